"""The stock Horovod hook: ``compress()``/``decompress()`` for ``hvd.DistributedOptimizer``.

Stock Horovod allreduces whatever ``compress(tensor)`` returns. SBC messages cannot be summed, so
``compress()`` starts an asynchronous *allgather* of this gradient's step message and hands Horovod
a 1-float placeholder to allreduce; ``decompress()`` waits for the allgathers, decodes every rank's
message and averages (or sums, with ``op=hvd.Sum``). The gradient itself is used up in
``compress()``: the residual takes ``R + g`` and the gradient is zeroed (a contiguous one; others
are copied), and the decoded average is written into that buffer, which Horovod then sets as
``p.grad``. Horovod passes no name: the parameter is found by
:func:`horovod_sbc.torch.owner.identify` (``SBC(named_parameters=...)`` first, then the name
Horovod's optimizer gives it). One gradient is one sync, so ``delay`` must be 1 here.

``compress()`` runs inside backward, so it only encodes and enqueues: it decodes nothing. With
``SBC(fixed_size=True)`` (SBC, the paper's selection, float32) on the tensor-op backend it reads
nothing on the host either: the message is written into its capacity and the step header's CRC
computed on the device (:meth:`horovod_sbc.torch.backend.ops.OpsBackend.encode_padded`), and a
rank whose update is not finite sends its ERROR/SKIP step, chosen by ``torch.where``, instead.
Horovod calls ``decompress()`` from ``optimizer.synchronize()`` after every ``compress()`` of the
step: its first call finishes every pending allgather and decodes them together
(:meth:`~horovod_sbc.torch.backend.base.Backend.decode_many`: a constant number of host reads per
step on the tensor-op backend), each gradient with its own verdict; each call then reports its
own gradient's verdict and commits its error feedback.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import protocol, wire
from .backend import (Accumulate, DecodeJob, Encoded, NonFiniteError, Targets, frame)
from .owner import Owner, identify
from .sync import transport
from .sync.state import SyncState


@dataclass
class StockContext:
    """What ``compress()`` hands ``decompress()`` for one gradient."""
    name: str
    handle: object
    sent_bytes: int
    layout: list
    encoded: Optional[Encoded]                # None: this rank failed to encode
    grad: torch.Tensor
    size: int
    owner: Owner
    consumed: bool = False                    # the encode zeroed grad (its buffer is all zero)
    rank: int = 0
    padding: Optional[int] = None             # zero bytes after this rank's content (None:
                                              # read from the gathered bytes)
    own_count: int = 0                        # positions this rank's message carries
    gathered: Optional[torch.Tensor] = None   # set by the step's decode
    out: Optional[torch.Tensor] = None        # the buffer the average is decoded into
    decoded: bool = False
    verdict: Optional[BaseException] = None   # the decode's verdict for this gradient


class StockHook:
    """``compress``/``decompress`` of :class:`horovod_sbc.torch.SBC` (mixed into it). It reads
    and writes only ``self.state`` (:class:`horovod_sbc.torch.sync.state.SyncState`) and the
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
        self._pending: List[StockContext] = []  # compressed, not yet decoded
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
        cap = frame.step_capacity(layout, cfg)
        res = self.state.residual(name, tensor)
        # A = R + g, in place (in the selection's pass where the backend can); the error
        # feedback waits for decompress(). A contiguous gradient is used up (zeroed): the
        # average is then decoded into its buffer with no memset of its own
        consumed = tensor.is_contiguous()
        src = Accumulate(res.view(-1), tensor.detach().reshape(-1), consumed)
        backend = self.state.backend(res.device)
        padded = None if cap is None else backend.encode_padded(
            src, cfg.density, cfg.mode, cfg.selection, fp,
            lambda nbytes: self._error_step(name, fp, rank, nbytes, res.device))
        padding = None
        if padded is not None:
            step, encoded = padded
        else:
            step, encoded, padding = self._encode(backend, src, name, fp, rank, cap)
        handle = transport.allgather_async(step, f"sbc.{name}")
        calls = self._calls[name] = self._calls.get(name, 0) + 1
        if calls > self._max_calls:  # the first tensor of a new step (stock path: sync = step)
            self._max_calls = calls
            self.state.manager.add(steps=1, syncs=1)
        ctx = StockContext(name, handle, step.numel(), layout, encoded, tensor, size, owner,
                           consumed, rank, padding)
        self._pending.append(ctx)
        dummy = tensor.new_zeros(1)
        self.state.manager.add(upstream_bits=8 * dummy.numel() * dummy.element_size(),
                               dense_bits=32 * tensor.numel())
        return dummy, ctx

    def _encode(self, backend, src: Accumulate, name: str, fp: int, rank: int, cap):
        """The per-tensor encoder and the host's framing: (step, encoding or None when this
        rank failed, padding bytes of a fixed-size step)."""
        cfg = self.state.config
        try:
            enc = backend.encode_tensor(src, cfg.density, cfg.mode, name, cfg.selection,
                                        self.state.generator(src.residual.device),
                                        self.state.position_buffer(name))
        except NonFiniteError as e:
            # the failing rank keeps the finite entries of R + g (nothing was sent) and
            # restarts the non-finite ones at 0, as the drop-in does with its weights
            skip = cfg.nonfinite == "skip"
            step = frame.error_frame(str(e), fp, skip, src.residual.device, rank, cap)
            return step, None, frame.error_padding(str(e), fp, skip, rank, cap)
        step = frame.frame([enc.message], fp, src.residual.device, cap)
        return step, enc, step.numel() - wire.STEP_HEADER_SIZE - enc.message.numel()

    def _error_step(self, name: str, fp: int, rank: int, body: int, dev) -> torch.Tensor:
        """This gradient's padded ERROR/SKIP step (built once). Its reason is short enough for
        the smallest capacity; receivers name the gradient themselves (decompress())."""
        skip = self.state.config.nonfinite == "skip"
        key = (name, fp, rank, body, skip, str(dev))
        if key not in self._errors:
            self._errors[key] = frame.error_frame(
                "NaN or Inf", fp, skip, dev, rank, wire.STEP_HEADER_SIZE + body)
        return self._errors[key]

    def decompress(self, output: torch.Tensor, ctx: StockContext) -> torch.Tensor:
        """Horovod hook: the first call of a step finishes every pending allgather and decodes
        them together; each call then reports its own gradient's verdict and commits its error
        feedback."""
        if not ctx.decoded:
            pending, self._pending = self._pending, []
            decode_pending(self, pending if ctx in pending else pending + [ctx])
        self.state.manager.add(upstream_bits=8 * ctx.sent_bytes,
                               downstream_bits=8 * (ctx.gathered.numel() - ctx.sent_bytes))
        try:
            if ctx.verdict is not None:
                raise ctx.verdict
        except wire.PeerError as e:
            if not e.skip:
                raise ValueError(f"SBC: {e} (the update of {ctx.name!r})") from None
            warnings.warn(f"horovod_sbc: skipping this step for {ctx.name!r}: {e}")
            # healthy ranks keep the gradient in the residual for next time
            return ctx.out.view(-1).zero_().view(ctx.grad.shape)
        finally:
            self.state.manager.add(padding_bits=8 * (ctx.padding or 0))
        ctx.encoded.commit()
        count = ctx.own_count if ctx.padding is None else ctx.encoded.positions.numel()
        self.state.manager.add(positions_sent=count, elements_synced=ctx.grad.numel())
        return ctx.out


