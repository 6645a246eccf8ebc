"""``SBC``: the state object of SBC for PyTorch (like PyTorch's ``PowerSGDState``).

It holds the validated knobs (:class:`horovod_sbc.config.SBCConfig`), the
:class:`~horovod_sbc.residual.ResidualManager` (residuals, reference weights, counters) and the
transport. What it does lives beside it, one concern per module:

* :mod:`horovod_sbc.torch.sync` — one fused sync of many tensors (drop-in optimizer, DDP hook
  and averager), and the ``"server"`` topology;
* :mod:`horovod_sbc.torch.hook` — ``compress()``/``decompress()`` for stock
  ``hvd.DistributedOptimizer`` (mixed into :class:`SBC`);
* :mod:`horovod_sbc.torch.backend` — encoding and decoding (one backend per device).

The baselines (:func:`TopK`, :func:`FedAvg`, :func:`SignSGD`, :func:`TernGrad`) are presets of
the same configuration.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..config import OPTIMIZER_STATE_KEY, SBCConfig
from . import sync
from .sync.transport import HorovodTransport
from .hook import StockHook
from .sync.state import SyncState


class SBC(StockHook):
    r"""Sparse Binary Compression (Sattler et al., "Sparse Binary Compression: Towards Distributed
    Deep Learning with minimal Communication", arXiv 1805.08768).

    Each rank sends, per tensor, the positions of the ``density`` fraction of its largest positive
    or of its most negative residual-corrected update entries, whichever side has the larger mean
    (Golomb-Rice coded), and one float: that mean. What is not sent stays in a residual and is
    added next time (error feedback), so nothing is lost, only delayed. Messages travel by
    ``allgather``; every rank decodes all of them and averages, so all ranks apply bit-identical
    updates.

    Args:
        density, delay: the paper's p and n, the two knobs to tune (docs/recipes.md).
        nonfinite, topology, downlink_density, downlink_mode, selection, mode, seed,
        fixed_size, momentum, hierarchy, local_residual, outer, freeze_variance_after: the
            knobs of :class:`horovod_sbc.config.SBCConfig`, documented there once and the same
            in TensorFlow; each applies where :func:`horovod_sbc.policy.choose` says (a knob
            that does not apply raises ValueError when the optimizer is known).
            ``topology="server"`` needs the drop-in
            :func:`horovod_sbc.torch.DistributedOptimizer` (and Horovod's MPI controller:
            ``horovodrun --mpi``, ``mpirun``); ``hierarchy`` an exchange of weight changes
            (the drop-in, or the stock hook where the policy chooses it).
        named_parameters: optional ``model.named_parameters()`` for stock Horovod, which passes
            no name to ``compress()``; these names are looked up first, then the name Horovod's
            optimizer gives the parameter (:mod:`horovod_sbc.torch.hook`). The drop-in takes
            them as its own argument.

    Attribute ``transport``: the collective :meth:`exchange` gathers step messages with;
    :class:`~horovod_sbc.torch.sync.transport.HorovodTransport` by default. The DDP hook and averager
    (:mod:`horovod_sbc.torch.ddp`) set a
    :class:`~horovod_sbc.torch.sync.transport.ProcessGroupTransport` (``torch.distributed``).
    """

    def __init__(self, density: float = 0.01, delay: int = 1, *, nonfinite: str = "raise",
                 topology: str = "allgather", downlink_density: Optional[float] = None,
                 downlink_mode: Optional[str] = None,
                 downlink_binarize: Optional[bool] = None, selection: str = "paper",
                 mode: str = "sbc", seed: int = 0, fixed_size: Optional[bool] = None,
                 momentum: Optional[str] = None, hierarchy=None,
                 local_residual: Optional[bool] = None, outer=None,
                 freeze_variance_after="auto", named_parameters=None):
        config = SBCConfig(density=density, delay=delay, mode=mode, selection=selection,
                           nonfinite=nonfinite, topology=topology,
                           downlink_density=downlink_density,
                           downlink_mode=downlink_mode, downlink_binarize=downlink_binarize,
                           seed=seed, fixed_size=fixed_size,
                           momentum=momentum, hierarchy=hierarchy, local_residual=local_residual,
                           outer=outer, freeze_variance_after=freeze_variance_after)
        self.hierarchy = config.hierarchy
        self.state = SyncState(config, HorovodTransport())
        StockHook.__init__(self, named_parameters)

    # -- the state the sync driver and the stock hook share --------------------------------
    manager = property(lambda self: self.state.manager)
    #: the knobs (:class:`horovod_sbc.config.SBCConfig`), held once, by the shared state
    config = property(lambda self: self.state.config,
                      lambda self, c: setattr(self.state, "config", c))
    transport = property(lambda self: self.state.transport,
                         lambda self, t: setattr(self.state, "transport", t))

    # -- the knobs, read-only views of the configuration --------------------------------------
    density = property(lambda self: self.config.density)
    delay = property(lambda self: self.config.delay)
    mode = property(lambda self: self.config.mode)
    binarize = property(lambda self: self.config.binarize)
    selection = property(lambda self: self.config.selection)
    nonfinite = property(lambda self: self.config.nonfinite)
    topology = property(lambda self: self.config.topology)
    downlink_density = property(lambda self: self.config.downlink_density)
    seed = property(lambda self: self.config.seed)
    fixed_size = property(lambda self: self.config.fixed_size)

    def __repr__(self) -> str:
        c = self.config
        extra = f", selection={c.selection!r}" if c.mode == "sbc" else ""
        return (f"SBC(density={c.density}, delay={c.delay}, mode={c.mode!r}{extra}, "
                f"nonfinite={c.nonfinite!r})")

    # -- statistics / state -----------------------------------------------------------------
    def stats(self) -> Dict[str, int]:
        """Cumulative figures of this rank: upstream_bits, downstream_bits, dense_bits, syncs,
        steps, positions_sent, elements_synced (see
        :meth:`horovod_sbc.residual.ResidualManager.stats`)."""
        return self.manager.stats()

    def state_dict(self):
        """This rank's residuals, reference weights, counters (and TernGrad's generator)."""
        return self.state.state_dict()

    def load_state_dict(self, state) -> None:
        """Restore residuals and counters. Residuals are per rank: loading a checkpoint written
        by another rank or by a job of another size raises ValueError (a changed ``density`` is
        fine: the residual is still the update mass not sent yet).

        Stock ``hvd.DistributedOptimizer`` with an optimizer whose steps exchange weight
        changes (Adam, ...: :func:`horovod_sbc.policy.choose`): pass the whole
        ``optimizer.state_dict()`` that was saved, after ``optimizer.load_state_dict()`` of the
        same; it is applied at the first ``step()`` (residuals, shared weights, counters, the
        variance freeze), as the drop-in's ``load_state_dict`` would."""
        if isinstance(state, dict) and OPTIMIZER_STATE_KEY in state:
            self._optimizer_state = state[OPTIMIZER_STATE_KEY]
            return
        self.state.load_state_dict(state)  # a checkpoint's "fold_guards" (before 0.x) is unread

    def take_optimizer_state(self):
        """The drop-in state :meth:`load_state_dict` was given for an optimizer not adopted
        yet (None if none); given once."""
        st, self._optimizer_state = getattr(self, "_optimizer_state", None), None
        return st

    def residual(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The flat residual of ``name`` (created as zeros shaped like ``like``)."""
        return self.state.residual(name, like)

    # -- one fused sync (the drop-in optimizer, the DDP hook and averager) ------------------
    def exchange(self, items, out: Optional[List[torch.Tensor]] = None, tag: str = "sbc.sync",
                 count_sync: bool = True, apply=None,
                 error=None) -> Optional[List[torch.Tensor]]:
        """Compress, exchange (one fused message), decode and average a set of updates
        (:class:`horovod_sbc.torch.sync.Update` or ``(name, value, shape[, base])`` tuples);
        see :func:`horovod_sbc.torch.sync.synchronize` (``apply``: the outer step; ``error``:
        ``(rank, reason)`` this rank already knows fails the sync)."""
        return sync.synchronize(self.state, items, out, tag, count_sync, apply, error)


# -- baselines: presets of the same configuration -----------------------------------------------
def TopK(density: float = 0.01, delay: int = 1, **kw) -> SBC:
    """Top-k sparsification with error feedback (as in DGC / GRACE): the kept entries' own
    float32 values are sent, positions Golomb-Rice coded like SBC's (``SBC(mode="values")``).
    Takes ``topology="server"`` and ``downlink_density`` like :class:`SBC` (the setting of
    "Downlink Compression Improves TopK Sparsification", Zou, De Sterck, Liu; arXiv
    2209.15203)."""
    return SBC(density=density, delay=delay, mode="values", **kw)


def FedAvg(delay: int = 4, **kw) -> SBC:
    """Communication delay alone (federated averaging / local SGD): every ``delay`` local steps
    the dense weight update is averaged (``SBC(density=1.0, mode="values", delay=n)``); needs
    the drop-in :func:`horovod_sbc.torch.DistributedOptimizer` for ``delay > 1``."""
    return SBC(density=1.0, delay=delay, mode="values", **kw)


def SignSGD(delay: int = 1, **kw) -> SBC:
    """Error-feedback signSGD (Karimireddy et al., "Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes", ICML 2019): every element is sent as ``sign(A) * mean(|A|)``,
    one bit per element plus one float per tensor; the difference stays in the residual."""
    return SBC(density=1.0, delay=delay, mode="sign", **kw)


def TernGrad(delay: int = 1, seed: int = 0, **kw) -> SBC:
    """TernGrad (Wen et al., NeurIPS 2017): each element is sent as ``max|A| * sign(A)`` with
    probability ``|A| / max|A|`` (unbiased stochastic ternarization), positions Golomb-Rice coded
    plus one sign bit each and one float per tensor; here with error feedback too, like every
    compressor of this package. ``seed`` (and the rank) seed the random stream, which is saved
    in ``state_dict()`` so a resumed run continues exactly."""
    return SBC(density=1.0, delay=delay, mode="terngrad", seed=seed, **kw)
