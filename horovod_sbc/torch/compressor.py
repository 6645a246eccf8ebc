"""``SBC``: the state object of SBC for PyTorch (like PyTorch's ``PowerSGDState``).

It holds the validated knobs (:class:`horovod_sbc.config.SBCConfig`), the
:class:`~horovod_sbc.residual.ResidualManager` (residuals, reference weights, counters) and the
transport. What it does lives beside it, one concern per module:

* :mod:`horovod_sbc.torch.sync` — one fused sync of many tensors (drop-in optimizer, DDP hook
  and averager), and the ``"server"`` topology;
* :mod:`horovod_sbc.torch.hook` — ``compress()``/``decompress()`` for stock
  ``hvd.DistributedOptimizer`` (mixed into :class:`SBC`);
* :mod:`horovod_sbc.torch.codec` / :mod:`horovod_sbc.torch.exchange` — encoding and decoding.

The baselines (:func:`TopK`, :func:`FedAvg`, :func:`SignSGD`, :func:`TernGrad`) are presets of
the same configuration.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..config import SBCConfig
from ..residual import ResidualManager
from . import codec, exchange, sync
from .hook import StockHook


def _residual_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp16/bf16 updates are accumulated in fp32 (small updates would vanish in 16 bits)
    return torch.float64 if dtype == torch.float64 else torch.float32


class SBC(StockHook):
    r"""Sparse Binary Compression (Sattler et al., "Sparse Binary Compression: Towards Distributed
    Deep Learning with minimal Communication", arXiv 1805.08768).

    Each rank sends, per tensor, the positions of the ``density`` fraction of its largest positive
    or of its most negative residual-corrected update entries, whichever side has the larger mean
    (Golomb-Rice coded), and one float: that mean. What is not sent stays in a residual and is added next time (error
    feedback), so nothing is lost, only delayed. Messages travel by ``allgather``; every rank
    decodes all of them and averages, so all ranks apply bit-identical updates.

    Args:
        density: the paper's *p*, in (0, 1]: with the default ``selection="paper"`` each rank
            sends ``k = round(p * numel)`` positions per tensor (at least 1; fewer only when the
            winning sign has fewer than k entries), so ``stats()["positions_sent"] /
            stats()["elements_synced"]`` is about p. 0.01 sends 1 %; about 8 bits per position
            after Golomb coding. Lower is smaller and, with error feedback, usually
            still converges; the paper goes down to 0.001-0.0001 combined with ``delay``.
        delay: the paper's *n*, communication delay: every rank runs ``delay`` local optimizer
            steps, then the accumulated weight update is compressed and exchanged. Only the
            drop-in :func:`horovod_sbc.torch.DistributedOptimizer` can delay; with stock
            ``hvd.DistributedOptimizer`` it must be 1 (gradients are compressed every step).
        binarize: True (SBC) sends one mean per tensor; False sends the kept entries' own float32
            values (top-k sparsification with error feedback, ~32 more bits per position).
        selection: ``"paper"`` (default; SBC paper's Algorithm 1): the top-k positive and the
            top-k negative entries are the two candidate sides. ``"magnitude"``: the top-k by
            magnitude split by sign (the side sent then has only ~0.5-0.65 k positions, so the
            effective density is about half of ``density``). Binarized SBC only.
        topology: ``"allgather"`` (default): every rank receives every rank's message, so the
            download per rank grows with the number of workers. ``"server"``: rank 0 gathers the
            messages, averages, compresses the average again with its own residual at
            ``downlink_density`` and broadcasts one message (Zou et al., arXiv 2209.15203);
            downlink bytes then stay flat in the number of workers. Needs Horovod's MPI
            controller (``horovodrun --mpi``, ``mpirun``) and the drop-in optimizer.
        downlink_density: fraction kept by the server's top-k of the average (``"server"`` only);
            ``None`` sends the average dense (32 bits per element), for comparison.
        downlink_binarize: binarize the downlink like SBC (one mean) instead of sending the kept
            values (plain top-k, as in the paper).
        nonfinite: what to do when an update holds NaN/Inf. ``"raise"``: every rank raises
            ``ValueError`` naming the rank and parameter. ``"skip"``: every rank skips the sync
            (a warning names the parameter); the shared weights stay as they were, healthy
            ranks keep their update in the residual, the failing rank drops its non-finite one
            (where the update is used up by the time it is found non-finite, the rest of it
            stays and only its non-finite entries restart: the drop-in with
            ``local_residual=True``, whose residual lives in the weights, resets them to the
            shared weights; the stock hook, whose gradient the selection's pass zeroes, resets
            those residual entries to 0).
        named_parameters: optional ``model.named_parameters()``. Stock Horovod passes no name to
            ``compress()``; these names are looked up first, then the name Horovod's optimizer
            that called gives the parameter (see :mod:`horovod_sbc.torch.hook`).
        mode: what a tensor message carries (:data:`horovod_sbc.config.MODES`): ``"sbc"``
            (default), ``"values"`` (top-k), ``"sign"`` (signSGD), ``"terngrad"``; the
            baselines :func:`TopK`, :func:`FedAvg`, :func:`SignSGD`, :func:`TernGrad` are presets.
            ``binarize=False`` is ``mode="values"``.
        seed: TernGrad's random stream (``seed`` and the rank); its state is checkpointed.
        momentum_masking: stock ``hvd.DistributedOptimizer`` only (the drop-in keeps the
            residual in the local weights instead, see :mod:`horovod_sbc.torch.optimizer`).
            There the optimizer's momentum acts on the averaged sparse update ("global"
            momentum): a coordinate arrives only every ~1/p steps, in one burst holding all its
            delayed gradient, and the momentum buffer then replays that burst for ~1/(1-m) more
            steps on top of the stale velocity it already had. True (default for SBC; False for
            :func:`TopK`, whose exact values need their momentum): DGC's momentum factor masking
            (Lin et al., ICLR 2018) on the global buffer — where the averaged update is
            non-zero, the owner optimizer's SGD ``momentum_buffer`` is zeroed just before its
            step (:func:`horovod_sbc.torch.hook.momentum_buffer`). It helps (mnist1d, 4 workers,
            SGD momentum 0.9, p = 0.1, 500 steps: 41.2 % -> 56.3 %; dense 84.7 %) but the stock
            path with momentum stays behind the drop-in optimizer: after 1,500 steps 90.7 %
            (p = 0.01) and 86.9 % (p = 0.1) against 94.5 % dense and 86.1 % for no
            communication, after 500 steps below no communication (docs/benchmarks.md §0);
            the hook warns once when the optimizer has momentum.

    Attribute ``transport``: the collective :meth:`exchange` gathers step messages with;
    :class:`~horovod_sbc.torch.exchange.HorovodTransport` by default. The DDP hook and averager
    (:mod:`horovod_sbc.torch.ddp`) set a
    :class:`~horovod_sbc.torch.exchange.ProcessGroupTransport` (``torch.distributed``).
    """

    def __init__(self, density: float = 0.01, delay: int = 1, binarize: bool = True,
                 nonfinite: str = "raise", named_parameters=None, topology: str = "allgather",
                 downlink_density: Optional[float] = None, downlink_binarize: bool = False,
                 selection: str = "paper", mode: Optional[str] = None, seed: int = 0,
                 momentum_masking: bool = True):
        if mode is None:
            mode = "sbc" if binarize else "values"
        elif not binarize and mode == "sbc":
            raise ValueError("binarize=False contradicts mode='sbc'; give one of them")
        self.config = SBCConfig(density=density, delay=delay, mode=mode, selection=selection,
                                nonfinite=nonfinite, topology=topology,
                                downlink_density=downlink_density,
                                downlink_binarize=downlink_binarize, seed=seed)
        self.manager = ResidualManager()
        self.manager.config.update(self.config.record())
        self._named = list(named_parameters) if named_parameters is not None else None
        self.transport = exchange.HorovodTransport()
        self._gen: Optional[torch.Generator] = None
        self._saved_gen = None
        self._positions: Dict[str, codec.PositionBuffer] = {}  # reused per tensor (CPU)
        self._calls: Dict[str, int] = {}  # compress() calls per tensor (stock path)
        self._max_calls = 0
        if not isinstance(momentum_masking, bool):
            raise ValueError(f"momentum_masking must be True or False, got {momentum_masking!r}")
        self.momentum_masking = momentum_masking
        self._warned_momentum = False

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
        st = self.manager.state_dict()
        if self._gen is not None:
            st["generator"] = self._gen.get_state()
        return st

    def load_state_dict(self, state) -> None:
        """Restore residuals and counters. Residuals are per rank: loading a checkpoint written
        by another rank or by a job of another size raises ValueError (a changed ``density`` is
        fine: the residual is still the update mass not sent yet)."""
        try:
            self.world()  # record this job's size and rank to compare with the checkpoint's
        except (RuntimeError, ImportError, ValueError):
            pass

        def copy(dst, src):
            if dst is not None and dst.shape == src.shape:
                return dst.copy_(src)
            return src.detach().clone()
        self.manager.load_state_dict(state, copy)
        self._saved_gen, self._gen = state.get("generator"), None

    def residual(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The flat residual of ``name`` (created as zeros shaped like ``like``)."""
        return self.manager.residual(
            name, lambda: torch.zeros(like.numel(), dtype=_residual_dtype(like.dtype),
                                      device=like.device))

    def position_buffer(self, name: str) -> "codec.PositionBuffer":
        """Where ``name``'s sent positions live between its encode and its error-feedback
        commit (reused every step: no fresh page-faulted tensor per tensor per step)."""
        buf = self._positions.get(name)
        if buf is None:
            buf = self._positions[name] = codec.PositionBuffer()
        return buf

    def world(self) -> Tuple[int, int]:
        """(size, rank) of the transport's job, recorded for checkpoint checks."""
        size, rank = self.transport.world()
        self.manager.config.update(world_size=size, rank=rank)
        return size, rank

    def generator(self, device) -> Optional[torch.Generator]:
        """TernGrad's random stream on ``device`` (None for the deterministic modes)."""
        if self.config.mode != "terngrad":
            return None
        if self._gen is None or self._gen.device != torch.device(device):
            _, rank = self.world()
            self._gen = torch.Generator(device=device)
            self._gen.manual_seed(self.config.seed + 1_000_003 * rank)
            saved, self._saved_gen = self._saved_gen, None
            if saved is not None:  # resume the random stream where the checkpoint left it
                self._gen.set_state(saved)
        return self._gen

    # -- one fused sync (the drop-in optimizer, the DDP hook and averager) ------------------
    def exchange(self, items, out: Optional[List[torch.Tensor]] = None, tag: str = "sbc.sync",
                 count_sync: bool = True, apply=None) -> Optional[List[torch.Tensor]]:
        """Compress, exchange (one fused message), decode and average a set of updates
        (:class:`horovod_sbc.torch.sync.Update` or ``(name, value, shape[, base])`` tuples);
        see :func:`horovod_sbc.torch.sync.synchronize` (``apply``: the outer step)."""
        return sync.synchronize(self, items, out, tag, count_sync, apply)


# -- baselines: presets of the same configuration -----------------------------------------------
def TopK(density: float = 0.01, delay: int = 1, nonfinite: str = "raise",
         named_parameters=None, **kw) -> SBC:
    """Top-k sparsification with error feedback (as in DGC / GRACE): the kept entries' own
    float32 values are sent, positions Golomb-Rice coded like SBC's (``SBC(mode="values")``).
    Takes ``topology="server"`` and ``downlink_density`` like :class:`SBC` (the setting of
    "Downlink Compression Improves TopK Sparsification", Zou, De Sterck, Liu; arXiv
    2209.15203). ``momentum_masking`` is off by default here: top-k sends exact values, and
    masking the global buffer would only remove the momentum they should get."""
    kw.setdefault("momentum_masking", False)
    return SBC(density=density, delay=delay, mode="values", nonfinite=nonfinite,
               named_parameters=named_parameters, **kw)


def FedAvg(delay: int = 4, nonfinite: str = "raise", named_parameters=None) -> SBC:
    """Communication delay alone (federated averaging / local SGD): every ``delay`` local steps
    the dense weight update is averaged (``SBC(density=1.0, mode="values", delay=n)``); needs
    the drop-in :func:`horovod_sbc.torch.DistributedOptimizer` for ``delay > 1``."""
    return SBC(density=1.0, delay=delay, mode="values", nonfinite=nonfinite,
               named_parameters=named_parameters)


def SignSGD(delay: int = 1, nonfinite: str = "raise", named_parameters=None) -> SBC:
    """Error-feedback signSGD (Karimireddy et al., "Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes", ICML 2019): every element is sent as ``sign(A) * mean(|A|)``,
    one bit per element plus one float per tensor; the difference stays in the residual."""
    return SBC(density=1.0, delay=delay, mode="sign", nonfinite=nonfinite,
               named_parameters=named_parameters)


def TernGrad(delay: int = 1, seed: int = 0, nonfinite: str = "raise",
             named_parameters=None) -> SBC:
    """TernGrad (Wen et al., NeurIPS 2017): each element is sent as ``max|A| * sign(A)`` with
    probability ``|A| / max|A|`` (unbiased stochastic ternarization), positions Golomb-Rice coded
    plus one sign bit each and one float per tensor; here with error feedback too, like every
    compressor of this package. ``seed`` (and the rank) seed the random stream, which is saved
    in ``state_dict()`` so a resumed run continues exactly."""
    return SBC(density=1.0, delay=delay, mode="terngrad", nonfinite=nonfinite,
               named_parameters=named_parameters, seed=seed)
