"""TernGrad (Wen, Xu, Yan, Wu, Wang, Chen, Li; "TernGrad: Ternary Gradients to Reduce
Communication in Distributed Deep Learning", NeurIPS 2017), here with error feedback like every
compressor of this package.

With ``scale = max|A|`` rounded to float32, element ``i`` is sent as ``sign(A_i) * scale`` with
probability ``|A_i| / scale`` (sent when a uniform draw ``u_i`` in [0, 1) has ``u_i * scale <
|A_i|``): unbiased, ternary. The message carries the positions (Golomb-Rice coded), one sign bit
each and the scale; nothing when ``scale`` is 0. ``density`` is ignored. The draws come from the
adapter's seeded generator (``SBCConfig.seed`` and the rank), which checkpoints keep.
"""
from __future__ import annotations

import math

import numpy as np

from .. import reference, registry, wire


class TernGrad(registry.Compressor):
    name = "terngrad"
    summary = "random positions (P = |A| / max|A|) + their signs + one scale, max |A|"
    binarize = True
    message = registry.Message.SIGNS
    random = True

    def capacity(self, numel, density):
        return wire.tensor_capacity(numel, numel, signs=True)

    def encode_np(self, a, density, selection, uniform=None):
        if uniform is None:
            raise ValueError("TernGrad's reference needs the uniform draws (uniform=...)")
        a_abs = np.abs(a)
        scale = float(np.float32(a_abs.max()))
        if scale == 0.0:
            empty = np.zeros(0, np.int64)
            return reference.encode_tensor_np(empty, a.size), empty, np.zeros(0, a.dtype)
        pos = np.flatnonzero(np.asarray(uniform, np.float32) * np.float32(scale) < a_abs)
        neg = a[pos] < 0
        sent = np.where(neg, a.dtype.type(-scale), a.dtype.type(scale)).astype(a.dtype)
        return reference.encode_tensor_np(pos, a.size, scale, signs=neg), pos, sent

    def encode_torch(self, a, *, density, selection, name, generator=None):
        import torch
        from ..torch import backend as tb
        n, dev = a.numel(), a.device
        a_abs = torch.abs(a, out=tb.scratch(n, a.dtype, dev))
        top = a_abs.max().item()
        if not math.isfinite(top):
            raise tb.NonFiniteError(f"the update of {name!r} contains NaN or Inf")
        scale = float(np.float32(top))
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        if scale == 0.0:
            return tb.encode_positions(empty, n), empty, a.new_zeros(0)
        u = torch.rand(n, generator=generator, device=dev, dtype=torch.float32)
        pos = torch.nonzero(u * scale < a_abs).squeeze(1)
        neg = a[pos] < 0
        sent = torch.where(neg, -scale, scale).to(a.dtype)
        return tb.encode_positions(pos, n, scale, signs=neg), pos, sent

    def encode_tf(self, a, *, density, selection, name, generator=None):
        """The scale from the magnitudes' bit patterns (TensorFlow flushes subnormal floats on
        the CPU, integer maxima do not); ``generator``: the stateless seed (int64 ``[2]``) of
        this tensor's draws (``tf.random.stateless_uniform``: graph-safe, and a resumed run
        draws the same)."""
        import tensorflow as tf
        from ..tensorflow.backend import codec
        if generator is None:
            raise ValueError(f"TernGrad needs a seed for the draws of {name!r}")
        n = int(a.shape[0])
        sbits = codec.abs_max_f32_bits(a)
        scale = codec.value_in(sbits, a.dtype)
        u = tf.random.stateless_uniform([n], seed=generator, dtype=tf.float32)
        pos = tf.where(tf.cast(u * codec.value_in(sbits, tf.float32), a.dtype) < tf.abs(a))[:, 0]
        neg = tf.gather(a, pos) < 0
        header, body = codec.encode_parts(pos, n, sbits, signs=neg)
        return codec.Encoded(header, body, pos, tf.where(neg, -scale, scale),
                             codec.all_finite(a), n, codec.ResidualUpdate.DENSE)


registry.register(TernGrad())
