"""What an SBC compressor is configured with — one validated, framework-free record.

Both adapters build their state objects on :class:`SBCConfig` (``horovod_sbc.torch.SBC``,
``horovod_sbc.tensorflow.SBC``), so a knob means the same and is checked the same way everywhere.
The baselines of the torch adapter (top-k, FedAvg, signSGD, TernGrad) are presets of this one
configuration (the compressors of :mod:`horovod_sbc.registry`), not separate classes.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

from . import registry


NONFINITE = ("raise", "skip")
#: the outer steps of :mod:`horovod_sbc.outer`, by their ``kind``
OUTER_KINDS = ("plain", "nesterov", "error_decay")
#: the knobs of training with SBC (below the codec's in :class:`SBCConfig`)
TRAINING_KNOBS = ("momentum", "hierarchy", "local_residual", "outer", "freeze_variance_after")
TOPOLOGIES = ("allgather", "server", "reduce_scatter")
#: the reduce-scatter owners' default downlink density, as a multiple of the uplink's ``density``
RS_DOWNLINK_FACTOR = 4
#: ``freeze_variance_after`` (torch and TF): the frozen second moment is raised to this fraction
#: of its tensor's mean, so a coordinate whose gradient was (almost) zero through the warm-up
#: cannot divide a later gradient by ``eps`` alone; its steps stay within ``1 / sqrt(floor)``
#: (about 32x) of a typical coordinate's at the same gradient
ADAM_VARIANCE_FLOOR = 1e-3
#: what the stock hooks give Horovod's allreduce per gradient and step while SBC's messages
#: travel by allgather: one element of this dtype (Horovod's optimizer and tape allreduce whatever
#: ``compress()`` returns; float16 is the narrowest dtype Horovod averages), counted in
#: ``stats()["upstream_bits"]``
PLACEHOLDER_DTYPE = "float16"
PLACEHOLDER_BITS = 16
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


def validate_freeze(freeze):
    """``freeze_variance_after``: ``"auto"``, None or a step count >= 1."""
    if freeze is None or (isinstance(freeze, str) and freeze == "auto"):
        return freeze
    if isinstance(freeze, bool) or not isinstance(freeze, int) or freeze < 1:
        raise ValueError(f"freeze_variance_after must be 'auto', None or an int >= 1, got "
                         f"{freeze!r}")
    return freeze


def describe_hierarchy(spec) -> str:
    """``SBC(hierarchy=...)`` as the user wrote it (groups as lists)."""
    if isinstance(spec, tuple):
        spec = [list(g) for g in spec]
    return f"SBC(hierarchy={spec!r})"


def validate_hierarchy(spec):
    """``hierarchy``: None (flat), ``"node"`` (Horovod's nodes) or a grouping of global ranks
    such as ``[[0, 1], [2, 3]]``, returned as sorted tuples. Checks what can be checked without
    a job (the adapters check the grouping against the job)."""
    if spec is None or (isinstance(spec, str) and spec == "node"):
        return spec
    what = describe_hierarchy(spec)
    if isinstance(spec, (str, bytes)) or not hasattr(spec, "__iter__"):
        raise ValueError(f"{what}: give None, 'node' or a list of groups of ranks such as "
                         "[[0, 1], [2, 3]]")
    groups = []
    for g in spec:
        if isinstance(g, (str, bytes)) or not hasattr(g, "__iter__"):
            raise ValueError(f"{what}: every group must be a list of ranks, got {g!r}")
        g = list(g)
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in g):
            raise ValueError(f"{what}: ranks must be integers >= 0, got group {g!r}")
        groups.append(tuple(sorted(g)))
    seen = set()
    for g in groups:
        for r in g:
            if r in seen:
                raise ValueError(f"{what}: rank {r} is in more than one group")
            seen.add(r)
    return tuple(sorted(groups))


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
        ``SBCCallback``, TF's stock tape given ``SBC(optimizer=opt)``; without it TF's stock tape
        exchanges gradients and ``delay`` must be 1).
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
        ``None`` is a dense downlink; ``"reduce_scatter"``: ``None`` is
        ``RS_DOWNLINK_FACTOR`` (4) x ``density``, at most 1: an owner's region sums N parts,
        whose positions mostly differ, and at 1x the re-compression loses 9-11 % perplexity
        on the transformer study, at 4x 0.3-1.5 %; docs/topologies.md).
    downlink_mode: the re-compressed average's compressor, a registered ``mode`` name
        (:mod:`horovod_sbc.registry`): ``"sbc"`` binarized, ``"values"`` top-k with float32
        values, ``"stc"`` ternary (both signs, one more bit per position), or one you
        register. ``None``: ``"server"`` sends values; ``"reduce_scatter"`` sends ``"stc"``
        when the uplink's ``mode`` is binarized (two signs lose less of a sum than one side),
        else ``"values"``. ``downlink_binarize`` (True / False) is its deprecated older
        spelling (``"sbc"`` / ``"values"``).
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

    The knobs of training with SBC, the same in both frameworks, each applying where
    :func:`horovod_sbc.policy.choose` says what the optimizer's steps exchange (where one does
    not apply, passing it raises ValueError there):

    momentum: removed. SGD's momentum is the user's optimizer's own, on every rank, in the
        weight exchange (:func:`horovod_sbc.policy.choose`); passing it raises ValueError.
    hierarchy: None (flat), ``"node"`` (Horovod's nodes) or groups of global ranks such as
        ``[[0, 1], [2, 3]]``: a dense reduce inside each node, SBC with error feedback between
        nodes (docs/topologies.md). The drop-in (weight exchange).
    local_residual: the weight exchange: True, every rank continues from the shared weights
        plus its own unsent residual (momentum and Adam see their own steps at once; ranks'
        weights differ by their residuals until ``finish``); False, every rank continues from
        the shared weights, bit-identical after every sync. None (default): True
        (:func:`horovod_sbc.policy.choose`).
    outer: the weight exchange: the outer step that turns each sync's average into the change
        of the shared weights (:mod:`horovod_sbc.outer`: ``Plain``, ``Nesterov``,
        ``ErrorDecay``). None (default): :func:`horovod_sbc.policy.outer_step`: ``Plain()``;
        ``Nesterov(1.0, 0.5)`` for Adam/AdamW with a delay and the residual in the weights;
        ``Plain(lr=sqrt(N))`` for other adaptive optimizers at delay 1.
    freeze_variance_after: the weight exchange with Adam/AdamW/RMSprop: when every rank's second
        moment is frozen so that its steps are linear in the gradients (1-bit Adam, arXiv
        2102.02888).
        ``"auto"`` (default): :func:`horovod_sbc.policy.auto_freeze_step`, from the run's
        learning-rate warm-up; K: after K steps; None: never. A number with another optimizer
        is an error.

    Each adapter adds what its framework needs (torch: ``named_parameters``; TF: ``optimizer``,
    ``name``).
    """
    density: float = 0.01
    delay: int = 1
    mode: str = "sbc"
    selection: str = "paper"
    nonfinite: str = "raise"
    topology: str = "allgather"
    downlink_density: Optional[float] = None
    downlink_mode: Optional[str] = None
    downlink_binarize: Optional[bool] = None
    seed: int = field(default=0)
    fixed_size: Optional[bool] = None
    momentum: Optional[str] = None
    hierarchy: Any = None
    local_residual: Optional[bool] = None
    outer: Any = None
    freeze_variance_after: Any = "auto"

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
        for knob in ("downlink_density", "downlink_mode", "downlink_binarize"):
            if getattr(self, knob) is not None and self.topology == "allgather":
                raise ValueError(f"{knob} applies to topology='server' or 'reduce_scatter' "
                                 "(the allgather has no downlink message)")
        if self.downlink_density is not None:
            set_("downlink_density", validate_density(self.downlink_density))
        if self.downlink_binarize is not None:
            said = "sbc" if self.downlink_binarize else "values"
            if self.downlink_mode is not None:
                raise ValueError(f"give downlink_mode={self.downlink_mode!r} alone: "
                                 f"downlink_binarize is its older spelling")
            warnings.warn(f"SBC(downlink_binarize={bool(self.downlink_binarize)}) is deprecated: "
                          f"use downlink_mode={said!r}", DeprecationWarning, stacklevel=4)
            set_("downlink_mode", said)
            set_("downlink_binarize", None)
        if self.downlink_mode is not None:
            registry.get(self.downlink_mode)  # ValueError naming the registered compressors
        set_("seed", int(self.seed))
        if self.fixed_size is not None and not isinstance(self.fixed_size, bool):
            raise ValueError(f"fixed_size must be True, False or None, got "
                             f"{self.fixed_size!r}")
        if self.fixed_size and self.topology != "allgather":
            raise ValueError("fixed_size applies to topology='allgather' (the server's "
                             "messages are not padded)")
        if self.momentum is not None:
            raise ValueError(
                f"SBC(momentum={self.momentum!r}) was removed: every optimizer now exchanges "
                "weight changes and SGD's momentum is your optimizer's own (the momentum fold "
                "and DGC's masking trained worse on the task matrix, docs/recipes.md); leave "
                "momentum= out")
        set_("hierarchy", validate_hierarchy(self.hierarchy))
        if self.hierarchy is not None and self.topology == "server":
            raise ValueError(f"{describe_hierarchy(self.hierarchy)} cannot be combined with "
                             "topology='server': the cross-node exchange is an allgather or a "
                             "reduce-scatter")
        if self.local_residual is not None and not isinstance(self.local_residual, bool):
            raise ValueError(f"local_residual must be None, True or False, got "
                             f"{self.local_residual!r}")
        if self.outer is not None and getattr(self.outer, "kind", None) not in OUTER_KINDS:
            raise ValueError("outer must be None, horovod_sbc.outer.Plain(...), Nesterov(...) "
                             f"or ErrorDecay(...), got {self.outer!r}")
        validate_freeze(self.freeze_variance_after)

    @property
    def binarize(self) -> bool:
        """One mean per tensor (SBC) rather than per-position values."""
        return registry.get(self.mode).binarize

    @property
    def downlink_compressor(self) -> str:
        """The re-compressed average's compressor: ``downlink_mode``, or when it is None
        ``"stc"`` for the reduce-scatter of a binarized uplink, else ``"values"``."""
        if self.downlink_mode is not None:
            return self.downlink_mode
        binarize = self.topology == "reduce_scatter" and registry.get(self.mode).binarize
        return "stc" if binarize else "values"

    @property
    def downlink_fraction(self) -> Optional[float]:
        """The re-compressed average's fraction of positions: ``downlink_density``, or when
        it is None ``RS_DOWNLINK_FACTOR`` x the uplink's ``density``, at most 1
        (``"reduce_scatter"``), or a dense downlink (``"server"``: None)."""
        if self.downlink_density is None and self.topology == "reduce_scatter":
            return min(1.0, RS_DOWNLINK_FACTOR * self.density)
        return self.downlink_density

    def padded(self, collective_needs_equal_sizes: bool = False) -> bool:
        """Whether step messages are padded to their layout's capacity (``fixed_size``, or
        when it is ``None`` whether the collective needs equal sizes)."""
        return collective_needs_equal_sizes if self.fixed_size is None else self.fixed_size

    def record(self) -> Dict[str, Any]:
        """The codec's knobs as a plain dict (stored with the residual state in checkpoints)."""
        out = asdict(self)
        for knob in TRAINING_KNOBS:
            out.pop(knob)
        return out


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
