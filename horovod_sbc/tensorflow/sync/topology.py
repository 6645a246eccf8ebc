"""One sync of a TensorFlow ``SBC`` object through the ``"reduce_scatter"`` or ``"server"``
topology (:attr:`horovod_sbc.config.SBCConfig.topology`; docs/topologies.md), as graph pieces
that run eagerly and inside ``tf.function``.

:func:`exchange` returns what :func:`horovod_sbc.tensorflow.sync.exchange.exchange` returns for
the allgather (``(code, results, new_residuals, positions)``), so every mode of the object (the
stock tape, gradients, weights) commits its uplink error feedback as it always does. The
downlink error feedback (an owner's or the server's residual, ``SBC.server_residuals``: flat
``tf.Variable`` s keyed by piece or tensor name, saved by ``tf.train.Checkpoint`` as torch's
``state_dict()["server_residuals"]``) is committed here, when the decode's verdict is COMMIT,
before ``code`` can be read.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from ... import wire
from . import exchange as _exchange
from . import scatter, server
from .downlink import Downlink
from .exchange import COMMIT, tf_name


def exchange(state, names: Sequence[str], shapes, updates: Sequence[tf.Tensor],
             residuals: Sequence[tf.Variable], *, scale: float, tag: str,
             outs: Optional[Sequence[tf.Tensor]], extra_up_bits: int,
             seeds_of: Callable[[int], Optional[list]], variable: Callable):
    """One sync of ``state`` (the ``SBC`` object: its ``config``, counters, backend, world and
    ``server_residuals``) through its topology. ``seeds_of(n)``: the seeds of ``n`` messages
    (a random compressor's); ``variable(initial, name)``: a new state variable."""
    size, rank = state._world()
    backend = state._backend_of(residuals)
    cfg = state.config
    reads = [r.read_value() for r in residuals]
    acc = tf.float64 if any(r.dtype == tf.float64 for r in residuals) else tf.float32
    down = Downlink(cfg.downlink_fraction, cfg.downlink_compressor, cfg.selection)
    knobs = dict(density=cfg.density, mode=cfg.mode, selection=cfg.selection, rank=rank,
                 skip=cfg.nonfinite == "skip")
    layout = tuple((n, tuple(int(d) for d in s)) for n, s in zip(names, shapes))
    out_dtypes = [r.dtype for r in reads] if outs is None else [o.dtype for o in outs]

    def count(**bits):
        bits["upstream_bits"] = bits.get("upstream_bits", 0) + extra_up_bits
        return [state.counters[k].assign_add(v) for k, v in bits.items()]

    if cfg.topology == "reduce_scatter":
        p = scatter.plan(layout, size)
        up = _exchange.encode_step(backend, [n for n, _ in p.layout], [s for _, s in p.layout],
                                   scatter.pieces(p, updates), scatter.pieces(p, reads),
                                   seeds=seeds_of(len(p.pieces)), **knobs)
        code, flat = through_regions(
            state, backend, p, up, rank=rank, scale=scale, tag=tag,
            outs=None if outs is None else scatter.pieces(p, outs),
            out_dtypes=[out_dtypes[pc.tensor] for pc in p.pieces], acc_dtype=acc, count=count,
            variable=variable)
        results = scatter.tensors(p, flat, shapes)
        new_res = [tf.reshape(t, tf.shape(r)) for t, r in
                   zip(scatter.tensors(p, up.new_residuals, shapes), reads)]
        return code, results, new_res, up.positions
    mine = rank == server.ROOT and down.density is not None  # the server's residuals
    srv = [_server_residual(state, n, wire.layout_numel(s), acc, variable)
           for n, s in layout] if mine else []
    up = _exchange.encode_step(backend, names, shapes, updates, reads,
                               seeds=seeds_of(len(names)), **knobs)
    down_step, new_srv = server.exchange_server(
        backend, up.step, layout, rank=rank, size=size, scale=scale, downlink=down,
        server_residuals=[v.read_value() for v in srv], acc_dtype=acc, count=count)
    code, flat = backend.decode(down_step, layout, 1, scale=1.0,
                                outs=None if outs is None else list(outs),
                                out_dtypes=out_dtypes, failed=up.failed, strict=False)
    results = [tf.reshape(t, s) for t, s in zip(flat, shapes)]
    return _commit_downlink(code, srv, new_srv), results, up.new_residuals, up.positions


def through_regions(state, backend, p, up: _exchange.Uplink, *, rank: int, scale: float,
                    tag: str, outs: Optional[Sequence[tf.Tensor]], out_dtypes,
                    acc_dtype: tf.DType, count: Callable[..., list], variable: Callable,
                    process_set=None) -> Tuple[tf.Tensor, List[tf.Tensor]]:
    """The ``"reduce_scatter"`` topology's sync of ``up`` (this rank's step of ``p.layout``,
    :func:`horovod_sbc.tensorflow.sync.scatter.plan` over ``p.size`` ranks) and its decode:
    ``(code, flat results per piece)`` (``outs`` per piece, or zeros of ``out_dtypes``, plus
    the average). This rank owns region ``rank``: its downlink residuals (``state``'s
    ``server_residuals`` of the region's piece names, ``acc_dtype``) are committed when the
    verdict is COMMIT, before ``code`` can be read. ``process_set``: the Horovod process set
    of the ``p.size`` ranks, ``rank`` this one's rank in it (the hierarchy's cross-node set);
    None: every rank of the job. ``up.failed``: this rank sent its ERROR/SKIP."""
    cfg = state.config
    srv = [_server_residual(state, n, wire.layout_numel(s), acc_dtype, variable)
           for n, s in p.regions[rank]]
    down = Downlink(cfg.downlink_fraction, cfg.downlink_compressor, cfg.selection)
    whole, new_srv = scatter.exchange_regions(
        backend, p, up, rank=rank, scale=scale, tag=tag, downlink=down,
        downlink_residuals=[v.read_value() for v in srv], acc_dtype=acc_dtype, count=count,
        process_set=process_set)
    code, flat = backend.decode(whole, p.layout, 1, scale=1.0,
                                outs=None if outs is None else list(outs),
                                out_dtypes=out_dtypes, failed=up.failed, strict=False)
    return _commit_downlink(code, srv, new_srv), flat


def _commit_downlink(code: tf.Tensor, srv: List[tf.Variable], new: List[tf.Tensor]):
    """``code``, read only after the downlink residuals took ``new`` (a committed sync)."""
    if not srv:
        return code

    def commit():
        with tf.control_dependencies([v.assign(n) for v, n in zip(srv, new)]):
            return tf.constant(True)

    done = tf.cond(tf.equal(code, int(COMMIT)), commit, lambda: tf.constant(False))
    with tf.control_dependencies([done]):
        return tf.identity(code)


def _server_residual(state, name: str, numel: int, dtype: tf.DType,
                     variable: Callable) -> tf.Variable:
    """The flat downlink residual of ``name`` (zeros at its first sync, or again when the
    region it belongs to changed size)."""
    v = state.server_residuals.get(name)
    if v is None or v.shape.num_elements() != numel or v.dtype != dtype:
        with tf.init_scope():
            v = variable(tf.zeros([numel], dtype), "server_residual_" + tf_name(name))
        state.server_residuals[name] = v
    return v
