"""The task matrix (issue 61): every task of ``benchmarks/matrix.json`` at every learning rate of
its sweep, dense and no communication beside the one-line change, as real multi-rank jobs.

    nice -n 19 python -m benchmarks.matrix --json benchmarks/results/matrix.json [--resume]
        [--tasks cnn1d,lstm_clip] [--workers 4] [--methods dense,none,sbc,sbc_delay4]
        [--seeds 0] [--variant NAME]  [--report]  [--quick]

``matrix.json`` declares the tasks (data, model, optimizer, the learning-rate sweep, steps),
the seeds, the methods and the targets; this module reads it and changes none of it. One
``mpirun`` job per (task, workers, learning rate) runs every method on every seed
(:func:`worker_main`). ``--variant`` runs a screen candidate (:data:`VARIANTS`) in place of the
package's defaults for the SBC methods (its results go to their own file). ``--json FILE``
saves every finished job to ``FILE.partial`` at once (``--resume`` reuses them) and writes
``FILE``, ``FILE.md`` (the tables and the verdict of every cell) and ``FILE.png`` (score against
upstream ratio per task); ``--report`` redraws the last two from ``FILE``.

Training follows what a user of Horovod writes: ``hvd.DistributedOptimizer(opt,
named_parameters=..., compression=...)``, parameters and optimizer state broadcast from rank 0,
the task's learning-rate schedule as a ``LambdaLR`` on the wrapped optimizer, gradient clipping
as Horovod documents it (``optimizer.synchronize()``, ``clip_grad_norm_``, then
``optimizer.step()`` inside ``optimizer.skip_synchronize()``; without communication the local
gradient is clipped) and ``optimizer.finish()`` at the end where the optimizer has one. The
score is rank 0's test score (the mean over ranks without communication).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .bench_train import (PROGRESS_TAG, RESULT_TAG, JobError, Progress, job_env,
                          launcher_prefix, python_exe, run_job)
from horovod_sbc.launch import ENV_NAMES

MATRIX = Path(__file__).resolve().parent / "matrix.json"
METHODS = ("dense", "none", "sbc", "sbc_delay4")

#: screen candidates: what the SBC methods run instead of the package's defaults
#: (``api``: "stock" or "dropin"; ``knobs``: arguments of ``SBC``; ``env``: what every rank runs
#: with; ``finish``: "shared" scores ``W_ref`` alone)
VARIANTS: Dict[str, dict] = {
    "default": {"api": "stock", "knobs": {}},
    "dropin": {"api": "dropin", "knobs": {}},
    "residual_beside": {"api": "stock", "knobs": {"local_residual": False}},
    "local_residual_shared": {"api": "stock", "knobs": {"local_residual": True},
                              "finish": "shared"},
    # the adaptive screen: outer steps in place of policy.outer_step's choice
    "outer_plain": {"api": "stock", "knobs": {"outer": ["plain", 1.0]}},
    "outer_diloco": {"api": "stock", "knobs": {"outer": ["nesterov", 0.7, 0.9]}},
    "outer_mild": {"api": "stock", "knobs": {"outer": ["nesterov", 1.0, 0.5]}},
    "outer_sparseloco": {"api": "stock", "knobs": {"outer": ["error_decay", 0.9]}},
}

#: the momentum-SGD screen of issue 61: candidates whose code lost and was deleted, and the
#: commit each ran at (``git checkout COMMIT; python -m benchmarks.matrix --variant NAME ...``
#: reruns it): today's fold with its guard ("default" at db348e6), the fold without it,
#: DGC (momentum correction + masking; + its density warm-up; correction alone), EF21 with
#: momentum, the heavy ball on the decoded average kept or masked, and the weight exchange with
#: the residual in the weights (now the default of every optimizer)
SCREENED = {"fold_guard": "db348e6", "fold_noguard": "a680148", "dgc": "9537d10",
            "dgc_warmup": "a680148", "dgc_nomask": "a680148", "ef21": "dd9c97a",
            "keep": "a680148", "mask": "a680148", "local_residual": "a680148",
            "rmsprop_freeze": "ebd0d48"}


def load(path: Path = MATRIX) -> dict:
    """The declaration, checked: every task names a known task, an optimizer and a sweep."""
    from .tasks import TASKS
    with open(path) as f:
        m = json.load(f)
    ids = [t["id"] for t in m["tasks"]]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: task ids must be unique, got {ids}")
    for t in m["tasks"]:
        if t["task"] not in TASKS:
            raise ValueError(f"{path}: task {t['id']!r} names unknown task {t['task']!r}")
        if len(t["lr"]) < 4 or max(t["lr"]) / min(t["lr"]) < 10 - 1e-9:
            raise ValueError(f"{path}: task {t['id']!r}: the sweep needs >= 4 learning rates "
                             "spanning 10x")
    return m


def digest(m: dict) -> str:
    """A short hash of the declaration (stored with every result)."""
    return hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:12]


# ------------------------------------------------------------------------------------------------
# the worker (every rank)
# ------------------------------------------------------------------------------------------------
def make_optimizer(params, spec: dict, lr: float):
    """The task's optimizer as its entry declares it."""
    import torch
    o = dict(spec)
    name = o.pop("name")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=o.get("momentum", 0.0),
                               nesterov=o.get("nesterov", False),
                               weight_decay=o.get("weight_decay", 0.0))
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        kw = {"betas": tuple(o["betas"])} if "betas" in o else {}
        if "weight_decay" in o:
            kw["weight_decay"] = o["weight_decay"]
        return cls(params, lr=lr, **kw)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}")


