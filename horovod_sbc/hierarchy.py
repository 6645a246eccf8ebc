"""The framework-free parts of the hierarchical exchange (``SBC(hierarchy=...)``): the grouping's
checks, the process sets it needs, the shard layout of the flat update and the names of its
pieces. The exchanges themselves are :mod:`horovod_sbc.torch.hierarchy` and
:mod:`horovod_sbc.tensorflow.hierarchy`; both import what is here, so that a job of torch and
TensorFlow ranks groups, shards and names alike (docs/design.md#the-hierarchy-of-multi-gpu-nodes).

Horovod itself (its ``ProcessSet`` class, ``add_process_set``, the collectives) is passed in by
each adapter: nothing here imports torch, TensorFlow or Horovod.
"""
from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from . import config

Groups = Tuple[Tuple[int, ...], ...]

parse = config.validate_hierarchy
describe = config.describe_hierarchy


# -- the grouping ----------------------------------------------------------------------------
def check(groups: Groups, size: int, what: str) -> Groups:
    """Raise ValueError (the same on every rank: a function of the grouping and the job size)
    unless ``groups`` partitions the job's ranks into at least 2 nodes of equal size >= 2."""
    ranks = sorted(r for g in groups for r in g)
    missing = sorted(set(range(size)) - set(ranks))
    extra = [r for r in ranks if r >= size]
    if extra:
        raise ValueError(f"{what}: rank(s) {extra} do not exist in this job of {size} ranks")
    if missing:
        raise ValueError(f"{what}: rank(s) {missing} of this job of {size} ranks are in no "
                         "group; every rank must be in exactly one")
    sizes = sorted({len(g) for g in groups})
    if len(sizes) != 1:
        raise ValueError(f"{what}: every node must have as many ranks (local rank i of every "
                         f"node compresses shard i), got node sizes {[len(g) for g in groups]}")
    if len(groups) < 2 or sizes[0] < 2:
        raise ValueError(f"{what}: a hierarchy needs at least 2 nodes of at least 2 ranks, got "
                         f"{len(groups)} node(s) of {sizes[0]}; use SBC(hierarchy=None) (flat)")
    return groups


def nodes_of_rows(rows: Sequence[Sequence[int]]) -> Groups:
    """Horovod's own nodes from every rank's ``(cross_rank, local_rank, local_size)`` (row ``r``
    is rank ``r``'s, as an allgather returns them); ValueError if the nodes differ in size."""
    nodes: Dict[int, List[Tuple[int, int]]] = {}
    for rank, (node, local, _) in enumerate(rows):
        nodes.setdefault(node, []).append((local, rank))
    if len({n for _, _, n in rows}) != 1:
        raise ValueError("SBC(hierarchy='node'): Horovod's nodes have different numbers of "
                         f"ranks ({sorted({n for _, _, n in rows})}); give the groups explicitly")
    return tuple(sorted(tuple(sorted(r for _, r in v)) for v in nodes.values()))


def checksum(groups: Groups) -> int:
    """What every rank allgathers to check that all were given the same grouping."""
    return zlib.crc32(repr(groups).encode())


def check_agreement(got: Sequence[int], what: str, built: str) -> None:
    """ValueError unless every rank's :func:`checksum` (``got``, by rank) is rank 0's;
    ``built`` names what the user builds with the hierarchy ("the optimizer", ...)."""
    odd = [r for r, c in enumerate(got) if c != got[0]]
    if odd:
        raise ValueError(f"{what}: rank(s) {odd} were given another grouping than rank 0; "
                         f"build {built} with the same hierarchy on every rank")


def position(groups: Groups, rank: int) -> Tuple[int, int, Tuple[int, ...]]:
    """``(node, local rank, cross-node ranks)`` of ``rank``: the index of its node, its index in
    the node and the ranks of the other nodes with the same local index (its cross-node set)."""
    node = next(j for j, g in enumerate(groups) if rank in g)
    local = groups[node].index(rank)
    return node, local, tuple(sorted(g[local] for g in groups))


