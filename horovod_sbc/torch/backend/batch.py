"""Every tensor message of a gathered step decoded at once, in tensor ops on the buffer's device.

:class:`~horovod_sbc.torch.backend.ops.OpsBackend` parses all headers on the host
(:func:`horovod_sbc.protocol.parse_gathered`: exact integers, compressed bytes only), then hands
every message of every rank (of one or of many gathered steps) to :func:`decode_messages`, which
decodes them with a fixed number of tensor ops, two uploads and two reads of O(messages)
integers, whatever the number of tensors, ranks and message kinds:

1. **statistics that need no positions** — one ``index_select`` gathers the unary streams of all
   messages with position streams; per message the number of one bits (byte popcounts, one
   cumsum), whether the last unary byte is zero, whether a remainder padding bit is set, and for
   SIGNS messages a sign padding bit, for VALUES messages the number of non-finite float32
   values (by bit pattern). **Host read 1.** A message whose one bits differ from its count is
   rejected by :func:`horovod_sbc.protocol.check_stream` on these alone (its positions are not
   decoded: they would not line up), so step 2 decodes only the others — the verdict stays
   exact for any input;
2. **positions** — each byte's ones expanded (``repeat_interleave`` by popcount) and located
   with a 256 x 8 table gives every one bit's offset ``u`` in its stream; quotients are the zero
   bits between one bits; remainders are read from a 40-bit window at each field's bit offset
   (in two halves above 31 bits, so any Rice parameter up to 62 is exact); positions by
   segmented cumulative sums, ``position = ((u - j) << b) + sum(r) + j`` for the j-th element.
   ALL messages hold positions ``0 .. count - 1``;
3. **values** — per element ``float64(value) * scale``: the message's value (binary), its sign
   bit applied (SIGNS), or its own float32 (VALUES), as :mod:`horovod_sbc.protocol` specifies;
4. per message the largest quotient, remainder and position (``scatter_reduce``). **Host read
   2**, for :func:`horovod_sbc.protocol.check_streams`.

The host facts each step needs (offsets, counts, the values times their scales) go to the device
as one buffer per step (:class:`Uploads`). Elements come out in message order, each message's
elements ascending; callers order the messages rank-major so that each rank's elements are one
slice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
import torch

from ... import protocol, wire

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
        _POPCOUNT[key] = torch.from_numpy(pc).to(dev)
        _BIT_OF[key] = torch.from_numpy(where.reshape(-1)).to(dev)
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
        buf = torch.from_numpy(host)
        if torch.device(dev).type != "cpu":
            buf = buf.to(dev)
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


def _phase1(buf: torch.Tensor, msgs, streams: List[int], signs: List[int], values: List[int]):
    """Step 1's device tensors, in the order ones / last zero / remainder padding (streams),
    sign padding (signs), non-finite counts (values); and the streams' gathered unary bytes."""
    dev = buf.device
    up = Uploads()
    if streams:
        s = _Streams([msgs[i] for i in streams])
        s_seg = up.segments(s.u0, s.ulen)
        s_ends, s_starts = up.add(s.ustart[1:] - 1), up.add(s.ustart[:-1])
        s_rem = _pad_slots(up, s.r0, s.rlen, s.count * s.b)
    if signs:
        cnt = np.array([msgs[i].count for i in signs], np.int64)
        s0 = np.array([msgs[i].signs[0] for i in signs], np.int64)
        sl = np.array([msgs[i].signs[1] - msgs[i].signs[0] for i in signs], np.int64)
        g_pad = _pad_slots(up, s0, sl, cnt)
    if values:
        vcnt = np.array([msgs[i].count for i in values], np.int64)
        v0 = np.array([msgs[i].values[0] for i in values], np.int64)
        v_seg, v_cnt = up.segments(v0, 4 * vcnt), up.add(vcnt)
    dv = up.send(dev)
    parts, unary = [], None
    if streams:
        unary = ub, pc, cs = _unary(buf, s, dv[s_seg])
        ends, starts = dv[s_ends], dv[s_starts]
        ones = cs.index_select(0, ends) - cs.index_select(0, starts) + pc.index_select(0, starts)
        last_zero = ub.index_select(0, ends) == 0
        rem_bad = _last_byte_bad(buf, dv[s_rem[0]], dv[s_rem[1]])
        parts += [ones, last_zero.long(), rem_bad.long()]
    if signs:
        parts.append(_last_byte_bad(buf, dv[g_pad[0]], dv[g_pad[1]]).long())
    if values:
        total = int(vcnt.sum())
        raw = buf.index_select(0, segment_index(dv[v_seg], 4 * total)).view(-1, 4).long()
        exp_bits = ((raw[:, 3] & 0x7F) << 1) | (raw[:, 2] >> 7)  # the float32 exponent
        owner = torch.repeat_interleave(torch.arange(len(values), device=dev), dv[v_cnt],
                                        output_size=total)
        parts.append(torch.zeros(len(values), dtype=torch.int64, device=dev).index_add_(
            0, owner, (exp_bits == 0xFF).long()))
    return parts, unary


