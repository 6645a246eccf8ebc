"""Elastic Horovod with SBC: :class:`SBCState`, a ``hvd.elastic.TorchState`` that keeps every
surviving rank's residual across a reset.

Plain ``TorchState`` broadcasts rank 0's weights (which hold rank 0's residual with the drop-in)
and optimizer state, and keeps the stock hook's ``SBC`` object by reference, never rolling its
residuals back (docs/elastic.md). ``SBCState`` gives each SBC optimizer (the drop-in, or stock
``hvd.DistributedOptimizer`` with ``compression=SBC(...)``, which it has the stock hook adopt at
once: the drop-in's step, on every rank from the start) one :class:`SBCHandler` that owns it and
the models holding its parameters:

* ``save()`` (``state.commit()``) deep-copies the weights, the models' other tensors and the
  optimizer's state, SBC's residuals, shared weights ``W_ref``, counters and delay-window
  position included; ``restore()`` copies them back (as this worker's own state, whatever rank
  it has now), so error feedback of steps after the commit is rolled back with them;
* ``sync()``: the *source* is the lowest rank that trained in this job (one flag exchanged).
  The shared weights ``W_ref``, the models' buffers and untrained
  tensors, the delay-window position, the outer-step state and the user's other attributes come
  from it by Horovod's broadcasts. A survivor whose shared weights equal the source's keeps its
  residual, weights and optimizer state; any other worker takes the source's optimizer state
  and continues from the shared weights with a zero residual. The synced state is committed;
* ``reset()`` renews the world size and rank SBC records for checkpoint checks.

A sync after a reset is encoded for, gathered in and decoded with the new world; one that a
failure interrupts commits no error feedback. Needs the Gloo controller (no ``topology="server"``).
Horovod's elastic loop, and why these rules: docs/design.md#elastic-horovod-what-survives-a-reset.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from horovod.torch.elastic.state import TorchState
from horovod.torch.functions import broadcast_object

from ..hierarchy import refuse_elastic
from .compressor import SBC
from .optimizer import _broadcast_tensors


def _hvd():
    import horovod.torch as hvd
    return hvd


def compression_of(optimizer) -> Optional[SBC]:
    """The :class:`SBC` of the drop-in (its ``compression``) or of stock
    ``hvd.DistributedOptimizer(compression=SBC(...))`` (Horovod keeps it as ``_compression``);
    None for any other optimizer."""
    for attr in ("compression", "_compression"):
        c = getattr(optimizer, attr, None)
        if isinstance(c, SBC):
            return c
    return None


def _is_drop_in(optimizer) -> bool:
    return hasattr(optimizer, "local_only") and hasattr(optimizer, "_sbc_params")


def _differs(old: Sequence[torch.Tensor], new: Sequence[torch.Tensor]) -> bool:
    """Does any pair differ in any element? One host read for all tensors."""
    flags = [torch.ne(a, b).any().view(1) for a, b in zip(old, new) if a.numel()]
    return bool(torch.cat(flags).any()) if flags else False


def _broadcast_int(value: int, root_rank: int, name: str) -> int:
    t = torch.tensor([int(value)], dtype=torch.int64)
    _hvd().broadcast_(t, root_rank, name=name)
    return int(t[0])


def _own_state(st: dict, sbc: SBC) -> dict:
    """A copy of SBC state this worker saved itself, its world record set to the current one:
    a rank number or world size that changed since the commit does not make it another
    rank's state (the checkpoint checks are for files, not for this worker's memory)."""
    with contextlib.suppress(RuntimeError, ImportError, ValueError):
        sbc.state.world()
    cfg = dict(st.get("config", {}))
    for key in ("world_size", "rank"):
        if key in sbc.manager.config:
            cfg[key] = sbc.manager.config[key]
        else:
            cfg.pop(key, None)
    return dict(st, config=cfg)


class SBCHandler:
    """Commit, restore and sync of one SBC optimizer together with the models that hold its
    parameters (a Horovod ``StateHandler``: ``value``, ``save``, ``restore``, ``sync``,
    ``set_value``). See the module docstring for the rules."""

    def __init__(self, optimizer, models: Sequence[torch.nn.Module] = ()):
        self.sbc = compression_of(optimizer)
        if self.sbc is None:
            raise ValueError("SBCState: the optimizer has no SBC compression; pass "
                             "horovod_sbc.torch.DistributedOptimizer(...) or "
                             "hvd.DistributedOptimizer(..., compression=SBC(...))")
        refuse_elastic(self.sbc.config.hierarchy)
        if not _is_drop_in(optimizer):
            # stock Horovod's: adopted now rather than at its first step (the hook's choice,
            # the same on every rank), so that a worker that joins later runs the same sync
            # as the survivors, whose optimizers have stepped
            self.sbc.exchange_for(optimizer)
        self.value = optimizer
        self.models = list(models)
        self.joined = False  # did this worker train in this job (is its state worth keeping)?
        self.save()

    @property
    def drop_in(self) -> bool:
        """Does the optimizer run the drop-in's step (the drop-in, or stock Horovod's adopted
        by the stock hook, which ``__init__`` asks for)?"""
        return _is_drop_in(self.value)

    def set_value(self, value) -> None:
        """``state.optimizer = new_optimizer`` (``TorchState.__setattr__``): own it instead."""
        joined = self.joined
        self.__init__(value, self.models)
        self.joined = joined

    # -- what the handler owns -------------------------------------------------------------------
    def owned(self) -> List[Tuple[str, torch.Tensor]]:
        """The trained parameters, named the same on every rank."""
        if self.drop_in:
            return list(self.value._sbc_params)
        return [(f"param.{gi}.{i}", p) for gi, g in enumerate(self.value.param_groups)
                for i, p in enumerate(g["params"])]

    def others(self) -> List[Tuple[str, torch.Tensor]]:
        """The models' other tensors (buffers, parameters nobody trains), by their state-dict
        names."""
        ptrs = {p.data_ptr() for _, p in self.owned() if p.numel()}
        return [(f"model{i}.{k}", v) for i, m in enumerate(self.models)
                for k, v in m.state_dict().items() if v.data_ptr() not in ptrs or not v.numel()]

    # -- commit / restore ----------------------------------------------------------------------
    @torch.no_grad()
    def save(self) -> None:
        self._weights = [p.detach().clone() for _, p in self.owned()]
        self._others = [v.clone() for _, v in self.others()]
        self._optimizer = copy.deepcopy(self.value.state_dict())
        self._saved_sbc = None if self.drop_in else copy.deepcopy(self.sbc.state_dict())

    @torch.no_grad()
    def restore(self) -> None:
        """Back to the last commit: weights first (the drop-in's residual is ``W - W_ref`` of
        the loaded weights), then the optimizer with SBC's state as this worker's own."""
        for (_, p), w in zip(self.owned(), self._weights):
            p.copy_(w)
        for (_, v), w in zip(self.others(), self._others):
            v.copy_(w)
        sd = copy.deepcopy(self._optimizer)  # loaded state must not alias the saved copy
        if "horovod_sbc" in sd:  # committed by the drop-in's step
            sd["horovod_sbc"] = _own_state(sd["horovod_sbc"], self.sbc)
        self.value.load_state_dict(sd)  # stock Horovod's also drops its pending handles
        if self._saved_sbc is not None:  # committed before stock Horovod's first step
            self.sbc.load_state_dict(_own_state(copy.deepcopy(self._saved_sbc), self.sbc))
        if not self.drop_in:
            self.sbc.realign_steps()

    def renew_world(self) -> None:
        """Record the new world's size and rank (after Horovod's ``shutdown(); init()``)."""
        with contextlib.suppress(RuntimeError, ImportError, ValueError):
            self.sbc.state.world()

    # -- sync ------------------------------------------------------------------------------------
    def source(self) -> int:
        """The lowest rank that trained in this job (0 at the job's first sync)."""
        flag = torch.tensor([int(self.joined)], dtype=torch.int32)
        flags = _hvd().allgather(flag, name="sbc.elastic.joined")
        held = [r for r, f in enumerate(flags.tolist()) if f]  # O(world size) control values
        return held[0] if held else 0

    @torch.no_grad()
    def sync(self) -> int:
        """Make the world agree on what it shares, keep each survivor's own state (see the
        module docstring); returns the source rank."""
        source = self.source()
        keep = self.joined
        shared = self._shared_tensors()  # W_ref (drop-in) or the weights (stock hook)
        before = [t.clone() for _, t in shared] if keep else []
        self._sync_optimizer_state(source, keep)
        _broadcast_tensors(shared, source)
        _broadcast_tensors(self.others(), source)
        if keep and _differs(before, [t for _, t in shared]):
            warnings.warn(f"horovod_sbc: rank {_hvd().rank()}'s shared weights differ from rank "
                          f"{source}'s (it restored an older commit): it continues from the "
                          "shared weights with a zero residual")
            keep = False
        if not keep:
            self._start_from_shared()
        if self.drop_in:
            opt = self.value
            opt._broadcast_outer_state(source)
            opt._sbc_local_steps = _broadcast_int(opt._sbc_local_steps, source,
                                                  "sbc.elastic.local_steps")
        else:
            self.sbc.realign_steps()
        self.renew_world()
        self.joined = True
        return source

    def _shared_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        if not self.drop_in:
            return [(n, p.data) for n, p in self.owned()]
        self.value._capture_reference()  # a new worker: W_ref = W, then overwritten
        ref = self.sbc.manager.reference
        return [(n, ref[n]) for n, _ in self.owned()]

    def _sync_optimizer_state(self, source: int, keep: bool) -> None:
        """``hvd.broadcast_optimizer_state`` from ``source``; a rank that keeps its state loads
        its own back. Horovod creates a missing state by one step on zero gradients first (the
        drop-in does not count it); a kept rank's weights and gradients are put back after it
        (weight decay would move them)."""
        opt = self.value
        # the user's optimizer class (an adopted stock optimizer's own super() is the drop-in's,
        # whose state_dict() holds SBC's state: not to be loaded back over the broadcasts)
        base = opt._sbc_base if self.drop_in else type(opt).__mro__[1]
        own = copy.deepcopy(base.state_dict(opt)) if keep else None
        params = [p for g in opt.param_groups for p in g["params"]]
        weights = [p.detach().clone() for p in params] if keep and not own["state"] else None
        grads = [p.grad for p in params]
        with opt.local_only() if self.drop_in else contextlib.nullcontext():
            _hvd().broadcast_optimizer_state(opt, root_rank=source)
        for p, g in zip(params, grads):
            p.grad = g
        if own is not None:
            base.load_state_dict(opt, own)
        if weights is not None:
            for p, w in zip(params, weights):
                p.copy_(w)

    def _start_from_shared(self) -> None:
        """A new worker (or one behind the source): the shared weights, a zero residual."""
        mgr = self.sbc.manager
        if self.drop_in:
            for name, p in self.owned():
                p.copy_(mgr.reference[name])
        for r in list(mgr.residuals.values()) + list(mgr.server_residuals.values()):
            r.zero_()


class SBCState(TorchState):
    """``hvd.elastic.TorchState`` for SBC: ``SBCState(model, optimizer, **kwargs)``.

    ``optimizer`` (and any further optimizer among ``kwargs``) may be the drop-in
    :func:`horovod_sbc.torch.DistributedOptimizer` or stock ``hvd.DistributedOptimizer`` with
    ``compression=SBC(...)``; each gets an :class:`SBCHandler` that also owns the models
    holding its parameters. Other models and optimizers keep Horovod's handlers (broadcast
    from rank 0); other keyword arguments are plain attributes, broadcast from the source
    rank at every sync (``ObjectState``). Use it as ``TorchState``::

        state = SBCState(model, optimizer, epoch=0, batch=0)

        @hvd.elastic.run
        def train(state):
            ...
            state.commit()
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        super().__init__(model=model, optimizer=optimizer, **kwargs)
        handlers = dict(self._handlers)
        ours = [k for k, h in handlers.items() if compression_of(h.value) is not None]
        if not ours:
            raise ValueError("SBCState needs an optimizer with SBC compression: "
                             "horovod_sbc.torch.DistributedOptimizer(...) or "
                             "hvd.DistributedOptimizer(..., compression=SBC(...)); for others "
                             "use hvd.elastic.TorchState")
        for k in ours:
            opt = handlers[k].value
            ids = {id(p) for g in opt.param_groups for p in g["params"]}
            models = [m for m, h in handlers.items() if isinstance(h.value, torch.nn.Module)
                      and any(id(p) in ids for p in h.value.parameters())]
            handlers[k] = SBCHandler(opt, [handlers.pop(m).value for m in models])
        self._handlers = handlers

    def _sbc_handlers(self) -> List[SBCHandler]:
        return [h for h in self._handlers.values() if isinstance(h, SBCHandler)]

    def sync(self) -> None:
        """Horovod's handlers as ``TorchState`` does; SBC handlers as described in the module
        docstring; then the plain attributes from the SBC source rank, and a commit."""
        source = 0
        for handler in self._handlers.values():
            if isinstance(handler, SBCHandler):
                source = handler.sync()
            else:
                handler.sync()
        if self._saved_state:  # ObjectState.sync, from the source instead of rank 0
            self._saved_state = broadcast_object(self._saved_state, root_rank=source,
                                                 name="sbc.elastic.objects")
            self._set_attrs()
        self.save()

    def reset(self) -> None:
        for handler in self._sbc_handlers():
            handler.renew_world()
        super().reset()

    def stats(self) -> Dict[str, Dict[str, int]]:
        """``stats()`` of every SBC optimizer, by its keyword."""
        return {k: h.sbc.stats() for k, h in self._handlers.items() if isinstance(h, SBCHandler)}


__all__ = ["SBCState", "SBCHandler", "compression_of"]
