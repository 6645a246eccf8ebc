"""Weight mode (TensorFlow): exchange weight changes, with communication delay.

The communication-delay algorithm of Sparse Binary Compression (Sattler et al., arXiv
1805.08768), as the torch drop-in optimizer runs it (:mod:`horovod_sbc.torch.optimizer`): every
rank takes ``delay`` local optimizer steps (1 or more) with its own optimizer on its own
gradients, then the window's change ``dW = W - W_ref`` plus the residual is compressed and
exchanged, every rank adds the same average to the shared weights ``W_ref`` (or takes
``outer=``'s step, :mod:`horovod_sbc.tensorflow.outer`) and continues from ``W_ref`` (plus its
own unsent residual, with ``local_residual``). The sync itself is
:func:`horovod_sbc.tensorflow.sync.synchronize_weights`.

:class:`WeightMode` (mixed into :class:`horovod_sbc.tensorflow.SBC`) is what drives it:
:meth:`~WeightMode.step` after each optimizer step (the drop-in
:func:`horovod_sbc.tensorflow.DistributedGradientTape`, :class:`horovod_sbc.tensorflow.SBCCallback`
for Keras), :meth:`~WeightMode.finish` at the end. Its first call fixes where the residual lives
and freezes Adam's second moment (:mod:`horovod_sbc.tensorflow.adam`), as
:mod:`horovod_sbc.policy` says.
"""
from __future__ import annotations

import warnings
from typing import Optional

import tensorflow as tf

from .. import wire
from .. import policy
from ..config import describe_hierarchy
from .adam import apply_freeze, family, is_frozen
from .owner import entries, tf_variable
from .sync import synchronize_weights
from .sync.exchange import tf_name
from .sync.state import SyncState, no_autograph, static_shape


