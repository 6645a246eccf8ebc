"""The stock Horovod hook (TensorFlow): ``compress()``/``decompress()`` for
``hvd.DistributedGradientTape(tape, compression=SBC(...))``.

Stock Horovod allreduces whatever ``compress()`` returns, and Sparse Binary Compression's
messages (Sattler et al., arXiv 1805.08768) cannot be summed: ``compress()`` hands Horovod a
1-element placeholder (counted in ``stats()``) and queues the gradient; the first
``decompress()`` of a group encodes the queued gradients with their residuals, allgathers one
step message, decodes every rank's and commits the error feedback. With
``hvd.DistributedGradientTape(..., num_groups=1)`` (or ``groups=``) that is one exchange per
step; without groups Horovod hands over one gradient at a time, each its own exchange (warned
once). Horovod passes no name: the variable is found by
:func:`horovod_sbc.tensorflow.owner.identify`. ``delay`` must be 1 (no local steps here).

This exchanges sparse *gradients*: an optimizer with momentum or of the Adam family then acts
on the averaged sparse update, which can train worse than each rank alone (warned once). A
Keras SGD given as ``SBC(optimizer=...)`` has its momentum folded instead, as torch's stock
hook does (:mod:`horovod_sbc.tensorflow.momentum`).
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from .. import wire
from .momentum import Fold, family, foldable, momentum_free
from .owner import identify
from .sync.exchange import tf_name
from .sync.state import SyncState, no_autograph, state_variable, static_shape


class StockBatch:
    """The gradients the stock hook compressed since its last exchange, in one graph."""

    def __init__(self, op_sum: bool):
        self.graph = tf.compat.v1.get_default_graph()
        self.op_sum = op_sum
        self.names: List[str] = []
        self.shapes: List[Tuple[int, ...]] = []
        self.dtypes: List[tf.DType] = []
        self.residuals: List[tf.Variable] = []
        self.updates: List[tf.Tensor] = []
        self.done = False
        self.avg: List[tf.Tensor] = []
        self.committed = None

    def add(self, name, shape, dtype, residual, update) -> None:
        self.names.append(name)
        self.shapes.append(shape)
        self.dtypes.append(dtype)
        self.residuals.append(residual)
        self.updates.append(update)


class StockHook(SyncState):
    """``compress``/``decompress`` of :class:`horovod_sbc.tensorflow.SBC` (mixed into it). Besides
    the shared state it reads ``calls`` (per gradient, how often it was exchanged: a
    checkpointed dict ``SBC.__init__`` creates) and the user's optimizer
    (``_optimizer.optimizer``), and writes the attributes its ``__init__`` sets."""

    calls: Dict[str, tf.Variable]
    _optimizer: object  # holds .optimizer, the user's (not tracked by the checkpoint)

    def __init__(self, optimizer):
        # the stock tape's fold: the gradient alone is scaled, Keras' decoupled decay is apart
        self._stock_fold = Fold(optimizer, decay_apart=True) \
            if foldable(optimizer, decay_apart=True) else None
        self._stock_first: Optional[str] = None  # the first gradient of a step (the fold's reset)
        self._stock_batch: Optional[StockBatch] = None
        self._warned_stock = False
        self._alone: Optional[set] = set()  # gradients exchanged one at a time (None: warned)

    @no_autograph
    def compress(self, tensor):
        """Horovod hook: queue this gradient for the next exchange; returns a 1-element dummy for
        Horovod's allreduce (the real data travels by allgather) and the context for
        :meth:`decompress`.

        The gradients Horovod compresses before it decompresses the first of them (all of a
        group with ``hvd.DistributedGradientTape(..., num_groups=1)`` or ``groups=``) are
        encoded, allgathered and decoded together, as one step message: one exchange and a
        constant number of host round trips per group. Without groups Horovod compresses and
        decompresses one gradient at a time, and each is its own exchange."""
        if self.delay != 1:
            raise ValueError(
                f"SBC(delay={self.delay}) needs local steps between syncs, which stock "
                "hvd.DistributedGradientTape cannot do: use horovod_sbc.tensorflow."
                "DistributedGradientTape(tape, compression=SBC(..., delay=n)) and call "
                "sbc.step(variables) after each optimizer step, or SBCCallback for Keras.")
        if self.config.topology == "server":
            raise ValueError(
                "SBC(topology='server') needs the fused exchange of weight mode: use "
                "horovod_sbc.tensorflow.DistributedGradientTape(tape, compression=SBC(..., "
                "topology='server')) with sbc.step(variables), or SBCCallback for Keras; "
                "stock hvd.DistributedGradientTape runs Horovod's collectives beside it")
        name, op_sum = identify(tensor)
        self._use("stock")
        self._warn_stock()
        if self._stock_first is None:
            self._stock_first = name
        fold = self._stock_fold
        if fold is not None and not fold.optimizer.built:
            # Horovod traces the exchange into a tf.function (eagerly too) once, before the
            # optimizer's first step would create the velocities the fold sets to zero
            raise ValueError(
                f"SBC(optimizer={type(fold.optimizer).__name__}) folds its momentum, which does "
                "not exist before its first step: call optimizer.build(model.trainable_variables)"
                " before the first step")
        if isinstance(tensor, tf.IndexedSlices):
            raise ValueError(f"SBC: gradient of {name!r} is sparse (tf.IndexedSlices); pass "
                             "sparse_as_dense=True to hvd.DistributedGradientTape")
        shape = static_shape(tensor, name)
        res = self._residual(name, shape, tensor.dtype)
        if name not in self.calls:
            with tf.init_scope():
                self.calls[name] = state_variable(tf.constant(0, tf.int64),
                                                  "calls_" + tf_name(name))
        numel = wire.layout_numel(shape)
        counted = [self.counters["dense_bits"].assign_add(32 * numel),
                   self.calls[name].assign_add(1)]
        with tf.control_dependencies(counted):
            upd = tf.identity(tf.cast(tensor, res.dtype))
        batch = self._stock_batch
        if batch is None or batch.done or batch.graph is not tf.compat.v1.get_default_graph():
            batch = self._stock_batch = StockBatch(op_sum)
        if batch.op_sum != op_sum:
            raise ValueError(f"SBC: {name!r} is reduced with another op than the gradients "
                             "grouped with it")
        batch.add(name, shape, tensor.dtype, res, upd)
        return tf.zeros([1], tensor.dtype), (batch, len(batch.names) - 1)

    @no_autograph
    def decompress(self, tensor, ctx):
        """Horovod hook: the averaged gradient; the first call of a group runs its exchange and
        commits its error feedback."""
        batch, i = ctx
        if not batch.done:
            self._exchange_batch(batch)
        with tf.control_dependencies([batch.committed]):
            return tf.cast(tf.identity(batch.avg[i]), batch.dtypes[i])  # zeros if skipped

    def _warn_stock(self) -> None:
        """Once per object: the stock tape exchanges sparse gradients, which an optimizer with
        momentum or of the Adam family reshapes badly; silent when ``SBC(optimizer=...)`` is a
        Keras SGD, whose momentum is folded (or which has none)."""
        if self._warned_stock:
            return
        self._warned_stock = True
        opt = self._optimizer.optimizer
        if self._stock_fold is not None or momentum_free(opt):
            return
        which = ("an optimizer that has momentum or is of the Adam family (pass it as "
                 "SBC(..., optimizer=opt): a Keras SGD's momentum is then folded)"
                 if opt is None else f"{type(opt).__name__}")
        adam = (" With Adam or AdamW the drop-in freezes its second moment: "
                "horovod_sbc.tensorflow.freeze_variance_after(opt, total_steps // 6)."
                if opt is not None and family(opt) == "adam" else "")
        warnings.warn(
            "horovod_sbc: SBC through stock hvd.DistributedGradientTape exchanges sparse "
            f"gradients; with {which}, which then acts on the averaged sparse update (each "
            "coordinate arriving late and in bursts), it can train worse than each rank alone "
            "(horovod_sbc.policy: such optimizers exchange weight changes). "
            "The drop-in horovod_sbc.tensorflow.DistributedGradientTape(tape, compression="
            "SBC(0.01)) with sbc.step(variables, opt) after each optimizer step (or "
            "SBCCallback for Keras) runs the optimizer on each rank's own gradients and "
            "compresses the weight change, as torch's one-line change does." + adam,
            stacklevel=3)

    def _warn_ungrouped(self, batch: StockBatch) -> None:
        """Once per object: Horovod hands the stock tape one gradient at a time (no groups), so
        every gradient is an exchange of its own, with its host round trips; say how to group."""
        if len(batch.names) != 1 or self._alone is None:
            return
        if self._alone and batch.names[0] not in self._alone:
            self._alone = None
            warnings.warn(
                "horovod_sbc: stock hvd.DistributedGradientTape hands SBC one gradient at a "
                "time, so each gradient is an exchange of its own (an allgather and a host "
                "round trip each); pass num_groups=1 (or groups=1) to "
                "hvd.DistributedGradientTape to exchange all gradients of a step at once.",
                stacklevel=4)
            return
        self._alone.add(batch.names[0])

    def _exchange_batch(self, batch: StockBatch) -> None:
        self._warn_ungrouped(batch)
        size, _ = self._world()
        first = tf_name(batch.names[0])
        tag = f"sbc_{first}" if len(batch.names) == 1 else f"sbc_{first}_x{len(batch.names)}"
        dummies = sum(dt.size for dt in batch.dtypes)  # Horovod's allreduce of the dummies
        code, avg, new_res, sent = self._exchange(
            batch.names, batch.shapes, batch.updates, batch.residuals,
            1.0 if batch.op_sum else 1.0 / size, tag, extra_up_bits=8 * dummies)
        fold = self._stock_fold
        if fold is not None:  # compress() counted this step: the fold's step is one less
            k = fold.scale(self.calls[batch.names[0]].read_value() - 1)
            avg = [a * tf.cast(k, a.dtype) for a in avg]
            if self._stock_first in batch.names:  # once per step: a zero velocity
                with tf.control_dependencies(fold.reset()):
                    avg = [tf.identity(a) for a in avg]
        batch.avg = avg
        batch.committed = self._commit(batch.residuals, batch.updates, code, new_res, sent)
        batch.done = True
