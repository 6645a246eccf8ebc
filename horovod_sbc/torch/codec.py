"""SBC codec in torch: selection, binarization and Golomb-Rice streams on the tensor's own device.

Produces byte-for-byte the messages of the numpy reference (:mod:`horovod_sbc.core`,
:mod:`horovod_sbc.wire`). Only small control values (counts, sums, headers: O(1) per tensor) and
the compressed message's headers cross to the host; the O(numel) work stays on the device.

Selection is exact top-k with deterministic ties, but avoids a full ``torch.topk``/sort of the
tensor (see :func:`select_topk`): one read pass for per-block maximum magnitudes, a threshold from
a strided sample, an exact search among the few blocks that reach it. The result is always
exactly the k largest (ties to the lower index), so the estimate costs speed, never accuracy.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .. import protocol, wire
from ..core import choose_side, keep_count

_EXACT_BELOW = 1 << 14  # below this a kthvalue over the whole tensor is faster
_BLOCK = 32
_BIT_SHIFTS = {}


def _shifts(b: int, device) -> torch.Tensor:
    key = (b, str(device))
    t = _BIT_SHIFTS.get(key)
    if t is None:
        t = torch.arange(b - 1, -1, -1, dtype=torch.int64, device=device)
        _BIT_SHIFTS[key] = t
    return t


def _exact_topk(vals: torch.Tensor, k: int, cand: Optional[torch.Tensor]) -> torch.Tensor:
    """Positions of the k largest of ``vals`` (magnitudes; ``cand`` their ascending positions,
    None for 0..len-1), ties at the k-th value to the lowest positions; sorted ascending."""
    c = vals.numel()
    kth = torch.kthvalue(vals, c - k + 1).values  # the k-th largest magnitude
    gt = torch.nonzero(vals > kth).squeeze(1)
    need = k - gt.numel()
    sel = torch.cat([gt, torch.nonzero(vals == kth).squeeze(1)[:need]]) if need > 0 else gt
    if cand is not None:
        sel = cand[sel]
    return torch.sort(sel).values


def select_topk(a: torch.Tensor, k: int, name: str = "tensor") -> torch.Tensor:
    """Sorted int64 flat indices of the k entries of 1-D ``a`` largest in magnitude
    (ties: lower index). Raises :class:`NonFiniteError` if ``a`` holds NaN or Inf.

    Large tensors never materialise ``|a|``: one read pass computes the maximum magnitude of
    each block of ``_BLOCK`` elements (``amax``/``amin``), a strided sample gives a threshold a
    little below the k-th magnitude, and only the blocks whose maximum reaches it are gathered
    and searched exactly. Too few candidates only lowers the threshold and searches the block
    maxima again (no new pass over the tensor).
    """
    n = a.numel()
    dev = a.device
    if k >= n or n <= _EXACT_BELOW or 16 * k > n:
        a_abs = torch.abs(a, out=_scratch(n, a.dtype, dev))
        if not bool(torch.isfinite(a_abs.max())):
            raise NonFiniteError(f"the update of {name!r} contains NaN or Inf")
        if k >= n:
            return torch.arange(n, dtype=torch.int64, device=dev)
        return _exact_topk(a_abs, k, None)
    nb = n // _BLOCK
    head = a[:nb * _BLOCK].view(nb, _BLOCK)
    tail = a[nb * _BLOCK:]
    bmax = torch.maximum(head.amax(1), head.amin(1).neg_())
    peak = bmax.max() if tail.numel() == 0 else torch.maximum(bmax.max(), tail.abs().max())
    if not bool(torch.isfinite(peak)):  # amax/amin propagate NaN
        raise NonFiniteError(f"the update of {name!r} contains NaN or Inf")
    # threshold estimate from a strided sample of magnitudes
    m_target = int(min(max(16384, 32 * n // k), 262144, n // 4))
    stride = max(1, n // m_target)
    sample = a[::stride].abs()
    m = sample.numel()
    expect = k * m / n
    ks = int(min(m, math.ceil(1.3 * expect + 3.0 * math.sqrt(expect) + 4)))
    offs = torch.arange(_BLOCK, dtype=torch.int64, device=dev)
    tail_pos = torch.arange(nb * _BLOCK, n, dtype=torch.int64, device=dev)
    while True:
        t_lo = torch.topk(sample, ks, sorted=False).values.min()
        hit = torch.nonzero(bmax >= t_lo).squeeze(1)
        if hit.numel() * _BLOCK > n // 2 or ks >= m:
            # the threshold selects most of the tensor: search it whole
            return _exact_topk(torch.abs(a, out=_scratch(n, a.dtype, dev)), k, None)
        vals = torch.index_select(head, 0, hit).abs_().view(-1)
        pos = (hit[:, None] * _BLOCK + offs).view(-1)
        if tail.numel():
            vals = torch.cat([vals, tail.abs()])
            pos = torch.cat([pos, tail_pos])
        keep = torch.nonzero(vals >= t_lo).squeeze(1)
        if keep.numel() >= k:
            return _exact_topk(vals[keep], k, pos[keep])
        ks = min(m, 2 * ks)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """0-d float64 tensor: the fixed pairwise-tree sum of :func:`horovod_sbc.core.tree_sum_np`
    (zero padding to a power of two, then ``x[:h] + x[h:]``), on ``x``'s device."""
    x = x.reshape(-1).to(torch.float64)
    n = x.numel()
    if n == 0:
        return x.new_zeros(())
    size = 1 << (n - 1).bit_length()
    if size != n:
        x = torch.cat([x, x.new_zeros(size - n)])
    while x.numel() > 1:
        h = x.numel() // 2
        x = x[:h] + x[h:]
    return x[0]


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


