"""The drop-in distributed optimizer: communication delay + SBC + one fused allgather per sync.

Built like Horovod's ``horovod/torch/optimizer.py``: :func:`DistributedOptimizer` returns an
instance of a subclass of *your* optimizer's class, so its ``step()`` math, hyper-parameters,
``param_groups`` and LR schedulers behave exactly as before.

How a step works (``delay = n``):

1. ``step()`` runs your optimizer's own step on this rank's gradients (a *local* step).
2. Every n-th step is a *sync*: for each parameter, the weight update since the last sync,
   ``dW = W_local - W_ref``, plus its residual is SBC-compressed; all tensors' messages go in one
   allgather; every rank decodes and averages all ranks' updates ``U`` and sets
   ``W_ref += U`` and ``W_local = W_ref``. So all ranks hold bit-identical weights after each sync.

With ``delay=1`` and plain SGD (``dW = -lr * g``) this is gradient sparsification with error
feedback. Optimizer state (momentum buffers, Adam moments) stays **local** to each rank and is not
reset at a sync: it is computed from the rank's own gradients, exactly as in local SGD / FedAvg and
the SBC paper's experiments (which used momentum SGD), and since ``dW`` includes the momentum
term, momentum is carried through the residual like in DGC's "momentum correction". Broadcast it
once at start (:func:`broadcast_state`) so all ranks begin equal.

Gradients may be None for some parameters on some ranks and steps: the exchange is on weights,
so such a parameter simply contributes ``dW = 0``. Parameters with ``requires_grad=False`` and
non-floating-point parameters are left alone.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch

from ..core import resolve_compression
from .compressor import SBC
from .sync import Update

_STATE_KEY = "horovod_sbc"


def _called_by_horovod_broadcast() -> bool:
    """Is ``step()`` being called by ``hvd.broadcast_optimizer_state``? It runs one step on zero
    gradients to create the optimizer state before broadcasting it; that is not a training step
    and must not count towards the delay window. Up to four callers are inspected, read-only
    (wrappers such as an LR scheduler's step counter sit in between)."""
    f = sys._getframe(2)
    for _ in range(4):
        if f is None:
            return False
        if (f.f_code.co_name == "broadcast_optimizer_state"
                and str(f.f_globals.get("__name__", "")).startswith("horovod.")):
            return True
        f = f.f_back
    return False


class _SBCOptimizer:
    """Methods mixed into a subclass of the user's optimizer class (see DistributedOptimizer)."""

    # torch.amp.GradScaler hands us ``grad_scale``/``found_inf`` and always calls step(): a rank
    # whose gradients overflowed then skips its local update but still counts the step, so the
    # delay windows of all ranks stay aligned (a skipped step() call would hang the next sync)
    _step_supports_amp_scaling = True

    def __init__(self, params, named_parameters, compression: SBC):
        super(self.__class__, self).__init__(params)
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"param.{gi}.{i}", p) for gi, g in enumerate(self.param_groups)
                                for i, p in enumerate(g["params"])]
        if any(not isinstance(x, tuple) or len(x) != 2 for x in named_parameters):
            raise ValueError("named_parameters must be (name, parameter) tuples, e.g. "
                             "model.named_parameters()")
        names = [n for n, _ in named_parameters]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"parameter names must be unique; duplicated: {', '.join(dups)}")
        by_id = {id(p): n for n, p in named_parameters}
        ours = []
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) not in by_id:
                    raise ValueError("named_parameters was given but does not name every "
                                     f"optimized parameter (shape {tuple(p.shape)})")
                if p.requires_grad and p.is_floating_point():
                    ours.append((by_id[id(p)], p))
        # one canonical order on every rank: sorted by name (robust to construction order)
        self._sbc_params = sorted(ours, key=lambda t: t[0])
        self._sbc = compression
        self._sbc_local_steps = 0
        self._sbc_bypass = False
        compression.manager.config.update(delay=compression.delay)

    # -- public extras ----------------------------------------------------------------------------
    @property
    def compression(self) -> SBC:
        return self._sbc

    def stats(self):
        """Cumulative traffic figures of this rank (see :meth:`SBC.stats`)."""
        return self._sbc.stats()

    @contextlib.contextmanager
    def local_only(self):
        """Within this context ``step()`` is the plain local step (no counting, no sync)."""
        prev, self._sbc_bypass = self._sbc_bypass, True
        try:
            yield
        finally:
            self._sbc_bypass = prev

    @property
    def local_steps_pending(self) -> int:
        """Local steps taken since the last sync (0 right after one). Call :meth:`synchronize`
        at the end of training when this is not 0, so all ranks end with the same weights."""
        return self._sbc_local_steps

    def reset_reference(self) -> None:
        """Take the current weights as the shared reference (after a broadcast or a load)."""
        self._sbc.manager.reference = {}
        self._sbc_local_steps = 0

    # -- the step ---------------------------------------------------------------------------------
    def _capture_reference(self) -> None:
        ref = self._sbc.manager.reference
        for name, p in self._sbc_params:
            if name not in ref:
                ref[name] = p.detach().clone()

    def _local_step(self, closure):
        """The user's optimizer step on this rank's gradients (AMP-aware, see above)."""
        if "found_inf" not in self.__dict__:
            return super(self.__class__, self).step(closure)
        # GradScaler's attributes are for us; the wrapped optimizer must not see them
        found_inf, scale = self.__dict__.pop("found_inf"), self.__dict__.pop("grad_scale", None)
        try:
            if bool(found_inf):  # O(1) host read: this rank's scaled gradients overflowed
                return None
            if scale is not None:  # GradScaler did not unscale them: do it as it would
                inv = scale.double().reciprocal().float()
                for g in self.param_groups:
                    for p in g["params"]:
                        if p.grad is not None:
                            p.grad.mul_(inv.to(p.grad.device))
            return super(self.__class__, self).step(closure)
        finally:
            self.found_inf, self.grad_scale = found_inf, scale

    def step(self, closure=None):
        if self._sbc_bypass or _called_by_horovod_broadcast():
            return super(self.__class__, self).step(closure)
        self._capture_reference()
        loss = self._local_step(closure)
        self._sbc_local_steps += 1
        numel = sum(p.numel() for _, p in self._sbc_params)
        self._sbc.manager.add(steps=1, dense_bits=32 * numel)
        if self._sbc_local_steps % self._sbc.delay == 0:
            self.synchronize()
        return loss

    @torch.no_grad()
    def synchronize(self) -> None:
        """Exchange the accumulated update now (normally called by ``step()``)."""
        ref = self._sbc.manager.reference
        self._capture_reference()
        # dW = W_local - W_ref per parameter; the average of all ranks' decoded updates is added
        # straight into W_ref, then every rank continues from W_ref
        items = [Update(name, p.detach(), tuple(p.shape), base=ref[name])
                 for name, p in self._sbc_params]
        self._sbc.exchange(items, out=[ref[name].view(-1) for name, _ in self._sbc_params])
        for name, p in self._sbc_params:
            p.copy_(ref[name])
        self._sbc_local_steps = 0

    # -- state --------------------------------------------------------------------------------
    def state_dict(self):
        sd = super(self.__class__, self).state_dict()
        st = self._sbc.state_dict()
        st["local_steps"] = self._sbc_local_steps
        sd[_STATE_KEY] = st
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        st = state_dict.pop(_STATE_KEY, None)
        super(self.__class__, self).load_state_dict(state_dict)
        if st is not None:
            self._sbc.load_state_dict(st)
            self._sbc_local_steps = int(st.get("local_steps", 0))
            ref = self._sbc.manager.reference
            for name, p in self._sbc_params:
                if name in ref:
                    ref[name] = ref[name].to(device=p.device, dtype=p.dtype)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression: Optional[SBC] = None, delay: Optional[int] = None,
                         density: Optional[float] = None):
    """Wrap ``optimizer`` for SBC training with communication delay (the full feature set).

    Args:
        optimizer: your torch optimizer; the result is an instance of a subclass of its class.
        named_parameters: ``model.named_parameters()``; names key the residuals and checkpoint
            state and fix the message order (sorted by name on every rank).
        compression: an :class:`SBC` (default ``SBC()``); its ``delay`` is the number of local
            steps between syncs.
        delay, density: shorthands that build ``SBC(density=..., delay=...)`` when
            ``compression`` is not given.

    Stock Horovod helpers work as with any optimizer: ``hvd.broadcast_parameters`` and
    ``hvd.broadcast_optimizer_state`` before training (its internal initialisation step is not
    counted as a training step), LR schedulers, and ``torch.amp.GradScaler`` (a rank whose
    gradients overflow skips its local update but keeps the delay window). If you overwrite the
    weights mid-training (a broadcast or a load of model weights only), call
    :meth:`reset_reference` on every rank afterwards.

    Checkpoints: ``optimizer.state_dict()`` includes this rank's residuals, the reference weights
    and the step counter within the delay window; save it **on every rank** (residuals differ per
    rank) and ``load_state_dict`` it to continue exactly.
    """
    compression = resolve_compression(SBC, compression, density, delay, "horovod_sbc.torch.SBC")
    methods = {k: v for k, v in _SBCOptimizer.__dict__.items()
               if k not in ("__dict__", "__weakref__")}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    return cls(optimizer.param_groups, named_parameters, compression)


