"""The TF-ops backend's encoder: selection, binarization, residual and Golomb-Rice streams in
TensorFlow ops on the tensor's own device, eagerly and inside ``tf.function``.

Produces byte for byte the messages of the numpy reference (:mod:`horovod_sbc.reference`,
:mod:`horovod_sbc.wire`) and of the torch codec (pinned by ``tests/golden/``). Everything runs
as TF ops on the tensor's device, nothing on the host: the O(numel) and O(k) work (non-finite
check, per-block maxima, threshold sample, exact top-k among the candidates, fixed-order float64
tree sums of both sides, residual update, unary / remainder / sign streams, the tensor message
with its header, varints built with ``tf.bitwise``) and the O(1) scalars: the Rice parameter
(``wire.rice_parameter``'s breakpoints precomputed in Python per tensor size by
``wire.rice_table``, looked up with integer ops) and the mean's float64 -> float32 rounding
(round to nearest even on the bit pattern). Framing: :mod:`.frame`; decoding: :mod:`.host`.

Selection is the exact top-k with the reference's tie rule (ties at the k-th value go to the
lower flat index) without a ``tf.math.top_k`` of the whole tensor: the maximum and minimum of
every block of ``_BLOCK`` elements, sampled thresholds a little below and above each side's
k-th value, and the exact k-th value among the blocks that reach them. If the sample misjudges
(never for ordinary data, possible for adversarial ties), the same selection runs on the whole
tensor: the estimate costs speed, never exactness.

TensorFlow on CPU flushes subnormal floats to zero (eagerly and inside ``tf.function``), so every
value that goes into or comes out of a message moves as bits (``tf.bitcast``): the mean, the
decoded values, their finiteness and sign checks; ``R + dW`` and the residual update stay TF
arithmetic. Details and costs: docs/tensorflow.md, "The backends: what runs where".
"""
from __future__ import annotations

import enum
import math
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ... import config, reference, registry, wire
from . import graphs
from .bits import f32_bits_to_f64, f64_to_f32_bits  # noqa: F401 (re-exported)

_EXACT_BELOW = 1 << 14   # below this (or at high density) the exact path runs on the whole tensor
_BLOCK = 32              # elements per block of the block-maxima pass
_SAMPLE_MAX = 262144
_SAMPLE_MIN = 65536
_BAND_SIGMAS = 4.0       # the sampled thresholds sit this many standard deviations off the k-th
_SAMPLE_EXPECT = 1024    # sample so that ~this many sampled entries reach the k-th (top_k cost)
_DENSE_UPDATE = 200      # residual update by one dense subtraction once k * this >= numel
if sys.byteorder != "little":  # pragma: no cover - tf.bitcast of float32 values to wire bytes
    raise ImportError("horovod_sbc.tensorflow.backend.codec assumes a little-endian host")

_no_autograph = tf.autograph.experimental.do_not_convert


class Side:
    """Which entries a selection ranks: the positive side (``a``), the negative side (``-a``) or
    magnitudes (``|a|``)."""
    POS, NEG, ABS = "pos", "neg", "abs"


class ResidualUpdate(enum.Enum):
    """How :func:`apply_sent` subtracts what was sent (chosen while tracing from the keep count;
    every way gives the same bits: ``a - 0 == a`` for every float TensorFlow keeps)."""
    SCATTER = "scatter"  # copy ``a``, subtract at the positions (few positions)
    DENSE = "dense"      # ``a - SparseToDense(positions, sent)`` (many positions,
                         # ``k * _DENSE_UPDATE >= numel``: TF's scatter costs more per position
                         # than the dense fill does per element by about that factor)
    ALL = "all"          # every element was sent: ``a - sent``


@dataclass
class Encoded:
    """One encoded tensor (all TF tensors, on the update's device).

    header:    int64 [5], ``[flags, rice_b, count, unary_nbytes, value_bits]``: the O(1)
               integers of the tensor header (:func:`header_bytes_host` / ``message``)
    body:      uint8, the message after its header (streams, signs or values)
    positions: int64 [count], sorted flat positions sent
    sent:      [count] values sent, in the update's dtype (error feedback subtracts them)
    finite:    bool scalar; False if the update holds NaN or Inf (then the message must not be
               sent and nothing may be committed)
    numel:     the tensor's element count (static)
    update:    how the error feedback is best applied (:class:`ResidualUpdate`, static)
    new_residual: flat ``A - sent`` once computed (the kernel op computes it with the message;
               a backend's encode sets it), else None (:meth:`residual` computes it)
    """
    header: tf.Tensor
    body: tf.Tensor
    positions: tf.Tensor
    sent: tf.Tensor
    finite: tf.Tensor
    numel: int
    update: ResidualUpdate = ResidualUpdate.SCATTER
    new_residual: Optional[tf.Tensor] = None

    def residual(self, a: tf.Tensor) -> tf.Tensor:
        """``a`` (the encoded update, any shape) with what was sent subtracted."""
        if self.new_residual is not None:
            return tf.reshape(self.new_residual, tf.shape(a))
        return apply_sent(a, self.positions, self.sent, self.update)

    @property
    def message(self) -> tf.Tensor:
        """uint8: the whole tensor message, its header built with TF ops."""
        return tf.concat([_header_bytes(self.numel, self.header), self.body], 0)


