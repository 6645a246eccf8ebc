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
   same order as :func:`horovod_sbc.reference.accumulate_np`, so all ranks agree).

Three ways through steps 2-4, chosen by a ``tf.cond`` on the parsed headers:

* the **kernel ops** (:mod:`horovod_sbc.tensorflow.backend.native`) when every message is binary SBC
  (or empty), the outputs are float32 and the buffer is on the CPU: one op decodes the streams'
  statistics and positions (C), the host verdict as below, one op adds every rank's values in
  rank order (C; IEEE subnormals kept);

* the **binary fast path** (:mod:`horovod_sbc.tensorflow.backend.binary`) when every message is binary
  SBC (or empty), the outputs are fresh float32 zeros and there are at most 8 ranks: the one
  bits are located once, positions come from one running sum, and the rank-ordered float32
  sums come from a small exact table indexed by which ranks sent a position (no sort of all
  positions unless there are few, no per-rank fold);
* the **general path** below (:func:`_streams`, :func:`_accumulate_all`) for everything else
  (ternary, top-k values, signSGD, float64 outputs, accumulating into ``outs``).

Cost: the fast path's work is a few integer ops per decoded position plus one pass over the
layout's elements (the dense masks); the general path adds a sort of all ranks' positions and
TensorFlow's scatter. The host steps are O(messages). ``benchmarks/bench_tf_codec.py`` measures
both against a ``tf.add`` of the same size.

Errors: ``ValueError`` raised by the host steps (``InvalidArgumentError`` with the same text
inside ``tf.function``).
"""
from __future__ import annotations

import enum

import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ... import protocol, wire
from . import binary, graphs, native
from .bits import add_f32_bits, f32_bits_to_f64, f64_to_f32_bits  # noqa: F401
from .table import (C_B, C_COUNT, C_KIND, C_NEG, C_NUMEL, C_RANK, C_RBYTES, C_RSTART,  # noqa: F401
                    C_SBYTES, C_SSTART, C_TENSOR, C_UBYTES, C_USTART, C_VBITS, C_VSTART,
                    K_ALL_SIGNS, K_ALL_VALUES, K_BINARY, K_SIGNS, K_VALUES, N_COLS)

_SIGN32 = -2 ** 31

# the verdict codes (shared with exchange.py)
class SyncCode(enum.IntEnum):
    """What a decode tells the caller to do with its residuals (an int32 inside graphs)."""
    COMMIT = 0            # the sync succeeded: subtract what was sent
    SKIP_KEEP_UPDATE = 1  # a rank asked to skip: healthy ranks keep R + dW in the residual
    SKIP_DROP_UPDATE = 2  # ... and the rank that failed to encode drops its update


COMMIT, SKIP_KEEP_UPDATE, SKIP_DROP_UPDATE = (SyncCode.COMMIT, SyncCode.SKIP_KEEP_UPDATE,
                                              SyncCode.SKIP_DROP_UPDATE)

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


def be_words(buf: tf.Tensor) -> tf.Tensor:
    """uint64 big-endian words of ``buf`` (uint8, zero padded to whole words plus one spare word):
    word w holds bytes 8w..8w+7 most significant first (O(message bytes), once per decode)."""
    n = tf.size(buf, out_type=tf.int64)
    padded = tf.concat([buf, tf.zeros(tf.reshape(16 - n % 8, [1]), tf.uint8)], 0)
    return tf.bitcast(tf.reverse(tf.reshape(padded, [-1, 8]), [1]), tf.uint64)


def read_fields(words: tf.Tensor, bit_start: tf.Tensor, width: tf.Tensor) -> tf.Tensor:
    """int64 fields of ``width`` (0..62, per element) bits at ``bit_start`` (MSB first) of the
    stream whose :func:`be_words` are ``words``: two word gathers and a few shifts each."""
    w = tf.bitwise.right_shift(bit_start, 6)
    off = tf.cast(tf.bitwise.bitwise_and(bit_start, 63), tf.uint64)
    w0, w1 = tf.gather(words, w), tf.gather(words, w + 1)
    top = tf.bitwise.left_shift(w0, off)
    # w1 >> (64 - off), written so that no shift reaches 64 (off == 0 adds nothing)
    top = tf.bitwise.bitwise_or(top, tf.bitwise.right_shift(
        tf.bitwise.right_shift(w1, tf.cast(63, tf.uint64) - off), tf.cast(1, tf.uint64)))
    wd = tf.cast(tf.clip_by_value(width, 1, 64), tf.uint64)
    val = tf.bitcast(tf.bitwise.right_shift(top, tf.cast(64, tf.uint64) - wd), tf.int64)
    return tf.where(width > 0, val, tf.zeros_like(val))


def _bits_at(buf: tf.Tensor, bit: tf.Tensor) -> tf.Tensor:
    byte = tf.cast(tf.gather(buf, tf.bitwise.right_shift(bit, 3)), tf.int64)
    return tf.bitwise.bitwise_and(tf.bitwise.right_shift(byte, 7 - tf.bitwise.bitwise_and(bit, 7)),
                                  1)


@dataclass
class _Decoded:
    """Step 2's output: elements (one per declared position) of all messages, message-major in
    canonical (rank, tensor) order, so each message's elements are one contiguous slice."""
    start: tf.Tensor    # int64 [M]: first element of each message
    count: tf.Tensor    # int64 [M]
    pos: tf.Tensor      # int64 [C]
    bits: tf.Tensor     # int32 [C]: float32 bit pattern of the decoded value, sign included
    is_val: tf.Tensor   # bool [C]: a VALUES element (its own float), else the message's value
    stats: tf.Tensor    # int64 [M, 8]: protocol.StreamStats rows


