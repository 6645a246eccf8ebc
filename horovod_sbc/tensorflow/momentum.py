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

``SBC(momentum="mask")`` in the stock tape's gradient exchange is DGC's momentum factor masking
(Lin et al., ICLR 2018) instead, as torch's stock hook does it (:mod:`horovod_sbc.torch.hook`,
``momentum_buffer``): :class:`Mask` sets the Keras SGD's velocity to zero wherever the averaged
gradient the tape returns is non-zero, before the optimizer's step uses it; elsewhere the
velocity is kept (``"keep"``: kept everywhere). The velocities are the same on every rank (every
rank applies the same average), so the ranks stay identical.
"""
from __future__ import annotations

from typing import Dict, List

import tensorflow as tf

from .adam import is_keras_adam
from .owner import tf_variable, variable_name


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


def linear(optimizer, decay_apart: bool = False) -> bool:
    """``policy.choose``'s ``foldable``: a Keras SGD without momentum, or one :class:`Fold`
    applies to (``decay_apart`` as there)."""
    return momentum_free(optimizer) or foldable(optimizer, decay_apart)


def family(optimizer) -> str:
    """The optimizer's family for :func:`horovod_sbc.policy.choose`: ``"sgd"`` for a Keras SGD
    (whether its momentum can be folded is :func:`foldable`'s), ``"adam"`` for Keras
    Adam/AdamW, ``"unknown"`` for None (not given), ``"adaptive"`` for anything else."""
    import keras
    if optimizer is None:
        return "unknown"
    if isinstance(optimizer, keras.optimizers.SGD):
        return "sgd"
    if is_keras_adam(optimizer) and not optimizer.amsgrad:
        return "adam"
    return "adaptive"


class Mask:
    """Momentum factor masking of one Keras SGD optimizer (see the module docstring)."""

    def __init__(self, optimizer):
        import keras
        if not isinstance(optimizer, keras.optimizers.SGD) or float(optimizer.momentum) <= 0:
            raise ValueError(f"SBC(momentum='mask') masks the velocity of a Keras SGD with "
                             f"momentum > 0, not {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._velocities: Dict[str, tf.Variable] = {}

    def velocity(self, name: str) -> tf.Variable:
        """The velocity of the variable named ``name`` (as :func:`owner.identify` names its
        gradient: its Keras path or its ``tf.Variable``'s name); ValueError before the
        optimizer's first step, or for a variable it does not step."""
        opt = self.optimizer
        if not opt.built:
            # Horovod traces the exchange into a tf.function (eagerly too) once, before the
            # optimizer's first step would create the velocities the mask zeroes
            raise ValueError(
                f"SBC(momentum='mask', optimizer={type(opt).__name__}) masks its velocities, "
                "which do not exist before its first step: call "
                "optimizer.build(model.trainable_variables) before the first step")
        if name not in self._velocities:
            for v in opt._trainable_variables:
                m = opt.momentums[opt._get_variable_index(v)]
                m = m if isinstance(m, tf.Variable) else m.value  # a Keras 3 Variable wraps one
                for key in (variable_name(v), variable_name(tf_variable(v))):
                    self._velocities.setdefault(key, m)
        if name not in self._velocities:
            raise ValueError(f"SBC(momentum='mask'): {name!r} is not a variable that "
                             f"{type(opt).__name__} was built with, so it has no velocity to "
                             "mask: build the optimizer with every variable the tape exchanges")
        return self._velocities[name]

    def apply(self, names: List[str], averages: List[tf.Tensor]) -> List:
        """Ops that zero each velocity where its averaged gradient is non-zero."""
        ops = []
        for name, avg in zip(names, averages):
            m = self.velocity(name)
            moved = tf.not_equal(tf.cast(avg, m.dtype), 0)
            ops.append(m.assign(tf.where(moved, tf.zeros_like(m), m.read_value())))
        return ops


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
