"""``SBC`` for TensorFlow 2: the compressor, its knobs and the state it keeps (a ``tf.Module``).

One object holds the knobs and all per-tensor state as ``tf.Variable`` s, so
``tf.train.Checkpoint(..., sbc=sbc)`` saves and restores it and a resumed run continues exactly:
``residuals[name]`` (error feedback: what of ``R + dW`` was not sent yet; fp32, fp64 for fp64
variables), ``reference[name]`` (the weights all ranks agreed on at the last sync, weight mode),
``counters[key]`` (the figures of :meth:`SBC.stats`), ``local_steps`` (optimizer steps since the
last sync). ``name`` is the variable's Keras 3 path (``"sequential/dense/kernel"``) or a
``tf.Variable``'s name without ``":0"``; the dict-like stores are those of
:class:`horovod_sbc.residual.ResidualManager`, tracked by TensorFlow's checkpointing.

Three ways to use one ``SBC`` object (one at a time per object), one module each:

* **stock** — ``hvd.DistributedGradientTape(tape, compression=SBC(...))``: Horovod calls
  ``compress``/``decompress`` per gradient (:mod:`horovod_sbc.tensorflow.hook`); ``delay`` 1.
* **weights** — the drop-in, as the torch drop-in optimizer: ``delay`` local optimizer steps,
  then the weight change is exchanged; :meth:`SBC.step` after each optimizer step (the drop-in
  tape, :class:`horovod_sbc.tensorflow.SBCCallback`), :mod:`horovod_sbc.tensorflow.weights`.
* **gradients** — :meth:`SBC.exchange_gradients`: all gradients in one step message, one
  allgather, averaged gradients returned (:mod:`horovod_sbc.tensorflow.sync`).

What every mode shares (state checks, one exchange, the error-feedback commit) is
:class:`horovod_sbc.tensorflow.sync.state.SyncState`.
"""
from __future__ import annotations

from typing import Dict, Optional

import tensorflow as tf

from ..config import SBCConfig
from ..residual import COUNTER_KEYS, ResidualManager
from . import sync
from .hook import StockHook
from .momentum import Fold
from .outer import Plain, resolve_outer
from .owner import entries, tf_variable
from .sync.state import no_autograph, state_variable
from .weights import WeightMode

__all__ = ["SBC", "tf_variable"]  # tf_variable: defined in .owner, importable here as before


