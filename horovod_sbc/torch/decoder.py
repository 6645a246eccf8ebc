"""Batched decoding of a gathered step: every binary Golomb-Rice message of every rank at once.

:func:`horovod_sbc.torch.exchange.decode_gathered` parses all headers on the host through
:mod:`horovod_sbc.protocol` (one pass, exact integers), then hands the binary messages (SBC: no
SIGNS/VALUES, not ALL, ``count > 0``, ``rice_b <= 25``) to :func:`decode_binary`, which decodes
them all with a fixed number of tensor ops, whatever the number of tensors and ranks:

1. gather the unary streams of all messages into one byte vector (one index built on the device
   from per-message offsets: O(messages) values cross from the host, none back);
2. per message, the number of one bits (byte popcounts, one cumsum), whether the last unary byte
   is zero and whether a remainder padding bit is set — one transfer of ``3 x messages``
   integers to the host. If any message's one-bit count differs from its header, the exact
   per-message path (:func:`horovod_sbc.torch.codec.stream_stats`) decides the verdict instead
   (only corrupt input gets there);
3. the bit offset of every one bit, without unpacking the bits: each byte's ones are expanded
   (``repeat_interleave`` by popcount) and located with a 256 x 8 table;
4. remainders read from a 32-bit window at each field's bit offset; quotients and positions by
   segmented cumulative sums (``position = ((u - j) << b) + sum(r) + j``, u the one bit's
   offset in its stream, j the index in its message);
5. per message max quotient and max remainder by ``scatter_reduce``, max position (the last) — a second
   transfer of ``3 x messages`` integers, for :func:`horovod_sbc.protocol.check_streams`.

Messages are processed in (tensor, rank) order so that each output tensor receives all ranks'
positions, in rank order, with one ``index_add_`` (sequential on CPU: the same sums, in the same
order, as adding rank by rank; on other devices it adds rank by rank, as atomics would not keep
the order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from .. import wire

MAX_BATCH_RICE_B = 25  # a field plus its bit offset fits a 32-bit window
_POPCOUNT = {}
_BIT_OF = {}


def _tables(dev) -> Tuple[torch.Tensor, torch.Tensor]:
    """(popcount of each byte value uint8[256], bit offset (MSB = 0) of the j-th set bit of each
    byte value int64[256 * 8])."""
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


BATCH_MAX_COUNT = 1024
"""Messages with more positions are decoded one by one: the batch amortises the fixed cost per
message (many small tensors, low densities) but costs more per position than the per-message
path (``benchmarks/bench_codec.py`` compares both on ResNet-18's layout)."""


def batchable(msg: wire.TensorMessage) -> bool:
    """Messages :func:`decode_binary` handles and should (binary SBC messages with fewer than
    :data:`BATCH_MAX_COUNT` positions)."""
    return (0 < msg.count < BATCH_MAX_COUNT and not msg.all_positions and not msg.has_values
            and not msg.has_signs and msg.rice_b <= MAX_BATCH_RICE_B)


def _segment_index(starts: np.ndarray, lengths: np.ndarray, dev) -> torch.Tensor:
    """int64 indices ``starts[m] + 0 .. lengths[m]-1`` for all m, concatenated (built on the
    device from O(messages) host values)."""
    total = int(lengths.sum())
    cum = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    lens = torch.from_numpy(lengths).to(dev)
    shift = torch.from_numpy(starts - cum).to(dev)
    return torch.arange(total, dtype=torch.int64, device=dev) + torch.repeat_interleave(
        shift, lens, output_size=total)


@dataclass
class BinaryBatch:
    """Decoded binary messages: ``pos[seg_start[m]:seg_start[m + 1]]`` are message m's
    positions (the order of ``msgs``); ``stats[m]`` its stream statistics
    (ones, unary_last_zero, max_q, max_r, rem_pad_nonzero, pos_max), or None when phase 2
    did not run because some message's one-bit count is wrong."""
    pos: torch.Tensor
    seg_start: np.ndarray
    stats: List[Tuple[int, bool, int, int, bool, int]]
    complete: bool


def decode_binary(buf: torch.Tensor, msgs: Sequence[wire.TensorMessage]) -> BinaryBatch:
    """Decode all ``msgs`` (each :func:`batchable`) of the gathered ``buf`` together."""
    dev = buf.device
    m_count = len(msgs)
    counts = np.array([m.count for m in msgs], np.int64)
    u0 = np.array([m.unary[0] for m in msgs], np.int64)
    ulen = np.array([m.unary[1] - m.unary[0] for m in msgs], np.int64)
    r0 = np.array([m.remainder[0] for m in msgs], np.int64)
    rlen = np.array([m.remainder[1] - m.remainder[0] for m in msgs], np.int64)
    bs = np.array([m.rice_b for m in msgs], np.int64)
    k_total = int(counts.sum())
    seg_start = np.concatenate([[0], np.cumsum(counts)])
    ustart = np.concatenate([[0], np.cumsum(ulen)])
    popcount, bit_of = _tables(dev)

    # phase 1: counts and paddings
    ub = buf.index_select(0, _segment_index(u0, ulen, dev))
    pc = popcount.index_select(0, ub.long())  # uint8
    cs = torch.cumsum(pc, 0)  # int64
    ends = torch.from_numpy(ustart[1:] - 1).to(dev)
    starts = torch.from_numpy(ustart[:-1]).to(dev)
    ones = cs.index_select(0, ends) - cs.index_select(0, starts) + pc.index_select(0, starts)
    last_zero = ub.index_select(0, ends) == 0
    pad_bits = 8 * rlen - counts * bs  # 0..7 (header parsing guarantees the length)
    has_pad = (rlen > 0) & (pad_bits > 0)
    last_r = torch.from_numpy(np.where(rlen > 0, r0 + rlen - 1, 0)).to(dev)
    pad_mask = torch.from_numpy(np.where(has_pad, (1 << pad_bits) - 1, 0)).to(dev)
    rem_bad = (buf.index_select(0, last_r).long() & pad_mask) != 0
    p1 = torch.stack([ones, last_zero.long(), rem_bad.long()], 1).tolist()
    if any(row[0] != c for row, c in zip(p1, counts.tolist())):
        return BinaryBatch(buf.new_zeros(0, dtype=torch.int64), seg_start,
                           [(r[0], bool(r[1]), 0, 0, bool(r[2]), -1) for r in p1], False)

    # phase 2: positions
    seg = torch.repeat_interleave(torch.arange(m_count, device=dev),
                                  torch.from_numpy(counts).to(dev), output_size=k_total)
    byte = torch.repeat_interleave(torch.arange(ub.numel(), device=dev), pc.long(),
                                   output_size=k_total)
    rank_in_byte = torch.arange(k_total, device=dev) - (cs - pc).index_select(0, byte)
    u = (byte - starts.index_select(0, seg)) * 8 + bit_of.index_select(
        0, ub.index_select(0, byte).long() * 8 + rank_in_byte)
    del rank_in_byte, byte
    first = torch.from_numpy(seg_start[:-1]).to(dev)
    j = torch.arange(k_total, device=dev) - first.index_select(0, seg)
    b_t = torch.from_numpy(bs).to(dev).index_select(0, seg)
    q = torch.diff(u, prepend=u.new_full((1,), -1)) - 1
    q.index_copy_(0, first, u.index_select(0, first))
    # remainders: a 32-bit big-endian window at each field's bit offset
    off = torch.from_numpy(8 * r0).to(dev).index_select(0, seg) + j * b_t
    last = buf.numel() - 1
    at = (off >> 3).clamp_(max=last)
    word = buf.index_select(0, at).long() << 24
    for sh in (16, 8, 0):  # bytes past the end only feed bits the mask drops
        at = (at + 1).clamp_(max=last)
        word |= buf.index_select(0, at).long() << sh
    r = (word >> (32 - b_t - (off & 7))) & ((1 << b_t) - 1)
    del word, at, off
    cr = torch.cumsum(r, 0)
    base = (cr - r).index_select(0, first)
    pos = ((u - j) << b_t) + (cr - base.index_select(0, seg)) + j
    del cr, u, j, b_t
    # positions increase within a message (gaps >= 0, no overflow for b <= 25): the last is
    # the largest
    ends_k = torch.from_numpy(seg_start[1:] - 1).to(dev)
    mx = torch.zeros(m_count, 2, dtype=torch.int64, device=dev)
    mx[:, 0].scatter_reduce_(0, seg, q, "amax", include_self=False)
    mx[:, 1].scatter_reduce_(0, seg, r, "amax", include_self=False)
    mx = torch.cat([mx, pos.index_select(0, ends_k)[:, None]], 1).tolist()
    stats = [(p[0], bool(p[1]), x[0], x[1], bool(p[2]), x[2]) for p, x in zip(p1, mx)]
    return BinaryBatch(pos, seg_start, stats, True)
