"""Outer steps: how a sync's averaged update ``U`` moves the shared weights ``W_ref``.

The same three classes are ``SBC(outer=...)`` in PyTorch and TensorFlow (exported by both
``horovod_sbc.torch`` and ``horovod_sbc.tensorflow``); they hold validated knobs only. Each
framework runs them with its own state (``horovod_sbc.torch.outer``, ``horovod_sbc.tensorflow.outer``:
multi-tensor ops, ``tf.Variable`` s), identical on every rank because it is a function of the
``U`` s alone, and saved with the residuals. A sync that does not commit changes neither
``W_ref`` nor that state. The outer step applies where weight changes are exchanged
(:func:`horovod_sbc.policy.choose`); where gradients are, ``outer=`` is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import check_number


class OuterStep:
    """What the three outer steps share: ``kind`` (saved with their state) and ``lr``."""
    kind = ""
    lr: float
    _max_lr = 2.0

    def _check_lr(self) -> None:
        object.__setattr__(self, "lr", check_number(f"{type(self).__name__}: lr", self.lr, 0.0,
                                                    self._max_lr, low_open=True))

    @property
    def decodes_into_reference(self) -> bool:
        """No state and ``lr = 1``: the average is decoded straight into ``W_ref``."""
        return self.kind == "plain" and self.lr == 1.0


@dataclass(frozen=True, repr=False)
class Plain(OuterStep):
    """``W_ref += lr * U`` (the SBC paper's step; with ``FedAvg`` federated averaging).

    Args:
        lr: in (0, 16]. ``Plain()`` (lr 1) is the default, decoded straight into ``W_ref``.
            Left at None, ``SBC(outer=None)`` picks :func:`horovod_sbc.policy.outer_step`:
            ``Plain(lr=sqrt(N))`` for N ranks for an adaptive optimizer other than Adam at
            delay 1, whose per-rank normalised steps average to up to sqrt(N) shorter than
            one step on the averaged gradient; ``Nesterov(1.0, 0.5)`` for Adam/AdamW with a
            delay.
    """
    lr: float = 1.0
    kind = "plain"
    _max_lr = 16.0

    def __post_init__(self):
        self._check_lr()

    def __repr__(self) -> str:
        return "Plain()" if self.lr == 1.0 else f"Plain(lr={self.lr})"


@dataclass(frozen=True, repr=False)
class Nesterov(OuterStep):
    r"""DiLoCo's outer step (Douillard et al., arXiv 2311.08105): SGD with Nesterov momentum on
    the pseudo-gradient ``-U``, with ``torch.optim.SGD(nesterov=True)``'s formulas::

        v <- momentum * v + U            (one buffer per tensor, zero at the start)
        D  = lr * (U + momentum * v)     (W_ref += D)

    Args:
        lr: in (0, 2]; DiLoCo uses 0.7. ``Nesterov(1, 0)`` is :class:`Plain` up to rounding.
        momentum: in [0, 1); DiLoCo uses 0.9. The buffer keeps applying the directions all
            ranks agreed on, which recovers progress plain averaging loses with few workers
            or a long ``delay``.
    """
    lr: float = 0.7
    momentum: float = 0.9
    kind = "nesterov"

    def __post_init__(self):
        self._check_lr()
        m = check_number("Nesterov: momentum", self.momentum, 0.0, 1.0)
        if m >= 1.0:
            raise ValueError(f"Nesterov: momentum must be below 1, got {self.momentum!r}")
        object.__setattr__(self, "momentum", m)

    def __repr__(self) -> str:
        return f"Nesterov(lr={self.lr}, momentum={self.momentum})"


@dataclass(frozen=True, repr=False)
class ErrorDecay(OuterStep):
    r"""SparseLoCo's error feedback with decay (Sarfi et al., arXiv 2508.15706): ``D = lr * U``
    and after each sync every rank's unsent residual is scaled by ``decay`` (with the residual
    in the live weights: ``W <- W_ref + decay (W - W_ref)``), in place of outer momentum.

    Args:
        decay: the paper's beta, in [0, 1]; 1 is plain error feedback.
        lr: the paper's alpha, in (0, 2].
    """
    decay: float = 0.95
    lr: float = 1.0
    kind = "error_decay"

    def __post_init__(self):
        self._check_lr()
        object.__setattr__(self, "decay", check_number("ErrorDecay: decay", self.decay, 0.0,
                                                       1.0))

    def __repr__(self) -> str:
        return f"ErrorDecay(decay={self.decay}, lr={self.lr})"
