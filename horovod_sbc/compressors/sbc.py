"""Sparse Binary Compression (Sattler, Wiedemann, Müller, Samek; arXiv 1805.08768).

Per tensor, of the residual-corrected update ``A``: the candidate sets P (largest positive
entries) and N (most negative), ``k = keep_count(numel, density)`` each with the paper's
selection (or the top-k by magnitude split by sign with ``selection="magnitude"``); the side with
the larger mean is sent as its positions and that one mean (``mu+`` wins ties; nothing when both
means are 0). The rule, the tie order and the fixed-order means are specified in
:mod:`horovod_sbc.reference`. This file holds its numpy reference; the torch and TensorFlow
backends run it natively (C kernels, fused device codec, kernel ops: ``native_kernel``), so it
has no framework encoders of its own.
"""
from __future__ import annotations

import numpy as np

from .. import reference, registry, wire


class SBC(registry.Compressor):
    name = "sbc"
    summary = "positions of the side with the larger mean + that mean (binarized top-k)"
    binarize = True
    message = registry.Message.BINARY
    sides = 2
    native_kernel = fused = True  # C kernels, fused device codec, TF ops and kernel op

    def capacity(self, numel, density):
        return wire.tensor_capacity(numel, reference.keep_count(numel, density))

    def encode_np(self, a, density, selection, uniform=None):
        k = reference.keep_count(a.size, density)
        p_idx, n_idx = reference.select_sides_np(a, k, selection)
        side, mu = reference.choose_side(reference.mean_f32(a[p_idx]),
                                         reference.mean_f32(-a[n_idx]))
        pos = p_idx if side > 0 else n_idx if side < 0 else p_idx[:0]
        msg = reference.encode_tensor_np(pos, a.size, mu, side < 0)
        return msg, pos, np.full(pos.size, -mu if side < 0 else mu, a.dtype)


registry.register(SBC())
