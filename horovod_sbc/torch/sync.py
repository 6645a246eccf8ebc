"""One sync of a set of updates (GRACE's *Communicator* at work): encode every update plus its
residual, exchange one fused step message, decode and average, then commit the error feedback.

:func:`synchronize` serves the drop-in optimizer (weight updates ``W - W_ref``), the DDP hook
and averager (:mod:`horovod_sbc.torch.ddp`) and the tests; the stock Horovod hook
(:mod:`horovod_sbc.torch.hook`) exchanges one gradient at a time with the same pieces. The
collective is the state's ``transport`` (Horovod's allgather by default, ``torch.distributed``
for DDP); the ``"server"`` topology gathers to rank 0 and broadcasts one downlink instead.

Error feedback is committed only after every rank's message decoded: a sync that fails (a
rank's NaN, a malformed message) leaves every residual as it was before the sync, and a skipped
sync keeps ``R + dW`` in the healthy ranks' residuals.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .. import wire
from . import exchange, fused_sync
from .state import SyncState
from ..reference import keep_count
from .codec import (Difference, NonFiniteError, scratch, encode_positions, encode_update,
                    subtract_sent_)


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


@dataclass
class Encoded:
    """An update encoded but not yet committed: its residual holds ``A = R + dW``; once the
    sync succeeded, ``sent`` is subtracted at ``positions``. ``in_weights``: ``residual`` is the
    flat weights (``A = W - W_ref``); with per-position values sent (top-k values, signSGD,
    TernGrad, FedAvg) ``kept`` is what stays of ``A`` there (``A - sent``), and once the sync
    succeeded the weights there become the new shared weights plus ``kept``."""
    update: Update
    residual: torch.Tensor
    positions: torch.Tensor
    sent: torch.Tensor
    message: torch.Tensor
    kept: Optional[torch.Tensor] = None

    def commit(self) -> None:
        """Error feedback, once every rank's message decoded. ``in_weights``, where ``W`` has
        moved with ``W_ref`` by the average: SBC's one value leaves ``W`` at the sent positions
        (``W + avg - mu``, one random read-modify-write per position); per-position values set
        ``W = W_ref + (A - sent)`` there, so a position whose whole update was sent lands
        exactly on the shared weights (FedAvg, density 1: every rank's weights equal)."""
        if self.kept is None:
            subtract_sent_(self.residual, self.positions, self.sent)
        elif self.positions.numel():
            base = self.update.base.reshape(-1)
            self.residual.index_copy_(0, self.positions,
                                      base.index_select(0, self.positions) + self.kept)


def reset_nonfinite_(res: torch.Tensor) -> None:
    """The failing rank's residual after a non-finite update: its NaN/Inf entries restart at 0
    (what cannot be taken back), the rest stays."""
    torch.nan_to_num_(res, nan=0.0, posinf=0.0, neginf=0.0)


def restore(res: torch.Tensor, upd: torch.Tensor) -> None:
    """Undo ``res += upd`` after a failed encode; entries made non-finite by a NaN/Inf in
    ``upd`` cannot be recovered and are reset to 0 (only on the failing rank)."""
    res.sub_(upd)
    reset_nonfinite_(res)


def _undo(res: torch.Tensor, u: Update, upd: Optional[torch.Tensor]) -> None:
    """Take a failed sync's ``R += dW`` back (``upd``: the update as added, if at hand). An
    update relative to the residual itself (``base_offset``) cannot be recomputed once ``R``
    was overwritten; its weights were checked finite before, so only an overflow to +-Inf of
    finite values gets here: those entries are reset to 0 and the rest of the window's update
    stays in the residual."""
    if upd is not None:
        restore(res, upd)
    elif u.base_offset is None:
        restore(res, u.flat(res.dtype))
    else:
        reset_nonfinite_(res)


def _encode(state: SyncState, u: Update) -> Encoded:
    """Encode one update; error feedback is committed later (:meth:`Encoded.commit`). Kept in
    the weights: ``A = W - W_ref`` is selected without being stored. Otherwise ``A = R + dW``
    in place in the residual (in the selection's pass), restored before a ``NonFiniteError``
    propagates."""
    cfg = state.config
    if u.in_weights:
        target = u.weights_flat()
        a = scratch(target.numel(), target.dtype, target.device, slot=1)
        addend = Difference(target, u.base.reshape(-1))
    else:
        target = a = state.residual(u.name, u.value)
        if a.numel() != u.value.numel():
            raise ValueError(f"SBC: {u.name!r} has {u.value.numel()} elements but its residual "
                             f"has {a.numel()}; did the model change shape?")
        addend = u.flat(a.dtype)
    try:
        msg, pos, sent = encode_update(a, cfg.density, cfg.mode, u.name,
                                       state.generator(a.device), cfg.selection,
                                       addend=addend, positions=state.position_buffer(u.name))
    except NonFiniteError:
        if not u.in_weights:  # kept in the weights: nothing was written
            _undo(a, u, addend)
        raise
    kept = None
    if u.in_weights and cfg.mode != "sbc":  # values per position: A - sent, before the decode
        base = u.base.reshape(-1)  # moves W and W_ref
        kept = (target.index_select(0, pos) - base.index_select(0, pos)) - sent
    return Encoded(u, target, pos, sent, msg, kept)


def sum_dtype(updates: Sequence[Update]) -> torch.dtype:
    return torch.float64 if any(u.value.dtype == torch.float64 for u in updates) else \
        torch.float32


def synchronize(state: SyncState, items, out: Optional[List[torch.Tensor]] = None,
                tag: str = "sbc.sync", count_sync: bool = True,
                apply: Optional[Callable[[List[torch.Tensor]], None]] = None,
                error: Optional[Tuple[int, str]] = None) -> Optional[List[torch.Tensor]]:
    """Compress, exchange (one fused message), decode and average ``items``
    (:class:`Update` or tuples, see :meth:`Update.of`). Returns ``out`` (flat tensors, e.g. the
    reference weights) or new zero tensors plus the average of all ranks' decoded updates; None
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
    fp = wire.layout_fingerprint(layout)
    dev = updates[0].value.device if updates else torch.device("cpu")
    encoded, step, fused, local_error = _encode_all(state, updates, fp, dev, rank, error)
    # the weights that hold their residual move with the shared weights
    also = [u.weights_flat() if u.in_weights else None for u in updates] \
        if apply is None and any(u.in_weights for u in updates) else None
    if (also is not None or apply is not None) and out is None:
        raise ValueError("SBC: updates kept in the weights or an outer step need out=")
    try:
        out = _exchange(state, step, layout, size, rank, out, sum_dtype(updates), also,
                        apply is not None, fused, tag)
    except wire.PeerError as e:
        if not e.skip:
            raise ValueError(f"SBC: {e}") from None
        warnings.warn(f"horovod_sbc: skipping this sync: {e}")
        if local_error:
            _drop_failed_update(encoded, updates)
        # healthy ranks keep R + dW in the residual: nothing sent, nothing lost
        return None
    if apply is not None:
        apply(out)
    for enc in encoded:  # commit error feedback only after success
        enc.commit()
    state.manager.add(syncs=int(count_sync),
                      positions_sent=sum(e.positions.numel() for e in encoded),
                      elements_synced=sum(e.residual.numel() for e in encoded))
    return out


def _encode_all(state: SyncState, updates: List[Update], fp: int, dev, rank: int,
                error: Optional[Tuple[int, str]] = None):
    """``(encoded, step message, fused encoding or None, this rank failed)``: every update
    encoded (on the device path all at once), or an ERROR/SKIP step message naming the first
    update that is not finite (weights checked before any residual changes, see
    :meth:`Update.weights_finite`)."""
    skip = state.config.nonfinite == "skip"
    cap = exchange.step_capacity([(u.name, u.value.shape) for u in updates], state.config)
    if error is not None:
        return [], _error_frame(state, error[1], fp, skip, dev, error[0], cap), None, True
    bad = next((u for u in updates if u.base_offset is not None and not u.weights_finite()),
               None)
    if bad is not None:
        reason = f"the update of {bad.name!r} contains NaN or Inf"
        return [], _error_frame(state, reason, fp, skip, dev, rank, cap), None, True
    # the device path encodes all at once (None on NaN/Inf: the loop then finds it as usual)
    fused = fused_sync.encode(state, updates, fp, cap) \
        if fused_sync.eligible(state, updates) else None
    if fused is not None:
        _count_padding(state, cap, fused.encoding.body.numel())
        return [fused], fused.step, fused, False
    encoded: List[Encoded] = []
    for u in updates:
        try:
            encoded.append(_encode(state, u))
        except NonFiniteError as e:
            return encoded, _error_frame(state, str(e), fp, skip, dev, rank, cap), None, True
    msgs = [e.message for e in encoded]
    _count_padding(state, cap, sum(m.numel() for m in msgs))
    return encoded, exchange.frame(msgs, fp, dev, cap), None, False


def _count_padding(state: SyncState, cap: Optional[int], body: int) -> None:
    """``stats()["padding_bits"]``: the zero bytes a fixed-size step adds after ``body``."""
    if cap is not None:
        state.manager.add(padding_bits=8 * (cap - wire.STEP_HEADER_SIZE - body))


def _error_frame(state: SyncState, reason: str, fp: int, skip: bool, dev, rank: int,
                 cap: Optional[int]) -> torch.Tensor:
    if cap is not None:  # a padded reason holds no zero byte: the padding is what rstrip drops
        raw = wire.error_step_message(reason, fp, skip, rank, cap)
        state.manager.add(padding_bits=8 * (len(raw) - len(raw.rstrip(b"\0"))))
    return exchange.error_frame(reason, fp, skip, dev, rank, cap)


def _exchange(state: SyncState, step: torch.Tensor, layout, size: int, rank: int, out,
              acc_dtype, also, dense: bool, fused, tag: str) -> List[torch.Tensor]:
    """Gather every rank's step message (or go through the server), decode and add the
    average to ``out`` (``dense``: ``out`` receives the average alone) and ``also``."""
    if state.config.topology == "server":
        return server_exchange(state, step, layout, size, rank, out, acc_dtype, also, dense)
    gathered = state.transport.allgather(step, tag)
    state.manager.add(upstream_bits=8 * step.numel(),
                      downstream_bits=8 * (gathered.numel() - step.numel()))
    # the batched device decode adds to its targets; an outer step's buffers take the average
    # alone, which the general decoder writes without a separate zeroing pass
    if fused is not None and out is not None and not dense and fused_sync.decode_gathered(
            gathered, layout, size, [out] if also is None else [out, also], 1.0 / size):
        return out
    return exchange.decode_gathered(gathered, layout, size, out, 1.0 / size, acc_dtype,
                                    also=also, zero_out=dense)


def _drop_failed_update(encoded: Sequence[Encoded], updates: Sequence[Update]) -> None:
    """A skipped sync on the rank that failed to encode: it drops this window's update. Kept in
    the weights, only its non-finite entries restart from the shared weights (the rest stays)."""
    for enc in encoded:
        if not enc.update.in_weights:
            _undo(enc.residual, enc.update, None)
    for u in updates:
        if u.in_weights:
            w, base = u.weights_flat(), u.base.reshape(-1)
            torch.where(torch.isfinite(w), w, base, out=w)


# ----------------------------------------------------------------------------------------------
# topology "server"
# ----------------------------------------------------------------------------------------------
def server_exchange(state: SyncState, step: torch.Tensor, layout, size: int, rank: int, out,
                    acc_dtype, also=None, zero_out: bool = False) -> List[torch.Tensor]:
    """Server topology (Zou, De Sterck, Liu, "Downlink Compression Improves TopK
    Sparsification", arXiv 2209.15203): rank 0 gathers every rank's step message (a real MPI
    gather: nothing goes to the other workers), decodes and averages them, adds its own server
    residual, compresses the average at ``downlink_density`` and broadcasts that one message;
    every rank, rank 0 included, applies the same decoded downlink (to ``out`` and ``also``, see
    :func:`horovod_sbc.torch.exchange.decode_gathered`; ``zero_out``: ``out`` receives the
    downlink alone)."""
    from . import server
    root = 0
    gathered = server.gather(step, root)
    state.manager.add(upstream_bits=8 * step.numel())
    down = None
    if rank == root:
        state.manager.add(server_in_bits=8 * (gathered.numel() - step.numel()))
        down = server_step(state, gathered, layout, size, acc_dtype, step.device)
    down = server.broadcast(down, root, step.device)
    if rank == root:
        state.manager.add(server_out_bits=8 * down.numel() * (size - 1))
    else:
        state.manager.add(downstream_bits=8 * down.numel())
    return exchange.decode_gathered(down, layout, 1, out, 1.0, acc_dtype, also=also,
                                    zero_out=zero_out)


def server_step(state: SyncState, gathered, layout, size, acc_dtype, dev) -> torch.Tensor:
    """Root only: the downlink step message for the gathered uplinks (or an error frame that
    makes every rank fail or skip together)."""
    fp = wire.layout_fingerprint(layout)
    try:
        avg = exchange.decode_gathered(gathered, layout, size, None, 1.0 / size, acc_dtype)
    except wire.PeerError as e:
        return exchange.error_frame(e.reason, fp, e.skip, dev, e.rank)  # relay it
    except ValueError as e:  # a malformed uplink: everybody must hear about it
        return exchange.error_frame(f"the server rejected an uplink: {e}", fp, False, dev, 0)
    msgs = []
    srv = state.manager.server_residuals
    cfg = state.config
    for (name, _), a in zip(layout, avg):
        if cfg.downlink_density is None:  # dense downlink: exact average, no residual
            msg, _, _ = encode_update(a, 1.0, "values", name)
        else:
            r = srv.get(name)
            if r is None or r.numel() != a.numel():
                r = srv[name] = torch.zeros_like(a)
            r.add_(a)  # server-side error feedback
            msg, pos, sent = encode_downlink(r, cfg.downlink_density, cfg.downlink_mode, name,
                                             cfg.selection)
            subtract_sent_(r, pos, sent)
        msgs.append(msg)
    return exchange.frame(msgs, fp, dev)


def encode_downlink(r: torch.Tensor, density: float, mode: str, name: str, selection: str):
    """The server's message for the residual-corrected average ``r``: never a zero-valued
    position. With few ranks the average often has fewer non-zeros than the downlink's k (2 ranks
    at p=0.01 send 2k positions at most, the downlink keeps k of a sum of sparse messages), so k
    is min(k, non-zeros) (one count crosses to the host)."""
    n = r.numel()
    k = keep_count(n, density)
    nz = int(torch.count_nonzero(r)) if n else 0
    if nz == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=r.device)
        return encode_positions(empty, n), empty, r.new_zeros(0)
    return encode_update(r, density if nz >= k else nz / n, mode, name, selection=selection)
