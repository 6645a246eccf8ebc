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
  ``compress``/``decompress`` per gradient (:mod:`horovod_sbc.tensorflow.hook`): gradients
  exchanged, or with ``SBC(optimizer=opt)`` what :func:`horovod_sbc.policy.choose` says (weight
  changes after the optimizer's step, :mod:`horovod_sbc.tensorflow.stock`).
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
from .adam import apply_freeze
from .adam import family
from .outer import make as make_outer
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
        density, delay: the paper's p and n, the two knobs to tune (docs/recipes.md).
        nonfinite, topology, downlink_density, downlink_mode, selection, mode, seed,
        fixed_size, momentum, hierarchy, local_residual, outer, freeze_variance_after: the
            knobs of :class:`horovod_sbc.config.SBCConfig`, documented there once and the same
            as torch's. Weight mode (the drop-in tape, :class:`SBCCallback`, and the stock tape
            given ``optimizer``) takes ``delay > 1``, ``local_residual``, ``outer``,
            ``freeze_variance_after``; the stock tape refuses ``topology="server"``. Inside
            ``tf.function`` a ``ValueError`` arrives as
            ``tf.errors.InvalidArgumentError`` with the same text; TernGrad's draws are
            ``tf.random.stateless_uniform`` of (``seed``, rank, sync count, tensor).
        optimizer: the Keras optimizer that applies this rank's steps; torch's stock hook finds
            it, TensorFlow's tape is told. The stock tape then does what
            :func:`horovod_sbc.policy.choose` says: every optimizer exchanges weight changes after
            its step (Adam's variance frozen by ``freeze_variance_after``). Without it the stock
            tape exchanges gradients and warns. Weight mode uses it when :meth:`step` is not
            given one. Not saved with this module (save the optimizer in your checkpoint).
        name: the ``tf.Module`` name.
    """

    def __init__(self, density: float = 0.01, delay: int = 1, *, nonfinite: str = "raise",
                 topology: str = "allgather", downlink_density: Optional[float] = None,
                 downlink_mode: Optional[str] = None,
                 downlink_binarize: Optional[bool] = None, selection: str = "paper",
                 mode: str = "sbc", seed: int = 0, fixed_size: Optional[bool] = None,
                 momentum: Optional[str] = None, hierarchy=None,
                 local_residual: Optional[bool] = None, outer=None,
                 freeze_variance_after="auto", optimizer=None, name: str = "sbc"):
        tf.Module.__init__(self, name=name)
        # the same validated knobs as the torch adapter's (horovod_sbc.config)
        self.config = SBCConfig(density=density, delay=delay, mode=mode, selection=selection,
                                nonfinite=nonfinite, topology=topology,
                                downlink_density=downlink_density,
                                downlink_mode=downlink_mode,
                                downlink_binarize=downlink_binarize, seed=seed,
                                fixed_size=fixed_size, momentum=momentum, hierarchy=hierarchy,
                                local_residual=local_residual, outer=outer,
                                freeze_variance_after=freeze_variance_after)
        self._local_residual = local_residual  # None: chosen at the first weight-mode call
        self._settled = False
        self.mode = self.config.mode
        self.density, self.delay = self.config.density, self.config.delay
        self.binarize, self.selection = self.config.binarize, self.config.selection
        self.nonfinite = self.config.nonfinite
        self.topology, self.downlink_density = self.config.topology, self.config.downlink_density
        self.outer = make_outer(outer)  # its spec set by policy.outer_step (weights._settle)
        self._optimizer = _Held(optimizer)
        if optimizer is not None and family(optimizer) == "adam":
            # before a tf.function traces its step (weight mode freezes it at the first sync)
            apply_freeze(optimizer, self.config.freeze_variance_after)
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
                                   downlink_mode=self.config.downlink_compressor)

    def __repr__(self) -> str:
        topo = "" if self.topology == "allgather" else f", topology={self.topology!r}"
        return (f"SBC(density={self.density}, delay={self.delay}, mode={self.mode!r}, "
                f"nonfinite={self.nonfinite!r}{topo})")

    def stats(self) -> Dict[str, int]:
        """Cumulative figures of this rank (eager), as in PyTorch:

        upstream_bits   bits this rank sent (real step message sizes, headers included; in stock
                        mode plus Horovod's allreduce of a float16 placeholder per gradient)
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
