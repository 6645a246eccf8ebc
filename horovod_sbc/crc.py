"""CRC-32 (zlib's, the step header's ``body_crc32``) as matrix products over GF(2): the numpy
tables from which the torch and TensorFlow codecs compute a step body's CRC on its device, with
no host read of the body.

CRC-32 is affine in the message bits. With ``L`` the CRC register run from zero over the message
(linear) and ``zero(n)`` the CRC of ``n`` zero bytes (the affine part), ``crc32(m) = L(m) ^
zero(len(m))``; leading zero bytes add nothing to ``L``, so a message may be zero padded at the
front to a whole number of chunks. ``L`` is then two matrix products of 0/1 values:

* :func:`chunk_table` ``[8 S, 32]``: row ``8 j + b`` (bit ``b``, value ``1 << b``, of byte ``j`` of
  an ``S``-byte chunk) holds that bit's contribution to the chunk's CRC;
* :func:`shift_table` ``[32 C, 32]``: for chunk ``c`` of ``C``, the matrix that moves its CRC
  past the ``C - 1 - c`` chunks after it (rows of the last chunk last).

Sums stay below ``2**24``, exact in float32, for messages under 512 MiB. :func:`zero_powers`
gives ``zero(n)`` for an ``n`` known only on the device: the zero-byte update raised to each
power of two, applied for the set bits of ``n``.
"""
from __future__ import annotations

import functools
from typing import List

import numpy as np

POLY = 0xEDB88320  # zlib's CRC-32, reflected
CHUNK = 1024       # bytes per row of the first matrix product
_BITS = np.arange(32, dtype=np.uint64)


def _step(r: int) -> int:
    return (r >> 1) ^ (POLY if r & 1 else 0)


def _apply(cols: np.ndarray, v: np.ndarray) -> np.ndarray:
    """The GF(2) 32x32 matrix of column images ``cols`` applied to the uint64 array ``v``."""
    out = np.zeros_like(v)
    for i in range(32):
        out ^= np.where((v >> np.uint64(i)) & np.uint64(1) != 0, cols[i], np.uint64(0))
    return out


def _images(n_bits: int) -> np.ndarray:
    """Column images of the basis vectors after ``n_bits`` zero bits (uint64 [32])."""
    out = []
    for i in range(32):
        r = 1 << i
        for _ in range(n_bits):
            r = _step(r)
        out.append(r)
    return np.array(out, np.uint64)


def _bits(v: np.ndarray) -> np.ndarray:
    """uint64 [..] -> float32 [.., 32]: bit i of each value in column i."""
    return ((v[..., None] >> _BITS) & np.uint64(1)).astype(np.float32)


@functools.lru_cache(maxsize=1)
def chunk_table() -> np.ndarray:
    """float32 ``[8 CHUNK, 32]`` (see the module docstring)."""
    s8 = 8 * CHUNK
    f = [0] * s8  # a one bit followed by d more bits adds f(d)
    r = POLY
    for d in range(s8):
        f[d] = r
        r = _step(r)
    d_of = [8 * (CHUNK - 1 - j) + 7 - b for j in range(CHUNK) for b in range(8)]
    return _bits(np.array([f[d] for d in d_of], np.uint64))


def shift_table(n_chunks: int) -> np.ndarray:
    """float32 ``[32 n_chunks, 32]`` (see the module docstring)."""
    z = _images(8 * CHUNK)
    powers = [np.array([1 << i for i in range(32)], np.uint64)]  # Z^0 .. Z^(C-1), by columns
    while len(powers) < n_chunks:
        powers.append(_apply(z, powers[-1]))
    return _bits(np.stack(powers[::-1])).reshape(-1, 32)


def zero_powers(max_bytes: int) -> np.ndarray:
    """float32 ``[K, 32, 32]``, ``K = max_bytes.bit_length()``: the zero-byte update of the CRC
    register raised to ``2**k``, as ``M[k][out bit, in bit]``. ``zero(n)`` is the register
    ``0xFFFFFFFF`` multiplied by ``M[k]`` for every set bit ``k`` of ``n``, then xor-ed with
    ``0xFFFFFFFF``."""
    out: List[np.ndarray] = []
    cols = _images(8)
    for _ in range(max(1, int(max_bytes).bit_length())):
        out.append(_bits(cols).T.copy())  # column i = image of bit i
        cols = _apply(cols, cols)         # the square: twice as many bytes
    return np.stack(out)