def decode_pending(hook: StockHook, ctxs: Sequence[StockContext]) -> None:
    """Finish the allgathers of every pending gradient of a step and decode them together
    (:meth:`~horovod_sbc.torch.backend.base.Backend.decode_many`), each into its gradient's
    buffer (DGC's momentum masking applied once its step is accepted); sets each context's
    verdict."""
    by_backend: Dict[int, Tuple[object, List[StockContext]]] = {}
    for c in ctxs:
        c.gathered = transport.synchronize(c.handle)
        grad = c.grad
        c.out = grad if grad.is_contiguous() else \
            torch.empty_like(grad, memory_format=torch.contiguous_format)  # channels_last, ...
        backend = hook.state.backend(c.gathered.device)
        by_backend.setdefault(id(backend), (backend, []))[1].append(c)
    for backend, group in by_backend.values():
        jobs = []
        for c in group:
            flat = c.out.view(-1)
            mask = momentum_buffer(c.owner, flat.numel()) if hook.momentum_masking else None
            scale = 1.0 if c.owner.op_sum else 1.0 / c.size
            jobs.append(DecodeJob(c.gathered, c.layout, c.size,
                                  Targets.replace([flat], zeroed=c.consumed, masks=[mask]), scale))
        for c, job, err in zip(group, jobs, backend.decode_many(jobs)):
            c.verdict, c.decoded = err, True
            if c.padding is None:  # encoded on the device: its size is read from the bytes
                c.own_count, c.padding = _own_message(job, c.rank)


def _own_message(job: DecodeJob, rank: int) -> Tuple[int, int]:
    """(positions, padding bytes) of this rank's step message in a gradient's gathered
    bytes, or (0, 0) when it cannot be read (the verdict then explains)."""
    step = getattr(job, "step", None)
    if step is not None:
        msg = step.messages[rank][0]
        return msg.count, step.steps[rank].end - msg.nbytes
    try:
        start, end = protocol.split(job.host, job.n_ranks)[rank]
        msg = wire.parse_tensor_header(job.host, start + wire.STEP_HEADER_SIZE)
    except (ValueError, AttributeError):
        return 0, 0
    return msg.count, end - msg.nbytes


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
