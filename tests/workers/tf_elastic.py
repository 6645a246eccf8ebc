"""Elastic Horovod with SBC (TensorFlow) on a real ``horovodrun`` elastic job (Gloo). argv: [k=v].

Every rank trains a small Keras model (one Dense layer) on one linear-regression task (each rank
draws its own samples), SGD momentum 0.9, ``SBC(density=0.1, delay=2)`` (weight mode with the
residual in the weights), in one ``horovod_sbc.tensorflow.elastic.SBCState`` committed after
every step. Before step ``fit`` (default 16) each step runs the drop-in
``horovod_sbc.tensorflow.DistributedGradientTape`` eagerly; from step ``fit`` on, the rest of the
run is one ``model.fit`` per entry of the training function, with ``SBCCallback(sbc)`` (the sync
after every batch, ``finish()`` at the end of ``fit``) and Horovod's own
``horovod.tensorflow.keras.elastic.CommitStateCallback(state)`` (a commit after every batch),
so the kill below lands in a sync ``fit`` runs. Every worker starts from its own random weights.

The schedule, by the step counter that ``SBCState`` carries across resets (the job starts on
3 ranks): at step ``shrink`` with 3 ranks and ``grow`` with 2, rank 0 prints a ``ready`` event
and all ranks commit in a loop until the driver reports the new hosts (the test rewrites the
discovery script when it reads ``ready``); from step ``kill`` with 3 ranks the worker on host
127.0.0.1 exits (``os._exit(1)``) inside SBC's allgather, mid-sync, and its host is
blacklisted.

Events, one ``EL {json}`` line each: ``entry`` (each time the training function starts, after
the sync: digests of the shared weights, residuals, weights and optimizer variables, the world
SBC records, and the worker's last committed snapshot), ``ready`` (with the loss of the shared
weights), ``kill``, ``fail`` (a survivor's error out of ``sbc.step()``: are the weights, shared
weights and residuals as they were when the sync's allgather started?) and ``done`` (after
``sbc.finish()``).
"""
import hashlib
import json
import os
import time

import numpy as np
import tensorflow as tf
import keras
import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras

import horovod_sbc
import horovod_sbc.tensorflow as hsbc
from horovod_sbc.tensorflow import elastic
from horovod_sbc.tensorflow.sync import exchange

KW = dict(a.split("=", 1) for a in __import__("sys").argv[1:])
STEPS, KILL, FIT = int(KW.get("steps", 32)), int(KW.get("kill", 24)), int(KW.get("fit", 16))
WAITS = {int(KW.get("shrink", 8)): ("shrink", 3), int(KW.get("grow", 16)): ("grow", 2)}
WAIT_S = float(KW.get("wait", 60))
HOST, WID = os.environ.get("HOROVOD_HOSTNAME"), os.getpid()
hvd.init()
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
TEACHER = np.random.default_rng(7).standard_normal((16, 4)).astype(np.float32)
EVAL_X = np.random.default_rng(8).standard_normal((256, 16)).astype(np.float32)


def emit(ev, **kw):
    print("EL " + json.dumps(dict(ev=ev, wid=WID, rank=hvd.rank(), size=hvd.size(), host=HOST,
                                  **kw)), flush=True)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(np.ascontiguousarray(np.asarray(t)).tobytes())
    return h.hexdigest()


def batch(step):
    x = np.random.default_rng(1000 * step + hvd.rank()).standard_normal((32, 16))
    x = x.astype(np.float32)
    return tf.constant(x), tf.constant(x @ TEACHER)


keras.utils.set_random_seed(WID % 100000)  # every worker starts apart: the first sync agrees
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
opt = keras.optimizers.SGD(0.05, momentum=0.9)
model.compile(optimizer=opt, loss="mse")  # the tape steps and fit's steps: one optimizer
sbc = hsbc.SBC(density=0.1, delay=2)
state = elastic.SBCState(model, opt, sbc, step=0)
VARS = model.trainable_variables
last_commit = None


def residual_max(tensors):
    return max([float(tf.reduce_max(tf.abs(t))) for t in tensors] or [0.0])


