"""The backend interface of the torch codec: encode the updates of a sync, decode a gathered step.

A *backend* turns residual-corrected updates into tensor messages (the bytes of
:mod:`horovod_sbc.wire`, equal to the numpy reference's, :mod:`horovod_sbc.reference`) and a
gathered step (every rank's step message, concatenated in rank order) back into sums:
:class:`~horovod_sbc.torch.backend.ops.OpsBackend` (tensor ops on the tensors' own device; what
CUDA tensors take) or :class:`~horovod_sbc.torch.backend.ckernels.KernelBackend` (the C kernels
on the CPU), chosen once per device by :func:`horovod_sbc.torch.backend.backend_for`.

What every backend guarantees:

* **the same bytes** for the same update, whatever the device (golden vectors, differential tests);
* **error feedback committed only after success**: :meth:`Backend.encode_tensor` returns an
  :class:`Encoded` whose :meth:`~Encoded.commit` takes what was sent out of the residual; the
  sync calls it once every rank's message decoded;
* **the protocol's verdict before any write**: :meth:`Backend.decode_many` parses every header
  on the host (:func:`horovod_sbc.protocol.parse_gathered`), measures the streams on the device,
  lets :func:`horovod_sbc.protocol.check_streams` judge, and only then adds; a rejected step
  leaves every output as it was;
* **the same sums on every rank**: each output element receives its ranks' values in rank
  order, ``float64(value) * scale`` rounded once to the output's dtype, then added.

An update is described by where it lives (:class:`InPlace`, :class:`Accumulate`,
:class:`Difference`), so that a backend can form it in the same pass that selects from it.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from ... import registry, wire


class NonFiniteError(ValueError):
    """An update holds NaN or Inf (raised by the selection, which sees every element once).
    ``index``: the position of the failing update in a sync's list, when it came from one."""
    index: Optional[int] = None


# ------------------------------------------------------------------------------------------------
# where an update lives
# ------------------------------------------------------------------------------------------------
@dataclass
class InPlace:
    """The update ``A`` is ``a`` itself (flat), e.g. a residual that already holds ``R + dW``;
    the error feedback is taken out of ``a``."""
    a: torch.Tensor


@dataclass
class Accumulate:
    """``A = R + g``, formed in place in the residual ``residual`` (flat) before the selection,
    in its pass where the backend can; ``consume``: ``g`` is also zeroed (the stock hook's
    gradient, whose buffer then receives the decoded average with no memset of its own).

    On NaN/Inf the residual is put back (``R``), its non-finite entries restarted at 0; a
    consumed ``g`` cannot be given back, so the residual then keeps ``R + g`` (its non-finite
    entries at 0)."""
    residual: torch.Tensor
    addend: torch.Tensor
    consume: bool = False


@dataclass
class Difference:
    """``A = W - W_ref`` (flat tensors of one size and dtype), never stored: the drop-in's update
    when this rank's residual lives in the weights. The error feedback is taken out of ``W``
    after the decoded average moved ``W`` and ``W_ref`` alike: one value (SBC) leaves ``W`` at
    the sent positions; per-position values set ``W = W_ref + (A - sent)`` there (a position
    whose whole update was sent lands exactly on the shared weights)."""
    weights: torch.Tensor
    reference: torch.Tensor


Source = Union[torch.Tensor, InPlace, Accumulate, Difference]


def as_source(x: Source):
    """A tensor is shorthand for :class:`InPlace`."""
    return InPlace(x) if isinstance(x, torch.Tensor) else x


def reset_nonfinite_(res: torch.Tensor) -> None:
    """Restart the NaN/Inf entries of ``res`` at 0 (what cannot be taken back); the rest
    stays."""
    torch.nan_to_num_(res, nan=0.0, posinf=0.0, neginf=0.0)


def restore_(res: torch.Tensor, upd: torch.Tensor) -> None:
    """Undo ``res += upd`` after a failed encode; entries made non-finite by a NaN/Inf in
    ``upd`` cannot be recovered and are reset to 0."""
    res.sub_(upd)
    reset_nonfinite_(res)


def check_request(mode, selection: str) -> str:
    """The compressor's registered name (``True``/``False``: ``"sbc"``/``"values"``); raises
    ``ValueError`` naming the choices."""
    mode = "sbc" if mode is True else "values" if mode is False else mode
    registry.get(mode)
    if selection not in ("paper", "magnitude"):
        raise ValueError(f"selection must be 'paper' or 'magnitude', got {selection!r}")
    return mode