# ----------------------------------------------------------------------------------------------
# exact scalar helpers (integer ops on bit patterns)
# ----------------------------------------------------------------------------------------------
def _i64(x) -> tf.Tensor:
    return tf.cast(x, tf.int64)


def _c64(v: int) -> tf.Tensor:
    return tf.constant(v, tf.int64)


def _f32_of_bits(bits: tf.Tensor) -> tf.Tensor:
    return tf.bitcast(tf.cast(bits, tf.int32), tf.float32)


def value_in(bits32: tf.Tensor, dtype: tf.DType, negative=None) -> tf.Tensor:
    """A float32 wire value (bits) as ``dtype``, exactly (float64 through integer ops)."""
    if negative is not None:
        bits32 = tf.where(negative, tf.bitwise.bitwise_or(bits32, tf.constant(-2 ** 31, tf.int32)),
                          bits32)
    if dtype == tf.float32:
        return _f32_of_bits(bits32)
    if dtype == tf.float64:
        return f32_bits_to_f64(bits32)
    return tf.cast(_f32_of_bits(bits32), dtype)


def tree_sum(x: tf.Tensor, max_len: Optional[int] = None) -> tf.Tensor:
    """0-d float64: the fixed pairwise-tree sum of :func:`horovod_sbc.reference.tree_sum_np` (values in
    order, zero padded to a power of two, then repeatedly ``x[:h] + x[h:]``), on x's device.

    Padding to any larger power of two gives the same bits (the extra levels add exact zeros),
    so ``x`` is padded to the power of two >= ``max_len`` (a static bound on its length; default
    its static length) and the halving is unrolled: no loop in the graph."""
    x = tf.cast(tf.reshape(x, [-1]), tf.float64)
    if max_len is None:
        max_len = int(x.shape[0])
    size = 1 << max(0, (max_len - 1).bit_length())
    n = tf.size(x, out_type=tf.int64)
    x = tf.pad(x, tf.reshape(tf.stack([_c64(0), size - n]), [1, 2]))
    x = tf.reshape(x, [size])
    while size > 1:
        size //= 2
        x = x[:size] + x[size:]
    return tf.reshape(x, [])


def _mean_bits_2(x: tf.Tensor, y: tf.Tensor, max_len: int) -> tf.Tensor:
    """int32 [2]: bits of ``float32(tree_sum(v) / len(v))`` (0 for no values) for ``v`` = x, y,
    as :func:`horovod_sbc.reference.mean_f32`. The float64 division is exact IEEE (no subnormal
    float64 arises from float32-range data); the rounding to float32 is done on the bits."""
    n = tf.stack([tf.size(x, out_type=tf.int64), tf.size(y, out_type=tf.int64)])
    size = 1 << max(0, (max_len - 1).bit_length())
    rows = tf.stack([tf.pad(tf.cast(v, tf.float64), tf.reshape(tf.stack([_c64(0), size - c]),
                                                                [1, 2]))
                     for v, c in ((x, n[0]), (y, n[1]))])
    rows = tf.reshape(rows, [2, size])
    while size > 1:  # the tree of tree_sum, both rows at once
        size //= 2
        rows = rows[:, :size] + rows[:, size:]
    sums = rows[:, 0]
    m = f64_to_f32_bits(sums / tf.cast(tf.maximum(n, 1), tf.float64))
    return tf.where(n > 0, m, tf.zeros_like(m))


# ----------------------------------------------------------------------------------------------
# selection
# ----------------------------------------------------------------------------------------------
def _side_values(a: tf.Tensor, side: str) -> tf.Tensor:
    if side == Side.POS:
        return a
    if side == Side.NEG:
        return -a
    return tf.abs(a)


def _select_among(vals: tf.Tensor, k, positive_only: bool) -> tf.Tensor:
    """Indices (ascending) into ``vals`` (side values in position order) of the k largest, ties
    to the lowest index; with ``positive_only`` only entries > 0 count (fewer if there are fewer).
    ``k`` may be a tensor; ``vals`` holds at least the k largest."""
    k = _i64(k)
    c = tf.size(vals, out_type=tf.int64)
    if positive_only:
        k = tf.minimum(k, tf.reduce_sum(tf.cast(vals > 0, tf.int64)))
    kk = tf.minimum(k, c)

    # k == 0: top_k is empty, its min is +max, nothing is selected
    kth = tf.reduce_min(tf.math.top_k(vals, tf.cast(kk, tf.int32), sorted=False).values)
    gt = vals > kth
    need = kk - tf.reduce_sum(tf.cast(gt, tf.int64))
    eq = tf.equal(vals, kth)
    eq = tf.logical_and(eq, tf.cumsum(tf.cast(eq, tf.int64)) <= need)
    sel = tf.logical_or(gt, eq)
    if positive_only:
        sel = tf.logical_and(sel, vals > 0)
    return tf.reshape(tf.where(sel), [-1])


