"""The TF decoder's fast path: binary SBC messages of every rank, decoded and averaged at once.

:func:`horovod_sbc.tensorflow.backend.decoder.decode_gathered` takes this path (a ``tf.cond`` on
O(messages) values of the host parse) when every message of the step is *binary* (no SIGNS, no
VALUES, not ALL; or empty), its Rice parameter is at most :data:`MAX_RICE_B`, the gathered buffer
is below :data:`MAX_BUFFER` bytes, and — static conditions — the outputs are fresh float32 zeros
(no ``outs``), there are at most :data:`MAX_RANKS` ranks and ``n_ranks * sum(numel) < 2**31``.
Everything else (ternary, top-k values, signSGD, float64 outputs, accumulating into ``outs``)
takes the general path of ``decoder.py``; both reach the same verdicts and bits (pinned by
``tests/test_differential.py`` and ``tests/test_tf_codec.py``).

What makes it cheaper than the general path, per decoded position:

* **streams** — one ``tf.where`` over the unary bits gives every one bit's offset in the
  concatenated unary streams; element ``i`` of message ``m`` is its ``i``-th one bit (a remap
  only runs when some message's one-bit count differs from its header, i.e. on corrupt input).
  The quotient of an element is the number of zero bits since the previous one bit (at a
  message's first element: since the start of its stream), its message the owner of the byte
  the one bit lies in, its remainder one gather from 64-bit windows every 4 bytes
  (:func:`_read_fields30`), and the tensor offset + position of all elements one running sum of
  the gaps ``(q << b) + r + 1`` minus a per-message constant: per element ~20 int64 ops, three
  gathers, one cumsum — no per-kind branches, no sign or value streams.
* **statistics** (:class:`horovod_sbc.protocol.StreamStats`) — one bits per message by a binary
  search of the message's end in the sorted one-bit offsets (O(messages x log)), the largest
  quotient and remainder by sorted ``segment_max``, the largest position as the message's last
  (positions strictly increase: every gap is ``(q << b) + r + 1 >= 1``, and with ``b <= 30`` and
  a buffer below 256 MiB no int64 sum can wrap: a message's quotients sum to < 2**31, each
  remainder is < 2**30 and there are < 2**31 elements).
* **accumulation** — for binary messages the value a rank adds at a position depends only on the
  rank and the tensor, so the rank-ordered sum at a position depends only on *which* ranks sent
  it: a ``mask`` of up to 8 bits. A table ``[tensor, mask]`` of the exact rank-ordered float32
  sums (``horovod_sbc.protocol``'s arithmetic, computed on 2**n_ranks entries per tensor with
  :func:`horovod_sbc.tensorflow.backend.bits.add_f32_bits`, so subnormal values and sums stay exact)
  replaces the sort and the per-rank fold. With many positions (``positions * SORT_FACTOR >= elements``) the masks are
  written with one ``SparseToDense`` per rank into a dense uint8 vector and OR-ed as uint64
  words, and each position reads its mask back; with few, the (position, rank) pairs are sorted
  and each distinct position's mask is a segment sum. Then each position reads its table entry
  and one ``SparseToDense`` writes the results (a position several ranks sent may be written
  several times, always with the same bits, so the order of those writes does not matter).

O(numel) work: the output's zero fill, plus (dense masks only) ``n_ranks`` byte fills and word
ORs; the rest is O(positions).

Where the time goes (one CPU thread, 8 ranks x 1.25M positions into 25M elements): TensorFlow's
``Where`` over the unary bits, the running sum, ``SparseToDense`` and the gathers, at 3-7 ns per
element each; ~55 ns per decoded position in all.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import tensorflow as tf

from . import graphs, table as _t
from .bits import add_f32_bits, f32_bits_to_f64, f64_to_f32_bits

MAX_RANKS = 8            # masks are uint8
MAX_RICE_B = 30          # keeps every position sum inside int64 (see the module docstring)
MAX_BUFFER = 1 << 28     # bytes: unary bit offsets and element indices fit int32
SORT_FACTOR = 32
"""The masks come from a sort of the positions when ``positions * SORT_FACTOR < elements``, else
from dense per-rank masks (one CPU thread: a sort costs ~35 ns per position, the dense masks
~1.2 ns per element of the layout). Read while tracing; tests set it to force either way."""


def static_ok(numels: Sequence[int], n_ranks: int, outs, out_dtypes, single: bool) -> bool:
    """Can this decode take the fast path at all (decided while tracing)?"""
    return (not single and outs is None and 1 <= n_ranks <= MAX_RANKS and len(numels) > 0
            and all(dt == tf.float32 for dt in out_dtypes)
            and n_ranks * max(1, sum(numels)) < (1 << 31))


def runtime_ok(buf: tf.Tensor, table: tf.Tensor) -> tf.Tensor:
    """bool scalar: every message binary (or empty) with ``rice_b <= MAX_RICE_B``, and the buffer
    small enough (O(messages) ops on the parsed header table)."""
    count, b, kind = table[:, _t.C_COUNT], table[:, _t.C_B], table[:, _t.C_KIND]
    binary = tf.logical_or(tf.equal(count, 0), tf.logical_and(tf.equal(kind, _t.K_BINARY),
                                                                b <= MAX_RICE_B))
    return tf.logical_and(tf.reduce_all(binary),
                          tf.size(buf, out_type=tf.int64) < MAX_BUFFER)


def _excl(x: tf.Tensor) -> tf.Tensor:
    return tf.cumsum(x, exclusive=True)


def _owner(starts: tf.Tensor, total: tf.Tensor, n: int) -> tf.Tensor:
    """int32 [total]: for each index of a concatenation of ``n`` segments starting at ``starts``
    (int64, non-decreasing, ``starts[0] == 0``), the segment holding it (empty segments are
    skipped): a +1 at each later segment's start, then a running sum."""
    marks = tf.math.unsorted_segment_sum(tf.ones([n - 1], tf.int32), starts[1:], total + 1)
    return tf.cumsum(marks[:-1])