class WeightMode(SyncState):
    """Weight mode of :class:`horovod_sbc.tensorflow.SBC` (mixed into it). Besides the shared
    state it reads ``local_steps`` and ``pending`` (the delay window, checkpointed), the user's
    optimizer (``_optimizer.optimizer``) and ``_local_residual``/``_settled``, which
    ``SBC.__init__`` sets and :meth:`_settle` decides."""

    pending: tf.Variable
    _optimizer: object  # holds .optimizer, the user's (not tracked by the checkpoint)
    _local_residual: Optional[bool]
    _settled: bool

    @property
    def local_residual(self) -> Optional[bool]:
        """Where weight mode keeps the residual (see the class docstring); None while the
        default is not chosen yet (before the first :meth:`step`)."""
        return self._local_residual

    def _settle(self, optimizer) -> None:
        """Weight mode's first call fixes where the residual lives and the outer step."""
        if self._settled:
            return
        self._settled = True
        if self.config.hierarchy is not None:  # built now: a bad grouping fails every rank
            from . import hierarchy
            hierarchy.of(self, describe_hierarchy(self.config.hierarchy))
        choice = policy.choose(family(optimizer), delay=self.delay, api="dropin",
                               local_residual=self._local_residual)
        self._local_residual = choice.local_residual
        if self.config.outer is None:  # the same runner: a restored checkpoint finds it
            self.outer.set_spec(policy.outer_step(choice, self._world_size()))
        if tf.inside_function() and family(optimizer) == "adam" and not is_frozen(optimizer) \
                and self.config.freeze_variance_after is not None:
            # its step is traced already: say how to freeze it
            warnings.warn(
                f"horovod_sbc: {type(optimizer).__name__}'s second moment is frozen "
                "automatically only when SBC sees the optimizer before its step is traced: "
                "pass it as SBC(..., optimizer=opt) (SBCCallback does it for fit)",
                stacklevel=4)
        elif not tf.inside_function():
            apply_freeze(optimizer, self.config.freeze_variance_after)

    def _world_size(self) -> int:
        """The job's number of ranks (1 outside a job, as torch's drop-in)."""
        try:
            return self._world()[0]
        except (RuntimeError, ImportError, ValueError):
            return 1

    def _create(self, variables) -> None:
        """The residuals and reference weights of ``variables`` (entries), created now (eagerly)
        where missing. With a hierarchy only the reference weights: its residuals are pieces
        of the node's shard, created by its first sync (:mod:`horovod_sbc.tensorflow.hierarchy`)."""
        flat = self.config.hierarchy is None
        with tf.init_scope():
            for name, v, _ in variables:
                if flat:
                    self._residual(name, static_shape(v, name), v.dtype)
                self._reference(name, v)

    @no_autograph
    def build(self, variables) -> None:
        """Create the residuals and reference weights of ``variables`` now (eagerly).

        Weight mode needs the reference weights before the first optimizer step: call this after
        broadcasting the initial weights (:func:`horovod_sbc.tensorflow.broadcast_variables`).
        Existing state is kept (so a checkpoint restored before or after stays in force).
        """
        self._world()
        self._create(entries(variables))

    @no_autograph
    def reset_reference(self, variables) -> None:
        """Take the current weights as the shared reference and restart the delay window
        (after a broadcast or after loading weights by other means than the checkpoint)."""
        with tf.init_scope():
            for name, v, _ in entries(variables):
                self._reference(name, v).assign(v.read_value())
            self.local_steps.assign(0)

    @no_autograph
    def step(self, variables, optimizer=None):
        """Count one optimizer step of ``variables``; every ``delay``-th call, synchronize.

        Call it right after ``optimizer.apply_gradients`` on every step, on every rank (the
        drop-in tape needs it, :class:`SBCCallback` does it), with the ``optimizer`` that
        stepped: it decides the outer step and Adam's variance freeze at the first call. Works
        eagerly and inside ``tf.function``.
        At a sync, this window's update (+ residual) is SBC-compressed for every variable, all
        messages go in one allgather, and every rank sets ``W_ref += mean over ranks``
        (bit-identical everywhere) and ``W = W_ref + R`` (``local_residual=True``) or
        ``W = W_ref`` (False).
        """
        self._use("weights")
        self._settle(self._optimizer.optimizer if optimizer is None else optimizer)
        found = entries(variables)
        for name, v, _ in found:
            self._reference(name, v, create=False)
        numel = sum(wire.layout_numel(static_shape(v, n)) for n, v, _ in found)
        ops = [self.local_steps.assign_add(1), self.counters["steps"].assign_add(1),
               self.counters["dense_bits"].assign_add(32 * numel), self.pending.assign(0)]
        with tf.control_dependencies(ops):
            if self.delay == 1:
                return self._synchronize(found)
            due = tf.equal(self.local_steps.read_value() % self.delay, 0)
            return tf.cond(due, lambda: self._synchronize(found), lambda: tf.constant(False))

    @no_autograph
    def synchronize(self, variables):
        """Exchange the accumulated weight update now (normally :meth:`step` does it)."""
        self._use("weights")
        self._settle(self._optimizer.optimizer)
        return self._synchronize(entries(variables))

    def _synchronize(self, found):
        if self.config.hierarchy is not None:  # dense in the node, SBC between nodes
            from .hierarchy import synchronize as hierarchical
            return hierarchical(self, found, self.local_residual)
        return synchronize_weights(self, found, self.local_residual)

    @no_autograph
    def finish(self, variables, average_residuals: Optional[bool] = None):
        """End of training in weight mode: sync a partial delay window, then give every rank the
        same weights: ``W_ref`` + the average of all ranks' residuals (one dense allreduce, then
        a broadcast from rank 0), or ``W_ref`` alone with ``average_residuals=False``. None
        (the default) averages residuals that live in the weights (``local_residual=True``)
        only, as the torch drop-in's ``finish``. Residuals are cleared. Eager only. With a
        hierarchy, the residual of each rank is its share of its node's (the weights' ``W -
        W_ref``, or its residual pieces times the node size), as in torch."""
        import horovod.tensorflow as hvd
        self._use("weights")
        self._settle(self._optimizer.optimizer)
        if average_residuals is None:
            average_residuals = self._local_residual
        found = entries(variables)
        if int(self.local_steps.numpy()) > 0:
            self._synchronize(found)
        if self.config.hierarchy is not None:  # the residuals are the node's pieces
            from . import hierarchy
            hierarchy.of(self).finish(self, found, average_residuals, self._local_residual)
            return
        for name, v, _ in found:
            ref = self._reference(name, v, create=False)
            r = self._residual(name, static_shape(v, name), v.dtype)
            new = tf.cast(ref.read_value(), r.dtype)
            if average_residuals:
                new = new + hvd.allreduce(r.read_value(), op=hvd.Average,
                                          name="sbc_finish_" + tf_name(name))
            v.assign(tf.cast(new, v.dtype))
            r.assign(tf.zeros_like(r))
        if average_residuals:
            hvd.broadcast_variables([tf_variable(v) for _, v, _ in found], root_rank=0)
        for name, v, _ in found:
            self._reference(name, v, create=False).assign(v.read_value())

    @no_autograph
    def _check_window(self, sources):
        """Drop-in tape: make sure reference weights exist (taken now, before the first local
        step) and that step() was called after the previous gradient()."""
        self._use("weights")
        self._create(entries(sources))
        check = tf.debugging.assert_equal(
            self.pending, tf.constant(0, tf.int64),
            message="SBC: call sbc.step(variables) after applying the gradients of every "
                    "horovod_sbc.tensorflow.DistributedGradientTape.gradient() call")
        with tf.control_dependencies([check]):
            return self.pending.assign(1)
