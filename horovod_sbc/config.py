"""What an SBC compressor is configured with — one validated, framework-free record.

Both adapters build their state objects on :class:`SBCConfig` (``horovod_sbc.torch.SBC``,
``horovod_sbc.tensorflow.SBC``), so a knob means the same and is checked the same way everywhere.
The baselines of the torch adapter (top-k, FedAvg, signSGD, TernGrad) are presets of this one
configuration (the compressors of :mod:`horovod_sbc.registry`), not separate classes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

from . import registry


NONFINITE = ("raise", "skip")
TOPOLOGIES = ("allgather", "server", "reduce_scatter")
#: ``freeze_variance_after`` (torch and TF): the frozen second moment is raised to this fraction
#: of its tensor's mean, so a coordinate whose gradient was (almost) zero through the warm-up
#: cannot divide a later gradient by ``eps`` alone; its steps stay within ``1 / sqrt(floor)``
#: (about 32x) of a typical coordinate's at the same gradient
ADAM_VARIANCE_FLOOR = 1e-3
#: the key of the drop-in's state in ``optimizer.state_dict()`` (torch)
OPTIMIZER_STATE_KEY = "horovod_sbc"


def validate_density(density) -> float:
    try:
        d = float(density)
    except (TypeError, ValueError):
        raise ValueError(f"density must be a number in (0, 1], got {density!r}") from None
    if not (0.0 < d <= 1.0):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return d


SELECTIONS = ("paper", "magnitude")


def validate_selection(selection) -> str:
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    return selection


def check_number(what: str, value, low: float, high: float, low_open: bool = False) -> float:
    """``value`` as a float in ``[low, high]`` (``(low, high]`` with ``low_open``), else a
    ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    v = float(value)
    if not (low < v if low_open else low <= v) or not v <= high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{what} must be in {bracket}{low}, {high}], got {value!r}")
    return v


def resolve_outer(outer, plain: type, module: str):
    """An outer step: ``None`` -> ``plain()``; an instance of ``plain`` (or of a subclass)
    as is; anything else a ValueError naming ``module``'s outer steps."""
    if outer is None:
        return plain()
    if not isinstance(outer, plain):
        raise ValueError(f"outer must be {module}.Plain(), Nesterov(...) or ErrorDecay(...), "
                         f"got {outer!r}")
    return outer


def validate_delay(delay) -> int:
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 1:
        raise ValueError(f"delay must be an integer >= 1, got {delay!r}")
    return delay


def validate_nonfinite(nonfinite) -> str:
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
    return nonfinite