def _read_fields30(buf: tf.Tensor, bit_start: tf.Tensor, width: tf.Tensor) -> tf.Tensor:
    """int64 fields of ``width`` (0..30) bits at ``bit_start`` (MSB first) of ``buf``: one gather
    per field from 64-bit big-endian windows starting every 4 bytes (a field starts at most 31
    bits into its window and ends at most 61 bits in)."""
    n = tf.size(buf, out_type=tf.int64)
    padded = tf.concat([buf, tf.zeros(tf.reshape(12 - n % 4, [1]), tf.uint8)], 0)
    w32 = tf.cast(tf.bitcast(tf.reverse(tf.reshape(padded, [-1, 4]), [1]), tf.uint32), tf.uint64)
    windows = tf.bitwise.bitwise_or(tf.bitwise.left_shift(w32[:-1], tf.constant(32, tf.uint64)),
                                    w32[1:])
    w = tf.gather(windows, tf.bitwise.right_shift(bit_start, 5))
    # w >> (64 - off - width), in two steps so that no shift reaches 64 (width 0 gives 0)
    sh = tf.cast(63 - tf.bitwise.bitwise_and(bit_start, 31) - width, tf.uint64)
    v = tf.bitwise.right_shift(tf.bitwise.right_shift(w, sh), tf.constant(1, tf.uint64))
    v = tf.bitcast(v, tf.int64)
    return tf.bitwise.bitwise_and(v, tf.bitwise.left_shift(tf.constant(1, tf.int64), width) - 1)


