"""Hierarchical SBC for multi-GPU nodes: dense inside a node, compressed between nodes.

The ranks of a node act as one SBC worker (as in BytePS's two-level compression, Jiang et al.,
OSDI 2020, and Bagua's node-level reduce-then-compress, Gan et al., VLDB 2021). Per sync:

1. every rank's update ``A = W - W_ref`` (all tensors in one flat buffer, sorted by name) is
   averaged over the node by one dense ``reducescatter`` on the node's Horovod process set:
   local rank ``i`` receives shard ``i`` of the node's average (``1/L`` of the elements);
2. local rank ``i`` SBC-compresses its shard with its own residual and allgathers it with the
   local ranks ``i`` of the other nodes (:func:`horovod_sbc.torch.sync.synchronize` with
   :class:`ProcessSetTransport`; the sparse reduce-scatter with ``topology="reduce_scatter"``);
3. the decoded average of shard ``i`` is shared inside the node by one dense ``allgather``; every
   rank applies the same bytes the same way: the shared weights are bit-identical job-wide.

``local_residual=True`` (default): every rank of a node continues from ``W_ref + R_node``;
``False``: from ``W_ref``, the residual of shard ``i`` kept by local rank ``i``. ``outer=`` acts
on the whole average, identically on every rank. ``ValueError`` at construction:
``topology="server"``, the stock Horovod hook and the DDP hook, parameters other than
float32/float64, of several dtypes or devices, or non-contiguous.

The process sets (Horovod >= 0.23) must exist on every rank: declared at initialisation
(``hvd.init(process_sets=horovod_sbc.torch.hierarchy_process_sets([[0, 1], [2, 3]]))``), or
added by the optimizer when it is built after ``hvd.init(process_sets="dynamic")`` (what
``hierarchy="node"`` needs). Why: docs/design.md#the-hierarchy-of-multi-gpu-nodes.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import hierarchy as common
from ..hierarchy import (Groups, Layout, check, describe, parse, piece_name,  # noqa: F401
                         set_lists)
from . import sync
from .sync.state import SyncState

_SETS: Dict[Tuple[int, ...], object] = {}  # ranks -> the hvd.ProcessSet made for them here
_DECLARE = "horovod_sbc.torch.hierarchy_process_sets"  # named in the errors


def check_parameters(named: Sequence[Tuple[str, torch.Tensor]], rank: int) -> None:
    """One flat buffer holds every update: one dtype (float32 or float64), one device,
    contiguous parameters."""
    kinds = {(p.dtype, p.device) for _, p in named}
    bad = [(n, p.dtype) for n, p in named if p.dtype not in (torch.float32, torch.float64)]
    if bad:
        raise ValueError(f"SBC(hierarchy=...) on rank {rank}: parameter {bad[0][0]!r} is "
                         f"{bad[0][1]}; the hierarchy supports float32 and float64 parameters "
                         "(keep 16-bit training in fp32 master weights)")
    if len(kinds) > 1:
        raise ValueError(f"SBC(hierarchy=...) on rank {rank}: the parameters must share one "
                         f"dtype and device, got {sorted(map(str, kinds))}")
    strided = [n for n, p in named if not p.is_contiguous()]
    if strided:
        raise ValueError(f"SBC(hierarchy=...) on rank {rank}: parameter {strided[0]!r} is not "
                         "contiguous (the sync writes the weights through flat views)")


def horovod_nodes(hvd) -> Groups:
    """Horovod's own nodes, from every rank's ``(cross_rank, local_rank, local_size)`` (one
    allgather of 3 integers per rank)."""
    mine = torch.tensor([[hvd.cross_rank(), hvd.local_rank(), hvd.local_size()]])
    return common.nodes_of_rows(hvd.allgather(mine, name="sbc.hierarchy.nodes").tolist())


def hierarchy_process_sets(groups) -> list:
    """The ``hvd.ProcessSet`` s of an explicit grouping, to declare at initialisation:
    ``hvd.init(process_sets=hierarchy_process_sets([[0, 1], [2, 3]]))``. The optimizer finds
    them here; without them it needs ``hvd.init(process_sets="dynamic")``."""
    import horovod.torch as hvd
    return common.declared_process_sets(groups, _SETS, hvd.ProcessSet)


def _process_set(hvd, ranks: Tuple[int, ...], what: str):
    return common.process_set(hvd, ranks, what, _SETS, _DECLARE)


class ProcessSetTransport:
    """Allgather of step messages among a Horovod process set (the seam of
    :func:`horovod_sbc.torch.sync.synchronize`, like
    :class:`~horovod_sbc.torch.sync.transport.HorovodTransport`): ``world()`` is the set's size
    and this rank's index in it (the messages come in that order)."""

    def __init__(self, process_set):
        self.process_set = process_set

    def world(self) -> Tuple[int, int]:
        return self.process_set.size(), self.process_set.rank()

    def allgather(self, step: torch.Tensor, tag: str) -> torch.Tensor:
        import horovod.torch as hvd
        return hvd.allgather(step, name=tag, process_set=self.process_set)

    def alltoall(self, buf: torch.Tensor, splits, tag: str) -> torch.Tensor:
        """The ``"reduce_scatter"`` topology's alltoall among the set."""
        import horovod.torch as hvd
        out, _ = hvd.alltoall(buf, splits=torch.tensor(splits, dtype=torch.int32), name=tag,
                              process_set=self.process_set)
        return out


