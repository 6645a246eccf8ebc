"""One encoder for every tensor of a sync: SBC's selection, means, binarization, Golomb-Rice
streams and residual update for all tensors at once, in a number of tensor ops and host reads
that does not grow with the number of tensors.

The bytes are those of :meth:`OpsBackend.encode_tensor <horovod_sbc.torch.backend.ops.OpsBackend.encode_tensor>` (mode ``"sbc"``, selection
``"paper"``), tensor by tensor, and so of the numpy reference (:mod:`horovod_sbc.reference`,
:mod:`horovod_sbc.wire`); the residual afterwards is the same too. The tensors' flat updates
lie in one float32 buffer, tensor ``i`` at ``[offsets[i], offsets[i+1])``; each tensor (a
*segment*) has two *groups*, its positive side ``2 i`` and its negative side ``2 i + 1``.

Per sync, everything segmented, nothing per tensor in Python:

1. **candidates** from a histogram of the top 12 magnitude bits per group, no sort of the
   tensor; **host read 1**: the per-group counts and non-finite counts;
2. **exact top-c** by one stable sort of the candidates (ties to the lower flat index);
3. **means** by the fixed-order float64 tree of :func:`horovod_sbc.reference.tree_sum_np`, every
   group at once;
4. **Rice parameter** from ``sum(gap >> b)`` tables; **host read 2**, then the host applies
   :func:`horovod_sbc.reference.choose_side` and :func:`horovod_sbc.wire.choose_rice_b` exactly
   as the per-tensor encoder does and builds every tensor header;
5. **streams** after **one upload** of the body and the per-tensor plan.

The same stages encode top-k with values (one group per tensor, no means) and STC (one group
per tensor; the mean magnitude over the top k, the zeros among them dropped from the streams,
one sign bit per position sent). The residual update (``a[pos] -= mu``) is
:meth:`FusedEncoding.commit`, one ``index_add_``, called
once the exchange succeeded. Each stage in full: docs/design.md#encoding-every-tensor-at-once.
"""
from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ... import crc, registry, wire
from ...reference import choose_side, keep_count
from .base import NonFiniteError
from .select import f32
from . import transfer

_BUCKET_BITS = 12
_NB = 1 << _BUCKET_BITS
_MAG_SHIFT = 31 - _BUCKET_BITS          # float32 magnitude bits (31) -> bucket
_NONFINITE_BUCKET = 0x7F800000 >> _MAG_SHIFT
_MAX_FUSED_B = 57                       # a field plus its bit offset fits a 64-bit window
_POS_SHIFT = 40                         # (group << 40) | position sort keys


@dataclass
class Layout:
    """Host facts of a set of flat tensors: element counts, offsets, k per tensor, and their
    device copies (built once per layout, density and device; see :func:`layout_for`)."""
    numels: Tuple[int, ...]
    offsets: Tuple[int, ...]
    ks: Tuple[int, ...]
    numel_dev: torch.Tensor     # int64 [m]
    k_dev: torch.Tensor         # int64 [m]
    total: int


_LAYOUTS: Dict[tuple, Layout] = {}


def layout_for(numels: Sequence[int], density: float, device) -> Layout:
    """The :class:`Layout` of ``numels`` at ``density`` on ``device`` (cached: its two small
    device tensors are uploaded once, not every sync)."""
    key = (tuple(int(n) for n in numels), float(density), str(device))
    lay = _LAYOUTS.get(key)
    if lay is None:
        ns = key[0]
        offs = [0]
        for n in ns:
            offs.append(offs[-1] + n)
        ks = tuple(keep_count(n, density) for n in ns)
        lay = _LAYOUTS[key] = Layout(ns, tuple(offs), ks,
                                     torch.tensor(ns, dtype=torch.int64, device=device),
                                     torch.tensor(ks, dtype=torch.int64, device=device), offs[-1])
    return lay


@dataclass
class FusedEncoding:
    """Every tensor's message and what to subtract from the residual once the sync succeeded.

    ``body``: the tensor messages back to back (uint8, on the device), tensor ``i`` at
    ``bounds[i]``; ``positions``: flat positions into the encoded buffer of every position sent
    (int64, tensor by tensor, ascending); ``values``: the value sent there (the tensor's signed
    mean); ``counts``/``means``/``negative``: per tensor, on the host."""
    flat: torch.Tensor
    body: torch.Tensor
    bounds: List[Tuple[int, int]]
    positions: torch.Tensor
    values: torch.Tensor
    counts: List[int]
    means: List[float]
    negative: List[bool]
    step: Optional[torch.Tensor] = None   # the header bytes given, then ``body``, contiguous

    def message(self, i: int) -> torch.Tensor:
        lo, hi = self.bounds[i]
        return self.body[lo:hi]

    def commit(self) -> None:
        """Error feedback: ``flat[positions] -= values`` (positions are unique)."""
        if self.positions.numel():
            self.flat.index_add_(0, self.positions, self.values, alpha=-1)


