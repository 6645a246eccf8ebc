"""Tensor messages in tensor ops: Golomb-Rice position streams and message assembly.

The bytes of :mod:`horovod_sbc.wire` (its docstring is the specification): a tensor header, the
unary stream of the gaps' quotients, the ``b``-bit remainder stream, then SIGNS bits or float32
VALUES where the message has them. Everything O(positions) stays on the positions' device; only
the header (a few bytes) is built on the host.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ... import wire
from .select import gaps, rice_candidates
from . import transfer


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


def stream_sizes(count: int, b: int, sum_q: int) -> Tuple[int, int]:
    """Bytes of the unary and remainder streams of ``count`` positions, Rice parameter ``b``,
    ``sum_q = sum(gaps >> b)``."""
    return -(-(sum_q + count) // 8), -(-(count * b) // 8)


def position_streams(pos: torch.Tensor, numel: int, b: Optional[int] = None,
                     sum_q: Optional[int] = None) -> Tuple[int, torch.Tensor, torch.Tensor]:
    """(rice_b, unary stream, remainder stream) of sorted unique ``pos`` (count > 0); ``b``
    and ``sum_q`` when the caller has them (else one host read chooses ``b`` by
    :func:`horovod_sbc.wire.choose_rice_b`)."""
    dev = pos.device
    count = pos.numel()
    g = gaps(pos)
    if b is None:
        bs = rice_candidates(count, numel)
        table = dict(zip(bs, torch.stack([(g >> bb).sum() for bb in bs]).tolist()))
        b = wire.choose_rice_b(count, numel, lambda bb: table[bb])
        sum_q = int(table[b])
    ones_at = torch.cumsum((g >> b) + 1, 0) - 1
    unary = _scatter_bits(-(-(sum_q + count) // 8), ones_at, dev)
    rem = _pack_fields(g & ((1 << b) - 1), b, dev) if b else unary[:0]
    return b, unary, rem


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
            return torch.cat([transfer.upload(head, dev),
                              values.to(torch.float32).contiguous().view(torch.uint8)])
        head = wire.tensor_header(numel, numel, 0, 0, value, False, False, True, True)
        return torch.cat([transfer.upload(head, dev), _pack_bits(signs)])
    count = pos.numel()
    if count == 0:
        head = wire.tensor_header(numel, 0, 0, 0, 0.0, False, values is not None)
        return transfer.upload(head, dev)
    b, unary, rem = position_streams(pos, numel, rice_b, sum_q)
    parts = [None, unary, rem]
    if values is not None:
        head = wire.tensor_header(numel, count, b, unary.numel(), 0.0, False, True)
        parts.append(values.to(torch.float32).contiguous().view(torch.uint8))
    elif signs is not None:
        head = wire.tensor_header(numel, count, b, unary.numel(), value, False, False, True)
        parts.append(_pack_bits(signs))
    else:
        head = wire.tensor_header(numel, count, b, unary.numel(), value, negative)
    parts[0] = transfer.upload(head, dev)
    return torch.cat(parts)


def empty_positions(dev) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64, device=dev)
