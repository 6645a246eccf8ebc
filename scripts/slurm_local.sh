#!/usr/bin/env bash
# A one-node SLURM cluster on localhost, for running examples/slurm/sbc_job.sbatch for real.
#
#   bash scripts/slurm_local.sh [extra sbatch options]      (as root; needs slurmctld, slurmd,
#                                                            sbatch and munged: scripts/install.sh)
#
# Everything lives in one temporary folder: a fresh munge key and munged socket, a slurm.conf
# (free TCP ports on 127.0.0.1, state and spool directories), the daemons' logs and the job's
# output. munged, slurmctld and slurmd are started with that config, the example is submitted
# with 2 tasks on this node and waited for, the job's output is printed, and on exit, also on
# failure or Ctrl-C, the job is cancelled, the three daemons are stopped and the folder removed.
# Nothing under /etc is read or written. The exit status is the job's.
#
# The node has no GPUs: the job is submitted with --gpus-per-node=0 and GPUS_PER_TASK=0 (so the
# batch script's srun asks for none) and --cpus-per-task=1 on one node, overriding the script's
# #SBATCH lines; the ranks are started by the script's own `srun --mpi=pmix` (LAUNCHER=srun) or
# `mpirun` (LAUNCHER=mpirun), exactly as on a cluster.
#
# Environment knobs:
#   SBC_SLURM_NTASKS   ranks (default 2)
#   SBC_SLURM_TIMEOUT  seconds the job may take before it is cancelled (default 600)
#   SBC_SLURM_KEEP     set to 1 to keep the temporary folder (its path is printed)
#   SBC_SLURM_SCRIPT   batch script to submit (default examples/slurm/sbc_job.sbatch)
#   VENV, SCRIPT, ARGS, LAUNCHER  passed to the batch script (see its header)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NTASKS="${SBC_SLURM_NTASKS:-2}"
JOB_TIMEOUT="${SBC_SLURM_TIMEOUT:-600}"
export PATH="$PATH:/usr/sbin:/sbin"   # the daemons live in sbin
export GPUS_PER_TASK="${GPUS_PER_TASK:-0}"
log() { printf '[slurm_local] %s\n' "$*" >&2; }

for c in munged slurmctld slurmd sbatch scontrol scancel; do
  command -v "$c" >/dev/null 2>&1 || { log "missing $c (run scripts/install.sh)"; exit 3; }
done
[ "$(id -u)" = 0 ] || { log "must run as root (slurmd starts the job's tasks)"; exit 3; }

T="$(mktemp -d "${TMPDIR:-/tmp}/sbc-slurm.XXXXXX")"
chmod 711 "$T"   # munged wants its socket reachable
mkdir -p "$T/munge" "$T/state" "$T/spool" "$T/log"
PIDS=()
JOBID=""

# The daemons and the job's tasks (sbatch exports its environment to them) carry
# SBC_SLURM_CLUSTER=$T, which tells this cluster's processes from any other.
mine() {
  local p
  for p in /proc/[0-9]*; do
    grep -qzxF "SBC_SLURM_CLUSTER=$T" "$p/environ" 2>/dev/null && echo "${p#/proc/}"
  done
  return 0
}

stop_pids() {  # SIGTERM, up to 10 s, then SIGKILL
  local pid
  for pid in "$@"; do kill "$pid" 2>/dev/null || true; done
  for pid in "$@"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  done
}

job_state() {
  scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$JOBID" ]; then  # cancel, and let slurmd see the tasks end before it is stopped
    scancel "$JOBID" >/dev/null 2>&1 || true
    for _ in $(seq 30); do
      case "$(job_state "$JOBID")" in PENDING|RUNNING|CONFIGURING|COMPLETING) sleep 1 ;; *) break ;; esac
    done
  fi
  local i rev=()
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do rev+=("${PIDS[i]}"); done
  stop_pids "${rev[@]}"                      # slurmd, slurmctld, munged
  # shellcheck disable=SC2046
  stop_pids $(mine)                          # whatever of the job outlived them
  if [ "$rc" != 0 ]; then
    for f in "$T"/log/*.log; do
      [ -f "$f" ] && { log "--- tail of $(basename "$f") ---"; tail -n 20 "$f" >&2; }
    done
  fi
  if [ "${SBC_SLURM_KEEP:-0}" = 1 ]; then log "kept $T"; else rm -rf "$T"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# ---- munge: a key of its own and a socket in the temporary folder -------------------------------
dd if=/dev/urandom of="$T/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$T/munge/munge.key"
SOCK="$T/munge/munge.socket"
munged --foreground --force --socket="$SOCK" --key-file="$T/munge/munge.key" \
  --pid-file="$T/munge/munged.pid" --seed-file="$T/munge/munged.seed" \
  --log-file="$T/log/munged.log" >"$T/log/munged.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.2; done
[ -S "$SOCK" ] || { log "munged did not start"; exit 4; }

# ---- slurm.conf -------------------------------------------------------------------------------
HOST="$(hostname -s)"
CPUS="$(nproc)"
[ "$CPUS" -ge "$NTASKS" ] || CPUS="$NTASKS"
cat > "$T/slurm.conf" <<EOF
ClusterName=sbclocal
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCK
CredType=cred/munge
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=debug
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$T/slurm.conf"

# ---- daemons --------------------------------------------------------------------------------
SBC_SLURM_CLUSTER="$T" slurmctld -D -i -f "$SLURM_CONF" >"$T/log/slurmctld.out" 2>&1 &
PIDS+=($!)
SBC_SLURM_CLUSTER="$T" slurmd -D -f "$SLURM_CONF" -N "$HOST" >"$T/log/slurmd.out" 2>&1 &
PIDS+=($!)
ready=0
for _ in $(seq 150); do
  if scontrol show node "$HOST" 2>/dev/null | grep -q "State=IDLE"; then ready=1; break; fi
  sleep 0.2
done
[ "$ready" = 1 ] || { log "node $HOST did not come up"; scontrol show node "$HOST" >&2 || true; exit 4; }
log "cluster up in $T (node $HOST, $CPUS CPUs)"

# ---- the job ------------------------------------------------------------------------------------
OUT="$T/job.out"
JOBID="$(cd "$ROOT" && SBC_SLURM_CLUSTER="$T" sbatch --parsable --nodes=1 --ntasks="$NTASKS" --ntasks-per-node="$NTASKS" \
  --cpus-per-task=1 --gpus-per-node=0 --output="$OUT" --time=$(( (JOB_TIMEOUT + 59) / 60 )) "$@" \
  "${SBC_SLURM_SCRIPT:-examples/slurm/sbc_job.sbatch}")"
JOBID="${JOBID%%;*}"
log "submitted job $JOBID"
state=""
deadline=$(( $(date +%s) + JOB_TIMEOUT ))
while [ "$(date +%s)" -lt "$deadline" ]; do
  state="$(job_state "$JOBID")"
  case "$state" in PENDING|RUNNING|CONFIGURING|COMPLETING|"") sleep 1 ;; *) break ;; esac
done
exit_code="$(scontrol show job "$JOBID" 2>/dev/null | grep -o ' ExitCode=[0-9:]*' | head -1 | cut -d= -f2)"
[ -f "$OUT" ] && cat "$OUT"
echo "slurm job $JOBID: state ${state:-unknown}, exit code ${exit_code:-unknown}"
case "$state" in
  COMPLETED) JOBID=""; exit 0 ;;
  PENDING|RUNNING|CONFIGURING|COMPLETING) log "job did not end within $JOB_TIMEOUT s"; exit 124 ;;
  *) exit 1 ;;
esac
