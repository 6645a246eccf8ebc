"""One sync of a set of updates: encode every update plus its residual, exchange one step
message, decode and average, then commit the error feedback.

:func:`synchronize` serves the drop-in optimizer (weight updates ``W - W_ref``), the DDP hook
and averager (:mod:`horovod_sbc.torch.ddp`), the hierarchical exchange and the tests; the stock
Horovod hook (:mod:`horovod_sbc.torch.hook`) exchanges one gradient at a time with the same
pieces. The codec is the state's backend (:mod:`horovod_sbc.torch.backend`, chosen once per
device), the collective its transport (:mod:`horovod_sbc.torch.sync.transport`: Horovod's
allgather by default, ``torch.distributed`` for DDP); the ``"server"`` topology gathers to rank 0
and broadcasts one downlink instead (:mod:`horovod_sbc.torch.sync.server`).

Error feedback is committed only after every rank's message decoded: a sync that fails (a
rank's NaN, a malformed message) commits nothing, and a skipped sync keeps ``R + dW`` in the
healthy ranks' residuals.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from ... import wire
from ..backend import (Accumulate, Difference, NonFiniteError, Targets, frame,
                       reset_nonfinite_, restore_, scratch)
from . import scatter
from .state import SyncState


def named_parameters(model) -> List[Tuple[str, torch.Tensor]]:
    """``(name, parameter)`` pairs of a module (a DDP wrapper is unwrapped, so names carry no
    ``module.`` prefix) or of an iterable of pairs such as ``model.named_parameters()``; the
    names key residuals and checkpoint state, so they must be unique."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    named = list(model.named_parameters()) if isinstance(model, torch.nn.Module) else list(model)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError("named_parameters must be a torch.nn.Module or (name, parameter) "
                         "pairs such as model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names must be unique; duplicated: {', '.join(dups)}")
    return named


@dataclass
class Update:
    """One tensor of a sync: the update is ``value`` (any shape, read flat) or, with ``base``,
    ``value - base`` (computed into a reused buffer, e.g. the weights minus the reference
    weights); with ``base_offset`` too, ``value - (base + base_offset)``, the sum rounded to
    ``base``'s dtype (the reference weights plus this rank's residual: what fp16/bf16 weights
    were set to at the last sync, ``local_residual=True``). ``name`` keys the residual and
    labels the tensor message; ``shape`` is the tensor's shape in the layout every rank must
    agree on.

    ``in_weights`` (with ``base``; ``value`` contiguous, of ``base``'s dtype and device, float32
    or float64): this rank's residual lives in ``value`` itself, the update ``value - base`` is
    the residual-corrected update and nothing is stored beside it (the drop-in optimizer's
    ``local_residual=True``: weights minus the shared weights). The sync then reads ``value``
    and ``base`` once, adds the decoded average to ``value`` as to ``base`` (``out``) and takes
    what was sent out of ``value`` (see :meth:`Encoded.commit`); a failed sync leaves both
    untouched."""
    name: str
    value: torch.Tensor
    shape: Tuple[int, ...]
    base: Optional[torch.Tensor] = None
    base_offset: Optional[torch.Tensor] = None
    in_weights: bool = False
    #: the residual to use (a piece of a tensor's, :mod:`~horovod_sbc.torch.sync.scatter`);
    #: None: the state's residual of ``name``
    residual: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, item) -> "Update":
        """From an :class:`Update` or a ``(name, value, shape[, base])`` tuple."""
        return item if isinstance(item, Update) else cls(item[0], item[1], tuple(item[2]),
                                                         item[3] if len(item) > 3 else None)

    def flat(self, dtype: torch.dtype) -> torch.Tensor:
        value = self.value.reshape(-1)
        if self.base is None:
            return value
        buf = scratch(value.numel(), dtype, value.device, slot=1)
        base = self.base.reshape(-1)
        if self.base_offset is not None:
            off = self.base_offset.reshape(-1).to(base.dtype)
            if base.dtype == dtype:  # base + offset into the buffer: no allocation
                base = torch.add(base, off, out=buf)
            else:
                base = base + off
        return torch.sub(value.to(dtype), base.to(dtype), out=buf)

    def weights_flat(self) -> torch.Tensor:
        """``value`` flat, as a view (``in_weights``: the sync writes through it)."""
        v = self.value.view(-1)
        if self.base is None or self.base.dtype != v.dtype or self.base.device != v.device or \
                self.base.numel() != v.numel() or v.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"SBC: {self.name!r}: an update kept in the weights needs a "
                             "reference of the same dtype, device and size (float32/float64)")
        return v

    def weights_finite(self) -> bool:
        """Are the weights (``value``) free of NaN/Inf? Checked before any residual changes
        when the update is taken relative to the residual itself (``base_offset``): ``R + dW``
        overwrites ``R`` in place and cannot be undone exactly afterwards. One host read."""
        return bool(torch.isfinite(self.value).all())


