"""Sparse Ternary Compression (Sattler, Wiedemann, Müller, Samek, "Robust and
Communication-Efficient Federated Learning from Non-IID Data", arXiv 1903.02891): the non-zero
entries among the ``k`` of largest ``|A|`` (ties: lower index), each sent as ``sign(A_i) * mu``
with ``mu`` their mean magnitude (the fixed-order tree sum of :mod:`horovod_sbc.reference` over
the ``k``, whose zeros add nothing, divided by the count sent, rounded once to float32).

A zero is never sent: the reduce-scatter's owners compress a sum of a few sparse messages, where
``+mu`` at a zero would be pure error; this is their default downlink (``SBCConfig``). The
message is positions + one sign bit each + ``mu``; nothing is sent when ``mu`` is 0. Golden
vectors: ``tests/golden/stc.json``.
"""
from __future__ import annotations

import math

import numpy as np

from .. import reference, registry, wire


class STC(registry.Compressor):
    name = "stc"
    summary = "top-k positions + their signs + the mean magnitude (ternary top-k)"
    binarize = True
    message = registry.Message.SIGNS
    fused = True  # the fused device codec and the C kernels; TF runs encode_tf below

    def capacity(self, numel, density):
        return wire.tensor_capacity(numel, reference.keep_count(numel, density), signs=True)

    def encode_np(self, a, density, selection, uniform=None):
        top = reference.select_np(np.abs(a), reference.keep_count(a.size, density))
        idx = top[a[top] != 0]
        if not idx.size:
            return reference.encode_tensor_np(idx, a.size), idx, np.zeros(0, a.dtype)
        mu = float(np.float32(reference.tree_sum_np(np.abs(a[top])) / idx.size))
        if mu == 0.0:  # subnormal magnitudes whose mean rounds to 0
            return reference.encode_tensor_np(idx[:0], a.size), idx[:0], np.zeros(0, a.dtype)
        neg = a[idx] < 0
        sent = np.where(neg, a.dtype.type(-mu), a.dtype.type(mu)).astype(a.dtype)
        return reference.encode_tensor_np(idx, a.size, mu, signs=neg), idx, sent

    def encode_torch(self, a, *, density, selection, name, generator=None):
        import torch
        from ..torch import backend as tb
        n = a.numel()
        k = reference.keep_count(n, density)
        top = tb.select_topk(a, k, name)
        nz = a[top] != 0
        total, count = torch.stack([tb.tree_sum(a[top].abs()),
                                    nz.sum().to(torch.float64)]).tolist()
        if not math.isfinite(total):
            raise tb.NonFiniteError(f"the update of {name!r} contains NaN or Inf")
        idx = top[nz]
        mu = float(np.float32(total / count)) if count else 0.0
        if mu == 0.0:
            empty = idx[:0]
            return tb.encode_positions(empty, n), empty, a.new_zeros(0)
        neg = a[idx] < 0
        sent = torch.where(neg, -mu, mu).to(a.dtype)
        return tb.encode_positions(idx, n, mu, signs=neg), idx, sent

    def encode_tf(self, a, *, density, selection, name, generator=None):
        import tensorflow as tf
        from ..tensorflow.backend import codec
        n = int(a.shape[0])
        k = reference.keep_count(n, density)
        top, finite = codec.top_k_abs(a, k)
        idx = tf.boolean_mask(top, tf.not_equal(tf.gather(a, top), 0))  # never a zero
        count = tf.size(idx, out_type=tf.int64)
        mbits = codec.f64_to_f32_bits(codec.tree_sum(tf.abs(tf.gather(a, top)), k)
                                      / tf.cast(tf.maximum(count, 1), tf.float64))
        take = tf.where(tf.equal(mbits, 0), tf.constant(0, tf.int64), count)
        pos = idx[:take]  # mu == 0: nothing is sent
        neg = tf.gather(a, pos) < 0
        mu = codec.value_in(mbits, a.dtype)
        header, body = codec.encode_parts(pos, n, mbits, signs=neg)
        return codec.Encoded(header, body, pos, tf.where(neg, -mu, mu), finite, n,
                             codec.ResidualUpdate.SCATTER)


registry.register(STC())
