"""The TF-ops backend's stream decoder: every message of a gathered step, of every kind, at once.

Input: the gathered buffer and the host parse's table (:mod:`.table`: one row per message, in
canonical (rank, tensor) order). Output: per decoded element (one per position a message
declares, message-major, so each message's elements are one contiguous slice) its *key* (the
tensor's offset in the concatenated layout + the position) and its message; per message the
:class:`horovod_sbc.protocol.StreamStats` row that the verdict judges. Values are read by
:func:`element_bits`, only where an accumulation needs them per element.

No branch per message kind (binary, SIGNS and VALUES messages share the position code of
:mod:`horovod_sbc.wire`); per element about twenty int64 ops, three gathers and one running sum.
Element ``i`` of message ``m`` is ``m``'s ``i``-th one bit (one ``Where`` over all unary bits;
by index where the one-bit count differs from the header's: ALL messages, corrupt input); its
quotient is the zero bits since the previous one bit, its remainder one gather from 64-bit
windows, its key one running sum of the gaps ``(q << b) + r + 1``. Statistics come from a binary
search per message and sorted segment maxima (int64 maxima as two int32 ones,
:func:`_segment_max64`: TensorFlow places an int64 segment reduction on the host). Each step,
and why the positions are exact: docs/tensorflow.md, "The backends: what runs where" (**The
TF-ops stream decoder**).

The whole decoder is one graph function (:func:`decode`), traced once per process: it depends
on no layout (sizes, offsets and the table are its inputs).
"""
from __future__ import annotations

from typing import Tuple

import tensorflow as tf

from . import graphs
from .table import (C_B, C_COUNT, C_KIND, C_NEG, C_RBYTES, C_RSTART, C_SBYTES, C_SSTART,
                    C_TENSOR, C_UBYTES, C_USTART, C_VBITS, C_VSTART, K_ALL_SIGNS, K_ALL_VALUES,
                    K_SIGNS, K_VALUES, N_COLS)

_SIGN32 = -2 ** 31


def _excl(x: tf.Tensor) -> tf.Tensor:
    return tf.cumsum(x, exclusive=True)


def _c64(v) -> tf.Tensor:
    return tf.constant(v, tf.int64)


def _owner(starts: tf.Tensor, total: tf.Tensor) -> tf.Tensor:
    """int32 [total]: for each index of a concatenation of segments starting at ``starts``
    (int64, non-decreasing, the first 0), the segment holding it (empty segments are skipped):
    a +1 at each later segment's start, then a running sum."""
    later = starts[1:]
    marks = tf.math.unsorted_segment_sum(tf.ones_like(later, tf.int32), later, total + 1)
    return tf.cumsum(marks[:-1])


def _segment_max64(x: tf.Tensor, seg: tf.Tensor) -> tf.Tensor:
    """Exact ``tf.math.segment_max`` of int64 ``x`` by sorted segment ids ``seg``, through two
    int32 segment maxima (TensorFlow has no GPU kernel for int64 segment reductions, which would
    put the op on the host): the high words' maximum, then the maximum of the low words
    (shifted into int32's order) among the elements whose high word reached it; 0 for an
    empty segment, as TensorFlow's."""
    hi = tf.cast(tf.bitwise.right_shift(x, 32), tf.int32)
    lo = tf.cast(tf.bitwise.bitwise_and(x, 0xFFFFFFFF) + _SIGN32, tf.int32)
    max_hi = tf.math.segment_max(hi, seg)
    lo = tf.where(tf.equal(hi, tf.gather(max_hi, seg)), lo, tf.int32.min)
    max_lo = tf.math.segment_max(lo, seg)
    full = tf.math.segment_max(tf.ones_like(hi), seg) > 0  # an empty segment's maximum is 0
    return tf.where(full, tf.bitwise.left_shift(tf.cast(max_hi, tf.int64), 32) +
                    (tf.cast(max_lo, tf.int64) - _SIGN32), 0)


