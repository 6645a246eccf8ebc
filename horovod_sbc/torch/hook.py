"""The stock Horovod hook: ``compress()``/``decompress()`` for ``hvd.DistributedOptimizer``.

Stock Horovod allreduces whatever ``compress(tensor)`` returns. SBC messages cannot be summed, so
``compress()`` starts an asynchronous *allgather* of this gradient's step message and hands Horovod
a 1-float placeholder to allreduce; ``decompress()`` waits for the allgather, decodes every rank's
message and averages (or sums, with ``op=hvd.Sum``). The gradient itself is used up in
``compress()``: the selection's pass adds it to the residual and zeroes it (a contiguous one;
others are copied), and ``decompress()`` scatters the average into that buffer, which Horovod
then sets as ``p.grad``. Horovod passes no name: the parameter is found
by :func:`identify` (``SBC(named_parameters=...)`` first, then the name Horovod's optimizer
gives it, read in a bounded, read-only look at its frame). One gradient is one sync, so ``delay`` must be 1 here.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import wire
from . import exchange
from .codec import Consumed, NonFiniteError, encode_update, subtract_sent_
from .sync import reset_nonfinite_


@dataclass
class Owner:
    """What the stock hook learns about its caller: the parameter's name and Horovod's
    optimizer (``None`` when found through ``named_parameters`` alone)."""
    name: str
    optimizer: object = None
    parameter: Optional[torch.Tensor] = None
    op_sum: bool = False


@dataclass
class StockContext:
    """What ``compress()`` hands ``decompress()`` for one gradient."""
    name: str
    handle: object
    sent_bytes: int
    layout: list
    residual: Optional[torch.Tensor]          # None: this rank failed to encode
    positions: Optional[torch.Tensor]
    sent: Optional[torch.Tensor]
    grad: torch.Tensor
    size: int
    owner: Owner
    consumed: bool = False                    # the encode zeroed grad (its buffer is all zero)


def _horovod_owner(tensor: torch.Tensor, max_frames: int = 3) -> Optional[Owner]:
    """Horovod's optimizer calls ``compress(p.grad)`` from ``_allreduce_grad_async(p)`` (or a
    comprehension over ``p`` in its grouped variant): read its ``self`` and ``p`` (read-only,
    at most ``max_frames`` frames, nothing of Horovod is modified)."""
    f = sys._getframe(3)
    for _ in range(max_frames):
        if f is None:
            return None
        loc = f.f_locals
        owner = loc.get("self")
        if owner is not None and hasattr(owner, "_parameter_names"):
            if hasattr(owner, "_starting_models"):  # horovod's _DistributedAdasumOptimizer
                raise ValueError(
                    "SBC cannot be combined with op=hvd.Adasum: Adasum combines dense vectors "
                    "pairwise. Use op=hvd.Average (the default) or "
                    "horovod_sbc.torch.DistributedOptimizer.")
            import horovod.torch as hvd
            op = getattr(owner, "op", hvd.Average)
            if op not in (hvd.Average, hvd.Sum):
                raise ValueError(f"SBC supports op=hvd.Average or hvd.Sum, not {op!r}")
            p = loc.get("p")
            if p is not None and _matches(p, tensor):
                name = owner._parameter_names.get(p)
                if name is not None:
                    return Owner(name, owner, p, op == hvd.Sum)
        f = f.f_back
    return None


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


class StockHook:
    """``compress``/``decompress`` of :class:`horovod_sbc.torch.SBC` (mixed into it)."""

    def _check_stock(self) -> None:
        cfg = self.config
        if cfg.delay != 1:
            raise ValueError(
                f"SBC(delay={cfg.delay}) needs local steps between syncs, which stock "
                "hvd.DistributedOptimizer cannot do: use horovod_sbc.torch.DistributedOptimizer("
                "optimizer, named_parameters, compression=SBC(..., delay=n)).")
        if cfg.topology != "allgather":
            raise ValueError("SBC(topology='server') needs the fused exchange of "
                             "horovod_sbc.torch.DistributedOptimizer; stock "
                             "hvd.DistributedOptimizer sends one message per tensor")

    def compress(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, StockContext]:
        """Horovod hook: start the allgather of this gradient's message; returns a 1-element
        dummy for Horovod's allreduce (the real data travels by allgather) and the context."""
        self._check_stock()
        cfg = self.config
        owner = identify(tensor, self._named)
        warn_momentum(self, owner)
        name = owner.name
        if tensor.is_sparse:
            raise ValueError(f"SBC: gradient of {name!r} is sparse; pass sparse_as_dense=True to "
                             "hvd.DistributedOptimizer")
        size, rank = self.world()
        layout = [(name, tuple(tensor.shape))]
        fp = wire.layout_fingerprint(layout)
        res = self.residual(name, tensor)
        upd = tensor.detach().reshape(-1)
        # A = R + g, in place (in the selection's pass); error feedback in decompress(). A
        # contiguous gradient is used up by that pass, which zeroes it: decompress() then
        # decodes the average into its buffer with no memset of its own
        consumed = tensor.is_contiguous()
        pos = sent = None
        try:
            msg, pos, sent = encode_update(res, cfg.density, cfg.mode, name,
                                           self.generator(res.device), cfg.selection,
                                           addend=Consumed(upd) if consumed else upd,
                                           positions=self.position_buffer(name))
            step = exchange.frame([msg], fp, tensor.device)
        except NonFiniteError as e:
            # the failing rank keeps the finite entries of R + g (nothing was sent) and
            # restarts the non-finite ones at 0, as the drop-in does with its weights
            reset_nonfinite_(res)
            step = exchange.error_frame(str(e), fp, cfg.nonfinite == "skip", tensor.device, rank)
            res = None
        handle = exchange.allgather_async(step, f"sbc.{name}")
        calls = self._calls[name] = self._calls.get(name, 0) + 1
        if calls > self._max_calls:  # the first tensor of a new step (stock path: sync = step)
            self._max_calls = calls
            self.manager.add(steps=1, syncs=1)
        ctx = StockContext(name, handle, step.numel(), layout, res, pos, sent, tensor, size,
                           owner, consumed)
        dummy = tensor.new_zeros(1)
        self.manager.add(upstream_bits=8 * dummy.numel() * dummy.element_size(),
                         dense_bits=32 * tensor.numel())
        return dummy, ctx

    def decompress(self, output: torch.Tensor, ctx: StockContext) -> torch.Tensor:
        """Horovod hook: finish the allgather, decode every rank's message and average."""
        gathered = exchange.synchronize(ctx.handle)
        self.manager.add(upstream_bits=8 * ctx.sent_bytes,
                         downstream_bits=8 * (gathered.numel() - ctx.sent_bytes))
        # the gradient was added to the residual in compress(): its buffer is free, so the
        # average is decoded into it (no new tensor-sized allocation per step); consumed, it
        # is all zero already
        grad = ctx.grad
        out = grad if grad.is_contiguous() else \
            torch.empty_like(grad, memory_format=torch.contiguous_format)  # channels_last, ...
        flat = out.view(-1)
        # DGC's momentum factor masking, applied by the decoder once the step is accepted
        mask = momentum_buffer(ctx.owner, flat.numel()) if self.momentum_masking else None
        try:
            exchange.decode_gathered(gathered, ctx.layout, ctx.size, [flat],
                                     1.0 if ctx.owner.op_sum else 1.0 / ctx.size,
                                     zero_out=True, zero_where_nonzero=[mask],
                                     zeroed=ctx.consumed)
        except wire.PeerError as e:
            if not e.skip:
                raise ValueError(f"SBC: {e}") from None
            warnings.warn(f"horovod_sbc: skipping this step for {ctx.name!r}: {e}")
            # healthy ranks keep the gradient in the residual for next time
            return flat.zero_().view(grad.shape)
        subtract_sent_(ctx.residual, ctx.positions, ctx.sent)
        self.manager.add(positions_sent=ctx.positions.numel(),
                         elements_synced=ctx.residual.numel())
        return out


