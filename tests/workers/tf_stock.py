"""The stock TensorFlow tape with the optimizer known: ``hvd.DistributedGradientTape(tape,
compression=SBC(..., optimizer=opt))`` (horovod_sbc/tensorflow/hook.py, stock.py).
argv: OUT --scenarios JSON (tests/workers/common.py); writes OUT/rank<R>.json.

Scenarios (key=value: fn=0|1 (tf.function), delay, steps, density, local_residual=0|1,
opt=adam|sgd):
  adam      stock tape + Keras Adam (or SGD), SBC(density, optimizer=opt[, delay, ...]):
            after every step the sha256 of the shared weights (SBC.reference) and of the
            model; then the same run through the drop-in tape + sbc.step (same seed, data):
            its digests; stats of both.
  resume    stock tape + Adam (local residual, delay 2): 4 steps straight, and 2 steps,
            tf.train.Checkpoint(model, opt, sbc) written, a fresh model/opt/SBC restored
            (no sbc.build) and 2 more steps: the digests of the weights and the reference.
  errors    what can not work: ranks starting apart (broadcast after the first step), a
            forgotten apply_gradients, the removed momentum= knob, delay or outer without the
            optimizer, hierarchy in the gradient exchange, op=hvd.Sum; SGD with
            local_residual=False and outer= works.
"""
import hashlib
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import catch, scenarios, write_result  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

import horovod_sbc.tensorflow as hsbc  # noqa: E402

hvd.init()
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()
KW = {}
N_IN, N_OUT = 12, 4
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model(apart=True):
    keras.utils.set_random_seed(0)
    inp = keras.Input((N_IN,))
    h = keras.layers.Dense(16, activation="relu", name="fc1")(inp)
    m = keras.Model(inp, keras.layers.Dense(N_OUT, name="fc2")(h))
    if apart:  # ranks start apart: the broadcast must make them equal
        m.get_layer("fc1").kernel.assign_add(0.01 * RANK * tf.ones_like(m.get_layer("fc1").kernel))
    return m


def batch(step):
    rng = np.random.default_rng(1000 * step + RANK)
    return (tf.constant(rng.standard_normal((8, N_IN)).astype(np.float32)),
            tf.constant(rng.integers(0, N_OUT, 8)))


def digest(variables):
    h = hashlib.sha256()
    for v in variables:
        h.update(np.ascontiguousarray(np.asarray(v)).tobytes())
    return h.hexdigest()


def ref_digest(sbc):
    return digest([sbc.reference[k] for k in sorted(sbc.reference.keys())])


def make_opt():
    if KW.get("opt", "adam") == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    return keras.optimizers.Adam(1e-2)


def stock_step(model, opt, sbc, fn, **kw):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        t = hvd.DistributedGradientTape(tape, compression=sbc, num_groups=1, **kw)
        grads = t.gradient(loss, [v.value for v in model.trainable_variables])
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return tf.function(step) if fn else step


