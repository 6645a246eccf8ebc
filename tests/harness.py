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
from horovod_sbc import launch  # noqa: E402

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
    ``controller``: ``"mpi"`` (Horovod's MPI controller, started by ``mpirun``: the command
    ``horovodrun --mpi`` runs, without the seconds of CPU ``horovodrun`` spends at every start
    importing TensorFlow and PyTorch in a subprocess to check its build), ``"horovodrun-mpi"``
    (the same through ``horovodrun``), ``"gloo"`` (``horovodrun --gloo``, whose rendezvous only
    ``horovodrun`` provides), or ``"torchrun"`` (``torch.distributed.run``: the worker
    initialises ``torch.distributed`` itself).
    """
    out = tempfile.mkdtemp(prefix="sbc-ranks-")
    script = str(WORKERS / worker)
    argv = [worker, *args] if raw else [script, out, *args]
    launcher = {"mpi": "mpirun", "gloo": "horovodrun-gloo"}.get(controller, controller)
    if launcher not in launch.LAUNCHERS:
        raise ValueError(f"controller must be mpi, gloo, horovodrun-mpi or torchrun, "
                         f"got {controller!r}")
    cmd = launch.launcher_prefix(np_, launcher) + ([] if launcher == "torchrun" else
                                                   [sys.executable]) + argv
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


def run_scenarios(worker: str, np_: int, scenarios: Sequence[Sequence[str]], **kw):
    """Run several scenarios of ``tests/workers/<worker>`` in ONE job (one process start-up):
    each scenario is the argument list the worker takes for a job of its own (``MODE
    key=value ...``); returns, per scenario, the results per rank (as :func:`run_ranks`)."""
    results, _ = run_ranks(worker, np_, ["--scenarios", json.dumps([list(s) for s in scenarios])],
                           **kw)
    return [[r["scenarios"][i] for r in results] for i in range(len(scenarios))]


class SharedJob:
    """A multi-rank job shared by the tests of one module: every scenario any of them needs
    runs in one job, started by the first test that asks and kept for the others. A failed job
    fails each test that uses it with the same error, without running it again.

        JOB = SharedJob("torch_sbc.py", 2, {"train-stock": ["train", "api=stock"], ...})
        def test_x():
            per_rank = JOB["train-stock"]
    """

    def __init__(self, worker: str, np_: int, scenarios: dict, after=(), **kw):
        """``after``: jobs that must have run first (e.g. the one that writes the checkpoints
        this one loads)."""
        self.worker, self.np_, self.scenarios, self.kw = worker, np_, dict(scenarios), kw
        self.after = tuple(after)
        self._results: Optional[dict] = None
        self._error: Optional[BaseException] = None

    def run(self) -> None:
        """Run the job now unless it has run (its dependencies first)."""
        for job in self.after:
            job.run()
        if self._results is None and self._error is None:
            keys = list(self.scenarios)
            try:
                out = run_scenarios(self.worker, self.np_, [self.scenarios[k] for k in keys],
                                    **self.kw)
                self._results = dict(zip(keys, out))
            except Exception as e:  # kept, and raised again for every test that asks
                self._error = e
        if self._error is not None:
            raise self._error

    def __getitem__(self, key) -> list:
        self.run()
        return self._results[key]


# the decoder memory probe: one valid ~1.5 MiB step message (2M positions at density 0.05)
# decoded in a fresh process, its peak resident memory beyond what it had just before (Linux
# /proc: clear_refs resets VmHWM). ``setup`` imports a framework and defines
# ``make(buf: bytes, layout, numel)``: a zero-argument callable that decodes ``buf`` (any
# allocation of the output it decodes into belongs in ``make``) and returns the decoded tensor
# as something ``numpy.asarray`` takes.
_DECODER_PROBE = """
import json
import numpy as np
from horovod_sbc import wire, reference
{setup}
rng = np.random.default_rng(5)
pos = np.cumsum(rng.geometric(0.05, size=2_000_000)) - 1
numel = int(pos[-1]) + 1
layout = [("w", (numel,))]
buf = wire.step_message_bytes(reference.encode_tensor_np(pos, numel, 0.5),
                              wire.layout_fingerprint(layout), 1)
small = [("s", (1000,))]
make(wire.step_message_bytes(reference.encode_tensor_np(np.arange(0, 1000, 7), 1000, 0.5),
                             wire.layout_fingerprint(small), 1), small, 1000)()  # warm-up
run = make(buf, layout, numel)


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024


with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak resident set size
before = status("VmRSS:")
out = run()
peak = status("VmHWM:")
ok = np.array_equal(np.flatnonzero(np.asarray(out)), pos)
print(json.dumps({{"bytes": len(buf), "extra": peak - before, "output": 4 * numel,
                  "ok": bool(ok)}}))
"""


def decoder_peak_memory(setup: str, timeout: float = 300) -> dict:
    """Run the decoder memory probe with ``setup`` (see above); returns ``{"bytes": message
    bytes, "extra": peak bytes beyond the resident set before decoding, "output": bytes of a
    float32 result, "ok": decoded positions correct}``."""
    import os
    import subprocess
    import textwrap
    code = _DECODER_PROBE.format(setup=textwrap.dedent(setup))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
