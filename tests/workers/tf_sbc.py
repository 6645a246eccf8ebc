"""TensorFlow SBC worker. argv: OUT MODE [key=value ...] (or OUT --scenarios JSON: several in
one job, see tests/workers/common.py); writes OUT/rank<R>.json.

Modes:
  train   several training runs in one job (api=stock|dropin, eager or tf.function, delay), each
          recording the sha256 of all model variables after every step, stats and the bytes the
          allgathers actually moved; a density-1 run beside a dense Horovod run; the step
          messages of one sync decoded by the PyTorch adapter's decoder (interop).
  errors  bad configurations, a NaN on the last rank (eager, tf.function, stock, Keras fit),
          nonfinite="skip"; records each rank's error text.
  save / load  checkpoint (tf.train.Checkpoint of model, optimizer, SBC) mid-delay-window on every
          rank and continue (save: uninterrupted; load: in a new process from the checkpoint).
"""
import hashlib
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import catch, scenarios, write_result  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

import horovod_sbc.tensorflow as hsbc  # noqa: E402
from horovod_sbc.tensorflow.owner import entries as tf_entries  # noqa: E402
from horovod_sbc.tensorflow.sync import exchange  # noqa: E402
from horovod_sbc.tensorflow.backend import host as tf_host  # noqa: E402

MODE, KW = None, {}  # of the scenario running


def SBC(*args, **kw):
    """These jobs check the exchange itself: bit-identical weights after every sync, which is
    ``local_residual=False`` (the default, True, is tests/workers/tf_train.py's)."""
    kw.setdefault("local_residual", False)
    return hsbc.SBC(*args, **kw)


hvd.init()
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()

# Record, as graph ops (so it also counts inside tf.function), every step message this rank
# sends and every gathered buffer it receives; keep the last gathered buffer seen eagerly.
REC = {"sent": tf.Variable(0, dtype=tf.int64), "received": tf.Variable(0, dtype=tf.int64)}
LAST = {}
_allgather = exchange.allgather


def _recording_allgather(step, name):
    out = _allgather(step, name)
    sent = tf.size(step, out_type=tf.int64)
    ops = [REC["sent"].assign_add(sent),
           REC["received"].assign_add(tf.size(out, out_type=tf.int64) - sent)]
    if tf.executing_eagerly():
        LAST["gathered"] = out.numpy().tobytes()
    with tf.control_dependencies(ops):
        return tf.identity(out)


exchange.allgather = _recording_allgather


PARSES = [0]  # host parses of gathered steps (one per exchange), in this process


def _counting_parse(orig):
    def parse_host(*a, **kw):
        PARSES[0] += 1
        return orig(*a, **kw)
    return parse_host


tf_host.parse_host = _counting_parse(tf_host.parse_host)


def rec_reset():
    for v in REC.values():
        v.assign(0)


def rec_value():
    return {k: int(v.numpy()) for k, v in REC.items()}


N_IN, N_OUT = 20, 5


def make_model(aux=True):
    keras.utils.set_random_seed(0)
    inp = keras.Input((N_IN,))
    h = keras.layers.Dense(32, activation="relu", name="fc1")(inp)
    out = keras.layers.Dense(N_OUT, name="fc2")(h)
    outs = [out]
    if aux:  # a head used only on some steps (and ranks): its gradients are None then
        outs.append(keras.layers.Dense(N_OUT, name="aux")(h))
    m = keras.Model(inp, outs if aux else out)
    # ranks start from different weights: the broadcast must make them equal
    m.get_layer("fc1").kernel.assign_add(0.01 * RANK * tf.ones_like(m.get_layer("fc1").kernel))
    return m


def batch(step):
    rng = np.random.default_rng(1000 * step + RANK)
    x = rng.standard_normal((16, N_IN)).astype(np.float32)
    y = rng.integers(0, N_OUT, 16)
    return tf.constant(x), tf.constant(y)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def digest(model):
    h = hashlib.sha256()
    for v in sorted(model.variables, key=lambda v: v.path):
        h.update(v.path.encode())
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()


