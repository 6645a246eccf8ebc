"""SBC compression math — the numpy reference (framework-agnostic).

Sparse Binary Compression (Sattler, Wiedemann, Müller, Samek; arXiv 1805.08768), per tensor:

1. ``A = R + dW``: add the residual R (error feedback) to the update dW.
2. **Sparsify** with ``k = keep_count(numel, density)`` (``density`` is the paper's *p*):

   * ``selection="paper"`` (default; the SBC paper's Algorithm 1): the positive set P is the
     ``min(k, #positive)`` largest positive entries of A, the negative set N the ``min(k,
     #negative)`` most negative ones. So the side finally sent has (up to) k positions: the
     fraction of positions sent per tensor is ``density`` whenever that side has k entries.
   * ``selection="magnitude"``: the k entries of largest |A| form the kept set, split by sign into
     P and N (together at most k, so the side sent usually has only ~0.5-0.65 k positions).

   Ties at the k-th value go to the lower flat index, so every implementation keeps the same set.
3. **Binarize**: ``mu+`` = mean of A over P, ``mu-`` = mean of -A over N. Only the side with the
   larger mean is sent (``mu+`` wins ties), every one of its entries as that mean: positions plus
   one float. If the winning mean is 0 (no non-zero entry) nothing is sent.
4. **Residual**: ``R = A - sent``. Entries not sent keep their exact value; sent entries become
   ``A - (+-mu)`` rounded to the residual's dtype.

Means are computed the same way by every implementation (:func:`tree_sum_np`): the values in
position order, as float64, summed by a fixed pairwise tree (padded with zeros to a power of two,
then repeatedly ``x[:h] + x[h:]``); the float64 sum is divided by the count on the host and
rounded once to float32 (the wire's float). IEEE float64 addition is the same on every backend and
device, so every implementation gets bit-identical means without any host-side O(k) work.

``binarize=False`` sends the kept entries' own float32 values instead (top-k with error feedback;
with density 1 the message is dense: flag ALL, 32 bits per element); it always uses the magnitude
selection.

``mode="sign"`` is error-feedback signSGD (Karimireddy et al. 2019, "Error Feedback Fixes
SignSGD"): every element is sent as ``sign(A) * mean(|A|)`` (one bit per element, one float;
``density`` is ignored; zeros count as positive); the scale is ``tree_sum_np(|A|) / numel``
rounded to float32.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from . import protocol, wire


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
    return top_k_np(a_abs, k)


def top_k_np(values: np.ndarray, k: int, above: Optional[float] = None,
             negate: bool = False) -> np.ndarray:
    """Sorted flat indices of the k largest entries of ``values`` (of ``-values`` with
    ``negate``; only entries ``> above`` count when ``above`` is given: fewer than k if fewer
    qualify); ties at the k-th value go to the lower index.

    The rule is the specification; how it is computed only costs time: a strided sample gives
    a threshold t that probably has at least k qualifying entries ``>= t``; the exact k-th value
    is then found among those candidates only, and if they are fewer than k the whole tensor is
    searched instead, so the result never depends on the sample."""
    v = values.ravel()
    n = v.size
    if k <= 0 or n == 0:
        return np.zeros(0, dtype=np.int64)
    sgn = -1 if negate else 1
    t = _sample_threshold_np(v, k, above, sgn)
    cand = None
    if t is not None:
        cand = np.flatnonzero(v <= -t if negate else v >= t)
        if cand.size < k:
            cand = None  # the sample overestimated: search everything
    if cand is None:
        if above is None:
            cand = np.arange(n, dtype=np.int64)
        else:
            cand = np.flatnonzero(v < -above if negate else v > above)
    if cand.size <= k:
        return cand.astype(np.int64)
    vals = -v[cand] if negate else v[cand]
    thr = np.partition(vals, vals.size - k)[vals.size - k]  # the k-th largest
    big = vals > thr
    ties = np.flatnonzero(vals == thr)[:k - int(np.count_nonzero(big))]
    big[ties] = True  # lowest indices first among the ties
    return cand[big].astype(np.int64)


def _sample_threshold_np(v: np.ndarray, k: int, above: Optional[float], sgn: int
                         ) -> Optional[float]:
    """A threshold a little below the k-th largest qualifying value of ``sgn * v``, from a
    strided sample of at most one element per 16 (None for small tensors, dense selections)."""
    n = v.size
    if n <= 1 << 14 or k * 4 > n:
        return None
    m = min(max(16384, 16 * (n // k)), 1 << 16, n // 16)
    sample = v[::max(1, n // m)] * sgn
    expect = k * sample.size / n  # sampled entries expected among the k largest
    if above is not None:
        sample = sample[sample > above]
    ks = int(math.ceil(1.02 * expect + 4.0 * math.sqrt(expect) + 4.0))
    if ks > sample.size:
        return None
    t = float(np.partition(sample, sample.size - ks)[sample.size - ks])
    if above is not None and not t > above:
        return None
    return t


SELECTIONS = ("paper", "magnitude")


def validate_selection(selection) -> str:
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    return selection


def tree_sum_np(values: np.ndarray) -> float:
    """The fixed-order float64 sum every implementation uses for means (see module docstring)."""
    x = np.asarray(values, dtype=np.float64).ravel()
    n = x.size
    if n == 0:
        return 0.0
    size = 1 << (n - 1).bit_length()
    if size != n:
        x = np.concatenate([x, np.zeros(size - n, np.float64)])
    while x.size > 1:
        h = x.size // 2
        x = x[:h] + x[h:]
    return float(x[0])


def mean_f32(values: np.ndarray) -> float:
    """``float32(tree_sum(values) / count)`` as a Python float (0.0 for no values)."""
    n = int(np.asarray(values).size)
    return float(np.float32(tree_sum_np(values) / n)) if n else 0.0


def choose_side(mu_pos: float, mu_neg: float) -> Tuple[int, float]:
    """Binarization's verdict: (+1 positive side, -1 negative side, 0 nothing), and its mean."""
    if mu_pos >= mu_neg and mu_pos > 0:
        return 1, mu_pos
    if mu_neg > 0:
        return -1, mu_neg
    return 0, 0.0