@dataclass(frozen=True)
class SBCConfig:
    """The knobs of SBC and of its baselines, documented here once for both adapters.

    density: the paper's *p*, in (0, 1]. With the default ``selection="paper"`` each rank sends
        ``k = round(p * numel)`` positions per tensor (at least 1; fewer only when the winning
        sign has fewer than k entries), so ``stats()["positions_sent"] /
        stats()["elements_synced"]`` is about p; about 8 bits per position after Golomb coding.
        With error feedback lower densities usually still converge; the paper goes down to
        0.001-0.0001 combined with ``delay``.
    delay: the paper's *n*, communication delay: every rank runs ``delay`` local optimizer steps,
        then the accumulated weight update is compressed and exchanged (the weight exchange of
        :func:`horovod_sbc.policy.choose`: the torch drop-in, stock ``hvd.DistributedOptimizer``
        once it has found the optimizer, TF's ``DistributedGradientTape`` with ``SBC.step`` or
        ``SBCCallback``). TF's stock tape exchanges gradients: there it must be 1.
    mode: the compressor, by its registered name (:mod:`horovod_sbc.registry`; one file each
        in ``horovod_sbc/compressors/``): ``"sbc"`` (positions and one mean),
        ``"values"`` (top-k: the kept entries' own float32 values, ~32 more bits per position),
        ``"sign"`` (error-feedback signSGD, Karimireddy et al. 2019: every element's sign and one
        scale), ``"terngrad"`` (stochastic ternary, Wen et al. 2017, with error feedback).
    selection: SBC's candidate sets. ``"paper"`` (the SBC paper's Algorithm 1): the k largest
        positive and the k most negative entries; the side with the larger mean is sent.
        ``"magnitude"``: the top-k by magnitude split by sign (the side sent then has only about
        half of k positions). Binarized SBC only; top-k always ranks magnitudes.
    nonfinite: an update holding NaN/Inf. ``"raise"``: every rank raises ``ValueError`` naming
        the rank and the tensor. ``"skip"``: every rank skips the sync (a warning names the
        tensor); the shared weights stay as they were, healthy ranks keep their update in the
        residual, and the failing rank drops its non-finite part (see each adapter for what
        that means where the update is used up before it is found non-finite).
    topology: ``"allgather"``: every rank receives every rank's message (download grows with the
        number of workers). ``"server"``: rank 0 gathers, averages, compresses the average again
        with its own residual at ``downlink_density`` and broadcasts one message (Zou et al.,
        arXiv 2209.15203), so download stays flat in the number of workers.
        ``"reduce_scatter"``: a sparse reduce-scatter (Li & Hoefler's Ok-Topk, arXiv 2201.07598,
        with the server's re-compression): rank r owns the r-th of N equal index regions of the
        model, receives every rank's part of it in one alltoall, averages it, compresses the
        average again with its own residual, and every rank allgathers and decodes the N region
        messages: upload per rank stays about one message, download and decode about two
        messages' worth, at any N.
    downlink_density: the re-compressed average's fraction of positions (``"server"``:
        ``None`` is a dense downlink; ``"reduce_scatter"``: ``None`` is ``density``).
    downlink_binarize: the re-compressed average is binarized like SBC instead of sending
        values (``None``: ``"server"`` sends values, ``"reduce_scatter"`` does what the
        uplink's ``mode`` does).
    seed: TernGrad's random stream (``seed`` and the rank); its state is checkpointed.
    fixed_size: every step message of a tensor layout is padded to one capacity known from the
        layout, ``density`` and ``mode`` (the PADDED step messages of :mod:`horovod_sbc.wire`),
        so the allgathered tensor has the same shape at every step: Horovod's response cache
        then hits instead of negotiating every step, NCCL can use ``ncclAllGather`` instead of
        one broadcast per rank, and a device encoder never reads a message length on the host
        (the stock hook's ``compress()`` then reads no device data at all on the tensor-op
        path). The cost is the padding between the streams' worst-case bound and their actual
        length, counted in ``stats()["upstream_bits"]`` and separately in
        ``stats()["padding_bits"]`` (docs/benchmarks.md measures both sides). The tensor
        messages are the same bytes either way. ``topology="allgather"`` only. ``None`` (the
        default) lets the collective decide: padded where it needs one size from every rank
        anyway (the DDP hook and model averager: ``torch.distributed``'s all-gather, where
        variable messages would be padded to the longest rank's after an extra exchange of the
        lengths and a host read of them), variable over Horovod's allgather.

    Each adapter adds its own knobs (torch: ``named_parameters``, ``momentum``; TF:
    ``local_residual``, ``name``) and says which of these it supports.
    """
    density: float = 0.01
    delay: int = 1
    mode: str = "sbc"
    selection: str = "paper"
    nonfinite: str = "raise"
    topology: str = "allgather"
    downlink_density: Optional[float] = None
    downlink_binarize: Optional[bool] = None
    seed: int = field(default=0)
    fixed_size: Optional[bool] = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("density", validate_density(self.density))
        set_("delay", validate_delay(self.delay))
        registry.get(self.mode)  # ValueError naming the registered compressors
        set_("selection", validate_selection(self.selection))
        set_("nonfinite", validate_nonfinite(self.nonfinite))
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {', '.join(map(repr, TOPOLOGIES))}, "
                             f"got {self.topology!r}")
        for knob in ("downlink_density", "downlink_binarize"):
            if getattr(self, knob) is not None and self.topology == "allgather":
                raise ValueError(f"{knob} applies to topology='server' or 'reduce_scatter' "
                                 "(the allgather has no downlink message)")
        if self.downlink_density is not None:
            set_("downlink_density", validate_density(self.downlink_density))
        if self.downlink_binarize is not None:
            set_("downlink_binarize", bool(self.downlink_binarize))
        set_("seed", int(self.seed))
        if self.fixed_size is not None and not isinstance(self.fixed_size, bool):
            raise ValueError(f"fixed_size must be True, False or None, got "
                             f"{self.fixed_size!r}")
        if self.fixed_size and self.topology != "allgather":
            raise ValueError("fixed_size applies to topology='allgather' (the server's "
                             "messages are not padded)")

    @property
    def binarize(self) -> bool:
        """One mean per tensor (SBC) rather than per-position values."""
        return registry.get(self.mode).binarize

    @property
    def downlink_mode(self) -> str:
        """The re-compressed average's compressor: ``"sbc"`` (binarized) or ``"values"``
        (``downlink_binarize``; None: ``"server"`` sends values, ``"reduce_scatter"`` does
        what the uplink's ``mode`` does)."""
        binarize = self.downlink_binarize
        if binarize is None:
            binarize = self.topology == "reduce_scatter" and registry.get(self.mode).binarize
        return "sbc" if binarize else "values"

    @property
    def downlink_fraction(self) -> Optional[float]:
        """The re-compressed average's fraction of positions: ``downlink_density``, or when
        it is None the uplink's ``density`` (``"reduce_scatter"``) or a dense downlink
        (``"server"``: None)."""
        if self.downlink_density is None and self.topology == "reduce_scatter":
            return self.density
        return self.downlink_density

    def padded(self, collective_needs_equal_sizes: bool = False) -> bool:
        """Whether step messages are padded to their layout's capacity (``fixed_size``, or
        when it is ``None`` whether the collective needs equal sizes)."""
        return collective_needs_equal_sizes if self.fixed_size is None else self.fixed_size

    def record(self) -> Dict[str, Any]:
        """The knobs as a plain dict (stored with the residual state in checkpoints)."""
        return asdict(self)


def resolve_compression(cls, compression, what: str = "SBC", density=None):
    """The adapters' shared argument rule: ``compression`` (an instance of ``cls``; None:
    ``cls()``), or for the DDP state a ``density`` that builds ``cls(density)``, not both."""
    if compression is None:
        return cls() if density is None else cls(density=density)
    if density is not None:
        raise ValueError("give density either in SBC(...) or as an argument, not both")
    if not isinstance(compression, cls):
        raise TypeError(f"compression must be {what} (or a subclass), "
                        f"got {type(compression).__name__}")
    return compression
