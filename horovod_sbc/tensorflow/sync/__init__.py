"""The TensorFlow sync driver: one sync of many tensors, as graph pieces (eager and traced).

Both drivers put every tensor of a step in one step message, exchanged by one allgather
(:mod:`horovod_sbc.tensorflow.sync.exchange`), and commit the error feedback of Sparse Binary
Compression (Sattler et al., arXiv 1805.08768) only after every rank's message decoded
(:class:`horovod_sbc.tensorflow.sync.state.SyncState`):

* :func:`exchange_gradients` — gradient mode (``SBC.exchange_gradients``): ``R + g`` is
  compressed, the average of all ranks' decoded gradients returned;
* :func:`synchronize_weights` — weight mode's sync (the paper's communication delay,
  :mod:`horovod_sbc.tensorflow.weights`): ``R + W - W_ref`` is compressed, the shared weights
  ``W_ref`` move by the average (or by ``outer=``'s step) and every rank continues from them.

Entries are ``(name, tf.Variable, index)`` sorted by name, as
:func:`horovod_sbc.tensorflow.owner.entries` gives them: one message order on every rank.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from ... import wire
from .exchange import COMMIT, tf_name
from .state import SyncState, state_variable, static_shape

Entries = Sequence[Tuple[str, tf.Variable, int]]


def exchange_gradients(state: SyncState, entries: Entries, gradients, size: int,
                       tag: str = "sbc_sync") -> List:
    """The averaged ``gradients`` (a flat list; ``entries`` index into it) of ``size`` ranks;
    see :meth:`horovod_sbc.tensorflow.SBC.exchange_gradients`."""
    out = list(gradients)
    if not entries:
        return out
    names, shapes, upds, res = [], [], [], []
    for name, v, i in entries:
        shape = static_shape(v, name)
        r = state._residual(name, shape, v.dtype)
        g = gradients[i]
        if g is None:
            u = tf.zeros(shape, r.dtype)
        else:
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            u = tf.cast(g, r.dtype)
        names.append(name), shapes.append(shape), upds.append(u), res.append(r)
    numel = sum(wire.layout_numel(s) for s in shapes)
    counted = [state.counters["steps"].assign_add(1),
               state.counters["dense_bits"].assign_add(32 * numel)]
    with tf.control_dependencies(counted):
        code, avg, new_res, sent = state._exchange(names, shapes, upds, res, 1.0 / size, tag)
    ops = [state._commit(res, upds, code, new_res, sent),
           state.counters["syncs"].assign_add(tf.cast(tf.equal(code, COMMIT), tf.int64))]
    with tf.control_dependencies(ops):
        for (name, v, i), a in zip(entries, avg):
            g = gradients[i]
            dt = v.dtype if g is None else g.dtype
            out[i] = tf.cast(tf.identity(a), dt)
    return out


def synchronize_weights(state: SyncState, entries: Entries, local_residual: bool,
                        tag: str = "sbc_sync") -> tf.Tensor:
    """Weight mode's sync of ``entries``; whether it committed (bool tensor). ``local_residual``:
    where ranks continue from (:func:`continue_from`)."""
    size, _ = state._world()
    names, shapes, upds, res, refs = [], [], [], [], []
    for name, v, _ in entries:
        shape = static_shape(v, name)
        ref = state._reference(name, v, create=False)
        r = state._residual(name, shape, v.dtype)
        upds.append(window_update(v, ref, r, local_residual))
        names.append(name), shapes.append(shape), res.append(r), refs.append(ref)
    plain = state.outer.decodes_into_reference
    if not plain:
        with tf.init_scope():
            state.outer.build(names, [r.read_value() for r in res],
                              lambda init, n: state_variable(init, "outer_" + tf_name(n)))
    # plain: the average of all ranks' decoded updates is added straight into W_ref
    code, decoded, new_res, sent = state._exchange(
        names, shapes, upds, res, 1.0 / size, tag,
        outs=[r.read_value() for r in refs] if plain else None)
    committed = tf.equal(code, COMMIT)
    ops = [state._commit(res, upds, code, new_res, sent),
           state.counters["syncs"].assign_add(tf.cast(committed, tf.int64)),
           state.local_steps.assign(0)]
    if plain:
        new_refs = decoded
    else:
        with tf.control_dependencies(ops):
            deltas = state.outer.delta(names, decoded, committed)
            ops += state.outer.after_commit(res, committed)
        new_refs = [tf.where(committed, tf.cast(tf.cast(ref.read_value(), d.dtype) + d,
                                                ref.dtype), ref.read_value())
                    for ref, d in zip(refs, deltas)]
    with tf.control_dependencies(ops):
        ops = ops + [ref.assign(new) for ref, new in zip(refs, new_refs)]
    with tf.control_dependencies(ops):
        assigns = [v.assign(continue_from(v, ref, r, local_residual))
                   for (name, v, _), ref, r in zip(entries, refs, res)]
    with tf.control_dependencies(assigns):
        return committed


def window_update(v, ref, r, local_residual: Optional[bool]):
    """The update of this delay window. Shared weights (``local_residual=False``):
    ``W - W_ref``. Local residual: the weights hold ``W_ref + R`` (rounded to the variable's
    dtype) after a sync, so the window's own progress is ``W - (W_ref + R)``."""
    base = continue_from(v, ref, r, local_residual)  # where this window started
    return tf.cast(v.read_value(), r.dtype) - tf.cast(base, r.dtype)


def continue_from(v, ref, r, local_residual: Optional[bool]):
    """Where a rank continues after a sync (run after the commit): ``W_ref`` (also after a
    skip), or with ``local_residual`` ``W_ref + R`` (after a skip healthy ranks keep
    ``R + dW``, i.e. their weights, and the failing rank drops its window)."""
    if not local_residual:
        return ref.read_value()
    return tf.cast(tf.cast(ref.read_value(), r.dtype) + r.read_value(), v.dtype)
