"""DDP head-to-head: ``python -m benchmarks.bench_ddp [--quick] --json FILE``.

On mnist1d (generated locally by ``mnist1d.data.make_dataset(get_dataset_args())``, never
downloaded; 4000 training / 1000 test sequences of length 40, standardised per position), one
torchrun job of ``--np`` ranks (gloo over loopback, CPU) trains an MLP 40-256-256-10 (78k
parameters; SGD, momentum 0.9, IID shards, equal steps) with every method below, each from the
same initial weights per seed:

* ``none``      DDP without a hook (fp32 allreduce of every bucket, every step);
* ``fp16``      PyTorch's ``fp16_compress_hook``;
* ``powersgd``  PyTorch's ``powerSGD_hook``, ranks 1, 2, 4 with all of ``PowerSGDState``'s
                defaults (``start_powerSGD_iter=1000``, warm start, error feedback,
                ``min_compression_rate=2``), and the same ranks with ``start_powerSGD_iter`` at
                10 % of the steps (PyTorch's own tuning advice), since the default warm-up is
                longer than this whole run, and at 2 (the least PowerSGD allows with error
                feedback: what it compresses without a dense warm-up);
* ``sbc-hook``  :func:`horovod_sbc.torch.ddp.sbc_hook`, per parameter at p = 0.01 and 0.05, and
                per bucket at p = 0.01 (the granularity comparison); the optimizer's momentum
                acts on the average;
* ``sbc-avg``   :class:`horovod_sbc.torch.ddp.SBCModelAverager` with ``PostLocalSGDOptimizer``
                (no gradient exchange between averages), a few (p, n).

Figures per method (mean and standard deviation over ``--seeds`` seeds):

accuracy         test accuracy of rank 0's model at the end (the averager synchronises the
                 pending local steps first; ``ranks_identical`` checks all ranks agree)
upstream bits    what one rank puts into the collectives over the whole run, averaged over
                 ranks: for allreduce hooks the bits of every tensor handed to
                 ``dist.all_reduce`` (counted by wrapping it); for ``none`` 32 x parameters x
                 steps (DDP's reducer); for SBC the zero-padded step messages plus their 64-bit
                 lengths (``transport_upstream_bits``; the bare message bits are in
                 ``message_bits``). A ring allreduce actually sends 2(N-1)/N times its payload
                 and an allgather sends the payload to N-1 peers: see ``docs/ddp.md``.
ratio            none's upstream bits / the method's
step time        mean wall time of one training step (forward, backward, exchange, optimizer
                 step) over loopback, and that time / none's in the same job and seed
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------
# the task
# ----------------------------------------------------------------------------------------------
def make_mnist1d(path: str) -> None:
    """Generate mnist1d locally (its defaults; no download) and save it as ``path`` (.npz)."""
    from mnist1d.data import get_dataset_args, make_dataset
    d = make_dataset(get_dataset_args())
    np.savez(path, x=d["x"], y=d["y"], x_test=d["x_test"], y_test=d["y_test"])


def methods(quick: bool, steps: int) -> List[Dict]:
    warm = max(2, steps // 10)
    out = [{"family": "none", "label": "none"}, {"family": "fp16", "label": "fp16"}]
    for r in ((1,) if quick else (1, 2, 4)):
        out.append({"family": "powersgd", "label": f"powersgd r={r}", "rank": r,
                    "start": None})
        for start in ((warm,) if quick else (warm, 2)):
            out.append({"family": "powersgd", "label": f"powersgd r={r} start={start}",
                        "rank": r, "start": start})
    hooks = [(0.01, "parameter")] if quick else [(0.01, "parameter"), (0.05, "parameter"),
                                                 (0.01, "bucket")]
    for p, g in hooks:
        out.append({"family": "sbc-hook", "label": f"sbc-hook p={p}" + (" bucket" if
                    g == "bucket" else ""), "density": p, "granularity": g})
    for p, n in ([(0.01, 4)] if quick else [(0.01, 4), (0.05, 4), (0.01, 16)]):
        out.append({"family": "sbc-avg", "label": f"sbc-avg p={p} n={n}", "density": p,
                    "period": n})
    return out


# ----------------------------------------------------------------------------------------------
# the torchrun worker
# ----------------------------------------------------------------------------------------------
def worker(cfg_path: str) -> None:
    import hashlib

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (PowerSGDState,
                                                                             powerSGD_hook)
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from horovod_sbc.torch import SBC
    from horovod_sbc.torch.ddp import SBCModelAverager, SBCState, sbc_hook, shutdown

    cfg = json.load(open(cfg_path))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    d = np.load(cfg["data"])
    mu, sd = d["x"].mean(0), d["x"].std(0) + 1e-6
    x = torch.from_numpy(((d["x"] - mu) / sd).astype(np.float32))
    y = torch.from_numpy(d["y"].astype(np.int64))
    xt = torch.from_numpy(((d["x_test"] - mu) / sd).astype(np.float32))
    yt = torch.from_numpy(d["y_test"].astype(np.int64))
    xs, ys = x[rank::size], y[rank::size]
    bs, epochs = cfg["batch"], cfg["epochs"]

    reduced = [0]
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **k):  # the payload every allreduce hook hands over
        reduced[0] += 8 * tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *a, **k)
    dist.all_reduce = counting_all_reduce

    def mean_over_ranks(v: float) -> float:
        t = torch.tensor([float(v)], dtype=torch.float64)
        all_reduce(t)
        return float(t) / size

    def run(m: Dict, seed: int) -> Dict:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(40, 256), torch.nn.ReLU(),
                                  torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                  torch.nn.Linear(256, 10))
        numel = sum(p.numel() for p in net.parameters())
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
        fam, stats, averager = m["family"], None, None
        if fam == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif fam == "powersgd":
            kw = {} if m["start"] is None else {"start_powerSGD_iter": m["start"]}
            model.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=m["rank"],
                                                   **kw), powerSGD_hook)
        elif fam == "sbc-hook":
            state = SBCState(model, SBC(density=m["density"]), granularity=m["granularity"])
            model.register_comm_hook(state, sbc_hook)
            stats = state.stats
        elif fam == "sbc-avg":
            model.register_comm_hook(None, noop_hook)
            averager = SBCModelAverager(model, period=m["period"], density=m["density"])
            opt = PostLocalSGDOptimizer(opt, averager)
            stats = averager.stats
        g = torch.Generator().manual_seed(1000 * seed + rank)
        reduced[0] = 0
        steps, t_train = 0, 0.0
        for _ in range(epochs):
            perm = torch.randperm(len(xs), generator=g)
            for i in range(0, len(xs) - bs + 1, bs):
                b = perm[i:i + bs]
                t0 = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xs[b]), ys[b]).backward()
                opt.step()
                t_train += time.perf_counter() - t0
                steps += 1
        if averager is not None and averager.local_steps_pending:
            averager.synchronize()
        if fam == "none":
            bits, msg_bits = 32 * numel * steps, None
        elif stats is not None:
            st = stats()
            bits, msg_bits = st["transport_upstream_bits"], st["upstream_bits"]
        else:
            bits, msg_bits = reduced[0], None
        with torch.no_grad():
            acc = float((net(xt).argmax(1) == yt).float().mean())
        h = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters()))
        dig = torch.tensor(list(h.digest()), dtype=torch.uint8)
        digs = [torch.empty_like(dig) for _ in range(size)]
        dist.all_gather(digs, dig)
        res = dict(m, seed=seed, accuracy=acc, steps=steps, numel=numel,
                   upstream_bits=mean_over_ranks(bits),
                   message_bits=None if msg_bits is None else mean_over_ranks(msg_bits),
                   step_time_s=mean_over_ranks(t_train / steps),
                   ranks_identical=all(bool((o == dig).all()) for o in digs))
        if stats is not None:
            st = stats()
            res["measured_density"] = st["positions_sent"] / max(1, st["elements_synced"])
            res["syncs"] = st["syncs"]
        return res

    for seed in range(cfg["seeds"]):
        for m in cfg["methods"]:
            res = run(m, seed)
            if rank == 0:
                with open(cfg["out"], "a") as f:
                    f.write(json.dumps(res) + "\n")
                print(f"seed {seed} {m['label']:<28} acc {100 * res['accuracy']:.2f}%  "
                      f"bits {res['upstream_bits']:.3g}  {1000 * res['step_time_s']:.2f} ms/step",
                      flush=True)
    shutdown()


# ----------------------------------------------------------------------------------------------
# the parent: launch, aggregate, write
# ----------------------------------------------------------------------------------------------
def summarise(runs: List[Dict]) -> List[Dict]:
    """One row per method: mean/std accuracy over seeds, mean bits, ratio and step time vs
    ``none`` of the same seed."""
    base = {r["seed"]: r for r in runs if r["family"] == "none"}
    rows = []
    for label in dict.fromkeys(r["label"] for r in runs):
        rs = [r for r in runs if r["label"] == label]
        accs = [r["accuracy"] for r in rs]
        row = {k: rs[0][k] for k in ("family", "label", "density", "period", "granularity",
                                     "rank", "start") if k in rs[0]}
        row.update(
            seeds=len(rs), accuracy_mean=statistics.fmean(accs),
            accuracy_std=statistics.stdev(accs) if len(accs) > 1 else 0.0,
            upstream_bits=statistics.fmean(r["upstream_bits"] for r in rs),
            ratio=statistics.fmean(base[r["seed"]]["upstream_bits"] / r["upstream_bits"]
                                   for r in rs),
            step_time_ms=1000 * statistics.fmean(r["step_time_s"] for r in rs),
            step_time_vs_none=statistics.fmean(r["step_time_s"] / base[r["seed"]]["step_time_s"]
                                               for r in rs),
            ranks_identical=all(r["ranks_identical"] for r in rs))
        if rs[0].get("message_bits") is not None:
            row["message_bits"] = statistics.fmean(r["message_bits"] for r in rs)
        if "measured_density" in rs[0]:
            row["measured_density"] = statistics.fmean(r["measured_density"] for r in rs)
        rows.append(row)
    return rows


def best_within(rows: List[Dict], family_prefix: str, points: float = 1.0) -> Optional[Dict]:
    """The most compressed method of a family whose mean accuracy is within ``points``
    percentage points of ``none``'s."""
    dense = next(r for r in rows if r["family"] == "none")["accuracy_mean"]
    ok = [r for r in rows if r["family"].startswith(family_prefix)
          and r["accuracy_mean"] >= dense - points / 100]
    return max(ok, key=lambda r: r["ratio"]) if ok else None