class SBC(StockHook, WeightMode, tf.Module):
    r"""Sparse Binary Compression (Sattler, Wiedemann, Müller, Samek, "Sparse Binary Compression:
    Towards Distributed Deep Learning with minimal Communication", arXiv 1805.08768).

    Each rank sends, per tensor, the positions of the ``density`` fraction of its largest positive
    or of its most negative residual-corrected update entries, whichever side has the larger mean
    (Golomb-Rice coded), and one float: that mean (``selection="paper"``, the default). What is
    not sent stays in a residual and is added next time (error feedback), so nothing is lost,
    only delayed. Messages travel by ``horovod.tensorflow.allgather``; every rank decodes all of
    them and averages, so all ranks apply bit-identical updates. Encoding and decoding run as
    TensorFlow ops on the tensors' device, in eager mode and inside ``tf.function``; the bytes
    are those of ``horovod_sbc/wire.py``, identical to the numpy reference's and the PyTorch
    adapter's.

    Args:
        density, delay, nonfinite, selection: the knobs of
            :class:`horovod_sbc.config.SBCConfig`, documented there once. Here ``delay > 1``
            needs weight mode: :func:`horovod_sbc.tensorflow.DistributedGradientTape` plus
            :meth:`step`, or :class:`horovod_sbc.tensorflow.SBCCallback`. With
            ``nonfinite="skip"`` in weight mode the weights go back to the last shared state;
            in gradient modes the returned gradients are zeros for that step. Inside
            ``tf.function`` a ``ValueError`` arrives as ``tf.errors.InvalidArgumentError`` with
            the same text.
        mode, seed: the compressor (any registered one: ``"sbc"``, ``"values"``, ``"sign"``,
            ``"terngrad"``, or your own, see :mod:`horovod_sbc.registry`) and the seed of a
            random one's draws, as in :class:`horovod_sbc.config.SBCConfig`. TernGrad's draws
            are ``tf.random.stateless_uniform`` of (``seed``, rank, sync count, tensor), so a
            resumed run draws what it would have drawn.
        fixed_size: every step message padded to the capacity of its layout, as in
            :class:`horovod_sbc.config.SBCConfig` (the allgather then has one shape every step;
            ``stats()["padding_bits"]`` counts the padding); ``None``, the default, is variable
            here (Horovod's allgather takes any sizes).
        topology, downlink_density, downlink_binarize: the exchange, as in
            :class:`horovod_sbc.config.SBCConfig` and torch (docs/topologies.md):
            ``"allgather"`` (default), ``"reduce_scatter"`` (Horovod's alltoall, then an
            allgather of the owners' region messages; the same bytes and collective names as
            torch, :mod:`horovod_sbc.tensorflow.sync.scatter`) or ``"server"`` (rank 0 gathers
            and broadcasts through mpi4py: the MPI controller only,
            :mod:`horovod_sbc.tensorflow.sync.server`). Every mode takes them but the stock tape,
            which refuses ``"server"``. The downlink residuals are ``server_residuals`` (saved
            with this module). The hierarchy and DGC's momentum masking are torch-only (the
            momentum fold is here: ``optimizer`` for the stock tape, ``local_residual`` for
            weight mode).
        local_residual: weight mode only (:meth:`step`: the drop-in tape,
            :class:`SBCCallback`). True: after a sync every rank continues from the shared
            weights plus its own unsent residual, so momentum and Adam see the effect of their
            own steps at once; ranks' weights then differ by their residuals until
            :meth:`finish`. False: every rank continues from the shared weights, bit-identical
            after every sync. None (the default) chooses as the torch drop-in does
            (:mod:`horovod_sbc.torch.optimizer`): False for ``keras.optimizers.SGD`` at
            ``delay=1``, whose momentum is then folded into its learning rate
            (:mod:`horovod_sbc.tensorflow.momentum`; with ``weight_decay``, which is not folded,
            True), True otherwise. The choice needs the
            optimizer: :class:`SBCCallback` passes the model's, the drop-in tape's loop passes
            it to :meth:`step`; without it the default is True. Gradient modes (stock tape,
            :meth:`exchange_gradients`) exchange gradients and are not affected.
        outer: weight mode only: the outer step that turns each sync's averaged update into
            the change of the shared weights (:mod:`horovod_sbc.tensorflow.outer`: ``Plain()``,
            the default, ``Plain(lr=sqrt(N))`` with Adam-family optimizers at delay 1,
            ``Nesterov(lr, momentum)``, ``ErrorDecay(decay, lr)``), as the torch
            drop-in's ``outer=``; its state is saved with this module.
        optimizer: the Keras optimizer that applies this rank's steps. The stock tape folds a
            Keras SGD's momentum with it (the averaged gradient scaled, the velocity set to zero
            before each step, as torch's stock hook: :mod:`horovod_sbc.tensorflow.momentum`;
            build the optimizer before the first step); without it the stock tape hands the
            average to the optimizer's momentum and warns.
            Weight mode uses it when :meth:`step` is not given one. Not saved with this module
            (save the optimizer in your checkpoint, as usual).
        name: the ``tf.Module`` name.
    """

    def __init__(self, density: float = 0.01, delay: int = 1,
                 nonfinite: str = "raise", topology: str = "allgather",
                 downlink_density: Optional[float] = None,
                 downlink_binarize: Optional[bool] = None, selection: str = "paper",
                 name: str = "sbc", local_residual: Optional[bool] = None,
                 mode: str = "sbc",
                 seed: int = 0, fixed_size: Optional[bool] = None,
                 outer: Optional[Plain] = None, optimizer=None):
        tf.Module.__init__(self, name=name)
        if local_residual is not None and not isinstance(local_residual, bool):
            raise ValueError(f"local_residual must be None, True or False, got "
                             f"{local_residual!r}")
        self._local_residual = local_residual  # None: chosen at the first weight-mode call
        self._fold: Optional[Fold] = None
        self._settled = False
        # the same validated knobs as the torch adapter's (horovod_sbc.config)
        self.config = SBCConfig(density=density, delay=delay, mode=mode, selection=selection,
                                nonfinite=nonfinite, topology=topology,
                                downlink_density=downlink_density,
                                downlink_binarize=downlink_binarize, seed=seed,
                                fixed_size=fixed_size)
        self.mode = self.config.mode
        self.density, self.delay = self.config.density, self.config.delay
        self.binarize, self.selection = self.config.binarize, self.config.selection
        self.nonfinite = self.config.nonfinite
        self.topology, self.downlink_density = self.config.topology, self.config.downlink_density
        self.outer = resolve_outer(outer)
        self._optimizer = _Held(optimizer)
        StockHook.__init__(self, optimizer)
        self._mode: Optional[str] = None
        self._backend = None
        with tf.init_scope():
            self.residuals = {}
            self.reference = {}
            self.server_residuals = {}  # topologies: an owner's / the server's downlink residual
            self.calls = {}  # stock mode: how often each gradient was exchanged
            self.counters = {k: state_variable(tf.constant(0, tf.int64), k)
                             for k in COUNTER_KEYS}
            self.local_steps = state_variable(tf.constant(0, tf.int64), "local_steps")
            self.pending = state_variable(tf.constant(0, tf.int64), "pending")
            self.world = state_variable(tf.constant([-1, -1], tf.int64), "world")
            # exchanges encoded so far: a random compressor's draws are a function of it
            self.draws = state_variable(tf.constant(0, tf.int64), "draws")
        # the framework-agnostic holder shares the (checkpoint-tracked) stores
        self.manager = ResidualManager()
        self.manager.residuals, self.manager.reference = self.residuals, self.reference
        self.manager.server_residuals = self.server_residuals
        self.manager.config.update(density=self.density, delay=delay, binarize=self.binarize,
                                   selection=self.selection, topology=self.topology,
                                   downlink_density=self.downlink_density,
                                   downlink_binarize=self.config.downlink_binarize)

    def __repr__(self) -> str:
        topo = "" if self.topology == "allgather" else f", topology={self.topology!r}"
        return (f"SBC(density={self.density}, delay={self.delay}, mode={self.mode!r}, "
                f"nonfinite={self.nonfinite!r}{topo})")

    def stats(self) -> Dict[str, int]:
        """Cumulative figures of this rank (eager), as in PyTorch:

        upstream_bits   bits this rank sent (real step message sizes, headers included; in stock
                        mode plus Horovod's 1-element dummy allreduce per gradient)
        downstream_bits bits this rank received from the other ranks
        dense_bits      32 x element count x steps: an uncompressed fp32 upload at every step
        syncs           number of exchanges that went through
        steps           number of optimizer steps (local steps count, weight mode)
        """
        out = {k: int(v.numpy()) for k, v in self.counters.items()}
        if len(self.calls):
            out["steps"] = out["syncs"] = max(int(c.numpy()) for c in self.calls.values())
        self.manager.counters = dict(out)
        return out

    @no_autograph
    def exchange_gradients(self, sources, gradients, tag: str = "sbc_sync"):
        """Compress all gradients into one step message, allgather it, return the averages.

        ``sources`` and ``gradients`` are flat lists; a None gradient counts as zeros (the
        residual is still sent); ``tf.IndexedSlices`` are densified. Gradients of non-float
        sources are returned unchanged. Works eagerly and inside ``tf.function``.
        """
        self._use("gradients")
        size, _ = self._world()
        return sync.exchange_gradients(self, entries(sources), gradients, size, tag)


class _Held:
    """The user's optimizer, held out of this module's checkpoint (``tf.Module`` would track
    it, and the user saves it already)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
