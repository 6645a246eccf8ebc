"""The stock Horovod hook: ``compress()``/``decompress()`` for ``hvd.DistributedOptimizer``.

Horovod passes no name: the parameter is found by :func:`horovod_sbc.torch.owner.identify`
(``SBC(named_parameters=...)`` first, then the name Horovod's optimizer gives it), and so is the
optimizer. :func:`horovod_sbc.policy.choose` then says what that optimizer's steps exchange:

* **weight changes** (every optimizer it finds): Horovod's optimizer is made to run the
  drop-in's step (:func:`horovod_sbc.torch.optimizer.adopt`); ``decompress()`` hands each local
  gradient back as it is (so ``optimizer.synchronize()`` then clipping clips this rank's own
  gradient), the user's optimizer steps on it, and every ``delay`` steps the change of the
  weights is exchanged (Adam's and RMSprop's second moment frozen automatically).
* **gradients** (an optimizer it cannot find: ``SBC(named_parameters=...)`` used outside
  Horovod's optimizer): ``compress()`` only records the gradient; the first ``decompress()`` of
  a step encodes every gradient of the step at once with its residual, allgathers one step
  message, decodes every rank's into the gradients' buffers and commits the error feedback. A
  NaN/Inf in any gradient fails (or, with ``nonfinite="skip"``, skips) the whole step on every
  rank.

Horovod still allreduces a one-element float16 placeholder per gradient and step (counted in
``stats()``).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import wire
from ..config import PLACEHOLDER_BITS, PLACEHOLDER_DTYPE
from .. import policy
from .adam import family
from .backend import Accumulate, Targets, frame
from .optimizer import adopt
from .owner import (Owner, global_process_set, horovod_op_sum, horovod_parameter_name,
                    identify)
from .sync import Outgoing, encode_uplink, exchange
from .sync import plan_regions as sync_plan
from .sync.state import SyncState


@dataclass
class StockContext:
    """What ``compress()`` hands ``decompress()`` for one gradient."""
    name: str
    grad: torch.Tensor
    size: int
    owner: Owner
    out: Optional[torch.Tensor] = None        # the buffer the average is decoded into
    done: bool = False                        # exchanged with the rest of its step
    verdict: Optional[BaseException] = None   # the step's verdict


class StockHook:
    """``compress``/``decompress`` of :class:`horovod_sbc.torch.SBC` (mixed into it). It reads
    and writes only ``self.state`` (:class:`horovod_sbc.torch.sync.state.SyncState`) and the
    attributes its own ``__init__`` sets."""

    state: SyncState

    def __init__(self, named_parameters=None):
        self._named = list(named_parameters) if named_parameters is not None else None
        self._calls: Dict[str, int] = {}  # compress() calls per tensor: a new step starts when
        self._max_calls = 0               # some tensor is compressed once more than before
        self._pending: List[StockContext] = []  # compressed, not yet exchanged
        self._modes: Dict[int, str] = {}  # id(optimizer) -> what its steps exchange

    def _exchange_of(self, owner: Owner) -> str:
        """What the step of ``owner``'s optimizer exchanges (:func:`horovod_sbc.policy.choose`,
        decided once per optimizer): ``"gradients"``, or ``"weights"``, for which Horovod's
        optimizer is made the drop-in's on the spot (:func:`adopt`)."""
        if owner.optimizer is None:  # found by named_parameters alone: nothing to step locally
            return "gradients"
        return self.exchange_for(owner.optimizer, owner.name, owner.op_sum)

    def exchange_for(self, opt, name: Optional[str] = None,
                     op_sum: Optional[bool] = None) -> str:
        """What the steps of Horovod's optimizer ``opt`` exchange, decided once per optimizer
        (the first ``compress()`` of its first step asks, with the parameter's ``name`` and
        the ``op_sum`` read from Horovod's frame; ``SBCState`` asks when it takes ``opt``, so
        that every rank of an elastic job, also one that joins later, runs the same step and
        the same syncs): ``"weights"`` adopts ``opt`` (:func:`adopt`)."""
        if id(opt) in self._modes:
            return self._modes[id(opt)]
        if op_sum is None:
            op_sum = horovod_op_sum(opt)
        if not global_process_set(opt):
            what = repr(name) if name is not None else "every parameter"
            raise ValueError(
                f"SBC through hvd.DistributedOptimizer(process_set=...): {what} would "
                "be reduced over a process set, but SBC's messages travel by collectives over "
                "every rank of the job; leave process_set at the global set (the default) or "
                "use a separate job per group")
        cfg = self.state.config
        choice = policy.choose(family(opt), delay=cfg.delay, api="stock",
                               local_residual=cfg.local_residual)
        if choice.exchange == "weights":
            if self.state.config.topology == "server":
                raise ValueError(
                    f"SBC through stock hvd.DistributedOptimizer with "
                    f"{type(opt).__name__} exchanges weight changes; its topology='server' "
                    "needs horovod_sbc.torch.DistributedOptimizer(optimizer, "
                    "named_parameters, compression=SBC(...))")
            if op_sum:
                raise ValueError(
                    f"SBC through stock hvd.DistributedOptimizer with {type(opt).__name__} "
                    "averages the ranks' weight changes; op=hvd.Sum has no meaning there: "
                    "use op=hvd.Average (the default)")
            adopt(opt, self, self._named)
        self._modes[id(opt)] = choice.exchange
        return choice.exchange

    def _check_stock(self) -> None:
        cfg = self.state.config
        if getattr(self, "hierarchy", None) is not None:
            raise ValueError(f"SBC(hierarchy={self.hierarchy!r}) needs the per-sync exchange of "
                             "weight changes, which stock hvd.DistributedOptimizer runs where it "
                             "finds the optimizer (give it named_parameters=); or use "
                             "horovod_sbc.torch.DistributedOptimizer")
        if cfg.delay != 1:
            raise ValueError(
                f"SBC(delay={cfg.delay}) needs local steps between syncs: through stock "
                "hvd.DistributedOptimizer give SBC the optimizer's parameters by name "
                "(named_parameters= of hvd.DistributedOptimizer) so that it can find the "
                "optimizer, or use horovod_sbc.torch.DistributedOptimizer(optimizer, "
                "named_parameters, compression=SBC(..., delay=n)).")
        if cfg.topology == "server":
            raise ValueError("SBC(topology='server') needs the fused exchange of "
                             "horovod_sbc.torch.DistributedOptimizer; stock "
                             "hvd.DistributedOptimizer sends one message per tensor")

    def realign_steps(self) -> None:
        """Count the next ``compress()`` of any tensor as the first of a new step, and forget
        what was compressed: a step that failed part-way (a peer died inside Horovod's
        collectives, and elastic Horovod rolled the state back) left some tensors compressed
        once more than others."""
        self._calls = {name: self._max_calls for name in self._calls}
        self._pending = []

    def compress(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, StockContext]:
        """Horovod hook: record this gradient for the step's exchange; returns a 1-element
        dummy for Horovod's allreduce (the real data travels by allgather) and the context."""
        owner = identify(tensor, self._named)
        name = owner.name
        if tensor.is_sparse:
            raise ValueError(f"SBC: gradient of {name!r} is sparse; pass sparse_as_dense=True to "
                             "hvd.DistributedOptimizer")
        if self._exchange_of(owner) == "weights":  # the optimizer's step() syncs
            ctx = StockContext(name, tensor, 0, owner, out=tensor, done=True)
            return self._placeholder(tensor), ctx
        self._check_stock()
        size, _ = self.state.world()
        calls = self._calls[name] = self._calls.get(name, 0) + 1
        if calls > self._max_calls:  # the first tensor of a new step (stock path: sync = step)
            self._max_calls = calls
            self.state.manager.add(steps=1, syncs=1)
        ctx = StockContext(name, tensor, size, owner)
        self._pending.append(ctx)
        self.state.manager.add(dense_bits=32 * tensor.numel())
        return self._placeholder(tensor), ctx

    def _placeholder(self, tensor: torch.Tensor) -> torch.Tensor:
        """What Horovod allreduces in the gradient's stead (counted as sent)."""
        self.state.manager.add(upstream_bits=PLACEHOLDER_BITS)
        return tensor.new_zeros(1, dtype=getattr(torch, PLACEHOLDER_DTYPE))

    def decompress(self, output: torch.Tensor, ctx: StockContext) -> torch.Tensor:
        """Horovod hook: the first call of a step exchanges every pending gradient; each call
        then reports the step's verdict and commits its own gradient's error feedback."""
        if ctx is None:  # Horovod's own sparse allreduce: it never called compress()
            name = horovod_parameter_name()
            raise ValueError(
                f"SBC: the gradient of {name or 'a parameter'!r} is sparse (e.g. "
                "nn.Embedding(sparse=True)); Horovod averages sparse gradients itself, without "
                "the compression: pass sparse_as_dense=True to hvd.DistributedOptimizer so "
                "that SBC compresses it")
        if not ctx.done:
            pending, self._pending = self._pending, []
            exchange_step(self, pending if ctx in pending else pending + [ctx])
        try:
            if ctx.verdict is not None:
                raise ctx.verdict
        except wire.PeerError as e:
            if not e.skip:
                raise ValueError(f"SBC: {e}") from None
            # healthy ranks keep the gradient in the residual for next time
            return ctx.out.view(-1).zero_().view(ctx.grad.shape)
        return ctx.out


