"""Exact float conversions on bit patterns (TensorFlow flushes subnormal floats to zero on CPU,
so a float32 value that may be subnormal is never passed through a TF float op or cast)."""
from __future__ import annotations

import tensorflow as tf


def f64_to_f32_bits(x: tf.Tensor) -> tf.Tensor:
    """int32 bit pattern of ``float32(x)`` (round to nearest even, subnormals and overflow to inf
    included) for finite float64 ``x`` of any shape, computed with integer ops only (a TF cast
    would flush a subnormal float32 result to zero)."""
    bits = tf.bitcast(tf.cast(x, tf.float64), tf.int64)
    sign = tf.cast(bits < 0, tf.int64)
    e = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 52), 0x7FF)
    m = tf.bitwise.bitwise_and(bits, (1 << 52) - 1)
    sig = tf.where(e > 0, tf.bitwise.bitwise_or(m, 1 << 52), m)
    e1 = tf.maximum(e, 1)
    e32 = tf.maximum(e1 - 896, 1)          # biased float32 exponent, at least 1 (subnormal)
    s = tf.minimum(e32 - e1 + 925, 62)     # right shift taking 53 to 24 significant bits
    q = tf.bitwise.right_shift(sig, s)
    rem = sig - tf.bitwise.left_shift(q, s)
    half = tf.bitwise.left_shift(tf.ones_like(s), s - 1)
    up = tf.logical_or(rem > half, tf.logical_and(tf.equal(rem, half),
                                                 tf.equal(tf.bitwise.bitwise_and(q, 1), 1)))
    out = tf.bitwise.left_shift(e32 - 1, 23) + q + tf.cast(up, tf.int64)
    out = tf.minimum(out, 0x7F800000)      # overflow rounds to inf (as numpy's float32(x))
    out = tf.bitwise.bitwise_or(out, tf.bitwise.left_shift(sign, 31))
    return tf.bitcast(tf.cast(out, tf.uint32), tf.int32)


def f32_bits_to_f64(bits: tf.Tensor) -> tf.Tensor:
    """float64 value of float32 bit patterns (int32), exact also for subnormals."""
    b = tf.cast(bits, tf.int64)
    b = tf.bitwise.bitwise_and(b, 0xFFFFFFFF)
    sign = tf.where(tf.not_equal(tf.bitwise.bitwise_and(b, 0x80000000), 0),
                    tf.constant(-1.0, tf.float64), tf.constant(1.0, tf.float64))
    mag = tf.bitwise.bitwise_and(b, 0x7FFFFFFF)
    normal = tf.cast(tf.bitcast(tf.cast(mag, tf.int32), tf.float32), tf.float64)
    sub = tf.cast(mag, tf.float64) * (2.0 ** -149)  # exact: integer * power of two, normal f64
    return sign * tf.where(mag < (1 << 23), sub, normal)




def _tiny(bits: tf.Tensor) -> tf.Tensor:
    """Zero or subnormal float32 (by bit pattern)."""
    return tf.equal(tf.bitwise.bitwise_and(bits, 0x7F800000), 0)


def _zero(bits: tf.Tensor) -> tf.Tensor:
    return tf.equal(tf.bitwise.bitwise_and(bits, 0x7FFFFFFF), 0)


def _subnormal(bits: tf.Tensor) -> tf.Tensor:
    return tf.logical_and(_tiny(bits), tf.logical_not(_zero(bits)))


def add_f32_bits(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    """Bits of the IEEE float32 sum of float32 bit patterns ``x + y`` (round to nearest even),
    also where TensorFlow's float add would flush a subnormal operand or result to zero: those
    (rare) elements are recomputed as ``float32(float64(x) + float64(y))`` with exact integer
    conversions (float64 has 53 >= 2 x 24 + 2 bits, so the double rounding is innocuous)."""
    s = tf.bitcast(tf.bitcast(x, tf.float32) + tf.bitcast(y, tf.float32), tf.int32)
    # TF's add is exact unless an operand is subnormal or the result is (then it shows as a zero
    # that two non-zero operands did not cancel to; real cancellations are redone harmlessly)
    both_zero = tf.logical_and(_zero(x), _zero(y))
    # zero + zero is -0 only when both are -0 (IEEE, round to nearest). Set from the bits: inside
    # tf.function Grappler folds "zeros + y" to y, which turned +0 + (-0) into -0
    s = tf.where(both_zero, tf.bitwise.bitwise_and(x, y), s)
    redo = tf.logical_or(tf.logical_or(_subnormal(x), _subnormal(y)),
                         tf.logical_and(_tiny(s), tf.logical_not(both_zero)))
    redo = tf.reshape(tf.where(redo), [-1])

    xs, ys = tf.gather(x, redo), tf.gather(y, redo)  # usually empty
    return tf.tensor_scatter_nd_update(
        s, redo[:, None], f64_to_f32_bits(f32_bits_to_f64(xs) + f32_bits_to_f64(ys)))
