"""The TF-ops backend's decoder: a gathered step decoded and accumulated in TensorFlow ops.

The four pieces of every decode (:mod:`.host`), here:

1. **parse (host)** — :func:`.host.parse`, done by the backend before calling :func:`decode`.
2. **streams (TF ops)** — :func:`.streams.decode`: every message of every kind at once,
   positions as keys into the concatenated layout and the protocol's statistics; one graph
   function for every step and layout.
3. **verdict (device)** — ``check(stats)``; the accumulation depends on it (control dependency),
   so nothing is added before it passed.
4. **accumulate (TF ops)** — :mod:`.accumulate`: by rank masks for a step of binary messages
   into fresh float32 zeros, the fold otherwise; the same bits either way.

The parse is O(messages) on the host; the streams a few ops per decoded position; the accumulation
O(positions) plus the outputs. ``benchmarks/bench_tf_codec.py`` measures the decoder against a
``tf.add`` of the same size.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ... import wire
from . import accumulate, host, streams


def decode(gathered: tf.Tensor, table: tf.Tensor, check, numels: Sequence[int], n_ranks: int,
           scale: float, outs: Optional[Sequence[tf.Tensor]], out_dtypes) -> List[tf.Tensor]:
    """Steps 2-4: flat results in layout order, ``outs`` (or zeros of ``out_dtypes``) plus
    ``float32(float64(value) * scale)`` of every rank at its positions, rank after rank.

    ``gathered`` is the flat uint8 step buffer, ``table`` the host parse's int64
    ``[n_ranks * len(numels), N_COLS]`` and ``check(stats)`` the verdict (:func:`.host.parse`).
    """
    if not numels:
        return []
    offs = tf.constant(np.concatenate([[0], np.cumsum(numels, dtype=np.int64)[:-1]]), tf.int64)
    key, msg, stats = streams.decode(gathered, table, offs)
    with tf.control_dependencies([check(stats)]):  # nothing is added before the verdict passed
        key = tf.identity(key)

    def fold():
        return accumulate.fold(gathered, key, msg, table, numels, n_ranks, scale, outs,
                               out_dtypes)

    if not accumulate.masks_fit(numels, n_ranks, outs, out_dtypes):
        return fold()
    results = tf.cond(accumulate.binary_step(table),
                      lambda: accumulate.by_rank_masks(key, msg, table, numels, n_ranks, scale),
                      fold)
    return list(results) if isinstance(results, (list, tuple)) else [results]


@tf.autograph.experimental.do_not_convert
def decode_message(message: tf.Tensor, shape, dtype=tf.float32) -> tf.Tensor:
    """Dense tensor of ``shape`` from one bare tensor message (validated; errors like
    :func:`horovod_sbc.reference.decompress_np`): the values are placed, not added (a -0.0
    value stays -0.0), as bit patterns, so a subnormal value survives. Header parsing runs on
    the host (O(message bytes)); the streams in TF ops (:func:`.streams.decode`)."""
    shape = tuple(int(d) for d in shape)
    numel = wire.layout_numel(shape)
    message = tf.reshape(tf.cast(message, tf.uint8), [-1])
    _, table, check = host.parse(message, [("tensor", shape)], 1, single=True)
    key, msg, stats = streams.decode(message, table, tf.zeros([1], tf.int64))
    with tf.control_dependencies([check(stats)]):
        key = tf.identity(key)
    bits, _ = streams.element_bits(message, table, msg)
    dense = tf.bitcast(tf.scatter_nd(key[:, None], bits, [numel]), tf.float32)
    out = tf.reshape(dense, shape)
    return out if dtype == tf.float32 else tf.cast(out, dtype)