def make_step(model, opt, api, sbc, fn, delay, groups=None):
    def step(x, y, use_aux: bool):
        with tf.GradientTape() as tape:
            outs = model(x)
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            loss = LOSS(y, outs[0])
            if use_aux:
                loss = loss + LOSS(y, outs[1])
        if api == "stock":
            t = hvd.DistributedGradientTape(tape, compression=sbc, groups=groups)
            variables = [v.value for v in model.trainable_variables]  # upstream #4290 workaround
            grads = t.gradient(loss, variables)
        elif api == "dense":
            t = hvd.DistributedGradientTape(tape)
            grads = t.gradient(loss, [v.value for v in model.trainable_variables])
        else:
            t = hsbc.DistributedGradientTape(tape, compression=sbc)
            grads = t.gradient(loss, model.trainable_variables)  # Keras 3 variables directly
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if api == "dropin":  # weight mode at every delay: sync every delay-th step
            sbc.step(model.trainable_variables)
        return loss
    return tf.function(step) if fn else step


def use_aux_at(api, s):
    # stock Horovod needs the same set of gradients on every rank; the drop-in treats None as 0
    return api == "dropin" and (s + RANK) % 3 == 0


def run_one(api, fn, delay, steps, density=0.05, momentum=0.9, lr=0.05,
            aux=None, mode="sbc", fixed_size=False, groups=None):
    t0 = time.perf_counter()
    rec_reset()
    parses0 = PARSES[0]
    aux = api == "dropin" if aux is None else aux
    model = make_model(aux=aux)
    opt = keras.optimizers.SGD(lr, momentum=momentum)
    sbc = SBC(density=density, delay=delay, mode=mode,
              fixed_size=fixed_size) if api != "dense" else None
    hsbc.broadcast_variables(model.variables, root_rank=0)
    step = make_step(model, opt, api, sbc, fn, delay, groups)
    digests, losses = [digest(model)], []
    for s in range(steps):
        x, y = batch(s)
        losses.append(float(step(x, y, aux and use_aux_at(api, s))))
        digests.append(digest(model))
    numel = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return model, {"digests": digests, "losses": losses, "stats": sbc.stats() if sbc else None,
                   "gathered": rec_value(), "numel": numel,
                   "host_parses": PARSES[0] - parses0,
                   "n_tensors": len(model.trainable_variables),
                   "backend": sbc.backend.name if sbc is not None and sbc.backend else None,
                   "seconds": time.perf_counter() - t0}


MODE_STEPS = 4  # of the other compressors' runs (tests/test_tensorflow.py)


def run_train():
    steps = int(KW.get("steps", 8))
    out = {}
    for spec in KW.get("runs", "stock-eager-1,stock-fn-1,dropin-eager-1,dropin-fn-1,"
                               "dropin-fn-3").split(","):
        api, mode, delay = spec.split("-")
        _, out[spec] = run_one(api, mode == "fn", int(delay), steps)
    for spec in KW.get("grouped", "").split(",") if KW.get("grouped") else []:
        # the stock tape with Horovod's grouped allreduce: one exchange per group
        api, mode, delay = spec.split("-")
        _, out["grouped:" + spec] = run_one(api, mode == "fn", int(delay), steps, groups=1)
    for spec in KW.get("fixed", "").split(",") if KW.get("fixed") else []:
        # the same runs with fixed-size (padded) step messages
        api, mode, delay = spec.split("-")
        _, out["fixed:" + spec] = run_one(api, mode == "fn", int(delay), steps, fixed_size=True)
    if "equiv" in KW:  # density 1, no binarization: the same as dense averaging
        m1, _ = run_one("dense", True, 1, 4, momentum=0.0, aux=False)
        m2, r2 = run_one("dropin", True, 1, 4, density=1.0, mode="values", momentum=0.0,
                         aux=False)
        worst = max(float(np.max(np.abs(a.numpy() - b.numpy())))
                    for a, b in zip(m1.trainable_variables, m2.trainable_variables))
        out["equiv"] = {"max_abs_diff": worst, "digest": r2["digests"][-1]}
    if "interop" in KW:
        out["interop"] = run_interop()
    for spec in KW.get("modes", "").split(",") if KW.get("modes") else []:
        # another compressor through the drop-in tape
        mode, how = spec.split("-")
        _, out[f"{mode}:dropin-{how}-1"] = run_one("dropin", how == "fn", 1, MODE_STEPS,
                                                    mode=mode)
    return out


