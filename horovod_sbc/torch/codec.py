"""SBC codec in torch: selection, binarization and Golomb-Rice streams on the tensor's own device.

Produces byte-for-byte the messages of the numpy reference (:mod:`horovod_sbc.core`,
:mod:`horovod_sbc.wire`). Only small control values (counts, sums, headers: O(1) per tensor) and
the compressed message's headers cross to the host; the O(numel) work stays on the device.

Selection is exact top-k with deterministic ties, but avoids a full ``torch.topk``/sort of the
tensor: a strided sample of |A| gives a threshold a little below the k-th largest magnitude, one
pass (``|A| >= t``) collects the candidates (typically 1.3-3x k of them), and the exact k-th value
is then found among the candidates only. If the sample under-estimates (fewer than k candidates),
the threshold is lowered and the pass repeated; after three misses it falls back to the whole
tensor. The result is always exactly the k largest, so the approximation costs speed, never
accuracy.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .. import wire
from ..core import keep_count

_EXACT_BELOW = 1 << 16
_BIT_SHIFTS = {}


def _shifts(b: int, device) -> torch.Tensor:
    key = (b, str(device))
    t = _BIT_SHIFTS.get(key)
    if t is None:
        t = torch.arange(b - 1, -1, -1, dtype=torch.int64, device=device)
        _BIT_SHIFTS[key] = t
    return t


def select_topk(a_abs: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 flat indices of the k largest entries of 1-D ``a_abs`` (ties: lower index)."""
    n = a_abs.numel()
    dev = a_abs.device
    if k >= n:
        return torch.arange(n, dtype=torch.int64, device=dev)
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    cand = None
    if n > _EXACT_BELOW and 16 * k <= n:
        m_target = int(min(max(16384, 32 * n // k), 262144, n // 4))
        stride = max(1, n // m_target)
        sample = a_abs[::stride]
        m = sample.numel()
        expect = k * m / n
        ks = int(min(m, math.ceil(1.3 * expect + 3.0 * math.sqrt(expect) + 4)))
        for _ in range(3):
            t_lo = torch.topk(sample, ks, sorted=False).values.min()
            c = torch.nonzero(a_abs >= t_lo).squeeze(1)
            if c.numel() >= k:
                cand = c
                break
            ks = min(m, 2 * ks)
    vals = a_abs if cand is None else a_abs[cand]
    c = vals.numel()
    kth = torch.kthvalue(vals, c - k + 1).values  # the k-th largest magnitude
    gt = torch.nonzero(vals > kth).squeeze(1)
    need = k - gt.numel()
    if need > 0:
        eq = torch.nonzero(vals == kth).squeeze(1)[:need]
        sel = torch.cat([gt, eq])
    else:
        sel = gt
    if cand is not None:
        sel = cand[sel]
    return torch.sort(sel).values


def binarize(kept: torch.Tensor) -> Tuple[torch.Tensor, float, bool]:
    """(mask of the side sent, mu as a float32-exact Python float, negative) for kept values."""
    k64 = kept.to(torch.float64)
    pm = kept > 0
    nm = kept < 0
    zero = torch.zeros((), dtype=torch.float64, device=kept.device)
    stats = torch.stack([torch.where(pm, k64, zero).sum(), -torch.where(nm, k64, zero).sum(),
                         pm.sum().to(torch.float64), nm.sum().to(torch.float64)]).tolist()
    s_pos, s_neg, n_pos, n_neg = stats
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # round once to float32
    mu_pos = f32(s_pos / n_pos) if n_pos else 0.0
    mu_neg = f32(s_neg / n_neg) if n_neg else 0.0
    if mu_pos >= mu_neg and mu_pos > 0:
        return pm, mu_pos, False
    if mu_neg > 0:
        return nm, mu_neg, True
    return torch.zeros_like(pm), 0.0, False


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


def encode_positions(pos: torch.Tensor, numel: int, value: float = 0.0, negative: bool = False,
                     values: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One tensor message (uint8, on ``pos``'s device) — see :mod:`horovod_sbc.wire`."""
    dev = pos.device
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
    else:
        head = wire.tensor_header(numel, count, b, unary.numel(), value, negative)
    parts[0] = torch.tensor(list(head), dtype=torch.uint8, device=dev)
    return torch.cat(parts)


def decode_positions(buf: torch.Tensor, msg: wire.TensorMessage, name: str) -> torch.Tensor:
    """Positions (int64, on ``buf``'s device) of a parsed tensor message; validates the streams."""
    dev = buf.device
    count, b = msg.count, msg.rice_b
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    ubits = _unpack_bits(buf[msg.unary[0]:msg.unary[1]])
    ones = torch.nonzero(ubits).squeeze(1)
    if ones.numel() != count:
        raise ValueError(f"corrupt message: {name} unary stream holds {ones.numel()} codes, "
                         f"header says {count}")
    q = torch.diff(ones, prepend=torch.full((1,), -1, dtype=torch.int64, device=dev)) - 1
    if b:
        rbits = _unpack_bits(buf[msg.remainder[0]:msg.remainder[1]])
        pad = rbits[count * b:]
        r = (rbits[:count * b].view(count, b) << _shifts(b, dev)).sum(1)
        pad_bad, sum_q, sum_r = torch.stack([pad.sum(), q.sum(), r.sum()]).tolist()
        if pad_bad:
            raise ValueError(f"corrupt message: {name} remainder padding is not zero")
    else:
        r = torch.zeros_like(q)
        sum_q, sum_r = q.sum().item(), 0
    wire.check_stream_totals(msg, int(sum_q), int(sum_r), name)
    return torch.cumsum((q << b) + r + 1, 0) - 1


class NonFiniteError(ValueError):
    pass


def encode_update(a: torch.Tensor, density: float, binarize_values: bool = True,
                  name: str = "tensor") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SBC-encode flat ``a`` (the residual-corrected update ``A = R + dW``).

    Returns (tensor message uint8, positions sent, values sent) without touching ``a``; the
    caller commits the error feedback with :func:`subtract_sent_` once the exchange succeeded.
    """
    n = a.numel()
    empty = torch.zeros(0, dtype=torch.int64, device=a.device)
    if n == 0:
        return encode_positions(empty, 0), empty, a.new_zeros(0)
    a_abs = a.abs()
    if not bool(torch.isfinite(a_abs.max())):
        raise NonFiniteError(f"the update of {name!r} contains NaN or Inf")
    idx = select_topk(a_abs, keep_count(n, density))
    kept = a[idx]
    if not binarize_values:
        vals = kept.to(torch.float32)
        return encode_positions(idx, n, values=vals), idx, vals.to(a.dtype)
    side, mu, negative = binarize(kept)
    pos = idx[side]
    sent = torch.full((pos.numel(),), -mu if negative else mu, dtype=a.dtype, device=a.device)
    return encode_positions(pos, n, mu, negative), pos, sent


def subtract_sent_(a: torch.Tensor, pos: torch.Tensor, sent: torch.Tensor) -> None:
    """Error feedback: ``a[pos] -= sent`` (positions are unique)."""
    if pos.numel():
        a[pos] = a[pos] - sent


def compress_(a: torch.Tensor, density: float, binarize_values: bool = True,
              name: str = "tensor") -> Tuple[torch.Tensor, int]:
    """Encode and commit at once (single-process use): returns (message, positions sent)."""
    msg, pos, sent = encode_update(a, density, binarize_values, name)
    subtract_sent_(a, pos, sent)
    return msg, pos.numel()
