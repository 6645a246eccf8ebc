"""Step messages in TensorFlow ops: the 24-byte step header (:mod:`horovod_sbc.wire`, "Step
message") around a rank's tensor messages, or the ERROR/SKIP step that names its first
non-finite tensor, built on the messages' device. The body's CRC-32 is two matrix products and a
log-depth combination over GF(2) (:mod:`horovod_sbc.crc`), so no byte of the step crosses to the
host before the allgather: Horovod can take the step as soon as it is computed.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ... import crc, reference, wire
from .codec import _const_bytes, _header_bytes, _le32
from .host import nonfinite_step

_SHIFTS = np.arange(8, dtype=np.uint8)


def _gf2(x: tf.Tensor) -> tf.Tensor:
    return tf.math.floormod(x, 2.0)


def _zero_crc(n: tf.Tensor, n_bits: int) -> tf.Tensor:
    """float32 [32]: the bits of the CRC-32 of ``n`` zero bytes (``n < 2**n_bits``): the
    register 0xFFFFFFFF moved past them, then inverted. The moves by each power of two that
    ``n`` holds are multiplied together in a tree (log2(n_bits) batched products)."""
    powers = crc.zero_powers(2 ** n_bits - 1)
    size = 1 << (len(powers) - 1).bit_length()  # the tree's leaves: a power of two
    have = tf.bitwise.bitwise_and(tf.bitwise.right_shift(n, tf.range(len(powers),
                                                                      dtype=tf.int64)), 1) > 0
    mats = tf.where(have[:, None, None], tf.constant(powers), tf.eye(32, batch_shape=[1]))
    mats = tf.concat([mats, tf.eye(32, batch_shape=[size - len(powers)])], 0)
    while size > 1:
        size //= 2
        pair = tf.reshape(mats, [size, 2, 32, 32])
        mats = _gf2(tf.matmul(pair[:, 0], pair[:, 1]))
    return 1.0 - _gf2(tf.reduce_sum(mats[0], 1))  # the register is all ones: row sums


def crc32(data: tf.Tensor, max_bytes: int = 2 ** 32 - 1) -> tf.Tensor:
    """zlib's CRC-32 of 1-D uint8 ``data`` (at most ``max_bytes`` bytes; its length may be
    known only when the graph runs) as an int64 scalar, on ``data``'s device. Products of 0/1
    values summed below 2**24: exact in float32, also with TensorFloat-32 inputs. The number of
    ops grows with log2(``max_bytes``)."""
    n = tf.size(data, out_type=tf.int64)
    chunks = tf.maximum((n + crc.CHUNK - 1) // crc.CHUNK, 1)
    x = tf.concat([tf.zeros(tf.reshape(chunks * crc.CHUNK - n, [1]), tf.uint8), data], 0)
    bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(
        tf.reshape(x, tf.stack([chunks, crc.CHUNK, 1])), _SHIFTS), 1)
    bits = tf.reshape(tf.cast(bits, tf.float32), tf.stack([chunks, 8 * crc.CHUNK]))
    part = _gf2(tf.matmul(bits, tf.constant(crc.chunk_table())))  # each chunk's own CRC
    levels = (max(1, -(-int(max_bytes) // crc.CHUNK)) - 1).bit_length()
    level_bytes = (crc.CHUNK - 1).bit_length()
    n_bits = max(1, int(max_bytes).bit_length(), level_bytes + levels)
    shifts = tf.constant(crc.zero_powers(2 ** n_bits - 1)[level_bytes:])  # 2**l chunks
    # pairs of neighbours: the left one's CRC moved past the right one, until one is left
    for level in range(levels):
        odd = tf.math.floormod(tf.shape(part, out_type=tf.int64)[0], 2)
        part = tf.concat([tf.zeros(tf.stack([odd, 32]), tf.float32), part], 0)
        pair = tf.reshape(part, [-1, 2, 32])
        part = _gf2(tf.matmul(pair[:, 0], shifts[level], transpose_b=True) + pair[:, 1])
    out = _gf2(part[0] + _zero_crc(n, n_bits))
    return tf.reduce_sum(tf.bitwise.left_shift(tf.cast(out, tf.int64),
                                               tf.range(32, dtype=tf.int64)))


def _step_header(flags: int, body_length, layout_crc: int, n_tensors: int, body_crc):
    head = wire.STEP_HEADER.pack(wire.STEP_MAGIC, wire.VERSION, flags, 0, 0, layout_crc,
                                 n_tensors, 0)
    return tf.concat([_const_bytes(head[:8]), _le32(body_length), _const_bytes(head[12:20]),
                      _le32(body_crc)], 0)


@functools.lru_cache(maxsize=256)
def step_bound(numels: Tuple[int, ...], density: float, mode: str) -> int:
    """The most bytes a step message of this layout can take (its fixed-size capacity,
    :func:`horovod_sbc.reference.step_capacity`): it sizes the CRC's combination."""
    return reference.step_capacity(numels, density, mode)


