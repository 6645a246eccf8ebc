"""The TF-ops backend's accumulation: ``outs`` (or zeros) plus ``float32(float64(value) * scale)``
of every rank at its positions, rank after rank at every element (the protocol's arithmetic, as
:func:`horovod_sbc.reference.accumulate_np`), so every rank gets the same bits.

Two ways to reach those bits, both taking the elements :func:`.streams.decode` produced:

* :func:`by_rank_masks` — a step of *binary* messages only (one value per message) into fresh
  float32 zeros, at most :data:`MAX_MASK_RANKS` ranks. The value a rank adds at a position then
  depends only on the rank and the tensor, so the rank-ordered sum at a position depends only on
  *which* ranks sent it: a mask of up to 8 bits. A table ``[tensor, mask]`` of the exact sums
  (2**n_ranks entries per tensor, computed on bit patterns by
  :func:`.bits.add_f32_bits`, subnormal values and sums included) replaces any sort or
  per-rank pass over the positions. The masks come from dense per-rank byte masks OR-ed as
  64-bit words when positions are many (``positions * SORT_FACTOR >= elements``), else from a
  sort of the (position, rank) pairs; one ``SparseToDense`` writes the results (a position
  several ranks sent is written several times, always with the same bits). O(positions), plus
  ``n_ranks`` byte fills of the layout with dense masks.
* :func:`fold` — everything else (SIGNS, VALUES and ALL messages, more ranks, float64 outputs,
  accumulating into ``outs``): one sort of every rank's keys (position-major, rank order within
  a position), a compact fold that adds rank after rank where several ranks sent a position,
  then one scatter per tensor; tensors too large for the sort key take one scatter per rank.

:func:`.decoder.decode` takes the first when the static conditions (:func:`masks_fit`) hold and
the parsed table says every message is binary (:func:`binary_step`), else the second.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from . import graphs
from .bits import add_f32_bits, f32_bits_to_f64, f64_to_f32_bits
from .streams import element_bits
from .table import C_COUNT, C_KIND, C_NEG, C_TENSOR, C_VBITS, K_BINARY, N_COLS

MAX_MASK_RANKS = 8       # masks are uint8
SORT_FACTOR = 32
"""The masks come from a sort of the positions when ``positions * SORT_FACTOR < elements``, else
from dense per-rank masks: a sort's cost per position is about this many times the dense masks'
cost per element of the layout (on one CPU thread; docs/tensorflow.md). Read while tracing;
tests set it to force either way."""

_SIGN32 = -2 ** 31


def _excl(x: tf.Tensor) -> tf.Tensor:
    return tf.cumsum(x, exclusive=True)


def masks_fit(numels: Sequence[int], n_ranks: int, outs, out_dtypes) -> bool:
    """The static conditions of :func:`by_rank_masks` (known while tracing): fresh float32
    outputs, 1 to :data:`MAX_MASK_RANKS` ranks, int32 keys (``n_ranks * sum(numel) < 2**31``)."""
    return (outs is None and 1 <= n_ranks <= MAX_MASK_RANKS and len(numels) > 0
            and all(dt == tf.float32 for dt in out_dtypes)
            and n_ranks * max(1, sum(numels)) < (1 << 31))


def binary_step(table: tf.Tensor) -> tf.Tensor:
    """bool scalar: every message of the parsed step is binary (or empty)."""
    return tf.reduce_all(tf.logical_or(tf.equal(table[:, C_COUNT], 0),
                                       tf.equal(table[:, C_KIND], K_BINARY)))


# ----------------------------------------------------------------------------------------------
# by rank masks
# ----------------------------------------------------------------------------------------------
def _sum_table(table: tf.Tensor, n_ranks: int, n_t: int, scale) -> tf.Tensor:
    """int32 [n_t << n_ranks]: entry ``(t << n_ranks) | mask`` holds the float32 bits of
    ``((0 + v[r0, t]) + v[r1, t]) + ...`` over the ranks r0 < r1 < ... set in ``mask``, with
    ``v[r, t] = float32(float64(value) * scale)`` (signed) of rank r's message for tensor t —
    the protocol's decoded arithmetic, exact also for subnormal values and sums."""
    vb = tf.cast(table[:, C_VBITS], tf.int32)
    if not (isinstance(scale, float) and scale == 1.0):
        vb = f64_to_f32_bits(f32_bits_to_f64(vb) * scale)
    vb = tf.where(table[:, C_NEG] > 0, tf.bitwise.bitwise_or(vb, tf.constant(_SIGN32, tf.int32)),
                  vb)
    v = tf.reshape(vb, [n_ranks, n_t])
    size = 1 << n_ranks
    m = np.arange(size, dtype=np.int64)
    acc = tf.zeros([n_t * size], tf.int32)
    for rk in range(n_ranks):
        sel = tf.constant(np.tile((m >> rk) & 1, n_t).astype(bool))
        add = tf.reshape(tf.tile(v[rk][:, None], [1, size]), [-1])
        acc = tf.where(sel, add_f32_bits(acc, add), acc)
    return acc


