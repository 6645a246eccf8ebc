"""The ``"reduce_scatter"`` topology in TensorFlow graph pieces, byte for byte torch's
(:mod:`horovod_sbc.torch.sync.scatter`, whose docstring tells the algorithm: Ok-Topk's sparse
reduce-scatter, Li & Hoefler arXiv 2201.07598, whose owners re-compress with a downlink
residual, Zou et al. arXiv 2209.15203).

The same regions (:class:`horovod_sbc.regions.Plan`), the same per-piece messages, the same
re-framing and joining on the host (:func:`horovod_sbc.regions.region_messages`,
:func:`horovod_sbc.regions.join_regions`), and collectives named as torch names them
(``"alltoall.<tag>.parts"``, ``"allgather.<tag>.regions"``), so TensorFlow and PyTorch ranks of
one job meet. The owner's step is :func:`horovod_sbc.tensorflow.sync.downlink.reencode`; the
whole step of every region is decoded by the backend's ordinary decode (one rank, scale 1),
which reaches the protocol's verdict: a rank's ERROR raises on every rank, a SKIP skips.
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ... import protocol, regions, wire
from ..backend import Backend, host
from . import exchange
from .downlink import Downlink, reencode

Layout = Tuple[Tuple[str, Tuple[int, ...]], ...]


@functools.lru_cache(maxsize=64)
def plan(layout: Layout, size: int) -> regions.Plan:
    """The regions of ``layout`` (a tuple of ``(name, shape tuple)``) over ``size`` ranks."""
    return regions.Plan(layout, size)


def pieces(p: regions.Plan, tensors: Sequence[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
    """Per piece, its elements of the per-tensor ``tensors`` (flat; None stays None)."""
    return [None if tensors[pc.tensor] is None else
            tf.reshape(tensors[pc.tensor], [-1])[pc.start:pc.stop] for pc in p.pieces]


def tensors(p: regions.Plan, parts: Sequence[tf.Tensor], shapes) -> List[tf.Tensor]:
    """The per-piece ``parts`` joined back into one tensor per shape of ``shapes``."""
    out: List[List[tf.Tensor]] = [[] for _ in shapes]
    for pc, t in zip(p.pieces, parts):
        out[pc.tensor].append(tf.reshape(t, [-1]))
    return [tf.reshape(ts[0] if len(ts) == 1 else tf.concat(ts, 0), s)
            for ts, s in zip(out, shapes)]


def _parts_host(step: np.ndarray, p: regions.Plan, rank: int, graph: bool):
    """The alltoall's buffer and splits (int32): this rank's step as one message per region
    (its ERROR/SKIP to every owner)."""
    raw = np.asarray(step, np.uint8).tobytes()
    try:
        head = protocol.parse_step(raw, 0, len(raw), rank)
        err = None if head.kind is protocol.StepKind.TENSORS else protocol.peer_error(raw, head)
        msgs = regions.region_messages(raw, p, err)
    except ValueError as e:
        raise host._remember(e, graph)
    return (np.frombuffer(b"".join(msgs), np.uint8).copy(),
            np.array([len(m) for m in msgs], np.int32))


def _join_host(gathered: np.ndarray, p: regions.Plan, graph: bool) -> np.ndarray:
    """The region messages as one step of the piece layout; the first ERROR (then SKIP) in
    rank order as an ERROR/SKIP step of that layout instead (the decode's verdict then raises
    or skips with it)."""
    raw = np.asarray(gathered, np.uint8).tobytes()
    try:
        heads = [protocol.parse_step(raw, s, e, r)
                 for r, (s, e) in enumerate(protocol.split(raw, p.size))]
        failed = sorted((h for h in heads if h.kind is not protocol.StepKind.TENSORS),
                        key=lambda h: (h.kind is protocol.StepKind.SKIP, h.rank))
        if not failed:
            return np.frombuffer(regions.join_regions(raw, p, heads), np.uint8).copy()
    except ValueError as e:
        raise host._remember(e, graph)
    e = protocol.peer_error(raw, failed[0])
    whole = wire.error_step_message(e.reason, wire.layout_fingerprint(p.layout), e.skip, e.rank)
    return np.frombuffer(whole, np.uint8).copy()


def exchange_regions(backend: Backend, p: regions.Plan, up: exchange.Uplink, *, rank: int,
                     scale: float, tag: str, downlink: Downlink,
                     downlink_residuals: Sequence[tf.Tensor], acc_dtype: tf.DType,
                     count: Callable[..., list],
                     process_set=None) -> Tuple[tf.Tensor, List[tf.Tensor]]:
    """This rank's uplink (``up``: a step of ``p.layout``) through the regions: ``(whole,
    new downlink residuals)``, ``whole`` the joined step of every region (decode it as one
    rank's step of ``p.layout``). ``count(upstream_bits=, downstream_bits=)`` returns the ops
    that count the traffic, as torch counts it (each collective a direct exchange).
    ``process_set``: the Horovod process set of the ``p.size`` ranks (``rank`` this one's rank
    in it; the hierarchy's cross-node set), None for every rank of the job."""
    graph = not tf.executing_eagerly()
    parts, splits = tf.numpy_function(lambda s: _parts_host(s, p, rank, graph), [up.step],
                                      [tf.uint8, tf.int32], stateful=True, name="sbc_regions")
    parts.set_shape([None])
    splits.set_shape([p.size])
    # among every rank the collectives are called as the flat path always called them
    among = {} if process_set is None else {"process_set": process_set}
    received = exchange.alltoall(parts, splits, tag + ".parts", **among)
    mine, new = reencode(backend, received, p.regions[rank], p.size, scale, downlink_residuals,
                         downlink, rank, f"region owner rank {rank} rejected an uplink",
                         acc_dtype)
    gathered = exchange.allgather(mine, tag + ".regions", **among)
    size_of = lambda t: tf.size(t, out_type=tf.int64)  # noqa: E731
    own = tf.cast(splits[rank], tf.int64)
    ops = count(upstream_bits=8 * (tf.reduce_sum(tf.cast(splits, tf.int64)) - own
                                   + size_of(mine)),
                downstream_bits=8 * (size_of(received) - own + size_of(gathered)
                                     - size_of(mine)))
    with tf.control_dependencies(ops):
        whole = tf.numpy_function(lambda g: _join_host(g, p, graph), [gathered], tf.uint8,
                                  stateful=True, name="sbc_join_regions")
    whole.set_shape([None])
    return whole, new
