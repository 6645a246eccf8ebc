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
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from ... import wire
from ..backend import Backend, codec, frame
# what a decode tells the caller to do with the residuals
from ..backend.host import COMMIT, SKIP_DROP_UPDATE, SKIP_KEEP_UPDATE  # noqa: F401

__all__ = ["COMMIT", "SKIP_DROP_UPDATE", "SKIP_KEEP_UPDATE", "Uplink", "allgather", "alltoall",
           "collective_name", "encode_step", "exchange", "residual_dtype", "tf_name"]


def tf_name(name: str) -> str:
    """A string usable as a TensorFlow op / Horovod tensor name."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


# ----------------------------------------------------------------------------------------------
# graph side (TensorFlow ops)
# ----------------------------------------------------------------------------------------------
_EAGER = {}


def collective_name(kind: str, tag: str) -> str:
    """The name of a Horovod collective: ``"<kind>.<tag>"``, exactly as ``horovod.torch`` names
    its collectives (``GetOpName``), so TensorFlow and PyTorch ranks of one job meet in
    Horovod's negotiation (characters a TensorFlow op name cannot hold become ``_``; dots
    stay, so torch's ``"sbc.sync.parts"`` is the same name here)."""
    return kind + "." + re.sub(r"[^A-Za-z0-9_.]", "_", tag)


def _eager(key, op, signature):
    """``op`` run inside a small ``tf.function`` (one trace per name and process set): an eager
    TensorFlow op loses its name (Horovod would see ``HorovodAllgather``)."""
    fn = _EAGER.get(key)
    if fn is None:
        fn = _EAGER[key] = tf.function(op, input_signature=signature)
    return fn


def _among(process_set) -> Tuple[dict, object]:
    """Horovod's keyword arguments for a collective among ``process_set`` (None: the global
    set, the flat exchange's collectives unchanged) and the key of its eager function. Among a
    process set the name ignores TensorFlow's name scope, as the hierarchy's collectives do:
    torch ranks of the set meet the bare ``"<kind>.<tag>"``."""
    if process_set is None:
        return {}, None
    return {"process_set": process_set, "ignore_name_scope": True}, process_set.process_set_id


def allgather(step: tf.Tensor, tag: str, process_set=None) -> tf.Tensor:
    """Every rank's step message, concatenated in rank order (``horovod.tensorflow.allgather``),
    the collective named ``"allgather.<tag>"`` (:func:`collective_name`); among the ranks of the
    Horovod ``process_set`` (in its rank order) if given, else among every rank."""
    import horovod.tensorflow as hvd
    name = collective_name("allgather", tag)
    kw, key = _among(process_set)
    if not tf.executing_eagerly():
        return hvd.allgather(step, name=name, **kw)
    return _eager(name if key is None else (name, key),
                  lambda t: hvd.allgather(t, name=name, **kw),
                  [tf.TensorSpec([None], tf.uint8)])(step)


def alltoall(buf: tf.Tensor, splits: tf.Tensor, tag: str, process_set=None) -> tf.Tensor:
    """``buf`` (uint8) cut into ``splits[r]`` bytes for each rank r, in rank order; returns what
    every rank sent this one, concatenated in rank order (``horovod.tensorflow.alltoall``,
    named ``"alltoall.<tag>"`` as ``horovod.torch`` names its alltoall of the same tag). With
    ``process_set`` the ranks are that Horovod process set's (``r`` its rank in the set)."""
    import horovod.tensorflow as hvd
    name = collective_name("alltoall", tag)
    kw, key = _among(process_set)
    splits = tf.cast(splits, tf.int32)
    if not tf.executing_eagerly():
        return hvd.alltoall(buf, splits=splits, name=name, **kw)[0]
    return _eager(name if key is None else (name, key),
                  lambda t, s: hvd.alltoall(t, splits=s, name=name, **kw)[0],
                  [tf.TensorSpec([None], tf.uint8), tf.TensorSpec([None], tf.int32)])(buf, splits)


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
    up = encode_step(backend, names, shapes, updates, residuals, density=density, mode=mode,
                     skip=skip, rank=rank, selection=selection, seeds=seeds, capacity=capacity)
    gathered = allgather(up.step, tag)
    out_dtypes = [r.dtype for r in residuals] if outs is None else [o.dtype for o in outs]
    with tf.control_dependencies(on_gathered(up.step, gathered, up.padding)
                                 if on_gathered else []):
        gathered = tf.identity(gathered)
    code, flat = backend.decode(gathered, layout, size, scale=scale,
                                outs=None if outs is None else list(outs),
                                out_dtypes=out_dtypes, failed=up.failed, strict=False)
    results = [tf.reshape(t, s) for t, s in zip(flat, shapes)]
    return code, results, up.new_residuals, up.positions


@dataclass
class Uplink:
    """This rank's part of a sync, encoded and framed (nothing committed): its ``step``
    message (uint8) and that step's zero ``padding`` (int64), the ``new_residuals`` ``A - sent``
    (each shaped like its residual), whether this rank ``failed`` to encode (a non-finite
    update: the step is then its ERROR/SKIP) and the ``positions`` its messages carry."""
    step: tf.Tensor
    padding: tf.Tensor
    new_residuals: List[tf.Tensor]
    failed: tf.Tensor
    positions: tf.Tensor


def encode_step(backend: Backend, names: Sequence[str], shapes: Sequence[Tuple[int, ...]],
                updates: Sequence[tf.Tensor], residuals: Sequence[tf.Tensor], *,
                density: float, mode="sbc", skip: bool, rank: int, selection: str = "paper",
                seeds: Optional[Sequence[tf.Tensor]] = None,
                capacity: Optional[int] = None) -> Uplink:
    """Steps 1 and 2 of the module docstring: ``A = dW + R`` of every tensor encoded and the
    step message framed (the ERROR/SKIP step naming the first non-finite tensor instead)."""
    layout = [(n, tuple(s)) for n, s in zip(names, shapes)]
    numels = [wire.layout_numel(s) for s in shapes]
    encoded = backend.encode(names, updates, residuals, density=density, mode=mode,
                             selection=selection, seeds=seeds)
    heads = [e.header for e in encoded] or [tf.zeros([5], tf.int64)]
    finite = [e.finite for e in encoded]
    new_res = [tf.reshape(e.new_residual, tf.shape(r)) for e, r in zip(encoded, residuals)]
    all_finite = tf.reduce_all(tf.stack(finite + [tf.constant(True)]))
    bound = capacity or frame.step_bound(tuple(numels), density, codec.normalize_mode(mode))
    step, padding = backend.frame(encoded, names, numels, wire.layout_fingerprint(layout), rank,
                                  skip, capacity, bound)
    return Uplink(step, padding, new_res, tf.logical_not(all_finite),
                  tf.reduce_sum(tf.stack(heads)[:, 2]))