# ------------------------------------------------------------------------------------------------
# an encoded update, and reusable buffers
# ------------------------------------------------------------------------------------------------
@dataclass
class Encoded:
    """One tensor encoded, its error feedback not yet committed. ``target`` (flat) is what the
    feedback is taken out of (the residual, or the weights of a :class:`Difference`);
    ``subtract`` the backend's :meth:`Backend.subtract_sent`. For a :class:`Difference` with
    per-position values, ``kept`` is ``A - sent`` at ``positions`` (computed before the decode
    moves anything) and ``reference`` the flat shared weights."""
    message: torch.Tensor
    positions: torch.Tensor
    sent: torch.Tensor
    target: torch.Tensor
    subtract: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    reference: Optional[torch.Tensor] = None
    kept: Optional[torch.Tensor] = None

    def commit(self) -> None:
        """Error feedback, once every rank's message decoded."""
        if self.kept is None:
            self.subtract(self.target, self.positions, self.sent)
        elif self.positions.numel():
            self.target.index_copy_(0, self.positions,
                                    self.reference.index_select(0, self.positions) + self.kept)


class PositionBuffer:
    """Reusable storage for one tensor's sent positions (the kernel backend writes them here):
    a fresh tensor per tensor per step would page-fault its memory in every time. The positions
    an encode returns are then a view of it, valid until the next encode given the same buffer
    (the sync and the stock hook commit the error feedback before that)."""

    def __init__(self):
        self._t: Optional[torch.Tensor] = None

    def get(self, count: int) -> torch.Tensor:
        """An int64 CPU view of ``count`` elements (grown, never shrunk)."""
        if self._t is None or self._t.numel() < count:
            self._t = torch.empty(count, dtype=torch.int64)
        return self._t[:count]


_SCRATCH = {}


def scratch(n: int, dtype, device, slot: int = 0) -> torch.Tensor:
    """A reusable flat buffer, so that a sync does not allocate (and page-fault) a fresh
    tensor-sized buffer per parameter. Slot 0 is the codec's own (``|A|``), slot 1 holds a
    formed update (``W - W_ref``, or the sync's ``dW``); other slots belong to callers."""
    key = (slot, dtype, str(device))
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n]


# ------------------------------------------------------------------------------------------------
# where a decoded step goes
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Targets:
    """The outputs of a decode (flat tensors in layout order; None: that tensor's sum is not
    wanted). Build with :meth:`add`, :meth:`replace` or :meth:`new`."""
    outs: Tuple[Optional[torch.Tensor], ...]
    also: Optional[Tuple[Optional[torch.Tensor], ...]] = None
    fresh: bool = False
    zeroed: bool = False
    masks: Optional[Tuple[Optional[torch.Tensor], ...]] = None

    @classmethod
    def add(cls, outs, also=None) -> "Targets":
        """The sums are added to ``outs`` (e.g. the shared weights), and to ``also`` (a second
        output per tensor of the same dtype, or None: the weights that hold this rank's
        residual move with the shared weights)."""
        return cls(tuple(outs), None if also is None else _padded(also, len(outs)))

    @classmethod
    def replace(cls, outs, zeroed: bool = False, masks=None) -> "Targets":
        """``outs`` hold the sums alone afterwards (whatever they held; ``zeroed``: the caller
        knows they are all zero, so nothing zeroes them). ``masks``: per output, a tensor of as
        many elements (or None) set to 0 wherever the sum is non-zero once the step is accepted
        (DGC's momentum factor masking, Lin et al., ICLR 2018)."""
        return cls(tuple(outs), None, True, zeroed,
                   None if masks is None else _padded(masks, len(outs)))

    @classmethod
    def new(cls, layout: Sequence[Tuple[str, Sequence[int]]], dtype, device) -> "Targets":
        """Fresh outputs of ``dtype`` on ``device``, one per tensor of ``layout``."""
        return cls(tuple(torch.empty(wire.layout_numel(s), dtype=dtype, device=device)
                         for _, s in layout), None, True, False)

    def lists(self) -> List[Tuple[Optional[torch.Tensor], ...]]:
        """The output lists that receive the same additions (``outs``, then ``also``)."""
        return [self.outs] if self.also is None else [self.outs, self.also]


