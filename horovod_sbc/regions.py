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
from typing import List, Sequence, Tuple

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