def node_of_rank(groups: Groups, size: int) -> List[int]:
    """Each global rank's node index."""
    return [next(j for j, g in enumerate(groups) if r in g) for r in range(size)]


# -- Horovod process sets --------------------------------------------------------------------
def set_lists(groups: Groups) -> List[Tuple[int, ...]]:
    """The process sets a grouping needs: one per node, one per local rank index (cross-node)."""
    local = len(groups[0])
    return list(groups) + [tuple(sorted(g[i] for g in groups)) for i in range(local)]


def declared_process_sets(groups, cache: Dict[Tuple[int, ...], object],
                          make: Callable[[List[int]], object]) -> list:
    """The process sets of an explicit grouping (``hierarchy_process_sets`` of each adapter):
    ``make(ranks)`` is the framework's ``hvd.ProcessSet``; ``cache`` (ranks -> set) keeps each
    one, for the lookup of :func:`process_set`."""
    parsed = parse(groups)
    if not isinstance(parsed, tuple):
        raise ValueError(f"hierarchy_process_sets needs explicit groups, got {groups!r}")
    out = []
    for ranks in set_lists(parsed):
        ps = cache.get(ranks)
        if ps is None:
            ps = cache[ranks] = make(list(ranks))
        out.append(ps)
    return out


def process_set(hvd, ranks: Tuple[int, ...], what: str, cache: Dict[Tuple[int, ...], object],
                declare: str):
    """The process set of ``ranks``: the one declared at initialisation (in ``cache``), else
    added now by ``hvd.add_process_set`` (``hvd`` is the framework's Horovod module);
    ``declare`` names the adapter's ``hierarchy_process_sets`` in the error."""
    ps = cache.get(ranks)
    if ps is not None and ps.process_set_id is not None:
        return ps
    try:
        ps = cache[ranks] = hvd.add_process_set(list(ranks))
    except ValueError as e:
        raise ValueError(
            f"{what}: Horovod has no process set of ranks {list(ranks)} and cannot add it "
            f"({e}); call hvd.init(process_sets={declare}(groups)) or "
            "hvd.init(process_sets='dynamic') on every rank") from None
    return ps


# -- the shard layout ----------------------------------------------------------------------
@dataclass
class Layout:
    """Where each tensor lies in the flat buffer of ``shards * shard`` elements (zero padded)
    and which pieces of which tensors fall in this rank's shard."""
    names: List[str]
    offsets: List[int]
    numels: List[int]
    shard: int
    pieces: List[Tuple[int, int, int]]  # (tensor index, start, end) within the tensor

    @property
    def numel(self) -> int:
        return sum(self.numels)


def layout(names: Sequence[str], numels: Sequence[int], shards: int, index: int) -> Layout:
    """Contiguous shards of ``ceil(N / shards)`` elements of the tensors ``names`` (sorted, of
    ``numels`` elements) one after the other; a tensor crossing a shard border is sent as one
    piece per shard (each piece a tensor message with its own SBC mean)."""
    numels = [int(n) for n in numels]
    offsets = [0, *itertools.accumulate(numels)][:-1]
    size = -(-sum(numels) // shards)
    lo, hi = index * size, (index + 1) * size
    pieces = [(i, max(lo, o) - o, min(hi, o + n) - o) for i, (o, n) in
              enumerate(zip(offsets, numels)) if o < hi and o + n > lo]
    return Layout(list(names), offsets, numels, size, pieces)


def piece_name(lay: Layout, piece: Tuple[int, int, int]) -> str:
    """A piece's tensor name, ``"name[a:b]"``: its residual's name and its message's."""
    i, a, b = piece
    return f"{lay.names[i]}[{a}:{b}]"


def refuse_elastic(groups) -> None:
    """Elastic ``SBCState`` (torch and TF): a hierarchy cannot follow an elastic job, whose
    ranks change, because its Horovod process sets are declared at ``hvd.init``."""
    if groups is not None:
        raise ValueError(f"SBCState: {describe(groups)} cannot follow an elastic job: its "
                         "Horovod process sets are declared at hvd.init for a fixed set of "
                         "ranks; use the flat exchange")
