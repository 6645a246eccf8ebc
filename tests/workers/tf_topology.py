"""TensorFlow SBC through the "reduce_scatter" and "server" topologies
(horovod_sbc/tensorflow/sync/topology.py). argv: OUT --scenarios JSON (tests/workers/common.py);
writes OUT/rank<R>.json.

Scenarios (key=value: topology, api=dropin|stock, fn=0|1 (tf.function), delay, steps, mode,
downlink_density):
  train     a small Keras model trained through the API; after every step the sha256 of the
            shared weights (SBC.reference; the model for the stock tape), stats, the bytes the
            collectives actually moved, the downlink residuals this rank holds and their
            names in a tf.train.Checkpoint.
  nan       rank 1 feeds a NaN at step 1: nonfinite="raise" (eager and tf.function: every
            rank's error text) and "skip" (eager: the warning, shared weights unchanged).
  callback  Keras fit with SBCCallback: the shared weights' digest after every batch.
  equiv     dense top-k (density 1, values) through the topology and through the allgather
            from the same start: the largest difference of the weights after 4 steps.
  refuse    what the stock tape says to topology="server".
"""
import hashlib
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import catch, end_job, scenarios  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

import horovod_sbc.tensorflow as hsbc  # noqa: E402
from horovod_sbc.tensorflow.sync import exchange, server  # noqa: E402

hvd.init()
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()
KW = {}

# what the collectives moved, recorded as graph ops (so it also counts inside tf.function), and
# the server's host steps (mpi4py, in Python)
REC = {k: tf.Variable(0, dtype=tf.int64) for k in ("a2a_sent", "a2a_received", "ag_sent",
                                                   "ag_received")}
HOST = {"gather_sent": 0, "gathered": 0, "bcast": 0}
_a2a, _ag, _gather, _bcast = (exchange.alltoall, exchange.allgather, server.gather_host,
                              server.broadcast_host)


def _rec_alltoall(buf, splits, tag):
    out = _a2a(buf, splits, tag)
    own = tf.cast(tf.cast(splits, tf.int32)[RANK], tf.int64)
    ops = [REC["a2a_sent"].assign_add(tf.reduce_sum(tf.cast(splits, tf.int64)) - own),
           REC["a2a_received"].assign_add(tf.size(out, out_type=tf.int64) - own)]
    with tf.control_dependencies(ops):
        return tf.identity(out)


def _rec_allgather(step, tag):
    out = _ag(step, tag)
    sent = tf.size(step, out_type=tf.int64)
    ops = [REC["ag_sent"].assign_add(sent),
           REC["ag_received"].assign_add(tf.size(out, out_type=tf.int64) - sent)]
    with tf.control_dependencies(ops):
        return tf.identity(out)


def _rec_gather(step):
    out = _gather(step)
    HOST["gather_sent"] += int(step.size)
    HOST["gathered"] += int(out.size)
    return out


def _rec_bcast(msg):
    out = _bcast(msg)
    HOST["bcast"] += int(out.size)
    return out


exchange.alltoall, exchange.allgather = _rec_alltoall, _rec_allgather
server.gather_host, server.broadcast_host = _rec_gather, _rec_bcast

N_IN, N_OUT = 20, 5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((N_IN,))
    h = keras.layers.Dense(32, activation="relu", name="fc1")(inp)
    m = keras.Model(inp, keras.layers.Dense(N_OUT, name="fc2")(h))
    # ranks start apart: the broadcast must make them equal
    m.get_layer("fc1").kernel.assign_add(0.01 * RANK * tf.ones_like(m.get_layer("fc1").kernel))
    return m


def batch(step, nan=False):
    rng = np.random.default_rng(1000 * step + RANK)
    x = rng.standard_normal((16, N_IN)).astype(np.float32)
    if nan:
        x[0, 0] = np.nan
    return tf.constant(x), tf.constant(rng.integers(0, N_OUT, 16))


def digest(variables):
    h = hashlib.sha256()
    for v in variables:
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()


def shared(model, sbc):
    """The shared weights: the reference weights (weight mode), else the model's."""
    if len(sbc.reference):
        return digest([sbc.reference[k] for k in sorted(sbc.reference.keys())])
    return digest(model.trainable_variables)


def compressor(**over):
    kw = dict(density=float(KW.get("density", 0.05)), delay=int(KW.get("delay", 1)),
              mode=KW.get("mode", "sbc"), topology=KW.get("topology", "reduce_scatter"),
              local_residual=False)
    if "downlink_density" in KW:
        kw["downlink_density"] = (None if KW["downlink_density"] == "none"
                                  else float(KW["downlink_density"]))
    if "downlink_mode" in KW:
        kw["downlink_mode"] = KW["downlink_mode"]
    kw.update(over)
    return hsbc.SBC(**kw)


