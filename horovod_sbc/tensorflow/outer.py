"""Outer steps of TensorFlow's weight mode: how a sync's averaged update moves the shared weights.

The same three steps, knobs and formulas as :mod:`horovod_sbc.torch.outer` (documented there
with their papers), for :class:`horovod_sbc.tensorflow.SBC` in weight mode (``SBC.step``: the
drop-in tape and :class:`horovod_sbc.tensorflow.SBCCallback`)::

    SBC(density=0.01, delay=16, outer=Nesterov(lr=1.0, momentum=0.5))

At a sync every rank decodes the same average ``U``; the outer step turns it into the change
``D`` of the shared weights ``W_ref``:

* :class:`Plain` -- ``D = lr * U`` (``Plain()``, lr 1, is the default: the average is decoded
  straight into ``W_ref``; ``lr = sqrt(N)`` for adaptive inner optimizers at delay 1).
* :class:`Nesterov` -- DiLoCo's outer SGD with Nesterov momentum on the pseudo-gradient ``-U``:
  ``v <- momentum * v + U``, ``D = lr * (U + momentum * v)``.
* :class:`ErrorDecay` -- SparseLoCo's decayed error feedback: ``D = lr * U`` and every rank's
  residual is multiplied by ``decay`` after the sync.

Each step's state (Nesterov's ``v``) is a ``tf.Variable`` per tensor, tracked by the ``SBC``
module (``outer/buffers/<name>`` in a ``tf.train.Checkpoint``), a function of the ``U`` s
alone and so identical on every rank. A sync that does not commit (a rank failed or skipped)
changes neither ``W_ref`` nor this state.
"""
from __future__ import annotations

from typing import List, Sequence

import tensorflow as tf

from .. import config
from ..config import check_number


class Plain(tf.Module):
    """``W_ref += lr * U``: the SBC paper's step (with ``mode="values", density=1`` federated
    averaging). No state.

    Args:
        lr: the outer learning rate, in (0, 16]; ``sqrt(N)`` for N ranks with an adaptive
            inner optimizer (Adam, AdamW, RMSprop) at ``delay=1``, 1 with momentum SGD; see
            :class:`horovod_sbc.torch.outer.Plain`.
    """

    kind = "plain"

    def __init__(self, lr: float = 1.0):
        super().__init__(name="outer")
        self.lr = check_number("Plain: lr", lr, 0.0, 16.0, low_open=True)

    def __repr__(self) -> str:
        return "Plain()" if self.lr == 1.0 else f"Plain(lr={self.lr})"

    @property
    def decodes_into_reference(self) -> bool:
        """The average is decoded straight into ``W_ref`` (no state, ``lr = 1``)."""
        return self.kind == "plain" and self.lr == 1.0

    def build(self, names: Sequence[str], likes: List[tf.Tensor], make) -> None:
        """Create the state of every tensor not holding one yet; ``make(initial, name)``
        creates a state variable eagerly."""

    def delta(self, names: Sequence[str], updates: List[tf.Tensor],
              committed: tf.Tensor) -> List[tf.Tensor]:
        """The change of the shared weights for the averaged ``updates``; the state moves only
        where ``committed`` (a scalar bool tensor) is true."""
        return [self.lr * u for u in updates] if self.lr != 1.0 else list(updates)

    def after_commit(self, residuals: List[tf.Variable], committed: tf.Tensor) -> List:
        """Ops acting on this rank's residuals once the sync's error feedback is committed."""
        return []


class Nesterov(Plain):
    """DiLoCo's outer step (Douillard et al., arXiv 2311.08105); see
    :class:`horovod_sbc.torch.outer.Nesterov`.

    Args:
        lr: the outer learning rate, in (0, 2]; DiLoCo uses 0.7.
        momentum: in [0, 1); DiLoCo uses 0.9.
    """

    kind = "nesterov"

    def __init__(self, lr: float = 0.7, momentum: float = 0.9):
        super().__init__()
        self.lr = check_number("Nesterov: lr", lr, 0.0, 2.0, low_open=True)
        self.momentum = check_number("Nesterov: momentum", momentum, 0.0, 1.0)
        if self.momentum >= 1.0:
            raise ValueError(f"Nesterov: momentum must be below 1, got {momentum!r}")
        self.buffers = {}

    def __repr__(self) -> str:
        return f"Nesterov(lr={self.lr}, momentum={self.momentum})"

    def build(self, names, likes, make) -> None:
        for name, u in zip(names, likes):
            v = self.buffers.get(name)
            if v is None:
                self.buffers[name] = make(tf.zeros(u.shape, u.dtype), name)
            elif tuple(v.shape) != tuple(u.shape):
                raise ValueError(f"Nesterov: the momentum buffer of {name!r} has shape "
                                 f"{tuple(v.shape)} but its update {tuple(u.shape)}; did the "
                                 "model change shape?")

    def delta(self, names, updates, committed):
        out = []
        for name, u in zip(names, updates):
            v = self.buffers[name]
            new_v = self.momentum * v.read_value() + u
            assign = v.assign(tf.where(committed, new_v, v.read_value()))
            with tf.control_dependencies([assign]):
                out.append(self.lr * (u + self.momentum * new_v))
        return out


class ErrorDecay(Plain):
    """SparseLoCo's error feedback with decay (Sarfi et al., arXiv 2508.15706); see
    :class:`horovod_sbc.torch.outer.ErrorDecay`.

    Args:
        decay: in [0, 1]; 1 is plain error feedback.
        lr: the outer learning rate, in (0, 2].
    """

    kind = "error_decay"

    def __init__(self, decay: float = 0.95, lr: float = 1.0):
        super().__init__()
        self.decay = check_number("ErrorDecay: decay", decay, 0.0, 1.0)
        self.lr = check_number("ErrorDecay: lr", lr, 0.0, 2.0, low_open=True)

    def __repr__(self) -> str:
        return f"ErrorDecay(decay={self.decay}, lr={self.lr})"

    def after_commit(self, residuals, committed):
        if self.decay == 1.0:
            return []
        return [r.assign(tf.where(committed, self.decay * r.read_value(), r.read_value()))
                for r in residuals]


def resolve_outer(outer) -> Plain:
    """``None`` -> :class:`Plain`; otherwise one of this module's outer steps."""
    return config.resolve_outer(outer, Plain, "horovod_sbc.tensorflow")
