"""SBC compression math — the numpy reference (framework-agnostic).

Sparse Binary Compression (Sattler, Wiedemann, Müller, Samek; arXiv 1805.08768), per tensor:

1. ``A = R + dW``: add the residual R (error feedback) to the update dW.
2. **Sparsify**: the kept set K is the ``k = keep_count(numel, density)`` entries of largest
   magnitude |A|; ties at the k-th magnitude go to the lower flat index, so every implementation
   keeps the same set.
3. **Binarize**: ``mu+`` = mean of the positive entries of A in K, ``mu-`` = mean magnitude of the
   negative ones. Only the side with the larger mean is sent (``mu+`` wins ties), every one of its
   entries as that mean: positions plus one float. (The paper takes the top fraction of the positive
   and of the negative entries separately; we take the top fraction by magnitude and split it,
   which sends at most k positions and is how this project specifies it.) If the winning mean is 0
   (A is zero on K) nothing is sent.
4. **Residual**: ``R = A - sent``. Entries not sent keep their exact value; sent entries become
   ``A - (+-mu)`` rounded to the residual's dtype.

Means are exact sums (``math.fsum``) divided once and rounded once to float32 (the wire's
float), so every implementation gets the same value whatever its summation order.

``binarize=False`` sends the kept entries' own float32 values instead (top-k with error feedback;
with density 1 the message is dense: flag ALL, 32 bits per element).

``mode="sign"`` is error-feedback signSGD (Karimireddy et al. 2019, "Error Feedback Fixes
SignSGD"): every element is sent as ``sign(A) * mean(|A|)`` (one bit per element, one float;
``density`` is ignored; zeros count as positive).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from . import wire


def keep_count(numel: int, density: float) -> int:
    """k = round(density * numel), at least 1 (for a non-empty tensor), at most numel."""
    if numel <= 0:
        return 0
    return int(min(numel, max(1, math.floor(density * numel + 0.5))))


def validate_density(density) -> float:
    try:
        d = float(density)
    except (TypeError, ValueError):
        raise ValueError(f"density must be a number in (0, 1], got {density!r}") from None
    if not (0.0 < d <= 1.0):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return d


def select_np(a_abs: np.ndarray, k: int) -> np.ndarray:
    """Sorted flat indices of the k largest values of ``a_abs`` (ties: lower index first)."""
    n = a_abs.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    thr = np.partition(a_abs, n - k)[n - k]  # the k-th largest magnitude
    above = np.flatnonzero(a_abs > thr)
    ties = np.flatnonzero(a_abs == thr)[:k - above.size]  # lowest indices first
    return np.sort(np.concatenate([above, ties])).astype(np.int64)


def binarize_np(values: np.ndarray) -> Tuple[np.ndarray, float, bool]:
    """Given the kept values (in position order): (mask of the side sent, mu as float32, negative)."""
    pos = values > 0
    neg = values < 0
    n_pos, n_neg = int(pos.sum()), int(neg.sum())
    mu_pos = float(np.float32(math.fsum(values[pos].astype(np.float64)) / n_pos)) if n_pos else 0.0
    mu_neg = float(np.float32(-math.fsum(values[neg].astype(np.float64)) / n_neg)) if n_neg else 0.0
    if mu_pos >= mu_neg and mu_pos > 0:
        return pos, mu_pos, False
    if mu_neg > 0:
        return neg, mu_neg, True
    return np.zeros_like(pos), 0.0, False


def compress_np(update: np.ndarray, residual: Optional[np.ndarray], density: float,
                binarize: bool = True, mode: Optional[str] = None) -> Tuple[bytes, np.ndarray]:
    """Reference SBC compressor for one tensor: (tensor message bytes, new residual).

    The residual is kept in float32 for float16/bfloat16/float32 inputs, float64 for float64.
    """
    rdt = np.float64 if update.dtype == np.float64 else np.float32
    a = update.astype(rdt).ravel()
    if residual is not None:
        a = a + residual.astype(rdt).ravel()
    if not np.all(np.isfinite(a)):
        raise ValueError("update contains NaN or Inf")
    n = a.size
    if mode == "sign":
        if n == 0:
            return wire.encode_tensor_np([], 0, 0.0), a.reshape(update.shape)
        scale = float(np.float32(np.abs(a).astype(np.float64).sum() / n))
        neg = a < 0
        msg = wire.encode_tensor_np(None, n, scale, signs=neg, all_positions=True)
        a = a - np.where(neg, rdt(-scale), rdt(scale)).astype(rdt)
        return msg, a.reshape(update.shape)
    if mode not in (None, "sbc", "values"):
        raise ValueError(f"unknown mode {mode!r}")
    binarize = binarize and mode != "values"
    k = keep_count(n, density)
    idx = select_np(np.abs(a), k)
    kept = a[idx]
    if not binarize:
        vals = kept.astype(np.float32)
        msg = wire.encode_tensor_np(idx, n, values=vals, all_positions=(k == n))
        a[idx] = a[idx] - vals.astype(rdt)
        return msg, a.reshape(update.shape)
    side, mu, negative = binarize_np(kept)
    pos = idx[side]
    msg = wire.encode_tensor_np(pos, n, mu, negative)
    if pos.size:
        a[pos] = a[pos] - rdt(-mu if negative else mu)
    return msg, a.reshape(update.shape)


def decompress_np(msg: bytes, shape, dtype=np.float32) -> np.ndarray:
    """Dense tensor of one tensor message."""
    numel = int(np.prod(shape)) if len(shape) else 1
    _, pos, vals, end = wire.decode_tensor_np(msg, 0, numel)
    if end != len(msg):
        raise ValueError("corrupt message: trailing bytes after tensor message")
    out = np.zeros(numel, dtype=np.float32)
    out[pos] = vals
    return out.astype(dtype).reshape(shape)


def resolve_compression(cls, compression, density=None, delay=None, what: str = "SBC"):
    """The adapters' shared argument rule: ``compression`` (an instance of ``cls``), or
    ``density``/``delay`` shorthands that build ``cls(...)``, but not both."""
    if compression is None:
        kw = {k: v for k, v in (("density", density), ("delay", delay)) if v is not None}
        return cls(**kw)
    if delay is not None or density is not None:
        raise ValueError("give delay/density either in SBC(...) or as arguments, not both")
    if not isinstance(compression, cls):
        raise TypeError(f"compression must be {what} (or a subclass), "
                        f"got {type(compression).__name__}")
    return compression
