"""The exchange for TensorFlow (GRACE's *Communicator*): encode, allgather, decode, average.

One sync is a few graph pieces, so it runs the same way eagerly and inside ``tf.function``:

1. **encode (the backend, on the tensors' device)** — per tensor ``A = R + dW`` and its
   tensor message (:meth:`horovod_sbc.tensorflow.backend.Backend.encode`: TF ops, or one kernel
   op per float32 tensor of binary SBC on the CPU); the new residuals ``A - sent`` are computed
   but not committed.
2. **frame (the backend)** — the step message: the 24-byte step header with the CRC-32 of the
   body (:meth:`horovod_sbc.tensorflow.backend.Backend.frame`, the bytes of
   :func:`horovod_sbc.wire.step_message_bytes`), in TF ops on the tensors' device (GPU tensors:
   nothing crosses to the host) or, with the CPU kernels, on the host. A non-finite update
   yields an ERROR (or SKIP) step message (:func:`horovod_sbc.wire.error_step_message`), so the
   other ranks learn of it from the same allgather instead of hanging.
3. ``horovod.tensorflow.allgather`` of that ``uint8`` tensor (a Horovod graph op: asynchronous in
   Horovod's background thread, blocks no TensorFlow thread).
4. **decode (the backend)** — :meth:`horovod_sbc.tensorflow.backend.Backend.decode`: headers
   and verdict on the host (:mod:`horovod_sbc.protocol`, on the compressed bytes), streams and
   the accumulation of ``scale`` x every rank's tensor, in rank order (onto zeros, or e.g. the
   reference weights): every rank adds the same values in the same order, bit-identically.

The bytes are those of the wire format spec (``horovod_sbc/wire.py``), identical to the PyTorch
adapter's. A host step's ``ValueError`` is a ``ValueError`` eagerly and, inside a
``tf.function``, ``tf.errors.InvalidArgumentError`` with the same text (docs/design.md).
"""
from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

import tensorflow as tf

from ... import wire
from ..backend import Backend, codec, frame
# what a decode tells the caller to do with the residuals
from ..backend.host import COMMIT, SKIP_DROP_UPDATE, SKIP_KEEP_UPDATE  # noqa: F401


def tf_name(name: str) -> str:
    """A string usable as a TensorFlow op / Horovod tensor name."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


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


@tf.autograph.experimental.do_not_convert
def exchange(backend: Backend, names: Sequence[str], shapes: Sequence[Tuple[int, ...]],
             updates: Sequence[tf.Tensor], residuals: Sequence[tf.Tensor], *, density: float,
             mode="sbc", skip: bool, rank: int, size: int, scale: float, tag: str,
             outs: Optional[Sequence[tf.Tensor]] = None, on_gathered=None,
             selection: str = "paper", seeds: Optional[Sequence[tf.Tensor]] = None,
             capacity: Optional[int] = None):
    """One sync as graph ops, encoded and decoded by ``backend``: ``(code, results,
    new_residuals, positions)``.

    ``updates`` and ``residuals`` are tensors of the residual dtype; ``results`` are ``outs`` (or
    zeros) plus ``scale`` x the sum of all ranks' decoded updates; ``code`` is a scalar int32
    (:class:`horovod_sbc.tensorflow.backend.host.SyncCode`). The caller commits ``new_residuals``
    according to ``code``; ``positions`` (int64 scalar) is how many positions this rank's
    messages carry (``stats()["positions_sent"]`` of a committed sync).
    ``on_gathered(step, gathered, padding)`` returns ops (e.g. traffic counters) that run before
    decoding, so they count a sync that then fails too (``padding``: the zero bytes of a
    fixed-size step, int64). ``capacity``: every step message padded to this many bytes
    (``fixed_size``, :mod:`horovod_sbc.wire`). ``mode``: the compressor (``True``/``False``
    are ``"sbc"``/``"values"``); ``seeds``: per tensor, the stateless seed of a random one.
    """
    layout = [(n, tuple(s)) for n, s in zip(names, shapes)]
    fp = wire.layout_fingerprint(layout)
    numels = [wire.layout_numel(s) for s in shapes]
    # A = dW + R, encoded (not committed)
    encoded = backend.encode(names, updates, residuals, density=density, mode=mode,
                             selection=selection, seeds=seeds)
    heads = [e.header for e in encoded] or [tf.zeros([5], tf.int64)]
    finite = [e.finite for e in encoded]
    new_res = [tf.reshape(e.new_residual, tf.shape(r)) for e, r in zip(encoded, residuals)]
    all_finite = tf.reduce_all(tf.stack(finite + [tf.constant(True)]))
    bound = capacity or frame.step_bound(tuple(numels), density, codec.normalize_mode(mode))
    step, padding = backend.frame(encoded, names, numels, fp, rank, skip, capacity, bound)
    gathered = allgather(step, tag)
    out_dtypes = [r.dtype for r in residuals] if outs is None else [o.dtype for o in outs]
    with tf.control_dependencies(on_gathered(step, gathered, padding) if on_gathered else []):
        gathered = tf.identity(gathered)
    code, flat = backend.decode(gathered, layout, size, scale=scale,
                                outs=None if outs is None else list(outs),
                                out_dtypes=out_dtypes, failed=tf.logical_not(all_finite),
                                strict=False)
    results = [tf.reshape(t, s) for t, s in zip(flat, shapes)]
    return code, results, new_res, tf.reduce_sum(tf.stack(heads)[:, 2])