def exchange_step(hook: StockHook, ctxs: Sequence[StockContext]) -> None:
    """One sync of every gradient of a step (see the module docstring); sets each context's
    verdict, output buffer and error feedback."""
    state, cfg = hook.state, hook.state.config
    size, rank = state.world()
    ctxs = sorted(ctxs, key=lambda c: c.name)  # the same layout on every rank
    for c in ctxs:
        c.done = True
    layout = [(c.name, tuple(c.grad.shape)) for c in ctxs]
    regions = sync_plan(state, layout, size)
    sent = layout if regions is None else regions.layout  # a region's pieces are tensors
    fp = wire.layout_fingerprint(sent)
    cap = frame.step_capacity(sent, cfg)
    dev = ctxs[0].grad.device
    # A = R + g in the residual; a contiguous gradient is used up (zeroed) by the encode, and
    # the average is then decoded into its buffer
    srcs = [Accumulate(state.residual(c.name, c.grad).view(-1), c.grad.detach().reshape(-1),
                       c.grad.is_contiguous()) for c in ctxs]
    if regions is not None:
        srcs = [Accumulate(srcs[p.tensor].residual[p.start:p.stop],
                           srcs[p.tensor].addend[p.start:p.stop], srcs[p.tensor].consume)
                for p in regions.pieces]
    uplink = encode_uplink(state, Outgoing([n for n, _ in sent], fp, dev, rank, cap),
                           srcs.__getitem__, whole=srcs)
    if uplink.failed:  # nothing of this step is sent: the rest of the gradients waits in the
        for src in srcs[len(uplink.encoded) + 1:]:  # residuals, as every healthy rank's does
            src.residual.add_(src.addend)
            if src.consume:
                src.addend.zero_()
    for c in ctxs:
        c.out = c.grad if c.grad.is_contiguous() else \
            torch.empty_like(c.grad, memory_format=torch.contiguous_format)  # channels_last
    zeroed = all(src.consume for src in srcs) and not uplink.failed
    targets = Targets.replace([c.out.view(-1) for c in ctxs], zeroed=zeroed)
    scales = {1.0 if c.owner.op_sum else 1.0 / c.size for c in ctxs}
    if len(scales) != 1:
        raise ValueError("SBC: the gradients of one step must all be averaged or all summed "
                         "(op=hvd.Average or op=hvd.Sum)")
    try:
        commit_down = exchange(state, uplink, regions or layout, targets, "sbc.stock",
                               torch.float64 if any(c.grad.dtype == torch.float64
                                                    for c in ctxs) else torch.float32,
                               scales.pop())
    except wire.PeerError as e:
        if e.skip:
            names = ", ".join(repr(c.name) for c in ctxs[:3]) + ("..." if len(ctxs) > 3 else "")
            warnings.warn(f"horovod_sbc: skipping this step for {names}: {e}")
        verdict = e
    except ValueError as e:
        verdict = e
    else:
        verdict = None
        commit_down()
        for _, enc in uplink.encoded:  # error feedback, once every rank's message decoded
            enc.commit()
        state.manager.add(positions_sent=uplink.positions_sent(),
                          elements_synced=sum(c.grad.numel() for c in ctxs))
    for c in ctxs:
        c.verdict = verdict
