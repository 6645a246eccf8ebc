"""SBC codec in torch: selection, binarization and Golomb-Rice streams on the tensor's own device.

Produces byte-for-byte the messages of the numpy reference (:mod:`horovod_sbc.reference`,
:mod:`horovod_sbc.wire`). Only small control values (counts, sums, headers: O(1) per tensor) and
the compressed message's headers cross to the host; the O(numel) work stays on the device.

Selection is exact top-k with deterministic ties, but avoids a full ``torch.topk``/sort of the
tensor (see :func:`select_topk`): one read pass for per-block maximum magnitudes, a threshold from
a strided sample, an exact search among the few blocks that reach it. The result is always
exactly the k largest (ties to the lower index), so the estimate costs speed, never accuracy.
"""
from __future__ import annotations

import ctypes
import math
import struct
import threading
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .. import kernels, protocol, registry, wire
from ..reference import choose_side, keep_count

_EXACT_BELOW = 1 << 14  # below this one exact pass over the whole tensor is cheaper
_SAMPLE_MAX = 1 << 18   # largest strided sample for the threshold estimate
_U8_SHIFTS = {}


def _shifts(b: int, device) -> torch.Tensor:
    """[b-1, ..., 1, 0] as uint8 (bit shifts, most significant bit first), cached per device."""
    key = (b, str(device))
    t = _U8_SHIFTS.get(key)
    if t is None:
        t = _U8_SHIFTS[key] = torch.arange(b - 1, -1, -1, dtype=torch.uint8, device=device)
    return t


class NonFiniteError(ValueError):
    """An update holds NaN or Inf (raised by the selection, which sees every element once)."""


