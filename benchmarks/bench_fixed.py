"""What fixed-size messages (``SBC(fixed_size=True)``) cost and save:
``python -m benchmarks.bench fixed [--densities ...] [--steps N] [--json FILE]``.

padding      per density, on ResNet-50's 161 parameter shapes with standard normal updates:
             the bytes of every tensor message as encoded (C kernels) against its capacity
             (:func:`horovod_sbc.reference.tensor_capacity`), for one step message of all
             tensors (drop-in) and one per tensor (stock hook, 24-byte header each).
negotiation  2 ranks under Horovod's MPI and Gloo controllers: a step of 161 asynchronous
             ``allgather``s named like the stock hook's, sized like ResNet-50's messages at
             p = 0.01, then their ``synchronize``; sizes either varying every step and rank
             (+-5 %, as variable-length messages do) or constant (fixed-size): milliseconds per
             step (median of the counted steps), and Horovod's response-cache hits.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

DENSITIES = (1e-4, 1e-3, 1e-2, 5e-2)


def padding(densities=DENSITIES, seed: int = 0):
    import torch
    from horovod_sbc import reference, wire
    from horovod_sbc.torch.backend import backend_for
    from benchmarks.bench_gpu_proxy import resnet50_layout, _numel
    shapes = resnet50_layout()
    g = torch.Generator().manual_seed(seed)
    rows = []
    for d in densities:
        content = 0
        for _, s in shapes:
            a = torch.randn(_numel(s), generator=g)
            msg = backend_for(a.device).encode_tensor(a, d, "sbc").message
            assert msg.numel() <= reference.tensor_capacity(a.numel(), d, "sbc"), (s, d)
            content += msg.numel()
        head = wire.STEP_HEADER_SIZE
        n = len(shapes)
        dropin = reference.step_capacity([_numel(s) for _, s in shapes], d)
        stock = sum(reference.step_capacity([_numel(s)], d) for _, s in shapes)
        rows.append({"density": d, "tensors": n, "content_bytes": content,
                     "capacity_bytes": dropin - head - 1, "padding_bytes_dropin":
                     dropin - head - content, "padding_bytes_stock": stock - n * head - content,
                     "padding_pct_dropin": 100.0 * (dropin - head - content) / (content + head),
                     "padding_pct_stock": 100.0 * (stock - n * head - content) / (
                         content + n * head),
                     "bits_per_position": 8.0 * content / sum(
                         reference.keep_count(_numel(s), d) for _, s in shapes)})
    return rows


def worker(mode: str, steps: int, warmup: int, out: str) -> None:
    """One rank of the negotiation job (run under horovodrun)."""
    import numpy as np
    import torch
    import horovod.torch as hvd
    from horovod_sbc import reference
    from benchmarks.bench_gpu_proxy import resnet50_layout, _numel
    hvd.init()
    rank = hvd.rank()
    caps = [reference.step_capacity([_numel(s)], 0.01, "sbc") for _, s in resnet50_layout()]
    rng = np.random.default_rng(1 + rank)
    times = []
    for step in range(warmup + steps):
        if mode == "varying":
            sizes = [max(1, int(c * rng.uniform(0.90, 1.0))) for c in caps]
        else:
            sizes = caps
        bufs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        hvd.barrier()
        t0 = time.perf_counter()
        handles = [hvd.allgather_async(b, name=f"sbc.t{i}") for i, b in enumerate(bufs)]
        for h in handles:
            hvd.synchronize(h)
        dt = time.perf_counter() - t0
        if step >= warmup:
            times.append(dt)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"mode": mode, "steps": steps, "ms_per_step": [1e3 * t for t in times]}, f)
    hvd.shutdown()


def negotiation(steps: int, warmup: int, tmp: str):
    from horovod_sbc import launch
    rows = []
    for controller in ("mpi", "gloo"):
        for mode in ("varying", "constant"):
            out = os.path.join(tmp, f"neg_{controller}_{mode}.json")
            cmd = launch.launcher_prefix(2, f"horovodrun-{controller}") + [
                launch.python_exe(), "-m", "benchmarks.bench_fixed", "--worker", mode,
                "--steps", str(steps), "--warmup", str(warmup), "--out", out]
            rc, text = launch.run(cmd, timeout=900)
            if rc != 0:
                raise RuntimeError(f"{controller}/{mode} failed ({rc}):\n{text[-3000:]}")
            with open(out) as f:
                ms = json.load(f)["ms_per_step"]
            rows.append({"controller": controller, "sizes": mode, "allgathers_per_step": 161,
                         "steps": steps, "ms_median": statistics.median(ms),
                         "ms_mean": statistics.fmean(ms), "ms_min": min(ms)})
            print(f"{controller:5} {mode:9} median {rows[-1]['ms_median']:.2f} ms/step "
                  f"(min {rows[-1]['ms_min']:.2f})", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench fixed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda f: (lambda v: [f(x) for x in v.split(",")])  # noqa: E731
    ap.add_argument("--densities", type=csv(float), default=list(DENSITIES))
    ap.add_argument("--steps", type=int, default=60, help="counted negotiation steps")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--skip-negotiation", action="store_true")
    ap.add_argument("--json", default="benchmarks/results/fixed_size.json")
    ap.add_argument("--worker", choices=("varying", "constant"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.out)
        return 0
    res = {"command": " ".join(["python -m benchmarks.bench fixed"] +
                               list(sys.argv[1:] if argv is None else argv))}
    res["padding"] = padding(args.densities)
    for r in res["padding"]:
        print(f"p={r['density']:g}: content {r['content_bytes']} B, capacity "
              f"{r['capacity_bytes']} B, padding {r['padding_bytes_dropin']} B = "
              f"{r['padding_pct_dropin']:.1f} % (drop-in) / {r['padding_pct_stock']:.1f} % "
              f"(stock hook)", flush=True)
    if not args.skip_negotiation:
        import tempfile
        res["negotiation"] = negotiation(args.steps, args.warmup,
                                         tempfile.mkdtemp(prefix="sbc-fixed-"))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
