"""The drop-in distributed optimizer: communication delay + SBC + one fused allgather per sync.

Built like Horovod's ``horovod/torch/optimizer.py``: an instance of a subclass of *your*
optimizer's class, so its ``step()``, hyper-parameters, ``param_groups`` and LR schedulers behave
as before. Every ``delay`` local steps the update ``A = W_local - W_ref`` of each parameter
(everything this rank's optimizer did since the shared weights and has not sent) is
SBC-compressed, all tensors' messages go in one allgather, and every rank adds the decoded
average to ``W_ref`` (bit-identical everywhere; ``outer=`` replaces that by another outer step,
:mod:`horovod_sbc.torch.outer`). The residual ``R = A - sent`` stays in each rank's weights
(``local_residual=True``, the default: error feedback in weight space) or beside the shared
weights (``False``); Adam's, AdamW's and RMSprop's second moment is frozen automatically
(:mod:`horovod_sbc.torch.adam`; :func:`horovod_sbc.policy.choose`). docs/design.md says why.

With the residual in float32/float64 weights nothing else stores it (``R = W - W_ref``): a sync
reads the weights and ``W_ref`` once. fp16/bf16 weights keep a float32 residual beside them.
Ranks' live weights differ by their residuals until :meth:`finish`; :meth:`shared_weights`
evaluates ``W_ref``. :func:`adopt` makes stock ``hvd.DistributedOptimizer`` run this step (the
stock hook's weight exchange). Parameters without gradient on some step contribute ``dW = 0``;
``requires_grad=False`` and non-floating-point parameters are left alone.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import policy
from ..config import OPTIMIZER_STATE_KEY
from .adam import check_freeze, family, frozen_step
from .hierarchy import Hierarchy
from .outer import check_kind, make as make_outer
from .owner import called_by_horovod_broadcast
from .sync import Update
from .sync import named_parameters as checked_named_parameters



class _SBCOptimizer:
    """Methods mixed into a subclass of the user's optimizer class (see DistributedOptimizer)."""

    # torch.amp.GradScaler hands us ``grad_scale``/``found_inf`` and always calls step(): a rank
    # whose gradients overflowed then skips its local update but still counts the step, so the
    # delay windows of all ranks stay aligned (a skipped step() call would hang the next sync)
    _step_supports_amp_scaling = True

    #: the user's optimizer class, whose step() this one runs locally (set per subclass by
    #: :func:`dropin_class`; not ``super(self.__class__, ...)``, so that Horovod's optimizer
    #: can be stacked on top, as the stock hook's weight exchange does)
    _sbc_base = torch.optim.Optimizer

    def __init__(self, params, named_parameters, compression):
        self._sbc_base.__init__(self, params)
        self._sbc_setup(named_parameters, compression, "dropin")

    def _sbc_setup(self, named_parameters, compression, api: str) -> None:
        """Everything of the drop-in but the user's optimizer (which ``self`` already is)."""
        cfg = compression.config
        self._sbc_freeze = check_freeze(cfg.freeze_variance_after, self)
        self._sbc_pending_load = None
        _refuse_stock_knobs(compression, api, type(self).__name__)
        choice = policy.choose(family(self), delay=compression.delay, api=api,
                               local_residual=cfg.local_residual)
        local_residual = self._sbc_local_residual = choice.local_residual
        outer = cfg.outer
        if outer is None:
            outer = policy.outer_step(choice, _world_size(compression))
        self._sbc_outer = make_outer(outer)
        self._sbc_outer_scratch = {}  # name -> dense buffer of the average U (not saved)
        if named_parameters is None:
            named_parameters = [(f"param.{gi}.{i}", p) for gi, g in enumerate(self.param_groups)
                                for i, p in enumerate(g["params"])]
        named_parameters = checked_named_parameters(named_parameters)
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
        self._sbc_failed = None  # nonfinite="skip": the first non-finite gradient's name
        self._sbc_bypass = False
        compression.manager.config.update(delay=compression.delay, local_residual=local_residual)
        self._sbc_hier = None  # the hierarchical exchange (SBC(hierarchy=...)), built on every rank
        if compression.hierarchy is not None:
            self._sbc_hier = Hierarchy(compression, compression.hierarchy, self._sbc_params)

    # -- public extras ----------------------------------------------------------------------------
    @property
    def compression(self):
        return self._sbc

    @property
    def outer(self):
        """The outer step (:mod:`horovod_sbc.torch.outer`) applied to each sync's average."""
        return self._sbc_outer

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

    def _user_step(self, closure):
        if "found_inf" not in self.__dict__:
            return self._inner_step(closure)
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
            return self._inner_step(closure)
        finally:
            self.found_inf, self.grad_scale = found_inf, scale

    def _inner_step(self, closure):
        """The user's step; Adam's with its second moment frozen once ``freeze_variance_after``
        steps are done (:mod:`horovod_sbc.torch.adam`)."""
        if self._sbc_freeze is None or \
                not self._sbc_freeze.due(self, self._sbc.manager.counters["steps"]):
            return self._sbc_base.step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        frozen_step(self)
        return loss

    def step(self, closure=None):
        if self._sbc_bypass or called_by_horovod_broadcast():
            return self._sbc_base.step(self, closure)
        if self._sbc_pending_load is not None:  # adopted: see adopt()
            st, self._sbc_pending_load = self._sbc_pending_load, None
            counted = dict(self._sbc.manager.counters)  # by this step's compress() calls
            self._sbc_load(st)
            self._sbc.manager.add(**counted)
        self._capture_reference()
        bad = self._nonfinite_gradient() if self._sbc.config.nonfinite == "skip" else None
        if bad is not None:
            # the user's optimizer never sees it (its momentum, its moments stay finite), and
            # the window's sync is skipped on every rank, naming this rank and parameter
            loss = None
            if self._sbc_failed is None:
                self._sbc_failed = bad
        else:
            loss = self._user_step(closure)  # the user's step on this rank's gradients
        self._sbc_local_steps += 1
        numel = sum(p.numel() for _, p in self._sbc_params)
        self._sbc.manager.add(steps=1, dense_bits=32 * numel)
        if self._sbc_local_steps % self._sbc.delay == 0:
            self._sbc_sync()
        return loss

    def _nonfinite_gradient(self) -> Optional[str]:
        """The name of the first parameter (in the canonical order) whose gradient holds NaN or
        Inf, else None: one fused max-abs over every gradient and one host read."""
        named = [(n, p.grad) for n, p in self._sbc_params
                 if p.grad is not None and not p.grad.is_sparse]
        if not named:
            return None
        peaks = torch._foreach_norm([g for _, g in named], float("inf"))
        dev = peaks[0].device
        if any(t.device != dev for t in peaks):  # a model split over devices: gather them
            peaks = [t.to(dev) for t in peaks]
        finite = torch.isfinite(torch.stack(peaks)).tolist()  # stack promotes the dtypes
        return next((n for (n, _), ok in zip(named, finite) if not ok), None)

    @property
    def local_residual(self) -> bool:
        """Whether each rank keeps its unsent update in its weights (see the module docstring)."""
        return self._sbc_local_residual

    def _in_weights(self, name: str, p: torch.Tensor) -> bool:
        """Does ``p`` hold its own residual (``local_residual=True`` with float32/float64
        contiguous weights)? Then ``R = W - W_ref`` is not stored anywhere else."""
        ref = self._sbc.manager.reference.get(name)
        return self._sbc_local_residual and p.dtype in (torch.float32, torch.float64) and \
            p.is_contiguous() and ref is not None and ref.dtype == p.dtype and \
            ref.device == p.device and ref.is_contiguous()

    def synchronize(self) -> None:
        """Exchange the accumulated update now (normally called by ``step()``). On a stock
        ``hvd.DistributedOptimizer`` that exchanges weight changes, ``synchronize()`` is
        Horovod's (the gradients' collectives) and this is ``_sbc_sync()``."""
        self._sbc_sync()

    @torch.no_grad()
    def _sbc_sync(self) -> None:
        ref = self._sbc.manager.reference
        self._capture_reference()
        res = self._sbc.manager.residuals
        local = self._sbc_local_residual
        failed, self._sbc_failed = self._sbc_failed, None
        reason = None if failed is None else f"the gradient of {failed!r} contains NaN or Inf"
        if self._sbc_hier is not None:  # dense in the node, SBC between nodes
            self._sbc_hier.synchronize(self._sbc_params, ref, local, self._sbc_outer, reason)
            self._sbc_local_steps = 0
            return
        error = None if reason is None else (self._sbc.state.world()[1], reason)
        # local_residual=True: float32/float64 weights hold W_ref + R themselves, so the update
        # is W - W_ref, read once in the selection's pass; the decoded average moves W with
        # W_ref, and what this rank sent leaves W (sync.Update.in_weights, Encoded.commit).
        # Other dtypes keep R beside the weights (fp32 for fp16/bf16): the update is
        # W - (W_ref + R), added to R, and the weights are set to W_ref + R afterwards.
        kept = {name for name, p in self._sbc_params if self._in_weights(name, p)}
        items = [Update(name, p.detach(), tuple(p.shape), base=ref[name], in_weights=name in kept,
                        base_offset=res[name] if local and name in res and name not in kept
                        else None)
                 for name, p in self._sbc_params]
        if self._sbc_outer.needs_buffer:
            self._outer_exchange(items, kept, error)
        else:
            self._sbc.exchange(items, out=[ref[name].view(-1) for name, _ in self._sbc_params],
                               error=error)
        shared = []  # the weights that continue from W_ref: one foreach copy for all
        for name, p in self._sbc_params:
            if name in kept:
                continue
            if local and name in res:
                # W_ref + R; after a skipped sync healthy ranks keep R + dW (weights unchanged)
                # and the failing rank has R again (its non-finite window is dropped)
                r = res[name].view_as(p)
                if r.dtype == p.dtype == ref[name].dtype and p.is_contiguous():
                    torch.add(ref[name].view_as(p), r, out=p)  # no temporary
                else:
                    p.copy_(ref[name] + r.to(p.dtype))
            else:
                shared.append((p, ref[name]))
        if shared:
            torch._foreach_copy_([p for p, _ in shared], [r.view_as(p) for p, r in shared])
        self._sbc_local_steps = 0

    def _outer_buffer(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """The reused dense buffer ``name``'s average is decoded into (float32; float64 for
        float64 weights); its contents are overwritten by every decode."""
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        buf = self._sbc_outer_scratch.get(name)
        if buf is None or buf.numel() != p.numel() or buf.dtype != dtype or \
                buf.device != p.device:
            buf = self._sbc_outer_scratch[name] = torch.empty(p.numel(), dtype=dtype,
                                                              device=p.device)
        return buf

    def _outer_exchange(self, items, kept, error=None) -> None:
        """One sync through the outer step: the average ``U`` is decoded into dense buffers,
        the outer step turns it into ``D`` (in place), ``D`` is added to ``W_ref`` and to the
        weights that hold their residual, and then this rank's sent update leaves those
        weights (the commit); the outer step may then act on the residuals (ErrorDecay)."""
        ref, res = self._sbc.manager.reference, self._sbc.manager.residuals
        names = [name for name, _ in self._sbc_params]
        bufs = [self._outer_buffer(name, p) for name, p in self._sbc_params]
        refs = [ref[name].view(-1) for name in names]
        moved = [(p.detach().view(-1), b) for (name, p), b in zip(self._sbc_params, bufs)
                 if name in kept]

        def apply(us):
            self._sbc_outer.delta_(names, us)
            if us:
                torch._foreach_add_(refs, us)
            if moved:
                torch._foreach_add_([w for w, _ in moved], [d for _, d in moved])

        if self._sbc.exchange(items, out=bufs, apply=apply, error=error) is None:
            return  # skipped: nothing was applied
        pairs = [(p.detach().view(-1), r, True) for (name, p), r in zip(self._sbc_params, refs)
                 if name in kept]
        pairs += [(res[name], r, False) for name, r in zip(names, refs)
                  if name not in kept and name in res]
        self._sbc_outer.after_commit([a for a, _, _ in pairs], [b for _, b, _ in pairs],
                                     [k for _, _, k in pairs])

    def _broadcast_outer_state(self, root_rank: int) -> None:
        """The outer step's state from ``root_rank`` (e.g. the one rank that loaded a
        checkpoint): every rank creates its buffers (zeros) first, so all broadcast the same
        set."""
        if not self._sbc_outer.buffers() and not self._sbc_outer.needs_buffer:
            return
        self._sbc_outer.init_state([n for n, _ in self._sbc_params],
                                   [self._outer_buffer(n, p) for n, p in self._sbc_params])
        bufs = self._sbc_outer.buffers()
        _broadcast_tensors([(f"outer.{n}", t) for n, t in bufs.items()], root_rank)

    def residuals(self):
        """``{name: flat residual}`` of this rank: the update not sent yet. Weights that hold
        their residual give ``W - W_ref`` (a new tensor); the others their stored residual."""
        ref, res = self._sbc.manager.reference, self._sbc.manager.residuals
        out = {}
        for name, p in self._sbc_params:
            if name in ref and self._in_weights(name, p):
                out[name] = (p.detach() - ref[name]).view(-1)
            elif name in res:
                out[name] = res[name]
        return out

    @torch.no_grad()
    def finish(self, average_residuals: Optional[bool] = None) -> None:
        """End of training: give every rank the same weights.

        Syncs a pending partial delay window first. ``average_residuals=True`` sets every
        rank's weights to ``W_ref`` + the average of all ranks' residuals (one dense allreduce,
        then a broadcast from rank 0 so that the result is bit-identical); ``False`` drops the
        residuals (weights = ``W_ref``, no traffic). ``None`` (default): ``True`` with
        ``local_residual=True`` (ranks' weights differ by their residuals, which are part of
        what each trained), ``False`` with the residual beside the shared weights (every rank
        already holds ``W_ref``; the residuals there are a backlog of delayed steps, and adding
        their average at once trained worse, docs/recipes.md). Residuals are
        cleared either way."""
        import horovod.torch as hvd
        if average_residuals is None:
            average_residuals = self._sbc_local_residual
        self._capture_reference()
        if self._sbc_local_steps:
            self._sbc_sync()
        ref = self._sbc.manager.reference
        res = self._sbc.manager.residuals
        current = self.residuals()
        if self._sbc_hier is not None and not self._sbc_local_residual:
            current = self._sbc_hier.residual_shares(self._sbc_params)
        for name, p in self._sbc_params:
            r = current.get(name)
            if average_residuals and r is not None:
                avg = hvd.allreduce(r.view_as(p).to(p.dtype), op=hvd.Average,
                                    name=f"sbc.finish.{name}")
                p.copy_(ref[name] + avg)
            else:
                p.copy_(ref[name])
            if name in res:
                res[name].zero_()
            ref[name].copy_(p)
        for t in self._sbc_hier.stored_residuals(self._sbc_params) if self._sbc_hier else ():
            t.zero_()
        if average_residuals:
            _broadcast_tensors(self._sbc_params, 0)
            for name, p in self._sbc_params:
                ref[name].copy_(p)
        self._sbc_local_steps = 0

    @contextlib.contextmanager
    def shared_weights(self):
        """Within this context the parameters hold the shared weights ``W_ref`` (bit-identical on
        every rank, e.g. to evaluate or save one model); they are restored afterwards."""
        ref = self._sbc.manager.reference
        saved = [(p, p.detach().clone()) for name, p in self._sbc_params if name in ref]
        try:
            with torch.no_grad():
                for name, p in self._sbc_params:
                    if name in ref:
                        p.copy_(ref[name])
            yield
        finally:
            with torch.no_grad():
                for p, v in saved:
                    p.copy_(v)

    # -- state --------------------------------------------------------------------------------
    def state_dict(self):
        sd = self._sbc_base.state_dict(self)
        st = self._sbc.state_dict()
        st["residuals"] = dict(st["residuals"], **self.residuals())  # W - W_ref where kept
        st["local_steps"] = self._sbc_local_steps
        st["outer"] = self._sbc_outer.state_dict()
        if self._sbc_freeze is not None:
            st["freeze"] = self._sbc_freeze.state_dict()
        sd[OPTIMIZER_STATE_KEY] = st
        return sd

    def load_state_dict(self, state_dict):
        """Restore a state saved by :meth:`state_dict`. This rank's own state resumes exactly.
        A state saved by another rank of a job of the same size (Horovod's habit: rank 0
        saves, every rank loads that file) gives this rank only what all ranks share: the
        shared weights ``W_ref``, the outer step's state, the step counter within the delay
        window (and the saved rank's optimizer state and counters); its weights are set to
        ``W_ref`` and its residual starts at zero (the saved rank's unsent update is not
        this rank's). Load the model's weights first, then this."""
        state_dict = dict(state_dict)
        st = state_dict.pop(OPTIMIZER_STATE_KEY, None)
        self._sbc_base.load_state_dict(self, state_dict)
        if st is not None:
            self._sbc_load(st)

    @torch.no_grad()
    def _sbc_load(self, st) -> None:
        """The drop-in's part of :meth:`load_state_dict`."""
        if "outer" in st:  # a mismatched outer step raises before any state changes
            check_kind(self._sbc_outer, st["outer"])
        rank = self._rank_if_saved_elsewhere(st)
        if rank is not None:
            st = _shared_part(st, rank)
        self._sbc.load_state_dict(st)
        if "outer" in st:
            self._sbc_outer.load_state_dict(st["outer"])
        if "freeze" in st and self._sbc_freeze is not None:
            self._sbc_freeze.load_state_dict(st["freeze"])
        self._sbc_local_steps = int(st.get("local_steps", 0))
        ref = self._sbc.manager.reference
        bufs = self._sbc_outer.buffers()
        for name, p in self._sbc_params:
            if name in ref:
                ref[name] = ref[name].to(device=p.device, dtype=p.dtype)
                if rank is not None:  # start from the shared weights
                    p.copy_(ref[name])
            if self._in_weights(name, p):  # the residual is W - W_ref of the loaded weights
                self._sbc.manager.residuals.pop(name, None)
            if name in bufs:
                bufs[name] = bufs[name].to(p.device)

    def _rank_if_saved_elsewhere(self, st) -> Optional[int]:
        """This rank, if ``st`` was saved by another rank of a job of this size; else None
        (a job of another size is refused by the residual manager)."""
        saved = st.get("config", {}) if isinstance(st, dict) else {}
        try:
            size, rank = self._sbc.state.world()
        except (RuntimeError, ImportError, ValueError):  # no job: nothing to compare with
            return None
        if saved.get("world_size", size) != size or saved.get("rank", rank) == rank:
            return None
        return rank


def _shared_part(st, rank: int):
    """What of another rank's saved state every rank shares: no residuals (theirs, not ours),
    no server residuals (rank 0's), no random stream (TernGrad's is seeded by the rank)."""
    st = dict(st, residuals={}, server_residuals={}, config=dict(st["config"], rank=rank))
    st.pop("generator", None)
    return st


def _world_size(compression) -> int:
    """The job's number of ranks (1 outside a job)."""
    try:
        return compression.state.world()[0]
    except (RuntimeError, ImportError, ValueError):
        return 1


def _refuse_stock_knobs(compression, api: str, optimizer: str) -> None:
    """Knobs of the stock hook that do not apply here raise instead of being ignored."""
    if api == "dropin" and getattr(compression, "_named", None) is not None:
        raise ValueError("SBC(named_parameters=...) is for stock hvd.DistributedOptimizer; "
                         "give named_parameters to horovod_sbc.torch.DistributedOptimizer")


def dropin_class(cls: type) -> type:
    """A new drop-in subclass of the optimizer class ``cls`` (a new one per optimizer, as
    Horovod makes its own: torch patches each class's ``step`` for its step hooks)."""
    if issubclass(cls, _SBCOptimizer):
        raise TypeError(f"{cls.__name__} is already a horovod_sbc drop-in optimizer")
    methods = {k: v for k, v in _SBCOptimizer.__dict__.items()
               if k not in ("__dict__", "__weakref__")}
    methods["_sbc_base"] = cls
    return type(cls.__name__, (cls,), methods)


def adopt(horovod_optimizer, compression, named_parameters=None) -> None:
    """The stock hook's weight exchange (:func:`horovod_sbc.policy.choose`): make the instance
    of ``hvd.DistributedOptimizer`` that the hook found run the drop-in's step.

    Horovod's optimizer is an instance of ``type(name, (UserClass,), Horovod's methods)``; its
    class becomes ``type(name, (DropIn(UserClass),), Horovod's methods)``: its ``step()``
    still runs Horovod's ``synchronize()`` first (the hook hands every gradient back as it
    is), then the drop-in's step instead of the user's — the user's step on this rank's own
    gradients, and every ``delay`` steps the exchange of the weight change. Its
    ``param_groups`` and ``state`` are the ones it had; step hooks registered on it fire as
    before. Idempotent."""
    hv_cls = type(horovod_optimizer)
    if issubclass(hv_cls, _SBCOptimizer):
        return
    body = {k: v for k, v in hv_cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    horovod_optimizer.__class__ = type(hv_cls.__name__, (dropin_class(hv_cls.__bases__[0]),),
                                       body)
    names = {id(p): n for n, p in (named_parameters or ())}
    for p, n in getattr(horovod_optimizer, "_parameter_names", {}).items():
        names.setdefault(id(p), n)
    named = [(names[id(p)], p) for g in horovod_optimizer.param_groups for p in g["params"]
             if id(p) in names]
    horovod_optimizer._sbc_setup(named, compression, "stock")
    # a checkpoint given to SBC.load_state_dict before (the weights are not touched inside
    # backward, where the hook runs: the first step() applies it)
    horovod_optimizer._sbc_pending_load = compression.take_optimizer_state()


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
        optimizer._broadcast_outer_state(root_rank)
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