def _windows(buf: tf.Tensor) -> tf.Tensor:
    """uint64 big-endian windows of ``buf``, one starting every 4 bytes (zero padded)."""
    n = tf.size(buf, out_type=tf.int64)
    padded = tf.concat([buf, tf.zeros(tf.reshape(12 - n % 4, [1]), tf.uint8)], 0)
    w32 = tf.cast(tf.bitcast(tf.reverse(tf.reshape(padded, [-1, 4]), [1]), tf.uint32), tf.uint64)
    return tf.bitwise.bitwise_or(tf.bitwise.left_shift(w32[:-1], tf.constant(32, tf.uint64)),
                                 w32[1:])


def _read32(windows: tf.Tensor, bit_start: tf.Tensor, width: tf.Tensor) -> tf.Tensor:
    """int64 fields of ``width`` (0..32) bits at ``bit_start`` (MSB first): one gather each (a
    field starts at most 31 bits into its window, so it ends at most 63 bits in)."""
    w = tf.gather(windows, tf.bitwise.right_shift(bit_start, 5))
    # w >> (64 - off - width), in two steps so that no shift reaches 64 (width 0 gives 0)
    sh = tf.cast(63 - tf.bitwise.bitwise_and(bit_start, 31) - width, tf.uint64)
    v = tf.bitcast(tf.bitwise.right_shift(tf.bitwise.right_shift(w, sh),
                                          tf.constant(1, tf.uint64)), tf.int64)
    return tf.bitwise.bitwise_and(v, tf.bitwise.left_shift(_c64(1), width) - 1)


def _read_fields(buf: tf.Tensor, b_any: tf.Tensor, bit_start: tf.Tensor,
                 width: tf.Tensor) -> tf.Tensor:
    """int64 fields of ``width`` (0..62) bits at ``bit_start``; two reads per field only when
    some message's Rice parameter exceeds 32 (``b_any``: the messages' parameters)."""
    windows = _windows(buf)

    def wide():
        hi = tf.maximum(width - 32, 0)
        lo = width - hi
        return tf.bitwise.bitwise_or(tf.bitwise.left_shift(_read32(windows, bit_start, hi), lo),
                                     _read32(windows, bit_start + hi, lo))

    return tf.cond(tf.reduce_any(b_any > 32), wide, lambda: _read32(windows, bit_start, width))


def _one_bits(buf: tf.Tensor, table: tf.Tensor):
    """``(offsets, owner, ones, unary_last_zero)``: the offset of every one bit in the
    concatenated unary streams (int64, increasing), the message of every unary byte, and per
    message its one bits and whether its last unary byte is 0."""
    ustart, ubytes = table[:, C_USTART], table[:, C_UBYTES]
    ucum = _excl(ubytes)
    n_ub = tf.reduce_sum(ubytes)
    owner = _owner(ucum, n_ub)
    ub = tf.gather(buf, tf.range(n_ub, dtype=tf.int64) + tf.gather(ustart - ucum, owner))
    bitmask = tf.constant([128, 64, 32, 16, 8, 4, 2, 1], tf.uint8)
    g = tf.reshape(tf.raw_ops.Where(condition=tf.reshape(
        tf.bitwise.bitwise_and(ub[:, None], bitmask), [-1])), [-1])
    ends = tf.searchsorted(g, 8 * (ucum + ubytes), side="left", out_type=tf.int64)
    ones = ends - tf.concat([[_c64(0)], ends[:-1]], 0)
    slack = tf.concat([buf, tf.zeros([8], tf.uint8)], 0)
    last_u = tf.gather(slack, tf.where(ubytes > 0, ustart + ubytes - 1, 0))
    return g, owner, ones, tf.logical_and(ubytes > 0, tf.equal(last_u, 0))