class _Phase2:
    """Step 2's host facts for the decoded messages, uploaded as one buffer."""

    def __init__(self, msgs, decoded: List[int], in_streams: List[int], start: np.ndarray,
                 scales: Sequence[float], reuse: bool):
        up = Uploads()
        self.s = s = _Streams([msgs[i] for i in in_streams]) if in_streams else None
        if s is not None:
            self.seg_start = np.concatenate([[0], np.cumsum(s.count)]).astype(np.int64)
            self.slots = dict(count=up.add(s.count), ustart=up.add(s.ustart[:-1]),
                              first=up.add(self.seg_start[:-1]), b=up.add(s.b), r0=up.add(s.r0),
                              last=up.add(self.seg_start[1:] - 1))
            if not reuse:
                self.slots["useg"] = up.segments(s.u0, s.ulen)
        else:
            self.slots = {}
        counts = np.array([msgs[i].count for i in decoded], np.int64)
        self.alls = [i for i in decoded if msgs[i].all_positions]
        if self.alls and in_streams:
            self.slots["place"] = up.segments(start[in_streams], s.count)
        if self.alls:
            acnt = np.array([msgs[i].count for i in self.alls], np.int64)
            self.slots["all_place"] = up.segments(start[self.alls], acnt)
            self.slots["all_pos"] = up.segments(np.zeros_like(acnt), acnt)
        # values: one float64 per message (the protocol's product), then per-kind facts
        self.slots["value"] = up.add(np.array([msgs[i].signed_value * scales[i]
                                               for i in decoded], np.float64))
        self.slots["vcount"] = up.add(counts)
        self.has_signs = any(msgs[i].has_signs for i in decoded)
        self.has_values = any(msgs[i].has_values for i in decoded)
        if self.has_signs or self.has_values:
            self.slots["vstart"] = up.add(start[decoded])
        if self.has_signs:
            self.slots["s0"] = up.add([msgs[i].signs[0] for i in decoded])
            self.slots["is_signs"] = up.add(np.array([msgs[i].has_signs for i in decoded]))
        if self.has_values:
            self.slots["v0"] = up.add([msgs[i].values[0] for i in decoded])
            self.slots["is_values"] = up.add(np.array([msgs[i].has_values for i in decoded]))
            self.slots["scale"] = up.add(np.array([scales[i] for i in decoded], np.float64))
        self.up = up
        self.n_decoded = len(decoded)

    def send(self, dev):
        dv = self.up.send(dev)
        return {k: dv[v] for k, v in self.slots.items()}


def _positions(buf: torch.Tensor, p: _Phase2, d, unary):
    """Step 2 for the stream messages: (positions, q, r, element's message) in message
    order."""
    dev = buf.device
    _, bit_of = _tables(dev)
    s = p.s
    k = int(s.count.sum())
    ub, pc, cs = unary if unary is not None else _unary(buf, s, d["useg"])
    seg = torch.repeat_interleave(torch.arange(s.count.size, device=dev), d["count"],
                                  output_size=k)
    byte = torch.repeat_interleave(torch.arange(ub.numel(), device=dev), pc.long(),
                                   output_size=k)
    rank_in_byte = torch.arange(k, device=dev) - (cs - pc).index_select(0, byte)
    u = (byte - d["ustart"].index_select(0, seg)) * 8 + bit_of.index_select(
        0, ub.index_select(0, byte).long() * 8 + rank_in_byte)
    first = d["first"]
    j = torch.arange(k, device=dev) - first.index_select(0, seg)
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
    return pos, q, r, seg