class _Messages:
    """The host parse's columns of every message (canonical (rank, tensor) order), and the
    offsets that place each message's stream and tensor."""

    def __init__(self, buf, table: tf.Tensor, offs: tf.Tensor, n_t: int, n_ranks: int):
        """``offs``: int64 ``[n_t]``, each tensor's offset in the concatenated layout;
        ``buf`` may be None where the streams are not read."""
        self.n_t, self.n_ranks = n_t, n_ranks
        self.m = n_ranks * self.n_t
        col = lambda c: table[:, c]  # noqa: E731
        self.count, self.b = col(_t.C_COUNT), col(_t.C_B)
        self.ustart, self.ubytes = col(_t.C_USTART), col(_t.C_UBYTES)
        self.rstart, self.rbytes = col(_t.C_RSTART), col(_t.C_RBYTES)
        self.slack = None if buf is None else tf.concat([buf, tf.zeros([8], tf.uint8)], 0)
        self.ucum = _excl(self.ubytes)
        self.first = _excl(self.count)  # each message's first element
        self.c_total = tf.reduce_sum(self.count)
        self.offs = offs
        self.toff = tf.tile(offs, [n_ranks])  # tensor offset of each message


class _Elements:
    """Every decoded element: its message, quotient, remainder and key (tensor offset +
    position), and per message the one bits of its unary stream."""
    msg: tf.Tensor
    q: tf.Tensor
    r: tf.Tensor
    key: tf.Tensor
    ones: tf.Tensor
    unary_last_zero: tf.Tensor

    def per(self, x: tf.Tensor) -> tf.Tensor:
        """A per-message constant, per element."""
        return tf.gather(x, self.msg)


def _unary_ones(buf: tf.Tensor, ms: _Messages, el: _Elements):
    """The offset of every one bit in the concatenated unary streams (int64, increasing), and
    (in ``el``) each message's one bits and whether its last unary byte is zero; returns
    ``(offsets, owner message of each unary byte or None)``."""
    n_ub = tf.reduce_sum(ms.ubytes)
    u_own = None
    if ms.m > 1:
        u_own = _owner(ms.ucum, n_ub, ms.m)
        u_src = tf.range(n_ub, dtype=tf.int64) + tf.gather(ms.ustart - ms.ucum, u_own)
    else:
        u_src = tf.range(n_ub, dtype=tf.int64) + ms.ustart[0]
    ub = tf.gather(buf, u_src)
    bitmask = tf.constant([128, 64, 32, 16, 8, 4, 2, 1], tf.uint8)
    g = tf.reshape(tf.raw_ops.Where(condition=tf.reshape(
        tf.bitwise.bitwise_and(ub[:, None], bitmask), [-1])), [-1])
    # one bits per message: where each message's stream ends among the sorted offsets
    ends = tf.searchsorted(g, 8 * (ms.ucum + ms.ubytes), side="left", out_type=tf.int64)
    el.ones = ends - tf.concat([[tf.constant(0, tf.int64)], ends[:-1]], 0)
    last_u = tf.gather(ms.slack, tf.where(ms.ubytes > 0, ms.ustart + ms.ubytes - 1, 0))
    el.unary_last_zero = tf.logical_and(ms.ubytes > 0, tf.equal(last_u, 0))
    return g, u_own


