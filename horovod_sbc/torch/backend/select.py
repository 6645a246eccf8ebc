"""SBC's selection and binarization in tensor ops, on the tensor's own device.

Exact top-k with deterministic ties (:mod:`horovod_sbc.reference`: the paper's positive and
negative candidate sets, or the k largest magnitudes split by sign; ties at the k-th value to
the lower index), without a full ``torch.topk``/sort of the tensor (see :func:`_candidates`):
one read pass for per-column maximum and minimum, a threshold from a strided sample, an exact
search among the few columns that reach it. The result is always exactly the k largest, so the
estimate costs speed, never accuracy. The means are the reference's fixed-order float64 tree
sums (:func:`tree_sums`), so every device gets the same bits.

Used one tensor at a time by :class:`~horovod_sbc.torch.backend.ops.OpsBackend` for what the
fused multi-tensor encoder (:mod:`horovod_sbc.torch.backend.fused`) does not take.
"""
from __future__ import annotations

import ctypes
import math
import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ... import wire
from ...reference import choose_side
from .base import NonFiniteError, scratch

_EXACT_BELOW = 1 << 14  # below this one exact pass over the whole tensor is cheaper
_SAMPLE_MAX = 1 << 18   # largest strided sample for the threshold estimate


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
    (ties: lower index). Raises :class:`NonFiniteError` if ``a`` holds NaN or Inf."""
    return _select(a, k, False, name)[0]


def select_sides(a: torch.Tensor, k: int, selection: str = "paper", name: str = "tensor"
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(P, N): sorted positions of the positive and negative candidate sets
    (:func:`horovod_sbc.reference.select_sides_np`)."""
    if selection == "paper":
        p, q = _select(a, k, True, name)
        return p, q
    idx = _select(a, k, False, name)[0]
    kept = a[idx]
    return idx[kept > 0], idx[kept < 0]


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


def f32(x: float) -> float:
    """Round a Python float to float32 (round to nearest even; overflow gives inf, as on the
    device): C's double-to-float conversion through ctypes, much cheaper on the host than a 0-d
    tensor's ``.to(torch.float32)`` (tests/test_kernels.py pins the two equal)."""
    return ctypes.c_float(x).value


@dataclass
class Binarized:
    """Binarization's verdict and the Rice parameter of the side sent (host values)."""
    pos: torch.Tensor     # positions sent (ascending)
    mu: float             # float32-exact magnitude
    negative: bool
    rice_b: int
    sum_q: int            # sum of gaps >> rice_b (unary stream bits = sum_q + count)


def rice_candidates(count: int, numel: int) -> List[int]:
    b0 = wire.rice_parameter(count / numel) if count else 0
    return [b for b in (b0 - 1, b0, b0 + 1) if 0 <= b <= wire.MAX_RICE_B]


def gaps(pos: torch.Tensor) -> torch.Tensor:
    return torch.diff(pos, prepend=pos.new_full((1,), -1)) - 1


def binarize_sides(a: torch.Tensor, p_idx: torch.Tensor, n_idx: torch.Tensor, numel: int = None
                   ) -> Binarized:
    """Pick the side with the larger mean (fixed-order tree sums on the device) and its Rice
    parameter. One transfer to the host: both sums (as bit patterns) and, for each side, the
    ``sum(gaps >> b)`` of the three candidate b (:func:`horovod_sbc.wire.choose_rice_b`)."""
    numel = a.numel() if numel is None else numel
    sides = [p_idx, n_idx]
    sums = tree_sums([a[p_idx], a[n_idx].neg()])
    parts = [sums.view(torch.int64)]
    cands = [rice_candidates(s.numel(), numel) for s in sides]
    for s, bs in zip(sides, cands):
        if bs and s.numel():
            g = gaps(s)
            parts.append(torch.stack([(g >> b).sum() for b in bs]))
    row = torch.cat(parts).tolist()
    s_pos, s_neg = struct.unpack("<2d", struct.pack("<2q", *row[:2]))
    np_, nn_ = p_idx.numel(), n_idx.numel()
    side, mu = choose_side(f32(s_pos / np_) if np_ else 0.0, f32(s_neg / nn_) if nn_ else 0.0)
    if side == 0:
        return Binarized(p_idx[:0], 0.0, False, 0, 0)
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
    return Binarized(pos, mu, side < 0, b, int(table[b]))
