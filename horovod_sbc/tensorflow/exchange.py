"""The exchange for TensorFlow (GRACE's *Communicator*): encode, allgather, decode, average.

One sync is a few graph pieces, so it runs the same way eagerly and inside ``tf.function``.
With the native codec (``SBC(codec="native")``, the default):

1. **encode (TF ops, on the tensors' device)** — per tensor ``A = R + dW`` and
   :func:`horovod_sbc.tensorflow.codec.encode_sum` (selection, binarization, streams and
   tensor header as TF ops, or one kernel op for float32 binary SBC on the CPU:
   :mod:`horovod_sbc.tensorflow.native`); the new residuals ``A - sent`` are computed but not
   committed.
2. **frame (host, O(compressed bytes))** — one small ``tf.numpy_function`` gets the tensor
   messages (kilobytes) and a finiteness flag per tensor and returns the step message: the
   24-byte step header needs the CRC-32 of the body (:func:`horovod_sbc.wire.step_message_bytes`).
   A non-finite update yields an ERROR (or SKIP) step message instead
   (:func:`horovod_sbc.wire.error_step_message`), so the other ranks learn of it from the same
   allgather instead of hanging. No O(numel) tensor ever crosses to the host.
3. ``horovod.tensorflow.allgather`` of that ``uint8`` tensor (a Horovod graph op: asynchronous in
   Horovod's background thread, blocks no TensorFlow thread).
4. **decode** — :func:`horovod_sbc.tensorflow.decoder.decode_gathered`: headers and verdict on
   the host (:mod:`horovod_sbc.protocol`, on the compressed bytes), streams and the accumulation
   of ``scale`` x every rank's tensor, in rank order, in TF ops (zeros, or e.g. the reference
   weights). Every rank adds the same values in the same order: bit-identical results.

``codec="numpy"`` runs steps 1-2 and 4 with the numpy reference in ``tf.numpy_function`` (:func:`encode_step`, :func:`decode_into`), copying every
update to host memory.

The bytes are those of the wire format spec (``horovod_sbc/wire.py``), identical to the PyTorch
adapter's: a TensorFlow rank and a PyTorch rank decode each other's messages.

Errors: a ``ValueError`` raised by a host step surfaces as ``ValueError`` in eager mode; inside a
``tf.function`` TensorFlow re-raises it as ``tf.errors.InvalidArgumentError`` with the same text
(``"ValueError: SBC: rank 1 could not encode ..."``).
"""
from __future__ import annotations

import re
import warnings
from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from .. import reference, wire
from . import codec as tfcodec
from . import decoder
# what decode_into() / decoder.decode_gathered tell the caller to do with the residuals
from .decoder import COMMIT, SKIP_DROP_UPDATE, SKIP_KEEP_UPDATE  # noqa: F401

CODECS = ("native", "numpy")