def _elements(buf: tf.Tensor, ms: _Messages) -> _Elements:
    """Element i of message m takes the i-th one bit of m's unary stream: its quotient, its
    remainder field, and its key (tensor offset + position) from one running sum of the gaps."""
    el = _Elements()
    g, u_own = _unary_ones(buf, ms, el)

    def matched():  # valid input: the one bits are the elements, in order
        if ms.m == 1:
            return g, tf.zeros(tf.shape(g), tf.int32)
        return g, tf.gather(u_own, tf.bitwise.right_shift(g, 3))

    def remap():  # corrupt input only (the verdict rejects it); keeps the shapes valid
        i = tf.range(ms.c_total, dtype=tf.int64)
        e = _owner(ms.first, ms.c_total, ms.m) if ms.m > 1 else tf.zeros_like(i, tf.int32)
        j = tf.gather(_excl(el.ones) - ms.first, e) + i
        padded = tf.concat([g, tf.zeros([1], tf.int64)], 0)
        return tf.gather(padded, tf.clip_by_value(j, 0, tf.size(g, out_type=tf.int64))), e

    gi, el.msg = tf.cond(tf.reduce_all(tf.equal(el.ones, ms.count)), matched, remap)
    nonempty = tf.reshape(tf.where(ms.count > 0), [-1])
    first_ne = tf.gather(ms.first, nonempty)
    # quotients: zero bits between consecutive one bits; a message's first one counts from the
    # start of its stream
    q = gi - tf.concat([tf.constant([-1], tf.int64), gi[:-1]], 0) - 1
    el.q = tf.tensor_scatter_nd_update(q, first_ne[:, None], tf.gather(gi, first_ne)
                                       - 8 * tf.gather(ms.ucum, nonempty))
    # remainders: b and the field offset's base packed into one per-message constant
    packed = el.per((8 * ms.rstart - ms.first * ms.b) * 64 + ms.b)
    b_e = tf.bitwise.bitwise_and(packed, 63)
    i = tf.range(ms.c_total, dtype=tf.int64)
    el.r = _read_fields30(buf, tf.bitwise.right_shift(packed, 6) + i * b_e, b_e)
    s = tf.cumsum(tf.bitwise.left_shift(el.q, b_e) + el.r + 1)  # positions + 1, running
    s_before = tf.gather(tf.concat([[tf.constant(0, tf.int64)], s], 0), ms.first)
    el.key = s + el.per(ms.toff - s_before - 1)
    return el


def _stream_stats(ms: _Messages, el: _Elements) -> tf.Tensor:
    """int64 ``[M, 8]`` :class:`horovod_sbc.protocol.StreamStats` rows, one per message."""
    def seg_max(x):  # per message, 0 for empty ones (segments sorted by message)
        mx = tf.math.segment_max(x, el.msg)
        mx = tf.concat([mx, tf.zeros(tf.reshape(ms.m - tf.size(mx), [1]), x.dtype)], 0)
        return tf.maximum(mx, 0)

    has = ms.count > 0
    max_q, max_r = seg_max(el.q), seg_max(el.r)
    last = tf.gather(tf.concat([el.key, [tf.constant(0, tf.int64)]], 0),
                     tf.where(has, ms.first + ms.count - 1, ms.c_total))
    pos_max = tf.where(has, last - ms.toff, -1)
    pad = 8 * ms.rbytes - ms.count * ms.b
    last_r = tf.cast(tf.gather(ms.slack, tf.where(ms.rbytes > 0, ms.rstart + ms.rbytes - 1, 0)),
                     tf.int64)
    mask = tf.bitwise.left_shift(tf.constant(1, tf.int64), tf.clip_by_value(pad, 0, 8)) - 1
    rem_pad = tf.logical_and(pad > 0, tf.not_equal(tf.bitwise.bitwise_and(last_r, mask), 0))
    zero = tf.zeros_like(ms.count)
    return tf.stack([el.ones, tf.cast(el.unary_last_zero, tf.int64), max_q, max_r,
                     tf.cast(rem_pad, tf.int64), pos_max, zero, zero], 1)