def select_sides(a: torch.Tensor, k: int, selection: str = "paper", name: str = "tensor"
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(P, N): sorted positions of the positive and negative candidate sets
    (:func:`horovod_sbc.core.select_sides_np`)."""
    if selection == "paper":
        p = select_topk(a.clamp(min=0), k, name)  # clamp keeps NaN: select_topk reports it
        n = select_topk(a.clamp(max=0).neg_(), k, name)
        return p[a[p] > 0], n[a[n] < 0]
    if selection != "magnitude":
        raise ValueError(f"selection must be 'paper' or 'magnitude', got {selection!r}")
    idx = select_topk(a, k, name)
    kept = a[idx]
    return idx[kept > 0], idx[kept < 0]


def binarize_sides(a: torch.Tensor, p_idx: torch.Tensor, n_idx: torch.Tensor
                   ) -> Tuple[torch.Tensor, float, bool]:
    """(positions sent, mu as a float32-exact Python float, negative): the side with the larger
    mean (fixed-order tree sums on the device; only the two sums cross to the host)."""
    s_pos, s_neg = torch.stack([tree_sum(a[p_idx]), tree_sum(a[n_idx].neg())]).tolist()
    np_, nn_ = p_idx.numel(), n_idx.numel()
    side, mu = choose_side(_f32(s_pos / np_) if np_ else 0.0, _f32(s_neg / nn_) if nn_ else 0.0)
    if side > 0:
        return p_idx, mu, False
    if side < 0:
        return n_idx, mu, True
    return p_idx[:0], 0.0, False


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 0/1 vector -> bytes, MSB first, zero-padded (numpy.packbits order)."""
    n = bits.numel()
    pad = (-n) % 8
    if pad:
        bits = torch.cat([bits, torch.zeros(pad, dtype=bits.dtype, device=bits.device)])
    w = _shifts(8, bits.device)
    return (bits.view(-1, 8).to(torch.int64) << w).sum(1).to(torch.uint8)


def _unpack_bits(data: torch.Tensor) -> torch.Tensor:
    return ((data.to(torch.int64)[:, None] >> _shifts(8, data.device)) & 1).view(-1)


def _head(head: bytes, dev) -> torch.Tensor:
    return torch.tensor(list(head), dtype=torch.uint8, device=dev)


def encode_positions(pos: torch.Tensor, numel: int, value: float = 0.0, negative: bool = False,
                     values: Optional[torch.Tensor] = None, signs: Optional[torch.Tensor] = None,
                     all_positions: bool = False) -> torch.Tensor:
    """One tensor message (uint8, on ``pos``'s device) — see :mod:`horovod_sbc.wire`.

    ``signs`` (bool, True = negative) makes it ternary; ``all_positions`` sends every element
    (``pos`` is then only used for its device) with ``signs`` or ``values``.
    """
    dev = pos.device
    if all_positions:
        if values is not None:
            head = wire.tensor_header(numel, numel, 0, 0, 0.0, False, True, False, True)
            return torch.cat([_head(head, dev),
                              values.to(torch.float32).contiguous().view(torch.uint8)])
        head = wire.tensor_header(numel, numel, 0, 0, value, False, False, True, True)
        return torch.cat([_head(head, dev), _pack_bits(signs.to(torch.uint8))])
    count = pos.numel()
    if count == 0:
        head = wire.tensor_header(numel, 0, 0, 0, 0.0, False, values is not None)
        return torch.tensor(list(head), dtype=torch.uint8, device=dev)
    gaps = torch.diff(pos, prepend=torch.full((1,), -1, dtype=torch.int64, device=dev)) - 1
    bs = [b for b in range(max(0, wire.rice_parameter(count / numel) - 1),
                           min(wire.MAX_RICE_B, wire.rice_parameter(count / numel) + 1) + 1)]
    sums = torch.stack([(gaps >> b).sum() for b in bs]).tolist()
    table = dict(zip(bs, sums))
    b = wire.choose_rice_b(count, numel, lambda bb: table[bb])
    q = gaps >> b
    ones_at = torch.cumsum(q + 1, 0) - 1
    total = int(table[b]) + count
    ubits = torch.zeros(total, dtype=torch.uint8, device=dev)
    ubits[ones_at] = 1
    unary = _pack_bits(ubits)
    parts = [None, unary]
    if b:
        r = gaps & ((1 << b) - 1)
        rbits = ((r[:, None] >> _shifts(b, dev)) & 1).to(torch.uint8).view(-1)
        parts.append(_pack_bits(rbits))
    if values is not None:
        head = wire.tensor_header(numel, count, b, unary.numel(), 0.0, False, True)
        parts.append(values.to(torch.float32).contiguous().view(torch.uint8))
    elif signs is not None:
        head = wire.tensor_header(numel, count, b, unary.numel(), value, False, False, True)
        parts.append(_pack_bits(signs.to(torch.uint8)))
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
        r = (rbits[:n * b].view(n, b) << _shifts(b, dev)).sum(1)
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
    return pos, vals, protocol.StreamStats(**{**stats.__dict__, "pos_max": int(pos.max())})


def _EMPTY_POS(dev) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64, device=dev)


