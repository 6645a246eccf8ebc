"""The protocol layer: one framework-free verdict for every decoder.

:mod:`horovod_sbc.wire` specifies the bytes; this module owns every *decision* a receiver makes
about them, so that the numpy, torch and TensorFlow decoders reach the same verdict, in the same
order, from the same bytes (docs/design.md#the-protocols-verdict): :func:`parse_gathered` judges
the headers on the host, the framework decodes the streams into :class:`StreamStats`, and
:func:`check_streams` judges those; only then may a decoder touch its output. The canonical
order of verdicts (the first problem found in this order is the one reported):

a. framing: rank by rank, a complete step header and its declared length; no trailing bytes;
b. step headers: rank by rank, magic, version, reserved bits, body length and body CRC-32;
c. ERROR before SKIP: the lowest rank that sent ERROR raises :class:`~horovod_sbc.wire.PeerError`;
   otherwise the lowest rank that sent SKIP raises a ``PeerError`` with ``skip=True``;
d. layouts: rank by rank, the layout fingerprint and the number of tensors;
e. tensor headers: rank by rank, tensor by tensor (:func:`horovod_sbc.wire.parse_tensor_header`),
   the body ending exactly after the last one, or PADDED with zero bytes only;
f. streams: rank by rank, tensor by tensor (:func:`check_streams`).

Decoded arithmetic: the output is zero-initialised (or the caller's tensor), and for each rank
in rank order each tensor message adds, at its (unique) positions,
``round_to_out_dtype(float64(value) * scale)``: ``value`` its float32 value there, ``scale`` a
Python float (e.g. ``1/size``). Malformed input is always ``ValueError`` (``PeerError`` is one
too), never ``IndexError`` or a framework error. Encoders' byte-level choices live here too
(:func:`empty_tensor_message`, next to :func:`horovod_sbc.wire.choose_rice_b`).
"""
from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Sequence, Tuple

from . import wire

Layout = Sequence[Tuple[str, Sequence[int]]]


class StepKind(enum.Enum):
    """What a step message carries."""
    TENSORS = "tensors"
    ERROR = "error"   # the sender could not encode: every rank fails
    SKIP = "skip"     # the sender asks every rank to skip this sync


@dataclass(frozen=True)
class StepHeader:
    """A validated step header and where its message lies in the gathered buffer."""
    rank: int
    start: int
    end: int
    kind: StepKind
    origin: int
    layout: int
    n_tensors: int
    padded: bool = False   # PADDED: zero bytes may follow the content up to ``end``

    @property
    def body(self) -> Tuple[int, int]:
        return self.start + wire.STEP_HEADER_SIZE, self.end


@dataclass
class GatheredStep:
    """Every rank's tensor messages of one sync, headers parsed and validated.

    ``messages[r][i]`` is rank r's message for tensor i of the layout; its offsets index the
    gathered buffer. ``names[r][i]`` is how errors name it (``"'fc.weight' from rank 1"``).
    :func:`parse_gathered` builds it complete; it is not changed afterwards (:meth:`flat`
    caches).
    """
    steps: List[StepHeader]
    messages: List[List[wire.TensorMessage]] = field(default_factory=list)
    names: List[List[str]] = field(default_factory=list)
    _flat: Optional[list] = field(default=None, repr=False, compare=False)

    def flat(self) -> List[Tuple[int, int, wire.TensorMessage, str]]:
        """(rank, tensor index, message, name) in canonical (rank, tensor) order (built once:
        the decoders and the stream check all walk it)."""
        if self._flat is None:
            self._flat = [(r, i, m, self.names[r][i]) for r, per in enumerate(self.messages)
                          for i, m in enumerate(per)]
        return self._flat


def describe(name: str, rank: int) -> str:
    return f"{name!r} from rank {rank}"