def _streams(buf: tf.Tensor, table: tf.Tensor) -> _Decoded:
    """Step 2: positions, value bits and the per-message statistics of all messages at once.

    The ops depend on no layout, so they are one graph function traced once per process and
    called by every decode (every gradient of the stock tape, every ``tf.function``), instead
    of a few hundred ops built again for each."""
    return _Decoded(*_streams_graph(buf, table))


def _streams_graph(buf: tf.Tensor, table: tf.Tensor):
    m = tf.shape(table, out_type=tf.int64)[0]
    col = lambda c: table[:, c]  # noqa: E731
    count, b, kind = col(C_COUNT), col(C_B), col(C_KIND)
    is_all = kind >= K_ALL_SIGNS
    slack = tf.concat([buf, tf.zeros([16], tf.uint8)], 0)
    # unary streams of all messages: one bits -> quotients
    u_owner, u_byte, _ = _ranges(col(C_USTART), col(C_UBYTES))
    ubits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(
        tf.gather(buf, u_byte)[:, None], tf.constant([7, 6, 5, 4, 3, 2, 1, 0], tf.uint8)), 1)
    ones = tf.reshape(tf.where(tf.reshape(ubits, [-1]) > 0), [-1])
    one_msg = tf.gather(u_owner, tf.bitwise.right_shift(ones, 3))
    local = ones - 8 * tf.gather(_excl_cumsum(col(C_UBYTES)), one_msg)
    first = tf.concat([tf.fill(tf.reshape(tf.minimum(tf.size(ones, out_type=tf.int64), 1), [1]),
                               True), tf.not_equal(one_msg[1:], one_msg[:-1])], 0)
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
    n_q = tf.size(q_ones, out_type=tf.int64)
    j = tf.gather(_excl_cumsum(n_ones), e_msg) + e_i
    q = tf.gather(tf.concat([q_ones, tf.zeros_like(e_i)], 0),
                  tf.minimum(j, n_q + tf.size(e_i, out_type=tf.int64) - 1))
    q = tf.where(e_all, tf.zeros_like(q), q)
    r = read_fields(be_words(buf), tf.where(e_all, tf.zeros_like(e_i),
                                            8 * tf.gather(col(C_RSTART), e_msg) + e_i * e_b), e_b)
    step = tf.bitwise.left_shift(q, e_b) + r + 1
    cs = tf.cumsum(step)
    seg0 = tf.gather(_excl_cumsum(tf.math.unsorted_segment_sum(step, e_msg, m)), e_msg)
    pos = tf.where(e_all, e_i, cs - seg0 - 1)
    # values: the message's value, its sign bit per element (SIGNS), or each element's own float
    vbits = tf.cast(tf.gather(col(C_VBITS), e_msg), tf.int32)
    is_sign = tf.logical_or(tf.equal(e_kind, K_SIGNS), tf.equal(e_kind, K_ALL_SIGNS))
    is_val = tf.logical_or(tf.equal(e_kind, K_VALUES), tf.equal(e_kind, K_ALL_VALUES))

    def sign_bits():
        sbit = tf.where(is_sign, 8 * tf.gather(col(C_SSTART), e_msg) + e_i, tf.zeros_like(e_i))
        return tf.logical_and(is_sign, tf.equal(_bits_at(slack, sbit), 1))

    neg = tf.logical_or(tf.gather(col(C_NEG), e_msg) > 0,
                        tf.cond(tf.reduce_any(is_sign), sign_bits,
                                lambda: tf.zeros_like(is_sign)))

    def own_bits():
        vstart = tf.where(is_val, tf.gather(col(C_VSTART), e_msg) + 4 * e_i, tf.zeros_like(e_i))
        vb = tf.cast(tf.gather(slack, vstart[:, None] + tf.range(4, dtype=tf.int64)[None, :]),
                     tf.int64)
        own = tf.reduce_sum(tf.bitwise.left_shift(vb, tf.constant([0, 8, 16, 24], tf.int64)), 1)
        return tf.where(is_val, tf.bitcast(tf.cast(own, tf.uint32), tf.int32), vbits)

    bits = tf.cond(tf.reduce_any(is_val), own_bits, lambda: vbits)
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
        # tf.not_equal, not ``!=``: outside TF2 functions (a v1 graph) ``!=`` is Python identity
        return tf.cast(tf.logical_and(pad > 0, tf.not_equal(tf.bitwise.bitwise_and(
            last_byte(start, nbytes), mask), 0)), tf.int64)

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
    return _excl_cumsum(count), count, pos, bits, is_val, stats


