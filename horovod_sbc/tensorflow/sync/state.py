"""What every sync of one TensorFlow ``SBC`` object shares: its state and its exchange.

Sparse Binary Compression (Sattler et al., arXiv 1805.08768) keeps, per tensor, a residual of
what was not sent yet (error feedback) and, with communication delay, the weights all ranks
agreed on at the last sync. :class:`SyncState` is the part of
:class:`horovod_sbc.tensorflow.SBC` (mixed into it) that creates and checks that state, runs one
exchange (:func:`horovod_sbc.tensorflow.sync.exchange.exchange`: encode, allgather, decode; or
through a topology, :mod:`horovod_sbc.tensorflow.sync.topology`) with the object's knobs, and
commits the error feedback according to the decode's verdict. The state lives in
``tf.Variable`` s that ``SBC.__init__`` assigns to the ``tf.Module`` itself, so
``tf.train.Checkpoint`` saves them under the names torch's ``state_dict()`` uses.

The stock hook (:mod:`horovod_sbc.tensorflow.hook`), gradient mode and weight mode
(:mod:`horovod_sbc.tensorflow.sync`, :mod:`horovod_sbc.tensorflow.weights`) are built on it; one
``SBC`` object serves one of them (their residuals would mix).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Tuple

import tensorflow as tf

from ... import reference, registry, wire
from ..backend import Backend, backend_for
from . import exchange, topology
from .exchange import residual_dtype, tf_name

if TYPE_CHECKING:
    from ...config import SBCConfig
    from ...residual import ResidualManager

#: Our graph-building code uses Python control flow on Python values only; AutoGraph must not
#: rewrite it when a user's tf.function calls into it.
no_autograph = tf.autograph.experimental.do_not_convert

#: how each mode is used, for the error that refuses a second mode on one object
MODES = {"stock": "hvd.DistributedGradientTape(tape, compression=SBC(...))",
         "gradients": "SBC.exchange_gradients()",
         "weights": "SBC.step() (horovod_sbc.tensorflow.DistributedGradientTape or SBCCallback)"}


def state_variable(initial, name: str) -> tf.Variable:
    """A non-trainable state variable, created eagerly (callers hold ``tf.init_scope``) even
    when the first call comes from inside a ``tf.function``'s trace. Without
    ``experimental_enable_variable_lifting=False`` the trace would record it as created by the
    function, and TensorFlow would trace that function a second time."""
    return tf.Variable(initial, trainable=False, name=name,
                       experimental_enable_variable_lifting=False)


def static_shape(t, name: str) -> Tuple[int, ...]:
    """``t``'s shape as a tuple; ``ValueError`` unless it is fully known."""
    shape = t.shape
    if not shape.is_fully_defined():
        raise ValueError(f"SBC: {name!r} has shape {shape}, which is not fully known; SBC keeps a "
                         "residual per tensor and needs static shapes")
    return tuple(int(d) for d in shape)