def tf_name(name: str) -> str:
    """A string usable as a TensorFlow op / Horovod tensor name."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


# ----------------------------------------------------------------------------------------------
# host side (numpy): run inside tf.numpy_function
# ----------------------------------------------------------------------------------------------
def encode_step(names: Sequence[str], updates: Sequence[np.ndarray],
                residuals: Sequence[np.ndarray], density: float, binarize: bool,
                layout_crc: int, rank: int, skip: bool, selection: str = "paper"):
    """(step message as uint8 array, new residuals, failed) for one sync of this rank.

    ``new residuals`` are ``R + dW - sent`` per tensor, to be committed only once every rank's
    message decoded. On a NaN/Inf the step message is an ERROR (SKIP if ``skip``) message naming
    the tensor (and this rank as its origin), ``new residuals`` are the old ones and ``failed`` is
    True.
    """
    msgs, new_res = [], []
    for name, u, r in zip(names, updates, residuals):
        try:
            msg, res = reference.compress_np(u, r, density, binarize, selection=selection)
        except ValueError:  # the reference's only error here: R + dW holds NaN or Inf
            reason = f"the update of {name!r} contains NaN or Inf"
            step = wire.error_step_message(reason, layout_crc, skip, origin=rank)
            return (np.frombuffer(step, np.uint8).copy(), [np.asarray(x) for x in residuals],
                    True)
        msgs.append(msg)
        new_res.append(res.astype(r.dtype, copy=False))
    step = wire.step_message_bytes(b"".join(msgs), layout_crc, len(msgs))
    return np.frombuffer(step, np.uint8).copy(), new_res, False


def decode_into(gathered: np.ndarray, layout: Sequence[Tuple[str, Sequence[int]]],
                n_ranks: int, outs: List[np.ndarray], scale: float, failed: bool
                ) -> Tuple[int, List[np.ndarray]]:
    """Add ``scale`` x every rank's decoded tensors, in rank order, to ``outs`` (in place).

    Returns ``(code, outs)``: ``COMMIT`` after a good sync; if a rank sent SKIP, ``outs`` are
    untouched and the code says whether this rank keeps its update in the residual
    (``SKIP_KEEP_UPDATE``, healthy ranks) or drops it (``SKIP_DROP_UPDATE``, a rank that
    ``failed`` to encode).
    Raises ``ValueError`` if a rank sent ERROR ("SBC: rank R could not encode this sync: ...")
    or anything is malformed; nothing is added unless every step message is well-formed.
    """
    try:
        per_rank = reference.decode_step_np(np.asarray(gathered, np.uint8).tobytes(), layout,
                                       n_ranks)
    except wire.PeerError as e:
        if not e.skip:
            raise ValueError(f"SBC: {e}") from None
        warnings.warn(f"horovod_sbc: skipping this sync: {e}")
        return (SKIP_DROP_UPDATE if failed else SKIP_KEEP_UPDATE), outs
    reference.accumulate_np(per_rank, [out.reshape(-1) for out in outs], scale)
    return COMMIT, outs


# ----------------------------------------------------------------------------------------------
# graph side (TensorFlow ops)
# ----------------------------------------------------------------------------------------------
_EAGER_ALLGATHER = {}


def allgather(step: tf.Tensor, tag: str) -> tf.Tensor:
    """Every rank's step message, concatenated in rank order (``horovod.tensorflow.allgather``).

    The collective is named ``"allgather.<tag>"``, exactly as ``horovod.torch`` names its
    allgather of the same tag, so TensorFlow and PyTorch ranks of one job meet in Horovod's
    negotiation. An eager TensorFlow op loses its name (Horovod would see ``HorovodAllgather``),
    so in eager mode the op runs inside a small ``tf.function`` (one trace per tag)."""
    import horovod.tensorflow as hvd
    name = "allgather." + tf_name(tag)
    if not tf.executing_eagerly():
        return hvd.allgather(step, name=name)
    fn = _EAGER_ALLGATHER.get(name)
    if fn is None:
        fn = _EAGER_ALLGATHER[name] = tf.function(
            lambda t: hvd.allgather(t, name=name),
            input_signature=[tf.TensorSpec([None], tf.uint8)])
    return fn(step)


def residual_dtype(dtype: tf.DType) -> tf.DType:
    """fp16/bf16/fp32 updates accumulate in fp32 (small updates would vanish in 16 bits)."""
    return tf.float64 if dtype == tf.float64 else tf.float32


def frame_host(names: Sequence[str], numels: Sequence[int], layout_crc: int, rank: int,
               skip: bool, finite, headers, *bodies) -> np.ndarray:
    """Step 2 (host, compressed bytes only): the step message of this rank's tensors — each
    tensor header from its five integers (:func:`horovod_sbc.tensorflow.codec.header_bytes_host`)
    followed by its body — or an ERROR/SKIP step message naming the first tensor whose update is
    not finite."""
    for name, ok in zip(names, np.asarray(finite).tolist()):
        if not ok:
            reason = f"the update of {name!r} contains NaN or Inf"
            step = wire.error_step_message(reason, layout_crc, skip, origin=rank)
            return np.frombuffer(step, np.uint8).copy()
    body = b"".join(tfcodec.header_bytes_host(n, h) + np.asarray(b, np.uint8).tobytes()
                    for n, h, b in zip(numels, np.asarray(headers).tolist(), bodies))
    return np.frombuffer(wire.step_message_bytes(body, layout_crc, len(bodies)),
                         np.uint8).copy()


@tf.autograph.experimental.do_not_convert
def decode_gathered(gathered: tf.Tensor, layout: Sequence[Tuple[str, Sequence[int]]],
                    n_ranks: int, scale: float = 1.0, outs=None, out_dtypes=None):
    """The TF decoder on its own (flat results, see :func:`decoder.decode_gathered`): a rank's
    ERROR or SKIP raises :class:`horovod_sbc.wire.PeerError` (eagerly; inside ``tf.function`` an
    ``InvalidArgumentError``, see :func:`outcome_of_error`)."""
    return decoder.decode_gathered(gathered, layout, n_ranks, outs, scale, out_dtypes,
                                   strict=True)[1]


def outcome_of_error(e: BaseException):
    """Normalise a decoder error to ``("error"|"skip", rank, reason)`` or ``("invalid", text)``
    (TensorFlow wraps host-step exceptions inside ``tf.function``)."""
    e = decoder.original_error(e)
    if isinstance(e, wire.PeerError):
        return ("skip" if e.skip else "error", e.rank, e.reason)
    return ("invalid", str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")


@tf.autograph.experimental.do_not_convert
def exchange(names: Sequence[str], shapes: Sequence[Tuple[int, ...]],
             updates: Sequence[tf.Tensor], residuals: Sequence[tf.Tensor], *, density: float,
             binarize: bool, skip: bool, rank: int, size: int, scale: float, tag: str,
             outs: Optional[Sequence[tf.Tensor]] = None, on_gathered=None,
             selection: str = "paper", codec: str = "native"):
    """One sync as graph ops: ``(code, results, new_residuals)``.

    ``updates`` and ``residuals`` are tensors of the residual dtype; ``results`` are ``outs`` (or
    zeros) plus ``scale`` x the sum of all ranks' decoded updates; ``code`` is a scalar int32
    (see :func:`decode_into`). The caller commits ``new_residuals`` according to ``code``.
    ``on_gathered(step, gathered)`` returns ops (e.g. traffic counters) that run before decoding,
    so they count a sync that then fails too. ``codec``: ``"native"`` (TF ops) or ``"numpy"``
    (the bridge).
    """
    if codec == "numpy":
        return _exchange_numpy(names, shapes, updates, residuals, density=density,
                               binarize=binarize, skip=skip, rank=rank, size=size, scale=scale,
                               tag=tag, outs=outs, on_gathered=on_gathered, selection=selection)
    if codec != "native":
        raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
    layout = [(n, tuple(s)) for n, s in zip(names, shapes)]
    fp = wire.layout_fingerprint(layout)
    numels = [wire.layout_numel(s) for s in shapes]
    heads, bodies, finite, new_res = [], [], [], []
    for name, u, r in zip(names, updates, residuals):
        # A = dW + R, encoded (by the kernel op for float32 binary SBC on the CPU)
        enc = tfcodec.encode_sum(u, r, density, binarize, selection, name)
        heads.append(enc.header)
        bodies.append(enc.body)
        finite.append(enc.finite)
        new_res.append(tf.reshape(enc.new_residual, tf.shape(r)))
    if not names:
        heads, finite = [tf.zeros([5], tf.int64)], [tf.constant(True)]
    all_finite = tf.reduce_all(tf.stack(finite))

    def _frame(fin, hs, *bs):
        return frame_host(names, numels, fp, rank, skip, fin, hs, *bs)

    step = tf.numpy_function(_frame, [tf.stack(finite), tf.stack(heads), *bodies], tf.uint8,
                             stateful=True, name="sbc_frame")
    step.set_shape([None])
    gathered = allgather(step, tag)
    out_dtypes = [r.dtype for r in residuals] if outs is None else [o.dtype for o in outs]
    with tf.control_dependencies(on_gathered(step, gathered) if on_gathered else []):
        gathered = tf.identity(gathered)
    code, flat = decoder.decode_gathered(
        gathered, layout, size, None if outs is None else list(outs), scale, out_dtypes,
        tf.logical_not(all_finite), strict=False)
    results = [tf.reshape(t, s) for t, s in zip(flat, shapes)]
    return code, results, new_res


def _exchange_numpy(names, shapes, updates, residuals, *, density, binarize, skip, rank, size,
                    scale, tag, outs=None, on_gathered=None, selection="paper"):
    """The numpy bridge (``codec="numpy"``): steps 1-2 and 4 in ``tf.numpy_function``."""
    layout = [(n, tuple(s)) for n, s in zip(names, shapes)]
    fp = wire.layout_fingerprint(layout)
    n = len(names)
    res_dtypes = [r.dtype for r in residuals]

    def _encode(*arrays):
        step, new_res, failed = encode_step(names, arrays[:n], arrays[n:], density, binarize, fp,
                                            rank, skip, selection)
        return [step, *new_res, np.bool_(failed)]

    enc = tf.numpy_function(_encode, [*updates, *residuals], [tf.uint8, *res_dtypes, tf.bool],
                            stateful=True, name="sbc_encode")
    step, new_res, failed = enc[0], list(enc[1:1 + n]), enc[-1]
    step.set_shape([None])
    for t, s in zip(new_res, shapes):
        t.set_shape(s)
    gathered = allgather(step, tag)

    if outs is None:
        out_dtypes = res_dtypes
        out_inputs = []
    else:
        out_dtypes = [o.dtype for o in outs]
        out_inputs = list(outs)

    def _decode(g, f, *arrays):
        bufs = ([np.array(a, copy=True) for a in arrays] if arrays else
                [np.zeros(s, dt.as_numpy_dtype) for s, dt in zip(shapes, out_dtypes)])
        code, bufs = decode_into(g, layout, size, bufs, scale, bool(f))
        return [np.int32(code), *bufs]

    with tf.control_dependencies(on_gathered(step, gathered) if on_gathered else []):
        dec = tf.numpy_function(_decode, [gathered, failed, *out_inputs], [tf.int32, *out_dtypes],
                                stateful=True, name="sbc_decode")
    code, results = dec[0], list(dec[1:])
    code.set_shape([])
    for t, s in zip(results, shapes):
        t.set_shape(s)
    return code, results, new_res