def dropin_step(model, opt, sbc, fn):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        grads = hsbc.DistributedGradientTape(tape, compression=sbc).gradient(
            loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        sbc.step(model.trainable_variables, opt)
        return loss
    return tf.function(step) if fn else step


def knobs():
    kw = dict(delay=int(KW.get("delay", 1)))
    if "local_residual" in KW:
        kw["local_residual"] = KW["local_residual"] == "1"
    return kw


def run_adam():
    fn, steps = KW.get("fn") == "1", int(KW.get("steps", 4))
    out = {}
    for api in ("stock", "dropin"):
        model, opt = make_model(), make_opt()
        sbc = hsbc.SBC(float(KW.get("density", 0.01)), optimizer=opt, **knobs())
        hsbc.broadcast_variables(model.variables, root_rank=0)
        if api == "dropin":
            sbc.build(model.trainable_variables)
        step = (stock_step if api == "stock" else dropin_step)(model, opt, sbc, fn)
        refs, weights, losses = [], [], []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for s in range(steps):
                losses.append(float(step(*batch(s))))
                refs.append(ref_digest(sbc))
                weights.append(digest(model.trainable_variables))
        out[api] = {"refs": refs, "weights": weights, "losses": losses, "stats": sbc.stats(),
                    "local_residual": sbc.local_residual,
                    "frozen": hsbc.adam.is_frozen(opt),
                    "iterations": int(opt.iterations.numpy()),
                    "warnings": [str(w.message) for w in seen
                                 if "horovod_sbc" in str(w.message)]}
    return out


def run_resume():
    fn = KW.get("fn") == "1"
    straight = None
    path = os.path.join(KW["dir"], "ckpt")  # one directory per rank
    for phase in ("straight", "first", "second"):
        model, opt = make_model(), make_opt()
        opt.build(model.trainable_variables)
        sbc = hsbc.SBC(0.05, optimizer=opt, **knobs())
        hsbc.broadcast_variables(model.variables, root_rank=0)
        ckpt = tf.train.Checkpoint(model=model, opt=opt, sbc=sbc)
        todo = range(4) if phase == "straight" else range(2) if phase == "first" else range(2, 4)
        if phase == "second":  # no sbc.build: the references are restored on creation
            ckpt.restore(path)
        step = stock_step(model, opt, sbc, fn)
        for s in todo:
            step(*batch(s))
        if phase == "first":
            ckpt.write(path)
            continue
        got = {"weights": digest(model.trainable_variables), "refs": ref_digest(sbc),
               "stats": sbc.stats(), "iterations": int(opt.iterations.numpy()),
               "outer": repr(sbc.outer),
               "outer_buffers": digest(sbc.outer.buffers[k] for k in sorted(sbc.outer.buffers))}
        if phase == "straight":
            straight = got
    return {"straight": straight, "resumed": got}


def run_errors():
    out = {}

    def stock(sbc, opt, model, broadcast=True, build=False, apply=True, **kw):
        if broadcast:
            hsbc.broadcast_variables(model.variables, root_rank=0)
        if build:
            opt.build(model.trainable_variables)
        x, y = batch(0)
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        t = hvd.DistributedGradientTape(tape, compression=sbc, num_groups=1, **kw)
        grads = t.gradient(loss, [v.value for v in model.trainable_variables])
        if apply:
            opt.apply_gradients(zip(grads, model.trainable_variables))

    def adam_case(broadcast=True, **kw):
        model, opt = make_model(), keras.optimizers.Adam(1e-2)
        return lambda: stock(hsbc.SBC(0.05, optimizer=opt, **kw), opt, model,
                             broadcast=broadcast)

    out["apart"] = catch(adam_case(broadcast=False))
    out["momentum"] = catch(lambda: hsbc.SBC(0.05, momentum="fold"))
    model, opt = make_model(), keras.optimizers.SGD(0.05, momentum=0.9)
    out["hierarchy"] = catch(lambda: stock(hsbc.SBC(0.05, hierarchy=[[0], [1]]),
                                           opt, model, build=True))
    model, opt = make_model(), keras.optimizers.Adam(1e-2)
    sbc = hsbc.SBC(0.05, optimizer=opt)

    def forgot():
        stock(sbc, opt, model)
        stock(sbc, opt, model, broadcast=False, apply=False)  # gradients never applied
        stock(sbc, opt, model, broadcast=False)
    out["forgot"] = catch(forgot)
    model, opt = make_model(), keras.optimizers.Adam(1e-2)
    out["op_sum"] = catch(lambda: stock(hsbc.SBC(0.05, optimizer=opt), opt, model, op=hvd.Sum))
    model, opt = make_model(), keras.optimizers.SGD(0.05, momentum=0.9)
    out["delay_no_opt"] = catch(lambda: stock(hsbc.SBC(0.05, delay=2), opt, model))
    model, opt = make_model(), keras.optimizers.Adam(1e-2)
    out["outer_no_opt"] = catch(lambda: stock(hsbc.SBC(0.05, outer=hsbc.Plain(lr=1.0)), opt,
                                              model))
    # the knobs of the weight exchange are taken where it runs: SGD with local_residual=False
    model, opt = make_model(), keras.optimizers.SGD(0.05, momentum=0.9)
    sbc = hsbc.SBC(0.05, optimizer=opt, local_residual=False, outer=hsbc.Plain(lr=1.0))
    out["sgd_local"] = catch(lambda: stock(sbc, opt, model))
    out["sgd_local_syncs"] = sbc.stats()["syncs"]
    return out


MODES = {"adam": run_adam, "resume": run_resume, "errors": run_errors}


def run_scenario(mode, kw):
    KW.clear()
    KW.update(kw)
    if mode == "resume" and "dir" not in KW:
        KW["dir"] = tempfile.mkdtemp()
    result = MODES[mode]()
    result.update(rank=RANK, size=SIZE)
    return result


write_result(RANK, scenarios(sys.argv, run_scenario))
