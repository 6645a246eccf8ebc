"""The tensor-op backend: the whole codec in torch ops, on the tensors' own device.

What CUDA tensors take (and CPU tensors when the C kernels are off). Designed for a device that
runs asynchronously from the host: the work is O(numel) and O(positions) tensor ops on the
device, and the host reads only O(tensors) integers a fixed number of times per sync.

* **Encoding a sync** (:meth:`OpsBackend.encode_many`): SBC with the paper's selection on
  float32 updates goes through the fused encoder (:mod:`horovod_sbc.torch.backend.fused`), every
  tensor at once in a constant number of kernels and two host reads, its step header uploaded
  with the encoder's plan and its CRC computed on the device. Anything else, and a sync
  whose update holds NaN/Inf (so that the error names the tensor and its residual is handled by
  its own rule), is encoded tensor by tensor (:meth:`OpsBackend.encode_tensor`: the selection of
  :mod:`horovod_sbc.torch.backend.select`, the streams of :mod:`horovod_sbc.torch.backend.
  streams`, or a registered compressor's ``encode_torch``).
* **Decoding** (:meth:`OpsBackend.decode_many`): one host read of every gathered byte (the
  compressed messages only) for the protocol's headers, every message of every rank and of every
  job decoded together (:func:`horovod_sbc.torch.backend.batch.decode_messages`), the verdict,
  then per output dtype one buffer of all outputs receives each rank's values with one
  ``index_add_`` per rank (rank order kept on any device: each rank's positions are unique) and
  is copied back. Host reads per call: two, whatever the number of tensors, ranks and jobs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ... import protocol, registry, wire
from ...reference import keep_count
from . import batch, frame
from .base import (Accumulate, Backend, DecodeJob, Difference, Encoded, InPlace,
                   NonFiniteError, Source, as_source, check_request, reset_nonfinite_,
                   restore_, scratch)
from .fused import FusedEncoding, crc_bytes, encode_fused, frame_device, frame_segments
from .select import binarize_sides, select_sides, select_topk
from .streams import empty_positions, encode_positions


def one_value(value: float, count: int, like: torch.Tensor) -> torch.Tensor:
    """``count`` copies of one sent value as a stride-0 view (SBC: every position carries the
    message's mean; :meth:`Backend.subtract_sent` may recognise it)."""
    return torch.full((1,), value, dtype=like.dtype, device=like.device).expand(count)


def form(src) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``A`` to select from, the tensor the error feedback is taken out of), forming ``A`` in
    tensor ops: ``R += g`` in place (``g`` zeroed when consumed), or ``W - W_ref`` into a
    scratch buffer."""
    if isinstance(src, InPlace):
        return src.a, src.a
    if isinstance(src, Accumulate):
        src.residual.add_(src.addend)
        if src.consume:
            src.addend.zero_()
        return src.residual, src.residual
    if isinstance(src, Difference):
        w = src.weights
        a = scratch(w.numel(), w.dtype, w.device, slot=1)
        torch.sub(w, src.reference, out=a)
        return a, w
    raise TypeError(f"not an update source: {type(src).__name__}")


def undo(src) -> None:
    """After NaN/Inf: an :class:`Accumulate` put back (consumed: kept, its non-finite entries at
    0); nothing else was written."""
    if isinstance(src, Accumulate):
        if src.consume:
            reset_nonfinite_(src.residual)
        else:
            restore_(src.residual, src.addend)


def kept_values(src, pos: torch.Tensor, sent: torch.Tensor) -> Optional[torch.Tensor]:
    """A :class:`Difference` sent with per-position values: ``A - sent`` at the positions (read
    now, before the decode moves the weights); else None."""
    if not isinstance(src, Difference):
        return None
    w, ref = src.weights, src.reference
    return (w.index_select(0, pos) - ref.index_select(0, pos)) - sent


class OpsBackend(Backend):
    """The codec in tensor ops (see the module docstring)."""

    name = "tensor ops"
    encodes_at_once = True

    # -- encode -------------------------------------------------------------------------------
    def encode_tensor(self, source: Source, density: float, mode="sbc", name: str = "tensor",
                      selection: str = "paper", generator=None, positions=None) -> Encoded:
        mode = check_request(mode, selection)
        src = as_source(source)
        a, target = form(src)
        return self._encoded(src, target, mode, lambda: self.encode_formed(
            a, density, mode, name, selection, generator))

    def _encoded(self, src, target: torch.Tensor, mode: str, encode) -> Encoded:
        """The :class:`Encoded` of ``encode()`` -> (message, positions, values sent), whose
        commit subtracts what was sent from ``target``; a non-finite update first undoes what
        forming it changed in ``src``."""
        try:
            msg, pos, sent = encode()
        except NonFiniteError:
            undo(src)
            raise
        one_value_sent = registry.get(mode).message is registry.Message.BINARY
        kept = None if one_value_sent else kept_values(src, pos, sent)
        ref = src.reference if kept is not None else None
        return Encoded(msg, pos, sent, target, self.subtract_sent, ref, kept)

    def encode_formed(self, a: torch.Tensor, density: float, mode: str, name: str,
                      selection: str, generator=None):
        """(message, positions, values sent) of the formed update ``a`` (not changed)."""
        n = a.numel()
        if n == 0:
            empty = empty_positions(a.device)
            return encode_positions(empty, 0), empty, a.new_zeros(0)
        comp = registry.get(mode)
        if not comp.native_kernel:  # a registered compressor's own encoder
            return comp.encode_torch(a, density=density, selection=selection, name=name,
                                     generator=generator)
        k = keep_count(n, density)
        if comp.message is registry.Message.VALUES:
            idx = select_topk(a, k, name)
            vals = a[idx].to(torch.float32)
            return (encode_positions(idx, n, values=vals, all_positions=idx.numel() == n), idx,
                    vals.to(a.dtype))
        bz = binarize_sides(a, *select_sides(a, k, selection, name))
        msg = encode_positions(bz.pos, n, bz.mu, bz.negative, rice_b=bz.rice_b, sum_q=bz.sum_q)
        return msg, bz.pos, one_value(-bz.mu if bz.negative else bz.mu, bz.pos.numel(), a)

    def encode_many(self, sources: Sequence[Source], density: float, mode: str,
                    selection: str, names: Sequence[str],
                    layout_crc: Optional[int] = None) -> Optional["FusedSync"]:
        srcs = [as_source(s) for s in sources]
        if not _fusable(srcs, mode, selection):
            return None
        if isinstance(srcs[0], Difference):
            targets = [s.weights for s in srcs]
            flat = torch.cat(targets) - torch.cat([s.reference for s in srcs])
        else:
            targets = [s.residual for s in srcs]
            flat = torch.cat(targets) + torch.cat([s.addend for s in srcs])
        head = None if layout_crc is None else (  # the step header, uploaded with the plan
            lambda size: frame.step_header_bytes(size, layout_crc, len(srcs)))
        try:
            enc = encode_fused(flat, [t.numel() for t in targets], density, list(names),
                               mode, step_header=head)
        except NonFiniteError:
            return None
        if isinstance(srcs[0], Accumulate):  # R + dW becomes the residual, as R += dW would
            torch._foreach_copy_(targets, list(torch.split(flat, [t.numel() for t in targets])))
            used = [s.addend for s in srcs if s.consume]
            if used:
                torch._foreach_zero_(used)
        return FusedSync(enc, targets)

    # -- decode -------------------------------------------------------------------------------
    def decode_many(self, jobs: Sequence[DecodeJob]) -> List[Optional[BaseException]]:
        if not jobs:
            return []
        big = jobs[0].gathered if len(jobs) == 1 else torch.cat([j.gathered for j in jobs])
        if all(j.host is not None for j in jobs):  # the caller read them already
            host = b"".join(bytes(j.host) for j in jobs)
        else:
            host = frame.host_bytes(big)
        errors: List[Optional[BaseException]] = [None] * len(jobs)
        msgs = MessageSet()
        off = 0
        for ji, job in enumerate(jobs):
            job.host = memoryview(host)[off:off + job.gathered.numel()]
            try:
                job.step = protocol.parse_gathered(job.host, job.layout, job.n_ranks)
            except ValueError as e:  # PeerError too
                errors[ji] = e
            else:
                msgs.add_job(ji, job, off)
            off += job.gathered.numel()
        dec = batch.decode_messages(big, msgs.messages, msgs.scales)
        for ji, job in enumerate(jobs):
            if errors[ji] is None:
                try:
                    protocol.check_streams(job.step, msgs.stats_of(ji, dec))
                except ValueError as e:
                    errors[ji] = e
        accumulate(dec, msgs, jobs, [ji for ji in range(len(jobs)) if errors[ji] is None])
        return errors


def _fusable(srcs, mode: str, selection: str) -> bool:
    """Sources the fused encoder takes: a ``fused`` one-value compressor (SBC with the
    paper's selection, or a ternary one such as STC), float32 on one device,
    every update a :class:`Difference` (float32 weights and reference) or every one an
    :class:`Accumulate` of a float32 addend into a float32 residual of its size (consumed
    addends are zeroed once the encode succeeded)."""
    comp = registry.get(mode)
    if not srcs or not comp.fused or comp.message is registry.Message.VALUES or \
            (comp.sides == 2 and selection != "paper"):
        return False
    kind = type(srcs[0])
    if kind is Difference:
        pairs = [(s.weights, s.reference) for s in srcs if isinstance(s, Difference)]
    elif kind is Accumulate:
        pairs = [(s.residual, s.addend) for s in srcs if isinstance(s, Accumulate)]
    else:
        return False
    if len(pairs) != len(srcs):
        return False
    dev = pairs[0][0].device
    return all(x.dtype == torch.float32 and y.dtype == torch.float32 and x.device == dev and
               y.device == dev and x.numel() == y.numel() for x, y in pairs)


@dataclass
class FusedSync:
    """Every update of a sync encoded at once (:func:`~horovod_sbc.torch.backend.fused.
    encode_fused`); ``targets`` are the flat tensors the error feedback is taken out of."""
    encoding: FusedEncoding
    targets: List[torch.Tensor]

    @property
    def positions(self) -> torch.Tensor:
        return self.encoding.positions

    @property
    def body_bytes(self) -> int:
        return self.encoding.body.numel()

    def frame(self, layout_crc: int, capacity: Optional[int] = None) -> torch.Tensor:
        """The step message, its CRC computed on the device (no host read); with
        ``capacity`` a PADDED one of exactly that many bytes."""
        body, n = self.encoding.body, len(self.targets)
        if capacity is None:
            step = self.encoding.step
            if step is None:
                return frame_device(body, layout_crc, n)
            step[20:24] = crc_bytes(body)  # its header came with the encoder's upload
            return step
        pad = capacity - wire.STEP_HEADER_SIZE - body.numel()
        if pad < 1:
            raise AssertionError(f"horovod_sbc: a step body of {body.numel()} bytes exceeds "
                                 f"its capacity of {capacity - wire.STEP_HEADER_SIZE}")
        return frame_device(torch.cat([body, body.new_zeros(pad)]), layout_crc, n, padded=True)

    def frame_groups(self, groups: Sequence[int], layout_crcs: Sequence[int]
                     ) -> Tuple[torch.Tensor, List[int]]:
        """One step message per group of consecutive tensors (group ``g``: tensors
        ``groups[g]`` to ``groups[g + 1]``, under ``layout_crcs[g]``; the reduce-scatter's
        regions), back to back, and their lengths: built on the device, no host read."""
        bounds = self.encoding.bounds
        lens = [bounds[b - 1][1] - bounds[a][0] if b > a else 0
                for a, b in zip(groups[:-1], groups[1:])]
        n_tensors = [b - a for a, b in zip(groups[:-1], groups[1:])]
        parts = frame_segments(self.encoding.body, lens, layout_crcs, n_tensors)
        return parts, [wire.STEP_HEADER_SIZE + ln for ln in lens]

    def commit(self) -> None:
        """What was sent leaves the targets: ``t[pos] -= mu`` (``t - 0`` elsewhere, exact)."""
        enc = self.encoding
        if not enc.positions.numel():
            return
        sent = torch.zeros_like(enc.flat).index_add_(0, enc.positions, enc.values)
        torch._foreach_sub_(self.targets, list(torch.split(sent, [t.numel() for t in
                                                                  self.targets])))


# ------------------------------------------------------------------------------------------------
# many jobs' messages, and where their sums go
# ------------------------------------------------------------------------------------------------
def shifted(m: wire.TensorMessage, by: int) -> wire.TensorMessage:
    """``m`` with its byte ranges moved by ``by`` (its job's offset in a concatenated buffer)."""
    if not by:
        return m
    move = lambda r: (r[0] + by, r[1] + by)  # noqa: E731
    return dataclasses.replace(m, unary=move(m.unary), remainder=move(m.remainder),
                               values=move(m.values), signs=move(m.signs))


class MessageSet:
    """The messages of the parsed jobs in (rank, job, tensor) order — each rank's messages
    together, so that each rank's decoded elements are one slice — and for each job its
    messages in the protocol's (rank, tensor) order. Add every job, then read."""

    def __init__(self):
        self._rows: List[Tuple[int, int, int, wire.TensorMessage, float]] = []
        self._sorted = True

    def add_job(self, ji: int, job: DecodeJob, off: int, tensors=None) -> None:
        """Job ``ji``'s messages (``off``: its offset in the decoded buffer; ``tensors``: only
        these tensor indices)."""
        self._rows += [(r, ji, i, shifted(m, off), job.scale) for r, i, m, _ in job.step.flat()
                       if tensors is None or i in tensors]
        self._sorted = False

    def _sort(self) -> None:
        if not self._sorted:
            self._rows.sort(key=lambda x: x[:3])
            self._by_job: Dict[int, List[int]] = {}
            for k, row in enumerate(self._rows):
                self._by_job.setdefault(row[1], []).append(k)
            self._sorted = True

    @property
    def messages(self) -> List[wire.TensorMessage]:
        self._sort()
        return [row[3] for row in self._rows]

    @property
    def scales(self) -> List[float]:
        self._sort()
        return [row[4] for row in self._rows]

    @property
    def meta(self) -> List[Tuple[int, int, int]]:
        """(rank, job, tensor) of each message."""
        self._sort()
        return [row[:3] for row in self._rows]

    def stats_of(self, ji: int, dec: batch.Decoded) -> List[protocol.StreamStats]:
        """Job ``ji``'s stream statistics in its (rank, tensor) order."""
        self._sort()
        return [dec.stats[k] for k in self._by_job.get(ji, [])]


def accumulate(dec: batch.Decoded, msgs: MessageSet, jobs: Sequence[DecodeJob],
               accepted: Sequence[int], tensors: Optional[Dict[int, set]] = None) -> None:
    """Add the decoded elements of the accepted jobs to their targets (``tensors``: per job,
    only these tensor indices; default all): per output list and dtype, one buffer of all the
    outputs, one ``index_add_`` per rank, then the sums copied back (and DGC's masks)."""
    groups: Dict[Tuple[int, torch.dtype], List[Tuple[int, int, torch.Tensor]]] = {}
    for ji in accepted:
        for li, lst in enumerate(jobs[ji].targets.lists()):
            for i, t in enumerate(lst):
                if t is not None and (tensors is None or i in tensors.get(ji, ())):
                    groups.setdefault((li, t.dtype), []).append((ji, i, t))
    for (li, dtype), members in groups.items():
        _add_group(dec, msgs, jobs, li, dtype, members)


def _add_group(dec, msgs: MessageSet, jobs, li: int, dtype, members) -> None:
    dev = members[0][2].device
    base, sizes, off = {}, [], 0
    for ji, i, t in members:
        base[(ji, i)] = off
        sizes.append(t.numel())
        off += t.numel()
    fresh = [jobs[ji].targets.fresh for ji, _, _ in members]
    meta = msgs.meta
    sel = [k for k, (r, ji, i) in enumerate(meta) if (ji, i) in base]
    starts = dec.start[sel]
    lens = dec.start[np.array(sel, np.int64) + 1] - starts if sel else np.zeros(0, np.int64)
    total = int(lens.sum())
    if not total:  # nothing decoded for these outputs: fresh ones hold the zero sum
        zero = [t for (ji, _, t), f in zip(members, fresh) if f and not jobs[ji].targets.zeroed]
        if zero:
            torch._foreach_zero_(zero)
        return
    if all(fresh):
        acc = torch.zeros(off, dtype=dtype, device=dev)
    elif not any(fresh):  # targets are flat
        acc = torch.cat([t for _, _, t in members])
    else:
        acc = torch.cat([t.new_zeros(t.numel()) if f else t
                         for (_, _, t), f in zip(members, fresh)])
    up = batch.Uploads()  # one upload: the elements' places and each tensor's offset
    s_idx, s_off = up.segments(starts, lens), up.add([base[meta[k][1:]] for k in sel])
    s_len = up.add(lens)
    dv = up.send(dev)
    idx = batch.segment_index(dv[s_idx], total)
    gpos = dec.pos.index_select(0, idx) + torch.repeat_interleave(dv[s_off], dv[s_len],
                                                                  output_size=total)
    vals = dec.value.index_select(0, idx).to(dtype)
    ranks = np.array([meta[k][0] for k in sel], np.int64)
    bounds = np.concatenate([[0], np.cumsum(lens)])
    for r in np.unique(ranks):  # rank by rank: atomics on a GPU would not keep the order
        ks = np.flatnonzero(ranks == r)
        lo, hi = int(bounds[ks[0]]), int(bounds[ks[-1] + 1])
        if hi > lo:
            acc.index_add_(0, gpos[lo:hi], vals[lo:hi])
    outs = [t for _, _, t in members]
    torch._foreach_copy_(outs, list(torch.split(acc, sizes)))
    if li == 0:
        _mask(jobs, members, acc, sizes)


def _mask(jobs, members, acc: torch.Tensor, sizes: List[int]) -> None:
    """DGC's momentum factor masking: each output's mask zeroed where its sum is non-zero."""
    masks = [(jobs[ji].targets.masks or (None,) * (i + 1))[i] for ji, i, _ in members]
    if all(m is None for m in masks):
        return
    for m, s in zip(masks, torch.split(acc, sizes)):
        if m is not None:
            m.view(-1).masked_fill_(s != 0, 0)