_streams_graph = graphs.shared(_streams_graph, (tf.TensorSpec([None], tf.uint8),
                                                tf.TensorSpec([None, N_COLS], tf.int64)))


def _scaled_f32_bits(d: _Decoded, table: tf.Tensor, scale: float) -> tf.Tensor:
    """int32 [C]: bits of ``float32(float64(value) * scale)`` per element (the protocol's
    decoded arithmetic), the message's value computed once per message."""
    if isinstance(scale, float) and scale == 1.0:
        return d.bits  # float64(v) * 1 rounds back to v exactly
    e_msg = tf.repeat(tf.range(tf.size(d.count, out_type=tf.int64)), d.count)
    msg_bits = f64_to_f32_bits(f32_bits_to_f64(tf.cast(table[:, C_VBITS], tf.int32)) * scale)
    sign = tf.bitwise.bitwise_and(d.bits, tf.constant(_SIGN32, tf.int32))
    per_msg = tf.bitwise.bitwise_or(tf.gather(msg_bits, e_msg), sign)

    def own():
        idx = tf.reshape(tf.where(d.is_val), [-1])
        conv = f64_to_f32_bits(f32_bits_to_f64(tf.gather(d.bits, idx)) * scale)
        return tf.tensor_scatter_nd_update(per_msg, idx[:, None], conv)

    return tf.cond(tf.reduce_any(d.is_val), own, lambda: per_msg)


