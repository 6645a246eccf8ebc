"""A plain TensorFlow 2 training loop (``tf.GradientTape`` inside ``tf.function``) on scikit-learn's
digits (shipped with the package, no download) on several ranks, dense (Horovod allreduce) and
with SBC, printing accuracy and measured compression.

    horovodrun -np 2 python examples/tensorflow2_tape_sbc.py
    horovodrun -np 2 python examples/tensorflow2_tape_sbc.py --methods sbc --api stock

``--api dropin`` uses horovod_sbc.tensorflow.DistributedGradientTape (one allgather per sync,
weight updates as the torch drop-in: ``sbc.step(variables, opt)`` after each optimizer step, every
--delay-th one exchanges the weight update; ``sbc.finish(variables)`` at the end);
``--api stock`` is the one-line change to stock Horovod:
``hvd.DistributedGradientTape(tape, compression=SBC(...), groups=1)`` (delay 1; ``groups=1``
makes the step one exchange; with Keras 3 variables pass
``[v.value for v in model.trainable_variables]``, upstream Horovod issue #4290).
"""
import argparse
import hashlib
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

import horovod_sbc.tensorflow as hsbc  # noqa: E402
from common import digits_split, print_runs  # noqa: E402


def make_model(hidden: int, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(10)])


def train(method: str, args, data, progress: bool):
    xtr, ytr, xte, yte = data
    rank, size = hvd.rank(), hvd.size()
    model = make_model(args.hidden, args.seed)
    opt = keras.optimizers.SGD(args.lr, momentum=args.momentum)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    delay = args.delay if (method == "sbc" and args.api == "dropin") else 1
    sbc = (hsbc.SBC(density=args.density, delay=delay, optimizer=opt) if method == "sbc"
           else None)
    if method == "sbc" and args.api == "stock":
        opt.build(variables)  # the stock tape folds SGD's momentum: its velocity must exist
    hsbc.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if method == "dense":
            grads = hvd.DistributedGradientTape(tape).gradient(loss, [v.value for v in variables])
        elif args.api == "stock":
            tape = hvd.DistributedGradientTape(tape, compression=sbc, groups=1)  # one exchange
            grads = tape.gradient(loss, [v.value for v in variables])
        else:
            grads = hsbc.DistributedGradientTape(tape, compression=sbc).gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        if method == "sbc" and args.api == "dropin":
            sbc.step(variables, opt)  # every delay-th call: exchange W - W_ref
        return loss

    # each rank trains on its own shard of the training set, the same number of batches
    xs, ys = xtr[rank::size], ytr[rank::size]
    steps_per_epoch = (len(xtr) // size) // args.batch_size
    rng = np.random.default_rng(args.seed + rank)
    step_times = []
    for epoch in range(args.epochs):
        perm = rng.permutation(len(xs))
        for i in range(steps_per_epoch):
            b = perm[i * args.batch_size:(i + 1) * args.batch_size]
            t0 = time.perf_counter()
            loss = float(train_step(tf.constant(xs[b]), tf.constant(ys[b])))
            step_times.append(time.perf_counter() - t0)
        if progress:
            done = (epoch + 1) / args.epochs
            print(f"{method:>5} [{'#' * int(30 * done):<30}] {100 * done:3.0f}% "
                  f"epoch {epoch + 1}/{args.epochs} loss {loss:.4f}", flush=True)
    if sbc is not None and args.api == "dropin":
        sbc.finish(variables)  # the last window; residuals averaged if in the weights
    acc = float((model(xte, training=False).numpy().argmax(1) == yte).mean())
    numel = sum(int(np.prod(v.shape)) for v in variables)
    flat = np.concatenate([v.numpy().ravel() for v in variables])
    digests = hvd.allgather_object(hashlib.sha256(flat.tobytes()).hexdigest())
    total = steps_per_epoch * args.epochs
    res = {"method": method, "api": args.api if method != "dense" else "horovod",
           "density": args.density if method != "dense" else 1.0, "delay": delay,
           "workers": size, "final_accuracy": acc,
           "step_time_s": float(np.mean(step_times[5:])),
           "step_time_median_s": float(np.median(step_times[5:])),
           "steps": total, "params": numel, "ranks_identical": len(set(digests)) == 1}
    if method == "dense":
        res.update(upstream_bits=32 * numel * total, dense_bits=32 * numel * total,
                   downstream_bits=32 * numel * total * (size - 1))
    else:
        res.update(sbc.stats())
    res["compression_ratio"] = res["dense_bits"] / max(1, res["upstream_bits"])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="dense,sbc", help="comma list of dense,sbc")
    ap.add_argument("--api", choices=["dropin", "stock"], default="dropin")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--delay", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results (rank 0) to this file")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.api == "stock":
        args.delay = 1  # stock Horovod syncs every step
    hvd.init()
    data = digits_split(args.seed)
    results = []
    for method in args.methods.split(","):
        results.append(train(method, args, data, hvd.rank() == 0 and not args.no_progress))
    if hvd.rank() == 0:
        print_runs(results, args.json)
    return results


if __name__ == "__main__":
    main()
