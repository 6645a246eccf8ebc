"""SBC for ``torch.distributed``: a DistributedDataParallel communication hook and a model averager.

The one-line change for a DDP user (used exactly like PyTorch's PowerSGD hook)::

    from horovod_sbc.torch.ddp import SBCState, sbc_hook
    model = DistributedDataParallel(net)
    model.register_comm_hook(SBCState(model, density=0.01), sbc_hook)

For communication delay (local steps, then the compressed weight update),
:class:`SBCModelAverager` has the shape of PyTorch's ``PeriodicModelAverager`` and works with
``PostLocalSGDOptimizer``: ``SBCModelAverager(model, period=4, density=0.01)``.

Both are thin adapters: compression, error feedback, the ``nonfinite`` verdicts, the wire format
and ``stats()`` are those of :class:`horovod_sbc.torch.SBC` (its :meth:`~SBC.exchange`), with a
:class:`~horovod_sbc.torch.sync.transport.ProcessGroupTransport` in place of Horovod's
allgather (uint8 step messages all-gathered, nothing pickled; decoded and averaged on the
gradients' device). gloo (CPU) and NCCL (GPU).

Granularity of the hook (``granularity=``): ``"parameter"`` (default) sends one tensor message
per parameter (its own top-k and mean, as on the Horovod path), residuals keyed by parameter
name, so DDP's bucket rebuild and checkpoints do not depend on the bucket layout; ``"bucket"``
compresses each flattened bucket as one tensor (one top-k and one mean across its parameters),
its residual keyed by the bucket's parameter set (a rebuild starts a new one). How it works and
what each measured: docs/ddp.md#how-it-works, docs/ddp.md#per-parameter-or-per-bucket.
"""
import enum
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

from .. import policy
from ..config import resolve_compression
from .compressor import SBC
from .sync import Update, named_parameters
from .sync.transport import ProcessGroupTransport

__all__ = ["Granularity", "SBCState", "sbc_hook", "SBCModelAverager", "shutdown"]

STATE_FORMAT = 1


class Granularity(str, enum.Enum):
    """What one SBC tensor message covers in the DDP hook (see the module docstring)."""
    PARAMETER = "parameter"
    BUCKET = "bucket"


def _make_compression(compression, density, what: str) -> SBC:
    comp = resolve_compression(SBC, compression, "horovod_sbc.torch.SBC", density)
    if comp.hierarchy is not None:
        raise ValueError(f"{what}: SBC(hierarchy={comp.hierarchy!r}) needs the drop-in "
                         "horovod_sbc.torch.DistributedOptimizer (Horovod process sets)")
    if comp.topology != "allgather":
        raise ValueError(f"{what}: SBC(topology={comp.topology!r}) needs Horovod's "
                         f"{'alltoall' if comp.topology == 'reduce_scatter' else 'MPI gather'}"
                         "; torch.distributed supports topology='allgather' only")
    cfg = comp.config
    if cfg.local_residual is not None:
        raise ValueError(f"{what}: SBC(local_residual={cfg.local_residual!r}) is the Horovod "
                         "drop-in's; the DDP hook keeps the residual beside the weights and the "
                         "averager in them")
    policy.refuse_weight_knobs(cfg, f"{what} has no outer step and no variance freeze")
    return comp


def warn_gradient_exchange(optimizer) -> None:
    """A gradient hook can only exchange gradients; :func:`horovod_sbc.policy.choose` exchanges
    weight changes for every optimizer it knows, so say what to use unless the optimizer has no
    state a late, burst-like arrival of each coordinate would disturb (SGD without momentum)."""
    groups = getattr(optimizer, "param_groups", [])
    if isinstance(optimizer, torch.optim.SGD) and not any(g.get("momentum", 0) for g in groups):
        return
    warnings.warn(
        f"horovod_sbc: the DDP comm hook exchanges compressed gradients, and "
        f"{type(optimizer).__name__} keeps per-coordinate state (momentum, moments) that each "
        "coordinate's late, burst-like arrival under error feedback disturbs: it trains well "
        "below dense (docs/recipes.md). Exchange weight changes instead: PostLocalSGDOptimizer "
        "with SBCModelAverager, or horovod_sbc.torch.DistributedOptimizer (Horovod).",
        stacklevel=3)