def _fold(p: tf.Tensor, a: tf.Tensor, n_ranks: int, base, add):
    """``(u, acc)``: the distinct keys ``u`` (sorted) of ``p`` (all ranks' positions, rank after
    rank) and at each the rank-ordered sum ``((base(u) + a_r0) + a_r1) + ...`` of the values
    ``a`` there (``add`` is the element-wise addition; ``base`` a function of ``u`` giving the
    initial values, or None for zeros). Compact: nothing here is O(numel)."""
    c = tf.size(p, out_type=tf.int64)
    # sort by (position, element index): element indices are rank-major, so equal positions
    # come out in rank order. pos * c + i < numel * c <= numel**2 * n_ranks < 2**63 (callers
    # use _chain for larger tensors).
    key = tf.sort(p * c + tf.range(c, dtype=tf.int64))
    elem = key % tf.maximum(c, 1)
    sp = tf.gather(p, elem)
    sa = tf.gather(a, elem)
    new = tf.concat([tf.fill(tf.reshape(tf.minimum(c, 1), [1]), True),
                     tf.not_equal(sp[1:], sp[:-1])], 0)
    starts = tf.reshape(tf.where(new), [-1])
    u = tf.gather(sp, starts)
    lens = tf.concat([starts[1:], tf.reshape(c, [1])], 0) - starts
    if base is None:  # 0 + a == a, except 0 + (-0) == +0
        acc = tf.gather(sa, starts)
        if a.dtype == tf.int32:
            acc = tf.where(tf.equal(acc, tf.constant(_SIGN32, tf.int32)), tf.zeros_like(acc), acc)
        else:
            acc = acc + tf.zeros_like(acc)
        first = 1
    else:
        acc = base(u)
        first = 0
    for j in range(first, n_ranks):  # the j-th rank present at each position
        seg = tf.reshape(tf.where(lens > j), [-1])
        cur = tf.gather(acc, seg)
        acc = tf.tensor_scatter_nd_update(acc, seg[:, None],
                                          add(cur, tf.gather(sa, tf.gather(starts, seg) + j)))
    return u, acc


def _accumulate_all(key, adds, numels: tf.Tensor, n_ranks: int, bases, add):
    """Dense flat results of several tensors at once: ``key`` are global positions (tensor
    offset + position, rank after rank), ``adds`` their values (one dtype), ``numels`` (int64
    ``[n]``, a tensor: one graph serves every layout of ``n`` tensors) their sizes, ``bases``
    the initial tensors (or None: zeros). One sort and one rank-ordered fold for all tensors,
    then one scatter per tensor (see :func:`_fold`); a few graph nodes per tensor."""
    n = int(numels.shape[0])
    offs = tf.concat([[_c64(0)], tf.cumsum(numels)], 0)

    def split(u):  # [start, end) of each tensor's keys in the sorted u
        return tf.searchsorted(u, offs, side="left")

    base_fn = None
    if bases is not None:
        def base_fn(u):
            bd = split(u)
            return tf.concat([tf.gather(bases[t], u[bd[t]:bd[t + 1]] - offs[t])
                              for t in range(n)], 0)

    u, acc = _fold(key, adds, n_ranks, base_fn, add)
    bd = split(u)
    out = []
    for t in range(n):
        p = (u[bd[t]:bd[t + 1]] - offs[t])[:, None]
        v = acc[bd[t]:bd[t + 1]]
        out.append(tf.scatter_nd(p, v, tf.reshape(numels[t], [1])) if bases is None else
                   tf.tensor_scatter_nd_update(bases[t], p, v))
    return out


