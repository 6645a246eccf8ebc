"""Decoding step messages in TensorFlow: headers on the host, streams in TF ops.

A decode is four pieces, the same eagerly and inside ``tf.function``:

1. **parse (host)** — one ``tf.numpy_function`` over the gathered *compressed* bytes (O(message
   bytes), never O(numel)): split the step messages, check step headers and CRC-32s, the verdict
   of the step (malformed framing > ERROR > SKIP, lowest rank first), the layout, and every tensor
   header in exact Python integers (:mod:`horovod_sbc.wire`). It returns one row of integers per
   tensor message (stream offsets, count, Rice b, flags, value bits) and checks the O(1) bytes of
   each message (last unary byte, remainder and sign padding).
2. **streams (TF ops, batched over all messages)** — unary bits to quotients, remainder fields,
   sign bits, float32 values (by bit pattern), positions, and the per-message statistics the
   validation needs: number of unary one bits, sum and max of the quotients, the remainder sum
   (in 21-bit limbs, so no int64 can wrap), the number of non-finite values.
3. **verdict (host)** — a second small ``tf.numpy_function`` over those O(1)-per-message
   statistics: the exact integer checks (one bits == count, last position < numel, values
   finite). Nothing is added to any output before it passed.
4. **accumulate (TF ops)** — ``scale`` x every rank's decoded tensor, in rank order, added into
   the outputs. Decoded values enter as bits (a subnormal value survives); the additions are
   TensorFlow float arithmetic in the output dtype, done in rank order at every position (the
   same order as :func:`horovod_sbc.tensorflow.exchange.decode_into`, so all ranks agree).

Errors: ``ValueError`` raised by the host steps (``InvalidArgumentError`` with the same text
inside ``tf.function``).
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from .. import protocol, wire
from .bits import f32_bits_to_f64, f64_to_f32_bits

# the verdict codes (shared with exchange.py)
COMMIT, SKIP_KEEP_UPDATE, SKIP_DROP_UPDATE = 0, 1, 2

# columns of the per-message table the host parse returns
(C_TENSOR, C_RANK, C_COUNT, C_B, C_KIND, C_USTART, C_UBYTES, C_RSTART, C_SSTART, C_VSTART,
 C_VBITS, C_NEG, C_NUMEL, C_RBYTES, C_SBYTES) = range(15)
N_COLS = 15
K_BINARY, K_SIGNS, K_VALUES, K_ALL_SIGNS, K_ALL_VALUES = range(5)


# ----------------------------------------------------------------------------------------------
# host steps (exact Python integers, horovod_sbc.protocol; run inside tf.numpy_function)
# ----------------------------------------------------------------------------------------------
_LAST_ERROR: List[BaseException] = []


def _remember(e: BaseException) -> BaseException:
    """Keep the last exception a host step raised: inside ``tf.function`` TensorFlow delivers it
    as ``InvalidArgumentError`` text; :func:`original_error` gives the Python object back."""
    _LAST_ERROR[:] = [e]
    return e


def original_error(e: BaseException) -> BaseException:
    """The Python exception behind ``e`` (an ``InvalidArgumentError`` from a host step inside
    ``tf.function``), or ``e`` itself."""
    if isinstance(e, tf.errors.OpError) and _LAST_ERROR and str(_LAST_ERROR[0]) in e.message:
        return _LAST_ERROR[0]
    return e


def _row(host: bytes, msg: wire.TensorMessage, t: int, r: int) -> List[int]:
    # the value's bits straight from the bytes: inside tf.function this runs on a TensorFlow
    # thread whose FPU flushes subnormals, so msg.value (a float) may have lost them
    vbits = int.from_bytes(host[msg.unary[0] - 4:msg.unary[0]], "little")
    if msg.all_positions:
        kind = K_ALL_VALUES if msg.has_values else K_ALL_SIGNS
    else:
        kind = K_VALUES if msg.has_values else K_SIGNS if msg.has_signs else K_BINARY
    return [t, r, msg.count, msg.rice_b, kind, msg.unary[0], msg.unary[1] - msg.unary[0],
            msg.remainder[0], msg.signs[0], msg.values[0], vbits, int(msg.negative),
            msg.numel, msg.remainder[1] - msg.remainder[0], msg.signs[1] - msg.signs[0]]


def _parse(host: bytes, layout, n_ranks: int, single: bool):
    if single:
        name, shape = layout[0]
        msg = wire.parse_tensor_header(host, 0, wire.layout_numel(shape), name)
        if msg.nbytes != len(host):
            raise ValueError("corrupt message: trailing bytes after tensor message")
        return None, [(0, 0, msg, name)]
    step = protocol.parse_gathered(host, layout, n_ranks)
    return step, step.flat()


def parse_host(buf: np.ndarray, layout: Sequence[Tuple[str, Sequence[int]]], n_ranks: int,
               failed: bool, single: bool, strict: bool) -> Tuple[np.int32, np.ndarray]:
    """Step 1: ``(code, table int64 [n_ranks * len(layout), N_COLS])``
    (:func:`horovod_sbc.protocol.parse_gathered`, checks a-e).

    ``single``: ``buf`` is one bare tensor message (no step framing), as ``decompress`` takes.
    ``strict``: a rank's ERROR or SKIP raises :class:`horovod_sbc.wire.PeerError`. Otherwise
    ERROR raises ``ValueError("SBC: rank R could not encode ...")`` and SKIP warns and returns a
    table without positions (outputs stay as they were) and the code ``SKIP_DROP_UPDATE`` if
    this rank ``failed``, else ``SKIP_KEEP_UPDATE``.
    """
    host = np.asarray(buf, np.uint8).tobytes()
    table = np.zeros((n_ranks * len(layout), N_COLS), np.int64)
    try:
        _, flat = _parse(host, layout, n_ranks, single)
    except wire.PeerError as e:
        if strict:
            raise _remember(e)
        if not e.skip:
            raise _remember(ValueError(f"SBC: {e}")) from None
        warnings.warn(f"horovod_sbc: skipping this sync: {e}")
        return np.int32(SKIP_DROP_UPDATE if failed else SKIP_KEEP_UPDATE), table
    except ValueError as e:
        raise _remember(e)
    for row, (r, t, msg, _) in enumerate(flat):
        table[row] = _row(host, msg, t, r)
    return np.int32(COMMIT), table


def check_stats_host(buf: np.ndarray, code, stats: np.ndarray,
                     layout: Sequence[Tuple[str, Sequence[int]]], n_ranks: int,
                     single: bool) -> np.int32:
    """Step 3: :func:`horovod_sbc.protocol.check_streams` on the TF-computed statistics (check
    f). The headers are parsed again (stateless; O(number of tensors) on the compressed bytes)."""
    if int(code) != COMMIT:
        return np.int32(0)
    step, flat = _parse(np.asarray(buf, np.uint8).tobytes(), layout, n_ranks, single)
    rows = [protocol.StreamStats.from_row(x) for x in np.asarray(stats).tolist()]
    try:
        for (_, _, msg, name), st in zip(flat, rows):
            protocol.check_stream(msg, st, name)
    except ValueError as e:
        raise _remember(e)
    return np.int32(0)


# ----------------------------------------------------------------------------------------------
# TF ops
# ----------------------------------------------------------------------------------------------
def _c64(v) -> tf.Tensor:
    return tf.constant(v, tf.int64)


def _excl_cumsum(x: tf.Tensor) -> tf.Tensor:
    return tf.cumsum(x, exclusive=True)


def _ranges(starts: tf.Tensor, lengths: tf.Tensor):
    """(owner, offset) of every element of the concatenated ranges [starts, starts + lengths)."""
    m = tf.size(lengths, out_type=tf.int64)
    owner = tf.repeat(tf.range(m, dtype=tf.int64), lengths)
    first = _excl_cumsum(lengths)
    local = tf.range(tf.reduce_sum(lengths), dtype=tf.int64) - tf.gather(first, owner)
    return owner, tf.gather(starts, owner) + local, local


def read_fields(buf: tf.Tensor, bit_start: tf.Tensor, width: tf.Tensor,
                max_width: tf.Tensor) -> tf.Tensor:
    """int64 fields of ``width`` (0..62, per element) bits at ``bit_start`` (MSB first) of the
    uint8 stream ``buf`` (which must have 16 bytes of slack past any field)."""
    off = tf.bitwise.bitwise_and(bit_start, 7)
    span = (7 + max_width + 7) // 8
    j = tf.range(span, dtype=tf.int64)
    idx = tf.bitwise.right_shift(bit_start, 3)[:, None] + j[None, :]
    byte = tf.cast(tf.gather(buf, idx), tf.uint64)
    sh_hi = tf.cast(tf.maximum(56 - 8 * j, 0), tf.uint64)
    sh_lo = tf.cast(tf.maximum(120 - 8 * j, 0), tf.uint64)
    zero = tf.zeros_like(byte)
    hi = tf.reduce_sum(tf.where(j < 8, tf.bitwise.left_shift(byte, sh_hi), zero), 1)
    lo = tf.reduce_sum(tf.where(j >= 8, tf.bitwise.left_shift(byte, sh_lo), zero), 1)
    off_u = tf.cast(off, tf.uint64)
    # the 64 bits starting at bit `off` of the 128-bit window hi:lo
    top = tf.bitwise.left_shift(hi, off_u)
    top = tf.where(off > 0, tf.bitwise.bitwise_or(
        top, tf.bitwise.right_shift(lo, tf.cast(64 - tf.maximum(off, 1), tf.uint64))), top)
    w = tf.cast(tf.clip_by_value(width, 1, 64), tf.uint64)
    val = tf.bitwise.right_shift(top, tf.cast(64, tf.uint64) - w)
    return tf.where(width > 0, tf.bitcast(val, tf.int64), tf.zeros_like(bit_start))


def _bits_at(buf: tf.Tensor, bit: tf.Tensor) -> tf.Tensor:
    byte = tf.cast(tf.gather(buf, tf.bitwise.right_shift(bit, 3)), tf.int64)
    return tf.bitwise.bitwise_and(tf.bitwise.right_shift(byte, 7 - tf.bitwise.bitwise_and(bit, 7)),
                                  1)


def _streams(buf: tf.Tensor, table: tf.Tensor):
    """Step 2: per element (tensor, rank, position, float64 value) and per message stats."""
    m = tf.shape(table, out_type=tf.int64)[0]
    col = lambda c: table[:, c]  # noqa: E731
    count, b, kind = col(C_COUNT), col(C_B), col(C_KIND)
    is_all = kind >= K_ALL_SIGNS
    slack = tf.concat([buf, tf.zeros([16], tf.uint8)], 0)
    # unary streams of all messages: one bits -> quotients
    u_owner, u_byte, _ = _ranges(col(C_USTART), col(C_UBYTES))
    ubits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(
        tf.cast(tf.gather(buf, u_byte), tf.int64)[:, None],
        tf.constant([7, 6, 5, 4, 3, 2, 1, 0], tf.int64)[None, :]), 1)
    ones = tf.reshape(tf.where(tf.reshape(ubits, [-1]) > 0), [-1])
    one_msg = tf.gather(u_owner, tf.bitwise.right_shift(ones, 3))
    local = ones - 8 * tf.gather(_excl_cumsum(col(C_UBYTES)), one_msg)
    first = tf.concat([[True], tf.not_equal(one_msg[1:], one_msg[:-1])], 0)
    prev = tf.where(first, _c64(-1), tf.concat([[_c64(-1)], local[:-1]], 0))
    q_ones = local - prev - 1
    n_ones = tf.math.unsorted_segment_sum(tf.ones_like(ones), one_msg, m)
    # elements (one per declared position) of all messages
    e_msg, _, e_i = _ranges(tf.zeros_like(count), count)
    e_b = tf.gather(b, e_msg)
    e_kind = tf.gather(kind, e_msg)
    e_all = tf.gather(is_all, e_msg)
    # the i-th element of a message takes the i-th one bit of its unary stream (a message with
    # the wrong number of one bits is rejected by the verdict; the padding keeps shapes valid)
    j = tf.gather(_excl_cumsum(n_ones), e_msg) + e_i
    q = tf.gather(tf.concat([q_ones, tf.zeros_like(e_i)], 0),
                  tf.minimum(j, tf.size(q_ones, out_type=tf.int64) + tf.size(e_i,
                                                                       out_type=tf.int64) - 1))
    q = tf.where(e_all, tf.zeros_like(q), q)
    max_b = tf.reduce_max(tf.concat([b, [_c64(0)]], 0))
    r = read_fields(slack, tf.where(e_all, tf.zeros_like(e_i), 8 * tf.gather(col(C_RSTART), e_msg) + e_i * e_b),
                    e_b, max_b)
    step = tf.bitwise.left_shift(q, e_b) + r + 1
    cs = tf.cumsum(step)
    seg0 = tf.gather(_excl_cumsum(tf.math.unsorted_segment_sum(step, e_msg, m)), e_msg)
    pos = tf.where(e_all, e_i, cs - seg0 - 1)
    # values
    vbits = tf.cast(tf.gather(col(C_VBITS), e_msg), tf.int32)
    is_sign = tf.logical_or(tf.equal(e_kind, K_SIGNS), tf.equal(e_kind, K_ALL_SIGNS))
    sbit = tf.where(is_sign, 8 * tf.gather(col(C_SSTART), e_msg) + e_i, 0)
    neg = tf.logical_or(tf.gather(col(C_NEG), e_msg) > 0,
                        tf.logical_and(is_sign, tf.equal(_bits_at(slack, sbit), 1)))
    is_val = tf.logical_or(tf.equal(e_kind, K_VALUES), tf.equal(e_kind, K_ALL_VALUES))
    vstart = tf.where(is_val, tf.gather(col(C_VSTART), e_msg) + 4 * e_i, 0)
    vb = tf.cast(tf.gather(slack, vstart[:, None] + tf.range(4, dtype=tf.int64)[None, :]),
                 tf.int64)
    own = tf.reduce_sum(tf.bitwise.left_shift(vb, tf.constant([0, 8, 16, 24], tf.int64)), 1)
    own = tf.bitcast(tf.cast(own, tf.uint32), tf.int32)
    bits = tf.where(is_val, own, vbits)
    bits = tf.where(neg, tf.bitwise.bitwise_or(bits, tf.constant(-2 ** 31, tf.int32)), bits)
    nonfinite = tf.logical_and(is_val, tf.equal(
        tf.bitwise.bitwise_and(bits, 0x7F800000), 0x7F800000))
    # protocol.StreamStats per message (ones, unary_last_zero, max_q, max_r, rem_pad_nonzero,
    # pos_max, sign_pad_nonzero, nonfinite): exact int64, no sums that could wrap
    def last_byte(start, nbytes):
        idx = tf.where(nbytes > 0, start + nbytes - 1, 0)
        return tf.where(nbytes > 0, tf.cast(tf.gather(slack, idx), tf.int64), 0)

    def pad_nonzero(start, nbytes, used_bits):
        pad = 8 * nbytes - used_bits
        mask = tf.bitwise.left_shift(_c64(1), tf.clip_by_value(pad, 0, 8)) - 1
        return tf.cast(tf.logical_and(pad > 0, tf.bitwise.bitwise_and(
            last_byte(start, nbytes), mask) != 0), tf.int64)

    smax = lambda x, init: tf.maximum(tf.math.unsorted_segment_max(x, e_msg, m), init)  # noqa
    ubytes = col(C_UBYTES)
    stats = tf.stack([
        n_ones,
        tf.cast(tf.logical_and(ubytes > 0, tf.equal(last_byte(col(C_USTART), ubytes), 0)),
                tf.int64),
        smax(q, 0), smax(r, 0),
        pad_nonzero(col(C_RSTART), col(C_RBYTES), count * b),
        smax(pos, -1),
        pad_nonzero(col(C_SSTART), col(C_SBYTES), count),
        tf.math.unsorted_segment_sum(tf.cast(nonfinite, tf.int64), e_msg, m)], 1)
    value = f32_bits_to_f64(bits)
    return (tf.gather(col(C_TENSOR), e_msg), tf.gather(col(C_RANK), e_msg), pos, value, bits,
            stats)


def _to_dtype(v64: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    if dtype == tf.float64:
        return v64
    if dtype == tf.float32:
        return tf.bitcast(f64_to_f32_bits(v64), tf.float32)
    return tf.cast(v64, dtype)


@tf.autograph.experimental.do_not_convert
def decode_gathered(gathered: tf.Tensor, layout: Sequence[Tuple[str, Sequence[int]]],
                    n_ranks: int, outs: Optional[Sequence[tf.Tensor]] = None, scale: float = 1.0,
                    out_dtypes: Optional[Sequence[tf.DType]] = None, failed=False,
                    single: bool = False, strict: bool = True):
    """``(code, results)``: every rank's step message decoded and accumulated.

    ``results`` are flat tensors in ``layout`` order: ``outs`` (or zeros of ``out_dtypes``,
    default float32) plus, for each rank in rank order, ``round(float64(value) * scale)`` added at
    its positions (the protocol's decoded arithmetic). With ``single`` the input is one bare
    tensor message and the one result holds the message's float32 values as bit patterns.
    ``code`` is a scalar int32, ``COMMIT`` or, with ``strict=False`` and a SKIP step,
    ``SKIP_KEEP_UPDATE`` / ``SKIP_DROP_UPDATE`` (``failed``: this rank could not encode); then
    ``results`` are ``outs`` (or zeros). See :func:`parse_host` for ERROR/SKIP with ``strict``.
    """
    layout = [(n, tuple(int(d) for d in s)) for n, s in layout]
    numels = [wire.layout_numel(s) for _, s in layout]
    if out_dtypes is None:
        out_dtypes = [o.dtype for o in outs] if outs is not None else [tf.float32] * len(layout)
    gathered = tf.reshape(tf.cast(gathered, tf.uint8), [-1])

    def _parse_fn(g, f):
        return parse_host(g, layout, n_ranks, bool(f), single, strict)

    code, table = tf.numpy_function(_parse_fn, [gathered, tf.cast(failed, tf.bool)],
                                    [tf.int32, tf.int64], stateful=True, name="sbc_parse")
    code.set_shape([])
    table.set_shape([n_ranks * len(layout), N_COLS])
    e_tensor, e_rank, pos, value, bits, stats = _streams(gathered, table)

    def _check_fn(g, c, st):
        return check_stats_host(g, c, st, layout, n_ranks, single)

    ok = tf.numpy_function(_check_fn, [gathered, code, stats], tf.int32, stateful=True,
                           name="sbc_verdict")
    with tf.control_dependencies([ok]):
        e_tensor = tf.identity(e_tensor)
    parts = tf.dynamic_partition(tf.range(tf.size(e_tensor)), tf.cast(e_tensor, tf.int32),
                                 max(1, len(layout)))
    results = []
    for t, ((name, shape), numel, dt) in enumerate(zip(layout, numels, out_dtypes)):
        sel = parts[t]
        p_t = tf.gather(pos, sel)
        if single:
            dense = tf.scatter_nd(p_t[:, None], tf.gather(bits, sel), [numel])
            results.append(tf.bitcast(dense, tf.float32))
            continue
        r_t = tf.gather(e_rank, sel)
        u, uidx = tf.unique(p_t, out_idx=tf.int64)
        base = None if outs is None else tf.reshape(outs[t], [-1])
        if dt == tf.float32:
            # float32 in bits: x + y as float32(float64(x) + float64(y)) (exact: float64 holds
            # 2 x 24 + 2 bits, so the double rounding is innocuous) with integer conversions, so
            # subnormal values and sums are not flushed to zero as TF's float32 add would
            add = f64_to_f32_bits(tf.gather(value, sel) * scale)
            base_bits = None if base is None else tf.bitcast(base, tf.int32)
            acc = (tf.zeros(tf.shape(u), tf.int32) if base is None else
                   tf.gather(base_bits, u))
            for r in range(n_ranks):  # rank order at every position (unique within one rank)
                mine = tf.equal(r_t, r)
                idx = tf.boolean_mask(uidx, mine)
                cur = f32_bits_to_f64(tf.gather(acc, idx))
                new = f64_to_f32_bits(cur + f32_bits_to_f64(tf.boolean_mask(add, mine)))
                acc = tf.tensor_scatter_nd_update(acc, idx[:, None], new)
            if base is None:
                flat = tf.bitcast(tf.scatter_nd(u[:, None], acc, [numel]), tf.float32)
            else:
                flat = tf.bitcast(tf.tensor_scatter_nd_update(base_bits, u[:, None], acc),
                                  tf.float32)
            results.append(flat)
            continue
        add = _to_dtype(tf.gather(value, sel) * scale, dt)
        acc = tf.zeros(tf.shape(u), dt) if base is None else tf.gather(base, u)
        for r in range(n_ranks):
            mine = tf.equal(r_t, r)
            acc = tf.tensor_scatter_nd_add(acc, tf.boolean_mask(uidx, mine)[:, None],
                                           tf.boolean_mask(add, mine))
        if base is None:
            flat = tf.scatter_nd(u[:, None], acc, [numel])
        else:
            flat = tf.tensor_scatter_nd_update(base, u[:, None], acc)
        results.append(flat)
    return code, results


def decode_messages(gathered, layout, n_ranks, outs=None, scale=1.0, out_dtypes=None,
                    single=False):
    """Only the results of :func:`decode_gathered` (strict: ERROR/SKIP raise ``PeerError``)."""
    return decode_gathered(gathered, layout, n_ranks, outs, scale, out_dtypes, False, single)[1]
