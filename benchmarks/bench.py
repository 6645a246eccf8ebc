"""Benchmarks: ``python -m benchmarks.bench {codec,train,grid,net,all} --json FILE``.

train   every method (none, fp16, sbc, topk, fedavg, signsgd, terngrad, local) as a real 2-rank
        mpirun job on scikit-learn's digits, equal steps: accuracy, bits, step time
        (:mod:`benchmarks.bench_train`); ``--quick``: none, SBC headline, top-K
grid    SBC density {1, 0.1, 0.01, 0.001} x delay {1, 4, 16}: accuracy vs total compression
tasks   every method on tasks where communication matters (:mod:`benchmarks.tasks`: mnist1d
        1-D CNN, character LSTM on CPython's pydoc topics), 2/4 workers (8 for the server
        topology), IID and non-IID, several methods per mpirun job
        (:func:`benchmarks.bench_train.task_jobs`); ``--tasks mnist1d`` for one task
net     step time of dense/fp16/top-K/SBC on a 10.5M-parameter MLP with every rank in its own
        network namespace behind a ``tc``-shaped link, plus plain localhost
        (:mod:`benchmarks.bench_net`; needs root); ``--bandwidth 100mbit`` (repeatable)
all     codec + train + grid + tasks + net (10mbit, 100mbit, 1gbit): ``make bench``
downlink  allgather vs server topology (dense / top-k / SBC downlink) for 2, 4, 8 ranks:
        per-worker downlink bits per sync and accuracy (:mod:`benchmarks.bench_downlink`)
gpu-proxy  aten ops and host reads per sync step on the tensor-op path (C kernels off: what CUDA
        tensors run), ResNet-50 and GPT-2 small layouts, drop-in / stock hook / DDP hook, 2 and 8
        ranks, counted on the CPU (:mod:`benchmarks.bench_gpu_proxy`)
gpu     the GPU check: the device codec (tensor ops, fused) against the numpy reference
        (bytes, decoded values, 8 ranks, mutated messages, fp16/bf16, non-contiguous and
        channels-last tensors), host syncs and kernels per sync step, encode/decode ms, memory
        over many syncs; ``--device cuda|cpu``, ``--quick``; torch and numpy only, exits 1 on
        any disagreement (:mod:`benchmarks.bench_gpu`; on a GPU machine: scripts/gpu_check.sh)
fixed   fixed-size messages: padding per density on ResNet-50's shapes, and Horovod's
        negotiation time with varying vs constant allgather sizes under MPI and Gloo
        (:mod:`benchmarks.bench_fixed`)
tf-train  TF drop-in tape, Keras SBCCallback and stock tape vs torch on mnist1d (accuracy) or
        the transformer (``--task transformer``, perplexity), dense baselines of both, 4
        workers, 3 seeds: score, ratio, TF - torch gap
        (:mod:`benchmarks.bench_tf_train`)
scatter  topology="reduce_scatter" vs the allgather, N ranks simulated in one process:
        re-compression error and region skew on digits gradients, bytes and codec time per rank
        on a big layout for N = 4 ... 64 (:mod:`benchmarks.bench_scatter`)
JSON goes to ``--json FILE``, markdown tables to ``FILE`` with ``.md``, PNG plots to ``--plots``
(default: the JSON's directory).

codec: every speed figure is a ratio measured side by side in the same run (this machine is
shared and noisy): our time divided by ``torch.add(a, b, out=c)`` on a tensor of the same size,
each the median of several repetitions.

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
    densities                       list: every p in --densities x workload (flat25m, resnet18)
                                    with p, workload, compress_over_add, decode_over_add,
                                    topk_over_add, bits_per_position_over_entropy (one sync of
                                    the whole model; see benchmarks/bench_codec.py); the four
                                    headline keys above are the worst over these and the 1e-3 run
    peers                           DGC sampled threshold, torch.topk, PowerSGD rank 1/2/4 on
                                    the same tensors: encode/decode over add, bits per step,
                                    one-step relative error
    numpy                           the same figures for the numpy reference (p = --density)
    tensorflow                      the TF codec at every density, kernel ops and stock TF ops
                                    side by side (benchmarks/bench_tf_codec.py: rows of
                                    native_/stock_ compress_over_add and decode_over_add)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict

import numpy as np

from horovod_sbc import reference, wire


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
        msg = reference.encode_tensor_np(pos, n, 1.0)
        hdr = wire.parse_tensor_header(msg, 0, n)
        bits = 8 * ((hdr.unary[1] - hdr.unary[0]) + (hdr.remainder[1] - hdr.remainder[0]))
        bound = n * entropy_bits(p)
        rows.append({"p": p, "positions": k, "rice_b": hdr.rice_b, "bits": bits,
                     "bits_per_position": bits / k, "entropy_bits_per_position": bound / k,
                     "over_entropy": bits / bound})
    return {"rows": rows, "worst": max(r["over_entropy"] for r in rows)}


def bench_torch(n: int, density: float, reps: int, n_msgs: int = 8) -> Dict[str, float]:
    import torch
    from horovod_sbc.torch.backend import Targets, backend_for, frame
    torch.manual_seed(0)
    backend = backend_for("cpu")
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    t_add = _median_time(lambda: torch.add(a, b, out=c), reps)
    grad = torch.randn(n)
    residual = torch.zeros(n)
    k = reference.keep_count(n, density)

    def compress_step():
        residual.add_(grad)
        backend.encode_tensor(residual, density).commit()

    t_comp = _median_time(compress_step, reps)
    t_topk = _median_time(lambda: torch.topk(a.abs(), k, sorted=False), max(3, reps // 2))
    # 8 different ranks' messages, framed like a real allgather
    layout = [("w", (n,))]
    fp = wire.layout_fingerprint(layout)
    msgs = []
    for r in range(n_msgs):
        g = torch.randn(n, generator=torch.Generator().manual_seed(100 + r))
        m = backend.encode_tensor(g, density).message  # one rank's message of g
        msgs.append(frame.frame([m], fp, g.device))
    gathered = torch.cat(msgs)
    dense = torch.empty(n)

    def decode():  # into an existing dense tensor (the reference weights / gradient buffer)
        backend.decode(gathered, layout, n_msgs, Targets.replace([dense]), 1.0 / n_msgs)

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
        _, state["r"] = reference.compress_np(grad, state["r"], density)

    t_comp = _median_time(compress_step, max(1, reps // 3), warmup=0)
    layout = [("w", (n,))]
    fp = wire.layout_fingerprint(layout)
    msgs = [wire.step_message_bytes(reference.compress_np(
        np.random.default_rng(100 + r).standard_normal(n, dtype=np.float32), None, density)[0],
        fp, 1) for r in range(n_msgs)]
    gathered = b"".join(msgs)

    out = np.empty(n, np.float32)

    def decode():
        out.fill(0)
        for per in reference.decode_step_np(gathered, layout, n_msgs):
            pos, vals = per[0]
            out[pos] += vals
        return out

    t_dec = _median_time(decode, reps)
    return {"add_s": t_add, "compress_s": t_comp, "decode_s": t_dec,
            "compress_over_add": t_comp / t_add, "decode_over_add": t_dec / t_add}


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
    from . import bench_codec
    sweep = bench_codec.run(args.densities, bench_codec.WORKLOADS, args.reps, args.n)
    res["densities"] = sweep["densities"]
    res["peers"] = sweep["peers"]
    # the headline keys are the worst case over every density and workload
    for key in ("compress_over_add", "decode_over_add", "topk_over_add"):
        res[key] = max([t[key]] + [r[key] for r in sweep["densities"]])
    res["bits_per_position_over_entropy"] = max(
        [pc["worst"]] + [r["bits_per_position_over_entropy"] for r in sweep["densities"]])
    if not args.skip_numpy:
        res["numpy"] = bench_numpy(args.n, args.density, args.reps)
    if not args.skip_tf:  # the TF codec at every density (benchmarks/bench_tf_codec.py)
        try:
            from . import bench_tf_codec
            res["tensorflow"] = bench_tf_codec.run(args.n, args.densities, max(2, args.reps))
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
    for impl in ("torch", "numpy"):
        t = res.get(impl)
        if not t or "skipped" in t:
            continue
        print(f"{impl:<11}{1000 * t['add_s']:>8.2f}{t['compress_over_add']:>9.2f}x"
              + (f"{t['decode_over_add']:>10.2f}x" if "decode_over_add" in t else f"{'-':>11}")
              + (f"{t['topk_over_add']:>7.1f}x" if "topk_over_add" in t else f"{'-':>8}"))
    print("targets: torch compress <= 5x, decode <= 3x")
    if "densities" in res:
        from . import bench_codec
        bench_codec.print_table(res)
        print(f"worst over all densities and workloads: compress {res['compress_over_add']:.2f}x, "
              f"decode {res['decode_over_add']:.2f}x (targets <= 3x, <= 2x)")
    tf_res = res.get("tensorflow")
    if tf_res and "rows" in tf_res:
        from . import bench_tf_codec
        print()
        bench_tf_codec.print_table(tf_res)


def _machine() -> Dict[str, object]:
    import os
    info: Dict[str, object] = {"python": platform.python_version(),
                               "cpu": platform.processor() or platform.machine(),
                               "cores": os.cpu_count()}
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        import horovod
        info["horovod"] = horovod.__version__
    except ImportError:
        pass
    try:
        info["load_avg_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def _write_json(path: str, obj) -> None:
    import os
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)
    print(f"wrote {path}")


def _plot_dir(args):
    import os
    if getattr(args, "plots", None):
        d = args.plots
    elif getattr(args, "json", None):
        d = os.path.dirname(os.path.abspath(args.json))
    else:
        return None
    os.makedirs(d, exist_ok=True)
    return d


def _write_md(args, sections, command=None) -> None:
    """Markdown tables next to the JSON (``X.json`` -> ``X.md``), for docs/benchmarks.md."""
    if not getattr(args, "json", None):
        return
    import os
    path = os.path.splitext(args.json)[0] + ".md"
    with open(path, "w") as f:
        f.write(f"<!-- generated by: {command or _command()} -->\n")
        for title, body in sections:
            f.write(f"\n### {title}\n\n{body}\n")
    print(f"wrote {path}")


def _command() -> str:
    return " ".join(["python -m benchmarks.bench"] + _ARGV)


_ARGV: list = []


def _seeds(args):
    n = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    return list(range(n))


def _epochs(args):
    e = args.epochs or (QUICK_EPOCHS if args.quick else None)
    return {"epochs": e} if e else None


QUICK_EPOCHS = 10


def cmd_train(args, grid=None) -> Dict[str, object]:
    from . import bench_train as bt
    t0 = time.perf_counter()
    over = _epochs(args)
    res = bt.run_configs(bt.train_runs(args.quick), "train" + (" (quick)" if args.quick else ""),
                         _seeds(args), progress=not args.no_progress, overrides=over)
    res["wall_s"] = time.perf_counter() - t0
    res["summary"] = bt.summarize(res, grid)
    res["notes"] = [
        "upstream/downstream bits are per rank over the whole training, mean over ranks and "
        "seeds; none/fp16 count the allreduce message (32/16 bits x parameters x steps) both "
        "ways, which at 2 ranks equals a ring allreduce's real per-rank volume",
        "all runs: the same MLP, epochs, batch size, learning rate and per-rank data shards"]
    bt.print_table(res, "training benchmark (scikit-learn digits)")
    return res


def _grid_partitions(args):
    from . import bench_train as bt
    p = getattr(args, "partition", None) or ("iid" if args.quick else "both")
    return list(bt.PARTITIONS) if p == "both" else [p]


def cmd_grid(args, baseline=None, reuse=()) -> Dict[str, object]:
    """``baseline``: {partition: the "none" run} (e.g. from ``train``); run here if missing.
    ``reuse``: runs of ``train`` (same seeds and epochs) whose configurations are not rerun."""
    from . import bench_train as bt
    t0 = time.perf_counter()
    over = _epochs(args)
    seeds = _seeds(args)
    parts = _grid_partitions(args)
    baseline = dict(baseline or {})
    configs = [dict(method="none", density=1.0, delay=1, workers=2, partition=p)
               for p in parts if p not in baseline] + bt.grid_runs(args.quick, parts)
    res = bt.run_configs(configs, "SBC grid" + (" (quick)" if args.quick else ""), seeds,
                         progress=not args.no_progress, overrides=over, reuse=reuse)
    for r in res["runs"]:
        if r["method"] == "none":
            baseline[r["partition"]] = r
    res["runs"] = [r for r in res["runs"] if r["method"] != "none"]
    res["baseline"] = baseline
    res["wall_s"] = time.perf_counter() - t0
    res["notes"] = ["density 1 with binarization is still binarized: every element is kept, "
                    "the sign side with the larger mean is sent (its positions, ~1 bit per "
                    "element, and one mean per tensor); the other side waits in the residual",
                    "baseline: dense allreduce (none) on the same partition, seeds and epochs"]
    bt.print_table(res, "SBC grid: density x delay (dense: " + ", ".join(
        f"{p} {100 * b['final_accuracy']:.2f}%" for p, b in baseline.items()) + ")")
    return res


def cmd_tasks(args) -> Dict[str, object]:
    """The sweep on the tasks where communication matters (benchmarks/tasks.py). With
    ``--json`` every finished job is saved to ``FILE.partial`` at once; ``--resume`` reuses the
    jobs found there (same task, workers, partition, seeds and runs)."""
    import os
    from . import bench_train as bt
    t0 = time.perf_counter()
    seeds = _seeds(args)
    partial = args.json + ".partial" if args.json else None
    done: Dict[str, list] = {}
    for path in ([partial] if partial and (args.resume or args.saved_only) else []) + \
            list(args.merge or []):
        if os.path.exists(path):
            with open(path) as f:
                done.update(json.load(f))

    def save(key, out):
        if partial:
            done[key] = out
            _write_json(partial, done)
    res: Dict[str, object] = {"runs": [], "skipped": []}
    for task in args.tasks.split(","):
        jobs = bt.task_jobs(task, args.quick)
        if args.saved_only:  # assemble the results of the jobs that were run, run nothing
            missing = [j for j in jobs if bt.job_key(task, j, seeds) not in done]
            res.setdefault("not_run", []).extend(
                {"task": task, "workers": j["workers"], "partition": j["partition"],
                 "seeds": j.get("seeds", seeds), "runs": [bt.spec_label(x) for x in j["runs"]]}
                for j in missing)
            jobs = [j for j in jobs if j not in missing]
        r = bt.run_task_jobs(task, jobs, seeds,
                             progress=not args.no_progress, done=done, on_job=save,
                             title=f"{task}" + (" (quick)" if args.quick else ""))
        res["runs"] += r["runs"]
        res["skipped"] += r["skipped"]
    res["runs"] = bt.merge_seed_runs(res["runs"])
    res["summary"] = bt.summarize_tasks(res)
    res["wall_s"] = time.perf_counter() - t0
    res["notes"] = [
        "score: test accuracy of rank 0's model (mnist1d) or test perplexity per character "
        "(text), mean ± std over seeds; 'local': no communication, mean over ranks' models",
        "upstream/downstream bits per rank over the whole run, mean over ranks and seeds; "
        "none/fp16 count the allreduce message both ways",
        "drop-in runs end with optimizer.finish() (W_ref + the average of the residuals)"]
    print(bt.markdown_tasks(res))
    return res


def _dense_acc(grid) -> Dict[str, float]:
    base = (grid or {}).get("baseline") or {}
    if "final_accuracy" in base:  # a single run (older files)
        return {base.get("partition", "iid"): base["final_accuracy"]}
    return {p: b["final_accuracy"] for p, b in base.items() if b}


def cmd_net(args) -> Dict[str, object]:
    from . import bench_net as bn
    t0 = time.perf_counter()
    bws = []
    for b in args.bandwidth or (["100mbit"] if args.quick else bn.FULL_BANDWIDTHS):
        bws += [x for x in b.split(",") if x]
    res = bn.run_net(bws, quick=args.quick, loopback=not args.no_loopback,
                     unlimited=not args.no_unlimited, workers=args.workers,
                     progress=not args.no_progress)
    res["wall_s"] = time.perf_counter() - t0
    bn.print_net(res)
    return res


def _add_common(p, quick_help: str) -> None:
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--json", help="write the results to this file (and X.md with tables)")
    p.add_argument("--plots", help="directory for PNG plots (default: the JSON's directory)")
    p.add_argument("--no-progress", action="store_true")


def _add_train_opts(p) -> None:
    p.add_argument("--seeds", type=int, help="seeds per configuration (default 3, quick 1)")
    p.add_argument("--epochs", type=int, help="epochs per run (default 20)")


def _exit_on_signal(signum, frame):
    # SystemExit unwinds through run_job (which ends the running mpirun job and its ranks) and
    # the network testbed's try/finally (which deletes its namespaces)
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    global _ARGV
    _ARGV = list(sys.argv[1:] if argv is None else argv)
    own = {"downlink": "bench_downlink", "gpu-proxy": "bench_gpu_proxy", "gpu": "bench_gpu",
           "fixed": "bench_fixed", "soak": "bench_soak", "tf-train": "bench_tf_train",
           "scatter": "bench_scatter"}
    if _ARGV[:1] and _ARGV[0] in own:  # benchmarks with their own module and options
        import importlib
        return importlib.import_module(f"benchmarks.{own[_ARGV[0]]}").main(_ARGV[1:])
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _exit_on_signal)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("codec", help="codec speed and position-coding size")
    c.add_argument("--n", type=int, default=25_000_000)
    c.add_argument("--n-positions", type=int, default=10_000_000)
    c.add_argument("--density", type=float, default=1e-3)
    c.add_argument("--reps", type=int, default=9)
    c.add_argument("--densities", type=lambda v: [float(x) for x in v.split(",")],
                   default=[1e-4, 1e-3, 1e-2, 5e-2],
                   help="comma-separated densities of the sweep (both workloads)")
    c.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: the ratio is per core)")
    c.add_argument("--skip-numpy", action="store_true")
    c.add_argument("--skip-tf", action="store_true")
    c.add_argument("--json")
    t = sub.add_parser("train", help="every method as a 2-rank job on digits: accuracy, bits, "
                                     "step time")
    _add_common(t, "3 runs (none, SBC headline, top-K), 1 seed, 10 epochs: about a minute")
    _add_train_opts(t)
    g = sub.add_parser("grid", help="SBC density x delay grid: accuracy vs total compression")
    _add_common(g, "2 x 2 grid, IID only, 1 seed, 10 epochs")
    _add_train_opts(g)
    g.add_argument("--partition", choices=["iid", "by_class", "both"],
                   help="data partition(s) (default both; quick: iid)")
    n = sub.add_parser("net", help="step time across rate-limited links (network namespaces + tc)")
    _add_common(n, "2.1M-parameter model, 100mbit only, none vs SBC")
    n.add_argument("--bandwidth", action="append",
                   help="tc rate(s), e.g. 100mbit or 10mbit,100mbit,1gbit (repeatable); default "
                        "10mbit,100mbit,1gbit (quick: 100mbit)")
    n.add_argument("--workers", type=int, default=2)
    n.add_argument("--no-loopback", action="store_true", help="skip plain localhost mpirun")
    n.add_argument("--no-unlimited", action="store_true", help="skip the unshaped veth run")
    st = sub.add_parser("steptime", help="SBC step time / dense allreduce step time over "
                                          "loopback (10.5M-parameter MLP, 2 ranks)")
    st.add_argument("--json", help="write the results to this file")
    st.add_argument("--workers", type=int, default=2)
    st.add_argument("--rounds", type=int, default=8, help="turns of every method (default 8)")
    st.add_argument("--block", type=int, default=4, help="steps per method per turn (default 4)")
    st.add_argument("--sizes", help="MLP layer sizes, comma-separated (default the 10.5M MLP)")
    st.add_argument("--no-progress", action="store_true")
    a = sub.add_parser("all", help="every benchmark: codec, train, grid, net (make bench)")
    _add_common(a, "quick mode of every benchmark")
    _add_train_opts(a)
    a.add_argument("--bandwidth", action="append")
    a.add_argument("--workers", type=int, default=2)
    a.add_argument("--no-loopback", action="store_true")
    a.add_argument("--no-unlimited", action="store_true")
    a.add_argument("--resume", action="store_true",
                   help="tasks part: reuse the jobs saved in JSON.partial")
    k = sub.add_parser("tasks", help="every method on mnist1d and a text LM (benchmarks/tasks.py), "
                                     "2/4 (8) workers, IID and non-IID")
    _add_common(k, "mnist1d, 2 workers, IID, 5 methods, 1 seed")
    k.add_argument("--tasks", default="mnist1d,text", help="comma-separated task names")
    k.add_argument("--seeds", type=int, help="seeds of jobs without their own seed list "
                                             "(default 3, quick 1)")
    k.add_argument("--resume", action="store_true",
                   help="reuse the jobs already saved in JSON.partial")
    k.add_argument("--saved-only", action="store_true",
                   help="run nothing: assemble JSON/tables/plots from the saved jobs (JSON.partial "
                        "and --merge files); jobs not run are listed under 'not_run'")
    k.add_argument("--merge", action="append",
                   help="another .partial file whose saved jobs are reused (repeatable)")
    r = sub.add_parser("report", help="redraw the plots and tables of an existing results JSON")
    r.add_argument("json")
    r.add_argument("--plots", help="directory for PNG plots (default: the JSON's directory)")
    args = ap.parse_args(argv)

    if args.cmd == "report":
        return report(args)
    if args.cmd == "codec":
        res = run_codec(args)
        print_codec(res)
        if args.json:
            _write_json(args.json, {"codec": res, "command": _command()})
        return 0

    from . import bench_train as bt
    plots = _plot_dir(args)
    out: Dict[str, object] = {"command": _command(), "machine": _machine()}
    if args.cmd == "train":
        res = cmd_train(args)
        out.update(res)
        if plots:
            bt.plot_accuracy_vs_bits(res, None, f"{plots}/accuracy_vs_bits.png")
        md = [("Training benchmark", bt.markdown_train(res))]
    elif args.cmd == "grid":
        res = cmd_grid(args)
        out.update(res)
        if plots:
            bt.plot_grid(res, _dense_acc(res), f"{plots}/sbc_grid.png")
        md = [("SBC grid (accuracy · compression ratio)", bt.markdown_grid(res))]
    elif args.cmd == "tasks":
        res = cmd_tasks(args)
        out.update(res)
        if plots:  # tasks.json -> tasks_score_vs_bits.png, tasks_long.json -> tasks_long_...
            stem = os.path.splitext(os.path.basename(args.json or "tasks"))[0]
            bt.plot_tasks(res, f"{plots}/{stem}_score_vs_bits.png")
        md = [(f"Training tasks ({', '.join(args.tasks.split(','))})", bt.markdown_tasks(res))]
    elif args.cmd == "steptime":
        from . import bench_net as bn
        sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else None
        res = bn.run_steptime(workers=args.workers, sizes=sizes, rounds=args.rounds,
                              block=args.block, progress=not args.no_progress)
        bn.print_steptime(res)
        out.update(res)
        md = [("Step time ÷ dense allreduce step time", bn.markdown_steptime(res))]
    elif args.cmd == "net":
        from . import bench_net as bn
        res = cmd_net(args)
        out.update(res)
        if plots and res["runs"]:
            bn.plot_net(res, f"{plots}/step_time_vs_bandwidth.png")
        md = [("Step time vs bandwidth", bn.markdown_net(res))]
    else:  # all
        from . import bench_net as bn
        walls = {}
        t0 = time.perf_counter()
        codec_args = ap.parse_args(["codec"] + (["--reps", "3"] if args.quick else []))
        out["codec"] = run_codec(codec_args)
        print_codec(out["codec"])
        walls["codec"] = time.perf_counter() - t0
        out["train"] = cmd_train(args)
        walls["train"] = out["train"]["wall_s"]
        base = {r["partition"]: r for r in out["train"]["runs"]
                if r["method"] == "none" and r["workers"] == 2}
        out["grid"] = cmd_grid(args, baseline=base, reuse=out["train"]["runs"])
        walls["grid"] = out["grid"]["wall_s"]
        out["train"]["summary"] = bt.summarize(out["train"], out["grid"])
        targs = argparse.Namespace(**vars(args))
        targs.tasks, targs.saved_only, targs.merge = "mnist1d,text", False, None
        targs.resume = getattr(args, "resume", False)
        out["tasks"] = cmd_tasks(targs)
        walls["tasks"] = out["tasks"]["wall_s"]
        out["net"] = cmd_net(args)
        walls["net"] = out["net"]["wall_s"]
        walls["total"] = time.perf_counter() - t0
        out["wall_s"] = walls
        out["summary"] = dict(out["train"]["summary"], net=out["net"].get("crossover"))
        if plots:
            bt.plot_accuracy_vs_bits(out["train"], out["grid"], f"{plots}/accuracy_vs_bits.png")
            bt.plot_grid(out["grid"], _dense_acc(out["grid"]), f"{plots}/sbc_grid.png")
            if out["net"]["runs"]:
                bn.plot_net(out["net"], f"{plots}/step_time_vs_bandwidth.png")
            bt.plot_tasks(out["tasks"], f"{plots}/tasks_score_vs_bits.png")
        md = [("Training benchmark", bt.markdown_train(out["train"])),
              ("SBC grid (accuracy · compression ratio)", bt.markdown_grid(out["grid"])),
              ("Training tasks (mnist1d, text)", bt.markdown_tasks(out["tasks"])),
              ("Step time vs bandwidth", bn.markdown_net(out["net"]))]
        print("\nwall time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in walls.items()))
    if plots:
        print(f"plots in {plots}/")
    if args.json:
        _write_json(args.json, out)
        _write_md(args, md)
    return 0


def report(args) -> int:
    """Plots and markdown tables from a JSON written by train/grid/net/all (no new runs)."""
    from . import bench_net as bn
    from . import bench_train as bt
    with open(args.json) as f:
        res = json.load(f)
    plots = _plot_dir(args)
    is_tasks = bool(res.get("runs")) and "task" in res["runs"][0]
    tasks = res.get("tasks") or (res if is_tasks else None)
    train = res.get("train") or (res if res.get("runs") and "networks" not in res
                                 and "baseline" not in res and not is_tasks else None)
    grid = res.get("grid") or (res if "baseline" in res else None)
    net = res.get("net") or (res if "networks" in res else None)
    md = []
    if train:
        bt.plot_accuracy_vs_bits(train, grid, f"{plots}/accuracy_vs_bits.png")
        md.append(("Training benchmark", bt.markdown_train(train)))
    if grid:
        bt.plot_grid(grid, _dense_acc(grid), f"{plots}/sbc_grid.png")
        md.append(("SBC grid (accuracy · compression ratio)", bt.markdown_grid(grid)))
    if tasks:
        bt.plot_tasks(tasks, f"{plots}/tasks_score_vs_bits.png")
        md.append(("Training tasks (mnist1d, text)", bt.markdown_tasks(tasks)))
    if net and net.get("runs"):
        bn.plot_net(net, f"{plots}/step_time_vs_bandwidth.png")
        md.append(("Step time vs bandwidth", bn.markdown_net(net)))
    _write_md(argparse.Namespace(json=args.json), md,
              f"{res.get('command', '?')} (tables redrawn by: {_command()})")
    print(f"plots in {plots}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