def _dense_masks(ms: _Messages, el: _Elements, key32: tf.Tensor, total: tf.Tensor):
    """Many positions: a dense uint8 mask per rank, OR-ed as words; each element reads its
    position's mask back. Returns (keys, table index of each key)."""
    padded = tf.cast((tf.maximum(total, 1) + 7) // 8 * 8, tf.int32)  # total < 2**31
    bounds = tf.cast(tf.concat([ms.first[::ms.n_t], [ms.c_total]], 0), tf.int32)
    words = None
    for rk in range(ms.n_ranks):  # rank rk's elements are bounds[rk]:bounds[rk + 1]
        d = tf.raw_ops.SparseToDense(
            sparse_indices=key32[bounds[rk]:bounds[rk + 1]], output_shape=tf.reshape(padded, [1]),
            sparse_values=tf.constant(1 << rk, tf.uint8),
            default_value=tf.constant(0, tf.uint8), validate_indices=False)
        w = tf.bitcast(tf.reshape(d, tf.stack([padded // 8, 8])), tf.uint64)
        words = w if words is None else tf.bitwise.bitwise_or(words, w)
    masks = tf.reshape(tf.bitcast(words, tf.uint8), [-1])
    m = tf.cast(tf.gather(masks, key32), tf.int64)
    if ms.n_t > 1:
        t_of = tf.tile(tf.range(ms.n_t, dtype=tf.int64), [ms.n_ranks])  # tensor of each message
        m = m + el.per(tf.bitwise.left_shift(t_of, ms.n_ranks))
    return key32, m


def _sorted_masks(ms: _Messages, el: _Elements, key32: tf.Tensor):
    """Few positions: the (key, rank) pairs sorted, one mask per distinct key."""
    rank_of = tf.repeat(tf.range(ms.n_ranks, dtype=tf.int64), ms.n_t)  # rank of each message
    sk = tf.sort(tf.cast(key32, tf.int64) * 8 + el.per(rank_of))
    k = tf.bitwise.right_shift(sk, 3)
    first_one = tf.fill(tf.reshape(tf.minimum(tf.size(k), 1), [1]), True)  # [] if none
    new = tf.concat([first_one, tf.not_equal(k[1:], k[:-1])], 0)
    seg = tf.cumsum(tf.cast(new, tf.int32)) - 1
    m = tf.math.segment_sum(tf.bitwise.left_shift(tf.constant(1, tf.int64),
                                                  tf.bitwise.bitwise_and(sk, 7)), seg)
    uk = tf.cast(tf.boolean_mask(k, new), tf.int32)
    if ms.n_t > 1:
        t = tf.searchsorted(tf.cast(ms.offs[1:], tf.int32), uk, side="right",
                            out_type=tf.int64)
        m = m + tf.bitwise.left_shift(t, ms.n_ranks)
    return uk, m


def decode(buf: tf.Tensor, table: tf.Tensor, layout, numels: Sequence[int],
           n_ranks: int, scale: float, check_fn) -> List[tf.Tensor]:
    """Flat float32 results (zeros plus ``float32(float64(value) * scale)`` at every rank's
    positions, in rank order) of a step whose messages passed :func:`runtime_ok`.

    ``table`` is the host parse's int64 ``[n_ranks * len(layout), N_COLS]`` (canonical (rank,
    tensor) order); ``check_fn(stats)`` runs the host verdict on the int64 ``[M, 8]``
    :class:`horovod_sbc.protocol.StreamStats` rows and returns an op that must run (and pass)
    before anything is written. The streams and the sums are graph functions that take the
    sizes as inputs (:func:`_graphs`), so every layout of as many tensors shares them.
    """
    n_t, total = len(numels), int(sum(numels))
    offs = tf.constant(np.concatenate([[0], np.cumsum(numels, dtype=np.int64)[:-1]]), tf.int64)
    streams, sums = _graphs(n_t, n_ranks, scale == 1.0, SORT_FACTOR)
    key, msg, stats = streams(buf, table, offs)
    ok = check_fn(stats)
    with tf.control_dependencies([ok]):  # nothing is written before the verdict passed
        key32 = tf.cast(key, tf.int32)
    dense = tf.reshape(sums(key32, msg, table, offs, tf.constant(total, tf.int64),
                            tf.constant(scale, tf.float64)), [total])
    if n_t == 1:
        return [dense]
    return tf.split(dense, list(numels)) if total else [dense[:0] for _ in numels]


_GRAPHS: dict = {}


def _graphs(n_t: int, n_ranks: int, unit_scale: bool, sort_factor: int):
    """``(streams, sums)``: the decode's two halves for ``n_t`` tensors and ``n_ranks`` ranks,
    graph functions traced once per process and kind and kept out of line (``_noinline``), so
    that each decode (each gradient of the stock tape, each ``tf.function``) calls them instead
    of building and optimizing their few hundred ops again. ``sort_factor`` is
    :data:`SORT_FACTOR` when traced."""
    key = (n_t, n_ranks, unit_scale, sort_factor)
    if key in _GRAPHS:
        return _GRAPHS[key]

    def streams(buf, table, offs):
        ms = _Messages(buf, table, offs, n_t, n_ranks)
        el = _elements(buf, ms)
        return el.key, el.msg, _stream_stats(ms, el)

    def sums(key32, msg, table, offs, total, scale):
        ms = _Messages(None, table, offs, n_t, n_ranks)
        el = _Elements()
        el.msg = msg
        # the exact rank-ordered sums from a table indexed by which ranks sent a position
        table_bits = _sum_table(table, n_ranks, n_t, 1.0 if unit_scale else scale)
        if n_ranks == 1:
            keys, idx = key32, el.per(tf.range(n_t, dtype=tf.int64) * 2 + 1)  # mask 1
        else:
            keys, idx = tf.cond(ms.c_total * sort_factor < total,
                                lambda: _sorted_masks(ms, el, key32),
                                lambda: _dense_masks(ms, el, key32, total))
        bits = tf.gather(table_bits, idx)
        shape = tf.cast(tf.reshape(tf.maximum(total, 1), [1]), tf.int32)  # total < 2**31
        dense = tf.raw_ops.SparseToDense(
            sparse_indices=keys, output_shape=shape, sparse_values=bits,
            default_value=tf.constant(0, tf.int32), validate_indices=False)
        return tf.bitcast(dense, tf.float32)[:total]

    spec = tf.TensorSpec
    _GRAPHS[key] = (
        graphs.shared(streams, (spec([None], tf.uint8), spec([None, _t.N_COLS], tf.int64),
                                spec([n_t], tf.int64))),
        graphs.shared(sums, (spec([None], tf.int32), spec([None], tf.int32),
                             spec([None, _t.N_COLS], tf.int64), spec([n_t], tf.int64),
                             spec([], tf.int64), spec([], tf.float64))))
    return _GRAPHS[key]


def _sum_table(table: tf.Tensor, n_ranks: int, n_t: int, scale: float) -> tf.Tensor:
    """int32 [n_t << n_ranks]: entry ``(t << n_ranks) | mask`` holds the float32 bits of
    ``((0 + v[r0, t]) + v[r1, t]) + ...`` over the ranks r0 < r1 < ... set in ``mask``, with
    ``v[r, t] = float32(float64(value) * scale)`` (signed) of rank r's message for tensor t —
    the protocol's decoded arithmetic, exact also for subnormal values and sums."""
    vb = tf.cast(table[:, _t.C_VBITS], tf.int32)
    if not (isinstance(scale, float) and scale == 1.0):
        vb = f64_to_f32_bits(f32_bits_to_f64(vb) * scale)
    vb = tf.where(table[:, _t.C_NEG] > 0, tf.bitwise.bitwise_or(vb, tf.constant(-2 ** 31,
                                                                               tf.int32)), vb)
    v = tf.reshape(vb, [n_ranks, n_t])
    size = 1 << n_ranks
    m = np.arange(size, dtype=np.int64)
    acc = tf.zeros([n_t * size], tf.int32)
    for rk in range(n_ranks):
        sel = tf.constant(np.tile((m >> rk) & 1, n_t).astype(bool))
        add = tf.reshape(tf.tile(v[rk][:, None], [1, size]), [-1])
        acc = tf.where(sel, add_f32_bits(acc, add), acc)
    return acc
