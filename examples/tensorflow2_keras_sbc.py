"""Keras 3 ``model.fit`` on scikit-learn's digits (shipped with the package, no download) on several
ranks, dense (Horovod allreduce) and with SBC, printing accuracy and measured compression.

    horovodrun -np 2 python examples/tensorflow2_keras_sbc.py
    horovodrun -np 2 python examples/tensorflow2_keras_sbc.py --methods sbc --density 0.01 --delay 4

SBC: ``model.fit(..., callbacks=[horovod_sbc.tensorflow.SBCCallback(SBC(density, delay=n))])``
with your own, unmodified Keras optimizer (see docs/tensorflow.md for why a callback).
Dense baseline: Horovod's own gradient allreduce in a ``train_step`` through
``hvd.DistributedGradientTape``, passing ``[v.value for v in model.trainable_variables]`` (the
workaround for Keras 3 variables, upstream Horovod issue #4290).
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


class HorovodDenseModel(keras.Model):
    """The dense baseline: Horovod's allreduce of gradients inside ``train_step``."""

    def train_step(self, data):
        x, y = data[0], data[1]
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        tape = hvd.DistributedGradientTape(tape)
        variables = self.trainable_variables
        grads = tape.gradient(loss, [v.value for v in variables])  # upstream #4290 workaround
        self.optimizer.apply_gradients(zip(grads, variables))
        return {"loss": loss}


def make_model(method: str, hidden: int, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((64,))
    h = keras.layers.Dense(hidden, activation="relu")(inp)
    h = keras.layers.Dense(hidden, activation="relu")(h)
    out = keras.layers.Dense(10)(h)
    cls = HorovodDenseModel if method == "dense" else keras.Model
    return cls(inp, out)


class StepTimer(keras.callbacks.Callback):
    """Wall time of every batch, SBC's sync included (put it after the SBC callback)."""

    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._t0)


class EpochProgress(keras.callbacks.Callback):
    def __init__(self, method, epochs):
        super().__init__()
        self.method, self.epochs = method, epochs

    def on_epoch_end(self, epoch, logs=None):
        done = (epoch + 1) / self.epochs
        print(f"{self.method:>5} [{'#' * int(30 * done):<30}] {100 * done:3.0f}% "
              f"epoch {epoch + 1}/{self.epochs} loss {logs['loss']:.4f}", flush=True)


def train(method: str, args, data, progress: bool):
    xtr, ytr, xte, yte = data
    rank, size = hvd.rank(), hvd.size()
    model = make_model(method, args.hidden, args.seed)
    model.compile(optimizer=keras.optimizers.SGD(args.lr, momentum=args.momentum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)  # Horovod's ops have no XLA kernels in this build
    numel = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    timer = StepTimer()
    callbacks = []
    if method == "dense":
        hsbc.broadcast_variables(model.variables, root_rank=0)
    else:
        sbc_cb = hsbc.SBCCallback(hsbc.SBC(density=args.density, delay=args.delay))
        callbacks.append(sbc_cb)  # broadcasts the initial weights itself
    callbacks.append(timer)
    if progress:
        callbacks.append(EpochProgress(method, args.epochs))
    # each rank trains on its own shard of the training set, the same number of batches
    steps_per_epoch = (len(xtr) // size) // args.batch_size
    n = steps_per_epoch * args.batch_size
    xs, ys = xtr[rank::size][:n], ytr[rank::size][:n]
    model.fit(xs, ys, batch_size=args.batch_size, epochs=args.epochs, shuffle=True, verbose=0,
              callbacks=callbacks)
    logits = model(xte, training=False).numpy()
    acc = float((logits.argmax(1) == yte).mean())
    flat = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    digests = hvd.allgather_object(hashlib.sha256(flat.tobytes()).hexdigest())
    total = steps_per_epoch * args.epochs
    res = {"method": method, "api": "keras-callback" if method != "dense" else "horovod",
           "density": args.density if method != "dense" else 1.0,
           "delay": args.delay if method != "dense" else 1, "workers": size,
           "final_accuracy": acc,
           # mean, not median: with delay n only every n-th batch pays for the exchange
           "step_time_s": float(np.mean(timer.times[5:])),
           "step_time_median_s": float(np.median(timer.times[5:])),
           "steps": total, "params": numel, "ranks_identical": len(set(digests)) == 1}
    if method == "dense":
        res.update(upstream_bits=32 * numel * total, dense_bits=32 * numel * total,
                   downstream_bits=32 * numel * total * (size - 1))
    else:
        res.update(sbc_cb.stats())
    res["compression_ratio"] = res["dense_bits"] / max(1, res["upstream_bits"])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="dense,sbc", help="comma list of dense,sbc")
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