def _quotients(table: tf.Tensor, g, owner, ones) -> Tuple[tf.Tensor, tf.Tensor]:
    """``(q, msg)`` of every element: its quotient and its message (int32)."""
    count, kind = table[:, C_COUNT], table[:, C_KIND]
    first, c_total = _excl(count), tf.reduce_sum(count)
    nonempty = tf.reshape(tf.where(count > 0), [-1])
    first_ne = tf.gather(first, nonempty)
    ustart_bit = 8 * tf.gather(_excl(table[:, C_UBYTES]), nonempty)

    def gaps(gi):  # zero bits between consecutive one bits; a message's first from its start
        q = gi - tf.concat([[_c64(-1)], gi[:-1]], 0) - 1
        return tf.tensor_scatter_nd_update(q, first_ne[:, None],
                                           tf.gather(gi, first_ne) - ustart_bit)

    def matched():  # valid binary, SIGNS and VALUES messages: the one bits are the elements
        return gaps(g), tf.gather(owner, tf.bitwise.right_shift(g, 3))

    def by_index():  # ALL messages or corrupt input (rejected by the verdict)
        i = tf.range(c_total, dtype=tf.int64)
        e = _owner(first, c_total)
        j = tf.gather(_excl(ones) - first, e) + i
        padded = tf.concat([g, tf.zeros([1], tf.int64)], 0)
        q = gaps(tf.gather(padded, tf.clip_by_value(j, 0, tf.size(g, out_type=tf.int64))))
        return tf.where(tf.gather(kind, e) >= K_ALL_SIGNS, tf.zeros_like(q), q), e

    return tf.cond(tf.reduce_all(tf.equal(ones, count)), matched, by_index)


def _pad_nonzero(buf: tf.Tensor, start, nbytes, used_bits) -> tf.Tensor:
    """int64 per message: is a padding bit of the stream's last byte set?"""
    slack = tf.concat([buf, tf.zeros([8], tf.uint8)], 0)
    last = tf.cast(tf.gather(slack, tf.where(nbytes > 0, start + nbytes - 1, 0)), tf.int64)
    pad = 8 * nbytes - used_bits
    mask = tf.bitwise.left_shift(_c64(1), tf.clip_by_value(pad, 0, 8)) - 1
    return tf.cast(tf.logical_and(pad > 0, tf.not_equal(tf.bitwise.bitwise_and(last, mask), 0)),
                   tf.int64)


def _nonfinite(buf: tf.Tensor, table: tf.Tensor) -> tf.Tensor:
    """int64 per message: its non-finite float32 values (VALUES messages; by bit pattern)."""
    kind, count = table[:, C_KIND], table[:, C_COUNT]
    vcount = tf.where(tf.logical_or(tf.equal(kind, K_VALUES), tf.equal(kind, K_ALL_VALUES)),
                      count, 0)

    vfirst, total = _excl(vcount), tf.reduce_sum(vcount)  # no values: empty tensors below
    e = _owner(vfirst, total)
    at = tf.gather(table[:, C_VSTART] - 4 * vfirst, e) + 4 * tf.range(total, dtype=tf.int64)
    exp = tf.bitwise.bitwise_and(tf.gather(buf, at + 3), 0x7F)  # the top byte holds 7 bits
    top = tf.logical_and(tf.equal(exp, 0x7F), tf.gather(buf, at + 2) >= 0x80)
    # int32 counts: TensorFlow has no GPU kernel for int64 segment sums
    return tf.cast(tf.math.unsorted_segment_sum(tf.cast(top, tf.int32), e, tf.size(count)),
                   tf.int64)


def _decode(buf: tf.Tensor, table: tf.Tensor, offs: tf.Tensor):
    count, b = table[:, C_COUNT], table[:, C_B]
    first, c_total = _excl(count), tf.reduce_sum(count)
    g, owner, ones, unary_last_zero = _one_bits(buf, table)
    q, msg = _quotients(table, g, owner, ones)
    per = lambda x: tf.gather(x, msg)  # noqa: E731 - a per-message constant, per element
    # b and the remainder fields' base packed into one per-message constant
    packed = per((8 * table[:, C_RSTART] - first * b) * 64 + b)
    b_e = tf.bitwise.bitwise_and(packed, 63)
    i = tf.range(c_total, dtype=tf.int64)
    r = _read_fields(buf, b, tf.bitwise.right_shift(packed, 6) + i * b_e, b_e)
    s = tf.cumsum(tf.bitwise.left_shift(q, b_e) + r + 1)  # positions + 1, running
    s_before = tf.gather(tf.concat([[_c64(0)], s], 0), first)
    toff = tf.gather(offs, table[:, C_TENSOR])
    key = s + per(toff - s_before - 1)
    m = tf.size(count)

    def seg_max(x):  # per message, 0 for empty ones (segments sorted by message)
        mx = _segment_max64(x, msg)
        return tf.concat([mx, tf.zeros(tf.reshape(m - tf.size(mx), [1]), x.dtype)], 0)

    stats = tf.stack([
        ones, tf.cast(unary_last_zero, tf.int64), tf.maximum(seg_max(q), 0),
        tf.maximum(seg_max(r), 0),
        _pad_nonzero(buf, table[:, C_RSTART], table[:, C_RBYTES], count * b),
        tf.where(count > 0, seg_max(key) - toff, -1),
        _pad_nonzero(buf, table[:, C_SSTART], table[:, C_SBYTES], count),
        _nonfinite(buf, table)], 1)
    return key, msg, stats


