"""The stock Horovod hook (TensorFlow): ``compress()``/``decompress()`` for
``hvd.DistributedGradientTape(tape, compression=SBC(...))``.

:func:`horovod_sbc.policy.choose` says what the steps of the optimizer given as
``SBC(optimizer=opt)`` exchange, as torch's stock hook does (:mod:`horovod_sbc.torch.hook`):

* **weight changes** (every optimizer given): ``compress()`` hands Horovod a 1-element
  placeholder (counted in ``stats()``), ``decompress()`` hands back this rank's own gradient,
  and the optimizer's step is followed by weight mode's sync (:mod:`horovod_sbc.tensorflow.stock`):
  every ``delay`` steps the weight change is compressed and exchanged, with ``local_residual``,
  ``outer`` and ``freeze_variance_after`` as in the drop-in tape (Adam's second moment frozen
  automatically).
* **gradients** (no ``optimizer=``: policy's "unknown"). Stock Horovod allreduces whatever
  ``compress()`` returns, and Sparse Binary Compression's messages (Sattler et al., arXiv
  1805.08768) cannot be summed: ``compress()`` hands Horovod the placeholder and queues the
  gradient; the first ``decompress()`` of a group encodes the queued gradients with their
  residuals, allgathers one step message, decodes every rank's and commits the error feedback.
  With ``hvd.DistributedGradientTape(..., num_groups=1)`` (or ``groups=``) that is one exchange
  per step; without groups Horovod hands over one gradient at a time, each its own exchange
  (warned once). The average goes to whatever optimizer applies it, which with momentum or of
  the Adam family trains worse than the weight exchange (warned once).

Horovod passes no name: the variable is found by :func:`horovod_sbc.tensorflow.owner.identify`.
``topology="server"`` is refused in either exchange, ``hierarchy=`` in the gradient exchange
(weight mode's sync takes it where weight changes are exchanged).
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from .. import policy, wire
from ..config import PLACEHOLDER_BITS, PLACEHOLDER_DTYPE
from . import stock
from .adam import family
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


class _Own:
    """What ``compress()`` hands ``decompress()`` where weight changes are exchanged: this
    rank's own gradient and the op that marks the step pending."""

    def __init__(self, grad, mark):
        self.grad, self.mark = grad, mark


