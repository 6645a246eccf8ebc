"""The stock tape's weight exchange: the optimizer's step followed by :meth:`SBC.step`.

Through stock ``hvd.DistributedGradientTape(tape, compression=SBC(..., optimizer=opt))``,
:func:`horovod_sbc.policy.choose` makes every optimizer given exchange *weight changes*, at
every ``delay`` (Keras SGD's momentum is its own), as torch's stock hook makes
Horovod's optimizer the drop-in's: the hook's ``decompress()`` hands each rank its own gradient
back, and the optimizer's step is followed by weight mode's :meth:`SBC.step`
(:mod:`horovod_sbc.tensorflow.weights`), which every ``delay`` steps compresses and exchanges
the change of the weights since the shared weights ``W_ref``. The user's loop stays stock::

    sbc = hsbc.SBC(0.01, optimizer=opt)
    tape = hvd.DistributedGradientTape(tape, compression=sbc, num_groups=1)
    grads = tape.gradient(loss, variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))   # steps, then syncs

:func:`adopt` mixes :class:`_StockWeights` into the optimizer instance (once; as the variance
freeze of :mod:`horovod_sbc.tensorflow.adam` mixes its frozen step): its ``apply``
(Keras 3: ``apply_gradients`` calls it) runs the original step, then ``sbc.step(variables,
self)``; eagerly and inside ``tf.function``.

The reference weights: the first step creates the missing ones (eagerly, also when the step is
traced) from the weights it is about to move, so ``sbc.build(variables)`` is optional. In a fresh
run (no step counted yet) it first checks, with one broadcast from rank 0, that every rank holds
the same weights, and raises on every rank if not: Horovod's examples broadcast *after* the first
step, which the gradient exchange tolerates (every rank applies the same average) and the weight
exchange does not (each rank's first step starts from its own weights). A resumed run restores
them from the checkpoint (TensorFlow restores a reference created after ``restore()`` on
creation).
"""
from __future__ import annotations

from typing import List

import tensorflow as tf

from .owner import entries
from .sync.exchange import tf_name
from .sync.state import no_autograph

#: what compress() asserts at the first gradient of a step: the previous step's gradients went
#: through the optimizer that syncs
FORGOT_STEP = ("SBC(optimizer={opt}) through stock hvd.DistributedGradientTape exchanges weight "
               "changes after {opt}'s step: apply the gradients of every tape.gradient() call "
               "with that optimizer (opt.apply_gradients), which then synchronizes")


class _StockWeights:
    """Mixed in before the optimizer's class by :func:`adopt`: the step, then the sync."""

    _sbc_stock = None  # the SBC whose stock tape exchanges this optimizer's weight changes

    @no_autograph
    def apply(self, grads, trainable_variables=None):
        sbc = self._sbc_stock
        grads = list(grads)
        if sbc is None or not grads or (trainable_variables is None and not self.built):
            return super().apply(grads, trainable_variables)  # nothing to sync, or Keras raises
        variables = list(self._trainable_variables if trainable_variables is None
                         else trainable_variables)
        prepare(sbc, variables)
        out = super().apply(grads, variables)
        sbc.step(variables, self)
        return out


def adopt(optimizer, sbc) -> None:
    """Make ``optimizer``'s steps sync ``sbc``'s weight exchange (idempotent; one SBC per
    optimizer)."""
    cls = type(optimizer)
    if not issubclass(cls, _StockWeights):
        optimizer.__class__ = type(cls.__name__, (_StockWeights, cls), {})
    held = optimizer._sbc_stock
    if held is not None and held is not sbc:
        raise ValueError(f"{cls.__name__} already synchronizes another SBC object through the "
                         "stock tape; use one SBC object per optimizer")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(f"SBC(optimizer={cls.__name__}) exchanges weight changes after every "
                         "optimizer step; Keras' gradient_accumulation_steps steps the weights "
                         "every few calls only: leave it out")
    optimizer._sbc_stock = sbc


@no_autograph
def prepare(sbc, variables) -> None:
    """Before the first step of ``variables``: their missing residuals and reference weights,
    created now (eagerly) from the weights; in a fresh run after checking that every rank
    starts from the same weights (see the module docstring)."""
    found = entries(variables)
    missing = [e for e in found if e[0] not in sbc.reference]
    if not missing:
        return
    with tf.init_scope():
        sbc._world()
        if int(sbc.counters["steps"].numpy()) == 0:
            check_same_start(missing, type(sbc._optimizer.optimizer).__name__)
        sbc._create(found)


def check_same_start(found, opt: str) -> None:
    """Eagerly: ValueError on every rank unless every rank holds rank 0's values of ``found``
    (entries)."""
    import horovod.tensorflow as hvd
    same = tf.stack([tf.reduce_all(tf.equal(
        hvd.broadcast(v.read_value(), root_rank=0, name="sbc_start_" + tf_name(name)),
        v.read_value())) for name, v, _ in found])
    apart_here = tf.cast(tf.logical_not(tf.reduce_all(same)), tf.float64)
    ranks = hvd.allreduce(tf.reshape(apart_here, [1]), op=hvd.Sum, name="sbc_start_apart")
    flags, ranks = same.numpy(), ranks.numpy()  # one host read, once per run
    apart: List[str] = [name for (name, _, _), ok in zip(found, flags) if not ok]
    if float(ranks[0]) > 0:
        which = f" (here: {', '.join(apart[:3])}{'...' if len(apart) > 3 else ''})" \
            if apart else ""
        raise ValueError(
            f"SBC(optimizer={opt}) through stock hvd.DistributedGradientTape exchanges weight "
            f"changes from weights all ranks share, but at the first step {int(ranks[0])} "
            f"rank(s) hold other weights than rank 0{which}: broadcast the initial weights "
            "BEFORE the first step (hvd.broadcast_variables(model.variables, root_rank=0) "
            "before training, not after the first step as Horovod's examples do)")


@no_autograph
def mark_gradient(sbc, first: bool, opt: str):
    """The pending-step mark of one gradient: at the first gradient of a step, assert that the
    previous step went through the optimizer (whose sync resets it)."""
    if not first:
        return sbc.pending.assign(1)
    check = tf.debugging.assert_equal(sbc.pending, tf.constant(0, tf.int64),
                                      message=FORGOT_STEP.format(opt=opt))
    with tf.control_dependencies([check]):
        return sbc.pending.assign(1)