def lr_factor(entry: dict, step: int) -> float:
    """The entry's warm-up and schedule (linear warm-up, then constant or cosine to 0)."""
    warm, steps = entry.get("warmup", 0), entry["steps"]
    if step < warm:
        return (step + 1) / warm
    if entry.get("schedule", "constant") == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))
    return 1.0


def build(model, base, method: str, variant: dict, density: float, delay: int, seed: int):
    """The optimizer of ``method`` around ``base`` and its compressor (None for dense/none)."""
    import horovod.torch as hvd
    import horovod_sbc.torch as sbc
    from examples.common import stock_horovod_optimizer
    if method == "dense":
        return stock_horovod_optimizer(base, model, hvd.Compression.none), None
    if method == "none":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return base, None
    knobs = dict(variant.get("knobs", {}))
    if "outer" in knobs:  # ["plain", lr] | ["nesterov", lr, momentum] | ["error_decay", decay]
        kind, *args = knobs["outer"]
        knobs["outer"] = {"plain": sbc.Plain, "nesterov": sbc.Nesterov,
                          "error_decay": sbc.ErrorDecay}[kind](*args)
    comp = sbc.SBC(density, delay=delay, **knobs)
    if variant.get("api", "stock") == "stock":
        return stock_horovod_optimizer(base, model, comp), comp
    opt = sbc.DistributedOptimizer(base, model.named_parameters(), compression=comp)
    sbc.broadcast_state(model, opt, root_rank=0)
    return opt, comp


