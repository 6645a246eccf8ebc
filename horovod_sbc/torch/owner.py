"""Which parameter is this gradient? The one place that reads Horovod's frames.

Stock ``hvd.DistributedOptimizer`` calls ``compression.compress(tensor)`` with no name, and
Horovod offers no public way to learn it. The name comes first from ``SBC(named_parameters=...)``
(public, always preferred); otherwise from the Horovod optimizer that called: a bounded, read-only
look at the frames of Horovod's own torch package only (``HOROVOD_MODULE``) for its ``self``
(whose ``_parameter_names`` maps parameters to names, and whose ``op`` says Average or Sum) and the
parameter ``p`` being reduced. Nothing of Horovod is modified. The drop-in optimizer also asks
whether ``step()`` is being called by ``hvd.broadcast_optimizer_state`` (a hidden initialisation
step that is not a training step).

What this reads of Horovod (names, locals) is pinned for the Horovod release this package is
built against by ``tests/test_owner.py``, which fails naming the piece that changed.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch

#: the Horovod release whose frames this module reads (tests/test_owner.py checks the source)
HOROVOD_VERSION = "0.28.1"
HOROVOD_MODULE = "horovod.torch"


@dataclass
class Owner:
    """What the stock hook learns about its caller: the parameter's name and Horovod's
    optimizer (``None`` when found through ``named_parameters`` alone)."""
    name: str
    optimizer: object = None
    parameter: Optional[torch.Tensor] = None
    op_sum: bool = False


def _horovod_frames(f, max_frames: int):
    """The frames of Horovod's torch package among ``f`` and its next ``max_frames - 1``
    callers."""
    for _ in range(max_frames):
        if f is None:
            return
        if str(f.f_globals.get("__name__", "")).startswith(HOROVOD_MODULE):
            yield f
        f = f.f_back


def _horovod_owner(tensor: torch.Tensor, max_frames: int = 3) -> Optional[Owner]:
    """Horovod's optimizer calls ``compress(p.grad)`` from ``_allreduce_grad_async(p)`` (or a
    comprehension over ``p`` in its grouped variant): read its ``self`` and ``p``."""
    for f in _horovod_frames(sys._getframe(3), max_frames):  # identify, compress, Horovod
        loc = f.f_locals
        owner = loc.get("self")
        if owner is not None and hasattr(owner, "_parameter_names"):
            op_sum = horovod_op_sum(owner)
            p = loc.get("p")
            if p is not None and _matches(p, tensor):
                name = owner._parameter_names.get(p)
                if name is not None:
                    return Owner(name, owner, p, op_sum)
    return None


def horovod_op_sum(optimizer) -> bool:
    """Does Horovod's ``optimizer`` sum (``op=hvd.Sum``) rather than average? Any other ``op``
    (Adasum) raises ValueError."""
    if hasattr(optimizer, "_starting_models"):  # horovod's _DistributedAdasumOptimizer
        raise ValueError(
            "SBC cannot be combined with op=hvd.Adasum: Adasum combines dense vectors "
            "pairwise. Use op=hvd.Average (the default) or "
            "horovod_sbc.torch.DistributedOptimizer.")
    import horovod.torch as hvd
    op = getattr(optimizer, "op", hvd.Average)
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"SBC supports op=hvd.Average or hvd.Sum, not {op!r}")
    return op == hvd.Sum


def _matches(p: torch.Tensor, tensor: torch.Tensor) -> bool:
    # Horovod hands compress() p.grad, or its dense copy with sparse_as_dense=True
    return p.grad is not None and (p.grad is tensor or (
        p.grad.is_sparse and not tensor.is_sparse and tensor.shape == p.shape))


def identify(tensor: torch.Tensor, named) -> Owner:
    """Which parameter is ``tensor`` the gradient of? By ``named`` (the ``named_parameters``
    given to ``SBC(...)``) first; the name Horovod's optimizer gives it otherwise. Horovod's
    frame is read in any case (bounded, read-only) for its ``op`` and to refuse Adasum."""
    hv = _horovod_owner(tensor)
    for name, p in named or ():
        if _matches(p, tensor):
            return Owner(name, hv.optimizer if hv else None, p, hv.op_sum if hv else False)
    if hv is not None:
        return hv
    raise ValueError(
        "SBC.compress() could not tell which parameter this tensor belongs to. Use it as "
        "compression= of hvd.DistributedOptimizer(..., named_parameters=...), pass "
        "named_parameters= to SBC(...), or use horovod_sbc.torch.DistributedOptimizer.")


def horovod_parameter_name(max_frames: int = 3) -> Optional[str]:
    """The name of the parameter Horovod's optimizer is handling in a caller's frame (its
    ``synchronize()`` loops over ``p``), or None: for errors about a tensor Horovod hands over
    without having called ``compress()`` for it (a sparse gradient)."""
    for f in _horovod_frames(sys._getframe(2), max_frames):
        owner, p = f.f_locals.get("self"), f.f_locals.get("p")
        names = getattr(owner, "_parameter_names", None)
        if isinstance(names, dict) and isinstance(p, torch.Tensor) and p in names:
            return names[p]
    return None


def global_process_set(optimizer) -> bool:
    """Does Horovod's ``optimizer`` reduce over the whole job (its default ``process_set``)?"""
    ps = getattr(optimizer, "process_set", None)
    return ps is None or getattr(ps, "process_set_id", 0) in (0, None)


def called_by_horovod_broadcast() -> bool:
    """Is ``step()`` being called by ``hvd.broadcast_optimizer_state``? It runs one step on zero
    gradients to create the optimizer state before broadcasting it; that is not a training step
    and must not count towards the delay window. Up to four callers are inspected, read-only
    (wrappers such as an LR scheduler's step counter sit in between)."""
    callers = _horovod_frames(sys._getframe(2), 4)  # step(), then who called it
    return any(f.f_code.co_name == "broadcast_optimizer_state" for f in callers)