# ----------------------------------------------------------------------------------------------
# a-e: the host-side verdict
# ----------------------------------------------------------------------------------------------
def split(buf, n_ranks: int) -> List[Tuple[int, int]]:
    """(a) [start, end) of each rank's step message in the gathered concatenation."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    out = []
    off, n = 0, len(buf)
    for r in range(n_ranks):
        if off + wire.STEP_HEADER_SIZE > n:
            raise ValueError(f"truncated message: step message of rank {r} cut short")
        (body_len,) = struct.unpack_from("<I", bytes(buf[off + 8:off + 12]))
        end = off + wire.STEP_HEADER_SIZE + body_len
        if end > n:
            raise ValueError(f"truncated message: step message of rank {r} declares "
                             f"{end - off} bytes, {n - off} present")
        out.append((off, end))
        off = end
    if off != n:
        raise ValueError(f"corrupt message: {n - off} trailing bytes after {n_ranks} step messages")
    return out


def parse_step(buf, start: int, end: int, rank: int) -> StepHeader:
    """(b) Validate one step header and its body checksum."""
    who = f"rank {rank}"
    head = bytes(buf[start:start + wire.STEP_HEADER_SIZE])
    if len(head) < wire.STEP_HEADER_SIZE:
        raise ValueError(f"truncated message: step header of {who} cut short")
    magic, version, flags, origin, body_len, layout, n_tensors, crc = wire.STEP_HEADER.unpack(head)
    if magic != wire.STEP_MAGIC:
        raise ValueError(f"corrupt message: bad step magic from {who}")
    if version != wire.VERSION:
        raise ValueError(f"unsupported wire format version {version} from {who} "
                         f"(this is {wire.VERSION})")
    kinds = flags & (wire.STEP_FLAG_ERROR | wire.STEP_FLAG_SKIP)
    if flags & ~(wire.STEP_FLAG_ERROR | wire.STEP_FLAG_SKIP | wire.STEP_FLAG_PADDED) or \
            kinds == wire.STEP_FLAG_ERROR | wire.STEP_FLAG_SKIP or (origin and not kinds):
        raise ValueError(f"corrupt message: reserved step header bits set from {who}")
    if start + wire.STEP_HEADER_SIZE + body_len != end:
        raise ValueError(f"corrupt message: step body length mismatch from {who}")
    body = memoryview(buf)[start + wire.STEP_HEADER_SIZE:end]  # no copy (crc32 takes buffers)
    if zlib.crc32(body) & 0xFFFFFFFF != crc:
        raise ValueError(f"corrupt message: checksum mismatch in step message from {who}")
    kind = (StepKind.ERROR if flags & wire.STEP_FLAG_ERROR else
            StepKind.SKIP if flags & wire.STEP_FLAG_SKIP else StepKind.TENSORS)
    if kind is not StepKind.TENSORS and n_tensors:
        raise ValueError(f"corrupt message: error step message with tensors from {who}")
    padded = bool(flags & wire.STEP_FLAG_PADDED)
    if padded and kind is not StepKind.TENSORS:
        raw = bytes(body)
        zero = raw.find(0)
        if zero < 0:
            raise ValueError(f"corrupt message: padded step message from {who} has no padding")
        if not _all_zero(raw[zero:]):
            raise ValueError(f"corrupt message: padding of step message from {who} is not zero")
    return StepHeader(rank, start, end, kind, origin, layout, n_tensors, padded)


def _all_zero(raw: bytes) -> bool:
    return raw.count(0) == len(raw)


def peer_error(buf, step: StepHeader) -> wire.PeerError:
    """The :class:`~horovod_sbc.wire.PeerError` an ERROR/SKIP step message reports."""
    s, e = step.body
    body = bytes(buf[s:e])
    reason = (body.split(b"\0", 1)[0] if step.padded else body).decode("utf-8", "replace")
    return wire.PeerError(step.origin, reason, step.kind is StepKind.SKIP)


def parse_gathered(buf, layout: Layout, n_ranks: int) -> GatheredStep:
    """(a)-(e): the verdict of a gathered buffer up to the streams (see the module docstring).

    ``buf`` is host bytes-like (the compressed messages only). Raises ``PeerError`` for a
    rank's ERROR/SKIP and ``ValueError`` for anything malformed.
    """
    ranges = split(buf, n_ranks)
    steps = [parse_step(buf, s, e, r) for r, (s, e) in enumerate(ranges)]
    for kind in (StepKind.ERROR, StepKind.SKIP):
        for st in steps:
            if st.kind is kind:
                raise peer_error(buf, st)
    fp = wire.layout_fingerprint(layout)
    for st in steps:
        if st.layout != fp:
            raise ValueError(f"rank {st.rank} sent a different tensor layout (set, order or sizes "
                             f"of parameters) than this rank: fingerprint {st.layout:#010x} != "
                             f"{fp:#010x}")
        if st.n_tensors != len(layout):
            raise ValueError(f"rank {st.rank} sent {st.n_tensors} tensors, this rank expects "
                             f"{len(layout)}")
    messages, all_names = [], []
    numels = [wire.layout_numel(shape) for _, shape in layout]
    mv = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else memoryview(buf)
    for st in steps:
        off = st.body[0]
        per, names = [], []
        mine = mv[:st.end]  # a tensor message must not run into the next rank's (no copy)
        for (name, _), numel in zip(layout, numels):
            who = describe(name, st.rank)
            msg = wire.parse_tensor_header(mine, off, numel, who)
            per.append(msg)
            names.append(who)
            off = msg.nbytes
        if off != st.end and not st.padded:
            raise ValueError(f"corrupt message: {st.end - off} stray bytes in step message of "
                             f"rank {st.rank}")
        if st.padded and off == st.end:
            raise ValueError(f"corrupt message: padded step message from rank {st.rank} has "
                             "no padding")
        if off != st.end and not _all_zero(bytes(mv[off:st.end])):
            raise ValueError(f"corrupt message: padding of step message from rank {st.rank} "
                             "is not zero")
        messages.append(per)
        all_names.append(names)
    return GatheredStep(steps, messages, all_names)


# ----------------------------------------------------------------------------------------------
# f: streams
# ----------------------------------------------------------------------------------------------
class StreamStats(NamedTuple):
    """What a framework measures on one tensor message's streams (its own ops, any device).

    Every field is an exact integer (or bool) that cannot overflow int64 for any input whose
    headers passed :func:`parse_gathered`:

    ones              one bits in the unary stream
    unary_last_zero   the unary stream's last byte is 0 (all padding)
    max_q             largest quotient (zero bits before a one bit; < 8 x unary bytes)
    max_r             largest remainder (< 2**rice_b <= 2**62)
    rem_pad_nonzero   a padding bit of the remainder stream is set
    pos_max           largest decoded position, ``cumsum(q << b + r + 1) - 1`` in int64
                      (only consulted once ``max_q``/``max_r`` showed that no gap reaches numel,
                      which makes the first out-of-range position exact)
    sign_pad_nonzero  a padding bit of the sign stream is set (SIGNS only)
    nonfinite         number of non-finite float32 values, tested on the bit pattern (VALUES
                      only; TensorFlow flushes subnormals inside ``tf.function``)

    Messages with ``count == 0`` or ALL use only the fields that apply (others 0/False).
    A named tuple (immutable, and cheap to build: a decoder makes one per message).
    """
    ones: int = 0
    unary_last_zero: bool = False
    max_q: int = 0
    max_r: int = 0
    rem_pad_nonzero: bool = False
    pos_max: int = -1
    sign_pad_nonzero: bool = False
    nonfinite: int = 0

    @classmethod
    def from_row(cls, row: Sequence[int]) -> "StreamStats":
        """From one row of a framework's batched ``[n_messages, 8]`` int64 statistics."""
        v = [int(x) for x in row]
        return cls(v[0], bool(v[1]), v[2], v[3], bool(v[4]), v[5], bool(v[6]), v[7])