def run_interop():
    """One real sync against the PyTorch adapter: torch encodes the same update into the same
    bytes, and decodes the gathered buffer into the same average."""
    import torch
    from horovod_sbc import protocol, wire
    from horovod_sbc.torch.backend import Targets, backend_for, frame as tframe
    model = make_model(aux=False)
    sbc = SBC(density=0.05)
    hsbc.broadcast_variables(model.variables)
    tvars = model.trainable_variables
    x, y = batch(0)
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x))
    local = [g.numpy().reshape(-1) for g in tape.gradient(loss, tvars)]  # this rank's update
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x))
    grads = sbc.exchange_gradients(list(tvars), tape.gradient(loss, tvars))
    order = sorted(range(len(tvars)), key=lambda i: tvars[i].path)
    layout = [(tvars[i].path, tuple(tvars[i].shape)) for i in order]
    buf = bytes(LAST["gathered"])
    # this rank's step message as the PyTorch adapter encodes and frames the same update
    tb = backend_for("cpu")
    msgs = [tb.encode_tensor(torch.from_numpy(local[i].copy()), 0.05, "sbc",
                             tvars[i].path).message for i in order]
    mine = tframe.frame(msgs, wire.layout_fingerprint(layout), "cpu").numpy().tobytes()
    s, e = protocol.split(buf, SIZE)[RANK]
    dec = tb.decode(torch.frombuffer(bytearray(buf), dtype=torch.uint8), layout, SIZE,
                    Targets.new(layout, torch.float32, "cpu"), 1.0 / SIZE)
    same = all(np.array_equal(d.numpy(), grads[i].numpy().reshape(-1))
               for d, i in zip(dec, order))
    return {"torch_decodes_identically": same, "torch_encodes_identically": mine == buf[s:e],
            "nonzero": int(sum(int((d != 0).sum()) for d in dec))}


def nan_batch(s, poison):
    x, y = batch(s)
    if poison:
        x = tf.tensor_scatter_nd_update(x, [[0, 0]], [float("nan")])
    return x, y