def snapshot():
    """What each rank must keep or agree on (names sorted: the same order on every rank)."""
    ref, res = sbc.reference, sbc.residuals
    return {"wref": digest([ref[k] for k in sorted(ref)]),
            "res": digest([res[k] for k in sorted(res)]),
            "res_max": residual_max(list(res.values())),
            "opt": digest(v for v in opt.variables),
            "local_steps": int(sbc.local_steps.numpy()),
            "weights": digest(sorted(VARS, key=lambda v: v.path))}


_allgather = exchange.allgather
before = None


def watched(step, tag):
    """SBC's allgather: a snapshot when each sync's allgather starts; on host 127.0.0.1 from
    step ``kill`` on (3 ranks), this worker dies there."""
    global before
    before = snapshot()
    if HOST == "127.0.0.1" and state.step >= KILL and hvd.size() == 3:
        emit("kill", step=state.step)
        os._exit(1)
    return _allgather(step, tag)


exchange.allgather = watched  # exchange() calls the module's allgather eagerly, at every sync


def loss_of_shared():
    """The evaluation loss of the shared weights ``W_ref`` (the weights are put back)."""
    own = [tf.identity(v) for v in VARS]
    for v in VARS:
        v.assign(sbc.reference[v.path])
    y = EVAL_X @ TEACHER
    loss = float(tf.reduce_mean(tf.square(model(EVAL_X) - y)))
    for v, w in zip(VARS, own):
        v.assign(w)
    return loss


def wait_for_hosts(state, name):
    global last_commit
    if hvd.rank() == 0:
        emit("ready", name=name, step=state.step, loss=loss_of_shared())
    deadline = time.time() + WAIT_S
    while time.time() < deadline:  # commit() raises HostsUpdatedInterrupt on the driver's news
        time.sleep(0.1)
        last_commit = snapshot()
        state.commit()
    raise RuntimeError(f"rank {hvd.rank()}: no host update within {WAIT_S:.0f} s ({name})")


def failed(e: tf.errors.OpError, where: str) -> None:
    """A survivor's error out of a sync: report it (Horovod's ``hvd.elastic.run`` checks for
    the op's type in the message)."""
    horovod_sees = any(f"Horovod{op}" in e.message for op in ("Allreduce", "Allgather",
                                                              "Broadcast"))
    emit("fail", step=state.step, unchanged=before == snapshot(), before=before, where=where,
         error=f"{type(e).__name__}: {e.message}", horovod_sees=horovod_sees)


def one_step(state):
    x, y = batch(state.step)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    grads = hsbc.DistributedGradientTape(tape, compression=sbc).gradient(loss, VARS)
    opt.apply_gradients(zip(grads, VARS))
    try:
        sbc.step(VARS, opt)
    except tf.errors.OpError as e:
        failed(e, "tape")
        raise


class Steps(keras.callbacks.Callback):
    """The step counter ``SBCState`` carries, after ``SBCCallback``'s sync and before the
    commit callback's commit (Keras calls the callbacks in list order)."""

    def on_train_batch_end(self, batch, logs=None):
        global last_commit
        state.step += 1
        last_commit = snapshot()


def fit_rest(state):
    """Steps ``state.step`` .. ``STEPS`` as one ``model.fit`` (the batches in step order)."""
    xs, ys = zip(*(batch(s) for s in range(state.step, STEPS)))
    callbacks = [hsbc.SBCCallback(sbc), Steps(), hvd_keras.elastic.CommitStateCallback(state)]
    try:
        model.fit(tf.concat(xs, 0), tf.concat(ys, 0), batch_size=32, epochs=1, shuffle=False,
                  callbacks=callbacks, verbose=0)
    except tf.errors.OpError as e:
        failed(e, "fit")
        raise


@elastic.run
def train(state):
    global last_commit
    emit("entry", step=state.step, last=last_commit, pkg=horovod_sbc.__file__,
         world=[int(x) for x in sbc.world.numpy()], stats=sbc.stats(), **snapshot())
    while state.step < STEPS:
        wait = WAITS.get(state.step)
        if wait and hvd.size() == wait[1]:
            wait_for_hosts(state, wait[0])
        if state.step >= FIT:
            fit_rest(state)  # SBCCallback calls finish() at the end of fit
            break
        one_step(state)
        state.step += 1
        last_commit = snapshot()
        state.commit()
    else:
        sbc.finish(VARS)
    emit("done", step=state.step, loss=loss_of_shared(), weights=digest(VARS),
         stats=sbc.stats())


train(state)
