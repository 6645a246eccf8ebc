"""Stock TensorFlow tape with Keras Adam/AdamW: gradient exchange before, weight exchange after.

    python -m benchmarks.tf_stock_study                     # quick: 1 seed, 500 steps
    python -m benchmarks.tf_stock_study --full --json benchmarks/results/tf_stock_study.json

Through stock ``hvd.DistributedGradientTape(tape, compression=SBC(0.01))`` without the optimizer
SBC exchanges sparse *gradients*, and Adam normalises each coordinate's late, burst-like arrival
by its own history (horovod_sbc/policy.py). Given the optimizer, ``SBC(0.01, optimizer=opt)``,
the same stock loop exchanges *weight changes* after each rank's own Adam step
(horovod_sbc/tensorflow/stock.py; the residual in each rank's weights, Adam's second moment
frozen automatically), as torch's stock hook does. Rows, per optimizer (Keras ``Adam`` and
``AdamW``, lr 1e-3, eps 1e-8; AdamW weight decay 0.01), one ``mpirun -np W`` job (default 4
workers) training every method in turn:

``dense``           plain ``hvd.DistributedGradientTape(tape)`` (dense allreduce of gradients);
``alone``           no communication: each rank trains on its shard alone (the floor);
``stock_gradients`` ``hvd.DistributedGradientTape(tape, compression=SBC(0.01), num_groups=1)``
                    (no optimizer given: the gradient exchange, as before);
``stock_weights``   the same loop with ``SBC(0.01, optimizer=opt)`` (the weight exchange), then
                    ``sbc.finish(variables)`` so that every rank ends on the same weights.

Task: mnist1d (``mnist1d.data.make_dataset``, generated locally, never downloaded: 4000 train /
2000 test, :func:`benchmarks.tasks.mnist1d_arrays`), IID shards (rank r takes samples r, r + W,
...), batch 64 per rank, a Keras 1-D CNN (three strided Conv1D of 32 channels + ReLU, a Dense
head; the torch task's ``mnist1d_cnn``), the same initial weights on every rank (seeded, then
broadcast), each rank its own batch sequence (seed ``seed * 1000 + rank``). Reported: test
accuracy (mean over ranks of each rank's final model, and its spread; the methods other than
``alone`` end with identical weights on every rank), the upstream compression ratio
``dense_bits / upstream_bits`` of SBC's ``stats()``, and seconds per run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List

METHODS = ("dense", "alone", "stock_gradients", "stock_weights")
OPTIMIZERS = ("adam", "adamw")
DESCRIPTION = {
    "dense": "hvd.DistributedGradientTape (dense allreduce)",
    "alone": "no communication (each rank alone)",
    "stock_gradients": "stock tape, SBC(0.01) (gradient exchange)",
    "stock_weights": "stock tape, SBC(0.01, optimizer=opt) (weight exchange)",
}
LR, EPS, WEIGHT_DECAY, BATCH = 1e-3, 1e-8, 0.01, 64
RESULT_TAG = "@@result "


# ------------------------------------------------------------------------------------------------
# the worker (every rank)
# ------------------------------------------------------------------------------------------------
def keras_cnn(seed: int, width: int = 32, length: int = 40, classes: int = 10):
    import keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((length,)), keras.layers.Reshape((length, 1)),
        keras.layers.Conv1D(width, 5, strides=2, padding="same", activation="relu"),
        keras.layers.Conv1D(width, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Conv1D(width, 3, strides=2, padding="same", activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(classes)])


def make_optimizer(name: str):
    import keras
    if name == "adamw":
        return keras.optimizers.AdamW(LR, weight_decay=WEIGHT_DECAY, epsilon=EPS)
    return keras.optimizers.Adam(LR, epsilon=EPS)


def train_once(method: str, opt_name: str, seed: int, steps: int, density: float, data) -> dict:
    import warnings
    import numpy as np
    import tensorflow as tf
    import keras
    import horovod.tensorflow as hvd
    import horovod_sbc.tensorflow as hsbc

    rank, size = hvd.rank(), hvd.size()
    xtr, ytr, xte, yte = data
    xs, ys = xtr[rank::size], ytr[rank::size]
    keras.backend.clear_session()
    model = keras_cnn(seed)
    opt = make_optimizer(opt_name)
    variables = model.trainable_variables
    sbc = None
    if method == "stock_gradients":
        sbc = hsbc.SBC(density)
    elif method == "stock_weights":
        sbc = hsbc.SBC(density, optimizer=opt)
    hsbc.broadcast_variables(model.variables, root_rank=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if method == "alone":
            grads = tape.gradient(loss, variables)
        else:
            kw = {} if sbc is None else dict(compression=sbc, num_groups=1)
            grads = hvd.DistributedGradientTape(tape, **kw).gradient(
                loss, [v.value for v in variables])  # Keras 3 variables: upstream #4290
        opt.apply_gradients(zip(grads, variables))
        return loss

    rng = np.random.default_rng(seed * 1000 + rank)
    order, pos = rng.permutation(len(xs)), 0
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stock_gradients warns (once) that Adam trains worse
        for _ in range(steps):
            if pos + BATCH > len(order):
                order, pos = rng.permutation(len(xs)), 0
            idx = order[pos:pos + BATCH]
            pos += BATCH
            train_step(tf.constant(xs[idx]), tf.constant(ys[idx]))
        if method == "stock_weights":
            sbc.finish(variables)  # the ranks' residuals averaged in: identical weights
    seconds = time.perf_counter() - t0
    logits = np.concatenate([model(xte[i:i + 500], training=False).numpy()
                             for i in range(0, len(xte), 500)])
    acc = float((logits.argmax(-1) == yte).mean())
    accs = hvd.allgather(tf.constant([acc], tf.float64), name=f"acc_{method}_{opt_name}_{seed}")
    out = {"method": method, "optimizer": opt_name, "seed": seed, "steps": steps,
           "accuracy_per_rank": [float(a) for a in accs.numpy()], "seconds": seconds}
    if sbc is not None:
        st = sbc.stats()
        out["stats"] = st
        out["ratio"] = st["dense_bits"] / max(1, st["upstream_bits"])
    return out


def worker_main(cfg: dict) -> None:
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from .tasks import mnist1d_arrays
    hvd.init()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    for seed in cfg["seeds"]:
        data = mnist1d_arrays(6000, 2 / 3, seed)
        for opt_name in cfg["optimizers"]:
            for method in cfg["methods"]:
                res = train_once(method, opt_name, seed, cfg["steps"], cfg["density"], data)
                if hvd.rank() == 0:
                    print(RESULT_TAG + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------
def summarize(runs: List[dict]) -> List[dict]:
    import numpy as np
    rows = []
    for opt_name in OPTIMIZERS:
        for method in METHODS:
            mine = [r for r in runs if r["optimizer"] == opt_name and r["method"] == method]
            if not mine:
                continue
            per_seed = [float(np.mean(r["accuracy_per_rank"])) for r in mine]
            spread = max(max(r["accuracy_per_rank"]) - min(r["accuracy_per_rank"]) for r in mine)
            rows.append({"optimizer": opt_name, "method": method,
                         "description": DESCRIPTION[method],
                         "accuracy": float(np.mean(per_seed)),
                         "accuracy_std": float(np.std(per_seed)),
                         "per_seed": per_seed, "rank_spread": spread,
                         "ratio": (float(np.mean([r["ratio"] for r in mine]))
                                   if "ratio" in mine[0] else None),
                         "seconds": float(np.mean([r["seconds"] for r in mine]))})
    return rows


def table(rows: List[dict], cfg: dict) -> str:
    lines = [f"mnist1d, {cfg['workers']} workers IID, batch {BATCH}/rank, {cfg['steps']} steps, "
             f"seeds {','.join(map(str, cfg['seeds']))}, density {cfg['density']}",
             "| optimizer | method | test accuracy | ranks' spread | upstream ratio | s/run |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{100 * r['accuracy']:.1f} %"
        if len(r["per_seed"]) > 1:
            acc += f" ± {100 * r['accuracy_std']:.1f}"
        ratio = "—" if r["ratio"] is None else f"×{r['ratio']:.0f}"
        lines.append(f"| {r['optimizer']} | {r['method']}: {r['description']} | {acc} | "
                     f"{100 * r['rank_spread']:.1f} pt | {ratio} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="default 500 (quick), 1500 (--full)")
    ap.add_argument("--seeds", default=None, help="comma-separated; default 0 (quick), 0,1,2")
    ap.add_argument("--full", action="store_true", help="3 seeds, 1500 steps")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", default=None, help="write the runs and the table here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker_main(json.loads(args.worker))
        return 0
    from horovod_sbc import launch
    cfg = {"workers": args.workers, "density": args.density,
           "steps": args.steps or (1500 if args.full else 500),
           "seeds": [int(s) for s in (args.seeds or ("0,1,2" if args.full else "0")).split(",")],
           "optimizers": [o for o in args.optimizers.split(",") if o],
           "methods": [m for m in args.methods.split(",") if m]}
    for o in cfg["optimizers"]:
        if o not in OPTIMIZERS:
            ap.error(f"--optimizers: {o!r} is not one of {OPTIMIZERS}")
    for m in cfg["methods"]:
        if m not in METHODS:
            ap.error(f"--methods: {m!r} is not one of {METHODS}")
    cmd = launch.launcher_prefix(args.workers, "mpirun") + [
        launch.python_exe(), "-m", "benchmarks.tf_stock_study", "--worker", json.dumps(cfg)]
    runs: List[Dict] = []

    def on_line(line: str) -> None:
        if line.startswith(RESULT_TAG):
            r = json.loads(line[len(RESULT_TAG):])
            runs.append(r)
            print(f"  {r['optimizer']:>5} {r['method']:<16} seed {r['seed']}: "
                  f"{100 * sum(r['accuracy_per_rank']) / len(r['accuracy_per_rank']):.1f} % "
                  f"({r['seconds']:.0f} s)", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    code, output = launch.run(cmd, args.timeout, launch.job_env(), on_line=on_line)
    if code != 0:
        print(output[-6000:], file=sys.stderr)
        print(f"the job exited {code}", file=sys.stderr)
        return 1
    rows = summarize(runs)
    text = table(rows, cfg)
    print(text)
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "runs": runs, "rows": rows, "table": text}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