def run_errors():
    out = {}
    last = SIZE - 1

    def stock(sbc, **kw):
        model = make_model(aux=False)
        x, y = batch(0)
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        t = hvd.DistributedGradientTape(tape, compression=sbc, **kw)
        t.gradient(loss, [v.value for v in model.trainable_variables])

    out["delay_stock"] = catch(lambda: stock(SBC(density=0.1, delay=2)))
    out["adasum"] = catch(lambda: stock(SBC(density=0.1), op=hvd.Adasum))
    out["groups"] = catch(lambda: stock(SBC(density=0.1), groups=1))  # grouped: still works
    # the stock tape says once per object that it exchanges gradients, naming the drop-in
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sbc = SBC(density=0.1)
        stock(sbc)
        stock(sbc)
    out["stock_warnings"] = [str(w.message) for w in seen if "horovod_sbc" in str(w.message)]
    with warnings.catch_warnings(record=True) as seen:  # grouped: no advice to group
        warnings.simplefilter("always")
        sbc = SBC(density=0.1)
        stock(sbc, groups=1)
        stock(sbc, groups=1)
    out["grouped_warnings"] = [str(w.message) for w in seen if "horovod_sbc" in str(w.message)]
    out["density"] = catch(lambda: SBC(density=0))
    out["wrong_compression"] = catch(
        lambda: hsbc.DistributedGradientTape(tf.GradientTape(), compression=hvd.Compression.fp16))

    def plain_tensor():
        x = tf.constant([1.0, 2.0])
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(x * x)
        hsbc.DistributedGradientTape(tape, compression=SBC()).gradient(loss, [x])
    out["plain_tensor"] = catch(plain_tensor)

    # delay > 1: forgetting sbc.step() after applying the gradients is caught
    model = make_model(aux=False)
    sbc = SBC(density=0.1, delay=2)

    def forget_step():
        for s in range(2):
            x, y = batch(s)
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x))
            hsbc.DistributedGradientTape(tape, compression=sbc).gradient(
                loss, model.trainable_variables)
    out["forgot_step"] = catch(forget_step)

    # one SBC object, two ways of using it: their residuals would mix
    model = make_model(aux=False)
    sbc = SBC(density=0.1)
    x, y = batch(0)
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x))
    hsbc.DistributedGradientTape(tape, compression=sbc).gradient(loss, model.trainable_variables)
    out["mixed_modes"] = catch(lambda: stock(sbc))

    # NaN on the last rank: every rank raises, naming that rank and the variable
    for key, fn in (("nan_eager", False), ("nan_fn", True)):
        model = make_model(aux=False)
        opt = keras.optimizers.SGD(0.05)
        sbc = SBC(density=0.1)
        hsbc.broadcast_variables(model.variables)
        step = make_step(model, opt, "dropin", sbc, fn, 1)
        x, y = nan_batch(0, RANK == last)
        out[key] = catch(lambda: step(x, y, False))
        out[key + "_stats"] = sbc.stats()

    # Keras model.fit with the callback, NaN in the last rank's data
    model = make_model(aux=False)
    kmodel = model
    kmodel.compile(optimizer=keras.optimizers.SGD(0.05), loss=LOSS, jit_compile=False)
    x, y = nan_batch(0, RANK == last)
    out["nan_keras"] = catch(lambda: kmodel.fit(x, y, batch_size=16, epochs=1, verbose=0,
                                                callbacks=[hsbc.SBCCallback(hsbc.SBC(0.1))]))

    # nonfinite="skip": the sync is skipped everywhere, training continues, ranks stay identical
    model = make_model(aux=False)
    opt = keras.optimizers.SGD(0.05)
    sbc = SBC(density=0.1, delay=2, nonfinite="skip")
    hsbc.broadcast_variables(model.variables)
    step = make_step(model, opt, "dropin", sbc, False, 2)
    step(*batch(0), False)  # a local step
    ref_before = {k: v.numpy().copy() for k, v in sbc.reference.items()}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        step(*nan_batch(1, RANK == last), False)  # the sync: skipped
    msgs = [str(m.message) for m in w if "horovod_sbc" in str(m.message)]
    out["skip_warning"] = msgs[0] if msgs else None
    out["skip_back_to_reference"] = all(
        np.array_equal(v.numpy(), ref_before[v.path]) for v in model.trainable_variables)
    out["skip_residual_finite"] = all(bool(np.all(np.isfinite(r.numpy())))
                                      for r in sbc.residuals.values())
    for s in (2, 3):
        step(*batch(s), False)
    out["skip_after"] = digest(model)
    out["skip_finite"] = all(bool(np.all(np.isfinite(v.numpy()))) for v in model.variables)
    out["skip_stats"] = sbc.stats()

    # stock path inside Horovod's graph: last, it leaves the NaN step's other collectives behind
    model = make_model(aux=False)
    opt = keras.optimizers.SGD(0.05)
    sbc = SBC(density=0.1)
    hsbc.broadcast_variables(model.variables)
    step = make_step(model, opt, "stock", sbc, True, 1)
    x, y = nan_batch(0, RANK == last)
    out["nan_stock"] = catch(lambda: step(x, y, False))
    return out


def ckpt_dir(rank=None):
    rank = RANK if rank is None else rank
    return os.path.join(KW["ckpt"], KW.get("outer", "plain"), f"rank{rank}")


