"""The horovod_sbc wire format, version 1 — this docstring is the specification.

Everything a rank sends in one synchronisation ("sync") is one flat byte string, a *step message*,
which travels as a ``uint8`` tensor through Horovod's ``allgather``. Receivers split the gathered
concatenation back into the ranks' step messages with the length each step header declares, so no
separate exchange of sizes is needed. All integers are little-endian; nothing is pickled.

Step message
============
::

    offset  size  field
    0       4     magic            b"SBCS"
    4       1     version          1
    5       1     flags            bit 0  ERROR: the sender could not encode this sync; the body
                                          is a UTF-8 reason and n_tensors is 0
                                   bit 1  SKIP: like ERROR, but the sender asks every rank to skip
                                          this sync instead of failing
                                   at most one of ERROR and SKIP
                                   bit 2  PADDED: the body ends in zero padding (see "Fixed-size
                                          step messages"); bits 3..7 reserved, must be 0
    6       2     origin           uint16: 0, or for ERROR/SKIP the rank that failed (a server
                                   relaying another rank's failure keeps that rank)
    8       4     body_length      uint32: number of bytes after this 24-byte header
    12      4     layout           uint32: CRC-32 of the sender's tensor layout (see below)
    16      4     n_tensors        uint32: number of tensor messages in the body
    20      4     body_crc32       uint32: CRC-32 (zlib/IEEE 802.3) of the body bytes
    24      ...   body             n_tensors tensor messages, back to back, in layout order

A rank that cannot encode (e.g. a NaN in an update) still sends a step message, with ERROR or
SKIP set, so every rank learns of it from the same allgather and fails (or skips) together
instead of hanging.

Fixed-size step messages
------------------------
With PADDED set, the body is its content — the ``n_tensors`` tensor messages back to back, or
for ERROR/SKIP the reason — followed by at least one zero byte, up to ``body_length``;
``body_crc32`` covers the whole body, padding included (the padding is never empty, so that a
flipped PADDED bit is caught like any other corrupt header bit). The reason of a padded ERROR/SKIP holds no zero byte and ends
at the first one. Receivers check that every padding byte is zero. A sender pads every step of
one tensor layout to the same *capacity* (:func:`step_capacity`), so that the allgathered tensor
has the same shape every step (collectives can cache it and need no per-rank sizes) and the
sender never needs the length of its messages on the host. Without PADDED nothing may follow
the content. The tensor messages themselves are the same bytes either way.

Capacity (a sender's rule; any body_length is valid on the wire): a tensor message of ``numel``
elements carrying at most ``c_max`` positions (:func:`tensor_capacity`) takes at most the
header with ``count = c_max`` and ``unary_nbytes = ceil(numel / 8)``, plus the streams' bound
``max over count <= c_max of min over the b the rule may choose`` of
``ceil((floor((numel - count) / 2**b) + count) / 8) + ceil(count * b / 8)`` (the gaps of
``count`` positions below ``numel`` sum to at most ``numel - count``, and the rule takes the b
whose streams are shortest), plus the sign and value streams of the largest count. A step's
capacity is the 24-byte header plus the sum of its tensors' capacities plus one byte (the
padding's least).

``layout`` is ``crc32`` of the UTF-8 text ``"name:shape;"`` repeated over the tensors in order,
``shape`` being the dimensions joined by ``x`` (``"fc.weight:10x64;fc.bias:10;"``; a 0-d tensor
has an empty shape) (``layout_fingerprint``). A receiver compares it with its own: ranks that disagree on the set,
order or sizes of tensors fail loudly on every rank instead of decoding garbage.

Tensor message
==============
One per tensor (e.g. one per model parameter)::

    offset  size  field
    0       2     magic            b"SB"
    2       1     version          1
    3       1     flags            bit 0  NEGATIVE  the binary value is -value (else +value)
                                   bit 1  VALUES    one float32 per position follows (non-binarized)
                                   bit 2  SIGNS     one sign bit per position follows (ternary)
                                   bit 3  ALL       every element is a position (no position streams)
                                   bits 4..7 reserved, must be 0
    4       1     rice_b           Rice parameter b, 0 <= b <= 62
    5       var   numel            uvarint: element count of the tensor, < 2**62
    .       var   count            uvarint: number of positions, count <= numel
    .       var   unary_nbytes     uvarint: byte length of the unary stream
    .       4     value            float32: the magnitude mu >= 0 (finite) of the binary value
    .       U     unary stream     U = unary_nbytes bytes
    .       R     remainder stream R = ceil(count * b / 8) bytes
    .       S     sign stream      S = ceil(count / 8) bytes, only if flag SIGNS is set
    .       4*count values         float32 per position, only if flag VALUES is set

``uvarint`` is unsigned LEB128 (as in protobuf): 7 bits per byte, least significant group first,
high bit set on every byte but the last; at most 9 bytes and minimal (no trailing 0x80 groups,
i.e. the last byte of a multi-byte varint is never 0).

Positions are the flat (row-major) indices ``p_0 < p_1 < ... < p_{count-1}`` of the sent entries.
They are Golomb-Rice coded as gaps ``d_i = p_i - p_{i-1} - 1`` (with ``p_{-1} = -1``), each split
into a quotient ``q_i = d_i >> b`` and a remainder ``r_i = d_i & (2**b - 1)``, written to two
separate bit streams (this is the classic Golomb-Rice code with its two parts de-interleaved,
which is exactly as long and lets both directions be vectorised):

* unary stream: for each i in order, ``q_i`` zero bits then a single one bit; then zero bits up to
  the byte boundary. It therefore holds exactly ``count`` one bits, and the byte that holds the last
  one bit is its last byte (``unary_nbytes == ceil((sum(q) + count) / 8)``).
* remainder stream: each ``r_i`` as ``b`` bits, most significant bit first, then zero padding to
  the byte boundary.

Bits fill each byte most significant bit first (``numpy.packbits`` order).

With ALL, the positions are simply ``0 .. numel-1``: ``count == numel``, ``rice_b == 0``,
``unary_nbytes == 0`` and there are no unary or remainder streams; ALL requires SIGNS or VALUES
(so the message always carries at least one bit per element it describes).

The sign stream holds one bit per position, in position order, 1 meaning negative, most
significant bit first, zero padded.

The decoded tensor is zero everywhere except at the positions, which hold ``+value`` (or
``-value`` with NEGATIVE); with SIGNS, ``+value`` or ``-value`` by each position's sign bit
(NEGATIVE must be clear); with VALUES, the float32 values in position order (``value`` is then
0 and NEGATIVE and SIGNS must be clear). ``count == 0`` means "nothing sent"
(``unary_nbytes == 0``).

Modes used by this package: SBC (binary: positions + NEGATIVE + value), top-k (positions +
VALUES), TernGrad-style ternary (positions + SIGNS + value), error-feedback signSGD (ALL + SIGNS
+ value), dense (ALL + VALUES).

Validation (a decoder must reject, with a reason, anything that breaks these):
magic, version, reserved bits and reserved bytes; every length against the bytes actually
present (before allocating anything); canonical varints; ``count <= numel``; ``b <= 62``;
the unary stream holds exactly ``count`` one bits, its padding is zero and its last byte is not
all padding; the remainder padding is zero; the last position ``< numel``; ``value`` finite and
``>= 0``; the expected ``numel`` and ``layout`` when the receiver knows them; ``body_length`` and
``body_crc32`` of the step; ``n_tensors`` messages exactly filling the body, or with PADDED
followed by at least one zero byte and zero bytes only. Memory a decoder
allocates is proportional to the message length, never to the declared ``numel``.

Choosing b: the encoder picks the b that minimises the stream length for the actual gaps among
``b* - 1, b*, b* + 1`` where ``b* = 1 + floor(log2(ln(phi - 1) / ln(1 - p)))``, ``phi`` the golden
ratio and ``p = count / numel`` (SBC paper, Sattler et al. 2018, eq. for optimal Golomb coding);
ties go to the smaller b. Any b is valid on the wire; this rule only makes encoders agree byte for
byte.

This module holds the format's constants and its host-side pieces (headers, varints, the choice
of b); it imports nothing else of the package. What a receiver decides about a gathered buffer —
the order of checks, which rank's ERROR/SKIP wins — is specified and implemented once in
:mod:`horovod_sbc.protocol`. The numpy reference encoder and decoder (the oracle every backend is
tested against, ``tests/golden/``) is :mod:`horovod_sbc.reference`.
"""
from __future__ import annotations

