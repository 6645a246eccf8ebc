"""Hierarchical SBC in TensorFlow (``SBC(hierarchy=...)``, weight mode): dense inside a node,
compressed between nodes, as :mod:`horovod_sbc.torch.hierarchy` does it and with its bytes.

The ranks of a node act as one SBC worker. Per sync (graph pieces: eagerly and inside
``tf.function``, nothing of the tensors read on the host):

1. every rank's update ``A = W - W_ref`` (all variables in one flat buffer, sorted by name,
   zero padded to ``L`` equal shards) is checked finite (one fused reduction; the first
   non-finite tensor's index goes to the node in one allgather of one int32 per local rank,
   ``"sbc.hierarchy.status"``) and averaged over the node by one dense ``reducescatter`` on the
   node's Horovod process set (``"sbc.hierarchy.reduce"``): local rank ``i`` gets shard ``i``;
2. local rank ``i`` SBC-compresses its shard with its own residual (one piece per variable
   crossing the shard, named ``"name[a:b]"``, flat residual variables in ``SBC.residuals``:
   checkpointed under torch's names) and allgathers the step message with the local ranks
   ``i`` of the other nodes (``"sbc.hierarchy.cross.<i>"``); a node whose update is not finite
   sends the ERROR/SKIP step naming its first failing rank and tensor instead. With
   ``topology="reduce_scatter"`` the shard goes through torch's sparse reduce-scatter among
   those ranks instead (:func:`horovod_sbc.tensorflow.sync.topology.through_regions` on the
   cross-node process set: the shard's pieces cut into one region per node, parts by
   ``alltoall`` ``"sbc.hierarchy.cross.<i>.parts"``, each owner re-compressing its region with
   its downlink residual, ``SBC.server_residuals`` keyed by torch's piece names and
   checkpointed, the region messages allgathered, ``"sbc.hierarchy.cross.<i>.regions"``);
3. the decoded average of shard ``i`` (and, ``local_residual=True``, shard ``i`` of the node's
   residual, moved out of the residual variables) is shared inside the node by one dense
   ``allgather`` (``"sbc.hierarchy.share"``) with an outcome flag; every rank applies the same
   bytes the same way: the shared weights are bit-identical job-wide, TensorFlow and torch
   ranks alike.

``local_residual=True``: every rank of a node continues from ``W_ref + R_node``; ``False``: from
``W_ref``, the residual of shard ``i`` kept by local rank ``i``. ``outer=`` acts on the whole
average, identically on every rank. Refused with ``ValueError``: variables other than
float32/float64 or of several dtypes, and ``topology="server"`` (by
:class:`horovod_sbc.config.SBCConfig`).

The process sets must exist on every rank: declared at initialisation
(``hvd.init(process_sets=horovod_sbc.tensorflow.hierarchy_process_sets(groups))``) or added at
the first step after ``hvd.init(process_sets="dynamic")``.

The grouping's checks, the process sets' lists and lookup, the shard layout and the pieces'
names are torch's: :mod:`horovod_sbc.hierarchy` (framework-free) holds them for both.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from .. import hierarchy as common
from .. import reference, wire
from ..hierarchy import (Groups, Layout, check, describe, layout, parse,  # noqa: F401
                         piece_name, set_lists)
from .backend.host import nonfinite_step
from .owner import tf_variable
from .sync import scatter, topology
from .sync.exchange import COMMIT, allgather, collective_name, encode_step, tf_name
from .sync.state import state_variable, static_shape

_SETS: Dict[Tuple[int, ...], object] = {}  # ranks -> the hvd.ProcessSet made for them here
_FNS: Dict[tuple, object] = {}  # eager collectives, one small tf.function per name and kind
_DECLARE = "horovod_sbc.tensorflow.hierarchy.hierarchy_process_sets"  # named in the errors


# -- Horovod process sets ------------------------------------------------------------------
def hierarchy_process_sets(groups) -> list:
    """The ``hvd.ProcessSet`` s of an explicit grouping, to declare at initialisation:
    ``hvd.init(process_sets=hierarchy_process_sets([[0, 1], [2, 3]]))``."""
    import horovod.tensorflow as hvd
    return common.declared_process_sets(groups, _SETS, hvd.ProcessSet)


def _process_set(hvd, ranks: Tuple[int, ...], what: str):
    return common.process_set(hvd, ranks, what, _SETS, _DECLARE)


def _collective(kind: str, tag: str, tensor: tf.Tensor, process_set, **kw) -> tf.Tensor:
    """Horovod's ``kind`` ("allgather" or "reducescatter", an average) of ``tensor`` among
    ``process_set``, named ``"<kind>.<tag>"`` as ``horovod.torch`` names it (eagerly inside a
    small ``tf.function``: an eager op loses its name)."""
    import horovod.tensorflow as hvd
    name = collective_name(kind, tag)

    def op(t):
        if kind == "allgather":
            return hvd.allgather(t, name=name, process_set=process_set, ignore_name_scope=True)
        return hvd.reducescatter(t, op=hvd.Average, name=name, process_set=process_set,
                                 ignore_name_scope=True)
    if not tf.executing_eagerly():
        return op(tensor)
    key = (name, process_set.process_set_id, tensor.dtype, tensor.shape.rank)
    fn = _FNS.get(key)
    if fn is None:
        fn = _FNS[key] = tf.function(op, input_signature=[
            tf.TensorSpec([None] * tensor.shape.rank, tensor.dtype)])
    return fn(tensor)


def horovod_nodes(hvd) -> Groups:
    """Horovod's own nodes, from every rank's ``(cross_rank, local_rank, local_size)``."""
    mine = tf.constant([[hvd.cross_rank(), hvd.local_rank(), hvd.local_size()]], tf.int64)
    return common.nodes_of_rows(_collective("allgather", "sbc.hierarchy.nodes", mine,
                                            hvd.global_process_set).numpy().tolist())


# -- the exchange --------------------------------------------------------------------------
def of(sbc, what: Optional[str] = None) -> "Hierarchy":
    """The hierarchical exchange of ``sbc`` (built at its first use, on every rank; ``what``
    names the knob in its errors)."""
    hier = sbc.__dict__.get("_sbc_hierarchy")
    if hier is None:
        with tf.init_scope():
            hier = Hierarchy(sbc, what)
        sbc.__dict__["_sbc_hierarchy"] = hier  # plain Python state, not tracked
    return hier


def synchronize(sbc, entries, local_residual: bool) -> tf.Tensor:
    """Weight mode's sync through the hierarchy (what
    :func:`horovod_sbc.tensorflow.sync.synchronize_weights` is flat); whether it committed."""
    return of(sbc).synchronize(sbc, entries, local_residual)


class Hierarchy:
    """The hierarchical exchange of one ``SBC`` object in weight mode: checks the grouping (the
    same ``ValueError`` on every rank), that every rank was given the same one, finds or adds
    the process sets and records the grouping (``SBC.node_of_rank``, checkpointed: a resume
    under another grouping is refused)."""

    def __init__(self, sbc, what: Optional[str] = None):
        import horovod.tensorflow as hvd
        spec = sbc.config.hierarchy
        what = what or describe(spec)
        size, rank = sbc._world()
        groups = horovod_nodes(hvd) if spec == "node" else spec
        self.groups = check(groups, size, what)
        self._agree(rank, what)
        self.node, self.local, cross = common.position(self.groups, rank)
        self.rank = rank
        sets = {ranks: _process_set(hvd, ranks, what) for ranks in set_lists(self.groups)}
        self.intra = sets[self.groups[self.node]]
        self.cross, self.cross_rank, self.nodes = sets[cross], cross.index(rank), len(cross)
        sbc.manager.config.update(hierarchy=[list(g) for g in self.groups])
        self._record(sbc, size, what)
        self._layouts: Dict[tuple, Layout] = {}
        self._errors: Dict[tuple, tuple] = {}

    @property
    def local_size(self) -> int:
        return len(self.groups[0])

    def _agree(self, rank: int, what: str) -> None:
        """Every rank must have been given the same grouping (one allgather of a checksum)."""
        import horovod.tensorflow as hvd
        crc = common.checksum(self.groups)
        got = _collective("allgather", "sbc.hierarchy.agree", tf.constant([crc], tf.int64),
                          hvd.global_process_set).numpy().tolist()
        common.check_agreement(got, what, "the SBC object")

    def _record(self, sbc, size: int, what: str) -> None:
        """``SBC.node_of_rank``: each global rank's node (-1 before the first step), saved by
        ``tf.train.Checkpoint``; a restored grouping must be this one."""
        nodes = common.node_of_rank(self.groups, size)
        var = getattr(sbc, "node_of_rank", None)
        if var is None:
            sbc.node_of_rank = var = state_variable(tf.constant([-1] * size, tf.int64),
                                                    "node_of_rank")
        self._check_record(var, nodes, what)
        self._nodes = nodes

    @staticmethod
    def _check_record(var, nodes, what) -> None:
        saved = [int(x) for x in var.numpy()]
        if len(saved) == len(nodes) and all(x == -1 for x in saved):
            var.assign(nodes)
        elif saved != nodes:
            raise ValueError(f"{what}: the SBC state was saved with the nodes {saved} (node of "
                             f"each rank) but this run has {nodes}; residuals are only valid "
                             "for the same grouping")

    def _layout(self, names, numels) -> Layout:
        key = tuple(zip(names, numels))
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = layout(names, numels, self.local_size, self.local)
        return lay

    def _entries_layout(self, entries) -> Layout:
        names = [n for n, _, _ in entries]
        return self._layout(names, [int(np.prod(static_shape(v, n), dtype=np.int64))
                                    for n, v, _ in entries])

    def stored_residuals(self, sbc, entries) -> list:
        """The residual pieces this rank keeps (``local_residual=False``: the node's unsent
        update of this rank's shard), those created so far."""
        lay = self._entries_layout(entries)
        found = (sbc.residuals.get(piece_name(lay, pc)) for pc in lay.pieces)
        return [r for r in found if r is not None]

    def residual_shares(self, sbc, entries) -> Dict[str, tf.Tensor]:
        """Per variable (flat, its dtype), this rank's pieces of its node's residual times the
        node size (zeros elsewhere): their average over every rank of the job is the average
        of the nodes' residuals (as torch's ``Hierarchy.residual_shares``)."""
        lay = self._entries_layout(entries)
        out = {}
        for i, (name, v, _) in enumerate(entries):
            parts, at = [], 0
            for (j, a, b) in lay.pieces:
                r = sbc.residuals.get(piece_name(lay, (j, a, b))) if j == i else None
                if r is None:
                    continue
                parts += [tf.zeros([a - at], v.dtype),
                          tf.cast(r.read_value() * self.local_size, v.dtype)]
                at = b
            parts.append(tf.zeros([lay.numels[i] - at], v.dtype))
            out[name] = tf.concat(parts, 0)
        return out

    def finish(self, sbc, entries, average_residuals: bool, local_residual: bool) -> None:
        """:meth:`WeightMode.finish` through the hierarchy (eagerly, after the last sync), as
        torch's drop-in ``finish``: every rank's weights become ``W_ref`` + the average over
        every rank of its share of the residuals (``local_residual=True``: ``W - W_ref``, the
        node's residual held in the weights; else :meth:`residual_shares`), one dense
        allreduce per variable and a broadcast from rank 0; or ``W_ref`` alone
        (``average_residuals=False``). The residual pieces are zeroed; ``W_ref`` = weights."""
        import horovod.tensorflow as hvd
        refs = [sbc._reference(name, v, create=False) for name, v, _ in entries]
        if average_residuals:
            if local_residual:
                shares = {name: tf.reshape(v.read_value() - tf.cast(ref.read_value(), v.dtype),
                                           [-1]) for (name, v, _), ref in zip(entries, refs)}
            else:
                shares = self.residual_shares(sbc, entries)
        for (name, v, _), ref in zip(entries, refs):
            new = tf.cast(ref.read_value(), v.dtype)
            if average_residuals:
                avg = hvd.allreduce(shares[name], op=hvd.Average,
                                    name="sbc_finish_" + tf_name(name))
                new = new + tf.reshape(avg, new.shape)
            v.assign(new)
        for r in self.stored_residuals(sbc, entries):
            r.assign(tf.zeros_like(r))
        if average_residuals:
            hvd.broadcast_variables([tf_variable(v) for _, v, _ in entries], root_rank=0)
        for (_, v, _), ref in zip(entries, refs):
            ref.assign(tf.cast(v.read_value(), ref.dtype))

    def _error_table(self, lay: Layout, fp: int, skip: bool, capacity: Optional[int]):
        """The ERROR/SKIP step of every (local rank, tensor) this node may report, back to back
        (uint8), their starts (int64 [L * T + 1]) and zero padding (int64 [L * T])."""
        key = (tuple(lay.names), fp, skip, capacity)
        got = self._errors.get(key)
        if got is None:
            msgs, pads = zip(*(nonfinite_step(name, fp, origin, skip, capacity)
                               for origin in self.groups[self.node] for name in lay.names))
            starts = np.cumsum([0] + [len(m) for m in msgs]).astype(np.int64)
            got = self._errors[key] = (np.frombuffer(b"".join(msgs), np.uint8).copy(), starts,
                                       np.array(pads, np.int64))
        return got

    def _check_variables(self, entries) -> tf.DType:
        dtypes = {v.dtype for _, v, _ in entries}
        bad = [(n, v.dtype) for n, v, _ in entries if v.dtype not in (tf.float32, tf.float64)]
        if bad:
            raise ValueError(f"SBC(hierarchy=...) on rank {self.rank}: variable {bad[0][0]!r} is "
                             f"{bad[0][1].name}; the hierarchy supports float32 and float64 "
                             "variables (keep 16-bit training in fp32 master weights)")
        if len(dtypes) > 1:
            raise ValueError(f"SBC(hierarchy=...) on rank {self.rank}: the variables must share "
                             f"one dtype, got {sorted(d.name for d in dtypes)}")
        return dtypes.pop()

    def synchronize(self, sbc, entries, local_residual: bool) -> tf.Tensor:
        """One sync of ``entries`` (``(name, variable, index)`` sorted by name) against the
        shared weights ``sbc.reference``; returns whether it committed (bool tensor). A rank's
        non-finite update raises ``ValueError`` on every rank (``InvalidArgumentError`` with
        the same text inside ``tf.function``), or skips the sync everywhere
        (``nonfinite="skip"``)."""
        size, _ = sbc._world()
        with tf.init_scope():
            self._check_record(sbc.node_of_rank, self._nodes, describe(sbc.config.hierarchy))
        dtype = self._check_variables(entries)
        names = [n for n, _, _ in entries]
        shapes = [static_shape(v, n) for n, v, _ in entries]
        lay = self._layout(names, [int(np.prod(s, dtype=np.int64)) for s in shapes])
        L, s, n = self.local_size, lay.shard, lay.numel
        refs = [sbc._reference(name, v, create=False) for name, v, _ in entries]
        pieces = [piece_name(lay, pc) for pc in lay.pieces]
        res = [sbc._residual(p, (b - a,), dtype) for p, (_, a, b) in zip(pieces, lay.pieces)]
        counters = sbc.counters

        # 1. the update, its node-wide check and the node's average (shard `local`)
        flat = tf.concat([tf.reshape(v.read_value(), [-1]) for _, v, _ in entries], 0) - \
            tf.concat([tf.reshape(r.read_value(), [-1]) for r in refs], 0)
        finite = tf.math.is_finite(flat)
        first = tf.argmin(tf.cast(finite, tf.int32), output_type=tf.int64)  # first False
        ends = tf.constant(np.cumsum(lay.numels, dtype=np.int64))
        bad = tf.where(tf.reduce_all(finite), tf.constant(-1, tf.int64),
                       tf.searchsorted(ends, tf.reshape(first, [1]), side="right",
                                       out_type=tf.int64)[0])
        status = _collective("allgather", "sbc.hierarchy.status",
                             tf.reshape(tf.cast(bad, tf.int32), [1]), self.intra)
        flat = tf.pad(flat, [[0, L * s - n]])
        avg = _collective("reducescatter", "sbc.hierarchy.reduce", flat, self.intra)
        intra_bits = 32 * (L - 1) + 8 * dtype.size * (
            s * (2 if local_residual else 1) + 1 + s) * (L - 1)
        ops = [counters["intra_node_bits"].assign_add(intra_bits)]

        # 2. SBC of this shard between nodes (a failing node sends its error instead)
        code, u, sent_ops = self._cross(sbc, lay, pieces, res, avg, status, dtype)
        committed = tf.equal(code, COMMIT)
        ops += sent_ops + [counters["syncs"].assign_add(tf.cast(committed, tf.int64)),
                           sbc.local_steps.assign(0)]

        # 3. shared in the node: the decoded shard, the residual shard, the outcome
        with tf.control_dependencies(ops):
            parts = [u]
            if local_residual:  # the node's residual moves into every rank's weights
                parts.append(tf.pad(tf.concat([r.read_value() for r in res], 0),
                                    [[0, s - sum(b - a for _, a, b in lay.pieces)]]))
            parts.append(tf.reshape(tf.cast(code != COMMIT, dtype), [1]))
            payload = tf.concat(parts, 0)
        zero = [r.assign(tf.zeros_like(r)) for r in res] if local_residual else []
        with tf.control_dependencies(zero):
            shared = tf.reshape(_collective("allgather", "sbc.hierarchy.share", payload,
                                            self.intra), [L, -1])
        flags = shared[:, -1]
        agree = tf.debugging.assert_equal(
            tf.reduce_max(flags), tf.reduce_min(flags),
            message=f"SBC: rank {self.rank}: this sync failed on another rank of its node")
        with tf.control_dependencies([agree]):
            ok = tf.equal(tf.reduce_max(flags), 0)
        return self._apply(sbc, entries, refs, res, lay, shared, ok, local_residual, ops)

    def _cross(self, sbc, lay: Layout, pieces, res, avg, status, dtype):
        """This rank's shard of the node's average, SBC-compressed with its residual and
        exchanged with the same shard of every other node (an allgather, or torch's sparse
        reduce-scatter among them with ``topology="reduce_scatter"``): ``(code, decoded
        shard, ops)``."""
        cfg = sbc.config
        skip = cfg.nonfinite == "skip"
        shapes = [(b - a,) for _, a, b in lay.pieces]
        lo = self.local * lay.shard
        spans = [(lay.offsets[i] + a - lo, lay.offsets[i] + b - lo) for i, a, b in lay.pieces]
        updates = [avg[a:b] for a, b in spans]
        reads = [r.read_value() for r in res]
        playout = [(p, sh) for p, sh in zip(pieces, shapes)]
        backend = sbc._backend_of(res)
        knobs = dict(density=cfg.density, mode=cfg.mode, skip=skip, rank=self.cross_rank,
                     selection=cfg.selection)
        if cfg.topology == "reduce_scatter":  # the shard's pieces cut into the nodes' regions
            plan = scatter.plan(tuple(playout), self.nodes)
            sent, capacity = plan.layout, None
            up = encode_step(backend, [n for n, _ in sent], [sh for _, sh in sent],
                             scatter.pieces(plan, updates), scatter.pieces(plan, reads),
                             seeds=sbc._seeds(self.cross_rank, len(sent)), **knobs)
        else:
            plan, sent = None, playout
            capacity = reference.step_capacity([b - a for _, a, b in lay.pieces], cfg.density,
                                               cfg.mode) if cfg.fixed_size else None
            up = encode_step(backend, pieces, shapes, updates, reads, capacity=capacity,
                             seeds=sbc._seeds(self.cross_rank, len(pieces)), **knobs)
        fp = wire.layout_fingerprint(sent)
        # the node's first failing rank and tensor, as every rank of the node sees them
        failing = status >= 0
        node_bad = tf.reduce_any(failing)
        j = tf.argmax(tf.cast(failing, tf.int32), output_type=tf.int64)
        raw, starts, pads = self._error_table(lay, fp, skip, capacity)
        which = j * len(lay.names) + tf.cast(tf.gather(status, j), tf.int64)
        which = tf.where(node_bad, which, tf.constant(0, tf.int64))
        begin, end = tf.gather(starts, which), tf.gather(starts, which + 1)
        step, padding = tf.cond(node_bad,
                                lambda: (tf.constant(raw)[begin:end], tf.gather(pads, which)),
                                lambda: (up.step, up.padding))
        failed = tf.logical_or(up.failed, node_bad)
        tag = f"sbc.hierarchy.cross.{self.local}"
        if plan is None:
            gathered = allgather(step, tag, self.cross)
            with tf.control_dependencies(sbc._count_traffic(step, gathered, padding)):
                gathered = tf.identity(gathered)
            code, decoded = backend.decode(gathered, playout, self.nodes,
                                           scale=1.0 / self.nodes,
                                           out_dtypes=[dtype] * len(pieces), failed=failed,
                                           strict=False)
            new_res = up.new_residuals
        else:  # this rank owns region `cross_rank` of the shard: its downlink residuals
            code, flat = topology.through_regions(
                sbc, backend, plan, dataclasses.replace(up, step=step, failed=failed),
                rank=self.cross_rank, scale=1.0 / self.nodes, tag=tag, outs=None,
                out_dtypes=[dtype] * len(sent), acc_dtype=dtype,
                count=lambda **bits: [sbc.counters[k].assign_add(v) for k, v in bits.items()],
                variable=state_variable, process_set=self.cross)
            decoded = scatter.tensors(plan, flat, shapes)
            new_res = scatter.tensors(plan, up.new_residuals, shapes)
        ops = [sbc._commit(res, updates, code, new_res, up.positions)]
        covered = sum(b - a for a, b in spans)
        u = tf.pad(tf.concat([tf.reshape(t, [-1]) for t in decoded], 0)
                   if decoded else tf.zeros([0], dtype), [[0, lay.shard - covered]])
        return code, u, ops

    def _apply(self, sbc, entries, refs, res, lay: Layout, shared, ok, local_residual, ops):
        """Every rank: ``W_ref += outer(U)`` where the sync committed; the weights become
        ``W_ref + R_node`` or ``W_ref`` (after a skip: residual in the weights, every rank
        keeps its weights, non-finite entries restart from ``W_ref``; otherwise ``W_ref``)."""
        n, s = lay.numel, lay.shard
        names = [name for name, _, _ in entries]
        shapes = [tuple(v.shape) for _, v, _ in entries]
        us = [tf.reshape(t, sh) for t, sh in
              zip(tf.split(tf.reshape(shared[:, :s], [-1])[:n], lay.numels), shapes)]
        outer = sbc.outer
        if not outer.decodes_into_reference:
            with tf.init_scope():
                outer.build(names, [r.read_value() for r in refs],
                            lambda init, nm: state_variable(init, "outer_" + tf_name(nm)))
        with tf.control_dependencies(ops):
            ds = outer.delta(names, us, ok)
            news = [tf.where(ok, r.read_value() + d, r.read_value()) for r, d in zip(refs, ds)]
            ops = ops + [r.assign(x) for r, x in zip(refs, news)]
        if local_residual:
            rs = tf.split(tf.reshape(shared[:, s:2 * s], [-1])[:n], lay.numels)
            decay = getattr(outer, "decay", 1.0)
            if decay != 1.0:  # ErrorDecay: the residual in the weights decays
                rs = [tf.where(ok, decay * r, r) for r in rs]
        else:
            ops += outer.after_commit(res, ok)
        with tf.control_dependencies(ops):
            assigns = []
            for i, ((_, v, _), new) in enumerate(zip(entries, news)):
                if local_residual:
                    w = v.read_value()
                    kept = tf.where(tf.math.is_finite(w), w, new)
                    assigns.append(v.assign(tf.where(ok, new + tf.reshape(rs[i], shapes[i]),
                                                     kept)))
                else:
                    assigns.append(v.assign(new))
        with tf.control_dependencies(assigns):
            return tf.identity(ok)