def frame(numels: Sequence[int], headers: Sequence[tf.Tensor], bodies: Sequence[tf.Tensor],
          layout_crc: int, capacity: Optional[int],
          max_bytes: int = 2 ** 32 - 1) -> Tuple[tf.Tensor, tf.Tensor]:
    """(the step message uint8, its zero padding in bytes int64) of the tensor messages: each
    tensor header from its five integers (``[flags, rice_b, count, unary_nbytes,
    value_bits]``, :func:`.codec.encode_parts`) followed by its body; with ``capacity`` a PADDED
    step of exactly that many bytes. ``max_bytes``: a bound on the step message's length
    (:func:`step_bound`; the fewer, the fewer ops)."""
    body = tf.concat([tf.zeros([0], tf.uint8)] + [
        part for n, h, b in zip(numels, headers, bodies) for part in (_header_bytes(n, h), b)],
        0)
    n = tf.size(body, out_type=tf.int64)
    if capacity is None:
        return tf.concat([_step_header(0, n, layout_crc, len(bodies), crc32(body, max_bytes)),
                          body], 0), tf.constant(0, tf.int64)
    pad = capacity - wire.STEP_HEADER_SIZE - n
    check = tf.debugging.assert_positive(
        pad, message=f"horovod_sbc: a step body exceeds its capacity of "
                     f"{capacity - wire.STEP_HEADER_SIZE} bytes")
    with tf.control_dependencies([check]):
        body = tf.concat([body, tf.zeros(tf.reshape(pad, [1]), tf.uint8)], 0)
    head = _step_header(wire.STEP_FLAG_PADDED, capacity - wire.STEP_HEADER_SIZE, layout_crc,
                        len(bodies), crc32(body, capacity - wire.STEP_HEADER_SIZE))
    return tf.ensure_shape(tf.concat([head, body], 0), [capacity]), pad


def error_steps(names: Sequence[str], layout_crc: int, rank: int, skip: bool,
                capacity: Optional[int]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per tensor, the ERROR (``skip``: SKIP) step naming it as non-finite, back to back:
    ``(bytes uint8, start int64 [T + 1], zero padding int64 [T])``."""
    msgs, pads = zip(*(nonfinite_step(name, layout_crc, rank, skip, capacity)
                       for name in names))
    starts = np.cumsum([0] + [len(m) for m in msgs]).astype(np.int64)
    pads = np.array(pads, np.int64)
    return np.frombuffer(b"".join(msgs), np.uint8).copy(), starts, pads


def step_or_error(step: tf.Tensor, padding: tf.Tensor, finite: Sequence[tf.Tensor],
                  names: Sequence[str], layout_crc: int, rank: int, skip: bool,
                  capacity: Optional[int]) -> Tuple[tf.Tensor, tf.Tensor]:
    """``(step, padding)``, or, when an update is not finite, the ERROR/SKIP step naming the
    first such tensor (:func:`error_steps`). Fixed-size steps are chosen among on the device;
    others, whose lengths differ, by a ``tf.cond``."""
    if not names:
        return step, padding
    raw, starts, pads = error_steps(names, layout_crc, rank, skip, capacity)
    ok = tf.stack(finite)
    first = tf.argmin(tf.cast(ok, tf.int32), output_type=tf.int64)  # the first False
    all_ok = tf.reduce_all(ok)
    err_pad = tf.gather(tf.constant(pads), first)
    if capacity is not None:  # every error step is `capacity` bytes too
        err = tf.gather(tf.reshape(tf.constant(raw), [len(names), capacity]), first)
        return tf.where(all_ok, step, err), tf.where(all_ok, padding, err_pad)
    begin, end = tf.gather(starts, first), tf.gather(starts, first + 1)
    return tf.cond(all_ok, lambda: (step, padding),
                   lambda: (tf.constant(raw)[begin:end], err_pad))