def compact(mask: torch.Tensor, size: int) -> torch.Tensor:
    """int64 indices of the ``size`` True entries of 1-D ``mask``, ascending, when the host
    knows ``size`` (``torch.nonzero`` would read it from the device): each True entry
    scattered to its rank among them; the False ones to a spare slot that is dropped."""
    rank = torch.cumsum(mask, 0) - 1
    out = torch.empty(size + 1, dtype=torch.int64, device=mask.device)
    dest = torch.where(mask, rank, size)
    out.scatter_(0, dest, torch.arange(mask.numel(), device=mask.device))
    return out[:size]


def _seg_ids(lay: Layout, dev) -> torch.Tensor:
    """int64 [total]: the tensor each element belongs to."""
    m = len(lay.numels)
    return torch.repeat_interleave(torch.arange(m, device=dev), lay.numel_dev,
                                   output_size=lay.total)


def _candidates(flat: torch.Tensor, lay: Layout, names: Optional[Sequence[str]], sides: int = 2):
    """Step 1: (candidate flat indices ascending, their group ids, their magnitude bits, c per
    group on the device, c per group on the host). ``sides`` 2: the paper's groups (positive,
    negative; zeros in neither); 1: one group of all entries per tensor (by magnitude, zeros
    too: the top-k values mode)."""
    dev = flat.device
    m = len(lay.numels)
    n_groups = sides * m
    mag = flat.view(torch.int32) & 0x7FFFFFFF
    seg = _seg_ids(lay, dev)
    grp = seg * 2 + (flat < 0) if sides == 2 else seg
    bucket = mag >> _MAG_SHIFT
    counted = flat != 0 if sides == 2 else torch.ones_like(flat, dtype=torch.bool)
    hist = torch.zeros(n_groups * _NB, dtype=torch.int64, device=dev)
    hist.index_add_(0, grp * _NB + bucket, counted.to(torch.int64))
    hist = hist.view(n_groups, _NB)
    # from the top: cum[g, b] = entries of group g in bucket b or above
    cum = hist.flip(1).cumsum(1).flip(1)
    n_side = cum[:, 0]
    nonfinite = cum[:, _NONFINITE_BUCKET]
    c = torch.minimum(n_side, lay.k_dev.repeat_interleave(sides))
    beta = (cum >= c[:, None]).sum(1) - 1  # highest bucket whose cumulative count reaches c
    beta = torch.where(c > 0, beta, torch.full_like(beta, _NB))
    n_cand = torch.where(c > 0, cum.gather(1, beta.clamp(max=_NB - 1)[:, None])[:, 0], 0)
    row = torch.cat([n_side, nonfinite, n_cand]).tolist()  # host read 1
    nf = row[n_groups:2 * n_groups]
    bad = next((g // sides for g in range(n_groups) if nf[g]), None)
    if bad is not None:
        name = names[bad] if names is not None else f"tensor {bad}"
        raise NonFiniteError(f"the update of {name!r} contains NaN or Inf")
    c_host = [min(n, lay.ks[g // sides]) for g, n in enumerate(row[:n_groups])]
    keep = (bucket >= beta.gather(0, grp)) & counted
    cidx = compact(keep, sum(row[2 * n_groups:]))
    return cidx, grp.gather(0, cidx), mag.gather(0, cidx), c, c_host


def _select(cidx, cgrp, cmag, c, c_host, lay: Layout):
    """Step 2: (flat positions, group ids) of the c largest magnitudes of every group, sorted by
    (group, position); ties at the c-th value to the lower position."""
    dev = cidx.device
    s = sum(c_host)
    key = (cgrp << 31) | (0x7FFFFFFF - cmag)
    order = torch.sort(key, stable=True).indices
    g_sorted = cgrp.gather(0, order)
    n_cand = torch.zeros(c.numel(), dtype=torch.int64, device=dev).index_add_(
        0, cgrp, torch.ones_like(cgrp))
    start = torch.cumsum(n_cand, 0) - n_cand
    rank = torch.arange(order.numel(), device=dev) - start.gather(0, g_sorted)
    kept = order.gather(0, compact(rank < c.gather(0, g_sorted), s))
    pos_key = torch.sort((cgrp.gather(0, kept) << _POS_SHIFT) | cidx.gather(0, kept)).values
    return pos_key & ((1 << _POS_SHIFT) - 1), pos_key >> _POS_SHIFT


def _next_pow2(c: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= c, elementwise (int64; 0 for 0)."""
    v = c - 1
    for s in (1, 2, 4, 8, 16, 32):
        v = v | (v >> s)
    return v + 1


def _tree_sums(vals: torch.Tensor, gsel: torch.Tensor, c: torch.Tensor, c_host: List[int]
               ) -> torch.Tensor:
    """Step 3: float64 [groups]: :func:`horovod_sbc.reference.tree_sum_np` of each group's values
    (``vals`` in (group, position) order), all groups level by level."""
    dev = vals.device
    n_groups = c.numel()
    w = _next_pow2(c)
    w_host = [1 << (n - 1).bit_length() if n else 0 for n in c_host]
    size = sum(w_host)
    slot0 = torch.cumsum(w, 0) - w
    cstart = torch.cumsum(c, 0) - c
    x = torch.zeros(size + 1, dtype=torch.float64, device=dev)
    rank = torch.arange(vals.numel(), device=dev) - cstart.gather(0, gsel)
    x.index_copy_(0, slot0.gather(0, gsel) + rank, vals)
    g_slot = torch.repeat_interleave(torch.arange(n_groups, device=dev), w, output_size=size)
    e = torch.arange(size, device=dev)
    j = e - slot0.gather(0, g_slot)
    w_slot = w.gather(0, g_slot)
    zero = torch.full_like(e, size)  # x[size] stays 0: inactive slots add an exact zero
    for level in range(max(w_host + [1]).bit_length() - 1):
        h = w_slot >> (level + 1)
        src = torch.where(j < h, e + h, zero)
        x = torch.cat([x[:size] + x.gather(0, src), x[size:]])
    return torch.where(c > 0, x.gather(0, slot0.clamp(max=size)), 0.0)


def _rice_range(c_host: List[int], lay: Layout, sides: int = 2) -> Tuple[int, int]:
    """The b that :func:`horovod_sbc.wire.choose_rice_b` may consider for any group."""
    bs = []
    for g, cnt in enumerate(c_host):
        if cnt:
            b0 = wire.rice_parameter(cnt / lay.numels[g // sides])
            bs += [b for b in (b0 - 1, b0, b0 + 1) if 0 <= b <= wire.MAX_RICE_B]
    return (min(bs), max(bs)) if bs else (0, 0)


def _gaps(pos: torch.Tensor, gsel: torch.Tensor, lay: Layout, sides: int = 2,
          keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gaps ``p_i - p_{i-1} - 1`` of each group's local positions (``p_{-1} = -1``); with
    ``keep``, of the kept positions only (``p_{i-1}`` the group's previous kept one; the gaps
    of the others mean nothing)."""
    seg = gsel // sides
    start = torch.cumsum(lay.numel_dev, 0) - lay.numel_dev
    local = pos - start.gather(0, seg)
    if keep is not None:  # the last kept local position before each entry, by a running max
        base = gsel << _POS_SHIFT
        mark = torch.cummax(base + torch.where(keep, local + 1, 0), 0).values
        before = torch.cat([mark.new_zeros(1), mark[:-1]])
        return local - (before - base).clamp(min=0)
    prev = torch.cat([local.new_full((1,), -1), local[:-1]])
    same = torch.cat([gsel.new_zeros(1, dtype=torch.bool), gsel[1:] == gsel[:-1]])
    return local - torch.where(same, prev, -1) - 1


def _stats(vals, pos, gsel, c, c_host, lay: Layout, sides: int = 2,
           keep: Optional[torch.Tensor] = None):
    """Steps 3 and 4 and host read 2: (sums per group, or () without ``vals``; {group: {b:
    sum(gap >> b)}}; gaps; kept count per group, or None). With ``keep`` the tables count the
    kept positions only, and any b their count could ask for."""
    sums = _tree_sums(vals, gsel, c, c_host) if vals is not None else c[:0].double()
    gaps = _gaps(pos, gsel, lay, sides, keep)
    lo, hi = _rice_range(c_host, lay, sides)
    if keep is not None:  # fewer kept than selected: a sparser tensor, a larger b
        hi = max([hi] + [min(wire.rice_parameter(1 / lay.numels[g // sides]) + 1,
                             wire.MAX_RICE_B) for g, n in enumerate(c_host) if n])
    shifts = torch.arange(lo, hi + 1, device=pos.device)
    table = torch.zeros(c.numel(), hi - lo + 1, dtype=torch.int64, device=pos.device)
    shifted = gaps[:, None] >> shifts[None, :]
    table.index_add_(0, gsel, shifted if keep is None else shifted * keep[:, None])
    parts = [sums.view(torch.int64), table.view(-1)]
    if keep is not None:  # the kept count per group, read with the tables
        parts.insert(1, torch.zeros_like(c).index_add_(0, gsel, keep.long()))
    row = torch.cat(parts).tolist()  # host read 2
    n_sums, n_groups = sums.numel(), c.numel()
    nk = 0 if keep is None else n_groups
    sums_host = struct.unpack(f"<{n_sums}d", struct.pack(f"<{n_sums}q", *row[:n_sums]))
    width = hi - lo + 1
    at = n_sums + nk
    tables = {g: {lo + i: row[at + g * width + i] for i in range(width)}
              for g in range(n_groups) if c_host[g]}
    return sums_host, tables, gaps, (row[n_sums:at] if keep is not None else None)


@dataclass
class _Plan:
    """The host's verdicts for every tensor (step 4), ready to upload."""
    group_flag: List[int]       # per group: 1 if it is its tensor's side sent
    b: List[int]
    unary_bit: List[int]        # bit offset of each tensor's unary stream in the body
    rem_bit: List[int]
    start: List[int]            # index of each tensor's first sent position among all sent
    signed: List[float]         # the value sent (-mu for the negative side)
    template: bytearray         # the body: headers in place, streams zero
    bounds: List[Tuple[int, int]]
    counts: List[int]
    means: List[float]
    negative: List[bool]
    streams: List[int]          # 1: position streams to write; 0: ALL (values only) or none
    value_byte: List[int]       # byte offset of the float32 values (values mode)

    @classmethod
    def empty(cls, m: int, n_groups: int) -> "_Plan":
        return cls([0] * n_groups, [0] * m, [0] * m, [0] * m, [0] * m, [0.0] * m, bytearray(),
                   [], [0] * m, [0.0] * m, [False] * m, [1] * m, [0] * m)


def _rice(i: int, count: int, numel: int, table: Dict[int, int]) -> Tuple[int, int, int]:
    """Tensor ``i``'s Rice parameter (:func:`horovod_sbc.wire.choose_rice_b` on its ``{b:
    sum(gap >> b)}`` table) and its unary and remainder streams' byte lengths."""
    b = wire.choose_rice_b(count, numel, table.__getitem__)
    if b > _MAX_FUSED_B:
        raise ValueError(f"SBC: tensor {i} needs Rice parameter {b} > {_MAX_FUSED_B}, "
                         "beyond the fused encoder")
    return b, -(-(table[b] + count) // 8), -(-(count * b) // 8)


def _plan(c_host, sums, tables, lay: Layout) -> _Plan:
    """Binarization and Rice parameter per tensor, exactly as the per-tensor encoder decides
    (:func:`horovod_sbc.reference.choose_side`, :func:`horovod_sbc.wire.choose_rice_b`), and every
    tensor header."""
    m = len(lay.numels)
    p = _Plan.empty(m, 2 * m)
    sent = 0
    for i, numel in enumerate(lay.numels):
        np_, nn_ = c_host[2 * i], c_host[2 * i + 1]
        side, mu = choose_side(f32(sums[2 * i] / np_) if np_ else 0.0,
                               f32(sums[2 * i + 1] / nn_) if nn_ else 0.0)
        at = len(p.template)
        p.start[i] = sent
        if side == 0:
            p.template += wire.tensor_header(numel, 0, 0, 0, 0.0, False)
            p.bounds.append((at, len(p.template)))
            continue
        g = 2 * i + (side < 0)
        count = c_host[g]
        b, ubytes, rbytes = _rice(i, count, numel, tables[g])
        head = wire.tensor_header(numel, count, b, ubytes, mu, side < 0)
        p.template += head + bytes(ubytes + rbytes)
        p.bounds.append((at, len(p.template)))
        p.group_flag[g] = 1
        p.b[i], p.counts[i], p.means[i], p.negative[i] = b, count, mu, side < 0
        p.unary_bit[i] = 8 * (at + len(head))
        p.rem_bit[i] = 8 * (at + len(head) + ubytes)
        p.signed[i] = -mu if side < 0 else mu
        sent += count
    return p


def _plan_values(c_host, tables, lay: Layout) -> _Plan:
    """Per tensor: top-k positions with their float32 values (flag VALUES; ALL when k = numel),
    the headers as :func:`horovod_sbc.torch.backend.streams.encode_positions` writes them."""
    m = len(lay.numels)
    p = _Plan.empty(m, m)
    sent = 0
    for i, numel in enumerate(lay.numels):
        count = c_host[i]
        at = len(p.template)
        p.start[i] = sent
        if count == 0:
            p.template += wire.tensor_header(numel, 0, 0, 0, 0.0, False)
            p.bounds.append((at, len(p.template)))
            p.streams[i] = 0
            continue
        if count == numel:
            head = wire.tensor_header(numel, numel, 0, 0, 0.0, False, True, False, True)
            ubytes = rbytes = b = 0
            p.streams[i] = 0
        else:
            b, ubytes, rbytes = _rice(i, count, numel, tables[i])
            head = wire.tensor_header(numel, count, b, ubytes, 0.0, False, True)
        p.template += head + bytes(ubytes + rbytes + 4 * count)
        p.bounds.append((at, len(p.template)))
        p.group_flag[i] = 1
        p.b[i], p.counts[i] = b, count
        p.unary_bit[i] = 8 * (at + len(head))
        p.rem_bit[i] = 8 * (at + len(head) + ubytes)
        p.value_byte[i] = at + len(head) + ubytes + rbytes
        sent += count
    return p


def _plan_ternary(counts, sums, tables, lay: Layout) -> _Plan:
    """Per tensor: the kept positions (``counts``), one sign bit each and their mean magnitude
    ``float32(sums / count)`` (flag SIGNS; nothing when it rounds to 0), the headers as
    :func:`horovod_sbc.torch.backend.streams.encode_positions` writes them."""
    m = len(lay.numels)
    p = _Plan.empty(m, m)
    sent = 0
    for i, numel in enumerate(lay.numels):
        count = counts[i]
        mu = f32(sums[i] / count) if count else 0.0
        at = len(p.template)
        p.start[i] = sent
        if mu == 0.0:  # nothing kept, or subnormal magnitudes whose mean rounds to 0
            p.template += wire.tensor_header(numel, 0, 0, 0, 0.0, False)
            p.bounds.append((at, len(p.template)))
            continue
        b, ubytes, rbytes = _rice(i, count, numel, tables[i])
        head = wire.tensor_header(numel, count, b, ubytes, mu, False, False, True)
        p.template += head + bytes(ubytes + rbytes + -(-count // 8))
        p.bounds.append((at, len(p.template)))
        p.group_flag[i] = 1
        p.b[i], p.counts[i], p.means[i], p.signed[i] = b, count, mu, mu
        p.unary_bit[i] = 8 * (at + len(head))
        p.rem_bit[i] = 8 * (at + len(head) + ubytes)
        p.value_byte[i] = at + len(head) + ubytes + rbytes  # the sign stream
        sent += count
    return p


def _upload(p: _Plan, dev, head: bytes = b"") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One host-to-device copy: (the int64 plan: group flags, then per tensor b, unary and
    remainder bit offsets, first index, streams flag, values offset, and the signed value as
    float64; the body template with 8 spare zero bytes for the remainder window; ``head`` and
    the body after it, contiguous)."""
    m = len(p.b)
    ints = p.group_flag + p.b + p.unary_bit + p.rem_bit + p.start + p.streams + p.value_byte
    raw = struct.pack(f"<{len(ints)}q{m}d", *ints, *p.signed) + head + bytes(p.template) + \
        bytes(8)
    buf = transfer.upload(raw, dev)
    at = 8 * (len(ints) + m)
    whole = buf[at:at + len(head) + len(p.template)]
    return buf[:at].view(torch.int64), buf[at + len(head):], whole


def _streams(body: torch.Tensor, plan_dev: torch.Tensor, p: _Plan, pos, gsel, gaps,
             sides: int = 2, keep: Optional[torch.Tensor] = None):
    """Step 5: write every sent tensor's unary and remainder streams into ``body``; returns
    (flat positions sent, tensor of each, index of each within its tensor). ``keep``: only
    those of the selected positions are sent."""
    m = len(p.b)
    n_groups = len(p.group_flag)
    dev = body.device
    gflag = plan_dev[:n_groups]
    b_t, ubit, rbit, start, streams = (plan_dev[n_groups + r * m:n_groups + (r + 1) * m]
                                       for r in range(5))
    n_sent = sum(p.counts)
    sending = gflag.gather(0, gsel) != 0
    take = compact(sending if keep is None else sending & keep, n_sent)
    wpos, t = pos.gather(0, take), gsel.gather(0, take) // sides
    gap = gaps.gather(0, take)
    b = b_t.gather(0, t)
    q1 = (gap >> b) + 1
    cs = torch.cumsum(q1, 0)
    first = start.gather(0, t)
    before = (cs - q1).gather(0, first)  # the cumulative sum where the tensor's stream starts
    bit = ubit.gather(0, t) + (cs - before) - 1
    on = streams.gather(0, t) != 0  # ALL messages have no position streams
    body.index_add_(0, torch.where(on, bit >> 3, 0),
                    torch.where(on, 128 >> (bit & 7), 0).to(torch.uint8))
    j = torch.arange(n_sent, device=dev) - first
    off = rbit.gather(0, t) + j * b
    r = gap & ((1 << b) - 1)
    word = r << (64 - b - (off & 7)).clamp(max=63)
    at = off >> 3
    for k in range((7 + max(p.b + [0]) + 7) // 8):
        body.index_add_(0, at + k, ((word >> (56 - 8 * k)) & 255).to(torch.uint8))
    return wpos, t, j


def encode_fused(flat: torch.Tensor, numels: Sequence[int], density: float,
                 names: Optional[Sequence[str]] = None, mode: str = "sbc",
                 step_header=None) -> FusedEncoding:
    """Messages of every tensor of ``flat`` (float32, contiguous; tensor ``i`` the
    ``numels[i]`` elements after the previous ones), byte for byte those of
    :meth:`OpsBackend.encode_tensor <horovod_sbc.torch.backend.ops.OpsBackend.encode_tensor>` per tensor
    of a ``fused`` compressor: ``"sbc"`` (selection ``"paper"``, ``sides`` 2), ``"values"``
    (top-k by magnitude with float32 values, ``sides`` 1) or ``"stc"`` (the non-zero among the
    top k by magnitude, a sign bit each and their mean magnitude). ``flat`` is not
    changed; :meth:`FusedEncoding.commit` applies the error feedback. Raises
    :class:`~horovod_sbc.torch.backend.base.NonFiniteError` naming the first tensor with NaN/Inf
    (``names``, else its index). ``step_header(body bytes)``, if given, returns the bytes to
    put right before the body in the same upload (a step header; see
    :attr:`FusedEncoding.step`). Two host reads and one upload, whatever the number of
    tensors."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("encode_fused needs a contiguous 1-D float32 buffer, got "
                         f"{flat.dtype} of shape {tuple(flat.shape)}")
    comp = registry.get(mode)
    if not comp.fused:
        fused = [m for m in registry.names() if registry.get(m).fused]
        raise ValueError(f"encode_fused: mode must be one the fused codec encodes {fused}, "
                         f"got {mode!r}")
    lay = layout_for(numels, density, flat.device)
    if lay.total != flat.numel():
        raise ValueError(f"encode_fused: the layout has {lay.total} elements, the buffer "
                         f"{flat.numel()}")
    sides = comp.sides  # 2: SBC's binarized sides (the paper's selection); 1: top-k values
    cidx, cgrp, cmag, c, c_host = _candidates(flat, lay, names, sides)
    pos, gsel = _select(cidx, cgrp, cmag, c, c_host, lay)
    vals = flat.gather(0, pos)
    ternary = comp.message is registry.Message.SIGNS
    keep = vals != 0 if ternary else None
    if sides == 2:
        v64 = vals.to(torch.float64)
        sums, tables, gaps, _ = _stats(torch.where((gsel & 1) == 1, -v64, v64), pos, gsel, c,
                                       c_host, lay)
        p = _plan(c_host, sums, tables, lay)
    elif ternary:  # the mean magnitude over the top k (its zeros add nothing), the rest kept
        sums, tables, gaps, kept = _stats(vals.abs().to(torch.float64), pos, gsel, c, c_host,
                                          lay, 1, keep)
        p = _plan_ternary(kept, sums, tables, lay)
    else:
        _, tables, gaps, _ = _stats(None, pos, gsel, c, c_host, lay, 1)
        p = _plan_values(c_host, tables, lay)
    head = b"" if step_header is None else step_header(len(p.template))
    plan_dev, body, whole = _upload(p, flat.device, head)
    wpos, t, j = _streams(body, plan_dev, p, pos, gsel, gaps, sides, keep)
    m, g0 = len(lay.numels), len(p.group_flag)  # the plan's rows: see _upload
    if sides == 2 or ternary:
        sent = plan_dev[g0 + 6 * m:g0 + 7 * m].view(torch.float64).gather(0, t).to(
            torch.float32)
    if ternary:  # one sign bit per position sent, 1 meaning negative
        neg = flat.gather(0, wpos) < 0
        bit = 8 * plan_dev[g0 + 5 * m:g0 + 6 * m].gather(0, t) + j
        body.index_add_(0, bit >> 3, torch.where(neg, 128 >> (bit & 7), 0).to(torch.uint8))
        sent = torch.where(neg, -sent, sent)
    elif sides == 1:
        sent = vals  # every entry of a values tensor is sent
        vbyte = plan_dev[g0 + 5 * m:g0 + 6 * m].gather(0, t) + 4 * j
        dest = (vbyte[:, None] + torch.arange(4, device=flat.device)).view(-1)
        body.index_copy_(0, dest, sent.contiguous().view(torch.uint8))
    size = len(p.template)
    return FusedEncoding(flat, body[:size], p.bounds, wpos, sent, p.counts, p.means,
                         p.negative, whole if head else None)


# ----------------------------------------------------------------------------------------------
# fixed-size messages: CRC-32 and a whole step message without a host read
# ----------------------------------------------------------------------------------------------
_CRC_TABLES: Dict[str, tuple] = {}


def _crc_tables(n_chunks: int, dev) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`horovod_sbc.crc.chunk_table` and the last ``n_chunks`` chunks' rows of
    :func:`horovod_sbc.crc.shift_table` on ``dev`` (uploaded once, grown by doubling)."""
    key = str(dev)
    have = _CRC_TABLES.get(key)
    if have is not None and have[2] >= n_chunks:
        return have[0], have[1][(have[2] - n_chunks) * 32:]
    c_max = max(n_chunks, 2 * (have[2] if have else 1))
    tables = (transfer.upload(crc.chunk_table(), dev),
              transfer.upload(crc.shift_table(c_max), dev), c_max)
    _CRC_TABLES[key] = tables
    return tables[0], tables[1][(c_max - n_chunks) * 32:]


def crc32_device(data: torch.Tensor) -> torch.Tensor:
    """zlib's CRC-32 of 1-D uint8 ``data`` as a 0-d int64 tensor on its device, in a fixed
    number of tensor ops and no host read (two matrix products of 0/1 floats, whose sums stay
    exact below 2**24; leading zero bytes add nothing to the linear part)."""
    n = data.numel()
    n_chunks = max(1, -(-n // crc.CHUNK))
    first, second = _crc_tables(n_chunks, data.device)
    pad = n_chunks * crc.CHUNK - n
    x = torch.cat([data.new_zeros(pad), data]) if pad else data
    lin = (_chunk_crcs(x, n_chunks, first).view(1, -1) @ second).view(32)
    return _crc_words(lin) ^ _zero_crc(n)


def _chunk_crcs(x: torch.Tensor, n_chunks: int, first: torch.Tensor) -> torch.Tensor:
    """float ``[n_chunks, 32]``: the linear CRC bits of each ``crc.CHUNK``-byte chunk of
    ``x`` (0/1 floats: one matrix product of the chunks' bits, taken mod 2)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    bits = ((x.view(n_chunks, crc.CHUNK, 1) >> shifts) & 1).view(n_chunks, -1).float()
    return torch.remainder(bits @ first, 2.0)


def _crc_words(lin: torch.Tensor) -> torch.Tensor:
    """int64 ``lin.shape[:-1]``: each last-axis row of 32 summed CRC bits (float, taken mod
    2) as a word."""
    weights = torch.ones(32, dtype=torch.int64, device=lin.device) << torch.arange(
        32, device=lin.device)
    return (torch.remainder(lin, 2.0).long() * weights).sum(-1)


@functools.lru_cache(maxsize=4096)
def _zero_crc(n: int) -> int:
    """CRC-32 of ``n`` zero bytes: the affine part of every ``n``-byte message's CRC."""
    return zlib.crc32(bytes(n)) & 0xFFFFFFFF


_HEADS: Dict[tuple, torch.Tensor] = {}


def frame_device(body: torch.Tensor, layout_crc: int, n_tensors: int, padded: bool = False,
                 origin: int = 0, flags: int = 0) -> torch.Tensor:
    """The step message around ``body`` (uint8 on its device; ``padded``: content and zero
    padding, flag PADDED) with no host read: the first 20 header bytes are uploaded once per
    (length, layout, device), the CRC is :func:`crc32_device`."""
    flags |= wire.STEP_FLAG_PADDED if padded else 0
    key = (body.numel(), layout_crc, n_tensors, origin, flags, str(body.device))
    head = _HEADS.get(key)
    if head is None:
        raw = wire.STEP_HEADER.pack(wire.STEP_MAGIC, wire.VERSION, flags, origin, body.numel(),
                                    layout_crc, n_tensors, 0)[:20]
        head = _HEADS[key] = transfer.upload(raw, body.device)
    return torch.cat([head, crc_bytes(body), body])


def frame_segments(body: torch.Tensor, lens: Sequence[int], layout_crcs: Sequence[int],
                   n_tensors: Sequence[int]) -> torch.Tensor:
    """Step messages of the consecutive slices of ``body`` (uint8 on its device; slice ``s``
    the ``lens[s]`` bytes after the previous ones, under ``layout_crcs[s]`` with
    ``n_tensors[s]`` tensor messages) back to back, with no host read: the reduce-scatter's
    parts of one encoded sync, one per region. The headers, the slices' offsets and the CRCs'
    plan come in one upload, the CRCs are :func:`crc32_segments`: a fixed number of tensor ops
    whatever the number of slices."""
    n, size = len(lens), body.numel()
    if sum(lens) != size:
        raise AssertionError(f"horovod_sbc: slices of {sum(lens)} bytes framing a body of "
                             f"{size}")
    dev, hs = body.device, wire.STEP_HEADER_SIZE
    heads = b"".join(wire.STEP_HEADER.pack(wire.STEP_MAGIC, wire.VERSION, 0, 0, ln, fp, nt, 0)
                     for ln, fp, nt in zip(lens, layout_crcs, n_tensors))
    starts = np.concatenate([[0], np.cumsum(lens[:-1], dtype=np.int64)]) if n else \
        np.zeros(0, np.int64)
    crc_plan = _segments_plan(lens)
    up = transfer.upload(np.concatenate([np.frombuffer(heads, np.int64),  # 3 words a header
                                         starts + hs * np.arange(n), crc_plan[0]]), dev)
    head = up[:3 * n].view(torch.uint8).view(n, hs).clone()
    seg = torch.repeat_interleave(torch.arange(n, device=dev), up[4 * n:5 * n],
                                  output_size=size)  # the CRC plan begins with the lengths
    crcs = _crc32_segments(body, lens, crc_plan, up[4 * n:], seg)
    head[:, 20:24] = ((crcs[:, None] >> (8 * torch.arange(4, device=dev))) & 255).to(torch.uint8)
    out = torch.empty(size + hs * n, dtype=torch.uint8, device=dev)
    out.index_copy_(0, (up[3 * n:4 * n, None] + torch.arange(hs, device=dev)).view(-1),
                    head.view(-1))
    out.index_copy_(0, torch.arange(size, device=dev) + hs * (seg + 1), body)
    return out


def crc32_segments(data: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
    """zlib's CRC-32 of each consecutive slice of 1-D uint8 ``data`` (slice ``s``: ``lens[s]``
    bytes) as int64 ``[len(lens)]`` on its device: :func:`crc32_device` of every slice at once
    (each front padded to whole chunks, every chunk moved past the chunks after it in its own
    slice), in a fixed number of tensor ops, one upload and no host read."""
    dev, n = data.device, len(lens)
    plan = _segments_plan(lens)
    up = transfer.upload(plan[0], dev)
    seg = torch.repeat_interleave(torch.arange(n, device=dev), up[:n], output_size=data.numel())
    return _crc32_segments(data, lens, plan, up, seg)


def _segments_plan(lens: Sequence[int]) -> Tuple[np.ndarray, int, int]:
    """The host side of :func:`crc32_segments`: its plan to upload (per slice its length, its
    bytes' shift to their padded place and the CRC of that many zero bytes; per chunk its
    slice and its shift block), the total number of chunks and the shift table's chunks."""
    chunks = [max(1, -(-ln // crc.CHUNK)) for ln in lens]
    c_max = max(chunks, default=1)  # the shift table's rows :func:`_crc_tables` gives
    shift, seg_of_chunk, block, lo, c0 = [], [], [], 0, 0
    for s, (ln, c) in enumerate(zip(lens, chunks)):
        shift.append(c0 * crc.CHUNK + (c * crc.CHUNK - ln) - lo)  # byte -> its padded place
        seg_of_chunk += [s] * c
        block += range(c_max - c, c_max)  # chunk k of c: moved past the c - 1 - k after it
        lo, c0 = lo + ln, c0 + c
    plan = np.array([*lens, *shift, *(_zero_crc(ln) for ln in lens), *seg_of_chunk, *block],
                    np.int64)
    return plan, sum(chunks), c_max


def _crc32_segments(data: torch.Tensor, lens: Sequence[int], plan, up: torch.Tensor,
                    seg: torch.Tensor) -> torch.Tensor:
    """:func:`crc32_segments` on the device: ``plan`` from :func:`_segments_plan`, ``up`` its
    array uploaded, ``seg`` the slice of every byte (int64 on the device)."""
    dev, n, size = data.device, len(lens), data.numel()
    _, total, c_max = plan
    first, second = _crc_tables(c_max, dev)
    x = torch.zeros(total * crc.CHUNK, dtype=torch.uint8, device=dev)
    if size:
        x.index_copy_(0, torch.arange(size, device=dev) + up[n:2 * n].gather(0, seg), data)
    moved = torch.bmm(_chunk_crcs(x, total, first)[:, None, :], second.view(
        c_max, 32, 32).index_select(0, up[3 * n + total:]))[:, 0]
    lin = torch.zeros(n, 32, device=dev).index_add_(0, up[3 * n:3 * n + total], moved)
    return _crc_words(lin) ^ up[2 * n:3 * n]


def crc_bytes(body: torch.Tensor) -> torch.Tensor:
    """The 4 little-endian bytes of :func:`crc32_device` of ``body`` (uint8, on its device)."""
    crc = crc32_device(body)
    return ((crc >> (8 * torch.arange(4, device=body.device))) & 255).to(torch.uint8)
