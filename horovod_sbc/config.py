"""What an SBC compressor is configured with — one validated, framework-free record.

Both adapters build their state objects on :class:`SBCConfig` (``horovod_sbc.torch.SBC``,
``horovod_sbc.tensorflow.SBC``), so a knob means the same and is checked the same way everywhere.
The baselines of the torch adapter (top-k, FedAvg, signSGD, TernGrad) are presets of this one
configuration (:data:`MODES`), not separate classes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional


#: what a tensor message carries (see :mod:`horovod_sbc.reference` and :mod:`horovod_sbc.wire`):
#: ``sbc`` positions + one mean (binarized); ``values`` top-k positions + their float32 values;
#: ``sign`` every element's sign + one scale (error-feedback signSGD); ``terngrad`` stochastic
#: ternary positions + signs + one scale.
MODES = ("sbc", "values", "sign", "terngrad")
NONFINITE = ("raise", "skip")
TOPOLOGIES = ("allgather", "server")


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
    """The knobs of SBC and of its baselines (each documented on ``horovod_sbc.torch.SBC``).

    density           the paper's p, in (0, 1]
    delay             the paper's n: local steps between syncs (>= 1)
    mode              one of :data:`MODES`
    selection         ``"paper"`` or ``"magnitude"`` (binarized SBC only)
    nonfinite         ``"raise"`` or ``"skip"``
    topology          ``"allgather"`` or ``"server"``
    downlink_density  the server's top-k fraction of the average (``None``: dense downlink)
    downlink_binarize the server binarizes its downlink like SBC
    seed              TernGrad's random stream (``seed + rank``)
    """
    density: float = 0.01
    delay: int = 1
    mode: str = "sbc"
    selection: str = "paper"
    nonfinite: str = "raise"
    topology: str = "allgather"
    downlink_density: Optional[float] = None
    downlink_binarize: bool = False
    seed: int = field(default=0)

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("density", validate_density(self.density))
        set_("delay", validate_delay(self.delay))
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        set_("selection", validate_selection(self.selection))
        set_("nonfinite", validate_nonfinite(self.nonfinite))
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be 'allgather' or 'server', got {self.topology!r}")
        if self.downlink_density is not None:
            if self.topology != "server":
                raise ValueError("downlink_density applies to topology='server' only")
            set_("downlink_density", validate_density(self.downlink_density))
        set_("downlink_binarize", bool(self.downlink_binarize))
        set_("seed", int(self.seed))

    @property
    def binarize(self) -> bool:
        """One mean per tensor (SBC) rather than per-position values."""
        return self.mode in ("sbc", "sign", "terngrad")

    @property
    def downlink_mode(self) -> str:
        return "sbc" if self.downlink_binarize else "values"

    def record(self) -> Dict[str, Any]:
        """The knobs as a plain dict (stored with the residual state in checkpoints)."""
        return asdict(self)


def resolve_compression(cls, compression, density=None, delay=None, what: str = "SBC"):
    """The adapters' shared argument rule: ``compression`` (an instance of ``cls``), or
    ``density``/``delay`` shorthands that build ``cls(...)``, but not both."""
    if compression is None:
        kw = {k: v for k, v in (("density", density), ("delay", delay)) if v is not None}
        return cls(**kw)
    if delay is not None or density is not None:
        raise ValueError("give delay/density either in SBC(...) or as arguments, not both")
    if not isinstance(compression, cls):
        raise TypeError(f"compression must be {what} (or a subclass), "
                        f"got {type(compression).__name__}")
    return compression
