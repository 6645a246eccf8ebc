"""The downlink of the ``"server"`` and ``"reduce_scatter"`` topologies, as TensorFlow graph pieces.

An aggregator (rank 0 of the server topology, or the owner of a region) decodes the step
messages it received, averages them, adds its own downlink residual and compresses the average
again (Zou, De Sterck, Liu, arXiv 2209.15203), as torch's ``server.server_step`` and
``scatter.owner_step`` do. Before anything is decoded, the host judges the received messages
(:func:`verdict_host`: the protocol's checks a-e, :mod:`horovod_sbc.protocol`): a rank's
ERROR/SKIP is relayed and a malformed uplink becomes an ERROR naming the aggregator, so every
rank learns of it from the downlink instead of the aggregator raising alone. The new downlink
residuals are returned, not committed: the caller commits them once the whole sync decoded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ... import protocol, reference, wire
from ..backend import Backend, codec, frame


@dataclass(frozen=True)
class Downlink:
    """How the aggregate is compressed again: ``density`` (None: dense, the exact average and
    no residual: the server's ``downlink_density=None``), ``mode`` (a registered compressor,
    :attr:`horovod_sbc.config.SBCConfig.downlink_compressor`) and the ``selection``."""
    density: Optional[float]
    mode: str
    selection: str = "paper"


def verdict_host(buf: np.ndarray, layout, n_ranks: int, fp: int, origin: int,
                 what: str) -> Tuple[np.bool_, np.ndarray]:
    """``(ok, error step)``: whether the ``n_ranks`` step messages in ``buf`` pass the checks
    a-e; if not, the ERROR/SKIP step (of layout fingerprint ``fp``) that relays a rank's
    ERROR/SKIP, or that names ``origin`` with ``"<what>: <the problem>"``."""
    host = np.asarray(buf, np.uint8).tobytes()
    try:
        protocol.parse_gathered(host, layout, n_ranks)
        return np.bool_(True), np.zeros(0, np.uint8)
    except wire.PeerError as e:
        step = wire.error_step_message(e.reason, fp, e.skip, e.rank)
    except ValueError as e:
        step = wire.error_step_message(f"{what}: {e}", fp, False, origin)
    return np.bool_(False), np.frombuffer(step, np.uint8).copy()


def reencode(backend: Backend, received: tf.Tensor, layout, n_ranks: int, scale: float,
             residuals: Sequence[tf.Tensor], down: Downlink, origin: int, what: str,
             acc_dtype: tf.DType) -> Tuple[tf.Tensor, List[tf.Tensor]]:
    """``(step, new residuals)``: the aggregator's step message of ``layout`` (``scale`` x the
    sum of the ``n_ranks`` messages in ``received``, plus ``residuals``, compressed by
    ``down``), or the error step of :func:`verdict_host` (residuals unchanged)."""
    layout = [(n, tuple(s)) for n, s in layout]
    fp = wire.layout_fingerprint(layout)
    ok, err = tf.numpy_function(lambda b: verdict_host(b, layout, n_ranks, fp, origin, what),
                                [received], [tf.bool, tf.uint8], stateful=True,
                                name="sbc_downlink_verdict")
    ok.set_shape([])
    err.set_shape([None])

    def good():
        if not layout:  # a region without pieces: its message carries no tensor
            return [tf.constant(np.frombuffer(wire.step_message_bytes(b"", fp, 0), np.uint8))]
        _, avg = backend.decode(received, layout, n_ranks, scale=scale,
                                out_dtypes=[acc_dtype] * len(layout))
        step, new = _encode(backend, layout, avg, residuals, down, fp, origin)
        return [step] + new

    def bad():
        return [err] + list(residuals)

    out = tf.cond(ok, good, bad)
    return out[0], list(out[1:])


def _encode(backend: Backend, layout, avg, residuals, down: Downlink, fp: int, rank: int):
    """The aggregate's step message and new residuals (``A = average + R``, ``A - sent``)."""
    names = [n for n, _ in layout]
    numels = [wire.layout_numel(s) for _, s in layout]
    if down.density is None:  # dense: the exact average, nothing left over
        encs = backend.encode(names, [None] * len(avg), avg, density=1.0, mode="values")
        new = list(residuals)
        density, mode = 1.0, "values"
    else:
        density, mode = down.density, down.mode
        encs = backend.encode(names, avg, residuals, density=density, mode=mode,
                              selection=down.selection)
        if mode == "values":
            encs = [without_zeros(e, density) for e in encs]
        new = [tf.reshape(e.new_residual, [-1]) for e in encs]
    bound = frame.step_bound(tuple(numels), density, mode)
    step, _ = backend.frame(encs, names, numels, fp, rank, False, None, bound)
    return step, new


def without_zeros(enc: codec.Encoded, density: float) -> codec.Encoded:
    """A top-k message without its zero-valued positions: the aggregate of a few sparse
    messages often has fewer non-zeros than k, and a position that carries 0 is wasted (torch's
    ``server.encode_downlink`` keeps ``min(k, non-zeros)``: the same positions). What was sent
    is unchanged (``A - 0 == A``), so is the new residual."""
    n = enc.numel
    if n == 0:
        return enc
    keep = tf.not_equal(enc.sent, 0)
    pos = tf.boolean_mask(enc.positions, keep)
    vals = tf.cast(tf.boolean_mask(enc.sent, keep), tf.float32)  # float32 values, exactly
    header, body = codec.encode_parts(pos, n, values=vals)
    if reference.keep_count(n, density) >= n:  # every position: ALL unless a zero is among them
        header, body = tf.cond(tf.reduce_all(keep), lambda: (enc.header, enc.body),
                               lambda: (header, body))
    return codec.Encoded(header, body, pos, tf.boolean_mask(enc.sent, keep), enc.finite, n,
                         new_residual=enc.new_residual)