def momentum_buffer(owner: Owner, numel: int) -> Optional[torch.Tensor]:
    """For DGC's momentum factor masking (Lin et al., ICLR 2018) on the *global* buffer: the
    flat ``optimizer.state[p]["momentum_buffer"]`` of the gradient's parameter, which the
    decoder zeroes wherever the averaged update is non-zero, before the optimizer's step (see
    ``SBC(momentum_masking=...)``); None for optimizers without that state (Adam, ...) and
    before the first step. The buffer is the same on every rank, so ranks stay identical.
    On-device, no host transfer."""
    state = getattr(owner.optimizer, "state", None)
    if state is None or owner.parameter is None:
        return None
    buf = state.get(owner.parameter, {}).get("momentum_buffer")
    if isinstance(buf, torch.Tensor) and buf.numel() == numel:
        return buf.view(-1)
    return None


def warn_momentum(hook, owner: Owner) -> None:
    """Once per compressor: the stock hook with an SGD-style optimizer with momentum."""
    if hook._warned_momentum or owner.optimizer is None:
        return
    hook._warned_momentum = True
    if any(g.get("momentum", 0) for g in getattr(owner.optimizer, "param_groups", [])):
        warnings.warn(
            "horovod_sbc: SBC through stock hvd.DistributedOptimizer with momentum: the "
            "optimizer's momentum then acts on sparse, stale updates. On mnist1d with IID "
            "shards (4 workers, SGD momentum 0.9) this ended 3.8 (p=0.01) to 7.6 (p=0.1) points "
            "below dense after 1,500 steps, where the drop-in optimizer "
            "horovod_sbc.torch.DistributedOptimizer matched dense; use it for IID data. (On "
            "shards that each hold their own classes it was the other way round: the stock hook "
            "2.4 points below dense, the drop-in far below; docs/benchmarks.md §0.)",
            stacklevel=4)