def run_save_load():
    delay, first, more = 3, 7, 10
    model = make_model(aux=False)
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    outer = OUTERS[KW.get("outer", "plain")]
    sbc = SBC(density=0.05, delay=delay, outer=outer())
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, sbc=sbc)
    step = make_step(model, opt, "dropin", sbc, True, delay)
    if MODE == "save":
        hsbc.broadcast_variables(model.variables)
        for s in range(first):
            step(*batch(s), False)
        ckpt.write(os.path.join(ckpt_dir(), "ckpt"))
    else:
        # a new process: no broadcast (the ranks' local weights differ mid-window); the SBC state
        # variables do not exist yet and are restored when created (deferred restoration)
        ckpt.read(os.path.join(ckpt_dir(), "ckpt")).assert_nontrivial_match()
    at_ckpt = {"digest": digest(model), "stats": sbc.stats(),
               "local_steps": int(sbc.local_steps.numpy())}
    digests = []
    for s in range(first, first + more):
        step(*batch(s), False)
        digests.append(digest(model))
    out = {"digests": digests, "at_checkpoint": at_ckpt, "stats": sbc.stats()}
    path = os.path.join(ckpt_dir(), "ckpt")
    if MODE == "save":
        out["saved"] = [n for n, _ in tf.train.list_variables(path)]
        return out
    # control: the same checkpoint without the SBC state does not continue the same way
    model = make_model(aux=False)
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    sbc = SBC(density=0.05, delay=delay, outer=outer())
    tf.train.Checkpoint(model=model, optimizer=opt).read(path).expect_partial()
    sbc.build(model.trainable_variables)
    step = make_step(model, opt, "dropin", sbc, True, delay)
    control = []
    for s in range(first, first + more):
        step(*batch(s), False)
        control.append(digest(model))
    out["without_sbc_state"] = control
    # another rank's SBC state is refused
    other = SBC(density=0.05, delay=delay)
    tf.train.Checkpoint(sbc=other).read(
        os.path.join(ckpt_dir((RANK + 1) % SIZE), "ckpt")).expect_partial()
    out["other_rank"] = catch(lambda: other.build(make_model(aux=False).trainable_variables))
    return out


OUTERS = {"plain": hsbc.Plain, "nesterov": lambda: hsbc.Nesterov(1.0, 0.5),
          "decay": lambda: hsbc.ErrorDecay(decay=0.5, lr=0.8), "plain2": lambda: hsbc.Plain(2.0)}


def run_outer():
    """Weight mode (delay 2, eager) with each outer step, on dense values (``mode="values"``,
    density 1: every rank's window update is sent exactly and its residual is zero): per sync,
    this rank's weights before the sync, ``W_ref`` and Nesterov's buffers before and after.
    The momentum-free inner SGD keeps a rank's window update a function of its weights."""
    out = {}
    for kind, make in OUTERS.items():
        model = make_model(aux=False)
        opt = keras.optimizers.SGD(0.05)
        sbc = SBC(density=1.0, delay=2, mode="values", outer=make())
        hsbc.broadcast_variables(model.variables, root_rank=0)
        sbc.build(model.trainable_variables)
        names = [n for n, _, _ in tf_entries(model.trainable_variables)]
        variables = {n: v for n, v, _ in tf_entries(model.trainable_variables)}
        snap = lambda d: {n: d[n].numpy().ravel().tolist() for n in names}  # noqa: E731
        bufs = lambda: snap(sbc.outer.buffers) if kind == "nesterov" and \
            sbc.outer.buffers else None  # noqa: E731
        syncs = []
        for s in range(6):
            x, y = batch(s)
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x))
            grads = hsbc.DistributedGradientTape(tape, compression=sbc).gradient(
                loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            due = (s + 1) % 2 == 0
            if due:
                rec = {"w": snap(variables), "ref_before": snap(sbc.reference),
                       "v_before": bufs()}
            sbc.step(model.trainable_variables)
            if due:
                rec.update(ref_after=snap(sbc.reference), v_after=bufs(),
                           res=snap(sbc.residuals))
                syncs.append(rec)
        out[kind] = {"syncs": syncs, "digest": digest(model), "stats": sbc.stats()}
    # the outer step belongs to weight mode: the stock tape refuses it on every rank
    sbc = SBC(outer=hsbc.Nesterov())
    x, y = batch(0)
    model = make_model(aux=False)
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x))
    out["stock_refused"] = catch(lambda: hvd.DistributedGradientTape(
        tape, compression=sbc).gradient(loss, [v.value for v in model.trainable_variables]))
    return out


