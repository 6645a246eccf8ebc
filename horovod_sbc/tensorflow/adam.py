"""Keras Adam's second moment frozen after a warm-up: the TensorFlow side of the torch drop-in's
``freeze_variance_after`` (1-bit Adam, arXiv 2102.02888). With the variance held, each rank's
step is linear in its gradients and the average of the ranks' steps is the step on the averaged
gradient (why: docs/design.md, "Adam's variance freeze"; :mod:`horovod_sbc.torch.adam`).

:func:`freeze_variance_after` gives a Keras 3 ``Adam`` or ``AdamW`` (or a subclass) a step that,
from its ``K``-th applied step on (``optimizer.iterations >= K``), is torch's frozen step:

* the velocity ``v`` is no longer updated (it stays Keras' moving average of the first K steps);
  ``m += (g - m) (1 - beta_1)`` and, with ``t = iterations + 1``,
  ``w -= lr / (1 - beta_1 ** t) * m / (sqrt(v / (1 - beta_2 ** K)) + eps)`` (``eps`` added to
  the corrected root as torch does, not scaled as Keras' Adam scales it); weight decay stays
  Keras' (decoupled, before the step);
* at the first frozen step ``v`` is raised to ``config.ADAM_VARIANCE_FLOOR`` times its mean
  (where all of it is zero, set to the square of that step's gradient), so a coordinate idle
  through the warm-up (a dead ReLU's weights) never divides a later gradient by about ``eps``.

Whether a step is frozen is read from ``iterations``, which Keras saves with the optimizer, so a
restored run freezes where the first one did (call this function again on the restored
optimizer before its first step). Build it before training: a ``tf.function`` traces the step it
finds. Each variable's step is one of three (Keras' Adam, the first frozen step, a later one):
traced (``tf.function``, ``fit``, XLA) a ``tf.switch_case`` decided on the device; eagerly the
step reads ``iterations`` once and branches in Python. ``amsgrad`` is refused. Usage, tests and
measurements: docs/tensorflow.md, "Adam and AdamW: the second moment frozen".
"""
from __future__ import annotations

import tensorflow as tf

from ..config import ADAM_VARIANCE_FLOOR
from ..policy import auto_freeze_step


def is_keras_adam(optimizer) -> bool:
    """``keras.optimizers.Adam`` and its subclasses (``AdamW`` is one)."""
    import keras
    return isinstance(optimizer, keras.optimizers.Adam)


def _check(optimizer, steps) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"freeze_variance_after needs a number of steps >= 1, got {steps!r}")
    if not is_keras_adam(optimizer):
        raise ValueError(f"freeze_variance_after applies to keras.optimizers.Adam and AdamW, "
                         f"not {type(optimizer).__name__}")
    if optimizer.amsgrad:
        raise ValueError("freeze_variance_after does not support Adam's amsgrad in TensorFlow")


class _FrozenVariance:
    """Mixed in before the user's Adam class by :func:`freeze_variance_after`."""

    _sbc_freeze_after: int
    _sbc_phase_now = None  # eagerly: this step's phase (ADAM, FIRST, FROZEN), read once

    def _phase(self, done):
        """0: Keras' Adam (``done < K``), 1: the first frozen step, 2: a later one."""
        return tf.cast(tf.clip_by_value(done - (self._sbc_freeze_after - 1), 0, 2), tf.int32)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if not tf.executing_eagerly():  # traced: one tf.switch_case per variable, on the device
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        # eagerly every tf.switch_case would read its index on the host: read it once per step
        self._sbc_phase_now = int(self._phase(self.iterations).numpy())
        try:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        finally:
            self._sbc_phase_now = None

    def update_step(self, gradient, variable, learning_rate):
        adam_step = super().update_step
        done = self.iterations  # steps applied before this one
        branches = [lambda: _no_value(adam_step(gradient, variable, learning_rate)),
                    lambda: self._frozen_update(gradient, variable, learning_rate, done, True),
                    lambda: self._frozen_update(gradient, variable, learning_rate, done, False)]
        if self._sbc_phase_now is not None:
            return branches[self._sbc_phase_now]()
        return tf.switch_case(self._phase(done), branches)

    def _frozen_update(self, gradient, variable, learning_rate, done, first):
        dtype = variable.dtype
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        beta_1 = tf.cast(self.beta_1, dtype)
        # the bias correction of the second moment as it was after the K-th step (v is not
        # updated from then on)
        correction = 1.0 - tf.cast(self.beta_2, dtype) ** tf.cast(self._sbc_freeze_after, dtype)
        root_correction = tf.math.rsqrt(correction)
        g = tf.cast(tf.convert_to_tensor(gradient), dtype)
        if first:  # torch's floor (a fraction of the mean; none at all: g ** 2)
            mean = tf.reduce_mean(v)
            floored = tf.maximum(v, mean * tf.cast(ADAM_VARIANCE_FLOOR, dtype))
            self.assign(v, tf.where(mean > 0, floored, tf.square(g) * correction))
        self.assign_add(m, (g - m) * (1.0 - beta_1))
        t = tf.cast(done + 1, dtype)
        scale = tf.cast(learning_rate, dtype) / (1.0 - beta_1 ** t)
        denom = tf.sqrt(v) * root_correction + tf.cast(self.epsilon, dtype)
        self.assign_sub(variable, scale * m / denom)
        return tf.constant(0)