class NonFiniteError(ValueError):
    pass


_SCRATCH = {}


def _scratch(n: int, dtype, device, slot: int = 0) -> torch.Tensor:
    """A reusable flat buffer (tensors are encoded one after another), so a sync does not
    allocate (and page-fault) a fresh tensor-sized buffer for every parameter. Slot 0 is the
    codec's own (|A|); other slots belong to callers."""
    key = (slot, dtype, str(device))
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n]


MODES = ("sbc", "values", "sign", "terngrad")


def encode_update(a: torch.Tensor, density: float, mode="sbc", name: str = "tensor",
                  generator: Optional[torch.Generator] = None, selection: str = "paper"
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode flat ``a`` (the residual-corrected update ``A = R + dW``).

    ``mode``: ``"sbc"`` (or True) top-k + binarization; ``"values"`` (or False) top-k with its
    float32 values; ``"sign"`` error-feedback signSGD (all elements, ``sign(A) * mean|A|``);
    ``selection`` (``"paper"`` or ``"magnitude"``) picks SBC's candidate sets (see
    :mod:`horovod_sbc.core`). ``"terngrad"`` stochastic ternary (Wen et al. 2017): each element is sent as
    ``max|A| * sign(A)`` with probability ``|A| / max|A|`` (``generator`` draws; unbiased).
    Returns (tensor message uint8, positions sent, values sent) without touching ``a``; the
    caller commits the error feedback with :func:`subtract_sent_` once the exchange succeeded.
    """
    mode = "sbc" if mode is True else "values" if mode is False else mode
    n = a.numel()
    dev = a.device
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    if n == 0:
        return encode_positions(empty, 0), empty, a.new_zeros(0)
    if mode in ("sign", "terngrad"):
        a_abs = torch.abs(a, out=_scratch(n, a.dtype, dev))
        stat = (tree_sum(a_abs) if mode == "sign" else a_abs.max()).item()
        if not math.isfinite(stat):
            raise NonFiniteError(f"the update of {name!r} contains NaN or Inf")
        if mode == "sign":
            scale = _f32(stat / n)
            neg = a < 0
            sent = torch.where(neg, -scale, scale).to(a.dtype)
            msg = encode_positions(empty, n, scale, signs=neg, all_positions=True)
            return msg, torch.arange(n, dtype=torch.int64, device=dev), sent
        scale = float(torch.tensor(stat, dtype=torch.float32))
        if scale == 0.0:
            return encode_positions(empty, n), empty, a.new_zeros(0)
        u = torch.rand(n, generator=generator, device=dev, dtype=torch.float32)
        pos = torch.nonzero(u * scale < a_abs).squeeze(1)
        neg = a[pos] < 0
        sent = torch.where(neg, -scale, scale).to(a.dtype)
        return encode_positions(pos, n, scale, signs=neg), pos, sent
    if mode not in ("sbc", "values"):
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
    k = keep_count(n, density)
    if mode == "values":
        idx = select_topk(a, k, name)
        vals = a[idx].to(torch.float32)
        return (encode_positions(idx, n, values=vals, all_positions=idx.numel() == n), idx,
                vals.to(a.dtype))
    pos, mu, negative = binarize_sides(a, *select_sides(a, k, selection, name))
    sent = torch.full((pos.numel(),), -mu if negative else mu, dtype=a.dtype, device=dev)
    return encode_positions(pos, n, mu, negative), pos, sent


def subtract_sent_(a: torch.Tensor, pos: torch.Tensor, sent: torch.Tensor) -> None:
    """Error feedback: ``a[pos] -= sent`` (positions are unique)."""
    if pos.numel():
        a[pos] = a[pos] - sent


def compress_(a: torch.Tensor, density: float, mode="sbc", name: str = "tensor",
              selection: str = "paper") -> Tuple[torch.Tensor, int]:
    """Encode and commit at once (single-process use): returns (message, positions sent)."""
    msg, pos, sent = encode_update(a, density, mode, name, selection=selection)
    subtract_sent_(a, pos, sent)
    return msg, pos.numel()