def check_stream(msg: wire.TensorMessage, st: StreamStats, name: str) -> None:
    """(f) for one message: raise ``ValueError`` for the first problem of its streams."""
    if msg.count and not msg.all_positions:
        if st.unary_last_zero:
            raise ValueError(f"corrupt message: {name} unary stream ends in a padding-only byte")
        if st.ones != msg.count:
            raise ValueError(f"corrupt message: {name} unary stream holds {st.ones} codes, "
                             f"header says {msg.count}")
        if st.rem_pad_nonzero:
            raise ValueError(f"corrupt message: {name} remainder padding is not zero")
        if (st.max_q << msg.rice_b) + st.max_r >= msg.numel or st.pos_max >= msg.numel:
            raise ValueError(f"corrupt message: {name} has positions out of range for "
                             f"{msg.numel} elements")
    if msg.has_signs and st.sign_pad_nonzero:
        raise ValueError(f"corrupt message: {name} sign padding is not zero")
    if msg.has_values and st.nonfinite:
        raise ValueError(f"corrupt message: {name} carries non-finite values")


def check_streams(step: GatheredStep, stats: Sequence[StreamStats]) -> None:
    """(f): ``stats`` in :meth:`GatheredStep.flat` order; raises the first problem."""
    flat = step.flat()
    if len(stats) != len(flat):
        raise AssertionError(f"{len(stats)} stream statistics for {len(flat)} messages")
    for (_, _, msg, name), st in zip(flat, stats):
        check_stream(msg, st, name)


# ----------------------------------------------------------------------------------------------
# encoders' byte-level choices
# ----------------------------------------------------------------------------------------------
def empty_tensor_message() -> bytes:
    """The one encoding of a tensor with no elements, whatever the mode (no ALL flag)."""
    return wire.tensor_header(0, 0, 0, 0, 0.0, False)