def run_exact():
    """Keras SGD momentum 0.9 through an exact exchange (``mode="values"``, density 1) with the
    default placement of the residual, beside a dense replica on every rank (the same model and
    optimizer stepping on Horovod's allreduce of the gradients) and a rank alone (its own
    gradients): per step the largest difference of the SBC model from each, whether both ranks
    hold the same SBC weights, and the SBC optimizer's largest velocity. The drop-in tape
    (heavy ball eagerly, Nesterov in tf.function) and the stock tape given the optimizer (heavy
    ball eagerly, Nesterov with weight decay in tf.function with ``groups=1``); the warnings."""
    out = {}
    for kind, nesterov, fn, stock in (("heavy", False, False, False),
                                      ("nesterov", True, True, False),
                                      ("stock_heavy", False, False, True),
                                      ("stock_nesterov", True, True, True)):
        wd = 0.01 if kind == "stock_nesterov" else None
        models = [make_model(aux=False) for _ in range(3)]  # SBC, dense replica, alone
        for m in models[1:]:
            m.set_weights(models[0].get_weights())
        opts = [keras.optimizers.SGD(0.05, momentum=0.9, nesterov=nesterov, weight_decay=wd)
                for _ in models]
        sbc = hsbc.SBC(density=1.0, delay=1, mode="values",
                       optimizer=opts[0] if stock else None)
        for m in models:
            hsbc.broadcast_variables(m.variables, root_rank=0)
        if not stock:
            sbc.build(models[0].trainable_variables)
        variables = [[v.value for v in m.trainable_variables] for m in models]

        def train(x, y):
            grads = []
            for i, (m, opt) in enumerate(zip(models, opts)):
                with tf.GradientTape() as tape:
                    loss = LOSS(y, m(x))
                if i == 0 and stock:
                    g = hvd.DistributedGradientTape(tape, compression=sbc, groups=1 if fn
                                                    else None).gradient(loss, variables[0])
                elif i == 0:
                    g = hsbc.DistributedGradientTape(tape, compression=sbc).gradient(
                        loss, m.trainable_variables)
                else:
                    g = tape.gradient(loss, variables[i])
                    if i == 1:
                        g = [hvd.allreduce(t, name=f"dense.{j}") for j, t in enumerate(g)]
                opt.apply_gradients(zip(g, m.trainable_variables))
                if i == 0 and not stock:
                    sbc.step(m.trainable_variables, opt)
                grads.append(g)
            return grads

        train = tf.function(train) if fn else train
        steps = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for s in range(4):
                train(*batch(s))
                w = [np.concatenate([v.numpy().ravel() for v in vs]) for vs in variables]
                steps.append({"from_dense": float(np.max(np.abs(w[0] - w[1]))),
                              "from_alone": float(np.max(np.abs(w[0] - w[2]))),
                              "digest": digest(models[0]),
                              "velocity": max(float(np.max(np.abs(m.numpy())))
                                              for m in opts[0].momentums)})
        out[kind] = {"steps": steps, "local_residual": sbc.local_residual,
                     "warnings": [str(w.message) for w in seen
                                  if "exchanges sparse" in str(w.message)]}
    return out


MODES = {"train": run_train, "errors": run_errors, "save": run_save_load,
         "load": run_save_load, "outer": run_outer, "exact": run_exact}


def run_scenario(mode, kw):
    global MODE, KW
    MODE, KW = mode, kw
    rec_reset()
    result = MODES[mode]()
    result.update(rank=RANK, size=SIZE)
    return result


write_result(RANK, scenarios(sys.argv, run_scenario))