@dataclass
class _Bucket:
    """One bucket of the step being recorded: its updates, where their average goes (``outs``,
    views of ``avg``), DDP's flat buffer, the future DDP waits for, and per parameter its name,
    the parameter and its part of ``avg``."""
    items: list
    outs: List[torch.Tensor]
    avg: torch.Tensor
    buf: torch.Tensor
    fut: torch.futures.Future
    parts: List[Tuple[str, torch.Tensor, torch.Tensor]]


class SBCState:
    """State of :func:`sbc_hook` (like PyTorch's ``PowerSGDState``): the SBC configuration, this
    rank's residuals (error feedback) and traffic counters.

    Args:
        model: the ``DistributedDataParallel`` model (or its module, or ``named_parameters()``):
            parameter names label the tensor messages and key the residuals.
        compression: an :class:`~horovod_sbc.torch.SBC` holding the knobs: ``density`` (the
            paper's *p*, fraction of positions sent per tensor), ``selection``, ``binarize``
            (False: top-k with values), ``nonfinite`` (``"raise"``: every rank raises
            ``ValueError`` naming the rank and parameter; ``"skip"``: every rank gets a zero
            gradient for the bucket and :attr:`last_step_skipped` is set). Its ``delay`` must be
            1: for communication delay use :class:`SBCModelAverager`.
        density: shorthand for ``compression=SBC(density=density)``.
        granularity: ``"parameter"`` (default) or ``"bucket"`` (see the module docstring).
        process_group: the group to exchange in (``None``: the default group).
        optimizer: the optimizer that steps on the averaged gradients (optional): given one
            with state (SGD momentum, Adam, ...), the hook warns that it trains below dense and
            names the weight exchange to use instead (:func:`warn_gradient_exchange`).

    Step messages are padded to their layout's capacity unless ``SBC(fixed_size=False)``:
    ``torch.distributed``'s all-gather takes one size from every rank, and a capacity known from
    the layout spares the exchange of the lengths and its host read (see
    :class:`horovod_sbc.config.SBCConfig`). ``stats()`` is :meth:`SBC.stats` (``upstream_bits``
    are the step messages' bits, padding included; ``padding_bits`` the padding) plus
    ``transport_upstream_bits``: what this rank put into the collectives (with
    ``fixed_size=False`` its message zero-padded to the longest rank's plus the 64-bit length).
    ``state_dict()`` / ``load_state_dict()`` save and restore residuals and counters: save them
    on every rank (residuals differ per rank).
    """

    def __init__(self, model, compression: Optional[SBC] = None, density: Optional[float] = None,
                 granularity="parameter", process_group=None, optimizer=None):
        self.compression = _make_compression(compression, density, "SBCState")
        self.optimizer = optimizer
        if optimizer is not None:
            warn_gradient_exchange(optimizer)
        if self.compression.delay != 1:
            raise ValueError(
                f"SBCState: SBC(delay={self.compression.delay}) needs local steps between "
                "syncs, which a gradient hook cannot do; use SBCModelAverager(model, "
                "period=n, ...) with PostLocalSGDOptimizer for communication delay")
        self.granularity = Granularity(granularity)
        self.process_group = process_group
        self.transport = ProcessGroupTransport(process_group,
                                               equal_sizes=self.compression.config.padded(True))
        self.compression.transport = self.transport
        self._names: Dict[int, str] = {id(p): n for n, p in named_parameters(model)}
        self._bucket_keys: Dict[int, str] = {}
        self._pending: list = []  # this step's buckets, exchanged with the last one
        self.last_step_skipped = False
        self.skipped_steps = 0
        self.iter = 0
        self.compression.manager.config.update(granularity=self.granularity.value)

    @property
    def manager(self):
        return self.compression.manager

    def stats(self) -> Dict[str, int]:
        out = self.compression.stats()
        out["transport_upstream_bits"] = 8 * self.transport.sent_bytes
        out["skipped_steps"] = self.skipped_steps
        return out

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "sbc": self.compression.state_dict(), "iter": self.iter,
                "skipped_steps": self.skipped_steps,
                "transport_bytes": [self.transport.sent_bytes, self.transport.received_bytes,
                                    self.transport.padding_bytes]}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("not an SBCState state_dict (missing or unknown 'format')")
        self.compression.load_state_dict(state["sbc"])
        self.iter = int(state["iter"])
        self.skipped_steps = int(state["skipped_steps"])
        (self.transport.sent_bytes, self.transport.received_bytes,
         self.transport.padding_bytes) = (int(x) for x in state["transport_bytes"])

    # -- per bucket -------------------------------------------------------------------------
    def _name(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))
        if name is None:
            raise ValueError(f"SBCState: a parameter of shape {tuple(p.shape)} in this DDP bucket "
                             "is not among the model's named parameters given to SBCState")
        return name

    def _bucket_key(self, index: int, names: List[str]) -> str:
        """Residual key of a whole bucket: its first and last parameter and a CRC of all names.
        A rebuilt bucket under the same index drops the residual of its old composition."""
        crc = zlib.crc32(";".join(names).encode("utf-8")) & 0xFFFFFFFF
        key = f"bucket[{names[0]}..{names[-1]}, {len(names)} params, {crc:08x}]"
        old = self._bucket_keys.get(index)
        if old is not None and old != key:
            self.manager.residuals.pop(old, None)
        self._bucket_keys[index] = key
        return key


