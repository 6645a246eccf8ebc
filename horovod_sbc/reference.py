"""SBC compression math — the numpy reference (framework-agnostic), the oracle of every codec.

Sparse Binary Compression (Sattler, Wiedemann, Müller, Samek; arXiv 1805.08768), per tensor:

1. ``A = R + dW``: add the residual R (error feedback) to the update dW.
2. **Sparsify** with ``k = keep_count(numel, density)`` (``density`` is the paper's *p*).
   ``selection="paper"`` (default; the paper's Algorithm 1): the positive set P is the
   ``min(k, #positive)`` largest positive entries of A, the negative set N the ``min(k,
   #negative)`` most negative ones. ``selection="magnitude"``: the k entries of largest |A|,
   split by sign into P and N. Ties at the k-th value go to the lower flat index.
3. **Binarize**: ``mu+`` = mean of A over P, ``mu-`` = mean of -A over N. Only the side with the
   larger mean is sent (``mu+`` wins ties), every one of its entries as that mean: positions plus
   one float. If the winning mean is 0 (no non-zero entry) nothing is sent.
4. **Residual**: ``R = A - sent``. Entries not sent keep their exact value; sent entries become
   ``A - (+-mu)`` rounded to the residual's dtype.

Means (:func:`tree_sum_np`): the values in position order, as float64, summed by a fixed
pairwise tree (padded with zeros to a power of two, then repeatedly ``x[:h] + x[h:]``), divided
by the count and rounded once to float32, so every implementation's means are bit-identical.

``binarize=False`` sends the kept entries' own float32 values (top-k with error feedback; always
the magnitude selection). ``mode="sign"`` is error-feedback signSGD (Karimireddy et al. 2019):
every element as ``sign(A) * mean(|A|)`` (zeros positive; ``density`` ignored). Why each rule:
docs/design.md#the-sbc-rule-per-tensor.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np

from . import protocol, registry, wire
from .config import validate_selection
from .protocol import StreamStats
from .wire import TensorMessage


def keep_count(numel: int, density: float) -> int:
    """k = round(density * numel), at least 1 (for a non-empty tensor), at most numel."""
    if numel <= 0:
        return 0
    return int(min(numel, max(1, math.floor(density * numel + 0.5))))


def tensor_capacity(numel: int, density: float, mode: str = "sbc") -> int:
    """The bytes a tensor message of ``numel`` elements may take in ``mode`` at ``density``
    (the compressor's :meth:`horovod_sbc.registry.Compressor.capacity`)."""
    if numel <= 0:
        return len(protocol.empty_tensor_message())
    return registry.get(mode).capacity(numel, density)


def step_capacity(numels: Sequence[int], density: float, mode: str = "sbc") -> int:
    """Bytes of every PADDED step message of a layout of these element counts."""
    return wire.step_capacity([tensor_capacity(int(n), density, mode) for n in numels])


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


def compress_np(update: np.ndarray, residual: Optional[np.ndarray], density: float,
                binarize: bool = True, mode: Optional[str] = None,
                selection: str = "paper", uniform: Optional[np.ndarray] = None
                ) -> Tuple[bytes, np.ndarray]:
    """Reference compressor for one tensor: (tensor message bytes, new residual).

    ``mode``: a registered compressor (:mod:`horovod_sbc.registry`; default ``"sbc"``, or
    ``"values"`` with ``binarize=False``); its ``encode_np`` selects on ``A = R + dW`` and the
    residual becomes ``A - sent``. The residual is kept in float32 for float16/bfloat16/float32
    inputs, float64 for float64. ``selection`` applies to binarized SBC only (``"paper"`` or
    ``"magnitude"``); ``uniform``: the draws of a random compressor (TernGrad).
    """
    validate_selection(selection)
    compressor = registry.get(mode if mode is not None else "sbc" if binarize else "values")
    rdt = np.float64 if update.dtype == np.float64 else np.float32
    if residual is not None:  # A = R + dW: a new array (the inputs are left alone)
        a = np.add(update.astype(rdt, copy=False).ravel(),
                   residual.astype(rdt, copy=False).ravel())
    else:
        a = update.astype(rdt, copy=True).ravel()
    if a.size and not (np.isfinite(a.max()) and np.isfinite(a.min())):  # NaN/Inf propagate
        raise ValueError("update contains NaN or Inf")
    if a.size == 0:  # one canonical encoding of an empty tensor, whatever the mode
        return protocol.empty_tensor_message(), a.reshape(update.shape)
    msg, pos, sent = compressor.encode_np(a, density, selection, uniform)
    if pos.size:
        a[pos] = a[pos] - sent
    return msg, a.reshape(update.shape)


def decompress_np(msg: bytes, shape, dtype=np.float32) -> np.ndarray:
    """Dense tensor of one tensor message."""
    numel = int(np.prod(shape)) if len(shape) else 1
    _, pos, vals, end = decode_tensor_np(msg, 0, numel)
    if end != len(msg):
        raise ValueError("corrupt message: trailing bytes after tensor message")
    out = np.zeros(numel, dtype=np.float32)
    out[pos] = vals
    return out.astype(dtype).reshape(shape)


# ----------------------------------------------------------------------------------------------
# numpy reference: Golomb-Rice streams and whole tensor messages
# ----------------------------------------------------------------------------------------------
def gaps_of(positions: np.ndarray) -> np.ndarray:
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size == 0:
        return pos
    return np.diff(pos, prepend=np.int64(-1)) - 1


def encode_streams_np(positions: np.ndarray, b: int) -> Tuple[bytes, bytes]:
    """Golomb-Rice streams (unary, remainder) of sorted unique non-negative positions."""
    gaps = gaps_of(positions)
    count = gaps.size
    if count == 0:
        return b"", b""
    q = gaps >> b
    ones_at = np.cumsum(q + 1) - 1
    unary_bits = np.zeros(int(ones_at[-1]) + 1, dtype=np.uint8)
    unary_bits[ones_at] = 1
    unary = np.packbits(unary_bits).tobytes()
    if b:
        # each remainder as a big-endian integer of W bytes (the narrowest that holds b bits),
        # unpacked to its 8W bits, the last b of them kept: one byte per bit, never eight
        w = next(x for x in (1, 2, 4, 8) if 8 * x >= b)
        r = (gaps & ((1 << b) - 1)).astype(f">u{w}")
        rbits = np.unpackbits(r.view(np.uint8).reshape(count, w), axis=1)[:, 8 * w - b:]
        rem = np.packbits(rbits.ravel()).tobytes()
    else:
        rem = b""
    return unary, rem


def decode_streams_np(buf: bytes, msg: TensorMessage, name: str = "tensor") -> np.ndarray:
    """Positions (int64) of a parsed tensor message; validates the streams (numpy reference of
    the statistics :class:`horovod_sbc.protocol.StreamStats`, checked by the protocol layer)."""
    pos, stats = stream_stats_np(buf, msg)
    protocol.check_stream(msg, stats, name)
    return pos


def stream_stats_np(buf: bytes, msg: TensorMessage):
    """(positions int64, :class:`horovod_sbc.protocol.StreamStats`) of a parsed message; the
    positions are meaningful only if the statistics pass :func:`protocol.check_stream`."""
    count, b = msg.count, msg.rice_b
    mv = memoryview(buf)
    sign_bad = False
    if msg.has_signs:
        sbits = np.unpackbits(np.frombuffer(mv[msg.signs[0]:msg.signs[1]], dtype=np.uint8))
        sign_bad = bool(sbits[count:].any())
    nonfinite = 0
    if msg.has_values:
        bits = np.frombuffer(mv[msg.values[0]:msg.values[1]], dtype="<u4")
        nonfinite = int(np.count_nonzero((bits & 0x7F800000) == 0x7F800000))
    if count == 0:
        return np.zeros(0, dtype=np.int64), StreamStats(sign_pad_nonzero=sign_bad,
                                                        nonfinite=nonfinite)
    if msg.all_positions:
        return (np.arange(count, dtype=np.int64),
                StreamStats(sign_pad_nonzero=sign_bad, nonfinite=nonfinite))
    ubytes = np.frombuffer(mv[msg.unary[0]:msg.unary[1]], dtype=np.uint8)
    ones = np.flatnonzero(np.unpackbits(ubytes))
    q = np.diff(ones, prepend=np.int64(-1))
    q -= 1
    n_ones = ones.size
    del ones  # the decoder's memory stays a few int64 per position (tests/test_codec.py)
    rem_bad = False
    if b:
        rbits = np.unpackbits(np.frombuffer(mv[msg.remainder[0]:msg.remainder[1]],
                                            dtype=np.uint8))
        rem_bad = bool(rbits[count * b:].any())
        n_r = min(n_ones, count)
        # b bits per row -> ceil(b / 8) bytes per row (uint8), then combined into int64: no
        # 8-bytes-per-bit intermediate
        rows = np.packbits(rbits[:n_r * b].reshape(n_r, b), axis=1)
        del rbits
        r = np.zeros(n_r, dtype=np.uint64)  # unsigned: b = 62 fills all 64 bits
        for j in range(rows.shape[1]):
            r <<= np.uint64(8)
            r |= rows[:, j]
        r >>= np.uint64(8 * rows.shape[1] - b)
        r = r.view(np.int64)
    else:
        r = np.zeros(min(n_ones, count), dtype=np.int64)
    stats = StreamStats(ones=int(n_ones), unary_last_zero=bool(ubytes[-1] == 0),
                        max_q=int(q.max()) if q.size else 0,
                        max_r=int(r.max()) if r.size else 0, rem_pad_nonzero=rem_bad,
                        sign_pad_nonzero=sign_bad, nonfinite=nonfinite)
    if n_ones != count or (stats.max_q << b) + stats.max_r >= msg.numel:
        return np.zeros(0, dtype=np.int64), stats  # rejected by the protocol before pos_max
    with np.errstate(over="ignore"):
        pos = q  # in place: gaps + 1, cumulated
        pos <<= b
        pos += r
        del r
        pos += 1
        np.cumsum(pos, out=pos)
        pos -= 1
    return pos, stats._replace(pos_max=int(pos.max()))


def sign_stream_np(signs: np.ndarray) -> bytes:
    return np.packbits(np.asarray(signs, dtype=bool).astype(np.uint8)).tobytes()


def decode_signs_np(buf: bytes, msg: TensorMessage, name: str) -> np.ndarray:
    """Sign bits (True = negative) of a ternary message whose padding the protocol checked."""
    bits = np.unpackbits(np.frombuffer(memoryview(buf)[msg.signs[0]:msg.signs[1]],
                                       dtype=np.uint8))
    return bits[:msg.count].astype(bool)


def encode_tensor_np(positions, numel: int, value: float = 0.0, negative: bool = False,
                     values: Optional[np.ndarray] = None, rice_b: Optional[int] = None,
                     signs: Optional[np.ndarray] = None, all_positions: bool = False) -> bytes:
    """One tensor message. ``positions`` sorted unique in [0, numel) (ignored with
    ``all_positions``); ``signs`` (bool, True = negative) makes it ternary."""
    if all_positions:
        if values is None and signs is None:
            raise ValueError("all_positions needs values or signs")
        value = 0.0 if values is not None else float(np.float32(value))
        head = wire.tensor_header(numel, numel, 0, 0, value, False, values is not None,
                             signs is not None, True)
        if values is not None:
            return head + np.asarray(values, dtype="<f4").tobytes()
        return head + sign_stream_np(signs)
    pos = np.asarray(positions, dtype=np.int64)
    count = int(pos.size)
    if numel < 0 or numel >= wire.MAX_NUMEL:
        raise ValueError(f"numel {numel} out of range")
    if count:
        if pos[0] < 0 or pos[-1] >= numel or (count > 1 and np.any(np.diff(pos) <= 0)):
            raise ValueError("positions must be sorted, unique and within [0, numel)")
    gaps = gaps_of(pos)
    if rice_b is None:
        rice_b = wire.choose_rice_b(count, numel, lambda bb: int((gaps >> bb).sum()))
    unary, rem = encode_streams_np(pos, rice_b)
    if values is not None:
        vals = np.asarray(values, dtype="<f4")
        if vals.shape != (count,):
            raise ValueError("values must have one float per position")
        head = wire.tensor_header(numel, count, rice_b, len(unary), 0.0, False, True)
        return head + unary + rem + vals.tobytes()
    value = float(np.float32(value))
    if signs is not None and count:
        head = wire.tensor_header(numel, count, rice_b, len(unary), value, False, False, True)
        return head + unary + rem + sign_stream_np(signs)
    if count == 0:
        value, negative = 0.0, False
    return wire.tensor_header(numel, count, rice_b, len(unary), value, negative) + unary + rem


def decode_tensor_np(buf: bytes, off: int = 0, expected_numel: Optional[int] = None,
                     name: str = "tensor") -> Tuple[TensorMessage, np.ndarray, np.ndarray, int]:
    """Decode one tensor message: (header, positions int64, values float32, end offset)."""
    msg = wire.parse_tensor_header(buf, off, expected_numel, name)
    pos = decode_streams_np(buf, msg, name)
    return msg, pos, tensor_values_np(buf, msg, name), msg.nbytes


def tensor_values_np(buf: bytes, msg: TensorMessage, name: str) -> np.ndarray:
    """float32 value per position of a message whose streams passed the protocol's checks."""
    if msg.has_values:
        vals = np.frombuffer(memoryview(buf)[msg.values[0]:msg.values[1]], dtype="<f4")
        vals = vals.astype(np.float32)
    elif msg.has_signs:
        neg = decode_signs_np(buf, msg, name)
        vals = np.where(neg, np.float32(-msg.value), np.float32(msg.value)).astype(np.float32)
    else:
        vals = np.full(msg.count, np.float32(msg.signed_value), dtype=np.float32)
    return vals


def decode_step_np(buf: bytes, layout: Sequence[Tuple[str, Sequence[int]]], n_ranks: int):
    """Decode an allgathered buffer: a list per rank of (positions, values) per tensor.

    The verdict (which problem or which rank's ERROR/SKIP is reported) is the protocol layer's
    (:mod:`horovod_sbc.protocol`), so every decoder reports the same one.
    """
    step = protocol.parse_gathered(buf, layout, n_ranks)
    flat = step.flat()
    decoded = [stream_stats_np(buf, msg) for _, _, msg, _ in flat]
    protocol.check_streams(step, [st for _, st in decoded])
    out = [[None] * len(layout) for _ in range(n_ranks)]
    for (r, i, msg, name), (pos, _) in zip(flat, decoded):
        out[r][i] = (pos, tensor_values_np(buf, msg, name))
    return out


def accumulate_np(per_rank, outs: Sequence[np.ndarray], scale: float = 1.0) -> None:
    """Add ``scale`` x the output of :func:`decode_step_np` to ``outs`` (flat arrays, in place),
    rank by rank, with the protocol's decoded arithmetic (``float64(value) * scale`` rounded to
    the output's dtype, then one add)."""
    for tensors in per_rank:
        for out, (pos, vals) in zip(outs, tensors):
            if pos.size:  # positions within one message are unique: plain indexed add
                out[pos] += (vals.astype(np.float64) * scale).astype(out.dtype)
