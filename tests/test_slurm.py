"""examples/slurm/sbc_job.sbatch run for real: a one-node SLURM cluster on localhost
(scripts/slurm_local.sh: slurmctld + slurmd + munged on a config in a temporary folder) runs the
batch script with 2 tasks launched by ``srun --mpi=pmix`` and by ``mpirun``; the SBC job must finish, its ranks
end bit-identical and its compression accounting must be printed and written.

Skipped only where SLURM is not installed (scripts/install.sh installs it) or not as root."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm_local.sh"
SBIN_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
NEEDED = ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "munged")

pytestmark = [
    pytest.mark.skipif(any(shutil.which(c, path=SBIN_PATH) is None for c in NEEDED),
                       reason="SLURM not installed (slurmctld, slurmd, slurm-client, munge: "
                              "scripts/install.sh installs them with apt-get)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="a local slurmd must run as root"),
]


def run_local_cluster(env_extra: dict, timeout: float = 420):
    """Run scripts/slurm_local.sh with its temporary folder under a fresh short folder (munged's
    socket path must fit a Unix socket name), where it must be gone afterwards; returns (exit
    status, output). A run past ``timeout`` gets SIGTERM first (the script's trap stops the
    daemons and removes its folder), SIGKILL only if that hangs."""
    tmp = Path(tempfile.mkdtemp(prefix="sbc-sl-"))
    env = dict(os.environ, TMPDIR=str(tmp), VENV=str(Path(sys.executable).parents[1]),
               PYTHONPATH=str(ROOT), SBC_SLURM_TIMEOUT=str(int(timeout - 60)), **env_extra)
    p = subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
        pytest.fail(f"slurm_local.sh did not finish within {timeout:.0f} s:\n{out[-6000:]}")
    leftovers = sorted(tmp.glob("sbc-slurm.*"))  # the job's ranks may leave caches beside it
    shutil.rmtree(tmp, ignore_errors=True)
    assert not leftovers, f"slurm_local.sh left {leftovers} behind\n{out[-3000:]}"
    return p.returncode, out


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_sbatch_example_runs_sbc_on_two_tasks(tmp_path, launcher):
    """srun: the tasks find each other through Slurm's PMIx plugin; mpirun: Open MPI reads the
    allocation (its hostfile is written from it) and starts the ranks itself."""
    res_file = tmp_path / "runs.json"
    args = f"--methods sbc --density 0.01 --delay 4 --epochs 3 --no-progress --json {res_file}"
    rc, out = run_local_cluster({"ARGS": args, "LAUNCHER": launcher})
    assert rc == 0, f"job failed (exit {rc}):\n{out[-6000:]}"
    assert "state COMPLETED, exit code 0:0" in out, out[-3000:]
    assert f"horovod_sbc: 2 ranks, 2 per node, launcher {launcher}" in out, out[-3000:]
    # the accounting the example prints on rank 0
    assert "ratio" in out and "ranks identical" in out, out[-3000:]
    sbc_lines = [ln.split() for ln in out.splitlines() if ln.startswith("sbc ")]
    assert sbc_lines and sbc_lines[-1][-1] == "True", out[-3000:]
    (run,) = json.loads(res_file.read_text())["runs"]
    assert run["method"] == "sbc" and run["workers"] == 2
    assert run["ranks_identical"] is True
    assert len(run["per_rank"]) == 2
    for st in run["per_rank"]:  # each rank sent and received SBC messages, far below dense
        assert 0 < st["upstream_bits"] < st["dense_bits"] / 20
        assert st["downstream_bits"] > 0 and st["syncs"] > 0
    assert run["compression_ratio"] > 20
    assert f"{run['compression_ratio']:.0f}x" in " ".join(sbc_lines[-1])


def test_failed_job_is_reported_and_cleaned_up():
    rc, out = run_local_cluster({"SCRIPT": "examples/no_such_script.py",
                                           "LAUNCHER": "srun", "ARGS": ""}, timeout=240)
    assert rc != 0, out[-3000:]
    assert "state FAILED" in out, out[-3000:]
    assert "no_such_script.py" in out, out[-3000:]  # python's error, from the job's output
