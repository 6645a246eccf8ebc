"""Outer steps of the drop-in optimizer: how a sync's averaged update moves the shared weights.

At every sync of :func:`horovod_sbc.torch.DistributedOptimizer` each rank's message decodes to
its sent update; their average ``U`` is bit-identical on every rank. The *outer step* turns ``U``
into the change ``D`` applied to the shared weights ``W_ref`` (and, when the residual lives in
the weights, to every rank's live weights by the same ``D``, so each rank's unsent residual
``W - W_ref`` is unchanged by it):

* :class:`Plain` -- ``D = lr * U`` (the SBC paper, FedAvg / local SGD at ``lr = 1``, the
  default); no state. ``lr = sqrt(N)`` for adaptive inner optimizers at ``delay=1`` (see
  there).
* :class:`Nesterov` -- DiLoCo's outer optimizer (Douillard et al., "DiLoCo: Distributed
  Low-Communication Training of Language Models", arXiv 2311.08105): ``-U`` is a
  *pseudo-gradient* fed to SGD with Nesterov momentum.
* :class:`ErrorDecay` -- SparseLoCo's error feedback with decay (Sarfi et al., "Communication
  Efficient LLM Pre-training with SparseLoCo", arXiv 2508.15706): ``D = lr * U`` and every
  rank's residual is multiplied by ``decay`` after each sync, in place of outer momentum.

An outer step's state is a function of the ``U`` s alone, so it is identical on every rank; the
drop-in saves it in its ``state_dict()``. The arithmetic runs as multi-tensor ``torch._foreach``
ops over all tensors at once (no per-tensor Python loop of kernel launches on a GPU, no host
read of device data).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .. import config
from ..config import check_number as _check_number


class Plain:
    """``W_ref += lr * U``: the shared weights take the averaged update (the SBC paper's step;
    with ``FedAvg`` federated averaging). ``Plain()`` is the drop-in's default; it keeps the
    one-walk decode straight into ``W_ref`` (and the weights), with no dense buffer of ``U``.

    Args:
        lr: the outer learning rate, in (0, 16]. With an adaptive inner optimizer (Adam,
            AdamW, RMSprop, Adagrad) and ``delay=1`` use ``lr = sqrt(N)`` for N ranks: each
            rank's update is normalized by its own second moment, so where gradient noise
            dominates the N updates point partly different ways, and their average is up to
            ``sqrt(N)`` times shorter than the step the same optimizer takes on the averaged
            gradient. Over several local steps (``delay > 1``) the ranks' updates agree more and
            ``sqrt(N)`` can overshoot. Momentum SGD's updates are linear in the gradients, and
            so are Adam's with ``freeze_variance_after`` (:mod:`horovod_sbc.torch.adam`): keep
            ``lr = 1`` there.
    """

    kind = "plain"

    def __init__(self, lr: float = 1.0):
        self.lr = _check_number("Plain: lr", lr, 0.0, 16.0, low_open=True)
        self.needs_buffer = self.lr != 1.0  # at lr = 1 the drop-in decodes straight into W_ref

    def __repr__(self) -> str:
        return "Plain()" if self.lr == 1.0 else f"Plain(lr={self.lr})"

    def delta_(self, names: Sequence[str], updates: List[torch.Tensor]) -> None:
        """Turn the averaged updates into the change of the shared weights, in place."""
        if updates and self.lr != 1.0:
            torch._foreach_mul_(updates, self.lr)

    def after_commit(self, residuals: List[torch.Tensor], refs: List[torch.Tensor],
                     in_weights: List[bool]) -> None:
        """Act on this rank's residuals once the sync's error feedback is committed."""

    def init_state(self, names: Sequence[str], likes: List[torch.Tensor]) -> None:
        """Create the state of every tensor not holding one yet (shaped like ``likes``)."""

    def state_dict(self) -> Dict:
        return {"kind": self.kind, "lr": self.lr}

    def load_state_dict(self, state: Dict) -> None:
        check_kind(self, state)

    def buffers(self) -> Dict[str, torch.Tensor]:
        """The state tensors (identical on every rank), by parameter name."""
        return {}


def check_kind(outer, state) -> None:
    """Raise ValueError unless ``state`` was saved by an outer step of the same kind."""
    kind = state.get("kind") if isinstance(state, dict) else None
    if kind != outer.kind:
        raise ValueError(f"the checkpoint's outer step is {kind!r} but this optimizer uses "
                         f"{outer!r}; build the DistributedOptimizer with the same outer=")


class Nesterov(Plain):
    r"""DiLoCo's outer step: SGD with Nesterov momentum on the pseudo-gradient ``g = -U``.

    With ``torch.optim.SGD(nesterov=True)``'s formulas on ``g`` (Sutskever et al., ICML 2013)::

        v <- momentum * v + U            (the momentum buffer, zero at the start)
        D  = lr * (U + momentum * v)     (W_ref += D)

    Args:
        lr: the outer learning rate, in (0, 2]; DiLoCo uses 0.7. ``lr=1, momentum=0`` is
            :class:`Plain` (up to rounding).
        momentum: in [0, 1); DiLoCo uses 0.9. The buffer keeps applying past syncs'
            averages, so the shared weights keep moving in directions all ranks agreed on:
            with few workers or many local steps between syncs (``delay``) this recovers
            progress that plain averaging loses (DiLoCo syncs every 500 local AdamW steps).

    The momentum buffers (one per parameter, float32 or float64 like the update) are a
    function of the averaged updates alone, identical on every rank, and saved in the
    drop-in's ``state_dict()``.
    """

    kind = "nesterov"
    needs_buffer = True

    def __init__(self, lr: float = 0.7, momentum: float = 0.9):
        self.lr = _check_number("Nesterov: lr", lr, 0.0, 2.0, low_open=True)
        self.momentum = _check_number("Nesterov: momentum", momentum, 0.0, 1.0)
        if self.momentum >= 1.0:
            raise ValueError(f"Nesterov: momentum must be below 1, got {momentum!r}")
        self._v: Dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"Nesterov(lr={self.lr}, momentum={self.momentum})"

    def _velocity(self, names: Sequence[str], updates: List[torch.Tensor]) -> List[torch.Tensor]:
        out = []
        for name, u in zip(names, updates):
            v = self._v.get(name)
            if v is None:
                v = self._v[name] = torch.zeros_like(u)
            elif v.shape != u.shape:
                raise ValueError(f"Nesterov: the momentum buffer of {name!r} has shape "
                                 f"{tuple(v.shape)} but its update {tuple(u.shape)}; did the "
                                 "model change shape?")
            elif v.dtype != u.dtype or v.device != u.device:
                v = self._v[name] = v.to(device=u.device, dtype=u.dtype)
            out.append(v)
        return out

    def delta_(self, names: Sequence[str], updates: List[torch.Tensor]) -> None:
        if not updates:
            return
        v = self._velocity(names, updates)
        torch._foreach_mul_(v, self.momentum)
        torch._foreach_add_(v, updates)
        torch._foreach_add_(updates, v, alpha=self.momentum)
        torch._foreach_mul_(updates, self.lr)

    def init_state(self, names: Sequence[str], likes: List[torch.Tensor]) -> None:
        self._velocity(names, likes)

    def state_dict(self) -> Dict:
        return {"kind": self.kind, "lr": self.lr, "momentum": self.momentum,
                "buffers": {k: v.detach().clone() for k, v in self._v.items()}}

    def load_state_dict(self, state: Dict) -> None:
        check_kind(self, state)
        self._v = {k: v.detach().clone() for k, v in state.get("buffers", {}).items()}

    def buffers(self) -> Dict[str, torch.Tensor]:
        return self._v


class ErrorDecay(Plain):
    r"""SparseLoCo's error feedback with decay: ``W_ref += lr * U``, and after each sync every
    rank's residual (what it has not sent yet) is scaled by ``decay``::

        e <- decay * e + dW;  send the selection of e;  e <- e - sent     (per rank)
        W_ref <- W_ref + lr * average(sent)

    SparseLoCo (arXiv 2508.15706) finds that this decayed error accumulator, together with
    aggressive top-k sparsification, takes the role of DiLoCo's outer momentum: there is no
    shared momentum state. The paper's workers restart from the shared weights after each
    sync (``local_residual=False`` here); with ``local_residual=True`` the residual lives in the
    live weights, and decaying it pulls each rank's weights towards ``W_ref`` by ``1 - decay``
    of their distance.

    Args:
        decay: the paper's beta, in [0, 1]; 1 is plain error feedback.
        lr: the outer learning rate (the paper's alpha), in (0, 2].
    """

    kind = "error_decay"
    needs_buffer = True

    def __init__(self, decay: float = 0.95, lr: float = 1.0):
        self.decay = _check_number("ErrorDecay: decay", decay, 0.0, 1.0)
        self.lr = _check_number("ErrorDecay: lr", lr, 0.0, 2.0, low_open=True)

    def __repr__(self) -> str:
        return f"ErrorDecay(decay={self.decay}, lr={self.lr})"

    def after_commit(self, residuals: List[torch.Tensor], refs: List[torch.Tensor],
                     in_weights: List[bool]) -> None:
        """``R *= decay``; a residual kept in the weights: ``W <- W_ref + decay (W - W_ref)``."""
        if self.decay == 1.0:
            return
        kept = [(w, r) for w, r, k in zip(residuals, refs, in_weights) if k]
        stored = [r for r, k in zip(residuals, in_weights) if not k]
        if kept:
            ws, rs = [w for w, _ in kept], [r for _, r in kept]
            torch._foreach_lerp_(ws, rs, 1.0 - self.decay)
        if stored:
            torch._foreach_mul_(stored, self.decay)

    def state_dict(self) -> Dict:
        return {"kind": self.kind, "decay": self.decay, "lr": self.lr}


def resolve_outer(outer) -> Plain:
    """``None`` -> :class:`Plain`; otherwise one of this module's outer steps."""
    return config.resolve_outer(outer, Plain, "horovod_sbc.torch.outer")