def _dense_masks(msg, first, c_total, key32, total, n_t: int, n_ranks: int):
    """Many positions: a dense uint8 mask per rank, OR-ed as words; each element reads its
    position's mask back. Returns (keys, table index of each key)."""
    padded = tf.cast((tf.maximum(total, 1) + 7) // 8 * 8, tf.int32)  # total < 2**31
    bounds = tf.cast(tf.concat([first[::n_t], [c_total]], 0), tf.int32)
    words = None
    for rk in range(n_ranks):  # rank rk's elements are bounds[rk]:bounds[rk + 1]
        d = tf.raw_ops.SparseToDense(
            sparse_indices=key32[bounds[rk]:bounds[rk + 1]], output_shape=tf.reshape(padded, [1]),
            sparse_values=tf.constant(1 << rk, tf.uint8),
            default_value=tf.constant(0, tf.uint8), validate_indices=False)
        w = tf.bitcast(tf.reshape(d, tf.stack([padded // 8, 8])), tf.uint64)
        words = w if words is None else tf.bitwise.bitwise_or(words, w)
    masks = tf.reshape(tf.bitcast(words, tf.uint8), [-1])
    m = tf.cast(tf.gather(masks, key32), tf.int64)
    if n_t > 1:
        t_of = tf.tile(tf.range(n_t, dtype=tf.int64), [n_ranks])  # tensor of each message
        m = m + tf.gather(tf.bitwise.left_shift(t_of, n_ranks), msg)
    return key32, m


def _sorted_masks(msg, key32, offs, n_t: int, n_ranks: int):
    """Few positions: the (key, rank) pairs sorted, one mask per distinct key."""
    rank_of = tf.repeat(tf.range(n_ranks, dtype=tf.int64), n_t)  # rank of each message
    sk = tf.sort(tf.cast(key32, tf.int64) * 8 + tf.gather(rank_of, msg))
    k = tf.bitwise.right_shift(sk, 3)
    first_one = tf.fill(tf.reshape(tf.minimum(tf.size(k), 1), [1]), True)  # [] if none
    new = tf.concat([first_one, tf.not_equal(k[1:], k[:-1])], 0)
    seg = tf.cumsum(tf.cast(new, tf.int32)) - 1
    # int32 (a mask of <= 8 ranks): TensorFlow has no GPU kernel for int64 segment sums
    m = tf.cast(tf.math.segment_sum(tf.bitwise.left_shift(
        1, tf.cast(tf.bitwise.bitwise_and(sk, 7), tf.int32)), seg), tf.int64)
    uk = tf.cast(tf.boolean_mask(k, new), tf.int32)
    if n_t > 1:
        t = tf.searchsorted(tf.cast(offs[1:], tf.int32), uk, side="right", out_type=tf.int64)
        m = m + tf.bitwise.left_shift(t, n_ranks)
    return uk, m


_MASK_GRAPHS: dict = {}


def _mask_graph(n_t: int, n_ranks: int, unit_scale: bool, sort_factor: int):
    """:func:`by_rank_masks` for ``n_t`` tensors and ``n_ranks`` ranks as one graph function,
    traced once per process and kind (sizes, offsets and scale are its inputs)."""
    key = (n_t, n_ranks, unit_scale, sort_factor)
    if key in _MASK_GRAPHS:
        return _MASK_GRAPHS[key]

    def sums(key32, msg, table, offs, total, scale):
        count = table[:, C_COUNT]
        first, c_total = _excl(count), tf.reduce_sum(count)
        table_bits = _sum_table(table, n_ranks, n_t, 1.0 if unit_scale else scale)
        if n_ranks == 1:
            keys, idx = key32, tf.gather(tf.range(n_t, dtype=tf.int64) * 2 + 1, msg)  # mask 1
        else:
            keys, idx = tf.cond(
                c_total * sort_factor < total,
                lambda: _sorted_masks(msg, key32, offs, n_t, n_ranks),
                lambda: _dense_masks(msg, first, c_total, key32, total, n_t, n_ranks))
        shape = tf.cast(tf.reshape(tf.maximum(total, 1), [1]), tf.int32)  # total < 2**31
        dense = tf.raw_ops.SparseToDense(
            sparse_indices=keys, output_shape=shape, sparse_values=tf.gather(table_bits, idx),
            default_value=tf.constant(0, tf.int32), validate_indices=False)
        return tf.bitcast(dense, tf.float32)[:total]

    spec = tf.TensorSpec
    _MASK_GRAPHS[key] = graphs.shared(sums, (
        spec([None], tf.int32), spec([None], tf.int32), spec([None, N_COLS], tf.int64),
        spec([n_t], tf.int64), spec([], tf.int64), spec([], tf.float64)))
    return _MASK_GRAPHS[key]


def by_rank_masks(key: tf.Tensor, msg: tf.Tensor, table: tf.Tensor, numels: Sequence[int],
                  n_ranks: int, scale: float) -> List[tf.Tensor]:
    """Flat float32 results of a binary step (see the module docstring; :func:`masks_fit`)."""
    n_t, total = len(numels), int(sum(numels))
    offs = tf.constant(np.concatenate([[0], np.cumsum(numels, dtype=np.int64)[:-1]]), tf.int64)
    sums = _mask_graph(n_t, n_ranks, scale == 1.0, SORT_FACTOR)
    dense = tf.reshape(sums(tf.cast(key, tf.int32), msg, table, offs,
                            tf.constant(total, tf.int64), tf.constant(scale, tf.float64)),
                       [total])
    if n_t == 1:
        return [dense]
    return tf.split(dense, list(numels)) if total else [dense[:0] for _ in numels]


# ----------------------------------------------------------------------------------------------
# the fold
# ----------------------------------------------------------------------------------------------
def _scaled_f32_bits(bits, own, msg, table, scale) -> tf.Tensor:
    """int32 [C]: bits of ``float32(float64(value) * scale)`` per element (the protocol's
    decoded arithmetic), a message's value computed once per message."""
    if isinstance(scale, float) and scale == 1.0:
        return bits  # float64(v) * 1 rounds back to v exactly
    msg_bits = f64_to_f32_bits(f32_bits_to_f64(tf.cast(table[:, C_VBITS], tf.int32)) * scale)
    sign = tf.bitwise.bitwise_and(bits, tf.constant(_SIGN32, tf.int32))
    per_msg = tf.bitwise.bitwise_or(tf.gather(msg_bits, msg), sign)

    def own_values():
        idx = tf.reshape(tf.where(own), [-1])
        conv = f64_to_f32_bits(f32_bits_to_f64(tf.gather(bits, idx)) * scale)
        return tf.tensor_scatter_nd_update(per_msg, idx[:, None], conv)

    return tf.cond(tf.reduce_any(own), own_values, lambda: per_msg)


def _fold_keys(p: tf.Tensor, a: tf.Tensor, n_ranks: int, base, add):
    """``(u, acc)``: the distinct keys ``u`` (sorted) of ``p`` (all ranks' keys, rank after
    rank) and at each the rank-ordered sum ``((base(u) + a_r0) + a_r1) + ...`` of the values
    ``a`` there (``add`` is the element-wise addition; ``base`` a function of ``u`` giving the
    initial values, or None for zeros). Compact: nothing here is O(numel)."""
    c = tf.size(p, out_type=tf.int64)
    # sort by (key, element index): element indices are rank-major, so equal keys come out in
    # rank order. key * c + i < numel * c <= numel**2 * n_ranks < 2**63 (see _fold)
    key = tf.sort(p * c + tf.range(c, dtype=tf.int64))
    elem = key % tf.maximum(c, 1)
    sp, sa = tf.gather(p, elem), tf.gather(a, elem)
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
        acc, first = base(u), 0
    for j in range(first, n_ranks):  # the j-th rank present at each key
        seg = tf.reshape(tf.where(lens > j), [-1])
        cur = tf.gather(acc, seg)
        acc = tf.tensor_scatter_nd_update(acc, seg[:, None],
                                          add(cur, tf.gather(sa, tf.gather(starts, seg) + j)))
    return u, acc


def _fold_tensors(key, adds, numels: tf.Tensor, n_ranks: int, bases, add):
    """Dense flat results of several tensors at once: ``key`` are keys (tensor offset +
    position, rank after rank; the tensors' offsets contiguous from 0), ``adds`` their values
    (one dtype), ``numels`` (int64 ``[n]``) the sizes, ``bases`` the initial tensors (or None:
    zeros). One sort and one rank-ordered fold for all, then one scatter per tensor."""
    n = int(numels.shape[0])
    offs = tf.concat([[tf.constant(0, tf.int64)], tf.cumsum(numels)], 0)

    def split(u):  # [start, end) of each tensor's keys in the sorted u
        return tf.searchsorted(u, offs, side="left")

    base_fn = None
    if bases is not None:
        def base_fn(u):
            bd = split(u)
            return tf.concat([tf.gather(bases[t], u[bd[t]:bd[t + 1]] - offs[t])
                              for t in range(n)], 0)

    u, acc = _fold_keys(key, adds, n_ranks, base_fn, add)
    bd = split(u)
    out = []
    for t in range(n):
        p = (u[bd[t]:bd[t + 1]] - offs[t])[:, None]
        v = acc[bd[t]:bd[t + 1]]
        out.append(tf.scatter_nd(p, v, tf.reshape(numels[t], [1])) if bases is None else
                   tf.tensor_scatter_nd_update(bases[t], p, v))
    return out


_FOLD_GRAPHS: dict = {}


def _fold_graph(n_t: int, n_ranks: int, dtypes: Tuple[str, ...], has_outs: bool,
                unit_scale: bool):
    """:func:`fold` for any layout of ``n_t`` tensors with these output dtypes, as one graph
    function traced once per process and kind (sizes, scale and outputs are its inputs)."""
    key = (n_t, n_ranks, dtypes, has_outs, unit_scale)
    if key in _FOLD_GRAPHS:
        return _FOLD_GRAPHS[key]
    out_dtypes = [tf.as_dtype(d) for d in dtypes]

    def run(buf, keys, msg, table, numels, scale, outs):
        bits, own = element_bits(buf, table, msg)
        add32 = (_scaled_f32_bits(bits, own, msg, table, 1.0 if unit_scale else scale)
                 if tf.float32 in out_dtypes else None)
        add64 = (f32_bits_to_f64(bits) * scale
                 if any(dt != tf.float32 for dt in out_dtypes) else None)
        e_tensor = tf.gather(table[:, C_TENSOR], msg)
        offs = _excl(numels)
        results: List[Optional[tf.Tensor]] = [None] * n_t
        for dt in sorted(set(out_dtypes), key=lambda x: x.name):  # one fold per output dtype
            ts = [t for t in range(n_t) if out_dtypes[t] == dt]
            idx = None if len(ts) == n_t else tf.reshape(tf.where(tf.reduce_any(tf.equal(
                e_tensor[:, None], tf.constant(ts, tf.int64)), 1)), [-1])
            pick = (lambda x: x) if idx is None else (lambda x: tf.gather(x, idx))
            if dt == tf.float32:
                adds, add, view = pick(add32), add_f32_bits, lambda x: tf.bitcast(x, tf.int32)
            else:
                adds, add, view = tf.cast(pick(add64), dt), tf.add, lambda x: x
            # keys of a subset of tensors: renumber their offsets to be contiguous
            ts_t = tf.constant(ts, tf.int64)
            sub_numels = tf.gather(numels, ts_t)
            remap = tf.scatter_nd(ts_t[:, None], _excl(sub_numels) - tf.gather(offs, ts_t), [n_t])
            k = pick(keys) + tf.gather(remap, pick(e_tensor))
            bases = [view(outs[t]) for t in ts] if has_outs else None
            for t, o in zip(ts, _fold_tensors(k, adds, sub_numels, n_ranks, bases, add)):
                results[t] = tf.bitcast(o, tf.float32) if dt == tf.float32 else o
        return results

    spec = tf.TensorSpec
    _FOLD_GRAPHS[key] = graphs.shared(run, (
        spec([None], tf.uint8), spec([None], tf.int64), spec([None], tf.int32),
        spec([None, N_COLS], tf.int64), spec([n_t], tf.int64), spec([], tf.float64),
        [spec([None], dt) for dt in out_dtypes] if has_outs else []))
    return _FOLD_GRAPHS[key]


def _per_rank(buf, key, msg, table, numels, n_ranks, scale, outs, out_dtypes):
    """One scatter per rank and tensor: tensors too large for the fold's int64 sort key."""
    bits, own = element_bits(buf, table, msg)
    add32 = _scaled_f32_bits(bits, own, msg, table, scale) if tf.float32 in out_dtypes else None
    add64 = f32_bits_to_f64(bits) * scale
    offs = np.concatenate([[0], np.cumsum(numels, dtype=np.int64)[:-1]])
    count = table[:, C_COUNT]
    first = _excl(count)
    results = []
    for t, (numel, dt) in enumerate(zip(numels, out_dtypes)):
        base = None if outs is None else tf.reshape(outs[t], [-1])
        if dt == tf.float32:
            adds, add = add32, add_f32_bits
            out = tf.zeros([numel], tf.int32) if base is None else tf.bitcast(base, tf.int32)
        else:
            adds, add = tf.cast(add64, dt), tf.add
            out = tf.zeros([numel], dt) if base is None else base
        for r in range(n_ranks):
            i = r * len(numels) + t
            lo, hi = first[i], first[i] + count[i]
            p = key[lo:hi] - int(offs[t])
            out = tf.tensor_scatter_nd_update(out, p[:, None],
                                              add(tf.gather(out, p), adds[lo:hi]))
        results.append(tf.bitcast(out, tf.float32) if dt == tf.float32 else out)
    return results


def fold(buf: tf.Tensor, key: tf.Tensor, msg: tf.Tensor, table: tf.Tensor,
         numels: Sequence[int], n_ranks: int, scale: float, outs, out_dtypes) -> List[tf.Tensor]:
    """Flat results of any step (see the module docstring) in ``out_dtypes``, onto ``outs``
    (flat tensors) or zeros."""
    total = sum(numels)
    if total * total * n_ranks >= 1 << 62:  # the fold's int64 sort key could overflow
        return _per_rank(buf, key, msg, table, numels, n_ranks, scale, outs, out_dtypes)
    run = _fold_graph(len(numels), n_ranks, tuple(dt.name for dt in out_dtypes),
                      outs is not None, scale == 1.0)
    res = run(buf, key, msg, table, tf.constant(numels, tf.int64),
              tf.constant(scale, tf.float64),
              [] if outs is None else [tf.reshape(o, [-1]) for o in outs])
    return [tf.reshape(r, [n]) for r, n in zip(res, numels)]
