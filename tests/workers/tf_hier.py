"""TensorFlow's hierarchical exchange (``SBC(hierarchy=[[0, 1], [2, 3]])``, weight mode) on one
4-rank job: 2 "nodes" of 2 ranks. argv: OUT [mixed]; writes OUT/rank<R>.json.

Parts (each recorded under its own key):
  errors    bad groupings and combinations: the message each rank raised
  stored    ``local_residual=False``, eager, delay 2, SGD momentum: after every step the sha256
            of the weights and (after a sync) of the shared weights, whether the weights are
            the shared weights; the residual pieces' names and norms, stats(), the
            checkpoint's keys; a tf.train.Checkpoint mid-delay, restored into a fresh model,
            optimizer and SBC, which take the same steps
  in_weights  ``local_residual=True`` in tf.function, delay 2 (no checkpoint)
  scatter   as ``stored`` with ``topology="reduce_scatter"`` across the nodes, in tf.function:
            also the downlink residuals' names and norms at the checkpoint, their sha256 at
            the end of the run and of the resumed run
            each then ends with ``finish`` right after a sync (``average_residuals=True``):
            the weights' sha256, their distance to torch's rule computed here from the state
            before (``W_ref`` + the mean over ranks of ``W - W_ref`` with the residual in the
            weights, else of the residual pieces times the node size)
  nonfinite a NaN on rank 3 (``nonfinite="raise"``: every rank's error) and on rank 1
            (``"skip"``: every rank skips, then syncs again); ``nonfinite_rs`` the same with
            ``topology="reduce_scatter"``
  fit       Keras fit with SBCCallback: the shared weights' sha256 after every batch

``mixed`` (argv[2]): even ranks TensorFlow, odd ranks torch's drop-in, one job: 3 syncs of
deterministic updates through the hierarchy, the shared weights' sha256 after each; then the
same with ``topology="reduce_scatter"`` across the nodes [[0, 3], [1, 2]], whose cross-node
sets (0, 1) and (2, 3) pair a TensorFlow rank with a torch rank (key ``scatter``: also the
downlink residuals' names).
"""
import hashlib
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import catch, end_job  # noqa: E402

import numpy as np  # noqa: E402

GROUPS = [[0, 1], [2, 3]]
MIXED_RS = [[0, 3], [1, 2]]  # the mixed job's reduce-scatter: every cross-node set is TF + torch
DELAY, FIRST, MORE = 2, 3, 4  # the checkpoint falls mid-delay (syncs after steps 2, 4, 6)
N_IN, N_HID, N_OUT = 12, 16, 4
RANK_ENV = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))