def markdown(res: Dict) -> str:
    rows = res["summary"]
    lines = ["| method | accuracy % (mean ± sd) | upstream bits / rank | ratio vs none | "
             "step ms | step / none | ranks identical |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {100 * r['accuracy_mean']:.2f} ± "
                     f"{100 * r['accuracy_std']:.2f} | {r['upstream_bits']:.3g} | "
                     f"{r['ratio']:.0f}x | {r['step_time_ms']:.2f} | "
                     f"{r['step_time_vs_none']:.2f} | {r['ranks_identical']} |")
    lines.append("")
    dense = next(r for r in rows if r["family"] == "none")
    lines.append(f"Dense (no hook): {100 * dense['accuracy_mean']:.2f} %. Most compressed "
                 "method within 1 point of it:")
    lines.append("")
    for fam in ("powersgd", "sbc"):
        b = best_within(rows, fam)
        lines.append(f"- {fam}: " + (f"{b['label']}, {100 * b['accuracy_mean']:.2f} %, "
                                     f"{b['ratio']:.0f}x fewer upstream bits" if b else
                                     "none of its settings"))
    cfg = res["config"]
    lines.append("")
    lines.append(f"{res['np']} ranks, gloo over loopback, {cfg['epochs']} epochs of batch "
                 f"{cfg['batch']} per rank ({res['runs'][0]['steps']} steps), lr {cfg['lr']}, "
                 f"{cfg['seeds']} seed(s).")
    return "\n".join(lines) + "\n"