def sum_dtype(updates: Sequence[Update]) -> torch.dtype:
    return torch.float64 if any(u.value.dtype == torch.float64 for u in updates) else \
        torch.float32


def synchronize(state: SyncState, items, out: Optional[List[torch.Tensor]] = None,
                tag: str = "sbc.sync", count_sync: bool = True,
                apply: Optional[Callable[[List[torch.Tensor]], None]] = None,
                error: Optional[Tuple[int, str]] = None) -> Optional[List[torch.Tensor]]:
    """Compress, exchange (one step message), decode and average ``items``
    (:class:`Update` or tuples, see :meth:`Update.of`). Returns ``out`` (flat tensors, e.g. the
    reference weights) or new tensors holding the average of all ranks' decoded updates; None
    if the sync was skipped (``nonfinite="skip"``); raises ``ValueError`` on every rank if any
    rank failed. ``count_sync=False`` leaves the ``syncs`` counter to the caller.

    ``apply`` (the drop-in's outer step): ``out`` are dense buffers that receive the average
    alone (whatever they held is overwritten), and ``apply(out)`` runs once the step is
    accepted and before the error feedback is committed; it must move the reference weights
    (each ``base``) and the weights of updates kept in the weights (``in_weights``) by the same
    change, which the commit then takes this rank's sent update out of.

    ``error``: ``(origin rank, reason)`` known before encoding (the hierarchical exchange's
    node-level check, :mod:`horovod_sbc.torch.hierarchy`): nothing is encoded, this rank
    frames the ERROR/SKIP step naming ``origin`` and every rank raises or skips with it."""
    updates = [Update.of(it) for it in items]
    size, rank = state.world()
    layout = [(u.name, u.shape) for u in updates]
    regions = plan_regions(state, layout, size)
    sent = updates if regions is None else _pieces(state, regions, updates)
    fp = wire.layout_fingerprint([(u.name, u.shape) for u in sent])
    dev = updates[0].value.device if updates else torch.device("cpu")
    uplink = _encode_all(state, sent, fp, dev, rank, error)
    # the weights that hold their residual move with the shared weights
    also = [u.weights_flat() if u.in_weights else None for u in updates] \
        if apply is None and any(u.in_weights for u in updates) else None
    if (also is not None or apply is not None) and out is None:
        raise ValueError("SBC: updates kept in the weights or an outer step need out=")
    if out is not None:
        targets = Targets.replace(out) if apply is not None else Targets.add(out, also)
    else:
        targets = Targets.new(layout, sum_dtype(updates), dev)
    try:
        commit_down = exchange(state, uplink, regions or layout, targets, tag,
                               sum_dtype(updates), 1.0 / size)
    except wire.PeerError as e:
        if not e.skip:
            raise ValueError(f"SBC: {e}") from None
        warnings.warn(f"horovod_sbc: skipping this sync: {e}")
        if uplink.failed:
            _drop_failed_update(uplink.encoded, sent)
        # healthy ranks keep R + dW in the residual: nothing sent, nothing lost
        return None
    out = list(targets.outs)
    if apply is not None:
        apply(out)
    commit_down()
    for _, enc in uplink.encoded:  # commit error feedback only after success
        enc.commit()
    state.manager.add(syncs=int(count_sync), positions_sent=uplink.positions_sent(),
                      elements_synced=sum(u.value.numel() for u in updates))
    return out