def _accumulate(ps, adds, numel: int, base, add) -> tf.Tensor:
    """One tensor, one scatter per rank (for tensors too large for the sort key of
    :func:`_accumulate_all`)."""
    out = tf.zeros([numel], adds[0].dtype) if base is None else base
    for p, a in zip(ps, adds):
        out = tf.tensor_scatter_nd_update(out, p[:, None], add(tf.gather(out, p), a))
    return out


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

    def check(stats):  # step 3: the host verdict on the streams' statistics
        return tf.numpy_function(
            lambda g, c, st: check_stats_host(g, c, st, layout, n_ranks, single),
            [gathered, code, stats], tf.int32, stateful=True, name="sbc_verdict")

    def general():
        return _decode_general(gathered, table, check, layout, numels, n_ranks, outs, scale,
                               out_dtypes, single)

    mod = native.decoder_static_ok(gathered, numels, outs, out_dtypes, single)
    if mod is not None:  # the kernel ops (binary messages, CPU, float32)
        def kernel():
            return native.decode(mod, gathered, table, check, numels, outs, scale,
                                 (C_USTART, C_UBYTES, C_RSTART, C_RBYTES, C_COUNT, C_B, C_NUMEL),
                                 (C_TENSOR, C_COUNT, C_VBITS, C_NEG))

        # every step the stock-op binary path (binary.py) takes, the kernel takes too: it is
        # not traced here (a third branch made the first tf.function call ~2x slower)
        results = tf.cond(native.decoder_runtime_ok(table, (C_COUNT, C_KIND, C_B, K_BINARY,
                                                            K_ALL_SIGNS)), kernel, general)
        return code, list(results) if isinstance(results, (list, tuple)) else [results]
    if binary.static_ok(numels, n_ranks, outs, out_dtypes, single):
        def fast():
            return binary.decode(gathered, table, layout, numels, n_ranks, scale, check)

        results = tf.cond(binary.runtime_ok(gathered, table), fast, general)
        return code, list(results) if isinstance(results, (list, tuple)) else [results]
    return code, general()


def _decode_general(gathered, table, check, layout, numels, n_ranks, outs, scale, out_dtypes,
                    single) -> List[tf.Tensor]:
    """Steps 2-4 for any messages (ternary, values, ALL, float64 outputs, ``outs``)."""
    d = _streams(gathered, table)
    ok = check(d.stats)
    with tf.control_dependencies([ok]):  # nothing is added before the verdict passed
        pos = tf.identity(d.pos)
    n_t = len(layout)

    def piece(x, t, r):
        i = r * n_t + t
        return x[d.start[i]:d.start[i] + d.count[i]]

    if single:
        dense = tf.scatter_nd(piece(pos, 0, 0)[:, None], piece(d.bits, 0, 0), [numels[0]])
        return [tf.bitcast(dense, tf.float32)]
    total = sum(numels)
    if total * total * n_ranks < 1 << 62:  # the fold's int64 sort key cannot overflow
        fold = _fold_graph(n_t, n_ranks, tuple(dt.name for dt in out_dtypes), outs is not None,
                           scale == 1.0)
        res = fold(pos, d.bits, d.is_val, d.count, table, tf.constant(numels, tf.int64),
                   tf.constant(scale, tf.float64),
                   [] if outs is None else [tf.reshape(o, [-1]) for o in outs])
        return [tf.reshape(r, [n]) for r, n in zip(res, numels)]
    # one scatter per rank and tensor
    add32 = (_scaled_f32_bits(d, table, scale) if tf.float32 in out_dtypes else None)
    add64 = (f32_bits_to_f64(d.bits) * scale
             if any(dt != tf.float32 for dt in out_dtypes) else None)
    results: List[Optional[tf.Tensor]] = [None] * n_t
    for t, (numel, dt) in enumerate(zip(numels, out_dtypes)):
        base = None if outs is None else tf.reshape(outs[t], [-1])
        ps = [piece(pos, t, r) for r in range(n_ranks)]
        if dt == tf.float32:
            adds = [piece(add32, t, r) for r in range(n_ranks)]
            b32 = None if base is None else tf.bitcast(base, tf.int32)
            results[t] = tf.bitcast(_accumulate(ps, adds, numel, b32, add_f32_bits), tf.float32)
        else:
            adds = [tf.cast(piece(add64, t, r), dt) for r in range(n_ranks)]
            results[t] = _accumulate(ps, adds, numel, base, tf.add)
    return results


