"""Multi-rank test harness: run a worker script under ``horovodrun -np N`` (or ``torchrun
--nproc_per_node=N``) on localhost.

Each worker writes ``<outdir>/rank<R>.json``; :func:`run_ranks` returns those dicts in rank order.
The whole job runs under a timeout: a hang kills the process group and fails the test with the
workers' output, instead of blocking the suite.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
BIN = Path(sys.executable).parent


class RankJobError(AssertionError):
    def __init__(self, msg: str, output: str, returncode: Optional[int]):
        super().__init__(f"{msg}\n--- workers' output (tail) ---\n{output[-6000:]}")
        self.output, self.returncode = output, returncode


def horovodrun_cmd(np_: int, argv: Sequence[str], controller: str = "mpi") -> List[str]:
    cmd = [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}"]
    if controller == "gloo":
        cmd.append("--gloo")
    elif controller == "mpi":
        cmd.append("--mpi")
    return cmd + list(argv)


def torchrun_cmd(np_: int, argv: Sequence[str]) -> List[str]:
    """``python -m torch.distributed.run`` (torchrun) on localhost with a free rendezvous port."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={np_}", "--monitor_interval=0.5", *argv]


def run_ranks(worker: str, np_: int = 2, args: Sequence[str] = (), timeout: float = 120,
              controller: str = "mpi", expect_fail: bool = False, env: Optional[dict] = None,
              raw: bool = False):
    """Run ``tests/workers/<worker>`` on ``np_`` ranks; return (results per rank, output).

    ``raw``: ``worker`` is any script path, run with ``args`` only (no output directory).
    ``controller``: ``"mpi"`` or ``"gloo"`` (``horovodrun``), or ``"torchrun"``
    (``torch.distributed.run``: the worker initialises ``torch.distributed`` itself).
    """
    out = tempfile.mkdtemp(prefix="sbc-ranks-")
    script = str(WORKERS / worker)
    argv = [worker, *args] if raw else [script, out, *args]
    if controller == "torchrun":
        cmd = torchrun_cmd(np_, argv)
    else:
        cmd = horovodrun_cmd(np_, [sys.executable, *argv], controller)
    e = dict(os.environ)
    e.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
              "PYTHONUNBUFFERED": "1", "HOROVOD_LOG_LEVEL": e.get("HOROVOD_LOG_LEVEL", "warning")})
    e.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(ROOT), env=e, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise RankJobError(f"{worker} on {np_} ranks did not finish within {timeout:.0f} s "
                           "(hang?)", output, None)
    if expect_fail:
        if proc.returncode == 0:
            raise RankJobError(f"{worker} was expected to fail but exited 0", output, 0)
    elif proc.returncode != 0:
        raise RankJobError(f"{worker} on {np_} ranks exited {proc.returncode}", output,
                           proc.returncode)
    results = []
    for r in range(np_):
        f = Path(out) / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    return results, output