@dataclass
class Uplink:
    """This rank's part of a sync: its step message, and the encodings to commit once every
    rank's message decoded (``(update, encoding)``: one per update, or one for the whole sync
    when the backend encoded it at once); ``failed``: this rank sent ERROR/SKIP, after
    encoding the first ``len(encoded)`` updates. ``framed``: the step message, or what frames
    it when first asked for (:attr:`step`; the reduce-scatter's parts framed from
    :meth:`whole` never ask)."""
    framed: Union[torch.Tensor, Callable[[], torch.Tensor]]
    encoded: List[Tuple[object, object]]
    failed: bool = False

    @property
    def step(self) -> torch.Tensor:
        if callable(self.framed):
            self.framed = self.framed()
        return self.framed

    def positions_sent(self) -> int:
        return sum(enc.positions.numel() for _, enc in self.encoded)

    def whole(self):
        """The encoding of the whole sync at once, which frames groups of its tensors on the
        device (``frame_groups``: the reduce-scatter's regions), or None."""
        if self.failed or len(self.encoded) != 1 or self.encoded[0][0] is not None:
            return None
        enc = self.encoded[0][1]
        return enc if hasattr(enc, "frame_groups") else None


@dataclass(frozen=True)
class Outgoing:
    """What this rank sends in one sync, before it is encoded: the tensors' ``names`` in
    message order, the ``fingerprint`` of their layout, the ``device`` they live on, this
    ``rank`` (an ERROR/SKIP step names it) and the step's ``capacity`` (fixed-size steps;
    None: variable)."""
    names: Sequence[str]
    fingerprint: int
    device: torch.device
    rank: int
    capacity: Optional[int] = None


def encode_uplink(state: SyncState, out: Outgoing, source_of: Callable[[int], object], *,
                  whole: Optional[Sequence] = None, keys: Optional[Sequence] = None) -> Uplink:
    """Every tensor of ``out`` encoded by the state's backend: all at once from ``whole`` (every
    source, or None) where the backend can, else one by one (``source_of(i)`` builds tensor
    i's source when its turn comes); a NaN/Inf gives the ERROR/SKIP step naming the tensor
    instead. ``keys[i]`` (default: the names) is what :attr:`Uplink.encoded` pairs each
    encoding with."""
    cfg, dev, fp, cap = state.config, out.device, out.fingerprint, out.capacity
    backend = state.backend(dev)
    keys = out.names if keys is None else keys
    try:
        fused = backend.encode_many(whole, cfg.density, cfg.mode, cfg.selection,
                                    list(out.names), fp if cap is None else None) \
            if whole else None
    except NonFiniteError as e:  # the tensors before it encoded, as one by one
        return Uplink(_error_frame(state, str(e), fp, cfg.nonfinite == "skip", dev, out.rank,
                                   cap), list(zip(keys, e.encoded)), True)
    if fused is not None:
        _count_padding(state, cap, fused.body_bytes)
        return Uplink(functools.partial(fused.frame, fp, cap), [(None, fused)])
    encoded = []
    for i, (key, name) in enumerate(zip(keys, out.names)):
        try:
            enc = backend.encode_tensor(source_of(i), cfg.density, cfg.mode, name,
                                        cfg.selection, state.generator(dev),
                                        state.position_buffer(name))
        except NonFiniteError as e:
            skip = cfg.nonfinite == "skip"
            return Uplink(_error_frame(state, str(e), fp, skip, dev, out.rank, cap), encoded,
                          True)
        encoded.append((key, enc))
    msgs = [enc.message for _, enc in encoded]
    _count_padding(state, cap, sum(m.numel() for m in msgs))
    return Uplink(frame.frame(msgs, fp, dev, cap), encoded)


