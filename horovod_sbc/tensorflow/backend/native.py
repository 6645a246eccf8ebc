"""SBC's C kernels as TensorFlow custom ops: the pieces of the kernel backend.

:mod:`horovod_sbc.kernels` builds ``sbc_tf_ops.cc`` (with ``sbc_kernels.c`` linked in) on first
use and loads it with ``tf.load_op_library``. The ops are CPU kernels, eager and inside
``tf.function`` alike:

* ``SbcEncode`` — one float32 tensor's whole binary SBC encoding in one kernel call: ``A = R +
  dW`` (in the selection's pass), the exact selection (paper or magnitude split), the means
  (fixed-order float64 tree sums), the side, its Rice parameter and streams, and the new residual
  ``A - sent`` (returned, not assigned: the caller commits it after the verdict);
* ``SbcDecode`` — every message of a gathered step, whatever its kind: the stream statistics
  that :func:`horovod_sbc.protocol.check_stream` judges on the host, and the positions (uint32);
* ``SbcScatterAdd`` — after the verdict, ``float32(float64(value) * scale)`` of every rank added
  at its positions, each element receiving its ranks' values in rank order (a binary message's
  one value, a SIGNS message's value with each position's sign, a VALUES message's own floats).

The ops keep IEEE subnormal values (each clears TensorFlow's flush-to-zero for its duration),
where TensorFlow's own arithmetic on the tensors flushes them.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import tensorflow as tf

from ... import kernels, registry, wire
from . import table as _t

if (_t.K_BINARY, _t.K_SIGNS, _t.K_VALUES, _t.K_ALL_SIGNS, _t.K_ALL_VALUES) != (0, 1, 2, 3, 4):
    raise ImportError("sbc_tf_ops.cc numbers the message kinds as table.py did: 0..4")

DECODE_COLUMNS = (_t.C_USTART, _t.C_UBYTES, _t.C_RSTART, _t.C_RBYTES, _t.C_COUNT, _t.C_B,
                  _t.C_NUMEL, _t.C_KIND, _t.C_SSTART, _t.C_SBYTES, _t.C_VSTART)
ADD_COLUMNS = (_t.C_TENSOR, _t.C_COUNT, _t.C_VBITS, _t.C_NEG, _t.C_KIND, _t.C_SSTART,
               _t.C_VSTART)


def ops():
    """The loaded op module, or None (disabled, or not buildable: warned once)."""
    return kernels.tf_ops()


def encodes(mode: str, residual: tf.Tensor, update: Optional[tf.Tensor]) -> bool:
    """Does ``SbcEncode`` take this tensor? Binary SBC (a ``native_kernel`` compressor whose
    message is ``Message.BINARY``) of float32 with at least one and at most
    ``kernels.MAX_NUMEL`` elements (static facts, known while tracing)."""
    comp = registry.get(mode)
    n = residual.shape.num_elements()
    return (comp.native_kernel and comp.message is registry.Message.BINARY
            and residual.dtype == tf.float32 and n is not None
            and 0 < n <= kernels.MAX_NUMEL and (update is None or update.dtype == tf.float32))


def decodes(numels: Sequence[int], out_dtypes) -> bool:
    """Do ``SbcDecode`` and ``SbcScatterAdd`` take this layout? float32 outputs, tensors of at
    most ``kernels.MAX_NUMEL`` elements (positions are uint32), at least one tensor."""
    return bool(numels) and all(dt == tf.float32 for dt in out_dtypes) and \
        all(n <= kernels.MAX_NUMEL for n in numels)


def encode(mod, update: Optional[tf.Tensor], residual: tf.Tensor, k: int, selection: str):
    """Raw ``SbcEncode`` outputs ``(new_residual, header, body, positions, value, finite)`` of
    ``A = residual + update`` (flat float32; ``update`` None: ``A = residual``)."""
    residual = tf.reshape(residual, [-1])
    numel = int(residual.shape[0])
    b1, steps = wire.rice_table(numel)
    upd = tf.zeros([0], tf.float32) if update is None else tf.reshape(update, [-1])
    return mod.sbc_encode(upd, residual, k=int(k), magnitude=selection == "magnitude",
                          rice_b1=int(b1), rice_steps=[int(x) for x in steps],
                          negative_flag=wire.FLAG_NEGATIVE)


def decode(mod, gathered: tf.Tensor, table: tf.Tensor, check, numels: Sequence[int],
           outs, scale: float) -> List[tf.Tensor]:
    """Flat float32 results: decode the streams, let ``check(stats)`` (the verdict) pass,
    then add every rank's values, in rank order, to ``outs`` (or zeros)."""
    stats, pos = mod.sbc_decode(gathered, table, columns=list(DECODE_COLUMNS))
    ok = check(stats)
    with tf.control_dependencies([ok]):  # nothing is added before the verdict passed
        pos = tf.identity(pos)
    zero = outs is None
    bases = ([tf.zeros([0], tf.float32)] * len(numels) if zero
             else [tf.reshape(o, [-1]) for o in outs])
    res = mod.sbc_scatter_add(pos, table, gathered, tf.constant(float(scale), tf.float64), bases,
                              numels=[int(n) for n in numels], columns=list(ADD_COLUMNS),
                              zero=zero)
    return list(res)
