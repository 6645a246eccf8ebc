"""Memory over a long run: ``python -m benchmarks.bench soak [--steps 5000] [--json FILE]``.

A 2-rank Horovod job per configuration — the drop-in (``DistributedOptimizer``, delay 1) and the
stock hook (``hvd.DistributedOptimizer(compression=SBC(...))``), each with variable-size and with
fixed-size messages, each with the C kernels on and off (the tensor-op backend CUDA tensors
take) — trains a small MLP on random data for ``--steps`` optimizer steps and samples each
rank's resident memory (``/proc/self/statm``) and, on a GPU, ``torch.cuda.memory_allocated``,
every ``--every`` steps. Growth is the last sample over the first sample after ``--warmup``
steps (what a leak per step would raise); a run is flat when every rank's growth is within
``--tolerance`` (5 %).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

CONFIGS = [(api, fixed, kernels) for api in ("dropin", "stock") for fixed in (False, True)
           for kernels in (True, False)]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(api: str, fixed: bool, steps: int, every: int, out: str) -> None:
    import torch
    import horovod.torch as hvd
    import horovod_sbc.torch as sbc
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dev = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else \
        torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(dev)
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    comp = sbc.SBC(density=0.01, fixed_size=fixed)
    if api == "dropin":
        opt = sbc.DistributedOptimizer(base, model.named_parameters(), compression=comp)
        sbc.broadcast_state(model, opt)
    else:
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=comp)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    xs = torch.randn(64, 32, 64, generator=g).to(dev)
    ys = torch.randint(0, 10, (64, 32), generator=g).to(dev)
    samples = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs[step % 64]), ys[step % 64])
        loss.backward()
        opt.step()
        if step % every == 0:
            cuda = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
            samples.append({"step": step, "rss": _rss_bytes(), "cuda": cuda})
    with open(os.path.join(out, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump({"samples": samples, "seconds": time.perf_counter() - t0,
                   "stats": comp.stats(), "backend": comp.state.backend(dev).name}, f)


def growth(samples, warmup: int, key: str):
    """(last sample / first sample at or after ``warmup``) - 1, or None without samples."""
    vals = [s[key] for s in samples if s["step"] >= warmup and s[key] is not None]
    return vals[-1] / vals[0] - 1.0 if len(vals) > 1 else None


def run(steps: int, every: int, warmup: int, tolerance: float, timeout: float):
    from horovod_sbc import launch
    rows = []
    for api, fixed, kernels in CONFIGS:
        out = tempfile.mkdtemp(prefix="sbc-soak-")
        cmd = launch.launcher_prefix(2) + [sys.executable, "-m", "benchmarks.bench_soak",
                                           "--worker", api, "--fixed", str(int(fixed)),
                                           "--steps", str(steps), "--every", str(every),
                                           "--out", out]
        env = launch.job_env({"HOROVOD_SBC_KERNELS": "1" if kernels else "0"})
        rc, text = launch.run(cmd, timeout, env)
        if rc != 0:
            raise RuntimeError(f"soak {api} fixed={fixed} kernels={kernels} failed:\n"
                               f"{text[-3000:]}")
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
        row = {"api": api, "fixed_size": fixed, "kernels": kernels, "steps": steps,
               "backend": ranks[0]["backend"],
               "seconds": max(r["seconds"] for r in ranks),
               "rss_start_mib": [r["samples"][0]["rss"] / 2**20 for r in ranks],
               "rss_growth": [growth(r["samples"], warmup, "rss") for r in ranks],
               "cuda_growth": [growth(r["samples"], warmup, "cuda") for r in ranks],
               "samples": [r["samples"] for r in ranks]}
        worst = max(abs(g) for g in row["rss_growth"] + row["cuda_growth"] if g is not None)
        row["flat"] = worst <= tolerance
        rows.append(row)
        print(f"{api:6} fixed={int(fixed)} kernels={'on ' if kernels else 'off'} "
              f"({row['backend']}): RSS growth "
              f"{', '.join(f'{100 * g:+.2f} %' for g in row['rss_growth'])} over steps "
              f"{warmup}..{steps} ({row['seconds']:.0f} s) {'flat' if row['flat'] else 'GROWS'}",
              flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--every", type=int, default=100, help="steps between memory samples")
    ap.add_argument("--warmup", type=int, default=500, help="steps before the first sample "
                    "growth is measured from (allocator caches, first-use buffers)")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", default="benchmarks/results/soak.json")
    ap.add_argument("--worker", choices=("dropin", "stock"), help=argparse.SUPPRESS)
    ap.add_argument("--fixed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, bool(a.fixed), a.steps, a.every, a.out)
        return 0
    rows = run(a.steps, a.every, a.warmup, a.tolerance, a.timeout)
    res = {"command": " ".join(["python -m benchmarks.bench soak"] +
                               list(sys.argv[1:] if argv is None else argv)),
           "tolerance": a.tolerance, "warmup": a.warmup, "runs": rows}
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.json}")
    return 0 if all(r["flat"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
