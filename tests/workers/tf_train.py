"""TensorFlow weight mode (drop-in tape with delay, SBCCallback) with ``local_residual``.

argv: OUTDIR. Two rank-local runs of a small Keras MLP (SGD momentum 0.9, density 0.1, delay 2,
eager and tf.function) with ``SBC(local_residual=True)`` and one with False. After every sync each
rank records the digest of the shared reference weights and whether every variable holds exactly
``W_ref + R`` (True) or ``W_ref`` (False); at the end :meth:`SBC.finish` and the digest of the
variables.
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_result  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

import horovod_sbc.tensorflow as hsbc  # noqa: E402
from horovod_sbc.tensorflow.owner import entries as tf_entries  # noqa: E402

hvd.init()
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(1)
RANK = hvd.rank()
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def digest(arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def run(local_residual, fn, steps=12, delay=2):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(5)])
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    sbc = hsbc.SBC(density=0.1, delay=delay, local_residual=local_residual)
    hsbc.broadcast_variables(model.variables)
    sbc.build(model.trainable_variables)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        t = hsbc.DistributedGradientTape(tape, compression=sbc)
        grads = t.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        sbc.step(model.trainable_variables)
        return loss
    step = tf.function(step) if fn else step
    syncs = []
    for s in range(steps):
        rng = np.random.default_rng(1000 * s + RANK)
        step(tf.constant(rng.standard_normal((16, 20)).astype(np.float32)),
             tf.constant(rng.integers(0, 5, 16)))
        if (s + 1) % delay == 0:
            entries = tf_entries(model.trainable_variables)
            refs = [sbc.reference[n].numpy() for n, _, _ in entries]
            exact = True
            for (n, v, _), ref in zip(entries, refs):
                want = ref + sbc.residuals[n].numpy() if local_residual else ref
                exact &= bool(np.array_equal(v.numpy(), want.astype(v.numpy().dtype)))
            syncs.append({"shared": digest(refs), "exact": exact,
                          "local": digest([v.numpy() for v in model.trainable_variables])})
    sbc.finish(model.trainable_variables)
    return {"syncs": syncs, "final": digest([v.numpy() for v in model.trainable_variables])}


write_result(RANK, {"local_eager": run(True, False), "local_fn": run(True, True),
                    "shared_eager": run(False, False)})
