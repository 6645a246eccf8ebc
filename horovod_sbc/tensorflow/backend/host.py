"""The host half of every TensorFlow decode: the parse of a gathered step, in exact Python
integers (:mod:`horovod_sbc.protocol`), run by ``tf.numpy_function``; the verdict on its streams
(in TF ops, with a host step only to name what failed); and the CPU kernel backend's step
framing (:func:`frame`; the ops backend frames on the device, :mod:`.frame`).

Both backends decode in four pieces, the same eagerly and inside ``tf.function`` (what runs
where, and costs: docs/tensorflow.md, "The backends: what runs where"):

1. **parse (host, here)** — the gathered *compressed* bytes (O(message bytes), never O(numel)):
   step messages, step headers and CRC-32s, the step's verdict (malformed framing > ERROR >
   SKIP, lowest rank first), the layout and every tensor header (:mod:`horovod_sbc.wire`); one
   row of integers per tensor message (:mod:`.table`: stream offsets, count, Rice b, kind,
   value bits).
2. **streams (the backend)** — positions and the per-message statistics the protocol judges
   (:class:`horovod_sbc.protocol.StreamStats`).
3. **verdict (device, here)** — :func:`stream_faults`: :func:`horovod_sbc.protocol.check_stream`
   on those statistics in TF ops; only when a message fails does :func:`check_stats_host` (in
   the ``tf.cond`` branch a failure takes) run ``check_stream`` itself for the exact error.
   Nothing is added to any output before the verdict passed (a control dependency).
4. **accumulate (the backend)** — ``scale`` x every rank's tensor, rank order at every element.

Errors: ``ValueError`` raised by the host steps (``InvalidArgumentError`` with the same text
inside ``tf.function``, a NUL written ``\\x00``: :func:`tf_text`; :func:`original_error` gives
the Python exception back, e.g. a peer's ``PeerError`` with its exact reason and rank).
"""
from __future__ import annotations

import enum
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ... import protocol, wire
from .codec import Encoded, header_bytes_host
from .table import (C_B, C_COUNT, C_KIND, C_NUMEL, K_ALL_SIGNS, K_ALL_VALUES, K_BINARY, K_SIGNS,
                    K_VALUES, N_COLS)


class SyncCode(enum.IntEnum):
    """What a decode tells the caller to do with its residuals (an int32 inside graphs)."""
    COMMIT = 0            # the sync succeeded: subtract what was sent
    SKIP_KEEP_UPDATE = 1  # a rank asked to skip: healthy ranks keep R + dW in the residual
    SKIP_DROP_UPDATE = 2  # ... and the rank that failed to encode drops its update


COMMIT, SKIP_KEEP_UPDATE, SKIP_DROP_UPDATE = (SyncCode.COMMIT, SyncCode.SKIP_KEEP_UPDATE,
                                              SyncCode.SKIP_DROP_UPDATE)

_LAST_ERROR: List[BaseException] = []


def tf_text(text: str) -> str:
    """``text`` as a TensorFlow op error can carry it whole: TensorFlow passes an exception's
    text through a C string, which ends at the first NUL (a peer's ERROR reason may hold NUL
    bytes: an unpadded reason is any UTF-8), so NUL is written ``\\x00`` (and a lone surrogate,
    which has no UTF-8, as its ``\\u`` escape)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\0", "\\x00")


def _remember(e: BaseException, graph: bool = False) -> BaseException:
    """Keep the last exception a host step raised, and return what to raise: ``e`` itself,
    or with ``graph`` (the host step runs inside ``tf.function``, where TensorFlow delivers it
    as ``InvalidArgumentError`` text) a copy of ``e`` whose text is :func:`tf_text` (its
    attributes, e.g. a ``PeerError``'s exact reason, stay ``e``'s). :func:`original_error` gives
    ``e`` back, found by that text, whatever ``e``'s own text holds."""
    _LAST_ERROR[:] = [e]
    text = str(e)
    if not graph or tf_text(text) == text:
        return e
    stand_in = BaseException.__new__(type(e))  # the same type, no __init__ (PeerError's takes 3)
    stand_in.args = (tf_text(text),)
    if hasattr(e, "__dict__"):
        stand_in.__dict__.update(e.__dict__)
    return stand_in


def original_error(e: BaseException) -> BaseException:
    """The Python exception behind ``e`` (an ``InvalidArgumentError`` from a host step inside
    ``tf.function``), or ``e`` itself."""
    if isinstance(e, tf.errors.OpError) and _LAST_ERROR and \
            tf_text(str(_LAST_ERROR[0])) in e.message:
        return _LAST_ERROR[0]
    return e


