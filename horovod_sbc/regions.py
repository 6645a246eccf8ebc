"""The regions of the ``"reduce_scatter"`` topology: which rank owns which piece of the model.

The model's tensors, in the sync's order, are laid end to end and cut into N contiguous
regions, one per rank (Ok-Topk's index-space split, Li & Hoefler, arXiv 2201.07598); a tensor
that straddles a cut becomes two *pieces*. Every piece is compressed like a tensor, so a
region's share of a message's positions is its share of the elements. An owner's work also has
a cost per piece (a tensor message per rank to parse, one to encode), so the cuts balance
``elements + c x pieces`` with ``c = E / (2 (T + N - 1))`` (E elements, T tensors): a region
of many small tensors gets fewer elements. The rule is integer arithmetic on the layout alone,
so every rank, torch or TensorFlow, cuts the same regions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from . import wire

Layout = Sequence[Tuple[str, Sequence[int]]]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flat tensor ``tensor`` (its index in the layout); a
    whole tensor keeps its name and shape, a cut one is ``"name[a:b]"``, flat."""
    tensor: int
    start: int
    stop: int
    name: str
    shape: Tuple[int, ...]


class Plan:
    """The regions of ``layout`` over ``size`` ranks: region r is the pieces
    ``pieces[bounds[r]:bounds[r + 1]]``, its layout ``regions[r]`` and its layout fingerprint
    ``fingerprints[r]``; ``layout`` is every piece's ``(name, shape)`` in order."""

    def __init__(self, layout: Layout, size: int):
        if size < 1:
            raise ValueError(f"a plan needs at least one rank, got {size}")
        self.size = size
        pieces, owner = cut(layout, size)
        self.pieces: Tuple[Piece, ...] = tuple(pieces)
        self.layout = [(p.name, p.shape) for p in pieces]
        self.bounds = [0] * (size + 1)
        for r in owner:
            self.bounds[r + 1] += 1
        for r in range(size):
            self.bounds[r + 1] += self.bounds[r]
        self.regions = [self.layout[self.bounds[r]:self.bounds[r + 1]] for r in range(size)]
        self.fingerprints = [wire.layout_fingerprint(lay) for lay in self.regions]


def cut(layout: Layout, size: int) -> Tuple[List[Piece], List[int]]:
    """The pieces of ``layout`` in order and each one's region (see the module docstring)."""
    numels = [wire.layout_numel(s) for _, s in layout]
    total, n_tensors = sum(numels), len(numels)
    c = total // (2 * (n_tensors + size - 1)) if size > 1 and n_tensors else 0
    cost = total + c * (n_tensors + size - 1)
    bound = [cost * (r + 1) // size for r in range(size)]  # region r ends where cost reaches
    pieces, owner, r, spent = [], [], 0, 0
    for t, ((name, shape), n) in enumerate(zip(layout, numels)):
        a = 0
        while True:
            while r < size - 1 and spent + c >= bound[r]:
                r += 1  # no room left in region r, not even for a piece's start
            spent += c
            b = n if r == size - 1 else min(n, a + bound[r] - spent)
            spent += b - a
            whole = a == 0 and b == n
            pieces.append(Piece(t, a, b, name if whole else f"{name}[{a}:{b}]",
                                tuple(shape) if whole else (b - a,)))
            owner.append(r)
            a = b
            if a >= n:
                break
    return pieces, owner


# ----------------------------------------------------------------------------------------------
# the host's byte work of a sync through the regions (shared by torch and TensorFlow; the step
# headers are parsed and judged by the caller, with horovod_sbc.protocol)
# ----------------------------------------------------------------------------------------------
def region_messages(host: bytes, plan: Plan,
                    error: Optional[wire.PeerError] = None) -> List[bytes]:
    """A rank's step message (``host``: its bytes, a step of ``plan.layout`` whose header the
    caller checked) re-framed as one step message per region, in rank order: region r's tensor
    messages under region r's fingerprint. ``error``: the ERROR/SKIP the step carries instead
    (``protocol.peer_error``), sent to every owner as an ERROR/SKIP of its region with the same
    reason and origin. Reads every piece's tensor header (``ValueError`` if one is malformed)."""
    if error is not None:
        return [wire.error_step_message(error.reason, fp, error.skip, error.rank)
                for fp in plan.fingerprints]
    ends, off = [wire.STEP_HEADER_SIZE], wire.STEP_HEADER_SIZE
    for name, shape in plan.layout:
        off = wire.parse_tensor_header(host, off, wire.layout_numel(shape), name).nbytes
        ends.append(off)
    return [wire.step_message_bytes(host[ends[plan.bounds[r]]:ends[plan.bounds[r + 1]]],
                                    plan.fingerprints[r], len(plan.regions[r]))
            for r in range(plan.size)]


def join_regions(host: bytes, plan: Plan, heads: Sequence) -> bytes:
    """Every owner's region message (``host``: concatenated in rank order; ``heads``: their
    step headers, ``protocol.parse_step`` of each, none an ERROR/SKIP) as ONE step message of
    the whole piece layout ``plan.layout`` (the region bodies joined in order), so that one
    decode of one rank's step gives every piece. ``ValueError`` naming the owner whose message
    is of another region."""
    for h in heads:
        if (h.layout, h.n_tensors) != (plan.fingerprints[h.rank], len(plan.regions[h.rank])):
            raise ValueError(f"rank {h.rank} sent the message of another region (fingerprint "
                             f"{h.layout:#010x}, {h.n_tensors} tensors; expected "
                             f"{plan.fingerprints[h.rank]:#010x}, "
                             f"{len(plan.regions[h.rank])})")
    return wire.step_message_bytes(b"".join(host[h.body[0]:h.body[1]] for h in heads),
                                   wire.layout_fingerprint(plan.layout), len(plan.layout))
