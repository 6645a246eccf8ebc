"""Training benchmark: every method as a real multi-rank job on scikit-learn's digits.

``python -m benchmarks.bench train --json FILE`` (and ``grid``) launch, per configuration, one
``mpirun -np W`` job (``horovodrun`` when mpirun is missing) running :func:`worker_main` of this
module. Every job trains the same MLP (64-256-256-10, 85,002 parameters) for the same number of
epochs on the same per-rank shards, so all methods see the same samples.

What is counted (per rank, summed over the whole training, averaged over ranks and seeds):

upstream_bits     what this rank sent. SBC/top-K/FedAvg/signSGD/TernGrad: the real size of the
                  step messages it allgathered (headers included), from ``optimizer.stats()``.
                  "none"/"fp16" (stock ``hvd.DistributedOptimizer``): the size of the message
                  handed to Horovod's allreduce, 32 (fp16: 16) bits x parameters x steps.
downstream_bits   what this rank received. Allgather: the other ranks' messages. Allreduce: the
                  reduced result, the same size as the message (a parameter server's reply).
                  A ring allreduce moves 2(W-1)/W x the message each way per rank; for W = 2
                  that is exactly 1x, so both counts are the real wire volume at 2 ranks; the
                  factor is stored as ``allreduce_wire_factor``.
dense_bits        32 x parameters x steps: an uncompressed fp32 upload at every step.
compression_ratio dense_bits / upstream_bits.
step_time_s       mean wall time of one optimizer step (forward, backward, step incl. the
                  exchange), the first 5 steps of each seed left out.
final_accuracy    test accuracy (fraction) of rank 0's model after the last step, mean over
                  seeds; ``accuracy_seeds`` has each seed's value.

Method "local" (full mode only) is a reference with no communication at all: each rank trains on
its own half of the data; it shows how much of the accuracy the data set gives away for free.

Partitions: ``iid`` (rank r gets every W-th training sample) and ``by_class`` (non-IID, label
skew: rank r gets the digits d with d mod W == r, so no rank ever sees the other ranks' classes;
a rank alone cannot exceed ~50 % test accuracy, so the exchange has to carry the knowledge).
Digits is easy: with IID shards a single rank on half the data already reaches ~97-98 %, which
is why the non-IID partition is in the benchmark.
"""
from __future__ import annotations

import inspect
import json
import queue
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
PROGRESS_TAG = "@@progress "
RESULT_TAG = "@@result "

STOCK = ("none", "fp16")             # stock hvd.DistributedOptimizer
DROPIN = ("sbc", "topk", "fedavg", "signsgd", "terngrad")  # horovod_sbc.torch.DistributedOptimizer
OPTIONAL = {"signsgd": "SignSGD", "terngrad": "TernGrad"}   # may not exist in older versions
HEADLINE = {"method": "sbc", "density": 0.01, "delay": 4}

GRID_DENSITIES = (1.0, 0.1, 0.01, 0.001)
GRID_DELAYS = (1, 4, 16)


# ------------------------------------------------------------------------------------------------
# launching jobs (shared with bench_net)
# ------------------------------------------------------------------------------------------------
# the launcher, the job environment and the interpreter are shared with the tests
from horovod_sbc.launch import (ENV_NAMES, job_env, kill_job, launcher_prefix,  # noqa: E402,F401
                                python_exe)


def run_stats(comp, method: str, numel: int, steps: int) -> Dict[str, int]:
    """Traffic figures of one run: the compressor's own, or those of a dense Horovod method
    (fp32/fp16 allreduce every step), or none (no communication)."""
    if comp is not None:
        return dict(comp.stats())
    if method in STOCK:
        bits = 16 if method == "fp16" else 32
        return {"upstream_bits": bits * numel * steps, "downstream_bits": bits * numel * steps,
                "dense_bits": 32 * numel * steps, "syncs": steps, "steps": steps}
    return {"upstream_bits": 0, "downstream_bits": 0, "dense_bits": 32 * numel * steps,
            "syncs": 0, "steps": steps}


class JobError(RuntimeError):
    pass


