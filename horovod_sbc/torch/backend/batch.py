"""Every tensor message of a gathered step decoded at once, in tensor ops on the buffer's device.

:class:`~horovod_sbc.torch.backend.ops.OpsBackend` parses all headers on the host
(:func:`horovod_sbc.protocol.parse_gathered`: exact integers, compressed bytes only), then hands
every message of every rank (of one or of many gathered steps) to :func:`decode_messages`, which
decodes them with a fixed number of tensor ops, one upload of the host facts (:class:`Uploads`)
and one read of O(messages) integers, whatever the number of tensors, ranks and message kinds:

1. **unary streams** — gathered by one ``index_select``; byte popcounts and their running sum
   locate each message's one bits;
2. **positions** — element j of a message is the j-th one bit after its own stream's start,
   ``position = ((u - j) << b) + sum(r) + j`` (remainders exact for any Rice parameter up to
   62); ALL messages hold positions ``0 .. count - 1``. A message whose one bits do not match
   its count cannot shift any other message's elements, so the verdict is exact for any input;
3. **values** — per element ``float64(value) * scale``: the message's value (binary), its sign
   bit applied (SIGNS), or its own float32 (VALUES), as :mod:`horovod_sbc.protocol` specifies;
4. **statistics** — per message, what :func:`horovod_sbc.protocol.check_streams` judges: the
   one host read.

Elements come out in message order, each message's elements ascending; callers order the
messages rank-major so that each rank's elements are one slice. How each stage is computed:
docs/design.md#decoding-every-message-at-once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
import torch

from ... import protocol, wire
from . import transfer

_POPCOUNT = {}
_BIT_OF = {}


def _tables(dev):
    """(popcount of each byte value uint8[256], bit offset (MSB = 0) of the j-th set bit of each
    byte value int64[256 * 8]), on ``dev`` (built once per device)."""
    key = str(dev)
    if key not in _POPCOUNT:
        v = np.arange(256, dtype=np.uint8)
        bits = np.unpackbits(v[:, None], axis=1)  # MSB first
        pc = bits.sum(1).astype(np.uint8)
        where = np.zeros((256, 8), np.int64)
        for x in range(256):
            nz = np.flatnonzero(bits[x])
            where[x, :nz.size] = nz
        _POPCOUNT[key] = transfer.upload(pc, dev)
        _BIT_OF[key] = transfer.upload(where.reshape(-1), dev)
    return _POPCOUNT[key], _BIT_OF[key]


class Uploads:
    """Host arrays (int64, float64 by their bits, bool) sent to the device as one buffer: one
    host-to-device copy however many arrays a step needs. :meth:`add` returns a slot,
    :meth:`send` the device tensors in slot order."""

    def __init__(self):
        self._parts: List[np.ndarray] = []
        self._kinds: List[str] = []

    def add(self, x) -> int:
        x = np.asarray(x)
        kind = "f" if x.dtype == np.float64 else "b" if x.dtype == np.bool_ else "i"
        self._parts.append(np.ascontiguousarray(x, np.float64 if kind == "f" else np.int64))
        self._kinds.append(kind)
        return len(self._parts) - 1

    def segments(self, starts: np.ndarray, lengths: np.ndarray) -> int:
        """A slot for :func:`segment_index` of these segments (starts, lengths)."""
        cum = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        return self.add(np.concatenate([starts - cum, lengths]).astype(np.int64))

    def send(self, dev) -> List[torch.Tensor]:
        sizes = [p.size for p in self._parts]
        host = np.concatenate([p.view(np.int64) for p in self._parts]) if sizes else \
            np.zeros(0, np.int64)
        buf = transfer.upload(host, dev)
        out = []
        for part, kind in zip(torch.split(buf, sizes), self._kinds):
            out.append(part.view(torch.float64) if kind == "f" else part != 0 if kind == "b"
                       else part)
        return out


def segment_index(seg: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``starts[m] + 0 .. lengths[m] - 1`` for every segment m, concatenated (``total``
    elements), from the device copy of an :meth:`Uploads.segments` slot."""
    m = seg.numel() // 2
    return torch.arange(total, dtype=torch.int64, device=seg.device) + torch.repeat_interleave(
        seg[:m], seg[m:], output_size=total)


