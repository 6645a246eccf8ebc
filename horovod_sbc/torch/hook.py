"""The stock Horovod hook: ``compress()``/``decompress()`` for ``hvd.DistributedOptimizer``.

Stock Horovod allreduces whatever ``compress(tensor)`` returns. SBC messages cannot be summed, so
``compress()`` starts an asynchronous *allgather* of this gradient's step message and hands Horovod
a 1-float placeholder to allreduce; ``decompress()`` waits for the allgather, decodes every rank's
message and averages (or sums, with ``op=hvd.Sum``). The gradient itself is used up in
``compress()``: the selection's pass adds it to the residual and zeroes it (a contiguous one;
others are copied), and ``decompress()`` scatters the average into that buffer, which Horovod
then sets as ``p.grad``. Horovod passes no name: the parameter is found
by :func:`horovod_sbc.torch.owner.identify` (``SBC(named_parameters=...)`` first, then the
name Horovod's optimizer gives it). One gradient is one sync, so ``delay`` must be 1 here.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .. import wire
from . import exchange
from .codec import Consumed, NonFiniteError, encode_update, subtract_sent_
from .owner import Owner, identify
from .state import SyncState
from .sync import reset_nonfinite_


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


class StockHook:
    """``compress``/``decompress`` of :class:`horovod_sbc.torch.SBC` (mixed into it). It reads
    and writes only ``self.state`` (:class:`horovod_sbc.torch.state.SyncState`) and the
    attributes its own ``__init__`` sets."""

    state: SyncState

    def __init__(self, named_parameters=None, momentum_masking: bool = True):
        if not isinstance(momentum_masking, bool):
            raise ValueError(f"momentum_masking must be True or False, got {momentum_masking!r}")
        self._named = list(named_parameters) if named_parameters is not None else None
        self._calls: Dict[str, int] = {}  # compress() calls per tensor: a new step starts when
        self._max_calls = 0               # some tensor is compressed once more than before
        self.momentum_masking = momentum_masking
        self._warned_momentum = False

    def _check_stock(self) -> None:
        cfg = self.state.config
        if getattr(self, "hierarchy", None) is not None:
            raise ValueError(f"SBC(hierarchy={self.hierarchy!r}) needs the per-sync exchange of "
                             "horovod_sbc.torch.DistributedOptimizer; stock "
                             "hvd.DistributedOptimizer sends one message per tensor")
        if cfg.delay != 1:
            raise ValueError(
                f"SBC(delay={cfg.delay}) needs local steps between syncs, which stock "
                "hvd.DistributedOptimizer cannot do: use horovod_sbc.torch.DistributedOptimizer("
                "optimizer, named_parameters, compression=SBC(..., delay=n)).")
        if cfg.topology != "allgather":
            raise ValueError("SBC(topology='server') needs the fused exchange of "
                             "horovod_sbc.torch.DistributedOptimizer; stock "
                             "hvd.DistributedOptimizer sends one message per tensor")

    def realign_steps(self) -> None:
        """Count the next ``compress()`` of any tensor as the first of a new step. A step that
        failed part-way (a peer died inside Horovod's collectives, and elastic Horovod rolled
        the state back) left some tensors compressed once more than others."""
        self._calls = {name: self._max_calls for name in self._calls}

    def compress(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, StockContext]:
        """Horovod hook: start the allgather of this gradient's message; returns a 1-element
        dummy for Horovod's allreduce (the real data travels by allgather) and the context."""
        self._check_stock()
        cfg = self.state.config
        owner = identify(tensor, self._named)
        warn_momentum(self, owner)
        name = owner.name
        if tensor.is_sparse:
            raise ValueError(f"SBC: gradient of {name!r} is sparse; pass sparse_as_dense=True to "
                             "hvd.DistributedOptimizer")
        size, rank = self.state.world()
        layout = [(name, tuple(tensor.shape))]
        fp = wire.layout_fingerprint(layout)
        res = self.state.residual(name, tensor)
        upd = tensor.detach().reshape(-1)
        # A = R + g, in place (in the selection's pass); error feedback in decompress(). A
        # contiguous gradient is used up by that pass, which zeroes it: decompress() then
        # decodes the average into its buffer with no memset of its own
        consumed = tensor.is_contiguous()
        pos = sent = None
        try:
            msg, pos, sent = encode_update(res, cfg.density, cfg.mode, name,
                                           self.state.generator(res.device), cfg.selection,
                                           addend=Consumed(upd) if consumed else upd,
                                           positions=self.state.position_buffer(name))
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
            self.state.manager.add(steps=1, syncs=1)
        ctx = StockContext(name, handle, step.numel(), layout, res, pos, sent, tensor, size,
                           owner, consumed)
        dummy = tensor.new_zeros(1)
        self.state.manager.add(upstream_bits=8 * dummy.numel() * dummy.element_size(),
                         dense_bits=32 * tensor.numel())
        return dummy, ctx

    def decompress(self, output: torch.Tensor, ctx: StockContext) -> torch.Tensor:
        """Horovod hook: finish the allgather, decode every rank's message and average."""
        gathered = exchange.synchronize(ctx.handle)
        self.state.manager.add(upstream_bits=8 * ctx.sent_bytes,
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
        self.state.manager.add(positions_sent=ctx.positions.numel(),
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
    """Once per compressor: the stock hook under an optimizer that reshapes the averaged sparse
    update — SGD with momentum, or the Adam family — names the drop-in setting instead."""
    if hook._warned_momentum or owner.optimizer is None:
        return
    hook._warned_momentum = True
    groups = getattr(owner.optimizer, "param_groups", [])
    if any("betas" in g for g in groups):
        why = ("Adam-style optimizers normalise each coordinate by its own history, so a "
               "coordinate's delayed update, arriving in one burst every ~1/density steps, moves "
               "the weight by about one learning rate instead of the sum of the steps it "
               "stands for: training runs as if at a far smaller learning rate, and can end "
               "worse than each rank training alone")
    elif any(g.get("momentum", 0) for g in groups):
        why = ("the optimizer's momentum then acts on the averaged sparse update, in which "
               "each coordinate arrives late and in bursts, so it trains below dense")
    else:
        return
    warnings.warn(
        f"horovod_sbc: SBC through stock hvd.DistributedOptimizer with "
        f"{type(owner.optimizer).__name__}: {why}. The drop-in "
        "horovod_sbc.torch.DistributedOptimizer(optimizer, named_parameters, "
        "compression=SBC(..., delay=4)) runs the optimizer on each rank's own gradients and "
        "compresses the weight change; the README's recommendation table compares both.",
        stacklevel=4)