def _topk_mask(vals: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of the k largest of 1-D ``vals``, ties at the k-th value to the lowest indices.

    One ``kthvalue`` and a few elementwise ops, no sort: the kept entries stay in their order
    (callers keep candidate positions ascending, so the kept positions come out sorted)."""
    c = vals.numel()
    if k >= c:
        return torch.ones(c, dtype=torch.bool, device=vals.device)
    kth = torch.kthvalue(vals, c - k + 1).values  # the k-th largest
    gt = vals > kth
    eq = vals == kth
    need = k - gt.sum()
    return gt | (eq & (torch.cumsum(eq, 0) <= need))


def _check_finite(vals, name: str) -> None:
    if not all(math.isfinite(v) for v in vals):
        raise NonFiniteError(f"the update of {name!r} contains NaN or Inf")


def _rows_for(frac: float) -> int:
    """Rows R of the ``(R, n // R)`` view whose column maxima/minima prefilter the candidates.

    A column is searched when its extreme reaches the threshold; with a candidate fraction q
    about ``q R`` of the tensor is searched against ``n / R`` column extremes to test, so
    ``R ~ 1 / sqrt(q)`` balances the two (2..64)."""
    r = 1.0 / math.sqrt(max(frac, 1e-12))
    return 1 << max(1, min(6, int(round(math.log2(r)))))


@dataclass
class _Side:
    """Candidates of one side of the selection: ascending positions, their scores (the value
    ranked: ``a``, ``-a`` or ``|a|``)."""
    pos: torch.Tensor
    score: torch.Tensor


def _candidates(a: torch.Tensor, k: int, paper: bool, name: str) -> Optional[List[_Side]]:
    """Candidate sets (paper: [positive, negative]; magnitude: [|a|]) holding at least the k
    largest scores of each side, or None where an exact pass over the whole tensor is the better
    plan (small tensors, dense selections, a side with fewer than k candidates in the sample).

    One read pass computes the column maxima and minima of an ``(R, n // R)`` view; a strided
    sample gives thresholds a little below each side's k-th score; only the columns whose
    extremes reach them are gathered. Too few candidates lowers the thresholds and retries
    without another pass over the tensor. Raises :class:`NonFiniteError` on NaN/Inf.
    """
    n = a.numel()
    dev = a.device
    frac = (2.6 if paper else 1.3) * k / n
    if n <= _EXACT_BELOW or frac > 0.3:
        return None
    rows = _rows_for(frac)
    nb = n // rows
    head = a[:rows * nb].view(rows, nb)
    tail = a[rows * nb:]
    cmax, cmin = head.amax(0), head.amin(0)
    m_target = int(min(max(16384, 32 * n // k), _SAMPLE_MAX, n // 4))
    stride = max(1, n // m_target)
    sample = a[::stride]
    m = sample.numel()
    expect = k * m / n
    ks = int(min(m, math.ceil(1.3 * expect + 3.0 * math.sqrt(expect) + 4)))
    extremes = [cmax.max(), cmin.min()]
    if tail.numel():
        extremes += [tail.max(), tail.min()]
    first = True
    while True:
        if paper:
            tp = torch.topk(sample, ks, sorted=False).values.min()
            tn = torch.topk(sample, ks, largest=False, sorted=False).values.max().neg()
        else:
            tp = tn = torch.topk(sample.abs(), ks, sorted=False).values.min()
        ctl = torch.stack(extremes + [tp, tn]).tolist() if first else torch.stack(
            [tp, tn]).tolist()
        if first:
            _check_finite(ctl[:-2], name)
            first = False
        if not (ctl[-2] > 0.0 and ctl[-1] > 0.0):
            return None  # a side may have fewer than k entries: let the exact path decide
        hit = torch.nonzero((cmax >= tp) | (cmin <= -tn)).squeeze(1)
        if hit.numel() * rows > (3 * n) // 4:
            return None
        blk = head.index_select(1, hit)  # (rows, hits): row-major order is position order
        tl = tail
        if paper:
            masks = [(blk >= tp, tl >= tp, False), (blk <= -tn, tl <= -tn, True)]
        else:
            masks = [((blk >= tp) | (blk <= -tn), (tl >= tp) | (tl <= -tn), None)]
        sides = []
        h = hit.numel()
        flat = blk.view(-1)
        for mb, mt, neg in masks:
            f = torch.nonzero(mb.view(-1)).squeeze(1)  # row-major: ascending positions
            row = torch.div(f, h, rounding_mode="floor") if h else f
            pos = row * nb + hit.index_select(0, f - row * h)
            sc = flat.index_select(0, f)
            if tl.numel():
                tpos = torch.nonzero(mt).squeeze(1)
                pos = torch.cat([pos, tpos + rows * nb])
                sc = torch.cat([sc, tl[tpos]])
            sc = sc.abs() if neg is None else sc.neg() if neg else sc
            sides.append(_Side(pos, sc))
        if all(s.pos.numel() >= k for s in sides):
            return sides
        if ks >= m:
            return None
        ks = min(m, 2 * ks)


def _exact_sides(a: torch.Tensor, k: int, paper: bool, name: str) -> List[torch.Tensor]:
    """The exact selection over the whole tensor (small tensors, dense selections)."""
    n = a.numel()
    if paper:
        _check_finite(torch.stack([a.max(), a.min()]).tolist(), name)
        p = torch.nonzero(_topk_mask(a.clamp(min=0), k) & (a > 0)).squeeze(1)
        q = torch.nonzero(_topk_mask(a.clamp(max=0).neg_(), k) & (a < 0)).squeeze(1)
        return [p, q]
    a_abs = torch.abs(a, out=scratch(n, a.dtype, a.device))
    _check_finite([a_abs.max().item()], name)
    if k >= n:
        return [torch.arange(n, dtype=torch.int64, device=a.device)]
    return [torch.nonzero(_topk_mask(a_abs, k)).squeeze(1)]


def _select(a: torch.Tensor, k: int, paper: bool, name: str) -> List[torch.Tensor]:
    sides = _candidates(a, k, paper, name)
    if sides is None:
        return _exact_sides(a, k, paper, name)
    return [s.pos[_topk_mask(s.score, k)] for s in sides]


def select_topk(a: torch.Tensor, k: int, name: str = "tensor") -> torch.Tensor:
    """Sorted int64 flat indices of the k entries of 1-D ``a`` largest in magnitude
    (ties: lower index). Raises :class:`NonFiniteError` if ``a`` holds NaN or Inf.

    Exact top-k without a sort or ``torch.topk`` of the tensor: see :func:`_candidates` (or the
    C kernel on the CPU, :mod:`horovod_sbc.kernels`)."""
    lib = _kernels_for(a)
    if lib is not None:
        return _select_c(lib, a, k, _C_MAGNITUDE, name).take(0)
    return _select(a, k, False, name)[0]


# ------------------------------------------------------------------------------------------------
# the C kernels (contiguous float32 CPU tensors; see horovod_sbc.kernels)
# ------------------------------------------------------------------------------------------------
_C_PAPER, _C_MAGNITUDE_SPLIT, _C_MAGNITUDE = 0, 1, 2


def _kernels_for(a: torch.Tensor):
    """The kernel library when ``a`` is a contiguous float32 CPU tensor of at most
    ``kernels.MAX_NUMEL`` elements and the kernels are available, else None (the tensor-op
    path)."""
    if not a.is_cpu or a.dtype is not torch.float32 or not a.is_contiguous() or \
            a.numel() > kernels.MAX_NUMEL:
        return None
    return kernels.lib()


@dataclass
class _CSelection:
    """``sbc_select``'s result: the sides' sizes and fixed-order float64 tree sums (of ``a[P]``
    and of ``-a[N]``); the positions wait in the kernel's scratch for :meth:`take`."""
    lib: object
    counts: Tuple[int, int]
    sums: Tuple[float, float]
    in_dst: Optional[int] = None  # the side the kernel wrote to ``dst`` (then only that one)

    def take(self, side: int, buffer: Optional["PositionBuffer"] = None) -> torch.Tensor:
        """Side 0 or 1's ascending positions (int64), copied out of the kernel's scratch (into
        ``buffer`` if given): call before the next selection on this thread."""
        if self.in_dst is not None:
            raise AssertionError("horovod_sbc: the selection wrote only one side, to dst")
        out = buffer.get(self.counts[side]) if buffer is not None else \
            torch.empty(self.counts[side], dtype=torch.int64)
        self.lib.sbc_take(side, out.data_ptr())
        return out


@dataclass
class Difference:
    """An update that is ``w - wref`` (flat tensors of one size and dtype), for
    :func:`encode_update`'s ``addend``: the drop-in optimizer's update when its residual lives in
    the weights (weights minus the shared reference). The C kernels select on it in their pass
    over ``w`` and ``wref`` without storing it; elsewhere it is formed into ``a`` first."""
    w: torch.Tensor
    wref: torch.Tensor


@dataclass
class Consumed:
    """An update ``g`` (flat, like ``a``) for :func:`encode_update`'s ``addend`` that is used up:
    afterwards ``a`` holds ``R + g`` and ``g`` is all zeros, also when a ``NonFiniteError`` is
    raised. The C kernels zero it in the same pass that adds it (a store into a cache line the
    pass has just read); elsewhere ``zero_()`` follows the add. The stock hook's gradient: its
    buffer then receives the decoded average with no memset of its own."""
    g: torch.Tensor


class PositionBuffer:
    """Reusable storage for the positions one tensor's encode returns (CPU kernel path).

    A fresh tensor of the sent positions per tensor per step page-faults its memory in every
    time (at density 0.05 that cost about a fifth of the selection); the hook and the fused sync
    keep one buffer per parameter instead. The positions :func:`encode_update` returns are then
    a view of it, valid until the next encode given the same buffer (both callers commit the
    error feedback before that)."""

    def __init__(self):
        self._t: Optional[torch.Tensor] = None

    def get(self, count: int) -> torch.Tensor:
        """An int64 CPU view of ``count`` elements (grown, never shrunk)."""
        if self._t is None or self._t.numel() < count:
            self._t = torch.empty(count, dtype=torch.int64)
        return self._t[:count]


def _check_rc(rc: int, name: str, what: str) -> None:
    if rc == kernels.NONFINITE:
        raise NonFiniteError(f"the update of {name!r} contains NaN or Inf")
    if rc == kernels.NOMEM:
        raise MemoryError(f"horovod_sbc: out of memory in {what} of {name!r}")
    if rc != kernels.OK:
        raise AssertionError(f"horovod_sbc: {what} of {name!r} rejected its arguments ({rc})")


class _KernelOut(threading.local):
    """The kernel calls' small output arrays, allocated once per thread (a fresh set of ctypes
    objects per tensor per step was a measurable part of the codec's per-tensor cost)."""

    def __init__(self):
        self.counts = (ctypes.c_int64 * 2)()
        self.sums = (ctypes.c_double * 2)()
        self.in_dst = ctypes.c_int(-1)
        self.bs = (ctypes.c_int64 * 3)()
        self.shift_sums = (ctypes.c_int64 * 3)()
        self.addr = tuple(ctypes.addressof(x) for x in
                          (self.counts, self.sums, self.in_dst, self.bs, self.shift_sums))


_OUT = _KernelOut()


def _select_c(lib, a: torch.Tensor, k: int, mode: int, name: str,
              addend=None, dst: Optional[torch.Tensor] = None) -> _CSelection:
    """``sbc_select`` (with ``addend``: ``a += addend`` in the same pass, first; a
    :class:`Consumed`: the same, and the addend zeroed, ``sbc_select_consume``; a
    :class:`Difference`: the selection of ``w - wref`` itself, ``a`` untouched,
    ``sbc_select_diff``). With ``dst`` (int64, k elements; paper rule only) the kernel may write
    only the winning side into it: see :attr:`_CSelection.in_dst`."""
    out = _OUT
    counts, sums, in_dst = out.counts, out.sums, out.in_dst
    c_addr, s_addr, d_addr = out.addr[:3]
    if dst is None:
        tail = (a.numel(), k, mode, c_addr, s_addr, None, None)
    else:
        tail = (a.numel(), k, mode, c_addr, s_addr, dst.data_ptr(), d_addr)
    if isinstance(addend, Difference):
        rc = lib.sbc_select_diff(addend.w.data_ptr(), addend.wref.data_ptr(), *tail)
    elif isinstance(addend, Consumed):
        rc = lib.sbc_select_consume(a.data_ptr(), addend.g.data_ptr(), *tail)
    else:
        rc = lib.sbc_select(a.data_ptr(), None if addend is None else addend.data_ptr(), *tail)
    _check_rc(rc, name, "the selection")
    side = in_dst.value if dst is not None else -1
    return _CSelection(lib, (counts[0], counts[1]), (sums[0], sums[1]),
                       None if side < 0 else side)


def _rice_choice_c(lib, pos: torch.Tensor, numel: int) -> Tuple[int, int]:
    """(b, sum(gaps >> b)) by :func:`horovod_sbc.wire.choose_rice_b`, the sums from the kernel."""
    count = pos.numel()
    bs = _rice_candidates(count, numel)
    out = _OUT
    out.bs[:len(bs)] = bs
    lib.sbc_gap_shift_sums(pos.data_ptr(), count, out.addr[3], len(bs), out.addr[4])
    table = dict(zip(bs, out.shift_sums[:len(bs)]))
    b = wire.choose_rice_b(count, numel, table.__getitem__)
    return b, table[b]


def _binarize_c(lib, a: torch.Tensor, k: int, selection: str, name: str,
                addend: Optional[torch.Tensor] = None,
                buffer: Optional[PositionBuffer] = None) -> "_Binarized":
    """:func:`binarize_sides` of :func:`select_sides` in two kernel calls."""
    paper = selection == "paper"
    dst = (buffer.get(k) if buffer is not None else torch.empty(k, dtype=torch.int64)) \
        if paper else None
    sel = _select_c(lib, a, k, _C_PAPER if paper else _C_MAGNITUDE_SPLIT, name, addend, dst)
    (np_, nn_), (s_pos, s_neg) = sel.counts, sel.sums
    side, mu = choose_side(_f32(s_pos / np_) if np_ else 0.0, _f32(s_neg / nn_) if nn_ else 0.0)
    if side == 0:
        return _Binarized(torch.zeros(0, dtype=torch.int64), 0.0, False, 0, 0)
    chosen = 0 if side > 0 else 1
    if sel.in_dst is not None:  # only the winner was written (its mean is larger beyond doubt)
        if sel.in_dst != chosen:
            raise AssertionError(f"horovod_sbc: the kernel's side for {name!r} is not the chosen one")
        pos = dst[:sel.counts[chosen]]
    else:
        pos = sel.take(chosen, buffer)
    b, sum_q = _rice_choice_c(lib, pos, a.numel())
    return _Binarized(pos, mu, side < 0, b, sum_q)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """0-d float64 tensor: the fixed pairwise-tree sum of :func:`horovod_sbc.reference.tree_sum_np`
    (zero padding to a power of two, then ``x[:h] + x[h:]``), on ``x``'s device."""
    return tree_sums([x])[0]


def tree_sums(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """float64 ``[len(xs)]``: :func:`tree_sum` of each vector, computed together (one halving
    loop). Padding a vector with more zeros to a larger power of two leaves its tree sum
    unchanged (each extra level adds exact zeros), so one common width serves all."""
    lens = [x.numel() for x in xs]
    width = 1 << max(0, (max(lens + [1]) - 1).bit_length())
    dev = xs[0].device
    m = torch.zeros(len(xs), width, dtype=torch.float64, device=dev)
    for i, x in enumerate(xs):
        if lens[i]:
            m[i, :lens[i]] = x.reshape(-1)
    while m.shape[1] > 1:
        h = m.shape[1] // 2
        m = m[:, :h] + m[:, h:]
    return m[:, 0]


def _f32(x: float) -> float:
    """Round a Python float to float32 (round to nearest even; overflow gives inf, as on the
    device): C's double-to-float conversion through ctypes, much cheaper on the host than a 0-d
    tensor's ``.to(torch.float32)`` (tests/test_kernels.py pins the two equal)."""
    return ctypes.c_float(x).value


def select_sides(a: torch.Tensor, k: int, selection: str = "paper", name: str = "tensor"
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(P, N): sorted positions of the positive and negative candidate sets
    (:func:`horovod_sbc.reference.select_sides_np`)."""
    if selection not in ("paper", "magnitude"):
        raise ValueError(f"selection must be 'paper' or 'magnitude', got {selection!r}")
    lib = _kernels_for(a)
    if lib is not None:
        mode = _C_PAPER if selection == "paper" else _C_MAGNITUDE_SPLIT
        sel = _select_c(lib, a, k, mode, name)
        return sel.take(0), sel.take(1)
    if selection == "paper":
        p, q = _select(a, k, True, name)
        return p, q
    idx = _select(a, k, False, name)[0]
    kept = a[idx]
    return idx[kept > 0], idx[kept < 0]


@dataclass
class _Binarized:
    """Binarization's verdict and the Rice parameter of the side sent (host values)."""
    pos: torch.Tensor     # positions sent (ascending)
    mu: float             # float32-exact magnitude
    negative: bool
    rice_b: int
    sum_q: int            # sum of gaps >> rice_b (unary stream bits = sum_q + count)


def _rice_candidates(count: int, numel: int) -> List[int]:
    b0 = wire.rice_parameter(count / numel) if count else 0
    return [b for b in (b0 - 1, b0, b0 + 1) if 0 <= b <= wire.MAX_RICE_B]


def _gaps(pos: torch.Tensor) -> torch.Tensor:
    return torch.diff(pos, prepend=pos.new_full((1,), -1)) - 1


def binarize_sides(a: torch.Tensor, p_idx: torch.Tensor, n_idx: torch.Tensor, numel: int = None
                   ) -> _Binarized:
    """Pick the side with the larger mean (fixed-order tree sums on the device) and its Rice
    parameter. One transfer to the host: both sums (as bit patterns) and, for each side, the
    ``sum(gaps >> b)`` of the three candidate b (:func:`horovod_sbc.wire.choose_rice_b`)."""
    numel = a.numel() if numel is None else numel
    sides = [p_idx, n_idx]
    sums = tree_sums([a[p_idx], a[n_idx].neg()])
    parts = [sums.view(torch.int64)]
    cands = [_rice_candidates(s.numel(), numel) for s in sides]
    for s, bs in zip(sides, cands):
        if bs and s.numel():
            g = _gaps(s)
            parts.append(torch.stack([(g >> b).sum() for b in bs]))
    row = torch.cat(parts).tolist()
    s_pos, s_neg = struct.unpack("<2d", struct.pack("<2q", *row[:2]))
    np_, nn_ = p_idx.numel(), n_idx.numel()
    side, mu = choose_side(_f32(s_pos / np_) if np_ else 0.0, _f32(s_neg / nn_) if nn_ else 0.0)
    if side == 0:
        return _Binarized(p_idx[:0], 0.0, False, 0, 0)
    off, tables = 2, []
    for s, bs in zip(sides, cands):
        if bs and s.numel():
            tables.append(dict(zip(bs, row[off:off + len(bs)])))
            off += len(bs)
        else:
            tables.append({})
    i = 0 if side > 0 else 1
    pos, table = sides[i], tables[i]
    b = wire.choose_rice_b(pos.numel(), numel, lambda bb: table[bb])
    return _Binarized(pos, mu, side < 0, b, int(table[b]))


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """0/1 (bool or uint8) vector -> bytes, MSB first, zero-padded (numpy.packbits order);
    uint8 arithmetic throughout (no widening)."""
    bits = bits.to(torch.uint8)
    n = bits.numel()
    pad = (-n) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    m = bits.view(-1, 8)
    out = m[:, 0] << 7
    for j in range(1, 8):
        out |= m[:, j] << (7 - j)
    return out


def _unpack_bits(data: torch.Tensor) -> torch.Tensor:
    """bytes -> 0/1 uint8 bits, MSB first (numpy.unpackbits order)."""
    return ((data[:, None] >> _shifts(8, data.device)) & 1).view(-1)


def _scatter_bits(nbytes: int, bit_at: torch.Tensor, dev) -> torch.Tensor:
    """A byte stream of ``nbytes`` zero bytes with the (distinct) bits ``bit_at`` set."""
    out = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    if bit_at.numel():
        out.index_add_(0, bit_at >> 3, (128 >> (bit_at & 7)).to(torch.uint8))
    return out


def _pack_fields(r: torch.Tensor, b: int, dev) -> torch.Tensor:
    """``count`` fields of ``b`` bits each (values < 2**b), back to back, MSB first, zero
    padded: the remainder stream. Each field lands in at most ceil((7 + b) / 8) bytes, whose
    shares are scattered with one ``index_add_`` per byte (the fields' bits are disjoint, so
    adding is OR-ing); beyond 25 bits falls back to a bit matrix."""
    count = r.numel()
    nbytes = -(-count * b // 8)
    if b > 25:
        bits = ((r[:, None] >> torch.arange(b - 1, -1, -1, device=dev)) & 1).to(torch.uint8)
        return _pack_bits(bits.view(-1))
    off = torch.arange(count, dtype=torch.int64, device=dev) * b
    word = r << (32 - b - (off & 7))  # the field left-aligned in a 32-bit big-endian window
    at = off >> 3
    out = torch.zeros(nbytes + 4, dtype=torch.uint8, device=dev)
    for j in range((7 + b + 7) // 8):
        out.index_add_(0, at + j, ((word >> (24 - 8 * j)) & 255).to(torch.uint8))
    return out[:nbytes]


def _head(head: bytes, dev) -> torch.Tensor:
    t = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    return t if dev.type == "cpu" else t.to(dev)


def _streams(pos: torch.Tensor, numel: int, b: Optional[int] = None, sum_q: Optional[int] = None
             ) -> Tuple[int, torch.Tensor, torch.Tensor]:
    """(rice_b, unary stream, remainder stream) of sorted unique ``pos`` (count > 0)."""
    dev = pos.device
    count = pos.numel()
    lib = _kernels_for_positions(pos)
    if lib is not None:
        if b is None:
            b, sum_q = _rice_choice_c(lib, pos, numel)
        ubytes, rbytes = _stream_sizes(count, b, sum_q)
        buf = torch.empty(ubytes + rbytes, dtype=torch.uint8)
        _rice_encode_c(lib, pos, b, buf.data_ptr(), ubytes, rbytes)
        return b, buf[:ubytes], buf[ubytes:]
    gaps = _gaps(pos)
    if b is None:
        bs = _rice_candidates(count, numel)
        table = dict(zip(bs, torch.stack([(gaps >> bb).sum() for bb in bs]).tolist()))
        b = wire.choose_rice_b(count, numel, lambda bb: table[bb])
        sum_q = int(table[b])
    ones_at = torch.cumsum((gaps >> b) + 1, 0) - 1
    unary = _scatter_bits(-(-(sum_q + count) // 8), ones_at, dev)
    rem = _pack_fields(gaps & ((1 << b) - 1), b, dev) if b else unary[:0]
    return b, unary, rem


def _stream_sizes(count: int, b: int, sum_q: int) -> Tuple[int, int]:
    """Bytes of the unary and remainder streams of ``count`` positions, Rice parameter ``b``,
    ``sum_q = sum(gaps >> b)``."""
    return -(-(sum_q + count) // 8), -(-(count * b) // 8)


def _rice_encode_c(lib, pos: torch.Tensor, b: int, at: int, ubytes: int, rbytes: int) -> None:
    """The kernel's unary then remainder stream of ``pos`` at address ``at``."""
    rc = lib.sbc_rice_encode(pos.data_ptr(), pos.numel(), b, at, ubytes, at + ubytes, rbytes)
    _check_rc(rc, "positions", "the Rice encoder")


def _encode_binary_c(lib, pos: torch.Tensor, numel: int, value: float, negative: bool,
                     rice_b: Optional[int], sum_q: Optional[int]) -> torch.Tensor:
    """A binary message of ``pos`` (int64, contiguous, on the CPU; count > 0): header and
    streams written into one buffer by the kernel."""
    b, sum_q = (rice_b, sum_q) if rice_b is not None else _rice_choice_c(lib, pos, numel)
    ubytes, rbytes = _stream_sizes(pos.numel(), b, sum_q)
    head = wire.tensor_header(numel, pos.numel(), b, ubytes, value, negative)
    msg = torch.empty(len(head) + ubytes + rbytes, dtype=torch.uint8)
    ctypes.memmove(msg.data_ptr(), head, len(head))
    _rice_encode_c(lib, pos, b, msg.data_ptr() + len(head), ubytes, rbytes)
    return msg


def _kernels_for_positions(pos: torch.Tensor):
    if not pos.is_cpu or pos.dtype is not torch.int64 or not pos.is_contiguous():
        return None
    return kernels.lib()


def encode_positions(pos: torch.Tensor, numel: int, value: float = 0.0, negative: bool = False,
                     values: Optional[torch.Tensor] = None, signs: Optional[torch.Tensor] = None,
                     all_positions: bool = False, rice_b: Optional[int] = None,
                     sum_q: Optional[int] = None) -> torch.Tensor:
    """One tensor message (uint8, on ``pos``'s device) — see :mod:`horovod_sbc.wire`.

    ``signs`` (bool, True = negative) makes it ternary; ``all_positions`` sends every element
    (``pos`` is then only used for its device) with ``signs`` or ``values``. ``rice_b`` and
    ``sum_q`` (``sum(gaps >> rice_b)``), when the caller already has them, save a reduction.
    """
    dev = pos.device
    if all_positions:
        if values is not None:
            head = wire.tensor_header(numel, numel, 0, 0, 0.0, False, True, False, True)
            return torch.cat([_head(head, dev),
                              values.to(torch.float32).contiguous().view(torch.uint8)])
        head = wire.tensor_header(numel, numel, 0, 0, value, False, False, True, True)
        return torch.cat([_head(head, dev), _pack_bits(signs)])
    count = pos.numel()
    if count == 0:
        return _head(wire.tensor_header(numel, 0, 0, 0, 0.0, False, values is not None), dev)
    lib = _kernels_for_positions(pos) if values is None and signs is None else None
    if lib is not None:
        return _encode_binary_c(lib, pos, numel, value, negative, rice_b, sum_q)
    b, unary, rem = _streams(pos, numel, rice_b, sum_q)
    parts = [None, unary, rem]
    if values is not None:
        head = wire.tensor_header(numel, count, b, unary.numel(), 0.0, False, True)
        parts.append(values.to(torch.float32).contiguous().view(torch.uint8))
    elif signs is not None:
        head = wire.tensor_header(numel, count, b, unary.numel(), value, False, False, True)
        parts.append(_pack_bits(signs))
    else:
        head = wire.tensor_header(numel, count, b, unary.numel(), value, negative)
    parts[0] = _head(head, dev)
    return torch.cat(parts)


def stream_stats(buf: torch.Tensor, msg: wire.TensorMessage):
    """(positions int64, values or None, :class:`horovod_sbc.protocol.StreamStats`) of a parsed
    tensor message, decoded on ``buf``'s device; one small transfer of the statistics to the
    host. Positions and values are meaningful only once the protocol accepted the statistics.
    ``values`` is None for a binary message (every position holds ``msg.signed_value``)."""
    dev = buf.device
    count, b = msg.count, msg.rice_b
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    sign_bad = nonfinite = zero
    vals = None
    if msg.has_signs:
        sbits = _unpack_bits(buf[msg.signs[0]:msg.signs[1]])
        sign_bad = sbits[count:].sum()
        vals = torch.where(sbits[:count].bool(), -msg.value, msg.value).to(torch.float32)
    if msg.has_values:
        raw = buf[msg.values[0]:msg.values[1]].clone()
        bits = raw.view(torch.int32)
        nonfinite = ((bits & 0x7F800000) == 0x7F800000).sum()
        vals = raw.view(torch.float32)
    if count == 0 or msg.all_positions:
        pos = torch.arange(count, dtype=torch.int64, device=dev)
        sign_bad, nonfinite = torch.stack([sign_bad, nonfinite]).tolist()
        return pos, vals, protocol.StreamStats(sign_pad_nonzero=bool(sign_bad),
                                               nonfinite=nonfinite)
    ubytes = buf[msg.unary[0]:msg.unary[1]]
    ones = torch.nonzero(_unpack_bits(ubytes)).squeeze(1)
    q = torch.diff(ones, prepend=torch.full((1,), -1, dtype=torch.int64, device=dev)) - 1
    n = min(ones.numel(), count)
    q = q[:n]
    if b:
        rbits = _unpack_bits(buf[msg.remainder[0]:msg.remainder[1]])
        rem_bad = rbits[count * b:].sum()
        w = torch.arange(b - 1, -1, -1, dtype=torch.int64, device=dev)
        r = (rbits[:n * b].view(n, b).to(torch.int64) << w).sum(1)
    else:
        rem_bad = zero
        r = torch.zeros_like(q)
    max_q = q.max() if n else zero
    max_r = r.max() if n else zero
    row = torch.stack([zero + ones.numel(), (ubytes[-1] == 0).to(torch.int64), max_q, max_r,
                       rem_bad, sign_bad, nonfinite]).tolist()
    stats = protocol.StreamStats(ones=row[0], unary_last_zero=bool(row[1]), max_q=row[2],
                                 max_r=row[3], rem_pad_nonzero=bool(row[4]),
                                 sign_pad_nonzero=bool(row[5]), nonfinite=row[6])
    if ones.numel() != count or (stats.max_q << b) + stats.max_r >= msg.numel:
        return _EMPTY_POS(dev), vals, stats  # the protocol rejects it before looking at pos_max
    pos = torch.cumsum((q << b) + r + 1, 0) - 1
    return pos, vals, stats._replace(pos_max=int(pos.max()))


def _EMPTY_POS(dev) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64, device=dev)


_SCRATCH = {}


def scratch(n: int, dtype, device, slot: int = 0) -> torch.Tensor:
    """A reusable flat buffer (tensors are encoded one after another), so a sync does not
    allocate (and page-fault) a fresh tensor-sized buffer for every parameter. Slot 0 is the
    codec's own (|A|); other slots belong to callers."""
    key = (slot, dtype, str(device))
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n]


def encode_update(a: torch.Tensor, density: float, mode="sbc", name: str = "tensor",
                  generator: Optional[torch.Generator] = None, selection: str = "paper",
                  addend=None, positions: Optional[PositionBuffer] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode flat ``a`` (the residual-corrected update ``A = R + dW``).

    ``addend`` (flat, like ``a``): first ``a += addend`` (``R += dW``), in the selection's own
    pass over the tensor when the C kernels run (saving a pass over memory), else with
    ``add_``; ``a`` holds the sum afterwards even if a ``NonFiniteError`` is raised. Wrapped in
    :class:`Consumed` it is also zeroed (in that same pass on the kernel path). A
    :class:`Difference` ``(w, wref)`` makes the update ``w - wref`` itself: the kernels (SBC
    mode) select on it without storing it, reading ``w`` and ``wref`` only, and ``a`` is not
    touched; elsewhere it is computed into ``a`` (a scratch buffer then) first.

    ``mode``: ``"sbc"`` (or True) top-k + binarization and ``"values"`` (or False) top-k with
    its float32 values run here (C kernels on the CPU, tensor ops elsewhere); ``selection``
    (``"paper"`` or ``"magnitude"``) picks SBC's candidate sets (see
    :mod:`horovod_sbc.reference`). Any other registered compressor (:mod:`horovod_sbc.registry`)
    runs its own ``encode_torch`` on the sum (``generator``: the draws of a random one).
    Returns (tensor message uint8, positions sent, values sent) without touching ``a``; the
    caller commits the error feedback with :func:`subtract_sent_` once the exchange succeeded.
    ``positions``: a :class:`PositionBuffer` the returned positions may live in (CPU kernel
    path; then valid until the next encode with that buffer).
    """
    mode = "sbc" if mode is True else "values" if mode is False else mode
    registry.get(mode)  # ValueError naming the known modes
    if selection not in ("paper", "magnitude"):
        raise ValueError(f"selection must be 'paper' or 'magnitude', got {selection!r}")
    n = a.numel()
    dev = a.device
    lib = _kernels_for(a)
    if isinstance(addend, Difference):
        if lib is None or mode != "sbc" or a.dim() != 1 or any(
                _kernels_for(t) is None or t.numel() != n or t.dim() != 1
                for t in (addend.w, addend.wref)):
            torch.sub(addend.w, addend.wref, out=a)
            addend = None
    elif addend is not None:
        consumed = isinstance(addend, Consumed)
        g = addend.g if consumed else addend
        if lib is None or mode not in ("sbc", "values") or a.dim() != 1 or \
                _kernels_for(g) is None or g.numel() != n or g.dim() != 1:
            a.add_(g)
            if consumed:
                g.zero_()
            addend = None
    if n == 0:
        empty = _EMPTY_POS(dev)
        return encode_positions(empty, 0), empty, a.new_zeros(0)
    if mode not in ("sbc", "values"):  # a registered compressor's own encoder
        return registry.get(mode).encode_torch(a, density, name, selection, generator)
    k = keep_count(n, density)
    if mode == "values":
        idx = _select_c(lib, a, k, _C_MAGNITUDE, name, addend).take(0, positions) \
            if lib is not None else select_topk(a, k, name)
        vals = a[idx].to(torch.float32)
        return (encode_positions(idx, n, values=vals, all_positions=idx.numel() == n), idx,
                vals.to(a.dtype))
    if lib is not None:
        bz = _binarize_c(lib, a, k, selection, name, addend, positions)
        msg = _encode_binary_c(lib, bz.pos, n, bz.mu, bz.negative, bz.rice_b, bz.sum_q) \
            if bz.pos.numel() else encode_positions(bz.pos, n)
    else:
        bz = binarize_sides(a, *select_sides(a, k, selection, name))
        msg = encode_positions(bz.pos, n, bz.mu, bz.negative, rice_b=bz.rice_b, sum_q=bz.sum_q)
    # one value for every position: a stride-0 view (subtract_sent_ recognises it)
    sent = torch.full((1,), -bz.mu if bz.negative else bz.mu, dtype=a.dtype,
                      device=dev).expand(bz.pos.numel())
    return msg, bz.pos, sent


def subtract_sent_(a: torch.Tensor, pos: torch.Tensor, sent: torch.Tensor) -> None:
    """Error feedback: ``a[pos] -= sent`` (positions are unique). ``sent`` of one value for all
    positions (a stride-0 view, as :func:`encode_update` returns for SBC) is subtracted by the C
    kernel on the CPU: ``a + (-v)`` is ``a - v`` exactly, as ``index_add_(alpha=-1)`` computes."""
    if not pos.numel():
        return
    if sent.dim() == 1 and sent.stride(0) == 0 and sent.dtype == torch.float32 and \
            sent.device.type == "cpu" and _kernels_for(a) is not None and \
            _kernels_for_positions(pos) is not None and a.dim() == 1:
        v = ctypes.c_float.from_address(sent.data_ptr()).value  # the one value (no tensor op)
        kernels.lib().sbc_add_at(a.data_ptr(), pos.data_ptr(), pos.numel(), -v)
        return
    a.index_add_(0, pos, sent, alpha=-1)


def compress_(a: torch.Tensor, density: float, mode="sbc", name: str = "tensor",
              selection: str = "paper") -> Tuple[torch.Tensor, int]:
    """Encode and commit at once (single-process use): returns (message, positions sent)."""
    msg, pos, sent = encode_update(a, density, mode, name, selection=selection)
    subtract_sent_(a, pos, sent)
    return msg, pos.numel()