FAMILY_STYLE = {"none": ("k", "s"), "fp16": ("tab:gray", "D"), "powersgd": ("tab:blue", "o"),
                "sbc-hook": ("tab:red", "^"), "sbc-avg": ("tab:orange", "v")}


def plot(res: Dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    seen = set()
    for r in res["summary"]:
        color, marker = FAMILY_STYLE[r["family"]]
        ax.errorbar(r["upstream_bits"], 100 * r["accuracy_mean"], yerr=100 * r["accuracy_std"],
                    color=color, marker=marker, linestyle="none", capsize=3,
                    label=None if r["family"] in seen else r["family"])
        seen.add(r["family"])
        ax.annotate(r["label"].split(" ", 1)[-1] if " " in r["label"] else "",
                    (r["upstream_bits"], 100 * r["accuracy_mean"]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")
    dense = next(r for r in res["summary"] if r["family"] == "none")
    ax.axhline(100 * dense["accuracy_mean"] - 1, color="k", linestyle=":", linewidth=0.8,
               label="none - 1 point")
    ax.set_xscale("log")
    ax.set_xlabel("upstream bits per rank, whole run (log)")
    ax.set_ylabel("test accuracy %")
    ax.set_title(f"mnist1d MLP, {res['np']} ranks DDP (gloo): accuracy vs bits")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(np_: int = 2, quick: bool = False, seeds: Optional[int] = None,
              epochs: Optional[int] = None, batch: int = 64, lr: float = 0.1,
              timeout: float = 3000, only: Optional[List[str]] = None) -> Dict:
    seeds = seeds if seeds is not None else (1 if quick else 3)
    epochs = epochs if epochs is not None else (6 if quick else 30)
    tmp = tempfile.mkdtemp(prefix="sbc-bench-ddp-")
    data = os.path.join(tmp, "mnist1d.npz")
    make_mnist1d(data)
    steps = epochs * ((4000 // np_) // batch)
    todo = methods(quick, steps)
    if only:
        unknown = sorted(set(only) - {m["label"] for m in todo})
        if unknown:
            raise ValueError(f"bench_ddp: no method labelled {', '.join(unknown)}")
        todo = [m for m in todo if m["label"] in only]
    if not any(m["family"] == "none" for m in todo):
        raise ValueError("bench_ddp: 'none' is the reference of every ratio: keep it")
    cfg = {"data": data, "out": os.path.join(tmp, "runs.jsonl"), "seeds": seeds,
           "epochs": epochs, "batch": batch, "lr": lr, "methods": todo}
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    from horovod_sbc import launch
    cmd = launch.launcher_prefix(np_, "torchrun") + ["-m", "benchmarks.bench_ddp", "--worker",
                                                      cfg_path]
    t0 = time.time()
    try:  # the job's output goes to this terminal as it comes
        rc, _ = launch.run(cmd, timeout, launch.job_env({"PYTHONWARNINGS": "ignore"}),
                           on_line=lambda line: print(line, end="", flush=True))
    except launch.JobTimeout:
        raise RuntimeError(f"bench_ddp: the torchrun job did not finish within {timeout:.0f} s")
    if rc != 0:
        raise RuntimeError(f"bench_ddp: the torchrun job exited {rc}")
    with open(cfg["out"]) as f:
        runs = [json.loads(line) for line in f]
    from benchmarks.bench import _machine
    res = {"np": np_, "quick": quick, "config": {k: cfg[k] for k in
                                                  ("seeds", "epochs", "batch", "lr")},
           "runs": runs, "summary": summarise(runs), "wall_s": time.time() - t0,
           "machine": _machine(), "command": " ".join(["python -m benchmarks.bench_ddp"]
                                                      + sys.argv[1:])}
    for fam in ("powersgd", "sbc"):
        b = best_within(res["summary"], fam)
        res[f"best_{fam.replace('-', '_')}_within_1pt"] = b and {
            "label": b["label"], "accuracy": b["accuracy_mean"], "ratio": b["ratio"]}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true",
                    help="1 seed, 6 epochs, none/fp16/PowerSGD r=1/SBC hook p=0.01/"
                         "SBC averager p=0.01 n=4 (a few minutes)")
    ap.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--seeds", type=int)
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--only", type=lambda v: [m for m in v.split(",") if m],
                    help="comma-separated method labels to run (with 'none'), e.g. "
                         "'none,sbc-hook p=0.01,sbc-avg p=0.01 n=4'")
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "ddp.json"))
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    res = run_bench(args.np, args.quick, args.seeds, args.epochs, only=args.only)
    from benchmarks.bench import _write_json
    _write_json(args.json, res)
    md = os.path.splitext(args.json)[0] + ".md"
    with open(md, "w") as f:
        f.write(f"<!-- generated by: {res['command']} -->\n\n{markdown(res)}")
    png = os.path.splitext(args.json)[0] + "_accuracy_vs_bits.png"
    plot(res, png)
    print(markdown(res))
    print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