def _encode_all(state: SyncState, updates: List[Update], fp: int, dev, rank: int,
                error: Optional[Tuple[int, str]] = None) -> Uplink:
    """Every update encoded (all at once where the backend can), or an ERROR/SKIP step naming
    the first update that is not finite (weights checked before any residual changes, see
    :meth:`Update.weights_finite`)."""
    cfg = state.config
    skip = cfg.nonfinite == "skip"
    # a transport whose collective needs one size from every rank says so (equal_sizes)
    cap = frame.step_capacity([(u.name, u.value.shape) for u in updates], cfg,
                              getattr(state.transport, "equal_sizes", False))
    if error is not None:
        return Uplink(_error_frame(state, error[1], fp, skip, dev, error[0], cap), [], True)
    bad = next((u for u in updates if u.base_offset is not None and not u.weights_finite()),
               None)
    if bad is not None:
        reason = f"the update of {bad.name!r} contains NaN or Inf"
        return Uplink(_error_frame(state, reason, fp, skip, dev, rank, cap), [], True)
    return encode_uplink(state, Outgoing([u.name for u in updates], fp, dev, rank, cap),
                         lambda i: _source(state, updates[i]),
                         whole=_whole_sync_sources(state, updates, dev), keys=updates)


def _whole_sync_sources(state: SyncState, updates: Sequence[Update], dev):
    """The sources of a sync a backend may encode at once — every update kept in the weights
    (``W - W_ref``), every one a plain ``dW`` added to its residual, or (a backend that
    encodes at once only) every one ``W - W_ref`` added to a residual of its dtype, the
    differences formed in one foreach kernel — else None (the per-update path forms each
    ``dW`` in a shared scratch buffer)."""
    if not updates or any(u.base_offset is not None for u in updates):
        return None
    if all(u.in_weights for u in updates):
        return [Difference(u.weights_flat(), u.base.reshape(-1)) for u in updates]
    if all(not u.in_weights and u.base is None for u in updates):
        return [Accumulate(_residual(state, u), u.value.reshape(-1)) for u in updates]
    if not state.backend(dev).encodes_at_once or any(
            u.in_weights or u.base is None or u.base.dtype != u.value.dtype for u in updates):
        return None
    res = [state.residual(u.name, u.value) if u.residual is None else u.residual
           for u in updates]
    if any(r.dtype != u.value.dtype or r.numel() != u.value.numel()
           for r, u in zip(res, updates)):
        return None  # the per-update path names the tensor whose residual does not fit
    diffs = torch._foreach_sub([u.value.reshape(-1) for u in updates],
                               [u.base.reshape(-1) for u in updates])
    return [Accumulate(r, d) for r, d in zip(res, diffs)]


def _source(state: SyncState, u: Update):
    """Where one update lives: kept in the weights, ``A = W - W_ref`` (selected without being
    stored); otherwise ``A = R + dW`` in place in the residual (in the selection's pass), put
    back before a ``NonFiniteError`` propagates."""
    if u.in_weights:
        return Difference(u.weights_flat(), u.base.reshape(-1))
    res = _residual(state, u)
    return Accumulate(res, u.flat(res.dtype))


def _residual(state: SyncState, u: Update) -> torch.Tensor:
    """``u``'s flat residual (its own, or the state's of its name)."""
    res = state.residual(u.name, u.value) if u.residual is None else u.residual
    if res.numel() != u.value.numel():
        raise ValueError(f"SBC: {u.name!r} has {u.value.numel()} elements but its residual "
                         f"has {res.numel()}; did the model change shape?")
    return res