def _no_value(_):
    return tf.constant(0)


def freeze_variance_after(optimizer, steps="auto"):
    """Freeze the second moment of ``optimizer`` (Keras 3 ``Adam``/``AdamW``) after ``steps``
    applied steps; returns the same optimizer. ``SBC(freeze_variance_after=...)`` calls it
    (:func:`apply_freeze`) where weight changes are exchanged, before a ``tf.function`` traces
    the step when ``SBC(optimizer=opt)`` is given; the benchmarks call it for dense baselines.

    ``steps``: ``"auto"`` (the default): :func:`horovod_sbc.policy.auto_freeze_step` of the
    warm-up of the optimizer's learning-rate schedule (evaluated on the host, once; a constant
    learning rate has none) and ``beta_2``, the torch drop-in's default; or a number K."""
    if steps == "auto" and isinstance(steps, str):
        steps = auto_freeze_steps(optimizer)
    _check(optimizer, steps)
    cls = type(optimizer)
    if not issubclass(cls, _FrozenVariance):
        optimizer.__class__ = type(cls.__name__, (_FrozenVariance, cls), {})
    optimizer._sbc_freeze_after = steps
    return optimizer


def apply_freeze(optimizer, knob) -> None:
    """``SBC(freeze_variance_after=knob)`` for the weight exchange with ``optimizer``:
    ``"auto"`` freezes a Keras Adam/AdamW (other optimizers: nothing), a number K freezes after
    K steps (Adam only, else ValueError), None never. Once per optimizer."""
    if knob is None or optimizer is None or is_frozen(optimizer):
        return
    if isinstance(knob, str):
        if is_keras_adam(optimizer) and not optimizer.amsgrad:
            freeze_variance_after(optimizer, "auto")
        return
    freeze_variance_after(optimizer, knob)


def is_frozen(optimizer) -> bool:
    """Has :func:`freeze_variance_after` been applied to ``optimizer``?"""
    return isinstance(optimizer, _FrozenVariance)


#: the longest warm-up :func:`auto_freeze_steps` looks for in a schedule
MAX_WARMUP = 100_000


def auto_freeze_steps(optimizer) -> int:
    """The automatic freeze step of a Keras Adam: the last step at which its learning-rate
    schedule still rises (0 for a constant learning rate), then
    :func:`horovod_sbc.policy.auto_freeze_step`."""
    import keras
    if not is_keras_adam(optimizer):
        raise ValueError(f"freeze_variance_after applies to keras.optimizers.Adam and AdamW, "
                         f"not {type(optimizer).__name__}")
    schedule = getattr(optimizer, "_learning_rate", None)
    warmup_end = 0
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        last = float(schedule(0))
        for step in range(1, MAX_WARMUP):
            lr = float(schedule(step))
            if lr <= last:
                break
            warmup_end, last = step, lr
    return auto_freeze_step(warmup_end, float(optimizer.beta_2))


def family(optimizer) -> str:
    """The optimizer's family for :func:`horovod_sbc.policy.choose`: ``"sgd"`` for a Keras SGD,
    ``"adam"`` for Keras Adam/AdamW (whose second moment this module freezes; Keras' RMSprop is
    not frozen here and stays ``"adaptive"``), ``"unknown"`` for None (not given),
    ``"adaptive"`` for anything else."""
    import keras
    if optimizer is None:
        return "unknown"
    if isinstance(optimizer, keras.optimizers.SGD):
        return "sgd"
    if is_keras_adam(optimizer) and not optimizer.amsgrad:
        return "adam"
    return "adaptive"