def _row(host: bytes, msg: wire.TensorMessage, t: int, r: int) -> List[int]:
    # the value's bits straight from the bytes: inside tf.function this runs on a TensorFlow
    # thread whose FPU flushes subnormals, so msg.value (a float) may have lost them
    vbits = int.from_bytes(host[msg.unary[0] - 4:msg.unary[0]], "little")
    if msg.all_positions:
        kind = K_ALL_VALUES if msg.has_values else K_ALL_SIGNS
    else:
        kind = K_VALUES if msg.has_values else K_SIGNS if msg.has_signs else K_BINARY
    return [t, r, msg.count, msg.rice_b, kind, msg.unary[0], msg.unary[1] - msg.unary[0],
            msg.remainder[0], msg.signs[0], msg.values[0], vbits, int(msg.negative),
            msg.numel, msg.remainder[1] - msg.remainder[0], msg.signs[1] - msg.signs[0]]


def _parse(host: bytes, layout, n_ranks: int, single: bool):
    if single:
        name, shape = layout[0]
        msg = wire.parse_tensor_header(host, 0, wire.layout_numel(shape), name)
        if msg.nbytes != len(host):
            raise ValueError("corrupt message: trailing bytes after tensor message")
        return [(0, 0, msg, name)]
    return protocol.parse_gathered(host, layout, n_ranks).flat()


def parse_host(buf: np.ndarray, layout: Sequence[Tuple[str, Sequence[int]]], n_ranks: int,
               failed: bool, single: bool, strict: bool,
               graph: bool = False) -> Tuple[np.int32, np.ndarray]:
    """Step 1: ``(code, table int64 [n_ranks * len(layout), N_COLS])``
    (:func:`horovod_sbc.protocol.parse_gathered`, checks a-e).

    ``single``: ``buf`` is one bare tensor message (no step framing), as ``decompress`` takes.
    ``strict``: a rank's ERROR or SKIP raises :class:`horovod_sbc.wire.PeerError`. Otherwise
    ERROR raises ``ValueError("SBC: rank R could not encode ...")`` and SKIP warns and returns a
    table without positions (outputs stay as they were) and the code ``SKIP_DROP_UPDATE`` if
    this rank ``failed``, else ``SKIP_KEEP_UPDATE``. ``graph``: it runs inside
    ``tf.function`` (errors are raised with :func:`tf_text`, see :func:`_remember`).
    """
    host = np.asarray(buf, np.uint8).tobytes()
    table = np.zeros((n_ranks * len(layout), N_COLS), np.int64)
    try:
        flat = _parse(host, layout, n_ranks, single)
    except wire.PeerError as e:
        if strict:
            raise _remember(e, graph)
        if not e.skip:
            raise _remember(ValueError(f"SBC: {e}"), graph) from None
        warnings.warn(f"horovod_sbc: skipping this sync: {e}")
        return np.int32(SKIP_DROP_UPDATE if failed else SKIP_KEEP_UPDATE), table
    except ValueError as e:
        raise _remember(e, graph)
    for row, (r, t, msg, _) in enumerate(flat):
        table[row] = _row(host, msg, t, r)
    return np.int32(COMMIT), table


def check_stats_host(buf: np.ndarray, code, stats: np.ndarray,
                     layout: Sequence[Tuple[str, Sequence[int]]], n_ranks: int,
                     single: bool, graph: bool = False) -> np.int32:
    """Step 3 on the host, run only once :func:`stream_faults` found a problem: raise the
    ``ValueError`` of :func:`horovod_sbc.protocol.check_stream` for the first message that
    fails (check f). The headers are parsed again (stateless; O(number of tensors) on the
    compressed bytes)."""
    if int(code) != COMMIT:
        return np.int32(0)
    flat = _parse(np.asarray(buf, np.uint8).tobytes(), layout, n_ranks, single)
    rows = [protocol.StreamStats.from_row(x) for x in np.asarray(stats).tolist()]
    try:
        for (_, _, msg, name), st in zip(flat, rows):
            protocol.check_stream(msg, st, name)
    except ValueError as e:
        raise _remember(e, graph)
    raise _remember(AssertionError(  # the device verdict and the protocol must agree
        "horovod_sbc: the TensorFlow stream verdict found a problem that "
        "protocol.check_stream does not; please report this"))


def stream_faults(table: tf.Tensor, stats: tf.Tensor) -> tf.Tensor:
    """Step 3 in TF ops, on the tensors' device: bool per message, True where
    :func:`horovod_sbc.protocol.check_stream` raises for that row of ``table`` (int64
    ``[M, N_COLS]``) and of ``stats`` (int64 ``[M, 8]``, the fields of
    :class:`horovod_sbc.protocol.StreamStats` in order). ``(max_q << b) + max_r >= numel`` is
    tested without overflowing int64 as ``max_r >= numel or max_q > (numel - 1 - max_r) >> b``
    (``b <= 62``)."""
    count, b, kind, numel = (table[:, c] for c in (C_COUNT, C_B, C_KIND, C_NUMEL))
    ones, last_zero, max_q, max_r, rem_pad, pos_max, sign_pad, nonfinite = tf.unstack(
        stats, 8, axis=1)
    every = (kind == K_ALL_SIGNS) | (kind == K_ALL_VALUES)
    signs = (kind == K_SIGNS) | (kind == K_ALL_SIGNS)
    values = (kind == K_VALUES) | (kind == K_ALL_VALUES)
    room = tf.bitwise.right_shift(tf.maximum(numel - 1 - max_r, 0), b)
    out_of_range = (max_r >= numel) | (max_q > room) | (pos_max >= numel)
    positions = (count > 0) & ~every & ((last_zero != 0) | (ones != count) | (rem_pad != 0)
                                        | out_of_range)
    return positions | (signs & (sign_pad != 0)) | (values & (nonfinite != 0))


