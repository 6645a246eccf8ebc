"""Error-feedback signSGD (Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and
other Gradient Compression Schemes", ICML 2019).

Every element is sent as ``sign(A) * scale`` with ``scale = mean(|A|)`` (zeros count as
positive): one sign bit per element (flags SIGNS | ALL, no positions) and one float32. The scale
is the fixed-order tree sum of ``|A|`` (:func:`horovod_sbc.reference.tree_sum_np`) divided by
``numel`` and rounded once to float32, so every backend gets the same bits in any order of
summation. ``density`` is ignored.
"""
from __future__ import annotations

import math

import numpy as np

from .. import reference, registry, wire


class SignSGD(registry.Compressor):
    name = "sign"
    summary = "every element's sign + one scale, mean |A|"
    binarize = True
    message = registry.Message.SIGNS

    def capacity(self, numel, density):
        return wire.tensor_capacity(numel, numel, signs=True, all_positions=True)

    def encode_np(self, a, density, selection, uniform=None):
        n = a.size
        scale = float(np.float32(reference.tree_sum_np(np.abs(a)) / n))
        neg = a < 0
        msg = reference.encode_tensor_np(None, n, scale, signs=neg, all_positions=True)
        sent = np.where(neg, a.dtype.type(-scale), a.dtype.type(scale)).astype(a.dtype)
        return msg, np.arange(n, dtype=np.int64), sent

    def encode_torch(self, a, *, density, selection, name, generator=None):
        import torch
        from ..torch import backend as tb
        n = a.numel()
        a_abs = torch.abs(a, out=tb.scratch(n, a.dtype, a.device))
        total = tb.tree_sum(a_abs).item()
        if not math.isfinite(total):
            raise tb.NonFiniteError(f"the update of {name!r} contains NaN or Inf")
        scale = float(np.float32(total / n))
        neg = a < 0
        sent = torch.where(neg, -scale, scale).to(a.dtype)
        empty = torch.zeros(0, dtype=torch.int64, device=a.device)
        msg = tb.encode_positions(empty, n, scale, signs=neg, all_positions=True)
        return msg, torch.arange(n, dtype=torch.int64, device=a.device), sent

    def encode_tf(self, a, *, density, selection, name, generator=None):
        import tensorflow as tf
        from ..tensorflow.backend import codec
        n = int(a.shape[0])
        sbits = codec.f64_to_f32_bits(codec.tree_sum(tf.abs(a), n) / float(n))
        neg = a < 0
        scale = codec.value_in(sbits, a.dtype)
        header, body = codec.encode_parts(tf.zeros([0], tf.int64), n, sbits, signs=neg,
                                          all_positions=True)
        return codec.Encoded(header, body, tf.range(n, dtype=tf.int64),
                             tf.where(neg, -scale, scale), codec.all_finite(a), n,
                             codec.ResidualUpdate.ALL)


registry.register(SignSGD())