_FOLDS: dict = {}


def _fold_graph(n_t: int, n_ranks: int, dtypes: Tuple[str, ...], has_outs: bool,
                unit_scale: bool):
    """Step 4 of the general path for any layout of ``n_t`` tensors with these output dtypes,
    as one graph function traced once per process and kind: the sizes, the scale and the
    outputs are its inputs, so the stock tape's per-gradient decodes (and every
    ``tf.function``) call it instead of building it again."""
    key = (n_t, n_ranks, dtypes, has_outs, unit_scale)
    if key in _FOLDS:
        return _FOLDS[key]
    out_dtypes = [tf.as_dtype(d) for d in dtypes]

    def fold(pos, bits, is_val, count, table, numels, scale, outs):
        d = _Decoded(None, count, pos, bits, is_val, None)
        add32 = (_scaled_f32_bits(d, table, 1.0 if unit_scale else scale)
                 if tf.float32 in out_dtypes else None)
        add64 = (f32_bits_to_f64(bits) * scale
                 if any(dt != tf.float32 for dt in out_dtypes) else None)
        results: List[Optional[tf.Tensor]] = [None] * n_t
        e_tensor = tf.gather(table[:, C_TENSOR],
                             tf.repeat(tf.range(tf.size(count, out_type=tf.int64)), count))
        offs = _excl_cumsum(numels)
        key = pos + tf.gather(offs, e_tensor)
        for dt in sorted(set(out_dtypes), key=lambda x: x.name):  # one fold per output dtype
            ts = [t for t in range(n_t) if out_dtypes[t] == dt]
            if len(ts) < n_t:
                mine = tf.reduce_any(tf.equal(e_tensor[:, None], tf.constant(ts, tf.int64)), 1)
                idx = tf.reshape(tf.where(mine), [-1])
            else:
                idx = None
            pick = (lambda x: x) if idx is None else (lambda x: tf.gather(x, idx))
            if dt == tf.float32:
                adds, add, view = pick(add32), add_f32_bits, lambda x: tf.bitcast(x, tf.int32)
            else:
                adds, add, view = tf.cast(pick(add64), dt), tf.add, lambda x: x
            # keys of a subset of tensors: renumber their offsets to be contiguous
            ts_t = tf.constant(ts, tf.int64)
            sub_numels = tf.gather(numels, ts_t)
            remap = tf.scatter_nd(ts_t[:, None], _excl_cumsum(sub_numels) - tf.gather(offs, ts_t),
                                  [n_t])
            k = pick(key) + tf.gather(remap, pick(e_tensor))
            bases = None if not has_outs else [view(outs[t]) for t in ts]
            for t, o in zip(ts, _accumulate_all(k, adds, sub_numels, n_ranks, bases, add)):
                results[t] = tf.bitcast(o, tf.float32) if dt == tf.float32 else o
        return results

    sig = (tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int32),
           tf.TensorSpec([None], tf.bool), tf.TensorSpec([None], tf.int64),
           tf.TensorSpec([None, N_COLS], tf.int64), tf.TensorSpec([n_t], tf.int64),
           tf.TensorSpec([], tf.float64),
           [tf.TensorSpec([None], dt) for dt in out_dtypes] if has_outs else [])
    _FOLDS[key] = graphs.shared(fold, sig)
    return _FOLDS[key]


def decode_messages(gathered, layout, n_ranks, outs=None, scale=1.0, out_dtypes=None,
                    single=False):
    """Only the results of :func:`decode_gathered` (strict: ERROR/SKIP raise ``PeerError``)."""
    return decode_gathered(gathered, layout, n_ranks, outs, scale, out_dtypes, False, single)[1]