def parse(gathered: tf.Tensor, layout, n_ranks: int, failed=False, single: bool = False,
          strict: bool = True) -> Tuple[tf.Tensor, tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]:
    """Steps 1 and 3 as graph ops: ``(code, table, check)``; ``check(stats)`` (int64 ``[M, 8]``
    statistics rows) returns the verdict op that must run, and pass, before anything is added:
    TF ops, and a host step only on the branch taken when a message failed.
    ``gathered`` is flat uint8; see :func:`parse_host` for the arguments."""
    graph = not tf.executing_eagerly()  # errors as TF text (inside tf.function) or objects

    def parse_fn(g, f):
        return parse_host(g, layout, n_ranks, bool(f), single, strict, graph)

    code, table = tf.numpy_function(parse_fn, [gathered, tf.cast(failed, tf.bool)],
                                    [tf.int32, tf.int64], stateful=True, name="sbc_parse")
    code.set_shape([])
    table.set_shape([n_ranks * len(layout), N_COLS])

    def check(stats):
        fault = tf.equal(code, int(COMMIT)) & tf.reduce_any(stream_faults(table, stats))

        def explain():  # the host only when a message failed: its exact error
            return tf.numpy_function(
                lambda g, c, st: check_stats_host(g, c, st, layout, n_ranks, single, graph),
                [gathered, code, stats], tf.int32, stateful=True, name="sbc_verdict")

        return tf.cond(fault, explain, lambda: tf.constant(0, tf.int32))

    return code, table, check


def nonfinite_step(name: str, layout_crc: int, rank: int, skip: bool,
                   capacity: Optional[int]) -> Tuple[bytes, int]:
    """The ERROR (``skip``: SKIP) step message naming ``name`` as not finite, and its zero
    padding in bytes (0 without ``capacity``: a reason holds no zero byte)."""
    step = wire.error_step_message(f"the update of {name!r} contains NaN or Inf", layout_crc,
                                   skip, rank, capacity)
    return step, (len(step) - len(step.rstrip(b"\0")) if capacity else 0)


def frame_host(names: Sequence[str], numels: Sequence[int], layout_crc: int, rank: int,
               skip: bool, capacity: Optional[int], finite, headers, *bodies):
    """The step message of this rank's tensors on the host (compressed bytes only) — each
    tensor header from its five integers (:func:`.codec.header_bytes_host`) followed by its
    body — or an ERROR/SKIP step message naming the first tensor whose update is not finite;
    with ``capacity`` a PADDED step of exactly that many bytes. Returns (the step uint8, its
    zero padding in bytes int64)."""
    for name, ok in zip(names, np.asarray(finite).tolist()):
        if not ok:
            step, pad = nonfinite_step(name, layout_crc, rank, skip, capacity)
            return np.frombuffer(step, np.uint8).copy(), np.int64(pad)
    body = b"".join(header_bytes_host(n, h) + np.asarray(b, np.uint8).tobytes()
                    for n, h, b in zip(numels, np.asarray(headers).tolist(), bodies))
    if capacity is None:
        step, pad = wire.step_message_bytes(body, layout_crc, len(bodies)), 0
    else:
        step = wire.padded_step_message(body, layout_crc, len(bodies), capacity)
        pad = capacity - wire.STEP_HEADER_SIZE - len(body)
    return np.frombuffer(step, np.uint8).copy(), np.int64(pad)


def frame(encoded: Sequence[Encoded], names: Sequence[str], numels: Sequence[int],
          layout_crc: int, rank: int, skip: bool,
          capacity: Optional[int]) -> Tuple[tf.Tensor, tf.Tensor]:
    """:func:`frame_host` as one ``tf.numpy_function`` on the compressed messages."""
    heads = [e.header for e in encoded] or [tf.zeros([5], tf.int64)]
    finite = [e.finite for e in encoded] or [tf.constant(True)]

    def fn(fin, hs, *bs):
        return frame_host(names, numels, layout_crc, rank, skip, capacity, fin, hs, *bs)

    step, padding = tf.numpy_function(fn, [tf.stack(finite), tf.stack(heads),
                                           *[e.body for e in encoded]],
                                      [tf.uint8, tf.int64], stateful=True, name="sbc_frame")
    step.set_shape([None] if capacity is None else [capacity])
    padding.set_shape([])
    return step, padding