def _padded(xs, n: int) -> Tuple:
    xs = list(xs)
    return tuple(xs + [None] * (n - len(xs)))


@dataclass
class DecodeJob:
    """One gathered step to decode: ``scale`` x every rank's tensors into ``targets``. The
    backend records what it read: ``host``, the job's bytes (given by a caller that read them
    already, they are not read again), and ``step``, its parsed headers
    (:class:`horovod_sbc.protocol.GatheredStep`, None when parsing failed)."""
    gathered: torch.Tensor
    layout: Sequence[Tuple[str, Sequence[int]]]
    n_ranks: int
    targets: Targets
    scale: float = 1.0
    host: Optional[memoryview] = None
    step: Optional[object] = None


# ------------------------------------------------------------------------------------------------
# the interface
# ------------------------------------------------------------------------------------------------
class Backend(abc.ABC):
    """Encode updates and decode gathered steps on one kind of device (see the module
    docstring for what every implementation guarantees)."""

    name = "backend"
    #: does :meth:`encode_many` encode a whole sync at once (so that sources worth forming for
    #: it, such as the drop-in's ``dW = W - W_ref`` of every tensor, are formed)?
    encodes_at_once = False

    @abc.abstractmethod
    def encode_tensor(self, source: Source, density: float, mode="sbc", name: str = "tensor",
                      selection: str = "paper", generator: Optional[torch.Generator] = None,
                      positions: Optional[PositionBuffer] = None) -> Encoded:
        """Encode one flat update (see :class:`InPlace`, :class:`Accumulate`,
        :class:`Difference`; a tensor means :class:`InPlace`).

        ``mode``: a registered compressor (:mod:`horovod_sbc.registry`); a ``native_kernel``
        one runs in the backend — ``"sbc"`` (top-k of each side, the larger mean sent;
        ``selection`` ``"paper"`` or ``"magnitude"``, see :mod:`horovod_sbc.reference`) and
        ``"values"`` (top-k with float32 values) — any other through its file's
        ``encode_torch`` (``generator``: the draws of a random one). ``positions``: a buffer
        the kernel backend may return the positions in. Raises :class:`NonFiniteError` naming
        ``name`` on NaN/Inf, with the source handled as its class says."""

    def encode_many(self, sources: Sequence[Source], density: float, mode: str,
                    selection: str, names: Sequence[str], layout_crc: Optional[int] = None):
        """Every update of a sync at once, in a number of tensor ops and host reads that does
        not grow with the number of tensors, framed by its ``frame(layout_crc, capacity)``
        (``layout_crc`` given here lets the step header travel with the encoder's own upload),
        or None when this backend encodes tensor by tensor or these sources do not qualify.
        Nothing is written when it returns None. It may raise :class:`NonFiniteError` with
        ``encoded``, the encodings of the tensors before the one named (what
        :meth:`encode_tensor` one by one would have left: those formed, that one put back)."""
        return None

    def subtract_sent(self, a: torch.Tensor, pos: torch.Tensor, sent: torch.Tensor) -> None:
        """Error feedback: ``a[pos] -= sent`` (positions are unique)."""
        if pos.numel():
            a.index_add_(0, pos, sent, alpha=-1)

    @abc.abstractmethod
    def decode_many(self, jobs: Sequence[DecodeJob]) -> List[Optional[BaseException]]:
        """Decode every job (each its own verdict: ``None`` when its targets received the sums,
        else the :class:`horovod_sbc.wire.PeerError` or ``ValueError`` to raise for it, its
        targets untouched)."""

    def decode(self, gathered: torch.Tensor, layout, n_ranks: int, targets: Targets,
               scale: float = 1.0) -> Tuple[Optional[torch.Tensor], ...]:
        """Decode one gathered step into ``targets`` and return ``targets.outs``; raises
        :class:`horovod_sbc.wire.PeerError` for a rank's ERROR/SKIP and ``ValueError`` for
        anything malformed, with nothing written."""
        err = self.decode_many([DecodeJob(gathered, layout, n_ranks, targets, scale)])[0]
        if err is not None:
            raise err
        return targets.outs

    def __repr__(self) -> str:
        return f"<{self.name} backend>"
