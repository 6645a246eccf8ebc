"""Keras SGD's momentum folded into its learning rate: the drop-in at delay 1 and the stock tape.

Why, and the arithmetic: :mod:`horovod_sbc.torch.momentum` and docs/design.md, "The momentum
fold" (under error feedback a velocity replays each coordinate's late, burst-like arrival, so
SGD runs without its velocity at ``lr / (1 - momentum)``, reached as a constant gradient's
velocity reaches it: the factor ``F_t`` carries ``1 - momentum ** (t + 1)`` at step ``t``).
Keras bakes ``momentum`` into its traced update, so the fold acts after the optimizer's step
(the same section says how and why):

* weight mode (the drop-in at delay 1, residual beside the shared weights): the velocity is set
  to zero after every step (Keras then moves the weight by ``-lr * a * g``, ``a = 1``, or
  ``1 + momentum`` with Nesterov), and the window update ``W - W_ref`` is scaled by ``F_t / a``
  before it is compressed;
* the stock tape (``hvd.DistributedGradientTape(tape, compression=SBC(..., optimizer=opt))``):
  the averaged gradient it returns is scaled by ``F_t / a`` and the velocities are set to zero
  before the optimizer applies it (once per step, by the exchange holding the step's first
  gradient).

Folded: ``keras.optimizers.SGD`` (and subclasses) with ``momentum > 0`` and without
``gradient_accumulation_steps``. In weight mode also without ``weight_decay`` (Keras decays by
``lr * weight_decay * W`` apart from the gradient, which a scaled window update would lengthen
too); the stock tape scales the gradient alone, so there the decay stays as Keras applies it.
"""
from __future__ import annotations

from typing import List

import tensorflow as tf

from .. import policy
from .adam import is_keras_adam


def foldable(optimizer, decay_apart: bool = False) -> bool:
    """Whether :class:`Fold` applies to ``optimizer`` (see the module docstring);
    ``decay_apart``: the fold scales the gradient alone (the stock tape), so Keras'
    ``weight_decay`` is no obstacle."""
    import keras
    return (isinstance(optimizer, keras.optimizers.SGD) and float(optimizer.momentum) > 0
            and (decay_apart or not optimizer.weight_decay)
            and not getattr(optimizer, "gradient_accumulation_steps", None))


def momentum_free(optimizer) -> bool:
    """Whether ``optimizer`` is a Keras SGD without momentum (nothing to fold)."""
    import keras
    return isinstance(optimizer, keras.optimizers.SGD) and float(optimizer.momentum) == 0


def family(optimizer) -> str:
    """The optimizer's family for :func:`horovod_sbc.policy.choose`: ``"sgd"`` for a Keras SGD
    whose step the package keeps linear (no momentum, or a momentum it folds), ``"adam"`` for
    Keras Adam/AdamW, ``"adaptive"`` for anything else (None: not known yet)."""
    if optimizer is not None and (momentum_free(optimizer) or foldable(optimizer)):
        return "sgd"
    if optimizer is not None and is_keras_adam(optimizer) and not optimizer.amsgrad:
        return "adam"
    return "adaptive"


def shares_weights(optimizer, delay: int) -> bool:
    """Whether the residual waits beside the shared weights by default
    (``SBC(local_residual=None)`` → False): :func:`horovod_sbc.policy.choose` for the drop-in,
    as in torch (a Keras SGD at delay 1 without a velocity or with one that folds)."""
    return not policy.choose(family(optimizer), delay=delay, api="dropin").local_residual


class Fold:
    """The fold of one Keras SGD optimizer: the scale of step ``t``'s window update and the
    reset of its velocity."""

    def __init__(self, optimizer, decay_apart: bool = False):
        if not foldable(optimizer, decay_apart):
            raise ValueError(f"cannot fold {type(optimizer).__name__}: only keras.optimizers.SGD "
                             "with momentum > 0, no weight_decay and no gradient accumulation")
        self.optimizer = optimizer
        self.momentum = float(optimizer.momentum)
        a = 1.0 + self.momentum if optimizer.nesterov else 1.0
        self._steady = 1.0 / ((1.0 - self.momentum) * a)

    def scale(self, step) -> tf.Tensor:
        """``F_t / a`` at ``step`` (from 0; an int64 tensor), in float64."""
        t = tf.cast(step, tf.float64)
        return self._steady * (1.0 - tf.pow(tf.constant(self.momentum, tf.float64), t + 1.0))

    def reset(self) -> List:
        """Ops that set the optimizer's velocities to zero (none before its first step)."""
        out = []
        for m in getattr(self.optimizer, "momentums", None) or []:
            v = m if isinstance(m, tf.Variable) else m.value  # a Keras 3 Variable wraps one
            out.append(v.assign(tf.zeros(v.shape, v.dtype)))
        return out