class StockHook(SyncState):
    """``compress``/``decompress`` of :class:`horovod_sbc.tensorflow.SBC` (mixed into it). Besides
    the shared state it reads ``calls`` (per gradient, how often it was exchanged: a
    checkpointed dict ``SBC.__init__`` creates) and the user's optimizer
    (``_optimizer.optimizer``), and writes the attributes its ``__init__`` sets."""

    calls: Dict[str, tf.Variable]
    _optimizer: object  # holds .optimizer, the user's (not tracked by the checkpoint)

    def __init__(self, optimizer):
        # what the optimizer's steps exchange (not given: the gradients, policy's "unknown")
        self._stock_choice = policy.choose(
            family(optimizer), delay=self.delay, api="stock",
            local_residual=self.config.local_residual)
        self._stock_first: Optional[str] = None  # the first gradient of a step
        self._stock_batch: Optional[StockBatch] = None
        self._warned_stock = False
        self._alone: Optional[set] = set()  # gradients exchanged one at a time (None: warned)

    def _stock_weights(self) -> bool:
        """Whether the stock tape exchanges weight changes (:func:`horovod_sbc.policy.choose`
        for the optimizer given as ``SBC(optimizer=...)``)."""
        return self._stock_choice.exchange == "weights"

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
        if self.config.topology == "server":
            raise ValueError(
                "SBC(topology='server') needs the fused exchange of weight mode: use "
                "horovod_sbc.tensorflow.DistributedGradientTape(tape, compression=SBC(..., "
                "topology='server')) with sbc.step(variables), or SBCCallback for Keras; "
                "stock hvd.DistributedGradientTape runs Horovod's collectives beside it")
        if self._stock_weights():  # hierarchy= too: weight mode's sync (sbc.step) takes it
            return self._compress_weights(tensor)
        if self.config.hierarchy is not None:
            raise ValueError(
                "SBC(hierarchy=...) needs the weight exchange, and stock "
                "hvd.DistributedGradientTape exchanges gradients here: pass the optimizer as "
                "SBC(..., optimizer=opt), or use horovod_sbc.tensorflow.DistributedGradientTape "
                "with sbc.step(), or SBCCallback")
        self._refuse_weight_knobs()
        name, op_sum = identify(tensor)
        self._use("stock")
        self._warn_stock()
        if self._stock_first is None:
            self._stock_first = name
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
        return _placeholder(), (batch, len(batch.names) - 1)

    @no_autograph
    def decompress(self, tensor, ctx):
        """Horovod hook: the averaged gradient; the first call of a group runs its exchange and
        commits its error feedback. Weight changes exchanged: this rank's own gradient."""
        if isinstance(ctx, _Own):  # once Horovod's allreduce of the placeholder is done
            with tf.control_dependencies([tensor, ctx.mark]):
                return tf.identity(ctx.grad)
        batch, i = ctx
        if not batch.done:
            self._exchange_batch(batch)
        with tf.control_dependencies([batch.committed]):
            return tf.cast(tf.identity(batch.avg[i]), batch.dtypes[i])  # zeros if skipped

    def _refuse_weight_knobs(self) -> None:
        """The gradient exchange (no optimizer given): knobs of the weight exchange raise
        instead of being ignored, naming what makes the stock tape exchange weight changes."""
        knob = None
        if self.delay != 1:
            knob = f"delay={self.delay}"
        elif self.config.local_residual:
            knob = "local_residual=True"
        elif self.config.outer is not None:
            knob = "outer=..."
        elif self.config.freeze_variance_after not in (None, "auto"):
            knob = "freeze_variance_after=..."
        if knob is not None:
            raise ValueError(
                f"SBC({knob}) applies where weight changes are exchanged (local steps between "
                "syncs), and stock hvd.DistributedGradientTape exchanges gradients unless it "
                "knows the optimizer: pass it as SBC(..., optimizer=opt) (each rank then runs "
                "opt's step on its own gradients and the weight change is exchanged after it), "
                "or use horovod_sbc.tensorflow.DistributedGradientTape(tape, compression=SBC(...)) "
                "with sbc.step(variables, opt) after each optimizer step, or SBCCallback for Keras")

    @no_autograph
    def _compress_weights(self, tensor):
        """compress() where weight changes are exchanged: the placeholder, and this rank's own
        gradient for decompress(); the optimizer's step syncs (:mod:`.stock`)."""
        name, op_sum = identify(tensor)
        opt = self._optimizer.optimizer
        what = type(opt).__name__
        if op_sum:
            raise ValueError(f"SBC through stock hvd.DistributedGradientTape with {what} averages "
                             "the ranks' weight changes; op=hvd.Sum has no meaning there: use "
                             "op=hvd.Average (the default)")
        self._use("weights")
        stock.adopt(opt, self)
        if self._stock_first is None:
            self._stock_first = name
        mark = stock.mark_gradient(self, name == self._stock_first, what)
        with tf.control_dependencies([mark]):  # Horovod allreduces the placeholder
            counted = self.counters["upstream_bits"].assign_add(PLACEHOLDER_BITS)
        return _placeholder(), _Own(tensor, counted)

    def _warn_stock(self) -> None:
        """Once per object, where the stock tape exchanges sparse gradients (no optimizer
        given), which an optimizer with momentum or of the Adam family reshapes badly."""
        if self._warned_stock:
            return
        self._warned_stock = True
        warnings.warn(
            "horovod_sbc: SBC through stock hvd.DistributedGradientTape exchanges sparse "
            "gradients when it does not know the optimizer; an optimizer with momentum or of "
            "the Adam family then acts on the averaged sparse update (each coordinate arriving "
            "late and in bursts) and can train worse than each rank alone. Pass it as "
            "SBC(..., optimizer=opt): the stock tape then runs opt on each rank's own gradients "
            "and exchanges the weight change (horovod_sbc.policy), as torch's one-line change "
            "does; or use horovod_sbc.tensorflow.DistributedGradientTape with "
            "sbc.step(variables, opt), or SBCCallback for Keras.", stacklevel=3)

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
        dummies = PLACEHOLDER_BITS * len(batch.names)  # Horovod's allreduce of placeholders
        code, avg, new_res, sent = self._exchange(
            batch.names, batch.shapes, batch.updates, batch.residuals,
            1.0 if batch.op_sum else 1.0 / size, tag, extra_up_bits=dummies)
        batch.avg = avg
        batch.committed = self._commit(batch.residuals, batch.updates, code, new_res, sent)
        batch.done = True


def _placeholder() -> tf.Tensor:
    """What Horovod allreduces in a gradient's stead (``stats()`` counts it as sent)."""
    return tf.zeros([1], getattr(tf, PLACEHOLDER_DTYPE))
