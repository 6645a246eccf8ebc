"""The outer steps of :mod:`horovod_sbc.outer` run on TensorFlow variables (``SBC(outer=...)``
in weight mode: the drop-in tape and :class:`horovod_sbc.tensorflow.SBCCallback`).

:func:`make` turns a step's knobs into its runner, a ``tf.Module`` the ``SBC`` module tracks:
Nesterov's buffers are ``tf.Variable`` s (``outer/buffers/<name>`` in a
``tf.train.Checkpoint``). ``delta`` returns the change of the shared weights for a sync's
averaged updates and moves the state only where the sync committed; ``after_commit`` acts on
the residuals (ErrorDecay). The formulas are those of :mod:`horovod_sbc.torch.outer`.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf

from ..outer import OuterStep, Plain


class OuterRunner(tf.Module):
    """The outer step ``spec`` (:mod:`horovod_sbc.outer`) on TensorFlow variables: ``Plain``
    (``W_ref += lr * U``, no state), ``Nesterov`` (``v <- m v + U``, ``D = lr (U + m v)``, one
    buffer per tensor) or ``ErrorDecay`` (``D = lr * U``, then every residual times ``decay``).

    One object for the life of its ``SBC``, whose spec :meth:`set_spec` may change before the
    first sync (``policy.outer_step``'s choice, made once the optimizer is known): a
    ``tf.train.Checkpoint`` restored before that matches ``outer/buffers/<name>`` to this
    object's ``buffers``, created at the first sync."""

    def __init__(self, spec: OuterStep):
        super().__init__(name="outer")
        self.buffers = {}
        self.set_spec(spec)

    def set_spec(self, spec: OuterStep) -> None:
        """Run ``spec`` from now on (before any state was created, or the same kind)."""
        if self.buffers and spec.kind != "nesterov":
            raise ValueError(f"the outer step holds Nesterov buffers; it cannot become {spec!r}")
        self.spec = spec
        self.kind, self.lr = spec.kind, spec.lr
        self.momentum = getattr(spec, "momentum", 0.0)
        self.decay = getattr(spec, "decay", 1.0)

    def __repr__(self) -> str:
        return repr(self.spec)

    @property
    def decodes_into_reference(self) -> bool:
        """The average is decoded straight into ``W_ref`` (no state, ``lr = 1``)."""
        return self.spec.decodes_into_reference

    def build(self, names: Sequence[str], likes: List[tf.Tensor], make) -> None:
        """Create the state of every tensor not holding one yet (Nesterov's buffers);
        ``make(initial, name)`` creates a state variable eagerly."""
        if self.kind != "nesterov":
            return
        for name, u in zip(names, likes):
            v = self.buffers.get(name)
            if v is None:
                self.buffers[name] = make(tf.zeros(u.shape, u.dtype), name)
            elif tuple(v.shape) != tuple(u.shape):
                raise ValueError(f"Nesterov: the momentum buffer of {name!r} has shape "
                                 f"{tuple(v.shape)} but its update {tuple(u.shape)}; did the "
                                 "model change shape?")

    def delta(self, names: Sequence[str], updates: List[tf.Tensor],
              committed: tf.Tensor) -> List[tf.Tensor]:
        """The change of the shared weights for the averaged ``updates``; the state moves only
        where ``committed`` (a scalar bool tensor) is true."""
        if self.kind != "nesterov":
            return [self.lr * u for u in updates] if self.lr != 1.0 else list(updates)
        out = []
        for name, u in zip(names, updates):
            v = self.buffers[name]
            new_v = self.momentum * v.read_value() + u
            assign = v.assign(tf.where(committed, new_v, v.read_value()))
            with tf.control_dependencies([assign]):
                out.append(self.lr * (u + self.momentum * new_v))
        return out

    def after_commit(self, residuals: List[tf.Variable], committed: tf.Tensor) -> List:
        """Ops acting on this rank's residuals once the sync's error feedback is committed."""
        if self.kind != "error_decay" or self.decay == 1.0:
            return []
        return [r.assign(tf.where(committed, self.decay * r.read_value(), r.read_value()))
                for r in residuals]


def make(spec: Optional[OuterStep]) -> OuterRunner:
    """The runner of ``spec`` (None: ``Plain()``), with fresh state."""
    return OuterRunner(Plain() if spec is None else spec)
