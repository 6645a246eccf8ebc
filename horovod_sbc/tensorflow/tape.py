"""The drop-in ``DistributedGradientTape``: SBC with one fused allgather per sync, and delay.

Built like Horovod's ``horovod.tensorflow.DistributedGradientTape``: it returns an instance of a
subclass of *your* tape's class that reuses the tape you recorded with, so ``gradient()`` is
TensorFlow's, followed by the exchange. Unlike Horovod's it accepts Keras 3 variables directly
(``model.trainable_variables``; Horovod 0.28.1 calls ``.ref()`` on them and fails, upstream issue
#4290) and it works in eager mode and inside ``tf.function``.

Like the torch drop-in optimizer it exchanges *weight updates*, at every ``delay``: ``gradient()``
returns this rank's own gradients (no communication); apply them with your optimizer, then call
``sbc.step(variables, optimizer)``, which every ``delay``-th time (every time at ``delay=1``) compresses the
weight update since the last sync (plus its residual) for every variable, sends all of them in
one step message through one ``horovod.tensorflow.allgather`` and moves the shared weights by
the average of all ranks' decoded updates, identical on every rank (:meth:`SBC.step`,
:mod:`horovod_sbc.tensorflow.weights`)::

    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    sbc.step(model.trainable_variables, opt)

Why weight updates, also at ``delay=1``, and not sparse gradients as stock
``hvd.DistributedGradientTape(tape, compression=SBC(...))``: docs/design.md (TensorFlow). A
``gradient()`` call whose gradients were not followed by ``sbc.step()`` fails loudly at the next
``gradient()``.
"""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

from .compressor import SBC
from .owner import tf_variable


class _SBCTape:
    """Methods copied into a subclass of the user's tape class (see DistributedGradientTape)."""

    def __init__(self, tape, compression: SBC, persistent=False, watch_accessed_variables=True):
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)
        self._tape = tape  # the tape that recorded the forward pass
        self._sbc = compression

    @property
    def compression(self) -> SBC:
        return self._sbc

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """TensorFlow's gradients, this rank's own: apply them, then call
        ``sbc.step(variables)`` (see the module docstring)."""
        grads = super(self.__class__, self).gradient(target, sources, output_gradients,
                                                     unconnected_gradients)
        flat_grads = tf.nest.flatten(grads)
        mark = self._sbc._check_window(tf.nest.flatten(sources))
        with tf.control_dependencies([mark]):
            out = [g if g is None else
                   (tf.identity(g) if not isinstance(g, tf.IndexedSlices) else g)
                   for g in flat_grads]
        return tf.nest.pack_sequence_as(grads, out)


def DistributedGradientTape(gradtape: tf.GradientTape, compression: SBC):
    """Wrap a recorded ``tf.GradientTape`` for SBC training (the full feature set).

    Args:
        gradtape: the tape your forward pass was recorded with.
        compression: an :class:`SBC`. Create it ONCE for the whole training run and pass the
            same object at every step: it holds the residuals, reference weights and counters
            (put it in your ``tf.train.Checkpoint``). Call ``compression.step(variables)``
            after applying the gradients, at every step (see the module docstring).

    Returns a tape whose ``gradient(target, sources)`` accepts ``tf.Variable`` s and Keras 3
    variables (nested structures too). Statistics: ``compression.stats()``.
    """
    if not isinstance(compression, SBC):
        raise TypeError(f"compression must be horovod_sbc.tensorflow.SBC (or a subclass), "
                        f"created once for the whole run; got {type(compression).__name__}")
    methods = {k: v for k, v in _SBCTape.__dict__.items()
               if k not in ("__dict__", "__weakref__")}
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,), methods)
    return cls(gradtape._tape, compression, gradtape._persistent,
               getattr(gradtape, "_watch_accessed_variables", True))


def broadcast_variables(variables, root_rank: int = 0, compression: Optional[SBC] = None):
    """Make all ranks start equal: broadcast ``variables`` (``tf.Variable`` s or Keras 3
    variables, e.g. ``model.variables``) from ``root_rank``. With ``compression``, its reference
    weights are then reset to the broadcast values (weight mode: the drop-in tape,
    :class:`SBCCallback`)."""
    import horovod.tensorflow as hvd
    flat = tf.nest.flatten(variables)
    hvd.broadcast_variables([tf_variable(v) for v in flat], root_rank=root_rank)
    if compression is not None and len(compression.reference):
        compression.reset_reference(flat)