import functools
import math
import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple


VERSION = 1
STEP_MAGIC = b"SBCS"
TENSOR_MAGIC = b"SB"
STEP_HEADER = struct.Struct("<4sBBHIIII")
STEP_HEADER_SIZE = STEP_HEADER.size  # 24
STEP_FLAG_ERROR = 1
STEP_FLAG_SKIP = 2
STEP_FLAG_PADDED = 4
FLAG_NEGATIVE = 1
FLAG_VALUES = 2
FLAG_SIGNS = 4
FLAG_ALL = 8
_KNOWN_FLAGS = FLAG_NEGATIVE | FLAG_VALUES | FLAG_SIGNS | FLAG_ALL
MAX_RICE_B = 62
MAX_NUMEL = 1 << 62
_PHI = (1.0 + math.sqrt(5.0)) / 2.0


# ----------------------------------------------------------------------------------------------
# small helpers shared by every implementation (host-side integers only)
# ----------------------------------------------------------------------------------------------
def rice_parameter(p: float) -> int:
    """The SBC paper's optimal Rice parameter b* for position density ``p`` (0 < p <= 1)."""
    if not (p > 0.0):
        return 0
    if p >= 1.0:
        return 0
    x = math.log(_PHI - 1.0) / math.log1p(-p)
    if x <= 1.0:
        return 1 if x >= 0.5 else 0
    return min(MAX_RICE_B, 1 + int(math.floor(math.log2(x))))