def decode_messages(buf: torch.Tensor, msgs: Sequence[wire.TensorMessage],
                    scales: Sequence[float]) -> Decoded:
    """Decode ``msgs`` (headers parsed, offsets into ``buf``; ``scales[m]`` the scale of message
    m's values) together: see the module docstring."""
    dev = buf.device
    n = len(msgs)
    streams = [i for i, m in enumerate(msgs) if m.count and not m.all_positions]
    signs = [i for i, m in enumerate(msgs) if m.count and m.has_signs]
    values = [i for i, m in enumerate(msgs) if m.count and m.has_values]
    parts, unary = _phase1(buf, msgs, streams, signs, values)
    row = torch.cat(parts).tolist() if parts else []  # host read 1
    ns = len(streams)
    stats = [protocol.StreamStats() for _ in range(n)]
    for j, i in enumerate(streams):
        stats[i] = stats[i]._replace(ones=row[j], unary_last_zero=bool(row[ns + j]),
                                     rem_pad_nonzero=bool(row[2 * ns + j]))
    at = 3 * ns
    for j, i in enumerate(signs):
        stats[i] = stats[i]._replace(sign_pad_nonzero=bool(row[at + j]))
    at += len(signs)
    for j, i in enumerate(values):
        stats[i] = stats[i]._replace(nonfinite=row[at + j])
    # step 2: the messages whose positions line up (and the ALL messages)
    decoded = [i for i, m in enumerate(msgs) if m.count and
               (m.all_positions or stats[i].ones == m.count)]
    counts = np.array([msgs[i].count for i in decoded], np.int64)
    start = np.zeros(n + 1, np.int64)
    np.add.at(start, np.array(decoded, np.int64) + 1, counts)
    start = np.cumsum(start)
    k = int(counts.sum())
    if not decoded:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return Decoded(empty, empty.double(), start, stats)
    in_streams = [i for i in decoded if not msgs[i].all_positions]
    reuse = len(in_streams) == len(streams)  # every stream lines up: step 1's bytes serve
    p2 = _Phase2(msgs, decoded, in_streams, start, scales, reuse)
    d = p2.send(dev)
    maxima = None
    pos = torch.zeros(k, dtype=torch.int64, device=dev) if p2.alls or not in_streams else None
    if in_streams:
        ps, q, r, seg = _positions(buf, p2, d, unary if reuse else None)
        if pos is None:  # every decoded message has streams: in message order already
            pos = ps
        else:
            pos.index_copy_(0, segment_index(d["place"], int(p2.s.count.sum())), ps)
        mx = torch.zeros(len(in_streams), 2, dtype=torch.int64, device=dev)
        mx[:, 0].scatter_reduce_(0, seg, q, "amax", include_self=False)
        mx[:, 1].scatter_reduce_(0, seg, r, "amax", include_self=False)
        # positions increase within a message (each gap is >= 1): the last is the largest
        maxima = torch.cat([mx, ps.index_select(0, d["last"])[:, None]], 1)
    if p2.alls:
        total = int(sum(msgs[i].count for i in p2.alls))
        pos.index_copy_(0, segment_index(d["all_place"], total),
                        segment_index(d["all_pos"], total))
    value = _values(buf, p2, d, k)
    if maxima is not None:
        for i, (mq, mr, pm) in zip(in_streams, maxima.tolist()):  # host read 2
            stats[i] = stats[i]._replace(max_q=mq, max_r=mr, pos_max=pm)
    return Decoded(pos, value, start, stats)


def _values(buf: torch.Tensor, p: _Phase2, d, k: int) -> torch.Tensor:
    """Step 3: float64 ``value * scale`` of every decoded element (message order)."""
    dev = buf.device
    seg = torch.repeat_interleave(torch.arange(p.n_decoded, device=dev), d["vcount"],
                                  output_size=k)
    value = d["value"].index_select(0, seg)
    if not (p.has_signs or p.has_values):
        return value
    j = torch.arange(k, device=dev) - d["vstart"].index_select(0, seg)
    if p.has_signs:  # SIGNS: the bit j of the sign stream negates the value
        at = (d["s0"].index_select(0, seg) + (j >> 3)).clamp(max=buf.numel() - 1)
        bit = (buf.index_select(0, at).long() >> (7 - (j & 7))) & 1
        value = torch.where((bit == 1) & d["is_signs"].index_select(0, seg), -value, value)
    if p.has_values:  # VALUES: each element's own float32
        at = (d["v0"].index_select(0, seg) + 4 * j).clamp(max=buf.numel() - 4)
        raw = buf.index_select(0, (at[:, None] + torch.arange(4, device=dev)).view(-1))
        own = raw.view(-1, 4).contiguous().view(torch.float32).view(-1).to(torch.float64)
        value = torch.where(d["is_values"].index_select(0, seg),
                            own * d["scale"].index_select(0, seg), value)
    return value