def broadcast_state(model_or_params, optimizer, root_rank: int = 0) -> None:
    """Make all ranks start equal: broadcast parameters and optimizer state from ``root_rank``
    and take the result as the reference weights of the communication delay.

    ``model_or_params`` is a module, its ``state_dict()`` or ``named_parameters()``.
    """
    import horovod.torch as hvd
    if isinstance(model_or_params, torch.nn.Module):
        params = model_or_params.state_dict()
    else:
        params = model_or_params
    _broadcast_tensors(params.items() if isinstance(params, dict) else params, root_rank)
    if hasattr(optimizer, "local_only"):
        with optimizer.local_only():
            hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
        optimizer.reset_reference()
    else:
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)


# Horovod's collectives lack these dtypes; broadcasting the same bytes under another dtype is exact.
_WIRE_VIEW = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}


def _broadcast_tensors(named, root_rank: int) -> None:
    """``hvd.broadcast_parameters`` that also handles bfloat16/bool tensors (as same-size integer
    views) and skips empty tensors (nothing to send; empty collectives can hang under Gloo)."""
    import horovod.torch as hvd
    handles = []
    for name, t in sorted(named, key=lambda kv: kv[0]):
        if t.numel() == 0:
            continue
        view = t.data.view(_WIRE_VIEW[t.dtype]) if t.dtype in _WIRE_VIEW else t.data
        handles.append(hvd.broadcast_async_(view, root_rank, name=f"sbc.bcast.{name}"))
    for h in handles:
        hvd.synchronize(h)