def sbc_hook(state: SBCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: SBC-compress the gradients (with error feedback), exchange every
    rank's step message, and complete each bucket's future with the average of all ranks'
    decoded gradients (a new flat tensor laid out like ``bucket.buffer()``).

    DDP calls the hook once per bucket during backward and waits for the futures when backward
    ends. The hook records each bucket and returns its future; the last bucket of the step
    (``bucket.is_last()``) exchanges every bucket at once (one sync: a constant number of
    kernels and host reads per step on the tensor-op backend, instead of that per bucket) and
    completes all the futures.

    Register with ``model.register_comm_hook(SBCState(model, ...), sbc_hook)``.
    """
    buf = bucket.buffer()
    sum_dtype = torch.float64 if buf.dtype == torch.float64 else torch.float32
    avg = torch.zeros(buf.numel(), dtype=sum_dtype, device=buf.device)
    params = bucket.parameters()
    names = [state._name(p) for p in params]
    views, off = [], 0  # each parameter's part of the average
    for g in bucket.gradients():
        views.append(avg[off:off + g.numel()])
        off += g.numel()
    if off != buf.numel():
        raise RuntimeError(f"SBC hook: bucket {bucket.index()} holds {buf.numel()} elements "
                           f"but its gradients {off}")
    if state.granularity is Granularity.PARAMETER:
        items = [Update(name, g.detach().reshape(-1), tuple(p.shape))
                 for name, p, g in zip(names, params, bucket.gradients())]
        outs = views
    else:
        key = state._bucket_key(bucket.index(), names)
        items, outs = [Update(key, buf.detach(), (buf.numel(),))], [avg]
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    state._pending.append(_Bucket(items, outs, avg, buf, fut, list(zip(names, params, views))))
    if bucket.is_last():  # DDP's last bucket of this backward pass: the step is complete
        _exchange_step(state)
    return fut


def _exchange_step(state: SBCState) -> None:
    """One sync of every bucket recorded this step; completes their futures (zeros for a
    skipped step: every rank got the same verdict)."""
    pending, state._pending = state._pending, []
    comp = state.compression
    items = [u for b in pending for u in b.items]
    outs = [o for b in pending for o in b.outs]
    try:
        result = comp.exchange(items, out=outs, tag="sbc.ddp", count_sync=False)
    except BaseException as e:
        for b in pending:
            b.fut.set_exception(e)
        raise
    comp.manager.add(dense_bits=32 * sum(b.buf.numel() for b in pending))
    state.iter += 1
    state.last_step_skipped = result is None
    if state.last_step_skipped:
        state.skipped_steps += 1
    comp.manager.add(steps=1, syncs=int(not state.last_step_skipped))
    for b in pending:
        b.fut.set_result(b.avg if b.avg.dtype == b.buf.dtype else b.avg.to(b.buf.dtype))


class SBCModelAverager(ModelAverager):
    """Communication delay for DDP users: after ``warmup_steps``, every ``period``-th call of
    :meth:`average_parameters` exchanges the SBC-compressed weight update since the last
    average (with its residual) instead of averaging the weights densely; every rank then holds
    bit-identical weights. Shaped like ``PeriodicModelAverager`` (same ``period``,
    ``warmup_steps``, ``process_group``, ``step``), so it plugs into ``PostLocalSGDOptimizer``.

    Args:
        model: the model (DDP or plain module) or its ``named_parameters()``: names key the
            residuals and reference weights. Build the averager when all ranks hold the same
            weights (after wrapping in DDP, which broadcasts them): they are the first reference.
        period: the paper's *n*: local steps between averages.
        warmup_steps: calls before the first average. During warm-up the gradients must be
            averaged every step (e.g. ``PostLocalSGDState(..., start_localSGD_iter=
            warmup_steps)`` with ``post_localSGD_hook``), so the weights are shared; each
            warm-up call takes them as the new reference.
        compression, density: the :class:`~horovod_sbc.torch.SBC` (its ``delay`` is ignored:
            ``period`` is the delay here) or a density shorthand.
        process_group: the group to average in (``None``: the default group).

    For pure local steps between averages, DDP must not allreduce gradients: after the warm-up
    use ``post_localSGD_hook`` with ``post_local_gradient_allreduce=False`` (or a no-op hook).
    ``state_dict()`` / ``load_state_dict()`` hold ``step``, residuals, reference weights and
    counters: save them on every rank.
    """

    def __init__(self, model, period: int, warmup_steps: int = 0,
                 compression: Optional[SBC] = None, density: Optional[float] = None,
                 process_group=None):
        super().__init__(process_group)
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(f"period must be an integer >= 1, got {period!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.period, self.warmup_steps = period, warmup_steps
        self.compression = _make_compression(compression, density, "SBCModelAverager")
        self.transport = ProcessGroupTransport(process_group,
                                               equal_sizes=self.compression.config.padded(True))
        self.compression.transport = self.transport
        self.compression.manager.config.update(delay=period)
        self._named = [(n, p) for n, p in named_parameters(model)
                       if p.requires_grad and p.is_floating_point()]
        self._names = {id(p): n for n, p in self._named}
        self._capture(self._named, refresh=True)
        self._pending = 0

    def stats(self) -> Dict[str, int]:
        """:meth:`SBC.stats` plus ``transport_upstream_bits`` (see :class:`SBCState`)."""
        out = self.compression.stats()
        out["transport_upstream_bits"] = 8 * self.transport.sent_bytes
        return out

    def _select(self, params) -> List[Tuple[str, torch.Tensor]]:
        """The named parameters among ``params`` (parameters or param_groups), sorted by name
        (one order on every rank). Unlike PyTorch's averagers, parameters without a gradient are
        kept: they contribute a zero update, so the exchanged set is the same on every rank."""
        if params is None:
            return sorted(self._named)
        flat: List[torch.Tensor] = []
        for x in params:
            flat.extend(x["params"] if isinstance(x, dict) else [x])
        out = {}
        for p in flat:
            if not (p.requires_grad and p.is_floating_point()):
                continue
            name = self._names.get(id(p))
            if name is None:
                raise ValueError(f"SBCModelAverager: a parameter of shape {tuple(p.shape)} is not "
                                 "among the named parameters the averager was built with")
            out[name] = p
        return sorted(out.items())

    def _capture(self, named: Iterable[Tuple[str, torch.Tensor]], refresh: bool) -> None:
        ref = self.compression.manager.reference
        for name, p in named:
            if name not in ref:
                ref[name] = p.detach().clone()
            elif refresh:
                ref[name].copy_(p.detach())

    @property
    def local_steps_pending(self) -> int:
        """Local steps since the last average (after warm-up). Call :meth:`synchronize` at the
        end of training when this is not 0, so that all ranks end with the same weights."""
        return self._pending

    @torch.no_grad()
    def average_parameters(self, params=None) -> None:
        """Call after every optimizer step (``PostLocalSGDOptimizer`` does). ``params``:
        ``model.parameters()`` or ``optimizer.param_groups`` (``None``: all of the model's)."""
        named = self._select(params)
        self.compression.manager.add(steps=1, dense_bits=32 * sum(p.numel() for _, p in named))
        if self.step < self.warmup_steps:  # weights are shared during warm-up
            self._capture(named, refresh=True)
        elif (self.step - self.warmup_steps) % self.period == 0:
            self._exchange(named)
        else:
            self._pending += 1
        self.step += 1

    @torch.no_grad()
    def synchronize(self, params=None) -> None:
        """Exchange the update of the pending local steps now (off the schedule, e.g. at the
        end of training). Every rank must call it at the same point."""
        self._exchange(self._select(params))

    def _exchange(self, named: List[Tuple[str, torch.Tensor]]) -> None:
        comp = self.compression
        self._capture(named, refresh=False)
        ref = comp.manager.reference
        items = [Update(n, p.detach(), tuple(p.shape), base=ref[n]) for n, p in named]
        # W_ref += average of all ranks' decoded updates (skip: nothing added), then every rank
        # continues from W_ref
        comp.exchange(items, out=[ref[n].view(-1) for n, _ in named], tag="sbc.ddp.average")
        for n, p in named:
            p.copy_(ref[n])
        self._pending = 0

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "step": self.step, "pending": self._pending,
                "period": self.period,
                "warmup_steps": self.warmup_steps, "sbc": self.compression.state_dict(),
                "transport_bytes": [self.transport.sent_bytes, self.transport.received_bytes,
                                    self.transport.padding_bytes]}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("not an SBCModelAverager state_dict (missing or unknown 'format')")
        self.compression.load_state_dict(state["sbc"])
        self.step, self._pending = int(state["step"]), int(state["pending"])
        (self.transport.sent_bytes, self.transport.received_bytes,
         self.transport.padding_bytes) = (int(x) for x in state["transport_bytes"])
        ref = self.compression.manager.reference
        for name, p in self._named:
            if name in ref:
                ref[name] = ref[name].to(device=p.device, dtype=p.dtype)


def shutdown(settle_s: float = 0.5) -> None:
    """End a job of the default process group: a barrier, a pause of ``settle_s`` seconds, then
    ``torch.distributed.destroy_process_group()``. Call it on every rank at the end instead of
    ``destroy_process_group()`` alone.

    Why the pause: torch's gloo backend frees each finished collective (and the tensors it
    holds, which takes the GIL) on its own worker thread, a moment after the collective
    completed; the process group's destructor joins those threads while holding the GIL. If the
    last reference to the group (a DDP model's reducer holds one) goes away inside that moment,
    the process deadlocks at exit. This was seen once with torch 2.13: the main thread in
    ``~ProcessGroupGloo`` joining ``pt_gloo_runloop``, that thread in ``~AsyncAllgatherWork``
    waiting for the GIL. During the pause the main thread holds no GIL, so the worker threads
    finish first."""
    dist.barrier()
    time.sleep(settle_s)
    dist.destroy_process_group()