def run_job(cmd: Sequence[str], env: Dict[str, str], timeout: float,
            on_progress: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """Run a job; return the ``@@result`` objects rank 0 printed. Output lines tagged
    ``@@progress`` go to ``on_progress``. On timeout the whole process group is killed."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(ROOT), env=env, start_new_session=True)
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    tail: List[str] = []
    results: List[dict] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(cmd, timeout)
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                break
            i = line.find(PROGRESS_TAG)
            j = line.find(RESULT_TAG)
            if i >= 0:
                if on_progress is not None:
                    try:
                        on_progress(json.loads(line[i + len(PROGRESS_TAG):]))
                    except ValueError:
                        pass
            elif j >= 0:
                results.append(json.loads(line[j + len(RESULT_TAG):]))
            else:
                tail.append(line)
                del tail[:-200]
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise JobError(f"job did not finish within {timeout:.0f} s: {shlex.join(cmd)}\n"
                       + "".join(tail[-40:])) from None
    except BaseException:
        _kill_group(proc)
        raise
    if rc != 0 or not results:
        raise JobError(f"job exited {rc} ({len(results)} results): {shlex.join(cmd)}\n"
                       + "".join(tail[-60:]))
    return results


def _kill_group(proc: subprocess.Popen) -> None:
    """End the job we started: SIGTERM to mpirun (it forwards it to the ranks), then SIGKILL to
    whatever of the job is left (launch.kill_job); then reap it."""
    try:
        proc.terminate()
        proc.wait(timeout=5)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    kill_job(proc.pid)  # the launcher, its session and its descendants
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


class Progress:
    """A tqdm bar per job on a terminal; one summary line per job otherwise (logs, tests)."""

    def __init__(self, total: int, title: str, enabled: bool = True):
        self.total, self.title, self.enabled = total, title, enabled
        self.i = 0
        self.bar = None
        self.tty = enabled and sys.stderr.isatty()
        if enabled:
            print(f"== {title}: {total} job(s)", flush=True)

    def start(self, label: str) -> None:
        self.i += 1
        self.label = label
        self.t0 = time.perf_counter()
        if self.tty:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=100, desc=f"[{self.i}/{self.total}] {label}",
                                bar_format="{desc} |{bar:30}| {percentage:3.0f}% {postfix}",
                                leave=False)
            except ImportError:
                self.bar = None

    def update(self, p: dict) -> None:
        if self.bar is not None and "frac" in p:
            self.bar.n = int(100 * p["frac"])
            self.bar.set_postfix_str(p.get("info", ""), refresh=True)
        elif self.enabled and not self.tty and p.get("log"):
            print(f"   {p['log']}", flush=True)

    def end(self, summary: str) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.enabled:
            print(f"[{self.i}/{self.total}] {self.label:<28} {summary}  "
                  f"({time.perf_counter() - self.t0:.1f} s)", flush=True)


# ------------------------------------------------------------------------------------------------
# the worker (runs on every rank)
# ------------------------------------------------------------------------------------------------
def load_digits_split(seed: int = 0):
    import torch
    from examples.common import digits_split
    return tuple(torch.from_numpy(a) for a in digits_split(seed))


PARTITIONS = ("iid", "by_class")


def shard(xtr, ytr, rank: int, size: int, partition: str):
    """This rank's training shard and the smallest shard length over all ranks."""
    if partition == "iid":
        return xtr[rank::size], ytr[rank::size], len(xtr) // size
    if partition == "by_class":
        sizes = [int((ytr % size == r).sum()) for r in range(size)]
        m = ytr % size == rank
        return xtr[m], ytr[m], min(sizes)
    raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")


def make_mlp(sizes: Sequence[int]):
    import torch
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def make_compressor(method: str, density: float, delay: int, seed: int = 0, **knobs):
    """The horovod_sbc.torch compressor of a drop-in method (kwargs filtered by its signature;
    ``knobs``: SBC's training knobs, passed on)."""
    import horovod_sbc.torch as sbc
    cls = {"sbc": "SBC", "topk": "TopK", "fedavg": "FedAvg"}.get(method) or OPTIONAL.get(method)
    if cls is None or not hasattr(sbc, cls):
        raise ValueError(f"method {method!r} is not available in horovod_sbc.torch")
    c = getattr(sbc, cls)
    want = {"density": density, "delay": delay, "seed": seed}
    params = inspect.signature(c).parameters
    return c(**{k: v for k, v in want.items() if k in params}, **knobs)


def method_available(method: str) -> bool:
    if method in STOCK or method in ("sbc", "topk", "fedavg", "local"):
        return True
    try:
        import horovod_sbc.torch as sbc
    except ImportError:
        return False
    return hasattr(sbc, OPTIONAL.get(method, "?"))


def _train_once(cfg: dict, seed: int, data, emit) -> dict:
    import hashlib

    import numpy as np
    import torch
    import horovod.torch as hvd
    import horovod_sbc.torch as sbc
    from examples.common import stock_horovod_optimizer

    xtr, ytr, xte, yte = data
    method = cfg["method"]
    torch.manual_seed(seed)
    model = make_mlp(cfg["sizes"])
    base = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    numel = sum(p.numel() for p in model.parameters())
    comp = None
    if method in STOCK:
        opt = stock_horovod_optimizer(base, model, hvd.Compression.fp16 if method == "fp16"
                                      else hvd.Compression.none)
    elif method == "local":
        opt = base
    else:
        comp = make_compressor(method, cfg["density"], cfg["delay"], seed)
        opt = sbc.DistributedOptimizer(base, model.named_parameters(), compression=comp)
        sbc.broadcast_state(model, opt, root_rank=0)
    rank, size = hvd.rank(), hvd.size()
    xs, ys, shard_len = shard(xtr, ytr, rank, size, cfg.get("partition", "iid"))
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    bs = cfg["batch_size"]
    steps_per_epoch = shard_len // bs  # the same on every rank (synchronous methods)
    total = steps_per_epoch * cfg["epochs"]
    times = []
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(cfg["epochs"]):
        perm = torch.randperm(len(xs), generator=g)
        for i in range(steps_per_epoch):
            b = perm[i * bs:(i + 1) * bs]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(model(xs[b]), ys[b])
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        emit({"epoch": epoch + 1, "loss": float(loss.item())})
    if hasattr(opt, "finish"):
        opt.finish()  # sync a partial delay window, average the residuals: ranks end equal
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    st = run_stats(comp, method, numel, total)
    skip = min(5, len(times) - 1)
    return {"accuracy": acc, "digest": digest, "stats": st, "params": numel,
            "step_time_mean": float(np.mean(times[skip:])),
            "step_time_median": float(np.median(times[skip:])), "steps": total,
            "samples_per_rank": total * bs}


def worker_main(argv: Sequence[str]) -> int:
    import numpy as np
    import torch
    import horovod.torch as hvd

    cfg = json.loads(argv[0])
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    data = load_digits_split(cfg.get("split_seed", 0))
    seeds = cfg["seeds"]
    per_seed = []
    for si, seed in enumerate(seeds):
        def emit(p, si=si):
            if rank == 0:
                done = (si + p["epoch"] / cfg["epochs"]) / len(seeds)
                print(PROGRESS_TAG + json.dumps(
                    {"frac": done, "info": f"seed {seed} epoch {p['epoch']} loss {p['loss']:.3f}",
                     "log": None}), flush=True)
        per_seed.append(_train_once(cfg, seed, data, emit))
    mine = [{"accuracy": r["accuracy"], "digest": r["digest"], "stats": r["stats"]}
            for r in per_seed]
    everyone = hvd.allgather_object(mine)
    if rank == 0:
        def mean_over(key):  # per seed: mean over ranks; then mean over seeds
            return float(np.mean([np.mean([everyone[r][s]["stats"][key]
                                           for r in range(len(everyone))])
                                  for s in range(len(seeds))]))
        accs = [r["accuracy"] for r in per_seed]
        out = {
            "final_accuracy": float(np.mean(accs)), "accuracy_seeds": accs,
            "accuracy_std": float(np.std(accs)),
            "accuracy_all_ranks": [[everyone[r][s]["accuracy"] for r in range(len(everyone))]
                                   for s in range(len(seeds))],
            "upstream_bits": mean_over("upstream_bits"),
            "downstream_bits": mean_over("downstream_bits"),
            "dense_bits": mean_over("dense_bits"), "syncs": mean_over("syncs"),
            "upstream_bits_per_rank": [everyone[r][0]["stats"]["upstream_bits"]
                                       for r in range(len(everyone))],
            "ranks_identical": all(len({everyone[r][s]["digest"] for r in range(len(everyone))})
                                   == 1 for s in range(len(seeds))),
            "step_time_s": float(np.mean([r["step_time_mean"] for r in per_seed])),
            "step_time_median_s": float(np.median([r["step_time_median"] for r in per_seed])),
            "steps": per_seed[0]["steps"], "samples_per_rank": per_seed[0]["samples_per_rank"],
            "params": per_seed[0]["params"], "workers": hvd.size(),
            "partition": cfg.get("partition", "iid"),
        }
        print(RESULT_TAG + json.dumps(out), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# orchestration
# ------------------------------------------------------------------------------------------------
DEFAULTS = {"sizes": [64, 256, 256, 10], "epochs": 20, "batch_size": 32, "lr": 0.05,
            "momentum": 0.9, "split_seed": 0, "partition": "iid"}


def train_runs(quick: bool) -> List[dict]:
    """The method list of ``train``: at equal steps and samples."""
    if quick:
        return [dict(method="none", density=1.0, delay=1, workers=2),
                dict(HEADLINE, workers=2),
                dict(method="topk", density=0.01, delay=4, workers=2)]
    runs = [dict(method="none", density=1.0, delay=1, workers=2),
            dict(method="fp16", density=1.0, delay=1, workers=2),
            dict(HEADLINE, workers=2),
            dict(method="sbc", density=0.01, delay=1, workers=2),
            dict(method="sbc", density=0.001, delay=4, workers=2),
            dict(method="topk", density=0.01, delay=4, workers=2),
            dict(method="topk", density=0.01, delay=1, workers=2),
            dict(method="fedavg", density=1.0, delay=4, workers=2),
            dict(method="signsgd", density=1.0, delay=1, workers=2),
            dict(method="terngrad", density=1.0, delay=1, workers=2),
            dict(method="local", density=1.0, delay=1, workers=2),
            dict(method="none", density=1.0, delay=1, workers=4),
            dict(HEADLINE, workers=4)]
    nid = dict(workers=2, partition="by_class")
    runs += [dict(nid, method="none", density=1.0, delay=1),
             dict(nid, **HEADLINE),
             dict(nid, method="sbc", density=0.01, delay=1),
             dict(nid, method="sbc", density=0.001, delay=4),
             dict(nid, method="topk", density=0.01, delay=4),
             dict(nid, method="fedavg", density=1.0, delay=4),
             dict(nid, method="signsgd", density=1.0, delay=1),
             dict(nid, method="local", density=1.0, delay=1)]
    return runs


def grid_runs(quick: bool, partitions: Sequence[str] = PARTITIONS) -> List[dict]:
    dens = (0.01, 0.001) if quick else GRID_DENSITIES
    dels = (1, 4) if quick else GRID_DELAYS
    return [dict(method="sbc", density=d, delay=n, workers=2, partition=p)
            for p in partitions for d in dens for n in dels]


def config_key(r: dict) -> tuple:
    return (r["method"], float(r.get("density", 1.0)), int(r.get("delay", 1)),
            int(r.get("workers", 2)), r.get("partition", "iid"))


def label(r: dict) -> str:
    m = r["method"]
    s = m
    if m in ("sbc", "topk"):
        s += f" p={r['density']:g}"
    if m in DROPIN and r.get("delay", 1) != 1 or m == "fedavg":
        s += f" n={r['delay']}"
    if r.get("workers", 2) != 2:
        s += f" W={r['workers']}"
    if r.get("partition", "iid") != "iid":
        s += " non-iid"
    return s


def run_configs(configs: List[dict], title: str, seeds: Sequence[int], timeout: float = 600,
                progress: bool = True, overrides: Optional[dict] = None,
                reuse: Sequence[dict] = ()) -> Dict[str, object]:
    """Launch one job per configuration; return ``{"runs": [...], "skipped": [...]}``.
    A configuration already measured in ``reuse`` (same method, density, delay, workers,
    partition; the caller guarantees same seeds and epochs) is taken from there."""
    done = {config_key(r): r for r in reuse}
    todo = [c for c in configs if config_key(c) not in done]
    prog = Progress(len(todo), title + (f" ({len(configs) - len(todo)} reused from train)"
                                        if len(todo) < len(configs) else ""), progress)
    runs, skipped = [], []
    for spec in configs:
        if config_key(spec) in done:
            runs.append(dict(done[config_key(spec)], reused=True))
            continue
        if not method_available(spec["method"]):
            skipped.append({"method": spec["method"],
                            "reason": f"horovod_sbc.torch has no {OPTIONAL[spec['method']]}"})
            prog.start(label(spec))
            prog.end("skipped (not available in horovod_sbc.torch)")
            continue
        cfg = dict(DEFAULTS, **(overrides or {}), **spec, seeds=list(seeds))
        if spec["method"] in STOCK or spec["method"] == "local":
            cfg["density"], cfg["delay"] = 1.0, 1
        cmd = launcher_prefix(spec["workers"], "mpirun", ENV_NAMES) + [
            python_exe(), "-m", "benchmarks.bench_train", "worker", json.dumps(cfg)]
        prog.start(label(spec))
        t0 = time.perf_counter()
        try:
            out = run_job(cmd, job_env(), timeout, prog.update)[0]
        except JobError as e:
            prog.end("FAILED")
            skipped.append({"method": spec["method"], "config": spec, "reason": str(e)[-2000:]})
            continue
        run = {"method": spec["method"], "label": label(spec), "density": cfg["density"],
               "delay": cfg["delay"], "workers": spec["workers"], "partition": cfg["partition"]}
        run.update(out)
        if spec["method"] in STOCK:
            run["bits_accounting"] = ("allreduce message: %d bits x parameters x steps, up and down"
                                      % (16 if spec["method"] == "fp16" else 32))
            w = spec["workers"]
            run["allreduce_wire_factor"] = 2 * (w - 1) / w
        elif spec["method"] == "local":
            run["bits_accounting"] = "no communication"
        else:
            run["bits_accounting"] = "measured message sizes (optimizer.stats())"
        up = run["upstream_bits"]
        run["compression_ratio"] = run["dense_bits"] / up if up > 0 else None
        if spec["method"] == "sbc" and spec["density"] == 1.0:
            run["note"] = ("density 1 with binarization: every element is kept, the sign side with "
                           "the larger mean is sent as positions (~1 bit/element) + one mean")
        run["seeds"] = list(seeds)
        run["epochs"] = cfg["epochs"]
        run["wall_s"] = time.perf_counter() - t0
        run["command"] = shlex.join(cmd)
        runs.append(run)
        prog.end(f"acc {100 * run['final_accuracy']:6.2f}%  ratio {_ratio_str(run):>8}  "
                 f"step {1000 * run['step_time_s']:.2f} ms")
    return {"runs": runs, "skipped": skipped}


def _ratio_str(r: dict) -> str:
    v = r.get("compression_ratio")
    return "-" if v is None else f"{v:,.0f}x" if v >= 10 else f"{v:.2f}x"


def _bits_str(b: float) -> str:
    for unit, f in (("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if b >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} bit"


def print_table(res: Dict[str, object], title: str) -> None:
    runs = res["runs"]
    print(f"\n{title}")
    hdr = (f"{'method':<28}{'W':>2}{'accuracy':>16}{'upstream':>13}{'downstream':>13}"
           f"{'ratio':>10}{'step ms':>9}  same")
    print(hdr)
    print("-" * len(hdr))
    for r in runs:
        acc = f"{100 * r['final_accuracy']:.2f}"
        if len(r.get("accuracy_seeds", [])) > 1:
            acc += f"±{100 * r['accuracy_std']:.2f}"
        print(f"{r['label']:<28}{r['workers']:>2}{acc + '%':>16}{_bits_str(r['upstream_bits']):>13}"
              f"{_bits_str(r['downstream_bits']):>13}{_ratio_str(r):>10}"
              f"{1000 * r['step_time_s']:>9.2f}  {'yes' if r.get('ranks_identical') else '-'}")
    for s in res.get("skipped", []):
        print(f"skipped {s['method']}: {s['reason'].splitlines()[0]}")
    if runs:
        r0 = runs[0]
        print(f"({r0['steps']} steps x {r0['samples_per_rank'] // max(1, r0['steps'])} samples per "
              f"rank; ratio = dense_bits / upstream_bits; accuracy mean±std over seeds "
              f"{r0.get('seeds')}; same = all ranks bit-identical at the end)")


def summarize(train: Optional[dict], grid: Optional[dict]) -> Dict[str, object]:
    """Key figures: headline SBC vs dense and vs top-K at equal steps."""
    out: Dict[str, object] = {}
    runs = (train or {}).get("runs", [])

    def find(method, density=None, delay=None, workers=2, partition="iid"):
        for r in runs:
            if r["method"] == method and r["workers"] == workers and \
                    r.get("partition", "iid") == partition and \
                    (density is None or r["density"] == density) and \
                    (delay is None or r["delay"] == delay):
                return r
        return None
    for part in PARTITIONS:
        key = "headline" if part == "iid" else f"headline_{part}"
        dense = find("none", partition=part)
        head = find("sbc", HEADLINE["density"], HEADLINE["delay"], partition=part)
        topk = find("topk", HEADLINE["density"], HEADLINE["delay"], partition=part)
        local = find("local", partition=part)
        if head:
            h = {k: head[k] for k in ("method", "density", "delay", "final_accuracy",
                                      "compression_ratio", "upstream_bits")}
            h["partition"] = part
            if dense:
                h["dense_accuracy"] = dense["final_accuracy"]
                h["accuracy_minus_dense"] = head["final_accuracy"] - dense["final_accuracy"]
                h["step_time_over_dense"] = head["step_time_s"] / dense["step_time_s"]
            if topk:
                h["topk_accuracy"] = topk["final_accuracy"]
                h["topk_ratio"] = topk["compression_ratio"]
                h["ratio_over_topk"] = head["compression_ratio"] / topk["compression_ratio"]
            if local:
                h["local_only_accuracy"] = local["final_accuracy"]
            out[key] = h
        base = (grid or {}).get("baseline", {}).get(part) if grid else None
        base = base or dense
        if grid and base:
            acc = base["final_accuracy"]
            cells = [g for g in grid["runs"] if g.get("partition", "iid") == part]
            ok = [g for g in cells if g["final_accuracy"] >= acc - 0.01]
            best = max(ok, key=lambda g: g["compression_ratio"] or 0, default=None)
            out[f"grid_{part}"] = {
                "dense_accuracy": acc,
                "best_within_1pct": None if best is None else {
                    k: best[k] for k in ("density", "delay", "final_accuracy",
                                         "compression_ratio")},
                "over_1000x_within_1pct": [
                    {k: g[k] for k in ("density", "delay", "final_accuracy", "compression_ratio")}
                    for g in ok if (g["compression_ratio"] or 0) >= 1000],
                "below_1pct": [
                    {k: g[k] for k in ("density", "delay", "final_accuracy", "compression_ratio")}
                    for g in cells if g["final_accuracy"] < acc - 0.01]}
    return out


def _parts(*results) -> List[str]:
    seen = {r.get("partition", "iid") for res in results if res for r in res.get("runs", [])}
    return [p for p in PARTITIONS if p in seen]


PART_TITLE = {"iid": "IID shards", "by_class": "non-IID shards (rank r: digits d mod W = r)"}


def plot_accuracy_vs_bits(train: Optional[dict], grid: Optional[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = _parts(train, grid) or ["iid"]
    fig, axes = plt.subplots(1, len(parts), figsize=(7.5 * len(parts), 5.5), squeeze=False)
    markers = {"none": "s", "fp16": "D", "sbc": "o", "topk": "^", "fedavg": "v",
               "signsgd": "P", "terngrad": "X"}
    colors: Dict[str, str] = {}  # the same method + setting has the same colour in every panel
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, part in zip(axes[0], parts):
        if grid:
            g = [r for r in grid["runs"] if r["upstream_bits"] > 0
                 and r.get("partition", "iid") == part]
            ax.scatter([r["upstream_bits"] for r in g], [100 * r["final_accuracy"] for r in g],
                       s=18, c="lightgray", edgecolors="gray", zorder=1, label="sbc grid")
            for r in g:
                ax.annotate(f"{r['density']:g}/{r['delay']}",
                            (r["upstream_bits"], 100 * r["final_accuracy"]), fontsize=6,
                            color="gray", xytext=(3, -8), textcoords="offset points")
        for r in (train or {}).get("runs", []):
            if r.get("partition", "iid") != part:
                continue
            if r["method"] == "local":
                ax.axhline(100 * r["final_accuracy"], ls=":", c="k", lw=1,
                           label="local only (no communication)")
                continue
            if r["upstream_bits"] <= 0 or r["workers"] != 2:
                continue
            lab = r["label"].replace(" non-iid", "")
            col = colors.setdefault(lab, cycle[len(colors) % len(cycle)])
            ax.scatter(r["upstream_bits"], 100 * r["final_accuracy"], s=50, zorder=3, color=col,
                       marker=markers.get(r["method"], "o"), label=lab)
        ax.set_xscale("log")
        ax.set_xlabel("upstream bits per rank, whole training (log)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{PART_TITLE.get(part, part)}\n(grid labels: density/delay)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("digits MLP, 2 ranks, equal steps: accuracy vs upstream traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_grid(grid: dict, dense_acc, path: str) -> None:
    """``dense_acc``: {partition: accuracy} (or one float for IID)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not isinstance(dense_acc, dict):
        dense_acc = {"iid": dense_acc}
    parts = _parts(grid) or ["iid"]
    fig, axes = plt.subplots(1, len(parts), figsize=(7.5 * len(parts), 5.5), squeeze=False)
    for ax, part in zip(axes[0], parts):
        runs = [r for r in grid["runs"] if r.get("partition", "iid") == part]
        for n in sorted({r["delay"] for r in runs}):
            rs = sorted([r for r in runs if r["delay"] == n],
                        key=lambda r: r["compression_ratio"] or 0)
            ax.plot([r["compression_ratio"] for r in rs], [100 * r["final_accuracy"] for r in rs],
                    "o-", label=f"delay {n}")
            for r in rs:
                ax.annotate(f"p={r['density']:g}",
                            (r["compression_ratio"], 100 * r["final_accuracy"]),
                            fontsize=7, xytext=(4, 4), textcoords="offset points")
        acc = dense_acc.get(part)
        if acc is not None:
            ax.axhline(100 * acc, ls="--", c="k", lw=1, label="dense (none)")
            ax.axhline(100 * acc - 1, ls=":", c="k", lw=1, label="dense - 1 point")
        ax.axvline(1000, ls="-.", c="r", lw=0.8, label="x1000")
        ax.set_xscale("log")
        ax.set_xlabel("total upstream compression dense_bits / upstream_bits (log)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(PART_TITLE.get(part, part), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SBC grid: density p x delay n (digits MLP, 2 ranks, equal steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_train(res: dict) -> str:
    lines = ["| method | workers | accuracy (mean ± std) | upstream bits / rank | "
             "downstream bits / rank | ratio | step ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["runs"]:
        acc = f"{100 * r['final_accuracy']:.2f}"
        if len(r.get("accuracy_seeds", [])) > 1:
            acc += f" ± {100 * r['accuracy_std']:.2f}"
        lines.append(f"| {r['label']} | {r['workers']} | {acc} % | {_bits_str(r['upstream_bits'])} "
                     f"| {_bits_str(r['downstream_bits'])} | {_ratio_str(r)} | "
                     f"{1000 * r['step_time_s']:.2f} |")
    for s in res.get("skipped", []):
        lines.append(f"\nskipped {s['method']}: {s['reason'].splitlines()[0]}")
    return "\n".join(lines)


def markdown_grid(grid: dict) -> str:
    out = []
    base = grid.get("baseline") or {}
    for part in _parts(grid):
        runs = [r for r in grid["runs"] if r.get("partition", "iid") == part]
        dens = sorted({r["density"] for r in runs}, reverse=True)
        dels = sorted({r["delay"] for r in runs})
        cell = {(r["density"], r["delay"]): r for r in runs}
        b = base.get(part) if isinstance(base, dict) and "runs" not in base else None
        head = f"**{PART_TITLE.get(part, part)}**"
        if b:
            head += f" — dense (none): {100 * b['final_accuracy']:.2f} %"
        lines = [head, "", "| density \\ delay | " + " | ".join(f"n = {n}" for n in dels)
                 + " |", "|---|" + "---:|" * len(dels)]
        for d in dens:
            row = []
            for n in dels:
                r = cell.get((d, n))
                row.append("-" if r is None else
                           f"{100 * r['final_accuracy']:.1f} % · ×{r['compression_ratio']:,.0f}")
            lines.append(f"| p = {d:g} | " + " | ".join(row) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


# ------------------------------------------------------------------------------------------------
# task benchmarks (benchmarks/tasks.py): mnist1d, text; many methods per job
# ------------------------------------------------------------------------------------------------
#: the other torch optimizers a spec may name (``"optimizer"``), with torch's defaults
TORCH_DEFAULTS = {"rmsprop": "RMSprop", "adagrad": "Adagrad", "adamax": "Adamax",
                  "nadam": "NAdam", "radam": "RAdam"}


def _task_optimizer(task, params, spec: dict):
    import torch
    r = task.recipe
    name = spec.get("optimizer", r.optimizer)
    lr = spec.get("lr", r.lr)
    wd = spec.get("weight_decay", r.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=spec.get("momentum", r.momentum),
                               nesterov=spec.get("nesterov", False), weight_decay=wd)
    if name == "adam":
        opt = torch.optim.Adam(params, lr=lr, betas=r.betas, weight_decay=wd)
    elif name == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, betas=r.betas, weight_decay=wd or 0.01)
    elif name in TORCH_DEFAULTS:  # as a user would: torch's defaults but the learning rate
        return getattr(torch.optim, TORCH_DEFAULTS[name])(params, lr=lr)
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    if spec.get("freeze_variance_after") and spec["method"] in ("none", "local"):
        # the dense baselines of a drop-in run with freeze_variance_after: the same optimizer
        opt.__class__ = _frozen_class(opt.__class__, spec["freeze_variance_after"])
    return opt


def _frozen_class(cls, after: int):
    """``cls`` (torch Adam/AdamW) with the second moment frozen after ``after`` steps, as the
    drop-in's ``freeze_variance_after`` does (:func:`horovod_sbc.torch.adam.frozen_step`)."""
    from horovod_sbc.torch.adam import frozen_step
    from horovod_sbc.torch.owner import called_by_horovod_broadcast

    def step(self, closure=None):
        if called_by_horovod_broadcast():  # its state-creating step is not a training step
            return cls.step(self, closure)
        self._bench_steps = getattr(self, "_bench_steps", 0) + 1
        if self._bench_steps <= after:
            return cls.step(self, closure)
        frozen_step(self)

    return type(cls.__name__, (cls,), {"step": step})


def _task_compressor(spec: dict, seed: int):
    """The compressor of a spec: drop-in and stock SBC/top-K with their extra knobs."""
    import horovod_sbc.torch as sbc
    m = spec["method"]
    extra = {k: spec[k] for k in ("topology", "downlink_density", "downlink_mode", "mode")
             if k in spec}
    if "downlink_binarize" in spec:  # the rows of before SBC(downlink_mode=...)
        extra["downlink_mode"] = "sbc" if spec["downlink_binarize"] else "values"
    knobs = {k: spec[k] for k in ("local_residual", "freeze_variance_after") if k in spec}
    if spec.get("outer") is not None:
        knobs["outer"] = _task_outer(spec)
    extra.update(knobs)
    if m == "sbc":
        return sbc.SBC(density=spec["density"], delay=spec.get("delay", 1), **extra)
    if m == "topk":
        return sbc.TopK(density=spec["density"], delay=spec.get("delay", 1), **extra)
    return make_compressor(m, spec.get("density", 1.0), spec.get("delay", 1), seed, **knobs)


def _task_outer(spec: dict):
    """The drop-in's outer step of ``spec["outer"]``: ``[kind, *args]`` with kind ``"plain"``,
    ``"nesterov"`` (lr, momentum) or ``"error_decay"`` (decay, lr); None: the default."""
    if spec.get("outer") is None:
        return None
    import horovod_sbc.torch as sbc
    kind, *args = spec["outer"]
    return {"plain": sbc.Plain, "nesterov": sbc.Nesterov, "error_decay": sbc.ErrorDecay}[kind](
        *args)


def lr_schedule(recipe, spec: dict, steps: int) -> Callable[[int], float]:
    """The factor of the base learning rate at step ``s``: the recipe's warm-up and decay,
    times ``spec["lr_after_freeze"]`` from the step Adam's variance is frozen on (the
    ``freeze_variance_after``-th step counted from 0, the first frozen one)."""
    boost, start = spec.get("lr_after_freeze", 1.0), spec.get("freeze_variance_after")
    if boost != 1.0 and not start:
        raise ValueError("lr_after_freeze needs freeze_variance_after")
    return lambda s: recipe.lr_factor(s, steps) * (boost if start and s >= start else 1.0)


def _task_train_once(task, spec: dict, seed: int, partition: str) -> dict:
    import hashlib

    import numpy as np
    import torch
    import horovod.torch as hvd
    import horovod_sbc.torch as sbc
    from examples.common import stock_horovod_optimizer

    rank, size = hvd.rank(), hvd.size()
    method, api = spec["method"], spec.get("api", "dropin")
    torch.manual_seed(seed)
    model = task.build_model()
    base = _task_optimizer(task, model.parameters(), spec)
    numel = sum(p.numel() for p in model.parameters())
    steps = spec.get("steps", task.recipe.steps)
    comp = None
    if method in STOCK:
        opt = stock_horovod_optimizer(base, model, hvd.Compression.fp16 if method == "fp16"
                                      else hvd.Compression.none)
    elif method == "local":
        opt = base
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif api == "stock":
        comp = _task_compressor(spec, seed)
        opt = stock_horovod_optimizer(base, model, comp)
    else:
        comp = _task_compressor(spec, seed)
        opt = sbc.DistributedOptimizer(base, model.named_parameters(), compression=comp)
        sbc.broadcast_state(model, opt, root_rank=0)
    xs, ys = task.shard(rank, size, partition)
    bs = spec.get("batch_size", task.recipe.batch_size)
    batches = task.batches(len(xs), bs, seed * 1000 + rank)
    # the recipe's warm-up and decay, on the optimizer the user steps (the drop-in subclasses
    # the user's optimizer class, so a scheduler drives it as it would the plain one)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(task.recipe, spec, steps))
    times, losses = [], []
    warm = spec.get("density_warmup")  # [start density, steps]: DGC's exponential warm-up
    for step in range(steps):
        b = next(batches)
        if warm and comp is not None:
            _set_density(comp, _warm_density(warm, spec["density"], step))
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = task.loss(model, xs[b], ys[b])
        loss.backward()
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    score_shared, score_own, finish_bits = None, None, 0
    if hasattr(opt, "finish"):
        # after a last (counted) sync of a partial window, two models a rank holds with no
        # traffic beyond the exchange's: the shared weights W_ref (the same on every rank) and
        # the rank's own live weights (W_ref + its residual with local_residual=True)
        if getattr(opt, "_sbc_local_steps", 0):
            opt._sbc_sync()  # the weight exchange (on a stock optimizer synchronize() is Horovod's)
        score_own = task.evaluate(model)
        with opt.shared_weights():
            score_shared = task.evaluate(model)
        # finish(): with the residuals in the weights, W_ref + the average of the ranks'
        # residuals, one dense allreduce of every parameter that the compressor's statistics
        # do not count (counted here); with them beside the shared weights, W_ref (no traffic)
        finish_bits = sum(8 * p.element_size() * p.numel() for p in model.parameters()
                          if p.requires_grad) if getattr(opt, "local_residual", True) else 0
        opt.finish()  # all ranks end on the same weights
    score = task.evaluate(model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    st = run_stats(comp, method, numel, steps)
    st["finish_bits"] = finish_bits
    every = max(1, steps // 20)
    curve = [float(np.mean(losses[i:i + every])) for i in range(0, steps, every)]
    skip = min(5, len(times) - 1)
    return {"score": score, "score_shared": score_shared, "score_own": score_own,
            "digest": digest, "stats": st,
            "params": numel, "steps": steps, "loss_curve": curve,
            "step_time_mean": float(np.mean(times[skip:]))}


def task_worker_main(argv: Sequence[str]) -> int:
    """One job: every spec of ``cfg["runs"]`` for every seed, on one task/partition/world size.
    Rank 0 prints one ``@@result`` per spec."""
    import numpy as np
    import torch
    import horovod.torch as hvd
    from .tasks import make_task

    cfg = json.loads(argv[0])
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    task = make_task(cfg["task"], cfg.get("data_seed", 0), **cfg.get("task_kw", {}))
    seeds, specs, part = cfg["seeds"], cfg["runs"], cfg.get("partition", "iid")
    for si, spec in enumerate(specs):
        per_seed = []
        t0 = time.perf_counter()
        for seed in seeds:
            per_seed.append(_task_train_once(task, spec, seed, part))
        if rank == 0:
            print(PROGRESS_TAG + json.dumps({"frac": (si + 1) / len(specs),
                                             "info": spec_label(spec)}), flush=True)
        mine = [{"score": r["score"], "score_own": r["score_own"], "digest": r["digest"],
                 "stats": r["stats"]} for r in per_seed]
        everyone = hvd.allgather_object(mine)
        if rank != 0:
            continue

        def mean_over(key):  # per seed: mean over ranks; then mean over seeds
            return float(np.mean([np.mean([everyone[r][s]["stats"].get(key, 0)
                                           for r in range(len(everyone))])
                                  for s in range(len(seeds))]))
        # a score per seed: rank 0's model (identical on all ranks for synchronous methods);
        # "local": the mean over ranks (every rank has its own model)
        if spec["method"] == "local":
            scores = [float(np.mean([everyone[r][s]["score"] for r in range(len(everyone))]))
                      for s in range(len(seeds))]
        else:
            scores = [r["score"] for r in per_seed]
        out = dict(spec, label=spec_label(spec), task=task.name, metric=task.metric,
                   partition=part, workers=hvd.size(), seeds=list(seeds),
                   score=float(np.mean(scores)), score_std=float(np.std(scores)),
                   score_seeds=scores,
                   upstream_bits=mean_over("upstream_bits"),
                   downstream_bits=mean_over("downstream_bits"),
                   dense_bits=mean_over("dense_bits"), syncs=mean_over("syncs"),
                   positions_sent=mean_over("positions_sent"),
                   elements_synced=mean_over("elements_synced"),
                   server_out_bits=float(np.mean([everyone[0][s]["stats"].get(
                       "server_out_bits", 0) for s in range(len(seeds))])),
                   ranks_identical=all(len({everyone[r][s]["digest"]
                                            for r in range(len(everyone))}) == 1
                                       for s in range(len(seeds))),
                   step_time_s=float(np.mean([r["step_time_mean"] for r in per_seed])),
                   steps=per_seed[0]["steps"], params=per_seed[0]["params"],
                   loss_curve=per_seed[0]["loss_curve"], wall_s=time.perf_counter() - t0,
                   task_info=task.info)
        shared = [r["score_shared"] for r in per_seed]
        if all(v is not None for v in shared):  # drop-in: the shared weights before finish()
            # each rank's own live weights before finish(): per seed the mean over ranks
            own = [float(np.mean([everyone[r][s]["score_own"] for r in range(len(everyone))]))
                   for s in range(len(seeds))]
            out.update(score_shared=float(np.mean(shared)),
                       score_shared_std=float(np.std(shared)), score_shared_seeds=shared,
                       score_own=float(np.mean(own)), score_own_std=float(np.std(own)),
                       score_own_seeds=own, finish_bits=mean_over("finish_bits"))
        _add_ratios(out)
        print(RESULT_TAG + json.dumps(out), flush=True)
    return 0


def _add_ratios(out: dict) -> None:
    """``compression_ratio``: dense bits / the exchange's upstream bits (the shared weights'
    ratio); ``ratio_with_finish``: the same with ``finish()``'s dense allreduce counted (the
    ratio of ``score``, the model after finish())."""
    up = out["upstream_bits"]
    out["compression_ratio"] = out["dense_bits"] / up if up > 0 else None
    if "finish_bits" in out and up > 0:
        out["ratio_with_finish"] = out["dense_bits"] / (up + out["finish_bits"])
    if out.get("elements_synced"):
        out["measured_density"] = out["positions_sent"] / out["elements_synced"]


def _warm_density(warm, target: float, step: int) -> float:
    """DGC's density warm-up (Lin et al., ICLR 2018): from ``warm[0]`` down to ``target``
    geometrically over the first ``warm[1]`` steps, then ``target``."""
    start, n = float(warm[0]), int(warm[1])
    if step >= n:
        return target
    return start * (target / start) ** (step / n)


def _set_density(comp, density: float) -> None:
    """The compressor's density from its next sync on (residuals are unsent update mass, valid
    at any density; the same knob a checkpoint resumed at another density changes)."""
    import dataclasses
    comp.config = dataclasses.replace(comp.config, density=density)


def spec_label(s: dict) -> str:
    m = s["method"]
    lab = m
    if m in ("sbc", "topk"):
        lab += f" p={s['density']:g}"
    if m in DROPIN and s.get("delay", 1) != 1 or m == "fedavg":
        lab += f" n={s.get('delay', 1)}"
    if s.get("mode"):
        lab += f" mode={s['mode']}"
    if s.get("api") == "stock":
        lab += " (stock)"
    if s.get("topology") == "server":
        dd = s.get("downlink_density")
        lab += " server" + (f" down={dd:g}" if dd is not None else " down=dense")
    elif s.get("topology") == "reduce_scatter":  # downlink_density None: the uplink's density
        dd = s.get("downlink_density")
        lab += " reduce_scatter" + (f" down={dd:g}" if dd is not None else "")
        if s.get("downlink_binarize") is False or s.get("downlink_mode") == "values":
            lab += " down_values"
        elif s.get("downlink_mode") not in (None, "sbc"):
            lab += f" down_{s['downlink_mode']}"
    if s.get("local_residual") is False:
        lab += " shared"
    elif s.get("local_residual") is True:
        lab += " local"
    if s.get("outer") is not None:
        lab += " outer=" + ",".join(str(a) for a in s["outer"])
    if s.get("density_warmup"):
        lab += " warmup={:g}/{}".format(*s["density_warmup"])
    if s.get("freeze_variance_after"):
        lab += f" freeze={s['freeze_variance_after']}"
    if s.get("lr_after_freeze", 1.0) != 1.0:
        lab += f" lr_after_freeze=x{s['lr_after_freeze']:g}"
    if "momentum_masking" in s:
        lab += " masking" if s["momentum_masking"] else " no-masking"
    if "stock_momentum" in s:
        lab += f" momentum={s['stock_momentum']}"
    for k in ("optimizer", "nesterov", "weight_decay"):
        if k in s:
            lab += f" {k}={s[k]}"
    return lab


def run_task_jobs(task: str, jobs: Sequence[dict], seeds: Sequence[int], timeout: float = 1800,
                  progress: bool = True, task_kw: Optional[dict] = None, title: str = "",
                  done: Optional[Dict[str, List[dict]]] = None,
                  on_job: Optional[Callable[[str, List[dict]], None]] = None
                  ) -> Dict[str, object]:
    """``jobs``: ``{"workers", "partition", "runs": [spec, ...], "seeds"?}``; one mpirun job
    each. ``done``: results of jobs already measured, by :func:`job_key` (not rerun);
    ``on_job(key, results)`` after every job (e.g. to save progress). Returns
    ``{"runs": [...], "skipped": [...]}``."""
    done = dict(done or {})
    prog = Progress(len(jobs), title or f"{task} benchmark", progress)
    runs, skipped = [], []
    for job in jobs:
        key = job_key(task, job, seeds)
        if key in done:
            runs.extend(done[key])
            continue
        cfg = {"task": task, "task_kw": task_kw or {}, "seeds": list(job.get("seeds", seeds)),
               "partition": job["partition"], "runs": job["runs"]}
        cmd = launcher_prefix(job["workers"], "mpirun", ENV_NAMES) + [
            python_exe(), "-m", "benchmarks.bench_train", "task-worker", json.dumps(cfg)]
        prog.start(f"{task} W={job['workers']} {job['partition']} ({len(job['runs'])} runs)")
        try:
            out = run_job(cmd, job_env(), timeout, prog.update)
        except JobError as e:
            prog.end("FAILED")
            skipped.append({"job": {k: job[k] for k in ("workers", "partition")},
                            "reason": str(e)[-3000:]})
            continue
        for r in out:
            r["command"] = shlex.join(cmd[:len(cmd) - 1]) + " CONFIG_JSON"
            r["job_key"] = key
        runs.extend(out)
        if on_job is not None:
            on_job(key, out)
        prog.end(", ".join(f"{r['label']}: {_score_str(r)}" for r in out[:4])
                 + (" ..." if len(out) > 4 else ""))
    return {"runs": runs, "skipped": skipped}


def _score_str(r: dict) -> str:
    if r["metric"] == "accuracy":
        return f"{100 * r['score']:.1f}%"
    return f"ppl {r['score']:.2f}"


# -- the sweep of ``python -m benchmarks.bench tasks`` --------------------------------------------
def _s(method, density=1.0, delay=1, **kw) -> dict:
    return dict(method=method, density=density, delay=delay, **kw)


def task_jobs(task: str, quick: bool) -> List[dict]:
    """The jobs of the sweep: one per (workers, partition, seed set), each running many methods.

    Budgeted for the 2-core development machine shared with other jobs: every method once
    (seed 0), then seeds 1 and 2 of the main comparison (mnist1d, 4 workers, IID) in a later job;
    :func:`merge_seed_runs` joins the seeds of the same setting. ``"seeds"`` of a job overrides
    the sweep's seeds."""
    if quick:
        return [{"workers": 2, "partition": "iid",
                 "runs": [_s("none"), _s("local"), _s("sbc", 0.01, 4), _s("sbc", 0.01, 1),
                          _s("sbc", 0.01, 1, api="stock")]}]
    one = [0]
    if task == "mnist1d":
        main = [_s("none"), _s("local"), _s("sbc", 0.01, 1), _s("sbc", 0.01, 4),
                _s("sbc", 0.001, 16)]
        return [
            {"workers": 4, "partition": "iid", "seeds": one,
             "runs": main + [_s("sbc", 0.1, 1), _s("sbc", 0.01, 1, local_residual=False),
                             _s("sbc", 0.01, 1, api="stock"), _s("sbc", 0.1, 1, api="stock"),
                             _s("topk", 0.01, 1, api="stock"), _s("topk", 0.01, 1)]},
            {"workers": 4, "partition": "by_class", "seeds": one,
             "runs": [_s("none"), _s("local"), _s("sbc", 0.01, 1), _s("sbc", 0.01, 4),
                      _s("sbc", 0.01, 1, local_residual=False),
                      _s("sbc", 0.01, 4, local_residual=False)]},
            {"workers": 8, "partition": "iid", "seeds": one,
             "runs": [_s("none"), _s("topk", 0.01, 1),
                      _s("topk", 0.01, 1, topology="server", downlink_density=0.01),
                      _s("topk", 0.01, 1, topology="server", downlink_density=None)]},
            {"workers": 4, "partition": "iid", "seeds": one,
             "runs": [_s("topk", 0.01, 1, topology="server", downlink_density=0.01),
                      _s("topk", 0.01, 1, topology="server", downlink_density=None),
                      _s("sbc", 0.1, 4), _s("sbc", 0.001, 1), _s("sbc", 0.001, 4),
                      _s("sbc", 0.01, 16), _s("signsgd"), _s("terngrad"),
                      _s("fedavg", 1.0, 4), _s("fp16")]},
            {"workers": 4, "partition": "iid", "seeds": [1, 2], "runs": main},
            {"workers": 2, "partition": "iid", "seeds": one,
             "runs": [_s("none"), _s("local"), _s("sbc", 0.01, 1), _s("sbc", 0.01, 4)]},
            {"workers": 2, "partition": "by_class", "seeds": one,
             "runs": [_s("none"), _s("local"), _s("sbc", 0.01, 1),
                      _s("sbc", 0.01, 1, local_residual=False)]}]
    if task == "mnist1d_long":  # issue 11's own setting: 3 seeds of every run
        return [
            {"workers": 4, "partition": "iid", "seeds": [0, 1, 2],
             "runs": [_s("none"), _s("local"), _s("sbc", 0.01, 1, api="stock"),
                      _s("sbc", 0.1, 1, api="stock"), _s("topk", 0.01, 1, api="stock"),
                      _s("sbc", 0.01, 1), _s("sbc", 0.1, 1), _s("sbc", 0.01, 4),
                      _s("sbc", 0.001, 1), _s("sbc", 0.001, 4)]},
            {"workers": 4, "partition": "iid", "seeds": [0, 1, 2],
             "runs": [_s("sbc", 0.001, 8), _s("sbc", 0.001, 16), _s("sbc", 0.001, 32),
                      _s("sbc", 0.01, 16)]},
            {"workers": 4, "partition": "iid", "seeds": [0, 1, 2],
             "runs": [_s("sbc", 0.01, 32), _s("sbc", 0.01, 64), _s("sbc", 0.003, 32)]},
            {"workers": 4, "partition": "by_class", "seeds": [0, 1, 2],
             "runs": [_s("none"), _s("local"), _s("sbc", 0.01, 1), _s("sbc", 0.01, 4),
                      _s("sbc", 0.01, 1, local_residual=False),
                      _s("sbc", 0.01, 4, local_residual=False)]},
            {"workers": 2, "partition": "iid", "seeds": [0, 1, 2],
             "runs": [_s("none"), _s("local"), _s("sbc", 0.01, 1), _s("sbc", 0.01, 4),
                      _s("sbc", 0.01, 1, api="stock")]},
            {"workers": 4, "partition": "iid", "seeds": [0, 1, 2],
             "runs": [_s("fp16"), _s("topk", 0.01, 1), _s("signsgd"), _s("terngrad"),
                      _s("fedavg", 1.0, 4)]},
            # the rest of the grid: every method at 2 workers and on non-IID shards too
            {"workers": 2, "partition": "iid", "seeds": [0, 1, 2],
             "runs": [_s("sbc", 0.1, 1), _s("sbc", 0.001, 1), _s("sbc", 0.001, 4),
                      _s("sbc", 0.01, 16), _s("sbc", 0.1, 1, api="stock"),
                      _s("topk", 0.01, 1, api="stock")]},
            {"workers": 2, "partition": "iid", "seeds": [0, 1, 2],
             "runs": [_s("fp16"), _s("topk", 0.01, 1), _s("signsgd"), _s("terngrad"),
                      _s("fedavg", 1.0, 4)]},
            {"workers": 2, "partition": "by_class", "seeds": [0, 1, 2],
             "runs": [_s("none"), _s("local"), _s("sbc", 0.01, 1), _s("sbc", 0.01, 4),
                      _s("sbc", 0.01, 1, local_residual=False),
                      _s("sbc", 0.01, 4, local_residual=False)]},
            {"workers": 2, "partition": "by_class", "seeds": [0, 1, 2],
             "runs": [_s("topk", 0.01, 1), _s("fedavg", 1.0, 4), _s("fp16"),
                      _s("sbc", 0.01, 1, api="stock")]},
            {"workers": 4, "partition": "by_class", "seeds": [0, 1, 2],
             "runs": [_s("fp16"), _s("topk", 0.01, 1), _s("signsgd"), _s("terngrad"),
                      _s("fedavg", 1.0, 4), _s("sbc", 0.1, 1), _s("sbc", 0.01, 1, api="stock")]},
            {"workers": 2, "partition": "by_class", "seeds": [0, 1, 2],
             "runs": [_s("signsgd"), _s("terngrad")]}]
    runs = [_s("none"), _s("local"), _s("sbc", 0.01, 4), _s("sbc", 0.001, 16),
            _s("sbc", 0.01, 4, local_residual=False)]
    return [{"workers": 4, "partition": p, "seeds": one, "runs": runs} for p in PARTITIONS] + \
        [{"workers": 4, "partition": p, "seeds": [1, 2], "runs": runs} for p in PARTITIONS]


def job_key(task: str, job: dict, seeds: Sequence[int]) -> str:
    return json.dumps([task, job["workers"], job["partition"], list(job.get("seeds", seeds)),
                       job["runs"]], sort_keys=True)


def merge_seed_runs(runs: List[dict]) -> List[dict]:
    """Join results of the same setting (task, workers, partition, label) measured by different
    jobs with different seeds: scores concatenated (mean and std over all seeds), bit counts and
    step times averaged weighted by the number of seeds."""
    import numpy as np
    order, groups = [], {}
    for r in runs:
        k = (r["task"], r["workers"], r["partition"], r["label"])
        if k not in groups:
            order.append(k)
            groups[k] = []
        groups[k].append(r)
    out = []
    for k in order:
        rs = groups[k]
        if len(rs) == 1:
            out.append(rs[0])
            continue
        m = dict(rs[0])
        w = [len(r["seeds"]) for r in rs]
        m["seeds"] = [s for r in rs for s in r["seeds"]]
        m["score_seeds"] = [s for r in rs for s in r["score_seeds"]]
        m["score"] = float(np.mean(m["score_seeds"]))
        m["score_std"] = float(np.std(m["score_seeds"]))
        for which in ("score_shared", "score_own"):  # joined only where every job has it
            if all(f"{which}_seeds" in r for r in rs):
                m[f"{which}_seeds"] = [s for r in rs for s in r[f"{which}_seeds"]]
                m[which] = float(np.mean(m[f"{which}_seeds"]))
                m[f"{which}_std"] = float(np.std(m[f"{which}_seeds"]))
            else:
                for key in (which, f"{which}_std", f"{which}_seeds"):
                    m.pop(key, None)
        if "score_shared" not in m:
            m.pop("finish_bits", None)
        for key in ("upstream_bits", "downstream_bits", "dense_bits", "syncs", "positions_sent",
                    "elements_synced", "step_time_s", "server_out_bits", "wall_s",
                    "finish_bits"):
            if all(key in r for r in rs):
                m[key] = float(np.average([r[key] for r in rs], weights=w))
        m["ranks_identical"] = all(r.get("ranks_identical") for r in rs)
        _add_ratios(m)
        m["merged_from_jobs"] = len(rs)
        out.append(m)
    return out


def _better(metric: str, a: float, b: float) -> bool:
    return a > b if metric == "accuracy" else a < b


def _within(metric: str, score: float, dense: float) -> bool:
    """Within one point of dense: 1 accuracy point, or 1 % of dense perplexity."""
    return score >= dense - 0.01 if metric == "accuracy" else score <= dense * 1.01


def summarize_tasks(res: dict) -> Dict[str, object]:
    """Per (task, workers, partition): dense, local, their gap, and the best upstream ratio
    among runs within one point of dense (1 accuracy point / 1 % perplexity)."""
    out: Dict[str, object] = {}
    groups: Dict[tuple, List[dict]] = {}
    for r in res["runs"]:
        groups.setdefault((r["task"], r["workers"], r["partition"]), []).append(r)
    for (task, w, part), runs in sorted(groups.items()):
        by = {r["label"]: r for r in runs}
        dense, local = by.get("none"), by.get("local")
        if dense is None:
            continue
        metric = dense["metric"]
        row = {"metric": metric, "dense": dense["score"], "dense_std": dense["score_std"]}
        if local:
            row["local"] = local["score"]
            row["local_minus_dense"] = local["score"] - dense["score"]
        ok = [r for r in runs if r.get("compression_ratio") and r["method"] not in STOCK
              and _within(metric, r["score"], dense["score"])]
        best = max(ok, key=lambda r: r["compression_ratio"], default=None)
        row["best_within_1pt"] = None if best is None else {
            "label": best["label"], "score": best["score"], "ratio": best["compression_ratio"]}
        sbc_ok = [r for r in ok if r["method"] == "sbc"]
        best_sbc = max(sbc_ok, key=lambda r: r["compression_ratio"], default=None)
        row["best_sbc_within_1pt"] = None if best_sbc is None else {
            "label": best_sbc["label"], "score": best_sbc["score"],
            "ratio": best_sbc["compression_ratio"]}
        def fails(r):  # more than 2 points below dense, or not better than no communication
            far = (r["score"] < dense["score"] - 0.02 if metric == "accuracy"
                   else r["score"] > dense["score"] * 1.02)
            return far or (local is not None and not _better(metric, r["score"], local["score"]))
        row["sbc_p_le_0.1_failing_2pt_or_local"] = [
            r["label"] for r in runs if r["method"] == "sbc" and r["density"] <= 0.1 and fails(r)]
        out[f"{task} W={w} {part}"] = row
    return out


def _fmt_score(r: dict) -> str:
    if r["metric"] == "accuracy":
        s = f"{100 * r['score']:.1f}"
        return s + (f" ± {100 * r['score_std']:.1f}" if len(r.get("seeds", [])) > 1 else "") + " %"
    return f"{r['score']:.2f}" + (f" ± {r['score_std']:.2f}" if len(r.get("seeds", [])) > 1
                                  else "")


def markdown_tasks(res: dict) -> str:
    out = []
    groups: Dict[tuple, List[dict]] = {}
    for r in res["runs"]:
        groups.setdefault((r["task"], r["workers"], r["partition"]), []).append(r)
    for (task, w, part), runs in sorted(groups.items()):
        metric = runs[0]["metric"]
        head = f"**{task}, {w} workers, {PART_TITLE.get(part, part) if task != 'text' else part}**"
        lines = [head, "", f"| method | {'test accuracy' if metric == 'accuracy' else 'test ppl'}"
                 " (mean ± std) | upstream bits / rank | downstream bits / rank | ratio | "
                 "positions / numel | ranks identical |", "|---|---:|---:|---:|---:|---:|:---:|"]
        for r in runs:
            md = r.get("measured_density")
            lines.append(f"| {r['label']} | {_fmt_score(r)} | {_bits_str(r['upstream_bits'])} | "
                         f"{_bits_str(r['downstream_bits'])} | {_ratio_str(r)} | "
                         f"{'-' if md is None else f'{md:.4f}'} | "
                         f"{'yes' if r.get('ranks_identical') else 'no'} |")
        out.append("\n".join(lines))
    for s in res.get("skipped", []):
        out.append(f"skipped {s.get('job')}: {s['reason'].splitlines()[0]}")
    summ = res.get("summary") or {}
    if summ:
        lines = ["**Summary** (one point = 1 accuracy point or 1 % of dense perplexity)", "",
                 "| setting | dense | local | local − dense | best ratio within 1 pt | "
                 "best SBC ratio within 1 pt | SBC p ≤ 0.1 > 2 pt below dense or ≤ local |",
                 "|---|---:|---:|---:|---|---|---|"]
        for k, v in summ.items():
            acc = v["metric"] == "accuracy"
            f = (lambda x: f"{100 * x:.1f} %") if acc else (lambda x: f"{x:.2f}")
            gap = v.get("local_minus_dense")
            b, bs = v.get("best_within_1pt"), v.get("best_sbc_within_1pt")
            lines.append(
                f"| {k} | {f(v['dense'])} | {f(v['local']) if 'local' in v else '-'} | "
                f"{'-' if gap is None else (f'{100 * gap:+.1f} pt' if acc else f'{gap:+.2f}')} | "
                f"{'-' if not b else b['label'] + ' ×' + format(b['ratio'], ',.0f')} | "
                f"{'-' if not bs else bs['label'] + ' ×' + format(bs['ratio'], ',.0f')} | "
                f"{', '.join(v['sbc_p_le_0.1_failing_2pt_or_local']) or 'none'} |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def plot_tasks(res: dict, path: str) -> None:
    """Score vs upstream bits per rank, one panel per (task, workers, partition)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups: Dict[tuple, List[dict]] = {}
    for r in res["runs"]:
        if r["workers"] in (2, 4):
            groups.setdefault((r["task"], r["workers"], r["partition"]), []).append(r)
    keys = sorted(groups)
    if not keys:
        return
    cols = min(4, len(keys))
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.3 * rows), squeeze=False)
    markers = {"none": "s", "fp16": "D", "sbc": "o", "topk": "^", "fedavg": "v",
               "signsgd": "P", "terngrad": "X"}
    for ax, key in zip(axes.flat, keys):
        runs = groups[key]
        acc = runs[0]["metric"] == "accuracy"
        val = (lambda r: 100 * r["score"]) if acc else (lambda r: r["score"])
        for r in runs:
            if r["method"] == "local":
                ax.axhline(val(r), ls=":", c="k", lw=1, label="local (no communication)")
                continue
            if r["method"] == "none":
                ax.axhline(val(r), ls="--", c="gray", lw=1, label="dense")
            if r["upstream_bits"] <= 0:
                continue
            c = "tab:blue" if r["method"] == "sbc" and r.get("api") != "stock" else None
            ax.scatter(r["upstream_bits"], val(r), marker=markers.get(r["method"], "o"), s=30,
                       color=c, zorder=3)
            ax.annotate(r["label"].replace("sbc ", ""), (r["upstream_bits"], val(r)), fontsize=5,
                        xytext=(2, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_title(f"{key[0]}, {key[1]} workers, {key[2]}", fontsize=9)
        ax.set_xlabel("upstream bits per rank (log)", fontsize=8)
        ax.set_ylabel("test accuracy (%)" if acc else "test perplexity", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle("Training tasks: final score vs upstream traffic (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "worker":
        sys.exit(worker_main(sys.argv[2:]))
    if len(sys.argv) >= 2 and sys.argv[1] == "task-worker":
        sys.exit(task_worker_main(sys.argv[2:]))
    print("usage: python -m benchmarks.bench train|grid ... (this module's entry is the worker)")
    sys.exit(2)