def _exact_side(a: tf.Tensor, k: int, side: str, positive_only: bool) -> tf.Tensor:
    return _select_among(_side_values(a, side), k, positive_only)


def _sample_thresholds(sample_side: tf.Tensor, k: int, n: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """(t_lo, t_hi) from a strided sample: with high probability the k-th largest of the whole
    side lies in [t_lo, t_hi]. Both are side values of the sample (t_lo may be 0)."""
    m = int(sample_side.shape[0])
    expect = k * m / n
    sd = math.sqrt(expect) + 2.0
    k_lo = int(min(m, math.ceil(expect + _BAND_SIGMAS * sd + 4)))
    k_hi = int(max(0, math.floor(expect - _BAND_SIGMAS * sd - 4)))
    top = tf.math.top_k(sample_side, k_lo, sorted=True).values
    t_lo = top[k_lo - 1]
    t_hi = top[k_hi - 1] if k_hi > 0 else tf.constant(np.inf, sample_side.dtype)
    return t_lo, t_hi


def _band_select(vals: tf.Tensor, k: int, t_lo, t_hi, positive_only: bool) -> tf.Tensor:
    """Indices into ``vals`` (candidates, position order) of the k largest, given that all
    entries of the whole side above ``t_hi`` and all the k largest are among ``vals``."""
    sure = vals > t_hi
    n_sure = tf.reduce_sum(tf.cast(sure, tf.int64))
    band = tf.logical_and(tf.logical_not(sure), vals >= t_lo)
    if positive_only:
        band = tf.logical_and(band, vals > 0)
    band_idx = tf.reshape(tf.where(band), [-1])
    band_vals = tf.gather(vals, band_idx)
    chosen = tf.gather(band_idx, _select_among(band_vals, k - n_sure, positive_only))
    mask = tf.scatter_nd(chosen[:, None], tf.ones_like(chosen, tf.bool), tf.shape(vals,
                                                                             out_type=tf.int64))
    return tf.reshape(tf.where(tf.logical_or(sure, mask)), [-1])


@dataclass
class _Prep:
    """What the selection reads of the whole tensor before deciding anything: block maxima and
    minima (``None`` when the tensor is searched whole or directly) and the finiteness flag."""
    bmax: Optional[tf.Tensor]
    bmin: Optional[tf.Tensor]
    finite: tf.Tensor


def _use_blocks(n: int, k: int, n_sides: int) -> bool:
    # blocks pay off while few of them reach the threshold (hit fraction ~ n_sides * B * k / n)
    return n > _EXACT_BELOW and n_sides * _BLOCK * 1.2 * k <= 0.25 * n


def _prepare(a: tf.Tensor, k: int, n_sides: int) -> _Prep:
    n = int(a.shape[0])
    if not _use_blocks(n, k, n_sides):
        return _Prep(None, None, all_finite(a))
    nb = n // _BLOCK
    head = tf.reshape(a[:nb * _BLOCK], [nb, _BLOCK])
    tail = a[nb * _BLOCK:]
    bmax, bmin = tf.reduce_max(head, 1), tf.reduce_min(head, 1)
    # max/min propagate NaN (TensorFlow's reduction kernels); Inf shows as an infinite extreme
    finite = tf.logical_and(tf.math.is_finite(tf.reduce_max(bmax)),
                            tf.math.is_finite(tf.reduce_min(bmin)))
    if n > nb * _BLOCK:
        finite = tf.logical_and(finite, tf.reduce_all(tf.math.is_finite(tail)))
    return _Prep(bmax, bmin, finite)


def _side_hit(x: tf.Tensor, side: str, t_lo, positive_only: bool, x_min=None) -> tf.Tensor:
    """Does the side value of ``x`` (or, for blocks, of the block with max ``x`` and min
    ``x_min``) reach ``t_lo`` (and, with ``positive_only``, exceed 0)? One comparison per side:
    ``s >= t_lo and s > 0`` is ``s > max(nextafter(t_lo, -inf), 0)``. (Should TF flush a
    subnormal threshold to 0 the test only gets wider: the candidates are filtered exactly.)"""
    lo = x if x_min is None else x_min
    if positive_only:
        t = tf.maximum(tf.math.nextafter(t_lo, tf.constant(-np.inf, t_lo.dtype)),
                       tf.zeros_like(t_lo))
        if side == Side.POS:
            return x > t
        if side == Side.NEG:
            return lo < -t
        return tf.logical_or(x > t, lo < -t)
    if side == Side.POS:
        return x >= t_lo
    if side == Side.NEG:
        return lo <= -t_lo
    return tf.logical_or(x >= t_lo, lo <= -t_lo)


def select_sides(a: tf.Tensor, k: int, sides: Sequence[str], positive_only: bool,
                 prep: Optional[_Prep] = None) -> List[tf.Tensor]:
    """Sorted int64 positions of the k largest of each side of flat ``a`` (ties to the lower
    index). ``positive_only``: only entries whose side value is > 0 (binarized SBC's P and N).

    ``a`` must be finite. Small tensors are searched whole; large ones through a sampled band
    of candidates, gathered by blocks (low density) or by one mask over the tensor.
    """
    n = int(a.shape[0])
    if k >= n and not positive_only:
        return [tf.range(n, dtype=tf.int64) for _ in sides]
    if n <= _EXACT_BELOW or (positive_only and 2 * k > n):
        # (k above half the tensor with positive_only: the sampled band gave wrong P/N for the
        # paper rule at density >= 0.9 on large tensors, found by tests/test_tf_ops.py's
        # property test; the whole-tensor rule is exact, and such densities are rare)
        return [_exact_side(a, k, s, positive_only) for s in sides]
    prep = prep or _prepare(a, k, len(sides))
    # a large sample keeps the band between the thresholds narrow (~8 / sqrt(k m / n) of k)
    # ... but a sample only as large as needed for ~_SAMPLE_EXPECT entries above the k-th (its
    # top_k is the cost), and not below _SAMPLE_MIN (a small sample widens the band)
    m_target = int(min(_SAMPLE_MAX, n // 4,
                       max(_SAMPLE_MIN, _SAMPLE_EXPECT * n // max(k, 1))))
    stride = max(1, n // m_target)
    sample = a[::stride]
    thresholds = {s: _sample_thresholds(_side_values(sample, s), k, n) for s in sides}
    if prep.bmax is not None:
        nb = n // _BLOCK
        head = tf.reshape(a[:nb * _BLOCK], [nb, _BLOCK])
        hit = None
        for s in sides:
            h = _side_hit(prep.bmax, s, thresholds[s][0], positive_only, prep.bmin)
            hit = h if hit is None else tf.logical_or(hit, h)
        hit = tf.reshape(tf.where(hit), [-1])
        offs = tf.range(_BLOCK, dtype=tf.int64)
        cand_pos = tf.concat([tf.reshape(hit[:, None] * _BLOCK + offs, [-1]),
                              tf.range(nb * _BLOCK, n, dtype=tf.int64)], 0)
        cand = tf.concat([tf.reshape(tf.gather(head, hit), [-1]), a[nb * _BLOCK:]], 0)
    else:
        mask = None
        for s in sides:
            h = _side_hit(a, s, thresholds[s][0], positive_only)
            mask = h if mask is None else tf.logical_or(mask, h)
        cand_pos = tf.reshape(tf.where(mask), [-1])
        cand = tf.gather(a, cand_pos)
    out = []
    for s in sides:
        t_lo, t_hi = thresholds[s]
        vals = _side_values(cand, s)
        n_lo = tf.reduce_sum(tf.cast(vals >= t_lo, tf.int64))
        n_hi = tf.reduce_sum(tf.cast(vals > t_hi, tf.int64))
        # the sample's verdict holds if everything above t_hi fits in k and t_lo leaves at least
        # k candidates (or every positive entry, when t_lo is 0 and only positives count)
        ok = tf.logical_and(n_hi <= k, tf.logical_or(n_lo >= k, tf.logical_and(
            tf.constant(positive_only), t_lo <= 0)))

        def fast(vals=vals, t_lo=t_lo, t_hi=t_hi):
            return tf.gather(cand_pos, _band_select(vals, k, t_lo, t_hi, positive_only))

        def whole(s=s):
            return _exact_side(a, k, s, positive_only)

        out.append(tf.cond(ok, fast, whole))
    return out


# ----------------------------------------------------------------------------------------------
# Golomb-Rice streams and headers
# ----------------------------------------------------------------------------------------------
def rice_b(gaps: tf.Tensor, count: tf.Tensor, numel: int) -> tf.Tensor:
    """The encoder's b (int64 scalar): :func:`horovod_sbc.wire.choose_rice_b` in TF ops (0
    for an empty tensor, which has no positions)."""
    if numel <= 0:
        return _c64(0)
    b1, ts = wire.rice_table(numel)
    count = _i64(count)
    b0 = _c64(b1) - tf.reduce_sum(tf.cast(tf.constant(ts, tf.int64) <= count, tf.int64))
    bs = b0 + tf.constant([-1, 0, 1], tf.int64)
    bc = tf.clip_by_value(bs, 0, wire.MAX_RICE_B)
    sq = tf.reduce_sum(tf.bitwise.right_shift(gaps[None, :], bc[:, None]), 1)
    nbytes = (sq + count + 7) // 8 + (count * bc + 7) // 8
    valid = tf.logical_and(bs >= 0, bs <= wire.MAX_RICE_B)
    nbytes = tf.where(valid, nbytes, _c64(np.iinfo(np.int64).max))
    # the smallest length, ties to the smaller b (the first of the three)
    first = tf.reduce_min(tf.where(tf.equal(nbytes, tf.reduce_min(nbytes)),
                                   tf.constant([0, 1, 2], tf.int64), 3))
    return tf.where(count > 0, tf.gather(bc, first), 0)


def _pack_ones(bit_index: tf.Tensor, nbytes) -> tf.Tensor:
    """uint8 [nbytes]: bytes (MSB first) with a one at each (unique) ``bit_index``."""
    # int32 bytes: TensorFlow has no GPU kernel for int64 segment sums (a byte sums to <= 255)
    contrib = tf.cast(tf.bitwise.right_shift(_c64(0x80), tf.bitwise.bitwise_and(bit_index, 7)),
                      tf.int32)
    out = tf.math.unsorted_segment_sum(contrib, tf.bitwise.right_shift(bit_index, 3),
                                       tf.cast(nbytes, tf.int64))
    return tf.cast(out, tf.uint8)


def _write_fields(values: tf.Tensor, width, nbytes) -> tf.Tensor:
    """uint8 [nbytes]: the ``values`` (int64 >= 0, < 2**width) as ``width``-bit fields back to
    back, most significant bit first, zero padded (the remainder stream). ``width`` <= 62."""
    width = _i64(width)
    count = tf.size(values, out_type=tf.int64)
    start = tf.range(count, dtype=tf.int64) * width
    off = tf.bitwise.bitwise_and(start, 7)
    end = off + width                                   # bits used of a 128-bit window
    hi = tf.where(end <= 64, tf.bitwise.left_shift(values, tf.maximum(64 - end, 0)),
                  tf.bitwise.right_shift(values, tf.maximum(end - 64, 0)))
    lo = tf.where(end > 64, tf.bitwise.left_shift(values, tf.clip_by_value(128 - end, 0, 63)),
                  tf.zeros_like(values))
    span = (7 + width + 7) // 8                        # window bytes that can be touched
    j = tf.range(span, dtype=tf.int64)
    hi_u, lo_u = tf.bitcast(hi, tf.uint64), tf.bitcast(lo, tf.uint64)
    sh_hi = tf.cast(tf.maximum(56 - 8 * j, 0), tf.uint64)
    sh_lo = tf.cast(tf.maximum(120 - 8 * j, 0), tf.uint64)
    byte = tf.where(j < 8, tf.bitwise.right_shift(hi_u[:, None], sh_hi[None, :]),
                    tf.bitwise.right_shift(lo_u[:, None], sh_lo[None, :]))
    byte = tf.cast(tf.bitwise.bitwise_and(byte, 0xFF), tf.int32)  # int32: see _pack_ones
    idx = tf.bitwise.right_shift(start, 3)[:, None] + j[None, :]
    nbytes = _i64(nbytes)
    keep = idx < nbytes
    out = tf.math.unsorted_segment_sum(tf.boolean_mask(byte, keep), tf.boolean_mask(idx, keep),
                                       nbytes)
    return tf.cast(out, tf.uint8)


def _uvarint(v: tf.Tensor) -> tf.Tensor:
    """uint8 bytes of the canonical LEB128 varint of int64 scalar ``v`` (0 <= v < 2**62)."""
    v = _i64(v)
    sh = tf.range(9, dtype=tf.int64) * 7
    groups = tf.bitwise.bitwise_and(tf.bitwise.right_shift(v, sh), 0x7F)
    length = 1 + tf.reduce_sum(tf.cast(tf.bitwise.right_shift(v, sh[1:]) > 0, tf.int64))
    more = tf.range(9, dtype=tf.int64) < length - 1
    return tf.cast(groups + tf.where(more, _c64(0x80), 0), tf.uint8)[:length]


def _le32(bits32: tf.Tensor) -> tf.Tensor:
    b = tf.bitwise.bitwise_and(tf.cast(bits32, tf.int64), 0xFFFFFFFF)
    return tf.cast(tf.bitwise.bitwise_and(tf.bitwise.right_shift(b, _c64(8) * tf.range(
        4, dtype=tf.int64)), 0xFF), tf.uint8)


def _const_bytes(b: bytes) -> tf.Tensor:
    return tf.constant(np.frombuffer(b, np.uint8).copy(), tf.uint8)


def _pack_bools(bits: tf.Tensor) -> tf.Tensor:
    """bool [n] -> uint8 [ceil(n/8)], MSB first, zero padded (numpy.packbits)."""
    n = tf.size(bits, out_type=tf.int64)
    x = tf.cast(bits, tf.int64)
    x = tf.pad(x, tf.reshape(tf.stack([_c64(0), (-n) % 8]), [1, 2]))
    w = tf.constant([128, 64, 32, 16, 8, 4, 2, 1], tf.int64)
    return tf.cast(tf.reduce_sum(tf.reshape(x, [-1, 8]) * w, 1), tf.uint8)


def _header_bytes(numel: int, header: tf.Tensor) -> tf.Tensor:
    """uint8 tensor header (:func:`horovod_sbc.wire.tensor_header`) from the int64
    ``[flags, rice_b, count, unary_nbytes, value_bits]`` of :func:`encode_parts`, in TF ops."""
    fixed = _const_bytes(wire.TENSOR_MAGIC + bytes((wire.VERSION,)))
    return tf.concat([fixed, tf.cast(header[:2], tf.uint8), _const_bytes(wire.uvarint(numel)),
                      _uvarint(header[2]), _uvarint(header[3]), _le32(header[4])], 0)


def header_bytes_host(numel: int, header) -> bytes:
    """The same tensor header on the host from the five integers (exact: the value's bits are
    copied, never converted through a float)."""
    flags, b, count, unary_nbytes, vbits = (int(x) for x in header)
    return (wire.TENSOR_MAGIC + bytes((wire.VERSION, flags, b)) + wire.uvarint(numel)
            + wire.uvarint(count) + wire.uvarint(unary_nbytes)
            + (vbits & 0xFFFFFFFF).to_bytes(4, "little"))


def encode_parts(pos: tf.Tensor, numel: int, value_bits=None, negative=None,
                 values: Optional[tf.Tensor] = None, signs: Optional[tf.Tensor] = None,
                 all_positions: bool = False) -> Tuple[tf.Tensor, tf.Tensor]:
    """``(header, body)`` of one tensor message of sorted unique int64 positions in [0, numel):
    ``header`` int64 ``[flags, rice_b, count, unary_nbytes, value_bits]`` (the O(1) integers the
    header bytes are made of), ``body`` uint8 (unary, remainder, sign or value streams).

    ``value_bits`` (int32 scalar tensor) is the float32 value's bit pattern; ``negative`` a bool
    scalar tensor. ``values`` (float32, one per position) makes a top-k VALUES message, ``signs``
    (bool, True = negative) a ternary one; ``all_positions`` (static) sends every element.
    A tensor of no elements (``numel == 0``) has one encoding whatever the mode
    (:func:`horovod_sbc.protocol.empty_tensor_message`), so every compressor's encoder that
    builds its message here gets it.
    """
    zero = _c64(0)
    value_bits = zero if value_bits is None else tf.cast(
        tf.bitwise.bitwise_and(tf.cast(value_bits, tf.int64), 0xFFFFFFFF), tf.int64)
    negative = tf.constant(False) if negative is None else tf.cast(negative, tf.bool)

    def head(flags, b, count, unary_nbytes, vbits):
        return tf.stack([_i64(flags), _i64(b), _i64(count), _i64(unary_nbytes), _i64(vbits)])

    if numel == 0:  # the one encoding of an empty tensor, whatever the mode
        # (protocol.empty_tensor_message: no flags, b 0, no positions, value 0, no streams)
        return head(0, 0, 0, 0, zero), tf.zeros([0], tf.uint8)
    if all_positions:
        if values is not None:
            vb = tf.reshape(tf.bitcast(tf.cast(values, tf.float32), tf.uint8), [-1])
            return head(wire.FLAG_VALUES | wire.FLAG_ALL, 0, numel, 0, zero), vb
        return head(wire.FLAG_SIGNS | wire.FLAG_ALL, 0, numel, 0, value_bits), _pack_bools(signs)
    count = tf.size(pos, out_type=tf.int64)
    gaps = pos - tf.concat([[_c64(-1)], pos[:-1]], 0) - 1
    b = rice_b(gaps, count, numel)
    q = tf.bitwise.right_shift(gaps, b)
    ones_at = tf.cumsum(q + 1) - 1
    unary_nbytes = (tf.reduce_sum(q) + count + 7) // 8
    unary = _pack_ones(ones_at, unary_nbytes)
    r = tf.bitwise.bitwise_and(gaps, tf.bitwise.left_shift(_c64(1), b) - 1)
    rem = _write_fields(r, b, (count * b + 7) // 8)
    some = tf.cast(count > 0, tf.int64)
    if values is not None:
        vb = tf.reshape(tf.bitcast(tf.cast(values, tf.float32), tf.uint8), [-1])
        return head(some * wire.FLAG_VALUES, b, count, unary_nbytes, zero), \
            tf.concat([unary, rem, vb], 0)
    if signs is not None:
        return head(some * wire.FLAG_SIGNS, b, count, unary_nbytes, some * value_bits), \
            tf.concat([unary, rem, _pack_bools(signs)], 0)
    flags = some * tf.cast(negative, tf.int64) * wire.FLAG_NEGATIVE
    return head(flags, b, count, unary_nbytes, some * value_bits), tf.concat([unary, rem], 0)


def encode_positions(pos: tf.Tensor, numel: int, value_bits=None, negative=None,
                     values: Optional[tf.Tensor] = None, signs: Optional[tf.Tensor] = None,
                     all_positions: bool = False) -> tf.Tensor:
    """One tensor message (uint8), header included, in TF ops (see :func:`encode_parts`)."""
    header, body = encode_parts(pos, numel, value_bits, negative, values, signs, all_positions)
    return tf.concat([_header_bytes(numel, header), body], 0)


# ----------------------------------------------------------------------------------------------
# the encoder
# ----------------------------------------------------------------------------------------------
def all_finite(a: tf.Tensor) -> tf.Tensor:
    """Does ``a`` hold only finite numbers? Large tensors: one float sum (NaN and Inf propagate
    through it; only a sum that overflowed is rechecked element by element)."""
    if int(a.shape[0]) <= _EXACT_BELOW:
        return tf.reduce_all(tf.math.is_finite(a))
    s = tf.reduce_sum(a)
    return tf.cond(tf.math.is_finite(s), lambda: tf.constant(True),
                   lambda: tf.reduce_all(tf.math.is_finite(a)))


def normalize_mode(mode) -> str:
    """The compressor's name: ``True`` is ``"sbc"``, ``False`` ``"values"`` (ValueError naming the
    known ones for an unknown name)."""
    mode = "sbc" if mode is True else "values" if mode is False else mode
    registry.get(mode)  # ValueError naming the known modes
    return mode


def abs_max_f32_bits(a: tf.Tensor) -> tf.Tensor:
    """int32 bits of ``max|a|`` rounded to float32, exact for subnormal values (which TF's float
    ops flush on the CPU): non-negative floats order like their bit patterns."""
    if a.dtype == tf.float32:
        return tf.reduce_max(tf.bitwise.bitwise_and(tf.bitcast(a, tf.int32), 0x7FFFFFFF))
    mag = tf.bitwise.bitwise_and(tf.bitcast(tf.cast(a, tf.float64), tf.int64),
                                 tf.constant(0x7FFFFFFFFFFFFFFF, tf.int64))
    return f64_to_f32_bits(tf.bitcast(tf.reduce_max(mag), tf.float64))


@_no_autograph
def encode_update(a: tf.Tensor, density: float, mode="sbc", selection: str = "paper",
                  name: str = "tensor", generator=None) -> Encoded:
    """Encode flat ``a`` (the residual-corrected update ``A = R + dW``, float32 or float64).

    ``mode``: a registered compressor (:mod:`horovod_sbc.registry`). A ``native_kernel`` one
    runs here: ``"sbc"`` (or True) top-k + binarization and ``"values"`` (or False) top-k with
    the kept entries' float32 values (magnitude selection); any other runs its own
    ``encode_tf`` (``generator``: the stateless seed of a random one).
    ``selection``: SBC's candidate sets, ``"paper"`` or ``"magnitude"`` (see
    :mod:`horovod_sbc.reference`). Returns an :class:`Encoded`; nothing in ``a`` changes (commit the
    error feedback with ``a - sent`` at ``positions``, see :func:`apply_sent`).
    """
    mode = normalize_mode(mode)
    config.validate_selection(selection)
    density = config.validate_density(density)
    a = tf.reshape(a, [-1])
    if a.dtype not in (tf.float32, tf.float64):
        raise TypeError(f"encode_update needs float32 or float64 (the residual dtype), got "
                        f"{a.dtype.name} for {name!r}")
    n = int(a.shape[0])
    empty_pos = tf.zeros([0], tf.int64)
    if n == 0:
        return Encoded(*encode_parts(empty_pos, 0), empty_pos, tf.zeros([0], a.dtype),
                       tf.constant(True), 0)
    comp = registry.get(mode)
    if not comp.native_kernel:  # a registered compressor's own encoder
        return comp.encode_tf(a, density=density, selection=selection, name=name,
                              generator=generator)
    k = reference.keep_count(n, density)
    header, body, pos, sent, finite = _encoder_graph(n, k, mode, selection, a.dtype)(a)
    if comp.message is registry.Message.VALUES and k >= n:
        update = ResidualUpdate.ALL
    elif k * _DENSE_UPDATE >= n:
        update = ResidualUpdate.DENSE
    else:
        update = ResidualUpdate.SCATTER
    return Encoded(header, body, pos, sent, finite, n, update)


_ENCODERS: dict = {}


def _encoder_graph(n: int, k: int, mode: str, selection: str, dtype: tf.DType):
    """The TF-op encoder of ``k`` of ``n`` elements as one graph function, traced once per
    process and (size, keep count, mode, selection, dtype) and kept out of line
    (``_noinline``): the many tensors of a model that share a shape (a network's repeated
    blocks, its norms' scales and biases) share one graph instead of each building and
    optimizing its few hundred ops."""
    key = (n, k, mode, selection, dtype.name)
    comp = registry.get(mode)  # a native_kernel one: top-k values or SBC's binarized sides
    values = comp.message is registry.Message.VALUES
    if key not in _ENCODERS:
        def encode(a):
            if n <= _EXACT_BELOW or k >= n:
                prep = _Prep(None, None, all_finite(a))
            else:
                prep = _prepare(a, k, comp.sides if selection == "paper" else 1)
            # A non-finite update is encoded all the same (nothing in the selection breaks on
            # NaN, it only takes the slow exact path); ``finite`` tells the caller to send an
            # error instead.
            run = _encode_values if values else _encode_binary
            (header, body), pos, sent = run(a, k, selection, prep)
            return header, body, pos, sent, prep.finite

        _ENCODERS[key] = graphs.shared(encode, (tf.TensorSpec([n], dtype),))
    return _ENCODERS[key]


def _encode_values(a: tf.Tensor, k: int, selection: str, prep: "_Prep"):
    """Top-k with values: (header, body), positions, sent (the float32 values, in a's dtype)."""
    n = int(a.shape[0])
    (idx,) = select_sides(a, k, [Side.ABS], positive_only=False, prep=prep)
    vals = tf.gather(a, idx)
    v32 = vals if a.dtype == tf.float32 else tf.cast(vals, tf.float32)
    msg = encode_parts(idx, n, values=v32, all_positions=(k == n))
    sent = v32 if a.dtype == tf.float32 else value_in(tf.bitcast(v32, tf.int32), a.dtype)
    return msg, idx, sent


def _encode_binary(a: tf.Tensor, k: int, selection: str, prep: "_Prep"):
    """Binarized SBC (:mod:`horovod_sbc.reference`'s rule): (header, body), the positions of
    the side sent, its value at each of them (no ``tf.cond``: both sides are computed)."""
    n = int(a.shape[0])
    if selection == "paper":
        p_idx, n_idx = select_sides(a, k, [Side.POS, Side.NEG], positive_only=True, prep=prep)
    else:
        (idx,) = select_sides(a, k, [Side.ABS], positive_only=True, prep=prep)
        kept = tf.gather(a, idx)
        p_idx, n_idx = tf.boolean_mask(idx, kept > 0), tf.boolean_mask(idx, kept < 0)
    mu_pos, mu_neg = tf.unstack(_mean_bits_2(tf.gather(a, p_idx), -tf.gather(a, n_idx),
                                              min(k, n)))
    # reference.choose_side on bit patterns: non-negative float32 bits order like their values
    pos_side = tf.logical_and(mu_pos >= mu_neg, mu_pos > 0)
    neg_side = tf.logical_and(tf.logical_not(pos_side), mu_neg > 0)
    take_p = tf.where(pos_side, tf.size(p_idx, out_type=tf.int64), 0)
    take_n = tf.where(neg_side, tf.size(n_idx, out_type=tf.int64), 0)
    pos = tf.concat([p_idx[:take_p], n_idx[:take_n]], 0)  # the side sent
    mu = tf.where(pos_side, mu_pos, tf.where(neg_side, mu_neg, 0))
    msg = encode_parts(pos, n, mu, neg_side)
    value = value_in(mu, a.dtype, negative=neg_side)
    return msg, pos, tf.fill(tf.shape(pos), value)


def top_k_abs(a: tf.Tensor, k: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """(sorted int64 positions of the ``k`` largest ``|a|``, ties to the lower index; is ``a``
    finite): the selection of top-k, for compressors built on it. ``a`` flat, non-empty."""
    n = int(a.shape[0])
    prep = _Prep(None, None, all_finite(a)) if n <= _EXACT_BELOW or k >= n else \
        _prepare(a, k, 1)
    (idx,) = select_sides(a, k, [Side.ABS], positive_only=False, prep=prep)
    return idx, prep.finite


def apply_sent(a: tf.Tensor, positions: tf.Tensor, sent: tf.Tensor,
               update: ResidualUpdate = ResidualUpdate.SCATTER) -> tf.Tensor:
    """Error feedback: ``a`` with ``a[positions] -= sent`` (positions unique), same shape
    (``update``: how, see :class:`ResidualUpdate`; all give the same result)."""
    flat = tf.reshape(a, [-1])
    sent = tf.cast(sent, a.dtype)
    if update is ResidualUpdate.ALL:
        out = flat - tf.reshape(sent, [-1])
    elif update is ResidualUpdate.DENSE:
        out = flat - tf.raw_ops.SparseToDense(
            sparse_indices=positions, output_shape=tf.shape(flat, out_type=tf.int64),
            sparse_values=sent, default_value=tf.zeros([], a.dtype), validate_indices=False)
    else:
        out = tf.tensor_scatter_nd_sub(flat, positions[:, None], sent)
    return tf.reshape(out, tf.shape(a))
