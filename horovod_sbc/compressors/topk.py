"""Top-k sparsification with error feedback (as in DGC, Lin et al. arXiv 1712.01887, and GRACE):
the ``k = keep_count(numel, density)`` entries of largest ``|A|`` (ties: lower index), each
sent with its own float32 value, positions Golomb-Rice coded as SBC's. At ``density=1`` every
element is sent (flag ALL, no positions): FedAvg / local SGD when combined with ``delay``.
"""
from __future__ import annotations

from .. import reference, registry, wire


class TopK(registry.Compressor):
    name = "values"
    summary = "top-k positions + their float32 values"
    message = registry.Message.VALUES
    native_kernel = fused = True  # C kernels, fused device codec, TF ops (no framework encoders)

    def capacity(self, numel, density):
        k = reference.keep_count(numel, density)
        return wire.tensor_capacity(numel, k, values=True, all_positions=k == numel)

    def encode_np(self, a, density, selection, uniform=None):
        import numpy as np
        k = reference.keep_count(a.size, density)
        idx = reference.select_np(np.abs(a), k)
        vals = a[idx].astype(np.float32)
        msg = reference.encode_tensor_np(idx, a.size, values=vals, all_positions=(k == a.size))
        return msg, idx, vals.astype(a.dtype)


registry.register(TopK())