def sha(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
    return h.hexdigest()


# -- the mixed job ---------------------------------------------------------------------------
SHAPES = {"a": (300,), "b": (10, 5)}


def update(rank, s):
    rng = np.random.default_rng(100 * s + rank)
    return {n: rng.standard_normal(sh).astype(np.float32) for n, sh in SHAPES.items()}


def declared(hierarchy_process_sets):
    """Every process set of both groupings, once each, in the same order on every rank."""
    out = []
    for ps in hierarchy_process_sets(GROUPS) + hierarchy_process_sets(MIXED_RS):
        if all(ps is not q for q in out):
            out.append(ps)
    return out


def mixed_tf():
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import horovod_sbc.tensorflow as hsbc
    from horovod_sbc.tensorflow.hierarchy import hierarchy_process_sets
    hvd.init(process_sets=declared(hierarchy_process_sets))
    rank = hvd.rank()
    out = {"framework": "tf"}
    for key, groups, topology in (("allgather", GROUPS, "allgather"),
                                  ("scatter", MIXED_RS, "reduce_scatter")):
        ws = {n: tf.Variable(tf.zeros(sh), name=n) for n, sh in SHAPES.items()}
        sbc = hsbc.SBC(density=0.05, local_residual=False, hierarchy=groups,
                       outer=hsbc.Plain(), topology=topology)
        sbc.build(list(ws.values()))
        rec = {"digests": [], "weights": []}
        for s in range(3):
            for n, u in update(rank, s).items():
                ws[n].assign_add(u)
            sbc.synchronize(list(ws.values()))
            rec["digests"].append(sha([sbc.reference[n].numpy() for n in sorted(SHAPES)]))
            rec["weights"].append(sha([ws[n].numpy() for n in sorted(SHAPES)]))
        rec["stats"] = sbc.stats()
        rec["downlink"] = sorted(sbc.server_residuals.keys())
        if key == "allgather":
            out.update(rec)
        else:
            out["scatter"] = rec
    return rank, out


def mixed_torch():
    import torch
    import horovod.torch as hvd
    import horovod_sbc.torch as sbc
    hvd.init(process_sets=declared(sbc.hierarchy_process_sets))
    torch.set_num_threads(1)
    rank = hvd.rank()
    out = {"framework": "torch"}
    for key, groups, topology in (("allgather", GROUPS, "allgather"),
                                  ("scatter", MIXED_RS, "reduce_scatter")):
        ps = {n: torch.nn.Parameter(torch.zeros(sh)) for n, sh in SHAPES.items()}
        opt = sbc.DistributedOptimizer(
            torch.optim.SGD(list(ps.values()), lr=1.0), list(ps.items()),
            compression=sbc.SBC(density=0.05, local_residual=False, hierarchy=groups,
                                outer=sbc.Plain(), topology=topology))
        rec = {"digests": [], "weights": []}
        ref = opt.compression.manager.reference
        for s in range(3):
            for n, u in update(rank, s).items():
                ps[n].grad = -torch.from_numpy(u)  # SGD(lr=1): W + u, as TF's assign_add
            opt.step()
            rec["digests"].append(sha([ref[n].numpy() for n in sorted(SHAPES)]))
            rec["weights"].append(sha([ps[n].detach().numpy() for n in sorted(SHAPES)]))
        rec["stats"] = opt.stats()
        rec["downlink"] = sorted(opt.compression.manager.server_residuals.keys())
        if key == "allgather":
            out.update(rec)
        else:
            out["scatter"] = rec
    return rank, out


if len(sys.argv) > 2 and sys.argv[2] == "mixed":
    if RANK_ENV % 2 == 0:
        end_job(*mixed_tf(), "tensorflow")
    else:
        end_job(*mixed_torch(), "torch")
    sys.exit(0)

# -- the TensorFlow job ----------------------------------------------------------------------
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

import horovod_sbc.tensorflow as hsbc  # noqa: E402
from horovod_sbc.tensorflow.hierarchy import hierarchy_process_sets  # noqa: E402

hvd.init(process_sets=hierarchy_process_sets(GROUPS))
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.threading.set_intra_op_parallelism_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CKPT = tempfile.mkdtemp(prefix=f"sbc-tfhier-{RANK}-")


def make_model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((N_IN,))
    h = keras.layers.Dense(N_HID, activation="relu", name="fc1")(inp)
    return keras.Model(inp, keras.layers.Dense(N_OUT, name="fc2")(h))


def batch(step, nan=False):
    rng = np.random.default_rng(1000 * step + RANK)
    x = rng.standard_normal((16, N_IN)).astype(np.float32)
    if nan:
        x[0, 0] = np.nan
    w = np.random.default_rng(123).standard_normal((N_IN, N_OUT))
    return tf.constant(x), tf.constant(np.argmax(np.nan_to_num(x) @ w, 1))


def shared(sbc):
    return sha([sbc.reference[k].numpy() for k in sorted(sbc.reference.keys())])


def build(hierarchy=GROUPS, broadcast=True, **kw):
    model = make_model()
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    sbc = hsbc.SBC(density=0.05, delay=kw.pop("delay", DELAY), hierarchy=hierarchy, **kw)
    if broadcast:
        hsbc.broadcast_variables(model.variables, root_rank=0)
        sbc.build(model.trainable_variables)
    return model, opt, sbc


def make_step(model, opt, sbc, fn=False):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        grads = hsbc.DistributedGradientTape(tape, compression=sbc).gradient(
            loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        sbc.step(model.trainable_variables, opt)
        return loss
    return tf.function(step) if fn else step


def new_rec():
    return {"losses": [], "weights": [], "shared": [], "on_shared": []}


def train(model, sbc, step, start, steps, rec):
    for s in range(start, start + steps):
        rec["losses"].append(float(step(*batch(s))))
        rec["weights"].append(sha([v.numpy() for v in model.trainable_variables]))
        if int(sbc.local_steps.numpy()) == 0:
            rec["shared"].append(shared(sbc))
            rec["on_shared"].append(all(
                np.array_equal(v.numpy(), sbc.reference[n].numpy())
                for n, v in zip(names(model), model.trainable_variables)))


def names(model):
    from horovod_sbc.tensorflow.owner import entries
    by_index = {i: n for n, _, i in entries(model.trainable_variables)}
    return [by_index[i] for i in range(len(model.trainable_variables))]


def part_errors():
    def attempt(hierarchy, dtype="float32", **kw):
        def go():
            v = tf.Variable(tf.zeros([4], dtype), name="w")
            sbc = hsbc.SBC(hierarchy=hierarchy, **kw)
            sbc.build([v])
            v.assign_add(tf.ones([4], dtype))
            sbc.step([v], keras.optimizers.SGD(0.1))
        return catch(go)
    mine = GROUPS if RANK < 2 else [[0, 2], [1, 3]]
    return {"missing": attempt([[0, 1], [2]]),
            "uneven": attempt([[0, 1, 2], [3]]),
            "twice": attempt([[0, 1], [1, 2, 3]]),
            "node": attempt("node"),
            "server": attempt(GROUPS, topology="server"),
            "disagree": attempt(mine),
            "fp16": attempt(GROUPS, dtype="float16"),
            "undeclared": attempt([[0, 3], [1, 2]])}


def downlink(sbc):
    return sha([sbc.server_residuals[k].numpy() for k in sorted(sbc.server_residuals.keys())])


def run_config(local_residual, fn, checkpoint, **kw):
    model, opt, sbc = build(local_residual=local_residual, **kw)
    step = make_step(model, opt, sbc, fn)
    rec = new_rec()
    train(model, sbc, step, 0, FIRST, rec)
    if checkpoint:
        path = tf.train.Checkpoint(model=model, optimizer=opt, sbc=sbc).write(
            os.path.join(CKPT, "ckpt"))
    rec["residuals"] = {k: float(np.abs(v.numpy()).sum()) for k, v in sbc.residuals.items()}
    rec["downlink"] = {k: float(np.abs(v.numpy()).sum())
                       for k, v in sbc.server_residuals.items()}
    train(model, sbc, step, FIRST, MORE, rec)
    rec["stats"] = sbc.stats()
    rec["downlink_end"] = downlink(sbc)
    rec["numel"] = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    rec["local_residual"] = sbc.local_residual
    if checkpoint:
        rec["keys"] = sorted(k for k, _ in tf.train.list_variables(path)
                             if k.startswith("sbc/"))
        m2, o2, s2 = build(local_residual=local_residual, broadcast=False, **kw)
        tf.train.Checkpoint(model=m2, optimizer=o2, sbc=s2).read(path).assert_nontrivial_match()
        again = new_rec()
        again["local_steps"] = int(s2.local_steps.numpy())
        train(m2, s2, make_step(m2, o2, s2, fn), FIRST, MORE, again)
        again["stats"] = s2.stats()
        again["downlink_end"] = downlink(s2)
        rec["resumed"] = again
        # the same state under another grouping is refused
        m3, o3, s3 = build(hierarchy=[[0, 2], [1, 3]], broadcast=False,
                           local_residual=local_residual, **kw)
        tf.train.Checkpoint(model=m3, optimizer=o3, sbc=s3).read(path).expect_partial()
        rec["regrouped"] = catch(lambda: make_step(m3, o3, s3)(*batch(0)))
    rec["finish"] = finish_after_sync(model, sbc)
    return rec


def finish_after_sync(model, sbc):
    """``sbc.finish`` after a sync, against torch's rule applied here to the state before."""
    variables = model.trainable_variables
    if int(sbc.local_steps.numpy()) > 0:
        sbc.synchronize(variables)
    nm, node = names(model), len(GROUPS[0])
    ref = {n: sbc.reference[n].numpy().astype(np.float64).reshape(-1) for n in nm}
    if sbc.local_residual:  # the node's residual is in the weights
        share = {n: v.numpy().astype(np.float64).reshape(-1) - ref[n]
                 for n, v in zip(nm, variables)}
    else:  # this rank's residual pieces, "name[a:b]", times the node size
        share = {n: np.zeros_like(ref[n]) for n in nm}
        for key, r in sbc.residuals.items():
            name, span = key[:-1].rsplit("[", 1)
            a, b = (int(x) for x in span.split(":"))
            share[name][a:b] = r.numpy().astype(np.float64) * node
    mine = np.concatenate([share[n] for n in nm])
    every = hvd.allgather(tf.constant(mine[None]), name="test.finish.shares").numpy()
    expected = np.concatenate([ref[n] for n in nm]) + every.mean(0)
    sbc.finish(variables, average_residuals=True)
    after = np.concatenate([v.numpy().reshape(-1) for v in variables]).astype(np.float64)
    return {"digest": sha([v.numpy() for v in variables]),
            "max_error": float(np.abs(after - expected).max()),
            "moved": float(np.abs(every.mean(0)).max()),
            "on_shared": all(np.array_equal(v.numpy(), sbc.reference[n].numpy())
                             for n, v in zip(nm, variables)),
            "residuals": {k: float(np.abs(r.numpy()).sum()) for k, r in sbc.residuals.items()}}


def part_nonfinite(**kw):
    """A NaN written into a weight after the optimizer's step (its velocity stays finite)."""
    out = {}
    for mode, bad_rank in (("raise", 3), ("skip", 1)):
        model, opt, sbc = build(nonfinite=mode, delay=1, local_residual=True, **kw)

        def step(s, nan=False):
            x, y = batch(s)
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x))
            grads = hsbc.DistributedGradientTape(tape, compression=sbc).gradient(
                loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            if nan:
                bias = model.get_layer("fc2").bias
                bias.assign(tf.tensor_scatter_nd_update(bias, [[1]], [float("nan")]))
            sbc.step(model.trainable_variables, opt)
        step(0)
        before = shared(sbc)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            err = catch(lambda: step(1, RANK == bad_rank))
        out[mode] = {"error": err, "unchanged": shared(sbc) == before,
                     "warnings": [str(w.message) for w in caught]}
        if mode == "skip":
            out[mode]["finite"] = all(bool(np.isfinite(v.numpy()).all())
                                      for v in model.trainable_variables)
            step(2)
            out[mode]["after"] = shared(sbc)
            out[mode]["syncs"] = sbc.stats()["syncs"]
    return out


class Record(keras.callbacks.Callback):
    def __init__(self, sbc):
        super().__init__()
        self.sbc, self.digests = sbc, []

    def on_train_batch_end(self, batch, logs=None):
        self.digests.append(shared(self.sbc))


def part_fit():
    model = make_model()
    sbc = hsbc.SBC(density=0.05, hierarchy=GROUPS)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=LOSS, jit_compile=False)
    rec = Record(sbc)
    xs, ys = zip(*(batch(s) for s in range(4)))
    model.fit(tf.concat(xs, 0), tf.concat(ys, 0), batch_size=16, epochs=1, verbose=0,
              shuffle=False, callbacks=[hsbc.SBCCallback(sbc), rec])
    return {"digests": rec.digests, "stats": sbc.stats()}


import time  # noqa: E402
result = {"rank": RANK, "size": SIZE, "path": hsbc.__file__, "seconds": {}}
for key, fn in (("errors", part_errors),
                ("stored", lambda: run_config(False, False, True)),
                ("in_weights", lambda: run_config(True, True, False)),
                ("scatter", lambda: run_config(False, True, True, topology="reduce_scatter")),
                ("nonfinite", part_nonfinite),
                ("nonfinite_rs", lambda: part_nonfinite(topology="reduce_scatter")),
                ("fit", part_fit)):
    t0 = time.time()
    result[key] = fn()
    result["seconds"][key] = round(time.time() - t0, 2)
end_job(RANK, result, "tensorflow")