class SyncState:
    """The state and the exchange of :class:`horovod_sbc.tensorflow.SBC` (mixed into it). The
    attributes below are assigned by ``SBC.__init__`` (the checkpoint's names)."""

    config: "SBCConfig"
    mode: str
    density: float
    delay: int
    selection: str
    nonfinite: str
    outer: object  # an outer step of horovod_sbc.tensorflow.outer
    manager: "ResidualManager"
    residuals: Dict[str, tf.Variable]
    reference: Dict[str, tf.Variable]
    server_residuals: Dict[str, tf.Variable]
    counters: Dict[str, tf.Variable]
    local_steps: tf.Variable
    world: tf.Variable
    draws: tf.Variable
    _mode: Optional[str]
    _backend: Optional[Backend]

    def _use(self, mode: str) -> None:
        """Fix the mode this object serves at its first use; refuse any other afterwards."""
        if mode != "weights" and not self.outer.decodes_into_reference:
            raise ValueError(f"SBC(outer={self.outer!r}) acts on the shared weights of weight "
                             f"mode; it cannot be used through {MODES[mode]} (use "
                             "horovod_sbc.tensorflow.DistributedGradientTape and sbc.step(), or "
                             "SBCCallback)")
        if self._mode is None:
            self._mode = mode
        elif self._mode != mode:
            raise ValueError(f"this SBC object is used through {MODES[self._mode]}; it cannot "
                             f"also be used through {MODES[mode]} (their residuals would mix). "
                             "Use one SBC object per training loop.")

    @property
    def backend(self) -> Optional[Backend]:
        """The backend that encodes and decodes this object's syncs
        (:mod:`horovod_sbc.tensorflow.backend`), chosen at the first sync for the device of
        its first residual (the kernel ops on the CPU unless disabled, else TF ops); None
        before."""
        return self._backend

    def _backend_of(self, residuals) -> Backend:
        if self._backend is None:
            self._backend = backend_for(residuals[0].device if residuals else "")
        return self._backend

    def _world(self) -> Tuple[int, int]:
        import horovod.tensorflow as hvd
        if not hvd.is_initialized():
            raise RuntimeError("horovod is not initialized: call hvd.init() first")
        size, rank = hvd.size(), hvd.rank()
        self.manager.config.update(world_size=size, rank=rank)
        with tf.init_scope():
            saved = [int(x) for x in self.world.numpy()]
            if saved == [-1, -1]:
                self.world.assign([size, rank])
            elif saved != [size, rank]:
                raise ValueError(f"SBC state was saved with world_size={saved[0]}, rank={saved[1]} "
                                 f"but this run has world_size={size}, rank={rank}; residuals "
                                 "are only valid for the same setting")
        return size, rank

    def _residual(self, name: str, shape: Tuple[int, ...], dtype: tf.DType) -> tf.Variable:
        def make():
            with tf.init_scope():
                return state_variable(tf.zeros(shape, residual_dtype(dtype)),
                                      "residual_" + tf_name(name))
        r = self.manager.residual(name, make)
        if tuple(r.shape) != tuple(shape):
            raise ValueError(f"SBC: {name!r} has shape {shape} but its residual has "
                             f"{tuple(r.shape)}; did the model change?")
        return r

    def _reference(self, name: str, var: tf.Variable, create: bool = True) -> tf.Variable:
        ref = self.reference.get(name)
        if ref is None:
            if not create:
                raise ValueError(
                    f"SBC(delay={self.delay}) has no reference weights for {name!r}: call "
                    "sbc.build(variables) before the first optimizer step (after broadcasting "
                    "the initial weights), or use DistributedGradientTape / SBCCallback, which "
                    "do it for you")
            with tf.init_scope():
                ref = state_variable(var.read_value(), "reference_" + tf_name(name))
            self.reference[name] = ref
        elif tuple(ref.shape) != tuple(var.shape):
            raise ValueError(f"SBC: {name!r} has shape {tuple(var.shape)} but its reference "
                             f"weights have {tuple(ref.shape)}; did the model change?")
        return ref

    def _commit(self, residuals, updates, code, new_res, positions):
        """Commit error feedback according to the verdict of the decode (see exchange), and
        count what a committed sync sent."""
        numel = sum(int(r.shape.num_elements()) for r in residuals)

        def commit():
            ops = [r.assign(n) for r, n in zip(residuals, new_res)]
            ops += [self.counters["positions_sent"].assign_add(positions),
                    self.counters["elements_synced"].assign_add(numel)]
            with tf.control_dependencies(ops):
                return tf.constant(True)

        def keep_update():  # a rank skipped: nothing was sent, R + dW stays in the residual
            with tf.control_dependencies([r.assign_add(u) for r, u in zip(residuals, updates)]):
                return tf.constant(False)

        def drop_update():  # this rank failed: its non-finite update is dropped
            return tf.constant(False)

        return tf.switch_case(code, [commit, keep_update, drop_update])

    def _count_traffic(self, step, gathered, padding, extra_up_bits: int = 0):
        sent = tf.size(step, out_type=tf.int64)
        got = tf.size(gathered, out_type=tf.int64)
        return [self.counters["upstream_bits"].assign_add(8 * sent + extra_up_bits),
                self.counters["downstream_bits"].assign_add(8 * (got - sent)),
                self.counters["padding_bits"].assign_add(8 * padding)]

    def _exchange(self, names, shapes, updates, residuals, scale, tag, outs=None,
                  extra_up_bits: int = 0):
        """One exchange with this object's knobs and backend: ``(code, results, new_residuals,
        positions)`` of :func:`horovod_sbc.tensorflow.sync.exchange.exchange` (or, for the
        ``"reduce_scatter"`` and ``"server"`` topologies, of
        :func:`horovod_sbc.tensorflow.sync.topology.exchange`, which commits its downlink
        residuals itself), traffic counted; the caller commits (:meth:`_commit`)."""
        size, rank = self._world()
        if self.config.topology != "allgather":
            return topology.exchange(self, names, shapes, updates, residuals, scale=scale,
                                     tag=tag, outs=outs, extra_up_bits=extra_up_bits,
                                     seeds_of=lambda n: self._seeds(rank, n),
                                     variable=state_variable)
        capacity = reference.step_capacity([wire.layout_numel(s) for s in shapes],
                                           self.density, self.mode) \
            if self.config.fixed_size else None
        return exchange.exchange(self._backend_of(residuals), names, shapes, updates,
                                 [r.read_value() for r in residuals],
                                 density=self.density, mode=self.mode,
                                 seeds=self._seeds(rank, len(names)),
                                 selection=self.selection, capacity=capacity,
                                 skip=self.nonfinite == "skip", rank=rank, size=size,
                                 scale=scale, tag=tag, outs=outs,
                                 on_gathered=lambda s, g, p: self._count_traffic(
                                     s, g, p, extra_up_bits))

    def _seeds(self, rank: int, n: int):
        """Per message of this exchange, the stateless seed of a random compressor's draws
        (``seed``, rank, exchange, message), or None; counts the exchange."""
        if not registry.get(self.mode).random:
            return None
        k = self.draws.assign_add(1) - 1
        return [tf.stack([tf.constant(self.config.seed * 65536 + rank, tf.int64),
                          k * 65536 + i]) for i in range(n)]