class NodeState(SyncState):
    """The compressing rank's sync state: the compressor's configuration and residual manager
    (residuals, counters, checkpoints stay in one place), the cross-node transport. Its
    world is the cross-node set's and is not recorded: checkpoints record the job's."""

    def world(self) -> Tuple[int, int]:
        return self.transport.world()


def layout(named: Sequence[Tuple[str, torch.Tensor]], shards: int, index: int) -> Layout:
    """:func:`horovod_sbc.hierarchy.layout` of the parameters ``named``."""
    return common.layout([n for n, _ in named], [p.numel() for _, p in named], shards, index)


class Hierarchy:
    """The hierarchical exchange of one drop-in optimizer (see the module docstring). Built
    on every rank when the optimizer is; checks the grouping (the same ``ValueError`` on every
    rank), that every rank was given the same one, and finds or adds the process sets."""

    def __init__(self, sbc, spec, named: Sequence[Tuple[str, torch.Tensor]]):
        import horovod.torch as hvd
        what = describe(spec)
        size, rank = sbc.state.world()  # records the job's size and rank for checkpoints
        check_parameters(named, rank)
        groups = horovod_nodes(hvd) if spec == "node" else spec
        self.groups = check(groups, size, what)
        self._agree(hvd, rank, what)
        self.node, self.local, cross = common.position(self.groups, rank)
        self.rank = rank
        sets = {ranks: _process_set(hvd, ranks, what) for ranks in set_lists(self.groups)}
        self.intra = sets[self.groups[self.node]]
        self.state = NodeState(sbc.config, ProcessSetTransport(sets[cross]), sbc.manager)
        sbc.manager.config.update(hierarchy=[list(g) for g in self.groups])
        self._buffers: Dict[str, torch.Tensor] = {}
        self._layout_key, self._lay = None, None  # the shard layout of the last sync

    def _agree(self, hvd, rank: int, what: str) -> None:
        """Every rank must have been given the same grouping (one allgather of a checksum)."""
        crc = common.checksum(self.groups)
        got = hvd.allgather(torch.tensor([crc], dtype=torch.int64),
                            name="sbc.hierarchy.agree").tolist()
        common.check_agreement(got, what, "the optimizer")

    @property
    def local_size(self) -> int:
        return len(self.groups[0])

    def _buffer(self, key: str, n: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != n or buf.dtype != like.dtype or \
                buf.device != like.device:
            buf = self._buffers[key] = torch.zeros(n, dtype=like.dtype, device=like.device)
        return buf

    def _layout(self, named) -> Layout:
        key = tuple((n, p.numel()) for n, p in named)
        if self._layout_key != key:
            self._layout_key, self._lay = key, layout(named, self.local_size, self.local)
        return self._lay

    @torch.no_grad()
    def synchronize(self, named: Sequence[Tuple[str, torch.Tensor]], ref: Dict[str, torch.Tensor],
                    local_residual: bool, outer, failed: Optional[str] = None) -> bool:
        """One sync of the drop-in's parameters ``named`` (sorted by name) against the shared
        weights ``ref`` (updated in place). Returns False if the sync was skipped
        (``nonfinite="skip"``); raises ValueError on every rank if any rank failed.
        ``failed``: why this rank's window already failed (a non-finite gradient whose local
        step was not taken)."""
        import horovod.torch as hvd
        lay = self._layout(named)
        flat = self._updates(named, ref, lay)
        error = self._node_error(hvd, lay, flat, failed)
        avg = hvd.reducescatter(flat, name="sbc.hierarchy.reduce", op=hvd.Average,
                                process_set=self.intra)
        code, err = self._cross(lay, avg, error)
        shared = self._share(hvd, lay, avg, code, local_residual)
        codes = [int(c) for c in shared[:, -1].tolist()]  # one flag per local rank
        if err is not None:
            raise err
        if len(set(codes)) > 1 or 2 in codes:
            failed = [self.groups[self.node][i] for i, c in enumerate(codes) if c == 2]
            raise ValueError(f"SBC: rank {self.rank}: this sync failed on rank(s) {failed} of "
                             "its node (their error names the cause)")
        if codes[0] == 1:
            self._skipped(named, ref, lay, local_residual)
            return False
        self._apply(named, ref, lay, shared, local_residual, outer)
        return True

    def _updates(self, named, ref, lay: Layout) -> torch.Tensor:
        """Every tensor's ``W - W_ref`` in one flat buffer (its zero padding never written)."""
        flat = self._buffer("update", self.local_size * lay.shard, named[0][1])
        head = flat[:lay.numel]  # 3 kernels whatever the number of tensors
        torch.cat([p.detach().reshape(-1) for _, p in named], out=head)
        head.sub_(torch.cat([ref[name].reshape(-1) for name, _ in named]))
        return flat

    def _node_error(self, hvd, lay: Layout, flat: torch.Tensor,
                    failed: Optional[str] = None) -> Optional[Tuple[int, str]]:
        """``(global rank, reason)`` of the first rank of this node whose update is not finite
        (or whose window ``failed``: a non-finite gradient, sent as ``-2 - tensor index``),
        else None: one allgather of one integer per local rank (and one host read)."""
        bad = -1
        if failed is not None:
            bad = -2 - lay.names.index(failed)
        elif not bool(torch.isfinite(flat).all()):
            bad = next(i for i, (o, n) in enumerate(zip(lay.offsets, lay.numels))
                       if not bool(torch.isfinite(flat[o:o + n]).all()))
        got = hvd.allgather(torch.tensor([bad], dtype=torch.int32),
                            name="sbc.hierarchy.status", process_set=self.intra).tolist()
        self.state.manager.add(intra_node_bits=32 * (self.local_size - 1))
        for i, b in enumerate(got):
            if b >= 0:
                return (self.groups[self.node][i],
                        f"the update of {lay.names[b]!r} contains NaN or Inf")
            if b <= -2:
                return (self.groups[self.node][i],
                        f"the gradient of {lay.names[-2 - b]!r} contains NaN or Inf")
        return None

    def _cross(self, lay: Layout, avg: torch.Tensor, error):
        """SBC of this rank's shard of the node's average, exchanged with the same shard of
        every other node. Returns ``(0 ok | 1 skipped | 2 failed, the error or None)``."""
        lo = self.local * lay.shard
        spans = [(lay.offsets[i] + a - lo, lay.offsets[i] + b - lo) for i, a, b in lay.pieces]
        items = [sync.Update(piece_name(lay, pc), avg[s:e], (e - s,))
                 for pc, (s, e) in zip(lay.pieces, spans)]
        u = self._buffer("average", lay.shard, avg)
        try:
            out = sync.synchronize(self.state, items, out=[u[s:e] for s, e in spans],
                                   tag=f"sbc.hierarchy.cross.{self.local}",
                                   apply=lambda us: None, error=error)
        except ValueError as e:
            return 2, e
        return (0 if out is not None else 1), None

    def _stored(self, lay: Layout) -> List[Optional[torch.Tensor]]:
        res = self.state.manager.residuals
        return [res.get(piece_name(lay, pc)) for pc in lay.pieces]

    def _share(self, hvd, lay: Layout, avg: torch.Tensor, code: int,
               local_residual: bool) -> torch.Tensor:
        """The dense allgather inside the node: each local rank's decoded shard of the
        average (and, residual in the weights, its shard of the node's residual) and its
        outcome flag; one row per local rank."""
        parts = [self._buffer("average", lay.shard, avg)]
        if local_residual:
            parts.append(self._residual_shard(lay, avg))
        parts.append(torch.full((1,), float(code), dtype=avg.dtype, device=avg.device))
        payload = torch.cat(parts)
        self.state.manager.add(intra_node_bits=8 * payload.element_size() *
                               (payload.numel() + lay.shard) * (self.local_size - 1))
        return hvd.allgather(payload, name="sbc.hierarchy.share",
                             process_set=self.intra).view(self.local_size, -1)

    def _residual_shard(self, lay: Layout, like: torch.Tensor) -> torch.Tensor:
        """This rank's pieces of the node's residual, one after the other as in the shard;
        the stored pieces are zeroed: the residual moves into the weights of every rank of
        the node."""
        r = self._buffer("residual", lay.shard, like)
        stored = self._stored(lay)
        covered = sum(b - a for _, a, b in lay.pieces)
        if all(t is not None for t in stored):
            torch.cat(stored, out=r[:covered])
            torch._foreach_zero_(stored)
            return r
        s = 0  # some pieces were never encoded (a failed first sync): zeros there
        for (_, a, b), t in zip(lay.pieces, stored):
            piece, s = r[s:s + b - a], s + b - a
            if t is None:
                piece.zero_()
            else:
                piece.copy_(t)
                t.zero_()
        return r

    def _apply(self, named, ref, lay: Layout, shared: torch.Tensor, local_residual: bool,
               outer) -> None:
        """Every rank: ``W_ref += outer(U)``; the weights become ``W_ref + R_node`` or
        ``W_ref``; then the outer step's action on the residuals (ErrorDecay)."""
        n, s = lay.numel, lay.shard
        u = shared[:, :s].reshape(-1)[:n]  # a copy: the outer step may work in place
        names = [name for name, _ in named]
        us = [u[o:o + k] for o, k in zip(lay.offsets, lay.numels)]
        outer.delta_(names, us)
        refs = [ref[name].view(-1) for name in names]
        torch._foreach_add_(refs, us)
        if local_residual:
            r = shared[:, s:2 * s].reshape(-1)[:n]
            rs = [r[o:o + k] for o, k in zip(lay.offsets, lay.numels)]
            _set_weights(named, torch._foreach_add(refs, rs))
            outer.after_commit([p.detach().view(-1) for _, p in named], refs,
                               [True] * len(named))
            return
        _set_weights(named, refs)
        kept = [(t, refs[i][a:b]) for (i, a, b), t in zip(lay.pieces, self._stored(lay))
                if t is not None]
        outer.after_commit([t for t, _ in kept], [r for _, r in kept], [False] * len(kept))

    def _skipped(self, named, ref, lay: Layout, local_residual: bool) -> None:
        """A skipped sync (``nonfinite="skip"``): the shared weights stay. Residual in the
        weights: every rank keeps its weights, non-finite entries restart from ``W_ref``.
        Otherwise every rank restarts from ``W_ref`` (a healthy node's update waits in its
        compressing ranks' residuals; the failing node's window is dropped)."""
        for (name, p) in named:
            w = p.detach()
            if local_residual:
                torch.where(torch.isfinite(w), w, ref[name].view_as(w), out=w)
            else:
                w.copy_(ref[name].view_as(w))

    def stored_residuals(self, named) -> List[torch.Tensor]:
        """The residual pieces this rank keeps (``local_residual=False``: the node's unsent
        update of this rank's shard)."""
        return [t for t in self._stored(layout(named, self.local_size, self.local))
                if t is not None]

    def residual_shares(self, named) -> Dict[str, torch.Tensor]:
        """Per parameter, this rank's pieces of its node's residual times the node size
        (zeros elsewhere): their average over every rank of the job is the average of the
        nodes' residuals (what :meth:`finish` adds to the shared weights)."""
        lay = layout(named, self.local_size, self.local)
        out = {name: torch.zeros_like(p).view(-1) for name, p in named}
        for (i, a, b), t in zip(lay.pieces, self._stored(lay)):
            if t is not None:
                out[lay.names[i]][a:b] = t * self.local_size
        return out


def _set_weights(named, values: List[torch.Tensor]) -> None:
    """``p = value`` for every (contiguous) parameter, in one multi-tensor copy."""
    torch._foreach_copy_([p.detach().view(-1) for _, p in named], values)