_DECODE = graphs.shared(_decode, (tf.TensorSpec([None], tf.uint8),
                                  tf.TensorSpec([None, N_COLS], tf.int64),
                                  tf.TensorSpec([None], tf.int64)))


def decode(buf: tf.Tensor, table: tf.Tensor, offs: tf.Tensor):
    """``(key, msg, stats)`` of a gathered step (see the module docstring): ``buf`` uint8, the
    host parse's ``table`` int64 ``[M, N_COLS]``, ``offs`` int64 ``[n_t]`` each tensor's offset
    in the concatenated layout; ``key`` int64 and ``msg`` int32 per element, ``stats`` int64
    ``[M, 8]``. One graph function for every step and layout."""
    return _DECODE(buf, table, offs)


def element_bits(buf: tf.Tensor, table: tf.Tensor, msg: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """``(bits, own)`` per element: the float32 bit pattern of its decoded value, sign included
    (its message's value; a SIGNS element's sign bit; a VALUES element's own float), and
    whether it is a VALUES element (its own float)."""
    kind = tf.gather(table[:, C_KIND], msg)
    local = tf.range(tf.size(msg, out_type=tf.int64)) - tf.gather(_excl(table[:, C_COUNT]), msg)
    is_sign = tf.logical_or(tf.equal(kind, K_SIGNS), tf.equal(kind, K_ALL_SIGNS))
    own = tf.logical_or(tf.equal(kind, K_VALUES), tf.equal(kind, K_ALL_VALUES))
    slack = tf.concat([buf, tf.zeros([8], tf.uint8)], 0)

    def sign_bits():
        bit = tf.where(is_sign, 8 * tf.gather(table[:, C_SSTART], msg) + local,
                       tf.zeros_like(local))
        byte = tf.cast(tf.gather(slack, tf.bitwise.right_shift(bit, 3)), tf.int64)
        set_ = tf.bitwise.bitwise_and(tf.bitwise.right_shift(byte, 7 - tf.bitwise.bitwise_and(
            bit, 7)), 1)
        return tf.logical_and(is_sign, tf.equal(set_, 1))

    def own_bits():
        at = tf.where(own, tf.gather(table[:, C_VSTART], msg) + 4 * local, tf.zeros_like(local))
        vb = tf.cast(tf.gather(slack, at[:, None] + tf.range(4, dtype=tf.int64)[None, :]),
                     tf.int64)
        word = tf.reduce_sum(tf.bitwise.left_shift(vb, tf.constant([0, 8, 16, 24], tf.int64)), 1)
        return tf.where(own, tf.bitcast(tf.cast(word, tf.uint32), tf.int32), vbits)

    vbits = tf.cast(tf.gather(table[:, C_VBITS], msg), tf.int32)
    neg = tf.logical_or(tf.gather(table[:, C_NEG], msg) > 0,
                        tf.cond(tf.reduce_any(is_sign), sign_bits, lambda: tf.zeros_like(is_sign)))
    bits = tf.cond(tf.reduce_any(own), own_bits, lambda: vbits)
    return tf.where(neg, tf.bitwise.bitwise_or(bits, tf.constant(_SIGN32, tf.int32)), bits), own