def make_step(model, opt, sbc, api, fn):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        if api == "stock":
            t = hvd.DistributedGradientTape(tape, compression=sbc, groups=1)
            grads = t.gradient(loss, [v.value for v in model.trainable_variables])
        else:
            grads = hsbc.DistributedGradientTape(tape, compression=sbc).gradient(
                loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if api == "dropin":
            sbc.step(model.trainable_variables)
        return loss
    return tf.function(step) if fn else step


def setup(**over):
    model, sbc = make_model(), compressor(**over)
    opt = keras.optimizers.SGD(0.05)
    hsbc.broadcast_variables(model.variables, root_rank=0)
    if KW.get("api", "dropin") == "dropin":
        sbc.build(model.trainable_variables)
    return model, opt, sbc


def checkpoint_keys(model, sbc):
    path = tf.train.Checkpoint(sbc=sbc).write(os.path.join(tempfile.mkdtemp(), "ckpt"))
    return sorted(k for k, _ in tf.train.list_variables(path) if "server_residuals" in k)


def run_train():
    for v in REC.values():
        v.assign(0)
    HOST.update(gather_sent=0, gathered=0, bcast=0)
    api = KW.get("api", "dropin")
    model, opt, sbc = setup()
    step = make_step(model, opt, sbc, api, KW.get("fn") == "1")
    digests, losses = [shared(model, sbc)], []
    for s in range(int(KW.get("steps", 4))):
        losses.append(float(step(*batch(s))))
        digests.append(shared(model, sbc))
    return {"digests": digests, "losses": losses, "stats": sbc.stats(),
            "moved": {k: int(v.numpy()) for k, v in REC.items()}, "host": dict(HOST),
            "downlink": {k: int(v.shape.num_elements()) for k, v in sbc.server_residuals.items()},
            "checkpoint": checkpoint_keys(model, sbc),
            "numel": sum(int(np.prod(v.shape)) for v in model.trainable_variables)}


def run_nan():
    out = {}
    for fn in (False, True):
        model, opt, sbc = setup()
        step = make_step(model, opt, sbc, "dropin", fn)
        step(*batch(0))
        out[f"raise_{'fn' if fn else 'eager'}"] = catch(lambda: step(*batch(1, RANK == 1)))
    model, opt, sbc = setup(nonfinite="skip")
    step = make_step(model, opt, sbc, "dropin", False)
    step(*batch(0))
    before = shared(model, sbc)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step(*batch(1, RANK == 1))
    out["skip_warning"] = next((str(x.message) for x in w if "skipping" in str(x.message)),
                               None)
    out["skip_unchanged"] = shared(model, sbc) == before
    step(*batch(2))
    out["skip_after"] = shared(model, sbc)
    out["skip_syncs"] = sbc.stats()["syncs"]
    return out


class Record(keras.callbacks.Callback):
    def __init__(self, sbc):
        super().__init__()
        self.sbc, self.digests = sbc, []

    def on_train_batch_end(self, batch, logs=None):
        self.digests.append(shared(self.model, self.sbc))


def run_callback():
    model, sbc = make_model(), compressor()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=LOSS, jit_compile=False)
    rec = Record(sbc)
    xs, ys = zip(*(batch(s) for s in range(4)))
    model.fit(tf.concat(xs, 0), tf.concat(ys, 0), batch_size=16, epochs=1, verbose=0,
              shuffle=False, callbacks=[hsbc.SBCCallback(sbc), rec])
    return {"digests": rec.digests, "syncs": sbc.stats()["syncs"]}


def run_equiv():
    models = []
    for topo in (KW.get("topology", "reduce_scatter"), "allgather"):
        model, opt, sbc = setup(density=1.0, mode="values", topology=topo)
        models.append((model, make_step(model, opt, sbc, "dropin", False)))
    for s in range(4):
        for _, step in models:
            step(*batch(s))
    return {"max_abs_diff": max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in
                                zip(models[0][0].trainable_variables,
                                    models[1][0].trainable_variables))}


def run_refuse():
    model, opt, sbc = setup(topology="server")
    step = make_step(model, opt, sbc, "stock", False)
    return {"stock_server": catch(lambda: step(*batch(0)))}


MODES = {"train": run_train, "nan": run_nan, "callback": run_callback, "equiv": run_equiv,
         "refuse": run_refuse}


def run_scenario(mode, kw):
    KW.clear()
    KW.update(kw)
    result = MODES[mode]()
    result.update(rank=RANK, size=SIZE)
    return result


RESULT = scenarios(sys.argv, run_scenario)
end_job(RANK, RESULT, "tensorflow")
