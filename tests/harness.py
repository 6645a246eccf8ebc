"""Multi-rank test harness: run a worker script under ``horovodrun -np N`` (or ``torchrun
--nproc_per_node=N``) on localhost.

Each worker writes ``<outdir>/rank<R>.json``; :func:`run_ranks` returns those dicts in rank order.
The whole job runs under a timeout: a hang kills the process group and fails the test with the
workers' output, instead of blocking the suite.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import launch  # noqa: E402  (one launcher for tests and benchmarks)

WORKERS = Path(__file__).resolve().parent / "workers"
BIN = Path(sys.executable).parent


class RankJobError(AssertionError):
    def __init__(self, msg: str, output: str, returncode: Optional[int]):
        super().__init__(f"{msg}\n--- workers' output (tail) ---\n{output[-6000:]}")
        self.output, self.returncode = output, returncode


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
        cmd = launch.launcher_prefix(np_, "torchrun") + argv
    else:
        cmd = launch.launcher_prefix(np_, f"horovodrun-{controller}") + [sys.executable, *argv]
    e = launch.job_env(env)
    try:
        returncode, output = launch.run(cmd, timeout, e)
    except launch.JobTimeout as t:
        raise RankJobError(f"{worker} on {np_} ranks did not finish within {timeout:.0f} s "
                           "(hang?)", t.output, None) from None
    if expect_fail:
        if returncode == 0:
            raise RankJobError(f"{worker} was expected to fail but exited 0", output, 0)
    elif returncode != 0:
        raise RankJobError(f"{worker} on {np_} ranks exited {returncode}", output,
                           returncode)
    results = []
    for r in range(np_):
        f = Path(out) / f"rank{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    return results, output