def _count_padding(state: SyncState, cap: Optional[int], body: int) -> None:
    """``stats()["padding_bits"]``: the zero bytes a fixed-size step adds after ``body``."""
    if cap is not None:
        state.manager.add(padding_bits=8 * (cap - wire.STEP_HEADER_SIZE - body))


def _error_frame(state: SyncState, reason: str, fp: int, skip: bool, dev, rank: int,
                 cap: Optional[int]) -> torch.Tensor:
    state.manager.add(padding_bits=8 * frame.error_padding(reason, fp, skip, rank, cap))
    return frame.error_frame(reason, fp, skip, dev, rank, cap)


def plan_regions(state: SyncState, layout, size: int) -> Optional[scatter.Plan]:
    """The regions of ``layout`` (topology ``"reduce_scatter"``), else None."""
    if state.config.topology != "reduce_scatter":
        return None
    return scatter.plan(tuple((n, tuple(s)) for n, s in layout), size)


def _pieces(state: SyncState, regions: scatter.Plan, updates: List[Update]) -> List[Update]:
    """The updates cut into the regions' pieces (views: the sync writes through them)."""
    res = [None if u.in_weights else _residual(state, u) for u in updates]

    def cut(t, p):
        return None if t is None else t.reshape(-1)[p.start:p.stop]
    return [Update(p.name, cut(u.value, p), p.shape, cut(u.base, p), cut(u.base_offset, p),
                   u.in_weights, cut(res[p.tensor], p))
            for p in regions.pieces for u in (updates[p.tensor],)]


def exchange(state: SyncState, uplink: Uplink, layout, targets: Targets, tag: str,
             acc_dtype, scale: float) -> Callable[[], None]:
    """Every rank's step message (this rank's: ``uplink``; ``layout``: the tensors', or a
    :class:`~horovod_sbc.torch.sync.scatter.Plan` whose pieces the step holds) exchanged by the
    configured topology and ``scale`` x their sum decoded into ``targets`` (per tensor; the
    server keeps its average in ``acc_dtype``). Returns the commit of the topology's own error
    feedback (the reduce-scatter's downlink residual), to call once the step is accepted."""
    size, rank = state.world()
    if isinstance(layout, scatter.Plan):
        whole = uplink.whole()  # its parts framed on the device, the whole step never framed
        return scatter.exchange(state, None if whole else uplink.step, layout, rank,
                                layout.targets(targets), scale, tag, acc_dtype, whole)
    step = uplink.step
    if state.config.topology == "server":
        from . import server
        server.exchange(state, step, layout, size, rank, targets, acc_dtype)
        return _nothing
    gathered = state.transport.allgather(step, tag)
    state.manager.add(upstream_bits=8 * step.numel(),
                      downstream_bits=8 * (gathered.numel() - step.numel()))
    state.backend(gathered.device).decode(gathered, layout, size, targets, scale)
    return _nothing


def _nothing() -> None:
    pass


def _drop_failed_update(encoded, updates: Sequence[Update]) -> None:
    """A skipped sync on the rank that failed to encode: it drops this window's update. Kept in
    the weights, only its non-finite entries restart from the shared weights (the rest stays).
    An update relative to the residual itself (``base_offset``) cannot be recomputed once ``R``
    was overwritten; its weights were checked finite before, so only an overflow to +-Inf of
    finite values gets here: those entries are reset to 0 and the rest of the window's update
    stays in the residual."""
    for u, enc in encoded:
        if u is not None and not u.in_weights:
            if u.base_offset is None:
                restore_(enc.target, u.flat(enc.target.dtype))
            else:
                reset_nonfinite_(enc.target)
    for u in updates:
        if u.in_weights:
            w, base = u.weights_flat(), u.base.reshape(-1)
            torch.where(torch.isfinite(w), w, base, out=w)
