"""The TF codec's CPU fast path: SBC's C kernels as TensorFlow custom ops.

:mod:`horovod_sbc.kernels` builds ``sbc_tf_ops.cc`` (with ``sbc_kernels.c`` linked in) on first
use and loads it with ``tf.load_op_library``. The ops are CPU kernels, eager and inside
``tf.function`` alike:

* ``SbcEncode`` — one float32 tensor's whole binary SBC encoding in one kernel call: ``A = R +
  dW`` (in the selection's pass), the exact selection (paper or magnitude split), the means
  (fixed-order float64 tree sums), the side, its Rice parameter and streams, and the new residual
  ``A - sent`` (returned, not assigned: the caller commits it after the verdict);
* ``SbcDecodeBinary`` — every binary message of a gathered step: the stream statistics that
  :func:`horovod_sbc.protocol.check_stream` judges on the host, and the positions (uint32);
* ``SbcScatterAdd`` — after the verdict, ``float32(float64(value) * scale)`` of every rank added
  at its positions, each element receiving its ranks' values in rank order.

Used by :mod:`horovod_sbc.tensorflow.backend.codec` (``encode_update``, ``compress``),
:mod:`horovod_sbc.tensorflow.sync.exchange` and :mod:`horovod_sbc.tensorflow.backend.decoder` for float32
tensors placed on the CPU in binary SBC mode; everything else (GPU tensors, float64, top-k values,
signSGD, bare single-message decodes) takes the stock-TF-op path, and so does everything when the
op library cannot be built (warned once) or ``HOROVOD_SBC_KERNELS=0`` /
:func:`horovod_sbc.kernels.disabled` turn the kernels off. Both paths produce the same bytes and
verdicts (golden vectors, differential and property tests run through each); the op path also
keeps IEEE subnormal values (its kernels clear TensorFlow's flush-to-zero), where TensorFlow's own
arithmetic on the tensors flushes them.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf

from ... import kernels, wire


def ops():
    """The loaded op module, or None (disabled, or not buildable: warned once)."""
    return kernels.tf_ops()


def on_cpu(t: tf.Tensor) -> bool:
    """Is ``t`` placed on the CPU? A symbolic tensor without a device (inside ``tf.function``,
    placement still to come) counts as CPU when no GPU is visible."""
    dev = getattr(t, "device", "") or ""
    if dev:
        return tf.DeviceSpec.from_string(dev).device_type in (None, "CPU")
    return not tf.config.list_logical_devices("GPU")


def encoder_for(t: tf.Tensor, mode: str):
    """The op module when binary SBC of ``t`` can run in the kernel: float32, on the CPU,
    ``mode == "sbc"`` and the ops available; else None (the stock-TF-op path)."""
    n = t.shape.num_elements()
    if mode != "sbc" or t.dtype != tf.float32 or not on_cpu(t) or n is None or \
            n > kernels.MAX_NUMEL:
        return None
    return ops()


def encode(mod, update: Optional[tf.Tensor], residual: tf.Tensor, k: int, selection: str):
    """Raw ``SbcEncode`` outputs ``(new_residual, header, body, positions, value, finite)`` of
    ``A = residual + update`` (flat float32; ``update`` None: ``A = residual``)."""
    residual = tf.reshape(residual, [-1])
    numel = int(residual.shape[0])
    b1, steps = wire.rice_table(numel) if numel else (0, ())
    upd = tf.zeros([0], tf.float32) if update is None else tf.reshape(update, [-1])
    return mod.sbc_encode(upd, residual, k=int(k), magnitude=selection == "magnitude",
                          rice_b1=int(b1), rice_steps=[int(x) for x in steps],
                          negative_flag=wire.FLAG_NEGATIVE)


def decoder_static_ok(gathered: tf.Tensor, numels: Sequence[int], outs, out_dtypes,
                      single: bool):
    """The op module when a gathered step may be decoded by the kernels (decided while tracing:
    float32 outputs, tensors of at most ``kernels.MAX_NUMEL`` elements, the buffer on the CPU), else None."""
    if single or not numels or any(dt != tf.float32 for dt in out_dtypes):
        return None
    if any(n > kernels.MAX_NUMEL for n in numels) or not on_cpu(gathered):
        return None
    if outs is not None and any(o.dtype != tf.float32 or not on_cpu(o) for o in outs):
        return None
    return ops()


def decoder_runtime_ok(table: tf.Tensor, columns) -> tf.Tensor:
    """bool scalar: every message is binary SBC (or empty and not ALL) with a Rice parameter the
    kernel reads (the parser's limits guarantee it; checked for safety). ``columns``: the
    decoder's ``(C_COUNT, C_KIND, C_B, K_BINARY, K_ALL_SIGNS)``."""
    c_count, c_kind, c_b, k_binary, k_all = columns
    count, kind, b = table[:, c_count], table[:, c_kind], table[:, c_b]
    ok = tf.logical_or(tf.equal(kind, k_binary),
                       tf.logical_and(tf.equal(count, 0), kind < k_all))
    return tf.reduce_all(tf.logical_and(ok, tf.logical_and(b >= 0, b <= wire.MAX_RICE_B)))


def decode(mod, gathered: tf.Tensor, table: tf.Tensor, check, numels: Sequence[int],
           outs, scale: float, decode_columns, add_columns) -> List[tf.Tensor]:
    """Flat float32 results: decode the streams, let ``check(stats)`` (the host verdict) pass,
    then add every rank's values, in rank order, to ``outs`` (or zeros)."""
    stats, pos = mod.sbc_decode_binary(gathered, table, columns=list(decode_columns))
    ok = check(stats)
    with tf.control_dependencies([ok]):  # nothing is added before the verdict passed
        pos = tf.identity(pos)
    zero = outs is None
    bases = ([tf.zeros([0], tf.float32)] * len(numels) if zero
             else [tf.reshape(o, [-1]) for o in outs])
    res = mod.sbc_scatter_add(pos, table, tf.constant(float(scale), tf.float64), bases,
                              numels=[int(n) for n in numels], columns=list(add_columns),
                              zero=zero)
    return list(res)