def select_sides_np(a: np.ndarray, k: int, selection: str = "paper"
                    ) -> Tuple[np.ndarray, np.ndarray]:
    """(P, N): sorted flat indices of the positive and negative candidate sets (see docstring)."""
    if selection == "paper":
        return top_k_np(a, k, above=0.0), top_k_np(a, k, above=0.0, negate=True)
    validate_selection(selection)
    idx = select_np(np.abs(a), k)
    return idx[a[idx] > 0], idx[a[idx] < 0]


def binarize_np(values: np.ndarray) -> Tuple[np.ndarray, float, bool]:
    """Magnitude rule on kept values (in position order): (mask of the side sent, mu, negative)."""
    pos = values > 0
    neg = values < 0
    side, mu = choose_side(mean_f32(values[pos]), mean_f32(-values[neg]))
    if side > 0:
        return pos, mu, False
    if side < 0:
        return neg, mu, True
    return np.zeros_like(pos), 0.0, False


def compress_np(update: np.ndarray, residual: Optional[np.ndarray], density: float,
                binarize: bool = True, mode: Optional[str] = None,
                selection: str = "paper") -> Tuple[bytes, np.ndarray]:
    """Reference SBC compressor for one tensor: (tensor message bytes, new residual).

    The residual is kept in float32 for float16/bfloat16/float32 inputs, float64 for float64.
    ``selection`` applies to binarized SBC only (``"paper"`` or ``"magnitude"``).
    """
    validate_selection(selection)
    rdt = np.float64 if update.dtype == np.float64 else np.float32
    if residual is not None:  # A = R + dW: a new array (the inputs are left alone)
        a = np.add(update.astype(rdt, copy=False).ravel(),
                   residual.astype(rdt, copy=False).ravel())
    else:
        a = update.astype(rdt, copy=True).ravel()
    if a.size and not (np.isfinite(a.max()) and np.isfinite(a.min())):  # NaN/Inf propagate
        raise ValueError("update contains NaN or Inf")
    n = a.size
    if n == 0:  # one canonical encoding of an empty tensor, whatever the mode
        return protocol.empty_tensor_message(), a.reshape(update.shape)
    if mode == "sign":
        scale = float(np.float32(tree_sum_np(np.abs(a)) / n))
        neg = a < 0
        msg = wire.encode_tensor_np(None, n, scale, signs=neg, all_positions=True)
        a = a - np.where(neg, rdt(-scale), rdt(scale)).astype(rdt)
        return msg, a.reshape(update.shape)
    if mode not in (None, "sbc", "values"):
        raise ValueError(f"unknown mode {mode!r}")
    binarize = binarize and mode != "values"
    k = keep_count(n, density)
    if not binarize:
        idx = select_np(np.abs(a), k)
        vals = a[idx].astype(np.float32)
        msg = wire.encode_tensor_np(idx, n, values=vals, all_positions=(k == n))
        a[idx] = a[idx] - vals.astype(rdt)
        return msg, a.reshape(update.shape)
    p_idx, n_idx = select_sides_np(a, k, selection)
    side, mu = choose_side(mean_f32(a[p_idx]), mean_f32(-a[n_idx]))
    pos = p_idx if side > 0 else n_idx if side < 0 else p_idx[:0]
    msg = wire.encode_tensor_np(pos, n, mu, side < 0)
    if pos.size:
        a[pos] = a[pos] - rdt(-mu if side < 0 else mu)
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