@functools.lru_cache(maxsize=1024)
def rice_table(numel: int) -> Tuple[int, Tuple[int, ...]]:
    """``(b*(1), T)`` with ``T[j]`` the smallest count whose b* is ``<= b*(1) - 1 - j``
    (:func:`rice_parameter` is non-increasing in the count), so a device computes
    ``b*(count) = b*(1) - #{T <= count}`` with integer ops and no host round trip."""
    def bstar(c):
        return rice_parameter(c / numel)

    b1, bn = bstar(1), bstar(numel)
    ts = []
    for j in range(b1 - 1, bn - 1, -1):
        lo, hi = 1, numel  # smallest c with bstar(c) <= j
        while lo < hi:
            mid = (lo + hi) // 2
            if bstar(mid) <= j:
                hi = mid
            else:
                lo = mid + 1
        ts.append(lo)
    return b1, tuple(ts)


def choose_rice_b(count: int, numel: int, sum_q) -> int:
    """Pick b among b*-1, b*, b*+1 minimising the padded stream bytes.

    ``sum_q(b)`` returns ``sum(gaps >> b)`` for the actual gaps (a framework-specific reduction).
    """
    if count == 0:
        return 0
    b0 = rice_parameter(count / numel)
    best_b, best_len = None, None
    for b in (b0 - 1, b0, b0 + 1):
        if b < 0 or b > MAX_RICE_B:
            continue
        sq = int(sum_q(b))
        nbytes = -(-(sq + count) // 8) + -(-(count * b) // 8)
        if best_len is None or nbytes < best_len:
            best_b, best_len = b, nbytes
    return best_b


def uvarint(n: int) -> bytes:
    if n < 0 or n >= MAX_NUMEL:
        raise ValueError(f"varint out of range: {n}")
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def read_uvarint(buf, off: int, what) -> Tuple[int, int]:
    """Parse a canonical uvarint from ``buf`` (bytes-like) at ``off``; returns (value, new_off).

    ``what`` names the field in errors: a string, or ``(name, field)``, joined only if the
    field is rejected (the header parser reads three fields per tensor per rank per step)."""
    n = shift = 0
    for i in range(off, min(off + 9, len(buf))):
        byte = buf[i]
        n |= (byte & 0x7F) << shift
        if byte < 0x80:
            if byte == 0 and i > off:
                raise ValueError(f"corrupt message: non-canonical varint for {_named(what)}")
            if n >= MAX_NUMEL:
                raise ValueError(f"corrupt message: {_named(what)} = {n} is out of range "
                                 "(>= 2**62)")
            return n, i + 1
        shift += 7
    if off + 9 > len(buf):
        raise ValueError(f"truncated message: {_named(what)} varint runs past the end")
    raise ValueError(f"corrupt message: {_named(what)} varint longer than 9 bytes")


def _named(what) -> str:
    return what if isinstance(what, str) else " ".join(what)


_U32 = struct.Struct("<I")
_F32 = struct.Struct("<f")
_MAGIC0, _MAGIC1 = TENSOR_MAGIC


def tensor_header(numel: int, count: int, b: int, unary_nbytes: int, value: float,
                  negative: bool, has_values: bool = False, has_signs: bool = False,
                  all_positions: bool = False) -> bytes:
    """The bytes of a tensor message up to (excluding) the unary stream."""
    flags = ((FLAG_NEGATIVE if negative else 0) | (FLAG_VALUES if has_values else 0)
             | (FLAG_SIGNS if has_signs else 0) | (FLAG_ALL if all_positions else 0))
    return (TENSOR_MAGIC + bytes((VERSION, flags, b)) + uvarint(numel) + uvarint(count)
            + uvarint(unary_nbytes) + struct.pack("<f", value))


def layout_numel(shape) -> int:
    """Element count of a layout entry's shape (an int is taken as a 1-D shape)."""
    if isinstance(shape, int):
        return shape
    n = 1
    for d in shape:
        n *= int(d)
    return n


def layout_fingerprint(layout: Sequence[Tuple[str, Sequence[int]]]) -> int:
    """CRC-32 of ``"name:d0xd1x...;"...``: identifies the tensor set, order and shapes."""
    def dims(shape):
        return str(shape) if isinstance(shape, int) else "x".join(str(int(d)) for d in shape)
    text = "".join(f"{name}:{dims(shape)};" for name, shape in layout)
    return zlib.crc32(text.encode("utf-8")) & 0xFFFFFFFF


def step_header_bytes(body, layout_crc: int, n_tensors: int, flags: int = 0) -> bytes:
    """The 24-byte step header for ``body`` (bytes-like, host)."""
    if len(body) >= 1 << 32:
        raise ValueError("step message body exceeds 4 GiB; lower density or split the model")
    return STEP_HEADER.pack(STEP_MAGIC, VERSION, flags, 0, len(body), layout_crc, n_tensors,
                            zlib.crc32(body) & 0xFFFFFFFF)


def step_message_bytes(body: bytes, layout_crc: int, n_tensors: int, flags: int = 0) -> bytes:
    """Frame the concatenated tensor messages of one sync (host bytes)."""
    return step_header_bytes(body, layout_crc, n_tensors, flags) + bytes(body)


def error_step_message(reason: str, layout_crc: int, skip: bool = False, origin: int = 0,
                       capacity: Optional[int] = None) -> bytes:
    """A step message that tells every rank that rank ``origin`` failed (or asks to skip).
    With ``capacity`` (bytes, header included) a PADDED step of exactly that length: the
    reason, without zero bytes and cut to fit (whole UTF-8 characters), then zero padding."""
    body = reason.encode("utf-8")[:4096]
    flags = STEP_FLAG_SKIP if skip else STEP_FLAG_ERROR
    if capacity is not None:
        room = capacity - STEP_HEADER_SIZE
        if room < 1:
            raise ValueError(f"step capacity {capacity} leaves no room for padding")
        text = body.replace(b"\0", b"")[:max(0, room - 1)].decode("utf-8", "ignore").encode(
            "utf-8")
        body = text + bytes(room - len(text))
        flags |= STEP_FLAG_PADDED
    head = STEP_HEADER.pack(STEP_MAGIC, VERSION, flags, origin & 0xFFFF, len(body), layout_crc, 0,
                            zlib.crc32(body) & 0xFFFFFFFF)
    return head + body


def padded_step_message(body: bytes, layout_crc: int, n_tensors: int, capacity: int) -> bytes:
    """A PADDED step message of exactly ``capacity`` bytes: ``body`` then zero bytes (at
    least one)."""
    room = capacity - STEP_HEADER_SIZE
    if len(body) >= room:
        raise ValueError(f"step body of {len(body)} bytes exceeds its capacity of {room}")
    body = bytes(body) + bytes(room - len(body))
    return step_header_bytes(body, layout_crc, n_tensors, STEP_FLAG_PADDED) + body


def _uvarint_len(n: int) -> int:
    return max(1, -(-n.bit_length() // 7))


def stream_capacity(numel: int, max_count: int) -> int:
    """Bytes of the unary and remainder streams of at most ``max_count`` positions among
    ``numel`` elements, whatever the positions, as :func:`choose_rice_b` encodes them (the
    bound of "Fixed-size step messages")."""
    if max_count <= 0 or numel <= 0:
        return 0
    # b*(count) is constant between the thresholds of rice_table, and for a fixed b the bound
    # grows with count: each interval's bound is largest at its last count
    b1, ts = rice_table(numel)
    edges = [1] + [t for t in ts if 1 < t <= max_count] + [max_count + 1]
    worst = 0
    for lo, hi in zip(edges, edges[1:]):
        if hi <= lo:
            continue
        c = hi - 1
        b0 = b1 - sum(1 for t in ts if t <= c)
        worst = max(worst, min(-(-(((numel - c) >> b) + c) // 8) + -(-(c * b) // 8)
                               for b in (b0 - 1, b0, b0 + 1) if 0 <= b <= MAX_RICE_B))
    return worst


def tensor_capacity(numel: int, max_count: int, values: bool = False, signs: bool = False,
                    all_positions: bool = False) -> int:
    """Most bytes a tensor message of ``numel`` elements with at most ``max_count`` positions
    (the flags as in :func:`tensor_header`) can take."""
    count = numel if all_positions else min(max_count, numel)
    head = 9 + _uvarint_len(numel) + _uvarint_len(count)
    if all_positions:
        streams, head = 0, head + 1
    else:
        streams, head = stream_capacity(numel, count), head + _uvarint_len(-(-numel // 8))
    return head + streams + (-(-count // 8) if signs else 0) + (4 * count if values else 0)


def step_capacity(tensor_capacities: Sequence[int]) -> int:
    """Bytes of a PADDED step message whose tensors have these capacities."""
    return STEP_HEADER_SIZE + sum(int(c) for c in tensor_capacities) + 1


#: how a reason says that an update held NaN/Inf (the encoders' words, torch and TF)
NONFINITE_REASON = "contains NaN or Inf"


class PeerError(ValueError):
    """A rank reported, through its step message, that it could not encode this sync. A
    non-finite update stopping the job says which knob decided that and how to change it."""

    def __init__(self, rank: int, reason: str, skip: bool):
        self.rank, self.reason, self.skip = rank, reason, skip
        msg = f"rank {rank} could not encode this sync: {reason}"
        if not skip and NONFINITE_REASON in reason:
            msg += ("; SBC's nonfinite policy is 'raise' (the default; dense Horovod would "
                    "average the NaN/Inf in silently): pass SBC(..., nonfinite='skip') to skip "
                    "such a sync on every rank instead (the healthy ranks keep their update "
                    "for the next one)")
        super().__init__(msg)


# no per-message __dict__ where Python has dataclass slots (3.10+; setup.py allows 3.9): a step of
# many tensors parses hundreds of these
@dataclass(**({"slots": True} if sys.version_info >= (3, 10) else {}))
class TensorMessage:
    """A parsed tensor message (positions are decoded lazily by the framework codecs)."""
    numel: int
    count: int
    rice_b: int
    value: float
    negative: bool
    has_values: bool
    unary: Tuple[int, int]       # [start, end) byte offsets of the unary stream in the buffer
    remainder: Tuple[int, int]   # [start, end) of the remainder stream
    values: Tuple[int, int]      # [start, end) of the float32 values (empty unless has_values)
    has_signs: bool = False
    all_positions: bool = False
    signs: Tuple[int, int] = (0, 0)  # [start, end) of the sign stream (empty unless has_signs)

    @property
    def signed_value(self) -> float:
        return -self.value if self.negative else self.value

    @property
    def nbytes(self) -> int:
        """End offset of this message in the buffer."""
        return max(self.values[1], self.signs[1], self.remainder[1])


def parse_tensor_header(buf, off: int, expected_numel: Optional[int] = None,
                        name: str = "tensor") -> TensorMessage:
    """Parse and validate a tensor message header at ``off`` of ``buf`` (bytes-like).

    Checks every length against ``len(buf)``; the streams themselves are checked when decoded.
    """
    n = len(buf)
    if off + 5 > n:
        raise ValueError(f"truncated message: header of {name} cut short")
    if buf[off] != _MAGIC0 or buf[off + 1] != _MAGIC1:
        raise ValueError(f"corrupt message: bad tensor magic for {name}")
    version, flags, b = buf[off + 2], buf[off + 3], buf[off + 4]
    if version != VERSION:
        raise ValueError(f"unsupported wire format version {version} for {name} (this is {VERSION})")
    if flags & ~_KNOWN_FLAGS:
        raise ValueError(f"corrupt message: reserved flag bits set ({flags:#x}) for {name}")
    if b > MAX_RICE_B:
        raise ValueError(f"corrupt message: Rice parameter {b} > {MAX_RICE_B} for {name}")
    p = off + 5
    numel, p = read_uvarint(buf, p, (name, "numel"))
    count, p = read_uvarint(buf, p, (name, "count"))
    unary_nbytes, p = read_uvarint(buf, p, (name, "unary length"))
    if expected_numel is not None and numel != expected_numel:
        raise ValueError(f"message for {name} declares {numel} elements, expected {expected_numel} "
                         "(ranks disagree on tensor shapes?)")
    if count > numel:
        raise ValueError(f"corrupt message: {name} declares {count} positions for {numel} elements")
    if p + 4 > n:
        raise ValueError(f"truncated message: value of {name} cut short")
    # checked on the bit pattern: inside tf.function this may run on a thread whose FPU treats
    # subnormals as zero (a float comparison would then accept a subnormal where 0 is required)
    (vbits,) = _U32.unpack_from(buf, p)
    (value,) = _F32.unpack_from(buf, p)
    p += 4
    if (vbits & 0x7F800000) == 0x7F800000 or vbits >> 31:
        raise ValueError(f"corrupt message: value of {name} (float32 bits {vbits:#010x}) is not "
                         "a finite number >= 0")
    has_values = bool(flags & FLAG_VALUES)
    negative = bool(flags & FLAG_NEGATIVE)
    has_signs = bool(flags & FLAG_SIGNS)
    all_pos = bool(flags & FLAG_ALL)
    if has_values and (negative or has_signs or vbits):
        raise ValueError(f"corrupt message: {name} has per-position values and a binary value")
    if has_signs and negative:
        raise ValueError(f"corrupt message: {name} has both sign bits and NEGATIVE")
    if all_pos:
        if not (has_values or has_signs):
            raise ValueError(f"corrupt message: {name} has ALL without SIGNS or VALUES")
        if count != numel or unary_nbytes or b:
            raise ValueError(f"corrupt message: {name} has ALL but {count} positions for "
                             f"{numel} elements or non-empty position streams")
    if count == 0 and (unary_nbytes or b):
        raise ValueError(f"corrupt message: {name} has no positions but non-empty streams")
    # Each position needs at least one unary bit: bound count by the bytes present first.
    if count > 8 * unary_nbytes and count and not all_pos:
        raise ValueError(f"corrupt message: {name} unary stream too short for {count} positions")
    rem_nbytes = -(-(count * b) // 8)
    sign_nbytes = -(-count // 8) if has_signs else 0
    val_nbytes = 4 * count if has_values else 0
    end = p + unary_nbytes + rem_nbytes + sign_nbytes + val_nbytes
    if end > n:
        raise ValueError(f"truncated message: {name} needs {end - off} bytes, "
                         f"{n - off} present")
    u = (p, p + unary_nbytes)
    r = (u[1], u[1] + rem_nbytes)
    sg = (r[1], r[1] + sign_nbytes)
    v = (sg[1], sg[1] + val_nbytes)
    return TensorMessage(numel, count, b, value, negative, has_values, u, r, v, has_signs,
                         all_pos, sg)
