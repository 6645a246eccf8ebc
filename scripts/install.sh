#!/usr/bin/env bash
# One source of truth for setting up horovod_sbc on a fresh Debian machine (as root),
# used by `make install`, `make demo`, `make test`, CI (.ci/run) and the Dockerfile.
#
# What it does, each step skipped when already done (idempotent, fast on a re-run):
#   1. Debian packages: Open MPI (libopenmpi-dev, openmpi-bin) and iproute2 (network benchmarks);
#      SLURM (slurmctld, slurmd, slurm-client, munge) for the local-cluster test, if apt has it.
#   2. A virtual environment .venv in the repo with torch, TensorFlow (CPU), numpy, mpi4py, cmake<4.
#   3. Horovod 0.28.1 built with PyTorch + TensorFlow + MPI + Gloo. The wheel is cached under
#      ~/.cache/horovod_sbc/ keyed by the Horovod, torch and TF versions, so a second clean clone
#      installs it in seconds. The sdist needs three fixes on this stack (see patch_horovod_sdist).
#   4. horovod_sbc itself, editable, with its extras, and its C kernels (horovod_sbc.kernels).
#
# Environment knobs:
#   PYTHON               interpreter used to create .venv (default: python3)
#   TORCH_SPEC           torch requirement (default: torch==2.13.0; the CPU build lies on this disk)
#   TF_SPEC              TensorFlow requirement (default: tensorflow-cpu==2.21.0)
#   HOROVOD_GPU_OPERATIONS  e.g. NCCL for a CUDA image (passed through to the Horovod build)
#   SBC_CACHE            wheel cache directory (default: ~/.cache/horovod_sbc)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
HOROVOD_VERSION=0.28.1
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TF_SPEC="${TF_SPEC:-tensorflow-cpu==2.21.0}"
SBC_CACHE="${SBC_CACHE:-$HOME/.cache/horovod_sbc}"
STAMP="$VENV/.horovod_sbc_install_stamp"

log() { printf '[install] %s\n' "$*"; }

# ---- 1. Debian packages ------------------------------------------------------------------
need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/openmpi ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include ] \
  || dpkg -s libopenmpi-dev >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
command -v tc >/dev/null 2>&1 || need_apt+=(iproute2)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# ---- 1b. SLURM, for tests/test_slurm.py (a one-node cluster: scripts/slurm_local.sh) ----------
need_slurm=()
for c in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
  command -v "${c%%:*}" >/dev/null 2>&1 || need_slurm+=("${c#*:}")
done
if [ ${#need_slurm[@]} -gt 0 ]; then
  log "apt-get install ${need_slurm[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need_slurm[@]}" >/dev/null; } \
    || log "SLURM not installed: tests/test_slurm.py will be skipped"
fi

# ---- 2. virtual environment --------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=(pip_quiet "$PY" -m pip --disable-pip-version-check -q)
# pip warns about this machine's optional local package mirrors on every lookup; keep real errors
pip_quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# A stamp of everything that decides what gets installed: when it matches and the imports work,
# we are done (this is the fast path of a second `make test`).
want_stamp="$(cat "$ROOT/setup.py" "$ROOT/scripts/install.sh" | sha256sum | cut -c1-16) $TORCH_SPEC $TF_SPEC"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ] \
   && "$PY" -c "import horovod_sbc, horovod.torch, horovod.tensorflow" >/dev/null 2>&1; then
  log "up to date ($VENV)"
  exit 0
fi

log "installing base packages into .venv"
"${PIP[@]}" install --upgrade "pip<27" "setuptools<81" wheel
"${PIP[@]}" install "$TORCH_SPEC" "$TF_SPEC" numpy mpi4py "cmake<4" packaging psutil cloudpickle pyyaml

# ---- 3. Horovod ----------------------------------------------------------------------------
torch_v="$("$PY" -c 'import torch; print(torch.__version__)')"
tf_v="$("$PY" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)"
key="horovod-${HOROVOD_VERSION}_torch-${torch_v}_tf-${tf_v}_gpu-${HOROVOD_GPU_OPERATIONS:-none}"
key="${key//+/_}"
wheel_dir="$SBC_CACHE/$key"

horovod_ok() {
  "$PY" - <<'PYEOF' >/dev/null 2>&1
import horovod, horovod.torch as ht, horovod.tensorflow as htf
assert horovod.__version__ == "0.28.1"
assert ht.mpi_built() and ht.gloo_built() and htf.mpi_built() and htf.gloo_built()
PYEOF
}

patch_horovod_sdist() {
  # The three fixes recorded in shared/verified-facts.md; each is idempotent (a no-op when applied).
  local src="$1"
  # (1) cmake 4.x rejects the bundled gloo: handled by installing "cmake<4" above.
  # (2) torch >= 2.1 headers need C++17; Horovod 0.28.1 asks for C++14.
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  # (3) TF 2.21 headers lack highwayhash/arch_specific.h, needed only by the XLA-on-GPU ops.
  sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
}

if ! horovod_ok; then
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION (first time on this machine: ~5-10 minutes)"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    "${PIP[@]}" download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$tmp"
    tar -xzf "$tmp"/horovod-"$HOROVOD_VERSION".tar.gz -C "$tmp"
    patch_horovod_sdist "$tmp/horovod-$HOROVOD_VERSION"
    mkdir -p "$wheel_dir.partial"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS="${HOROVOD_CPU_OPERATIONS:-MPI}" \
    MAKEFLAGS="${MAKEFLAGS:--j2}" \
      "$PY" -m pip wheel --no-build-isolation --no-deps -w "$wheel_dir.partial" "$tmp/horovod-$HOROVOD_VERSION"
    rm -rf "$wheel_dir" && mv "$wheel_dir.partial" "$wheel_dir"
  else
    log "using cached Horovod wheel from $wheel_dir"
  fi
  "${PIP[@]}" install --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  horovod_ok || { log "Horovod installed but lacks torch/TF/MPI/Gloo support"; exit 1; }
fi

# ---- 4. horovod_sbc itself -------------------------------------------------------------------
log "installing horovod_sbc (editable) with extras"
"${PIP[@]}" install -e "$ROOT[torch,tensorflow,test,bench]"
# the C kernels of the CPU codec (compiled on first use otherwise; without a compiler the
# tensor-op codec runs instead)
"$PY" -m horovod_sbc.kernels >/dev/null || log "C kernels not built: the tensor-op codec will be used"
echo "$want_stamp" > "$STAMP"
log "done: $("$VENV/bin/horovodrun" --version 2>/dev/null | tail -1) in $VENV"
