"""``SBC`` for TensorFlow 2: the compressor and the state it keeps (a ``tf.Module``).

One object holds the knobs and all per-tensor state as ``tf.Variable`` s, so
``tf.train.Checkpoint(..., sbc=sbc)`` saves and restores it and a resumed run continues exactly:

* ``residuals[name]``  — error feedback: what of ``R + dW`` was not sent yet (fp32; fp64 for
  fp64 variables);
* ``reference[name]``  — the weights all ranks agreed on at the last sync (weight mode, below);
* ``counters[key]``    — the traffic figures of :meth:`SBC.stats` (int64);
* ``local_steps``      — optimizer steps since the last sync (weight mode).

``name`` is the variable's Keras 3 path (``"sequential/dense/kernel"``) or a ``tf.Variable``'s name
without ``":0"``. The dict-like stores are those of :class:`horovod_sbc.residual.ResidualManager`
(the framework-agnostic state holder) and are tracked by TensorFlow's checkpointing.

Three ways to use one ``SBC`` object (one at a time per object):

* **stock** — ``hvd.DistributedGradientTape(tape, compression=SBC(...))``: Horovod calls
  :meth:`SBC.compress` / :meth:`SBC.decompress` per gradient; each gradient's message travels by its
  own allgather (one per group with ``groups=``). ``delay`` must be 1.
* **weights** — the drop-in, as the torch drop-in optimizer: every rank takes ``delay`` local
  optimizer steps (1 or more), then ``dW = W - W_ref`` is compressed and exchanged, the average is
  added to ``W_ref`` and every rank continues from ``W_ref`` (plus its residual, with
  ``local_residual``). Driven by :meth:`SBC.step` after each optimizer step (the drop-in tape,
  and :class:`horovod_sbc.tensorflow.SBCCallback` for Keras).
* **gradients** — :meth:`SBC.exchange_gradients`: all gradients in one step message, one
  allgather, averaged gradients returned (for loops that need exchanged gradients).
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from .. import reference, registry, wire
from ..config import SBCConfig
from ..residual import COUNTER_KEYS, ResidualManager
from .backend import Backend, backend_for
from .sync import exchange
from .sync.exchange import COMMIT, residual_dtype, tf_name
from .adam import freeze_variance_after, is_frozen
from .momentum import Fold, family, foldable, momentum_free, shares_weights
from .outer import Plain, resolve_outer
from .owner import identify, variable_name

# Our graph-building code uses Python control flow on Python values only; AutoGraph must not
# rewrite it when a user's tf.function calls into it.
_no_autograph = tf.autograph.experimental.do_not_convert
_MODES = {"stock": "hvd.DistributedGradientTape(tape, compression=SBC(...))",
          "gradients": "SBC.exchange_gradients()",
          "weights": "SBC.step() (horovod_sbc.tensorflow.DistributedGradientTape or SBCCallback)"}


def tf_variable(v) -> tf.Variable:
    """The ``tf.Variable`` behind ``v`` (a Keras 3 ``Variable`` wraps one as ``.value``)."""
    if isinstance(v, tf.Variable):
        return v
    inner = getattr(v, "value", None)
    if isinstance(inner, tf.Variable):
        return inner
    raise TypeError(f"SBC needs variables (tf.Variable or keras.Variable), got {type(v).__name__}"
                    " (gradients of plain tensors cannot be given a residual)")


def _state(initial, name: str) -> tf.Variable:
    """A non-trainable state variable, created eagerly (callers hold ``tf.init_scope``) even
    when the first call comes from inside a ``tf.function``'s trace. Without
    ``experimental_enable_variable_lifting=False`` the trace would record it as created by the
    function, and TensorFlow would trace that function a second time."""
    return tf.Variable(initial, trainable=False, name=name,
                       experimental_enable_variable_lifting=False)


def _static_shape(t, name: str) -> Tuple[int, ...]:
    shape = t.shape
    if not shape.is_fully_defined():
        raise ValueError(f"SBC: {name!r} has shape {shape}, which is not fully known; SBC keeps a "
                         "residual per tensor and needs static shapes")
    return tuple(int(d) for d in shape)


class SBC(tf.Module):
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
        The server topology, the hierarchy
            and DGC's momentum masking are torch-only (the momentum fold is here: ``optimizer``
            for the stock tape, ``local_residual`` for weight mode).
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
                 nonfinite: str = "raise", selection: str = "paper",
                 name: str = "sbc", local_residual: Optional[bool] = None,
                 mode: str = "sbc",
                 seed: int = 0, fixed_size: Optional[bool] = None,
                 outer: Optional[Plain] = None, optimizer=None):
        super().__init__(name=name)
        if local_residual is not None and not isinstance(local_residual, bool):
            raise ValueError(f"local_residual must be None, True or False, got "
                             f"{local_residual!r}")
        self._local_residual = local_residual  # None: chosen at the first weight-mode call
        self._fold: Optional[Fold] = None
        self._settled = False
        # the same validated knobs as the torch adapter's (horovod_sbc.config)
        self.config = SBCConfig(density=density, delay=delay, mode=mode, selection=selection,
                                nonfinite=nonfinite, seed=seed, fixed_size=fixed_size)
        self.mode = self.config.mode
        self.density, self.delay = self.config.density, self.config.delay
        self.binarize, self.selection = self.config.binarize, self.config.selection
        self.nonfinite = self.config.nonfinite
        self.outer = resolve_outer(outer)
        self._optimizer = _Held(optimizer)
        # the stock tape's fold: the gradient alone is scaled, Keras' decoupled decay is apart
        self._stock_fold = Fold(optimizer, decay_apart=True) \
            if foldable(optimizer, decay_apart=True) else None
        self._stock_first: Optional[str] = None  # the first gradient of a step (the fold's reset)
        self._mode: Optional[str] = None
        self._backend: Optional[Backend] = None
        self._stock_batch: Optional[_StockBatch] = None
        self._warned_stock = False
        self._alone: Optional[set] = set()  # gradients exchanged one at a time (None: warned)
        with tf.init_scope():
            self.residuals = {}
            self.reference = {}
            self.calls = {}  # stock mode: how often each gradient was exchanged
            self.counters = {k: _state(tf.constant(0, tf.int64), k) for k in COUNTER_KEYS}
            self.local_steps = _state(tf.constant(0, tf.int64), "local_steps")
            self.pending = _state(tf.constant(0, tf.int64), "pending")
            self.world = _state(tf.constant([-1, -1], tf.int64), "world")
            # exchanges encoded so far: a random compressor's draws are a function of it
            self.draws = _state(tf.constant(0, tf.int64), "draws")
        # the framework-agnostic holder shares the (checkpoint-tracked) stores
        self.manager = ResidualManager()
        self.manager.residuals, self.manager.reference = self.residuals, self.reference
        self.manager.config.update(density=self.density, delay=delay, binarize=self.binarize,
                                   selection=self.selection)

    def __repr__(self) -> str:
        return (f"SBC(density={self.density}, delay={self.delay}, mode={self.mode!r}, "
                f"nonfinite={self.nonfinite!r})")

    @property
    def local_residual(self) -> Optional[bool]:
        """Where weight mode keeps the residual (see the class docstring); None while the
        default is not chosen yet (before the first :meth:`step`)."""
        return self._local_residual

    def _settle(self, optimizer) -> None:
        """Weight mode's first call fixes where the residual lives and whether ``optimizer``'s
        momentum is folded (at delay 1 with the residual beside the shared weights only)."""
        if self._settled:
            return
        self._settled = True
        if self._local_residual is None:
            self._local_residual = not shares_weights(optimizer, self.delay)
        if family(optimizer) == "adam" and not is_frozen(optimizer):
            if tf.inside_function():  # its step is traced already: say how to freeze it
                warnings.warn(
                    f"horovod_sbc: {type(optimizer).__name__}'s second moment is frozen "
                    "automatically only when SBC sees the optimizer before its step is "
                    "traced: call horovod_sbc.tensorflow.freeze_variance_after(optimizer) "
                    "before the first tf.function step (SBCCallback does it for fit)",
                    stacklevel=4)
            else:
                freeze_variance_after(optimizer, "auto")  # horovod_sbc.policy, as torch
        if self.delay == 1 and not self._local_residual and foldable(optimizer):
            self._fold = Fold(optimizer)

    # -- statistics ---------------------------------------------------------------------------
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

    # -- state --------------------------------------------------------------------------------
    def _use(self, mode: str) -> None:
        if mode != "weights" and not self.outer.decodes_into_reference:
            raise ValueError(f"SBC(outer={self.outer!r}) acts on the shared weights of weight "
                             f"mode; it cannot be used through {_MODES[mode]} (use "
                             "horovod_sbc.tensorflow.DistributedGradientTape and sbc.step(), or "
                             "SBCCallback)")
        if self._mode is None:
            self._mode = mode
        elif self._mode != mode:
            raise ValueError(f"this SBC object is used through {_MODES[self._mode]}; it cannot "
                             f"also be used through {_MODES[mode]} (their residuals would mix). "
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
                return _state(tf.zeros(shape, residual_dtype(dtype)),
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
                ref = _state(var.read_value(), "reference_" + tf_name(name))
            self.reference[name] = ref
        elif tuple(ref.shape) != tuple(var.shape):
            raise ValueError(f"SBC: {name!r} has shape {tuple(var.shape)} but its reference "
                             f"weights have {tuple(ref.shape)}; did the model change?")
        return ref

    def _entries(self, variables) -> List[Tuple[str, tf.Variable, int]]:
        """(name, tf.Variable, index in ``variables``) of the floating-point variables, sorted by
        name (one canonical message order on every rank); names must be unique."""
        out = []
        for i, v in enumerate(tf.nest.flatten(variables)):
            tv = tf_variable(v)
            if tv.dtype.is_floating:
                out.append((variable_name(v), tv, i))
        names = [e[0] for e in out]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"SBC: variable names must be unique; duplicated: {', '.join(dups)} "
                             "(give your tf.Variables distinct names)")
        return sorted(out, key=lambda e: e[0])

    @_no_autograph
    def build(self, variables) -> None:
        """Create the residuals and reference weights of ``variables`` now (eagerly).

        Weight mode needs the reference weights before the first optimizer step: call this after
        broadcasting the initial weights (:func:`horovod_sbc.tensorflow.broadcast_variables`).
        Existing state is kept (so a checkpoint restored before or after stays in force).
        """
        self._world()
        with tf.init_scope():
            for name, v, _ in self._entries(variables):
                self._residual(name, _static_shape(v, name), v.dtype)
                self._reference(name, v)

    @_no_autograph
    def reset_reference(self, variables) -> None:
        """Take the current weights as the shared reference and restart the delay window
        (after a broadcast or after loading weights by other means than the checkpoint)."""
        with tf.init_scope():
            for name, v, _ in self._entries(variables):
                self._reference(name, v).assign(v.read_value())
            self.local_steps.assign(0)

    # -- pieces shared by the modes -------------------------------------------------------------
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
        size, rank = self._world()
        seeds = None
        if registry.get(self.mode).random:  # stateless draws: (seed, rank, exchange, tensor)
            n = self.draws.assign_add(1) - 1
            seeds = [tf.stack([tf.constant(self.config.seed * 65536 + rank, tf.int64),
                               n * 65536 + i]) for i in range(len(names))]
        capacity = reference.step_capacity([wire.layout_numel(s) for s in shapes],
                                           self.density, self.mode) \
            if self.config.fixed_size else None
        return exchange.exchange(self._backend_of(residuals), names, shapes, updates,
                                 [r.read_value() for r in residuals],
                                 density=self.density, mode=self.mode, seeds=seeds,
                                 selection=self.selection, capacity=capacity,
                                 skip=self.nonfinite == "skip", rank=rank, size=size,
                                 scale=scale, tag=tag, outs=outs,
                                 on_gathered=lambda s, g, p: self._count_traffic(
                                     s, g, p, extra_up_bits))

    # -- gradient mode ----------------------------------------------------------------------------
    @_no_autograph
    def exchange_gradients(self, sources, gradients, tag: str = "sbc_sync"):
        """Compress all gradients into one step message, allgather it, return the averages.

        ``sources`` and ``gradients`` are flat lists; a None gradient counts as zeros (the
        residual is still sent); ``tf.IndexedSlices`` are densified. Gradients of non-float
        sources are returned unchanged. Works eagerly and inside ``tf.function``.
        """
        self._use("gradients")
        size, _ = self._world()
        entries = self._entries(sources)
        out = list(gradients)
        if not entries:
            return out
        names, shapes, upds, res = [], [], [], []
        for name, v, i in entries:
            shape = _static_shape(v, name)
            r = self._residual(name, shape, v.dtype)
            g = gradients[i]
            if g is None:
                u = tf.zeros(shape, r.dtype)
            else:
                if isinstance(g, tf.IndexedSlices):
                    g = tf.convert_to_tensor(g)
                u = tf.cast(g, r.dtype)
            names.append(name), shapes.append(shape), upds.append(u), res.append(r)
        numel = sum(wire.layout_numel(s) for s in shapes)
        counted = [self.counters["steps"].assign_add(1),
                   self.counters["dense_bits"].assign_add(32 * numel)]
        with tf.control_dependencies(counted):
            code, avg, new_res, sent = self._exchange(names, shapes, upds, res, 1.0 / size,
                                                      tag)
        ops = [self._commit(res, upds, code, new_res, sent),
               self.counters["syncs"].assign_add(tf.cast(tf.equal(code, COMMIT), tf.int64))]
        with tf.control_dependencies(ops):
            for (name, v, i), a in zip(entries, avg):
                g = gradients[i]
                dt = v.dtype if g is None else g.dtype
                out[i] = tf.cast(tf.identity(a), dt)
        return out

    # -- weight mode (communication delay) ------------------------------------------------------
    @_no_autograph
    def step(self, variables, optimizer=None):
        """Count one optimizer step of ``variables``; every ``delay``-th call, synchronize.

        Call it right after ``optimizer.apply_gradients`` on every step, on every rank (the
        drop-in tape needs it, :class:`SBCCallback` does it), with the ``optimizer`` that
        stepped: it decides the default of ``local_residual`` at the first call, and a Keras
        SGD with momentum at ``delay=1`` is then folded (:mod:`horovod_sbc.tensorflow.momentum`:
        its velocity is set to zero after each step). Works eagerly and inside ``tf.function``.
        At a sync, this window's update (+ residual) is SBC-compressed for every variable, all
        messages go in one allgather, and every rank sets ``W_ref += mean over ranks``
        (bit-identical everywhere) and ``W = W_ref + R`` (``local_residual=True``) or
        ``W = W_ref`` (False).
        """
        self._use("weights")
        self._settle(self._optimizer.optimizer if optimizer is None else optimizer)
        entries = self._entries(variables)
        for name, v, _ in entries:
            self._reference(name, v, create=False)
        numel = sum(wire.layout_numel(_static_shape(v, n)) for n, v, _ in entries)
        ops = [self.local_steps.assign_add(1), self.counters["steps"].assign_add(1),
               self.counters["dense_bits"].assign_add(32 * numel), self.pending.assign(0)]
        with tf.control_dependencies(ops):
            if self.delay == 1:
                return self._synchronize(entries)
            due = tf.equal(self.local_steps.read_value() % self.delay, 0)
            return tf.cond(due, lambda: self._synchronize(entries), lambda: tf.constant(False))

    @_no_autograph
    def synchronize(self, variables):
        """Exchange the accumulated weight update now (normally :meth:`step` does it)."""
        self._use("weights")
        self._settle(self._optimizer.optimizer)
        return self._synchronize(self._entries(variables))

    def _synchronize(self, entries, tag: str = "sbc_sync"):
        size, _ = self._world()
        names, shapes, upds, res, refs = [], [], [], [], []
        for name, v, _ in entries:
            shape = _static_shape(v, name)
            ref = self._reference(name, v, create=False)
            r = self._residual(name, shape, v.dtype)
            upds.append(self._window_update(v, ref, r))
            names.append(name), shapes.append(shape), res.append(r), refs.append(ref)
        if self._fold is not None:  # counted steps are 1, 2, ...: the fold's step is one less
            k = self._fold.scale(self.counters["steps"].read_value() - 1)
            upds = [u * tf.cast(k, u.dtype) for u in upds]
        plain = self.outer.decodes_into_reference
        if not plain:
            with tf.init_scope():
                self.outer.build(names, [r.read_value() for r in res],
                                 lambda init, n: _state(init, "outer_" + tf_name(n)))
        # plain: the average of all ranks' decoded updates is added straight into W_ref
        code, decoded, new_res, sent = self._exchange(
            names, shapes, upds, res, 1.0 / size, tag,
            outs=[r.read_value() for r in refs] if plain else None)
        committed = tf.equal(code, COMMIT)
        ops = [self._commit(res, upds, code, new_res, sent),
               self.counters["syncs"].assign_add(tf.cast(committed, tf.int64)),
               self.local_steps.assign(0)]
        if self._fold is not None:
            ops += self._fold.reset()
        if plain:
            new_refs = decoded
        else:
            with tf.control_dependencies(ops):
                deltas = self.outer.delta(names, decoded, committed)
                ops += self.outer.after_commit(res, committed)
            new_refs = [tf.where(committed, tf.cast(tf.cast(ref.read_value(), d.dtype) + d,
                                                    ref.dtype), ref.read_value())
                        for ref, d in zip(refs, deltas)]
        with tf.control_dependencies(ops):
            ops = ops + [ref.assign(new) for ref, new in zip(refs, new_refs)]
        with tf.control_dependencies(ops):
            assigns = [v.assign(self._continue_from(v, ref, r))
                       for (name, v, _), ref, r in zip(entries, refs, res)]
        with tf.control_dependencies(assigns):
            return committed

    def _window_update(self, v, ref, r):
        """The update of this delay window. Shared weights (``local_residual=False``):
        ``W - W_ref``. Local residual: the weights hold ``W_ref + R`` (rounded to the variable's
        dtype) after a sync, so the window's own progress is ``W - (W_ref + R)``."""
        base = self._continue_from(v, ref, r)  # where this window started
        return tf.cast(v.read_value(), r.dtype) - tf.cast(base, r.dtype)

    def _continue_from(self, v, ref, r):
        """Where a rank continues after a sync (run after the commit): ``W_ref`` (also after a
        skip), or with ``local_residual`` ``W_ref + R`` (after a skip healthy ranks keep
        ``R + dW``, i.e. their weights, and the failing rank drops its window)."""
        if not self.local_residual:
            return ref.read_value()
        return tf.cast(tf.cast(ref.read_value(), r.dtype) + r.read_value(), v.dtype)

    @_no_autograph
    def finish(self, variables, average_residuals: Optional[bool] = None):
        """End of training in weight mode: sync a partial delay window, then give every rank the
        same weights: ``W_ref`` + the average of all ranks' residuals (one dense allreduce, then
        a broadcast from rank 0), or ``W_ref`` alone with ``average_residuals=False``. None
        (the default) averages residuals that live in the weights (``local_residual=True``)
        only, as the torch drop-in's ``finish``. Residuals are cleared. Eager only."""
        import horovod.tensorflow as hvd
        self._use("weights")
        self._settle(self._optimizer.optimizer)
        if average_residuals is None:
            average_residuals = self._local_residual
        entries = self._entries(variables)
        if int(self.local_steps.numpy()) > 0:
            self._synchronize(entries)
        for name, v, _ in entries:
            ref = self._reference(name, v, create=False)
            r = self._residual(name, _static_shape(v, name), v.dtype)
            new = tf.cast(ref.read_value(), r.dtype)
            if average_residuals:
                new = new + hvd.allreduce(r.read_value(), op=hvd.Average,
                                          name="sbc_finish_" + tf_name(name))
            v.assign(tf.cast(new, v.dtype))
            r.assign(tf.zeros_like(r))
        if average_residuals:
            hvd.broadcast_variables([tf_variable(v) for _, v, _ in entries], root_rank=0)
        for name, v, _ in entries:
            self._reference(name, v, create=False).assign(v.read_value())

    @_no_autograph
    def _check_window(self, sources):
        """Drop-in tape: make sure reference weights exist (taken now, before the first local
        step) and that step() was called after the previous gradient()."""
        self._use("weights")
        entries = self._entries(sources)
        with tf.init_scope():
            for name, v, _ in entries:
                self._residual(name, _static_shape(v, name), v.dtype)
                self._reference(name, v)
        check = tf.debugging.assert_equal(
            self.pending, tf.constant(0, tf.int64),
            message="SBC: call sbc.step(variables) after applying the gradients of every "
                    "horovod_sbc.tensorflow.DistributedGradientTape.gradient() call")
        with tf.control_dependencies([check]):
            return self.pending.assign(1)

    # -- stock horovod.tensorflow.DistributedGradientTape interface -------------------------------
    @_no_autograph
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
        shape = _static_shape(tensor, name)
        res = self._residual(name, shape, tensor.dtype)
        if name not in self.calls:
            with tf.init_scope():
                self.calls[name] = _state(tf.constant(0, tf.int64), "calls_" + tf_name(name))
        numel = wire.layout_numel(shape)
        counted = [self.counters["dense_bits"].assign_add(32 * numel),
                   self.calls[name].assign_add(1)]
        with tf.control_dependencies(counted):
            upd = tf.identity(tf.cast(tensor, res.dtype))
        batch = self._stock_batch
        if batch is None or batch.done or batch.graph is not tf.compat.v1.get_default_graph():
            batch = self._stock_batch = _StockBatch(op_sum)
        if batch.op_sum != op_sum:
            raise ValueError(f"SBC: {name!r} is reduced with another op than the gradients "
                             "grouped with it")
        batch.add(name, shape, tensor.dtype, res, upd)
        return tf.zeros([1], tensor.dtype), (batch, len(batch.names) - 1)

    @_no_autograph
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

    def _warn_ungrouped(self, batch: "_StockBatch") -> None:
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

    def _exchange_batch(self, batch: "_StockBatch") -> None:
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


class _Held:
    """The user's optimizer, held out of this module's checkpoint (``tf.Module`` would track
    it, and the user saves it already)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


class _StockBatch:
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
