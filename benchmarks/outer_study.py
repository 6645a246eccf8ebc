"""A small study of the drop-in's outer step (horovod_sbc.torch.outer): plain ``W_ref += U``
against DiLoCo's Nesterov momentum (and a milder momentum) at a few (density, delay) points,
on IID and label-skewed (``by_class``) shards of a training task, one seed, 4 workers.

    nice -n 10 python -m benchmarks.outer_study [--task mnist1d] [--seeds 0] [--set main]
        [--json benchmarks/results/outer_study.json]

Prints one line per run (score, upstream ratio) and writes every run's record as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from .bench_train import _s, run_task_jobs

NESTEROV = ["nesterov", 0.7, 0.9]  # DiLoCo's outer lr and momentum
MILD = ["nesterov", 1.0, 0.5]


DECAY = ["error_decay", 0.9, 1.0]


def study_jobs(workers: int = 4, which: str = "main"):
    """``main``: plain vs Nesterov at two (density, delay) points, IID and label-skewed;
    ``residual``: the same with every rank restarting from the shared weights
    (``local_residual=False``, DiLoCo's and SparseLoCo's setting) and SparseLoCo's decay;
    ``adamw`` (for ``--task transformer``, documents by worker): dense, no communication, the
    stock hook, the drop-in at delays 4 and 16 (and 16 with Nesterov), and FedAvg."""
    if which == "adamw":  # documents sharded by worker, as the transformer recipe is run
        runs = [_s("none"), _s("local"), _s("sbc", 0.01, 1, api="stock"),
                _s("sbc", 0.01, 4), _s("sbc", 0.01, 16), _s("fedavg", 1.0, 4),
                _s("sbc", 0.01, 16, outer=NESTEROV)]
        return [{"workers": workers, "partition": "by_class", "runs": runs}]
    if which == "main":
        runs = [_s("none"), _s("sbc", 0.01, 4), _s("sbc", 0.01, 4, outer=NESTEROV),
                _s("sbc", 0.01, 4, outer=MILD), _s("sbc", 0.001, 16),
                _s("sbc", 0.001, 16, outer=NESTEROV)]
    else:
        shared = dict(local_residual=False)
        runs = [_s("sbc", 0.01, 4, **shared), _s("sbc", 0.01, 4, outer=NESTEROV, **shared),
                _s("sbc", 0.01, 4, outer=DECAY, **shared), _s("sbc", 0.01, 4, outer=DECAY)]
    return [{"workers": workers, "partition": p, "runs": runs} for p in ("iid", "by_class")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="mnist1d")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--set", default="main", choices=("main", "residual", "adamw"))
    ap.add_argument("--json", default="benchmarks/results/outer_study.json")
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    t0 = time.perf_counter()
    res = run_task_jobs(a.task, study_jobs(a.workers, a.set), seeds, timeout=5400,
                        progress=False, title=f"outer step study ({a.task})")
    for r in res["runs"]:
        ratio = r.get("compression_ratio")
        print(f"{r['partition']:9s} {r['label']:45s} score {r['score']:.4f}  "
              f"ratio {'-' if ratio is None else f'{ratio:,.0f}'}  wall {r['wall_s']:.0f} s")
    for s in res["skipped"]:
        print("SKIPPED", s["job"], s["reason"][-500:], file=sys.stderr)
    res.update(command="nice -n 10 python -m benchmarks.outer_study " + " ".join(
        sys.argv[1:] if argv is None else argv), wall_s=time.perf_counter() - t0)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    return 0 if not res["skipped"] else 1


if __name__ == "__main__":
    sys.exit(main())
