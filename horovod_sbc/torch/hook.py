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

On the tensor-op path (CUDA tensors, or the C kernels off) nothing in ``compress()`` — which
Horovod calls inside backward — should wait for the device, and nothing per gradient should
read device data on the host. With ``SBC(fixed_size=True)`` (SBC, the paper's selection,
float32) ``compress()`` is tensor ops only: :func:`horovod_sbc.torch.fused.encode_fixed` writes
the message into its capacity, the step header's CRC is computed on the device, and a rank
whose update is not finite sends its ERROR/SKIP step, chosen by ``torch.where``, instead.
Decoding waits for ``decompress()``, which Horovod calls from ``optimizer.synchronize()`` after
every ``compress()`` of the step: its first call finishes every pending allgather and judges
them together (:func:`decode_pending`: a constant number of host reads per step), and each call
then adds its own gradient's positions. With the C kernels (CPU tensors) host reads cost
nothing and each ``decompress()`` decodes its own gradient.
"""
from __future__ import annotations

import dataclasses
import struct
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import protocol, wire
from . import decoder, exchange, fused
from .codec import Consumed, NonFiniteError, _kernels_for, encode_update, subtract_sent_
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
    rank: int = 0
    batched: bool = False                     # decoded with the step's other gradients
    device_fixed: bool = False                # encoded by fused.encode_fixed (k slots)
    padding: int = 0                          # zero bytes after this rank's content
    own_count: int = 0                        # positions this rank's message carries
    gathered: Optional[torch.Tensor] = None   # set by decode_pending
    decoded: object = None                    # decode_pending's verdict (see there)


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
        self._pending: List[StockContext] = []  # compressed, not yet decoded (device path)
        self._errors: Dict[tuple, torch.Tensor] = {}  # fixed-size ERROR/SKIP steps

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
        cap = exchange.step_capacity(layout, cfg)
        res = self.state.residual(name, tensor)
        upd = tensor.detach().reshape(-1)
        # A = R + g, in place (in the selection's pass); error feedback in decompress(). A
        # contiguous gradient is used up by that pass, which zeroes it: decompress() then
        # decodes the average into its buffer with no memset of its own
        consumed = tensor.is_contiguous()
        batched = _kernels_for(res.view(-1)) is None  # the device path: decoded together
        device_fixed = cap is not None and batched and cfg.mode == "sbc" and \
            cfg.selection == "paper" and fused.fixed_eligible(res.view(-1))
        if device_fixed:
            step, pos, sent = self._encode_fixed(res.view(-1), upd, consumed, name, fp, rank)
        else:
            step, pos, sent, res, padding = self._encode(res, upd, consumed, name, fp, rank,
                                                         cap)
        handle = exchange.allgather_async(step, f"sbc.{name}")
        calls = self._calls[name] = self._calls.get(name, 0) + 1
        if calls > self._max_calls:  # the first tensor of a new step (stock path: sync = step)
            self._max_calls = calls
            self.state.manager.add(steps=1, syncs=1)
        ctx = StockContext(name, handle, step.numel(), layout, res, pos, sent, tensor, size,
                           owner, consumed, rank, batched, device_fixed)
        if cap is not None and not device_fixed:  # framed on the host: its padding is known
            ctx.padding = padding
        if batched:
            self._pending.append(ctx)
        dummy = tensor.new_zeros(1)
        self.state.manager.add(upstream_bits=8 * dummy.numel() * dummy.element_size(),
                         dense_bits=32 * tensor.numel())
        return dummy, ctx

    def _encode(self, res, upd, consumed: bool, name: str, fp: int, rank: int, cap):
        """The per-tensor encoder (host reads on the device path): (step, positions, values,
        residual or None when this rank failed, padding bytes of a fixed-size step)."""
        cfg = self.state.config
        pos = sent = None
        try:
            msg, pos, sent = encode_update(res, cfg.density, cfg.mode, name,
                                           self.state.generator(res.device), cfg.selection,
                                           addend=Consumed(upd) if consumed else upd,
                                           positions=self.state.position_buffer(name))
            step = exchange.frame([msg], fp, res.device, cap)
            padding = step.numel() - wire.STEP_HEADER_SIZE - msg.numel()
        except NonFiniteError as e:
            # the failing rank keeps the finite entries of R + g (nothing was sent) and
            # restarts the non-finite ones at 0, as the drop-in does with its weights
            reset_nonfinite_(res)
            skip = cfg.nonfinite == "skip"
            step = exchange.error_frame(str(e), fp, skip, res.device, rank, cap)
            raw = wire.error_step_message(str(e), fp, skip, rank, cap)
            padding = len(raw) - len(raw.rstrip(b"\0"))  # a padded reason holds no zero byte
            res = None
        return step, pos, sent, res, padding

    def _encode_fixed(self, res, upd, consumed: bool, name: str, fp: int, rank: int):
        """The fixed-size device encoder: tensor ops only, no host read. A rank whose
        ``R + g`` is not finite sends the ERROR/SKIP step instead (chosen on the device) and
        restarts the non-finite entries at 0 (a no-op elsewhere); its own step tells
        decompress() not to commit."""
        res.add_(upd)
        if consumed:
            upd.zero_()
        plan = fused.fixed_plan(res.numel(), self.state.config.density, res.device)
        body, pos, sent, bad = fused.encode_fixed(res, plan)
        step = torch.where(bad, self._error_step(name, fp, rank, body.numel(), res.device),
                           fused.frame_fixed(body, fp, 1))
        res.nan_to_num_(0.0, 0.0, 0.0)
        return step, pos, sent

    def _error_step(self, name: str, fp: int, rank: int, body: int, dev) -> torch.Tensor:
        """This gradient's padded ERROR/SKIP step (built once). Its reason is short enough for
        the smallest capacity; receivers name the gradient themselves (decompress())."""
        skip = self.state.config.nonfinite == "skip"
        key = (name, fp, rank, body, skip, str(dev))
        if key not in self._errors:
            self._errors[key] = exchange.error_frame(
                "NaN or Inf", fp, skip, dev, rank, wire.STEP_HEADER_SIZE + body)
        return self._errors[key]

    def decompress(self, output: torch.Tensor, ctx: StockContext) -> torch.Tensor:
        """Horovod hook: finish the allgather, decode every rank's message and average. On
        the device path the first call of a step finishes and judges every pending
        gradient's allgather at once (:func:`decode_pending`); each call then only adds its
        own positions."""
        if ctx.batched and ctx.decoded is None:
            pending, self._pending = self._pending, []
            decode_pending(pending)
        gathered = ctx.gathered if ctx.batched else exchange.synchronize(ctx.handle)
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
        scale = 1.0 if ctx.owner.op_sum else 1.0 / ctx.size
        try:
            if ctx.batched and ctx.decoded != "general":
                _add_decoded(ctx, flat, mask)
            else:
                exchange.decode_gathered(gathered, ctx.layout, ctx.size, [flat], scale,
                                         zero_out=True, zero_where_nonzero=[mask],
                                         zeroed=ctx.consumed)
            count = ctx.own_count
        except wire.PeerError as e:
            if not e.skip:
                raise ValueError(f"SBC: {e} (the update of {ctx.name!r})") from None
            warnings.warn(f"horovod_sbc: skipping this step for {ctx.name!r}: {e}")
            # healthy ranks keep the gradient in the residual for next time
            return flat.zero_().view(grad.shape)
        finally:
            self.state.manager.add(padding_bits=8 * ctx.padding)
        if ctx.device_fixed:  # the unsent slots add -0.0: nothing
            ctx.residual.index_add_(0, ctx.positions, ctx.sent, alpha=-1)
        else:
            subtract_sent_(ctx.residual, ctx.positions, ctx.sent)
            count = ctx.positions.numel()
        self.state.manager.add(positions_sent=count, elements_synced=ctx.residual.numel())
        return out


def _own_message(buf, ctx: StockContext) -> Tuple[int, int]:
    """(positions, padding bytes) of this rank's step message in a gradient's gathered
    bytes, or (0, 0) when it cannot be read (the verdict then explains)."""
    try:
        start, end = protocol.split(buf, ctx.size)[ctx.rank]
        msg = wire.parse_tensor_header(buf, start + wire.STEP_HEADER_SIZE)
    except ValueError:
        return 0, 0
    return msg.count, end - msg.nbytes


def _shifted(m: wire.TensorMessage, by: int) -> wire.TensorMessage:
    return dataclasses.replace(m, unary=(m.unary[0] + by, m.unary[1] + by),
                               remainder=(m.remainder[0] + by, m.remainder[1] + by))


def decode_pending(ctxs: Sequence[StockContext]) -> None:
    """Finish the allgathers of every pending gradient of a step and judge them together:
    one host read of all gathered bytes, the protocol's headers per gradient, and every
    binary message of every gradient decoded by one :func:`horovod_sbc.torch.decoder.
    decode_binary` (its two reads), whatever the number of gradients. Sets each context's
    ``decoded``: an exception to raise, ``"general"`` (decode it alone, e.g. top-k values),
    or (positions, float64 values, bounds of each rank's positions among them) to add."""
    if not ctxs:
        return
    for c in ctxs:
        c.gathered = exchange.synchronize(c.handle)
    big = torch.cat([c.gathered for c in ctxs])
    host = exchange._host_bytes(big)
    steps, msgs, off = {}, [], 0
    for i, c in enumerate(ctxs):
        buf = memoryview(host)[off:off + c.gathered.numel()]
        if c.device_fixed:
            c.own_count, c.padding = _own_message(buf, c)
        try:
            step = protocol.parse_gathered(buf, c.layout, c.size)
        except ValueError as e:
            c.decoded = e
        else:
            if all(not (m.all_positions or m.has_values or m.has_signs) and
                   m.rice_b <= decoder.MAX_BATCH_RICE_B for _, _, m, _ in step.flat()):
                steps[i] = step
                for _, _, m, _ in step.flat():
                    if m.count:
                        msgs.append(_shifted(m, off))
            else:
                c.decoded = "general"
        off += c.gathered.numel()
    batch = decoder.decode_binary(big, msgs) if msgs else None
    if batch is not None and not batch.complete:  # corrupt: the exact per-gradient verdicts
        for i in steps:
            ctxs[i].decoded = "general"
        return
    _judge(ctxs, steps, batch)


def _judge(ctxs, steps, batch) -> None:
    """decode_pending's stream verdicts, and for each accepted gradient (positions, values,
    the bounds of each rank's positions among them)."""
    dev = ctxs[0].gathered.device
    slot, vals, counts, accepted = 0, [], [], []
    for i, step in steps.items():
        c = ctxs[i]
        scale = 1.0 if c.owner.op_sum else 1.0 / c.size
        stats = []
        bounds = [int(batch.seg_start[slot])] if batch is not None else [0]
        for per in step.messages:  # rank by rank
            for m in per:
                st = protocol.StreamStats(sign_pad_nonzero=False, nonfinite=0)
                if m.count:
                    st = protocol.StreamStats(*batch.stats[slot])
                    vals.append(m.signed_value * scale)
                    counts.append(m.count)
                    slot += 1
                stats.append(st)
            bounds.append(int(batch.seg_start[slot]) if batch is not None else 0)
        try:
            protocol.check_streams(step, stats)
        except ValueError as e:
            c.decoded = e
            continue
        c.decoded = bounds
        accepted.append(c)
    if batch is None:
        for c in accepted:
            c.decoded = (None, None, c.decoded)
        return
    n = len(vals)  # one upload: the values as float64 bits, then the counts
    meta = torch.tensor(list(struct.unpack(f"<{n}q", struct.pack(f"<{n}d", *vals))) + counts,
                        dtype=torch.int64).to(dev)
    total = int(batch.seg_start[-1])
    src = torch.repeat_interleave(meta[:n].view(torch.float64), meta[n:], output_size=total)
    for c in accepted:
        c.decoded = (batch.pos, src, c.decoded)


def _add_decoded(ctx: StockContext, flat: torch.Tensor, mask) -> None:
    """Add a gradient's accepted positions (every rank's, in rank order) into ``flat``,
    which then holds the sum alone; then DGC's mask. Raises the verdict it was given."""
    d = ctx.decoded
    if isinstance(d, Exception):
        raise d
    if not ctx.consumed:
        flat.zero_()
    pos, src, bounds = d
    lo, hi = bounds[0], bounds[-1]
    if hi > lo:
        v = src[lo:hi].to(flat.dtype)
        if flat.device.type == "cpu":  # index_add_ is sequential on CPU: rank order is kept
            flat.index_add_(0, pos[lo:hi], v)
        else:  # rank by rank: atomics would not keep the order
            for r in range(ctx.size):
                a, b = bounds[r] - lo, bounds[r + 1] - lo
                if b > a:
                    flat.index_add_(0, pos[lo + a:lo + b], v[a:b])
    if mask is not None:
        mask.masked_fill_(flat != 0, 0)


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
