"""TensorFlow training-step time with SBC, as a multiple of the dense Horovod step (issue 14).

    python -m benchmarks.bench_tf_step [--np 2] [--params-m 3] [--steps 20] [--density 0.01]
                                       [--json benchmarks/results/tf_step.json]

Launches ``--np`` ranks (``horovod_sbc/launch.py``, Horovod's launcher) that each train the same
MLP (784 -> h -> h -> 10, ``h`` chosen for about ``--params-m`` million parameters) on random
data, batch 32, one thread per rank, with a ``tf.function`` step (forward, backward, sync,
SGD update) in three ways:

* ``dense``  — ``hvd.DistributedGradientTape(tape)`` (allreduce of every gradient);
* ``stock``  — ``hvd.DistributedGradientTape(tape, compression=SBC(density))``: stock Horovod
               with the SBC compressor (one allgather per tensor);
* ``dropin`` — ``horovod_sbc.tensorflow.DistributedGradientTape(tape, compression=SBC(...))``
               (one allgather per sync for all tensors).

Each step is timed on rank 0 (``float(loss)`` forces completion), the first ``--warmup`` steps
(tracing) excluded; the figure is the median. The printed ratios are median step time ÷ the
dense median, measured in the same job.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("dense", "stock", "dropin")


def hidden_for(params_m: float) -> int:
    """Width h of 784 -> h -> h -> 10 with about ``params_m`` million parameters."""
    target = params_m * 1e6
    h = 64
    while 784 * h + h + h * h + h + 10 * h + 10 < target:
        h += 32
    return h


def _make_step(method, model, opt, sbc, loss_fn, hvd, hsbc, tf):
    """The ``tf.function`` training step of one method (closes over the model: variables must
    not become function arguments)."""
    variables = model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if method == "dense":
            grads = hvd.DistributedGradientTape(tape).gradient(loss, [v.value for v in variables])
        elif method == "stock":
            grads = hvd.DistributedGradientTape(tape, compression=sbc).gradient(
                loss, [v.value for v in variables])
        else:
            grads = hsbc.DistributedGradientTape(tape, compression=sbc).gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        if method not in ("dense", "stock"):
            sbc.step(variables)  # the drop-in: the weight update's exchange
        return loss

    return step


def worker(cfg: Dict) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import horovod.tensorflow as hvd
    import horovod_sbc.tensorflow as hsbc

    hvd.init()
    rank = hvd.rank()
    h = cfg["hidden"]
    rng = np.random.default_rng(rank)
    x = tf.constant(rng.standard_normal((cfg["batch"], 784)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, cfg["batch"]).astype(np.int64))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = {}
    for method in cfg["methods"]:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(h, activation="relu"),
                                  keras.layers.Dense(h, activation="relu"),
                                  keras.layers.Dense(10)])
        variables = model.trainable_variables
        n_params = int(sum(int(np.prod(v.shape)) for v in variables))
        opt = keras.optimizers.SGD(0.01)
        sbc = hsbc.SBC(density=cfg["density"]) if method != "dense" else None

        step = _make_step(method, model, opt, sbc, loss_fn, hvd, hsbc, tf)
        times = []
        t_first = None
        for i in range(cfg["warmup"] + cfg["steps"]):
            t0 = time.perf_counter()
            float(step(x, y))
            dt = time.perf_counter() - t0
            if i == 0:
                t_first = dt
            if i >= cfg["warmup"]:
                times.append(dt)
        out[method] = {"median_s": statistics.median(times), "min_s": min(times),
                       "first_call_s": t_first, "params": n_params}
        if rank == 0:
            print(f"{method:>7}: median {1000 * out[method]['median_s']:.1f} ms/step "
                  f"(first call {t_first:.1f} s)", flush=True)
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(out, f)


def run(np_: int = 2, params_m: float = 3.0, steps: int = 20, warmup: int = 3,
        density: float = 0.01, batch: int = 32, timeout: float = 600) -> Dict:
    """Launch the job; returns the figures (see the module docstring)."""
    from horovod_sbc import launch
    tmp = tempfile.mkdtemp(prefix="sbc-bench-tf-step-")
    cfg = {"hidden": hidden_for(params_m), "steps": steps, "warmup": warmup,
           "density": density, "batch": batch, "methods": list(METHODS),
           "out": os.path.join(tmp, "out.json")}
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    cmd = launch.launcher_prefix(np_, "horovodrun-gloo") + [
        launch.python_exe(), "-m", "benchmarks.bench_tf_step", "--worker", cfg_path]
    t0 = time.time()
    rc, output = launch.run(cmd, timeout, launch.job_env(),
                            on_line=lambda line: print(line, end="", flush=True))
    if rc != 0:
        raise RuntimeError(f"bench_tf_step: the job exited {rc}")
    with open(cfg["out"]) as f:
        per = json.load(f)
    dense = per["dense"]["median_s"]
    return {"np": np_, "params": per["dense"]["params"], "hidden": cfg["hidden"],
            "density": density, "batch": batch, "steps": steps, "threads_per_rank": 1,
            "methods": per,
            "over_dense": {m: per[m]["median_s"] / dense for m in METHODS},
            "wall_s": time.time() - t0,
            "command": " ".join(["python -m benchmarks.bench_tf_step"] + sys.argv[1:])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--params-m", type=float, default=3.0,
                    help="model size in millions of parameters (default 3)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results",
                                                   "tf_step.json"))
    args = ap.parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            worker(json.load(f))
        return 0
    res = run(args.np, args.params_m, args.steps, args.warmup, args.density)
    print(f"TF step time / dense Horovod step, {res['np']} ranks, {res['params']:,} parameters, "
          f"SBC density {res['density']:g}: "
          + ", ".join(f"{m} {res['over_dense'][m]:.2f}x" for m in METHODS))
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
