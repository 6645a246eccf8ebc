"""SBC codec for TensorFlow: a documented bridge to the numpy reference.

``compress``/``decompress`` wrap :func:`horovod_sbc.reference.compress_np` and the wire decoder in
``tf.numpy_function``, so they run in eager mode and inside ``tf.function`` and give exactly the
reference's bytes. The bridge runs on the host CPU (TF copies device tensors to host around it);
the messages are tiny, but selection then costs a numpy pass over the tensor. A native TF-ops
implementation can replace it behind the same signatures.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import reference, config


def compress(update: tf.Tensor, residual: tf.Tensor, density: float, binarize: bool = True,
             selection: str = "paper"):
    """(message uint8 1-D, new residual) for one tensor; the residual keeps ``residual``'s dtype."""
    density = config.validate_density(density)

    def _run(u, r):
        msg, res = reference.compress_np(u, r, density, binarize, selection=selection)
        return np.frombuffer(msg, dtype=np.uint8).copy(), res.astype(r.dtype)

    msg, res = tf.numpy_function(_run, [update, residual], [tf.uint8, residual.dtype],
                                 stateful=False)
    msg.set_shape([None])
    res.set_shape(residual.shape)
    return msg, res


def decompress(message: tf.Tensor, shape, dtype=tf.float32) -> tf.Tensor:
    """Dense tensor of ``shape`` from one tensor message (validated; ValueError if malformed)."""
    shape = tuple(int(d) for d in shape)

    def _run(m):
        return reference.decompress_np(m.tobytes(), shape, np.float32)

    out = tf.numpy_function(_run, [message], tf.float32, stateful=False)
    out.set_shape(shape)
    return tf.cast(out, dtype)
