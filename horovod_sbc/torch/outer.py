"""The outer steps of :mod:`horovod_sbc.outer` run on torch tensors (``SBC(outer=...)``).

:func:`make` turns a step's knobs into its runner: ``delta_`` turns a sync's averaged updates
``U`` into the change ``D`` of the shared weights in place, ``after_commit`` acts on the
residuals once the error feedback is committed; its state (Nesterov's buffers, one per tensor)
is saved in the drop-in's ``state_dict()``. The arithmetic runs as multi-tensor
``torch._foreach`` ops over all tensors at once (no per-tensor Python loop of kernel launches
on a GPU, no host read of device data).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from ..outer import ErrorDecay, Nesterov, OuterStep, Plain


class PlainStep:
    """``W_ref += lr * U`` (:class:`horovod_sbc.outer.Plain`); no state."""

    def __init__(self, spec: OuterStep):
        self.spec = spec
        self.kind, self.lr = spec.kind, spec.lr
        # at lr = 1 the drop-in decodes straight into W_ref, with no dense buffer of U
        self.needs_buffer = not spec.decodes_into_reference

    def __repr__(self) -> str:
        return repr(self.spec)

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
                         f"{outer!r}; build SBC with the same outer=")


class NesterovStep(PlainStep):
    """:class:`horovod_sbc.outer.Nesterov`: ``v <- m v + U``, ``D = lr (U + m v)``; the
    buffers (float32 or float64 like the update) are saved in ``state_dict()``."""

    def __init__(self, spec: Nesterov):
        super().__init__(spec)
        self.momentum = spec.momentum
        self._v: Dict[str, torch.Tensor] = {}

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


class ErrorDecayStep(PlainStep):
    """:class:`horovod_sbc.outer.ErrorDecay`: ``D = lr * U``, then every residual times
    ``decay``."""

    def __init__(self, spec: ErrorDecay):
        super().__init__(spec)
        self.decay = spec.decay
        self.needs_buffer = True

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


_RUNNERS = {"plain": PlainStep, "nesterov": NesterovStep, "error_decay": ErrorDecayStep}


def make(spec: Optional[OuterStep]) -> PlainStep:
    """The runner of ``spec`` (None: ``Plain()``), with fresh state."""
    spec = Plain() if spec is None else spec
    return _RUNNERS[spec.kind](spec)