def _last_byte_bad(buf: torch.Tensor, at: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """bool per stream: a padding bit (``mask``) of the stream's last byte (``at``) is set."""
    return (buf.index_select(0, at).long() & mask) != 0


def _pad_slots(up: Uploads, start: np.ndarray, nbytes: np.ndarray, used_bits: np.ndarray):
    """Slots of (last byte, padding mask) of streams of ``nbytes`` bytes holding ``used_bits``."""
    pad = 8 * nbytes - used_bits
    at = np.where(nbytes > 0, start + nbytes - 1, 0)
    mask = np.where((nbytes > 0) & (pad > 0), (1 << np.clip(pad, 0, 8)) - 1, 0)
    return up.add(at), up.add(mask)


def _read_bits(buf: torch.Tensor, bit: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """int64 fields of ``width`` (0..31, per element) bits at bit offsets ``bit`` (MSB first)
    of ``buf``: a 40-bit big-endian window from five bytes (bytes past the end feed only bits
    the mask drops)."""
    last = buf.numel() - 1
    at = (bit >> 3).clamp(max=last)
    word = buf.index_select(0, at).long()
    for _ in range(4):
        at = (at + 1).clamp(max=last)
        word = (word << 8) | buf.index_select(0, at).long()
    return (word >> (40 - width - (bit & 7))) & ((1 << width) - 1)


@dataclass
class Decoded:
    """:func:`decode_messages`' result: message m's elements are ``[start[m], start[m + 1])``
    of ``pos`` (positions in its tensor, ascending) and ``value`` (float64 ``value * scale``);
    ``stats[m]`` its :class:`horovod_sbc.protocol.StreamStats`. A message whose positions were
    not decoded (its stream statistics already reject it) has no elements."""
    pos: torch.Tensor
    value: torch.Tensor
    start: np.ndarray
    stats: List[protocol.StreamStats]


class _Streams:
    """The position streams of a set of messages (host arrays, one entry per message)."""

    def __init__(self, msgs: Sequence[wire.TensorMessage]):
        self.count = np.array([m.count for m in msgs], np.int64)
        self.u0 = np.array([m.unary[0] for m in msgs], np.int64)
        self.ulen = np.array([m.unary[1] - m.unary[0] for m in msgs], np.int64)
        self.r0 = np.array([m.remainder[0] for m in msgs], np.int64)
        self.rlen = np.array([m.remainder[1] - m.remainder[0] for m in msgs], np.int64)
        self.b = np.array([m.rice_b for m in msgs], np.int64)
        self.ustart = np.concatenate([[0], np.cumsum(self.ulen)]).astype(np.int64)


def _unary(buf: torch.Tensor, s: _Streams, seg: torch.Tensor):
    """The unary streams gathered into one byte vector (``seg``: their segments' slot): (bytes,
    their popcounts, the popcounts' cumulative sum)."""
    popcount, _ = _tables(buf.device)
    ub = buf.index_select(0, segment_index(seg, int(s.ulen.sum())))
    pc = popcount.index_select(0, ub.long())
    return ub, pc, torch.cumsum(pc, 0)


class _Plan:
    """The host facts of one decode, uploaded as one buffer (:class:`Uploads`)."""

    def __init__(self, msgs: Sequence[wire.TensorMessage], scales: Sequence[float]):
        up = Uploads()
        self.streams = [i for i, m in enumerate(msgs) if m.count and not m.all_positions]
        self.signs = [i for i, m in enumerate(msgs) if m.count and m.has_signs]
        self.values = [i for i, m in enumerate(msgs) if m.count and m.has_values]
        self.alls = [i for i, m in enumerate(msgs) if m.count and m.all_positions]
        self.sent = [i for i, m in enumerate(msgs) if m.count]
        counts = np.array([m.count for m in msgs], np.int64)
        self.start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.k = int(self.start[-1])
        slots = {}
        self.s = s = _Streams([msgs[i] for i in self.streams]) if self.streams else None
        if s is not None:
            slots["useg"] = up.segments(s.u0, s.ulen)
            slots["ends"], slots["ustart"] = up.add(s.ustart[1:] - 1), up.add(s.ustart[:-1])
            slots["rem_at"], slots["rem_mask"] = _pad_slots(up, s.r0, s.rlen, s.count * s.b)
            self.seg_start = np.concatenate([[0], np.cumsum(s.count)]).astype(np.int64)
            slots["count"], slots["first"] = up.add(s.count), up.add(self.seg_start[:-1])
            slots["last"] = up.add(self.seg_start[1:] - 1)
            slots["b"], slots["r0"] = up.add(s.b), up.add(s.r0)
            if self.alls:  # places of the stream messages' elements among all elements
                slots["place"] = up.segments(self.start[self.streams], s.count)
        if self.alls:
            acnt = counts[self.alls]
            slots["all_place"] = up.segments(self.start[self.alls], acnt)
            slots["all_pos"] = up.segments(np.zeros_like(acnt), acnt)
            self.all_total = int(acnt.sum())
        if self.signs:
            slots["sign_at"], slots["sign_mask"] = _pad_slots(
                up, np.array([msgs[i].signs[0] for i in self.signs], np.int64),
                np.array([msgs[i].signs[1] - msgs[i].signs[0] for i in self.signs], np.int64),
                counts[self.signs])
        if self.values:
            vcnt = counts[self.values]
            slots["vseg"] = up.segments(np.array([msgs[i].values[0] for i in self.values],
                                                 np.int64), 4 * vcnt)
            slots["vcnt"] = up.add(vcnt)
            self.v_total = int(vcnt.sum())
        # each element's value: its message's float64 value x scale (the protocol's product),
        # negated by a SIGNS bit, or its own float32 x scale (VALUES)
        sent = self.sent
        slots["value"] = up.add(np.array([msgs[i].signed_value * scales[i] for i in sent],
                                         np.float64))
        slots["vcount"], slots["vstart"] = up.add(counts[sent]), up.add(self.start[sent])
        if self.signs:
            slots["s0"] = up.add([msgs[i].signs[0] for i in sent])
            slots["is_signs"] = up.add(np.array([msgs[i].has_signs for i in sent]))
        if self.values:
            slots["v0"] = up.add([msgs[i].values[0] for i in sent])
            slots["is_values"] = up.add(np.array([msgs[i].has_values for i in sent]))
            slots["scale"] = up.add(np.array([scales[i] for i in sent], np.float64))
        self._up, self._slots = up, slots

    def send(self, dev):
        dv = self._up.send(dev)
        return {k: dv[v] for k, v in self._slots.items()}


def _streams(buf: torch.Tensor, p: _Plan, d):
    """Steps 1, 2 and 4 for the stream messages: (per-message statistics [ones, last zero,
    remainder padding, max q, max r, last position] as one int64 [6, m] tensor, positions in
    message order). Element j of a message is the j-th one bit after its stream's start, found
    by a binary search of the running popcount, so a message whose one bits do not match its
    count (rejected on its own statistics) cannot shift any other message's elements."""
    dev = buf.device
    _, bit_of = _tables(dev)
    s = p.s
    m, k = s.count.size, int(s.count.sum())
    ub, pc, cs = _unary(buf, s, d["useg"])
    ends, ustart = d["ends"], d["ustart"]
    before = cs.index_select(0, ustart) - pc.index_select(0, ustart)  # ones before each stream
    ones = cs.index_select(0, ends) - before
    last_zero = ub.index_select(0, ends) == 0
    rem_bad = _last_byte_bad(buf, d["rem_at"], d["rem_mask"])
    seg = torch.repeat_interleave(torch.arange(m, device=dev), d["count"], output_size=k)
    first = d["first"]
    j = torch.arange(k, device=dev) - first.index_select(0, seg)
    target = before.index_select(0, seg) + j  # the global index of the element's one bit
    byte = torch.searchsorted(cs, target, right=True).clamp_(max=ub.numel() - 1)
    rank_in_byte = (target - (cs - pc).index_select(0, byte)).clamp_(0, 7)
    u = (byte - ustart.index_select(0, seg)) * 8 + bit_of.index_select(
        0, ub.index_select(0, byte).long() * 8 + rank_in_byte)
    b = d["b"].index_select(0, seg)
    q = torch.diff(u, prepend=u.new_full((1,), -1)) - 1
    q.index_copy_(0, first, u.index_select(0, first))
    off = 8 * d["r0"].index_select(0, seg) + j * b
    if int(s.b.max(initial=0)) <= 31:
        r = _read_bits(buf, off, b)
    else:  # fields above 31 bits are read in two halves
        hi = (b - 31).clamp(min=0)
        lo = b - hi
        r = (_read_bits(buf, off, hi) << lo) | _read_bits(buf, off + hi, lo)
    cr = torch.cumsum(r, 0)
    base = (cr - r).index_select(0, first)
    pos = ((u - j) << b) + (cr - base.index_select(0, seg)) + j
    mx = torch.zeros(2, m, dtype=torch.int64, device=dev)
    mx[0].scatter_reduce_(0, seg, q, "amax", include_self=False)
    mx[1].scatter_reduce_(0, seg, r, "amax", include_self=False)
    # within a message that lines up positions increase (each gap is >= 1): the last is the
    # largest
    rows = torch.stack([ones, last_zero.long(), rem_bad.long(), mx[0], mx[1],
                        pos.index_select(0, d["last"])])
    return rows, pos


def decode_messages(buf: torch.Tensor, msgs: Sequence[wire.TensorMessage],
                    scales: Sequence[float]) -> Decoded:
    """Decode ``msgs`` (headers parsed, offsets into ``buf``; ``scales[m]`` the scale of message
    m's values) together: see the module docstring."""
    dev = buf.device
    p = _Plan(msgs, scales)
    stats = [protocol.StreamStats() for _ in msgs]
    if not p.sent:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return Decoded(empty, empty.double(), p.start, stats)
    d = p.send(dev)
    parts, pos = [], None
    if p.streams:
        rows, pos = _streams(buf, p, d)
        parts.append(rows.view(-1))
    if p.alls:
        every = torch.zeros(p.k, dtype=torch.int64, device=dev)
        if pos is not None:
            every.index_copy_(0, segment_index(d["place"], pos.numel()), pos)
        every.index_copy_(0, segment_index(d["all_place"], p.all_total),
                          segment_index(d["all_pos"], p.all_total))
        pos = every
    if p.signs:
        parts.append(_last_byte_bad(buf, d["sign_at"], d["sign_mask"]).long())
    if p.values:
        raw = buf.index_select(0, segment_index(d["vseg"], 4 * p.v_total)).view(-1, 4).long()
        exp_bits = ((raw[:, 3] & 0x7F) << 1) | (raw[:, 2] >> 7)  # the float32 exponent
        owner = torch.repeat_interleave(torch.arange(len(p.values), device=dev), d["vcnt"],
                                        output_size=p.v_total)
        parts.append(torch.zeros(len(p.values), dtype=torch.int64, device=dev).index_add_(
            0, owner, (exp_bits == 0xFF).long()))
    value = _values(buf, p, d)
    row = torch.cat(parts).tolist() if parts else []  # the one host read
    ns = len(p.streams)
    for j, i in enumerate(p.streams):
        stats[i] = protocol.StreamStats(row[j], bool(row[ns + j]), row[3 * ns + j],
                                        row[4 * ns + j], bool(row[2 * ns + j]), row[5 * ns + j])
    at = 6 * ns
    for j, i in enumerate(p.signs):
        stats[i] = stats[i]._replace(sign_pad_nonzero=bool(row[at + j]))
    at += len(p.signs)
    for j, i in enumerate(p.values):
        stats[i] = stats[i]._replace(nonfinite=row[at + j])
    return Decoded(pos, value, p.start, stats)


def _values(buf: torch.Tensor, p: _Plan, d) -> torch.Tensor:
    """Step 3: float64 ``value * scale`` of every element (message order)."""
    dev = buf.device
    k = p.k
    seg = torch.repeat_interleave(torch.arange(len(p.sent), device=dev), d["vcount"],
                                  output_size=k)
    value = d["value"].index_select(0, seg)
    if not (p.signs or p.values):
        return value
    j = torch.arange(k, device=dev) - d["vstart"].index_select(0, seg)
    if p.signs:  # SIGNS: the bit j of the sign stream negates the value
        at = (d["s0"].index_select(0, seg) + (j >> 3)).clamp(max=buf.numel() - 1)
        bit = (buf.index_select(0, at).long() >> (7 - (j & 7))) & 1
        value = torch.where((bit == 1) & d["is_signs"].index_select(0, seg), -value, value)
    if p.values:  # VALUES: each element's own float32
        at = (d["v0"].index_select(0, seg) + 4 * j).clamp(max=buf.numel() - 4)
        raw = buf.index_select(0, (at[:, None] + torch.arange(4, device=dev)).view(-1))
        own = raw.view(-1, 4).contiguous().view(torch.float32).view(-1).to(torch.float64)
        value = torch.where(d["is_values"].index_select(0, seg),
                            own * d["scale"].index_select(0, seg), value)
    return value