def train_once(task, entry: dict, lr: float, method: str, variant: dict, density: float,
               seed: int, partition: str) -> dict:
    """One run on this rank: its test score, weights digest, traffic and loss curve."""
    import numpy as np
    import torch
    import horovod.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(seed)
    model = task.build_model()
    init_score = task.evaluate(model) if method == "dense" and rank == 0 else None
    base = make_optimizer(model.parameters(), entry["optimizer"], lr)
    delay = 4 if method == "sbc_delay4" else 1
    opt, comp = build(model, base, method, variant, density, delay, seed)
    steps, clip = entry["steps"], entry.get("clip")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(entry, s))
    xs, ys = task.shard(rank, size, partition)
    batches = task.batches(len(xs), entry["batch_size"], seed * 1000 + rank)
    stock = method == "dense" or (comp is not None and variant.get("api", "stock") == "stock")
    losses, t0 = [], time.perf_counter()
    for _ in range(steps):
        b = next(batches)
        opt.zero_grad()
        loss = task.loss(model, xs[b], ys[b])
        loss.backward()
        if clip and stock:  # Horovod's documented clipping pattern
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        sched.step()
        losses.append(float(loss))
    wall = time.perf_counter() - t0
    if hasattr(opt, "finish"):
        opt.finish(**({"average_residuals": False} if variant.get("finish") == "shared" else {}))
    score = task.evaluate(model)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    numel = flat.numel()
    if comp is not None:
        st = dict(comp.stats())
    else:
        bits = 32 * numel * steps
        st = {"upstream_bits": bits if method == "dense" else 0, "dense_bits": bits}
    every = max(1, steps // 20)
    curve = [float(np.mean(losses[i:i + every])) for i in range(0, steps, every)]
    finite = bool(np.isfinite(losses).all())
    return {"score": score if math.isfinite(score) else None, "init_score": init_score,
            "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "upstream_bits": st.get("upstream_bits", 0), "dense_bits": st.get("dense_bits", 0),
            "positions_sent": st.get("positions_sent", 0),
            "elements_synced": st.get("elements_synced", 0), "curve": curve,
            "finite": finite, "wall_s": wall}


def worker_main(argv: Sequence[str]) -> int:
    """One job: every method of ``cfg["methods"]`` on every seed, one task, one learning rate.
    Rank 0 prints one ``@@result`` per method."""
    import numpy as np
    import torch
    import horovod.torch as hvd
    from .tasks import make_task

    cfg = json.loads(argv[0])
    hvd.init()
    torch.set_num_threads(1)
    entry, lr, seeds = cfg["entry"], cfg["lr"], cfg["seeds"]
    variant = VARIANTS[cfg.get("variant", "default")]
    task = make_task(entry["task"], cfg.get("data_seed", 0))
    for mi, method in enumerate(cfg["methods"]):
        per_seed = [train_once(task, entry, lr, method, variant, cfg["density"], s,
                               entry["partition"]) for s in seeds]
        everyone = hvd.allgather_object(per_seed)
        if hvd.rank() != 0:
            continue
        print(PROGRESS_TAG + json.dumps({"frac": (mi + 1) / len(cfg["methods"]),
                                         "info": method}), flush=True)
        n = len(everyone)
        if method == "none":  # every rank its own model: the mean over ranks
            scores = [_mean([everyone[r][s]["score"] for r in range(n)]) for s in range(len(seeds))]
        else:
            scores = [r["score"] for r in per_seed]
        up = float(np.mean([everyone[r][s]["upstream_bits"] for r in range(n)
                            for s in range(len(seeds))]))
        dense = float(np.mean([r["dense_bits"] for r in per_seed]))
        good = [s for s in scores if s is not None]
        out = {"id": entry["id"], "task": entry["task"], "workers": n, "lr": lr,
               "method": method, "variant": cfg.get("variant", "default"), "seeds": seeds,
               "score_seeds": scores,
               "score": float(np.mean(good)) if len(good) == len(scores) else None,
               "score_std": float(np.std(good)) if len(good) == len(scores) else None,
               "init_score": per_seed[0]["init_score"],
               "upstream_bits": up, "dense_bits": dense,
               "ratio": dense / up if up else None,
               "density_sent": (float(np.mean([r["positions_sent"] for r in per_seed]))
                                / max(1.0, float(np.mean([r["elements_synced"]
                                                          for r in per_seed])))),
               "ranks_identical": all(len({everyone[r][s]["digest"] for r in range(n)}) == 1
                                      for s in range(len(seeds))) if method != "none" else None,
               "finite": all(everyone[r][s]["finite"] for r in range(n)
                             for s in range(len(seeds))),
               "curves": [r["curve"] for r in per_seed],
               "wall_s": float(np.mean([r["wall_s"] for r in per_seed])),
               "matrix": cfg["matrix"]}
        print(RESULT_TAG + json.dumps(out), flush=True)
    return 0


def _mean(xs):
    return None if any(x is None for x in xs) else float(sum(xs) / len(xs))


# ------------------------------------------------------------------------------------------------
# planning and running jobs
# ------------------------------------------------------------------------------------------------
def plan(m: dict, tasks=None, workers=None, methods=METHODS, seeds=None, variant="default",
         quick: bool = False) -> List[dict]:
    """One job config per (task, workers, learning rate)."""
    jobs = []
    for t in m["tasks"]:
        if tasks and t["id"] not in tasks:
            continue
        entry = dict(t)
        if quick:
            entry.update(steps=max(8, t["steps"] // 50))
        for w in t["workers"]:
            if workers and w not in workers:
                continue
            for lr in t["lr"]:
                jobs.append({"entry": entry, "workers": w, "lr": lr, "methods": list(methods),
                             "seeds": list(seeds if seeds is not None else m["seeds"]),
                             "density": m["density"], "data_seed": m["data_seed"],
                             "variant": variant, "matrix": digest(m)})
    return jobs


def job_key(job: dict) -> str:
    return json.dumps([job["entry"]["id"], job["entry"]["steps"], job["workers"], job["lr"],
                       job["methods"], job["seeds"], job["variant"], job["matrix"]])


def _covering(job: dict, done: Dict[str, list]) -> Optional[str]:
    """The key of a finished job that ran ``job`` with a superset of its seeds, if any."""
    want = json.loads(job_key(job))
    for key in done:
        have = json.loads(key)
        if (have[:5] + have[6:] == want[:5] + want[6:]
                and set(want[5]) <= set(have[5])):
            return key
    return None


def run(jobs: List[dict], timeout: float, done: Dict[str, list], on_job=None) -> dict:
    runs, skipped = [], []
    prog = Progress(len(jobs), "task matrix")
    for job in jobs:
        key = job_key(job)
        if key in done:
            runs.extend(done[key])
            continue
        wider = _covering(job, done)
        if wider is not None:  # a finished job ran these seeds and more: keep all of them
            runs.extend(done[wider])
            continue
        cmd = launcher_prefix(job["workers"], "mpirun", ENV_NAMES) + [
            python_exe(), "-m", "benchmarks.matrix", "worker", json.dumps(job)]
        prog.start(f"{job['entry']['id']} W={job['workers']} lr={job['lr']:g}")
        try:
            out = run_job(cmd, job_env(VARIANTS[job["variant"]].get("env")), timeout,
                          prog.update)
        except JobError as e:
            prog.end("FAILED")
            skipped.append({"job": key, "reason": str(e)[-3000:]})
            continue
        for r in out:
            r["command"] = shlex.join(cmd[:-1]) + " CONFIG_JSON"
        runs.extend(out)
        if on_job is not None:
            on_job(key, out)
        prog.end(", ".join(f"{r['method']}: {_fmt(r, r['score'])}" for r in out))
    return {"runs": runs, "skipped": skipped}


# ------------------------------------------------------------------------------------------------
# verdicts and report
# ------------------------------------------------------------------------------------------------
def _acc(r: dict) -> bool:
    return r["task"] not in ("text", "transformer", "transformer_code", "regression")


def _fmt(r: dict, v: Optional[float], std: Optional[float] = None) -> str:
    if v is None:
        return "diverged"
    if _acc(r):
        s = f"{100 * v:.1f}"
        return s + (f" ± {100 * std:.1f}" if std is not None else "") + " %"
    s = f"{v:.3f}" if v < 1 else f"{v:.2f}"
    return s + (f" ± {std:.3f}" if std is not None and v < 1 else
                f" ± {std:.2f}" if std is not None else "")


def gap(r: dict, v: Optional[float], dense: float) -> Optional[float]:
    """Points below dense (accuracy) or the fraction above dense (lower-is-better metrics);
    positive is worse."""
    if v is None:
        return math.inf
    return (dense - v) * 100 if _acc(r) else (v - dense) / dense


def better(r: dict, a: Optional[float], b: Optional[float]) -> bool:
    """Is score ``a`` at least as good as ``b``?"""
    if a is None:
        return b is None
    if b is None:
        return True
    return a >= b if _acc(r) else a <= b


def cells(m: dict, runs: List[dict]) -> List[dict]:
    """Every (task, workers, lr) with its methods' runs and the verdict of each target."""
    by = {}
    for r in runs:
        by.setdefault((r["id"], r["workers"], r["lr"]), {})[r["method"]] = r
    out = []
    for t in m["tasks"]:
        best = {}
        for (tid, w, lr), rs in by.items():
            d = rs.get("dense")
            if tid == t["id"] and d and d["score"] is not None:
                if w not in best or better(d, d["score"], best[w]):
                    best[w] = d["score"]
        for w in t["workers"]:
            for lr in t["lr"]:
                rs = by.get((t["id"], w, lr))
                if not rs:
                    continue
                c = {"id": t["id"], "title": t["title"], "workers": w, "lr": lr, "runs": rs}
                d = rs.get("dense")
                c["dense_trains"] = bool(d and d["score"] is not None and w in best and
                                         _trains(d, d["score"], best[w]))
                for meth, goal in m["targets"].items():
                    r = rs.get(meth)
                    if r is None or d is None or d["score"] is None:
                        continue
                    g = gap(r, r["score"], d["score"])
                    tol = goal["accuracy_points"] if _acc(r) else goal["relative"]
                    ok = g <= tol
                    n = rs.get("none")
                    if goal.get("not_below_none") and n is not None:
                        ok = ok and better(r, r["score"], n["score"])
                    c[meth] = {"gap": g, "ok": ok if c["dense_trains"] else None}
                out.append(c)
    return out


def _trains(d: dict, v: float, best: float) -> bool:
    init = d.get("init_score")
    if init is None:
        return True
    return (v - init) >= 0.5 * (best - init) if _acc(d) else (init - v) >= 0.5 * (init - best)


def markdown(m: dict, res: dict) -> str:
    cs = cells(m, res["runs"])
    lines = ["# The task matrix", "",
             f"Declared in `benchmarks/matrix.json` (hash `{digest(m)}`); seeds "
             f"{', '.join(map(str, sorted({s for r in res['runs'] for s in r['seeds']})))}; "
             f"density {m['density']}. Scores are the mean ± std over seeds (a cell run on one "
             "seed names it); a gap is "
             "accuracy points below dense, or the fraction above dense's perplexity / MSE; "
             "×N is dense upstream bits over SBC's. ✓ / ✗: the cell meets / misses its target "
             "(`SBC(0.01)`: within 1 point or 3 % of dense and not below no communication; "
             "`delay=4`: within 2 points or 5 %); · : dense does not train at this learning "
             "rate (not judged).", ""]
    variants = sorted({r["variant"] for r in res["runs"]})
    if variants != ["default"]:
        lines += [f"Variant: {', '.join(variants)}.", ""]
    for t in m["tasks"]:
        tc = [c for c in cs if c["id"] == t["id"]]
        if not tc:
            continue
        lines += [f"## {t['id']}: {t['title']}", "",
                  "| workers | lr | dense | no communication | `SBC(0.01)` "
                  "| `SBC(0.01, delay=4)` |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for c in tc:
            row = [str(c["workers"]), f"{c['lr']:g}"]
            for meth in METHODS:
                r = c["runs"].get(meth)
                if r is None:
                    row.append("—")
                    continue
                one = len(r["seeds"]) == 1  # no spread to show: the seed is named
                s = _fmt(r, r["score"], None if one else r["score_std"])
                s += f" (seed {r['seeds'][0]})" if one else ""
                if meth in m["targets"] and meth in c:
                    g = c[meth]["gap"]
                    gs = "diverged" if g == math.inf else (
                        f"{-g:+.1f} pt" if _acc(r) else f"{100 * g:+.1f} %")
                    mark = {True: " ✓", False: " ✗", None: " ·"}[c[meth]["ok"]]
                    s += f" ({gs}, ×{r['ratio']:,.0f}){mark}" if r.get("ratio") else f"{mark}"
                row.append(s)
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    verdicts = [(c, meth, c[meth]["ok"]) for c in cs for meth in m["targets"] if meth in c]
    missed = [(c, meth) for c, meth, ok in verdicts if ok is False]
    judged = [(c, meth) for c, meth, ok in verdicts if ok is not None]
    lines += ["## Summary", "", f"{len(judged) - len(missed)} of {len(judged)} judged cells meet "
              "their target."]
    if missed:
        lines += ["", "Missed:"] + [f"* {c['id']}, {c['workers']} workers, lr {c['lr']:g}: "
                                    f"`{meth}`" for c, meth in missed]
    if res.get("skipped"):
        lines += ["", f"{len(res['skipped'])} job(s) failed (see the JSON)."]
    return "\n".join(lines) + "\n"


#: how a screen picks (written before the screen's results were read): a candidate that needs
#: a detector of its own blow-up is not eligible as a default; among the others the most cells
#: meeting their target (``SBC(0.01)`` and ``delay=4`` counted apart) wins, then the most cells
#: not below no communication, then the smaller mean gap (infinite gaps counted as 100)
SCREEN_RULE = ("eligible: no detector of its own blow-up; then most cells meeting their target, "
               "then most cells not below no communication, then the smallest mean gap")


def screen_report(m: dict, controls: dict, screens: Dict[str, dict], tasks=None,
                  workers=None) -> str:
    """Every candidate's cells judged against the dense and no-communication runs of
    ``controls`` (the same seeds), one column per candidate and method, and the ranking of
    :data:`SCREEN_RULE` (cells counted per method too); only ``tasks`` / ``workers`` if given."""
    keep = lambda r: (not tasks or r["id"] in tasks) and (not workers or r["workers"] in workers)  # noqa: E731
    base = [r for r in controls["runs"] if r["method"] in ("dense", "none") and keep(r)]
    rows, score, per = {}, {}, {}
    for name, res in screens.items():
        runs = base + [r for r in res["runs"] if r["method"] in m["targets"] and keep(r)]
        for c in cells(m, runs):
            for meth in m["targets"]:
                if meth not in c or c[meth]["ok"] is None:
                    continue
                r = c["runs"][meth]
                g = c[meth]["gap"]
                n = c["runs"].get("none")
                above = n is None or better(r, r["score"], n["score"])
                rows.setdefault((c["id"], c["workers"], c["lr"]), {})[(name, meth)] = (
                    g, c[meth]["ok"], r)
                s = score.setdefault(name, [0, 0, 0.0, 0])
                pm = per.setdefault((name, meth), [0, 0])
                pm[0] += int(c[meth]["ok"])
                pm[1] += 1
                s[0] += int(c[meth]["ok"])
                s[1] += int(above)
                s[2] += min(g, 100.0)
                s[3] += 1
    names = list(screens)
    head = "| task | W | lr | " + " | ".join(f"{n} `{meth}`" for n in names
                                             for meth in m["targets"]) + " |"
    lines = ["# Screen: " + ", ".join(names), "",
             f"Rule: {SCREEN_RULE}. Gaps: accuracy points below dense (−) or the fraction "
             "above dense perplexity / MSE; ✓ meets the target.", "", head,
             "|---|---:|---:|" + "---:|" * (len(names) * len(m["targets"]))]
    for (tid, w, lr), cols in rows.items():
        out = []
        for n in names:
            for meth in m["targets"]:
                v = cols.get((n, meth))
                if v is None:
                    out.append("—")
                    continue
                g, ok, r = v
                gs = "diverged" if g == math.inf else (f"{-g:+.1f}" if _acc(r) else
                                                       f"{100 * g:+.1f} %")
                out.append(gs + (" ✓" if ok else " ✗"))
        lines.append(f"| {tid} | {w} | {lr:g} | " + " | ".join(out) + " |")
    rank = sorted(score, key=lambda n: (-score[n][0], -score[n][1], score[n][2] / score[n][3]))
    heads = " | ".join(f"`{meth}` met" for meth in m["targets"])
    lines += ["", f"| candidate | cells meeting target | {heads} | not below no communication "
              "| mean gap |", "|---|---:|" + "---:|" * len(m["targets"]) + "---:|---:|"]
    for n in rank:
        s = score[n]
        each = " | ".join(f"{per[(n, meth)][0]} of {per[(n, meth)][1]}" if (n, meth) in per
                          else "—" for meth in m["targets"])
        lines.append(f"| {n} | {s[0]} of {s[3]} | {each} | {s[1]} of {s[3]} | "
                     f"{s[2] / s[3]:.2f} |")
    return "\n".join(lines) + "\n"


def plot(m: dict, res: dict, path: str) -> None:
    """Score against upstream ratio (log x), one panel per task."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    tasks = [t for t in m["tasks"] if any(r["id"] == t["id"] for r in res["runs"])]
    if not tasks:
        return
    cols = 3
    rows = (len(tasks) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    marks = {"dense": "s", "none": "x", "sbc": "o", "sbc_delay4": "^"}
    for ax, t in zip(axes.flat, tasks):
        for r in res["runs"]:
            if r["id"] != t["id"] or r["score"] is None:
                continue
            x = r["ratio"] if r.get("ratio") else 1.0
            if r["method"] == "none":
                x = 1e5  # no traffic: drawn at the right edge
            v = 100 * r["score"] if _acc(r) else r["score"]
            ax.scatter([x], [v], marker=marks[r["method"]], s=18,
                       label=f"{r['method']}" if r["lr"] == t["lr"][0] else None)
        ax.set_xscale("log")
        ax.set_title(t["id"], fontsize=9)
        ax.set_xlabel("dense bits / upstream bits (no communication at 1e5)", fontsize=7)
        ax.set_ylabel("test accuracy (%)" if t["task"] in ("mnist1d", "digits_conv")
                      else "test score (lower is better)", fontsize=7)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(m: dict, res: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    with open(path[:-5] + ".md" if path.endswith(".json") else path + ".md", "w") as f:
        f.write(markdown(m, res))
    plot(m, res, path[:-5] + ".png" if path.endswith(".json") else path + ".png")


def read_results(path: str) -> dict:
    """A results file, or the ``.partial`` of a run still going (its finished jobs)."""
    with open(path) as f:
        d = json.load(f)
    if "runs" not in d:  # FILE.partial: {job key: [runs]}
        d = {"runs": [r for runs in d.values() for r in runs], "skipped": []}
    return d


def main(argv=None) -> int:
    if argv and argv[0] == "worker":
        return worker_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write results here (and .md, .png beside)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--report", action="store_true", help="redraw .md/.png from --json")
    p.add_argument("--tasks", help="comma-separated task ids (default: all)")
    p.add_argument("--workers", help="comma-separated worker counts (default: each task's)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", help="comma-separated seeds (default: the declared seeds)")
    p.add_argument("--variant", default="default", choices=sorted(VARIANTS))
    p.add_argument("--quick", action="store_true", help="a few steps per run (smoke test)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--screen", nargs="+", metavar="NAME=FILE",
                   help="with --json CONTROLS: judge each screen's results against the dense "
                        "and no-communication runs of CONTROLS; writes --screen-out")
    p.add_argument("--screen-out", help="markdown file for --screen")
    a = p.parse_args(argv)
    m = load()
    split = (lambda s, f=str: [f(x) for x in s.split(",")] if s else None)  # noqa: E731
    if a.screen:
        controls = read_results(a.json)
        screens = {}
        for item in a.screen:
            name, path = item.split("=", 1)
            screens[name] = read_results(path)
        text = screen_report(m, controls, screens, split(a.tasks), split(a.workers, int))
        if a.screen_out:
            with open(a.screen_out, "w") as f:
                f.write(text)
        print(text)
        return 0
    if a.report:
        res = read_results(a.json)
        write(m, res, a.json)
        print(markdown(m, res))
        return 0
    jobs = plan(m, split(a.tasks), split(a.workers, int), split(a.methods),
                split(a.seeds, int), a.variant, a.quick)
    done: Dict[str, list] = {}
    partial = a.json + ".partial" if a.json else None
    if a.resume and partial and os.path.exists(partial):
        with open(partial) as f:
            done = json.load(f)

    def save(key, out):
        if partial:
            done[key] = out
            with open(partial, "w") as f:
                json.dump(done, f)

    res = run(jobs, a.timeout, done, save)
    res["matrix"] = digest(m)
    res["python"] = sys.version
    if a.json:
        write(m, res, a.json)
    print(markdown(m, res))
    return 1 if res["skipped"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
