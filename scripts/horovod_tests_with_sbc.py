"""Run Horovod's own optimizer tests with ``compression=SBC(...)`` in every
``hvd.DistributedOptimizer`` they build (issue 61, item 4).

    python scripts/horovod_tests_with_sbc.py HOROVOD_CHECKOUT [--np 2] [--density 1.0]
        [--mode values] [-k EXPR] [--json FILE] [--control]

``HOROVOD_CHECKOUT`` is a clone of github.com/horovod/horovod (its ``test/parallel/
test_torch.py``; nothing of it is copied here). The tests that build a
``hvd.DistributedOptimizer`` are selected (``-k`` narrows them further); each runs as its own
``horovodrun -np N pytest`` job with a pytest plugin that wraps ``hvd.DistributedOptimizer`` so
that every optimizer it builds gets ``compression=horovod_sbc.torch.SBC(density, mode=mode)``
(the default, ``SBC(1.0, mode="values")``, is lossless). ``--control`` runs the same tests
without SBC (dense Horovod on this stack: what fails there is not SBC's). torch's ``Muon``
(2-D parameters only) is hidden from Horovod's loops over every optimizer unless
``--keep-muon``: they fail on it with dense Horovod too. Prints one line
per test (passed, failed or hang, with the last line of its failure) and writes them to
``--json``. Horovod's tests need ``pip install mock``.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
import os
import horovod.torch as hvd
import horovod.torch.optimizer as _hopt
import torch

if os.environ.get("HIDE_MUON") == "1" and hasattr(torch.optim, "Muon"):
    # torch >= 2.10's Muon takes 2-D parameters only; Horovod's tests step every torch.optim
    # class on biases too and fail on it, dense or not: their filter keeps torch.optim.* only
    torch.optim.Muon.__module__ = "hidden_from_horovods_tests"

_orig = _hopt.DistributedOptimizer


def _with_sbc(*args, **kwargs):
    from horovod_sbc.torch import SBC
    kwargs["compression"] = SBC(float(os.environ["SBC_DENSITY"]), mode=os.environ["SBC_MODE"])
    return _orig(*args, **kwargs)


if os.environ.get("SBC_INJECT") == "1":
    # Horovod compares an optimizer's __module__ with DistributedOptimizer's
    # (broadcast_optimizer_state runs the plain optimizer's step only for its own): keep it
    _with_sbc.__module__ = _orig.__module__
    hvd.DistributedOptimizer = _with_sbc
    _hopt.DistributedOptimizer = _with_sbc
'''


def optimizer_tests(path: Path):
    """The test methods of ``path`` whose body builds a ``hvd.DistributedOptimizer``."""
    src = path.read_text()
    out = []
    for cls in ast.parse(src).body:
        if isinstance(cls, ast.ClassDef):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test") and \
                        "DistributedOptimizer" in (ast.get_source_segment(src, fn) or ""):
                    out.append((cls.name, fn.name))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("horovod", type=Path, help="a checkout of horovod/horovod")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--density", type=float, default=1.0)
    p.add_argument("--mode", default="values")
    p.add_argument("-k", default=None)
    p.add_argument("--timeout", type=float, default=180)
    p.add_argument("--json")
    p.add_argument("--control", action="store_true", help="without SBC (dense Horovod)")
    p.add_argument("--keep-muon", action="store_true",
                   help="leave torch.optim.Muon in Horovod's loops over every optimizer")
    a = p.parse_args(argv)
    test_file = a.horovod / "test" / "parallel" / "test_torch.py"
    tests = optimizer_tests(test_file)
    if a.k:
        tests = [t for t in tests if a.k in t[1]]
    venv = ROOT / ".venv" / "bin"
    rows = []
    with tempfile.TemporaryDirectory() as d:
        Path(d, "sbc_into_horovod.py").write_text(PLUGIN)
        env = dict(os.environ, SBC_DENSITY=str(a.density), SBC_MODE=a.mode,
                   SBC_INJECT="0" if a.control else "1", HIDE_MUON="0" if a.keep_muon else "1",
                   PATH=f"{venv}{os.pathsep}{os.environ.get('PATH', '')}",
                   PYTHONPATH=os.pathsep.join([d, str(ROOT), str(test_file.parent),
                                               str(test_file.parents[1] / "utils")]),
                   OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
        for cls, name in tests:
            cmd = [str(venv / "horovodrun"), "-np", str(a.np), "-H", f"localhost:{a.np}",
                   str(venv / "python"), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                   "-p", "sbc_into_horovod", f"{test_file}::{cls}::{name}"]
            t0 = time.monotonic()
            try:
                r = subprocess.run(cmd, env=env, cwd=d, capture_output=True, text=True,
                                   timeout=a.timeout, start_new_session=True)
                out = r.stdout + r.stderr
                verdict = "passed" if r.returncode == 0 else "failed"
            except subprocess.TimeoutExpired as e:
                out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
                    else (e.stdout or "")
                verdict = "hang"
                subprocess.run(["pkill", "-9", "-f", f"{test_file}::{cls}::{name}"])
            why = ""
            if verdict != "passed":
                errs = [ln for ln in out.splitlines() if "Error" in ln or ln.startswith("E ")]
                why = errs[-1].strip()[:300] if errs else out.strip().splitlines()[-1:][0][:300] \
                    if out.strip() else ""
            rows.append({"test": name, "verdict": verdict, "why": why,
                         "seconds": round(time.monotonic() - t0, 1)})
            print(f"{name:<40} {verdict:<7} {why}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"horovod_test_file": str(test_file), "np": a.np, "density": a.density,
                       "mode": a.mode, "control": a.control, "muon_hidden": not a.keep_muon,
                       "tests": rows}, f, indent=1)
    print(f"{sum(r['verdict'] == 'passed' for r in rows)} of {len(rows)} passed")
    return 0 if all(r["verdict"] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
