"""Benchmarks: ``python -m horovod_sbc.bench codec --json FILE``.

Every speed figure is a ratio measured side by side in the same run (this machine is shared and
noisy): our time divided by ``torch.add(a, b, out=c)`` on a tensor of the same size, each the
median of several repetitions.

codec
    bits_per_position_over_entropy  worst over p in {1e-4, 1e-3, 1e-2, 1e-1} of the position bits
                                    written (header excluded) / (N * H(p)), N = 10M, p*N uniformly
                                    random positions; target <= 1.02
    compress_over_add               whole compress step for 25M fp32 at density 1e-3 (add the
                                    residual, select, binarize, encode, update the residual) / add;
                                    target <= 5
    decode_over_add                 decode + scatter-add of 8 such messages into a zeroed dense
                                    tensor / add; target <= 3
    topk_over_add                   torch.topk at the same size and k / add, for reference
    numpy / tensorflow              the same figures for the numpy reference and the TF bridge
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from typing import Callable, Dict

import numpy as np

from . import core, wire


def _median_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def entropy_bits(p: float) -> float:
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def bench_position_coding(n: int = 10_000_000, seed: int = 0) -> Dict[str, object]:
    rng = np.random.default_rng(seed)
    rows = []
    for p in (1e-4, 1e-3, 1e-2, 1e-1):
        k = int(round(p * n))
        pos = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
        msg = wire.encode_tensor_np(pos, n, 1.0)
        hdr = wire.parse_tensor_header(msg, 0, n)
        bits = 8 * ((hdr.unary[1] - hdr.unary[0]) + (hdr.remainder[1] - hdr.remainder[0]))
        bound = n * entropy_bits(p)
        rows.append({"p": p, "positions": k, "rice_b": hdr.rice_b, "bits": bits,
                     "bits_per_position": bits / k, "entropy_bits_per_position": bound / k,
                     "over_entropy": bits / bound})
    return {"rows": rows, "worst": max(r["over_entropy"] for r in rows)}


def bench_torch(n: int, density: float, reps: int, n_msgs: int = 8) -> Dict[str, float]:
    import torch
    from .torch import codec, exchange
    torch.manual_seed(0)
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    t_add = _median_time(lambda: torch.add(a, b, out=c), reps)
    grad = torch.randn(n)
    residual = torch.zeros(n)
    k = core.keep_count(n, density)

    def compress_step():
        residual.add_(grad)
        _, pos, sent = codec.encode_update(residual, density)
        codec.subtract_sent_(residual, pos, sent)

    t_comp = _median_time(compress_step, reps)
    t_topk = _median_time(lambda: torch.topk(a.abs(), k, sorted=False), max(3, reps // 2))
    # 8 different ranks' messages, framed like a real allgather
    layout = [("w", (n,))]
    fp = wire.layout_fingerprint(layout)
    msgs = []
    for r in range(n_msgs):
        g = torch.randn(n, generator=torch.Generator().manual_seed(100 + r))
        m, _ = codec.compress_(g, density)
        msgs.append(exchange.frame([m], fp, g.device))
    gathered = torch.cat(msgs)
    dense = torch.empty(n)

    def decode():  # into an existing dense tensor (the reference weights / gradient buffer)
        exchange.decode_gathered(gathered, layout, n_msgs, [dense.zero_()], 1.0 / n_msgs)

    t_dec = _median_time(decode, reps)
    return {"add_s": t_add, "compress_s": t_comp, "decode_s": t_dec, "topk_s": t_topk,
            "compress_over_add": t_comp / t_add, "decode_over_add": t_dec / t_add,
            "topk_over_add": t_topk / t_add, "message_bytes": int(msgs[0].numel())}


def bench_numpy(n: int, density: float, reps: int, n_msgs: int = 8) -> Dict[str, float]:
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))
    t_add = _median_time(lambda: np.add(a, b, out=c), reps)
    grad = rng.standard_normal(n, dtype=np.float32)
    state = {"r": np.zeros(n, np.float32)}

    def compress_step():
        _, state["r"] = core.compress_np(grad, state["r"], density)

    t_comp = _median_time(compress_step, max(1, reps // 3), warmup=0)
    layout = [("w", (n,))]
    fp = wire.layout_fingerprint(layout)
    msgs = [wire.step_message_bytes(core.compress_np(
        np.random.default_rng(100 + r).standard_normal(n, dtype=np.float32), None, density)[0],
        fp, 1) for r in range(n_msgs)]
    gathered = b"".join(msgs)

    out = np.empty(n, np.float32)

    def decode():
        out.fill(0)
        for per in wire.decode_step_np(gathered, layout, n_msgs):
            pos, vals = per[0]
            out[pos] += vals
        return out

    t_dec = _median_time(decode, reps)
    return {"add_s": t_add, "compress_s": t_comp, "decode_s": t_dec,
            "compress_over_add": t_comp / t_add, "decode_over_add": t_dec / t_add}


def bench_tensorflow(n: int, density: float, reps: int) -> Dict[str, float]:
    import tensorflow as tf
    from .tensorflow import codec as tfcodec
    a = tf.random.normal([n], seed=1)
    b = tf.random.normal([n], seed=2)
    t_add = _median_time(lambda: tf.add(a, b).numpy(), reps)
    g = tf.random.normal([n], seed=3)
    r = tf.Variable(tf.zeros([n]))

    def compress_step():
        _, new_r = tfcodec.compress(g, r, density)
        r.assign(new_r)

    t_comp = _median_time(compress_step, max(1, reps // 3))
    return {"add_s": t_add, "compress_s": t_comp, "compress_over_add": t_comp / t_add,
            "note": "numpy bridge (tf.numpy_function); add includes .numpy() of the result"}


def run_codec(args) -> Dict[str, object]:
    import torch
    torch.set_num_threads(args.threads)
    res: Dict[str, object] = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": args.threads, "cpu": platform.processor() or platform.machine()},
        "n": args.n, "density": args.density}
    pc = bench_position_coding(args.n_positions)
    res["position_coding"] = pc["rows"]
    res["bits_per_position_over_entropy"] = pc["worst"]
    t = bench_torch(args.n, args.density, args.reps)
    res["torch"] = t
    for key in ("compress_over_add", "decode_over_add", "topk_over_add"):
        res[key] = t[key]
    if not args.skip_numpy:
        res["numpy"] = bench_numpy(args.n, args.density, args.reps)
    if not args.skip_tf:
        try:
            res["tensorflow"] = bench_tensorflow(args.n, args.density, args.reps)
        except ImportError as e:
            res["tensorflow"] = {"skipped": str(e)}
    return res


def print_codec(res: Dict[str, object]) -> None:
    print(f"\nGolomb-Rice position coding, N = {res['position_coding'][0]['bits'] and 0 or ''}"
          .rstrip(", N = "))
    print(f"{'p':>8} {'b':>3} {'bits/pos':>9} {'H(p)/p':>8} {'ratio':>7}")
    for r in res["position_coding"]:
        print(f"{r['p']:>8g} {r['rice_b']:>3} {r['bits_per_position']:>9.3f} "
              f"{r['entropy_bits_per_position']:>8.3f} {r['over_entropy']:>7.4f}")
    print(f"worst bits/entropy: {res['bits_per_position_over_entropy']:.4f} (target <= 1.02)\n")
    print(f"{res['n']:,} fp32 elements, density {res['density']:g}; time / torch.add(out=)")
    print(f"{'impl':<11}{'add ms':>8}{'compress':>10}{'decode x8':>11}{'topk':>8}")
    for impl in ("torch", "numpy", "tensorflow"):
        t = res.get(impl)
        if not t or "skipped" in t:
            continue
        print(f"{impl:<11}{1000 * t['add_s']:>8.2f}{t['compress_over_add']:>9.2f}x"
              + (f"{t['decode_over_add']:>10.2f}x" if "decode_over_add" in t else f"{'-':>11}")
              + (f"{t['topk_over_add']:>7.1f}x" if "topk_over_add" in t else f"{'-':>8}"))
    print("targets: torch compress <= 5x, decode <= 3x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m horovod_sbc.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("codec", help="codec speed and position-coding size")
    c.add_argument("--n", type=int, default=25_000_000)
    c.add_argument("--n-positions", type=int, default=10_000_000)
    c.add_argument("--density", type=float, default=1e-3)
    c.add_argument("--reps", type=int, default=9)
    c.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: the ratio is per core)")
    c.add_argument("--skip-numpy", action="store_true")
    c.add_argument("--skip-tf", action="store_true")
    c.add_argument("--json")
    a = sub.add_parser("all", help="every benchmark implemented so far (make bench)")
    a.add_argument("--json")
    args = ap.parse_args(argv)
    if args.cmd == "all":
        args = ap.parse_args(["codec"] + (["--json", args.json] if args.json else []))
    res = run_codec(args)
    print_codec(res)
    if args.json:
        import os
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"codec": res, "command": " ".join(["python -m horovod_sbc.bench"]
                                                          + (argv or sys.argv[1:]))}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
