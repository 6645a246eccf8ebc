"""Elastic Horovod with SBC (TensorFlow): :class:`SBCState` keeps every surviving rank's residual
across a reset, as :mod:`horovod_sbc.torch.elastic` does for PyTorch.

Horovod's ``hvd.elastic.TensorFlowKerasState`` broadcasts rank 0's variables (with the residual
in the weights, ``local_residual=True``, rank 0's residual over everybody's), calls Keras 2's
``optimizer.variables()`` (a list in Keras 3) and knows nothing of SBC's state. ``SBCState``
holds a Keras model, its optimizer and the weight-mode :class:`SBC` (drop-in tape or
``SBCCallback``) in one :class:`SBCHandler`:

* ``save()`` (``state.commit()``) copies the model's and optimizer's variables and SBC's
  residuals, shared weights ``W_ref``, counters, outer-step state and delay-window position;
  ``restore()`` assigns them back, as this worker's own state whatever rank it has now;
* ``sync()``: the *source* is the lowest rank that trained in this job (one flag allgathered).
  ``W_ref``, the model's other variables, the outer step's state, the window position and the
  user's attributes come from it (Horovod TF tensor broadcasts, one per dtype and group; the
  attributes by ``broadcast_object``). A survivor whose ``W_ref`` equals the source's keeps its
  residual, weights and optimizer state; any other worker takes the source's optimizer
  variables and starts from ``W_ref`` with a zero residual. The synced state is committed;
* ``reset()`` renews the world size and rank SBC records (``SBC.world``).

Use :func:`run`, not ``hvd.elastic.run``: Horovod 0.28.1's turns a failed collective into
``HorovodInternalError`` only when TensorFlow's message names the op type (SBC's named ones do
not), and otherwise returns None as if training had ended. Trace a ``tf.function`` step inside
the trained function (it keeps the world size it traced). Rules: docs/elastic.md.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Dict, List, Optional, Sequence

import tensorflow as tf
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError

from ..hierarchy import refuse_elastic
from .compressor import SBC
from .owner import entries, tf_variable, variable_name
from .sync.exchange import tf_name
from .sync.state import state_variable

#: dtypes sent as a same-size integer view (bitcast; bool as uint8): Horovod's TF ops do not
#: take every dtype
_WIRE_VIEW = {tf.bfloat16: tf.int16, tf.uint32: tf.int32, tf.uint64: tf.int64}
_BROADCASTS: Dict[tuple, object] = {}


def _hvd():
    import horovod.tensorflow as hvd
    return hvd


def compression_of(obj) -> Optional[SBC]:
    """The :class:`SBC` of ``obj``: an ``SBC``, an ``SBCCallback`` (its ``sbc``) or the drop-in
    tape (its ``compression``); None for anything else."""
    if isinstance(obj, SBC):
        return obj
    for attr in ("sbc", "compression"):
        c = getattr(obj, attr, None)
        if isinstance(c, SBC):
            return c
    return None


def _named_fn(name: str, dtype: tf.DType, root: int, gather: bool = False):
    """A cached ``tf.function`` around one named Horovod collective (an eager op loses its
    name, :func:`horovod_sbc.tensorflow.sync.exchange.allgather`)."""
    key = (name, dtype, root, gather)
    fn = _BROADCASTS.get(key)
    if fn is None:
        hvd = _hvd()
        op = (lambda t: hvd.allgather(t, name=name)) if gather else \
            (lambda t: hvd.broadcast(t, root, name=name))
        fn = _BROADCASTS[key] = tf.function(op, input_signature=[tf.TensorSpec([None], dtype)])
    return fn


def _broadcast(variables: Sequence[tf.Variable], root: int, tag: str, take: bool = True) -> None:
    """``root``'s values of ``variables`` (the same shapes and dtypes, in one order, on every
    rank): one named broadcast per dtype, of all its variables flattened. Every rank takes
    part; only where ``take`` are they assigned. Empty groups are skipped (no collective)."""
    by_dtype: Dict[tf.DType, List[tf.Variable]] = {}
    for v in variables:
        by_dtype.setdefault(v.dtype, []).append(v)
    for dtype in sorted(by_dtype, key=lambda d: d.name):
        vs = by_dtype[dtype]
        flat = tf.concat([tf.reshape(v.read_value(), [-1]) for v in vs], 0)
        if int(flat.shape[0]) == 0:
            continue
        wire = tf.uint8 if dtype == tf.bool else _WIRE_VIEW.get(dtype, dtype)
        sent = tf.cast(flat, wire) if dtype == tf.bool else \
            (tf.bitcast(flat, wire) if wire != dtype else flat)
        got = _named_fn(f"sbc.elastic.{tag}.{dtype.name}", wire, root)(sent)
        got = tf.cast(got, dtype) if dtype == tf.bool else \
            (tf.bitcast(got, dtype) if wire != dtype else got)
        if take:
            parts = tf.split(got, [int(v.shape.num_elements()) for v in vs])
            for v, p in zip(vs, parts):
                v.assign(tf.reshape(p, v.shape))


def _differs(old: Sequence[tf.Tensor], new: Sequence[tf.Variable]) -> bool:
    """Does any pair differ in any element?"""
    flags = [tf.reduce_any(tf.not_equal(a, b.read_value())) for a, b in zip(old, new)]
    return bool(tf.reduce_any(tf.stack(flags))) if flags else False


def _optimizer_variables(optimizer) -> List[tf.Variable]:
    """A Keras 3 optimizer's ``variables`` (a list; Keras 2's was a method), as tf.Variables."""
    vs = optimizer.variables
    return [tf_variable(v) for v in (vs() if callable(vs) else vs)]


def sbc_variables(sbc: SBC) -> Dict[str, tf.Variable]:
    """This rank's SBC state by name: residuals, shared weights, counters, delay window, draws
    and the outer step's state; not its world record (renewed at every reset)."""
    out = {f"residual/{k}": v for k, v in sbc.residuals.items()}
    out.update({f"reference/{k}": v for k, v in sbc.reference.items()})
    out.update({f"counter/{k}": v for k, v in sbc.counters.items()})
    out.update({f"calls/{k}": v for k, v in sbc.calls.items()})
    out.update({f"outer/{k}": v for k, v in getattr(sbc.outer, "buffers", {}).items()})
    out.update(local_steps=sbc.local_steps, pending=sbc.pending, draws=sbc.draws)
    return out


def renew_world(sbc: SBC) -> None:
    """Record the new world's size and rank (after Horovod's ``shutdown(); init()``): SBC's
    check that its state belongs to this world is for checkpoints, not this worker's memory."""
    with contextlib.suppress(RuntimeError, ValueError):
        sbc.world.assign([-1, -1])
        sbc._world()


class SBCHandler:
    """Commit, restore and sync of one Keras model, its optimizer and its weight-mode
    :class:`SBC` (``variables``: what ``sbc.step`` is given, by default the model's trainable
    variables). See the module docstring for the rules."""

    def __init__(self, model, optimizer, compression, variables=None):
        self.sbc = compression_of(compression)
        if self.sbc is None:
            raise ValueError("SBCState needs the SBC object of the drop-in tape or SBCCallback "
                             "(horovod_sbc.tensorflow.SBC(..., delay=n)); for training without "
                             "SBC use hvd.elastic.TensorFlowKerasState")
        refuse_elastic(self.sbc.config.hierarchy)
        self._check_mode()
        if optimizer is None:
            raise ValueError("SBCState: pass the optimizer (or compile the model with one)")
        if not getattr(model, "built", True):
            raise ValueError("SBCState: build the model first (model.build(input_shape))")
        self.model, self.optimizer = model, optimizer
        self._variables = model.trainable_variables if variables is None else variables
        if not optimizer.built:  # its variables exist from now on, on every worker alike
            optimizer.build(self._variables)
        # the outer step and freeze chosen now, as on every worker alike: a new worker's outer
        # state is created and broadcast at its first reset, before its first step
        self.sbc._settle(optimizer)
        self.joined = False  # did this worker train in this job (is its state worth keeping)?
        self.save()

    def _check_mode(self) -> None:
        if self.sbc._mode not in (None, "weights"):
            raise ValueError("SBCState supports SBC's weight mode (the drop-in "
                             "horovod_sbc.tensorflow.DistributedGradientTape with sbc.step(), "
                             f"or SBCCallback); this SBC object is used in {self.sbc._mode!r} "
                             "mode")

    # -- what the handler owns -------------------------------------------------------------------
    def owned(self):
        """(name, tf.Variable) of the variables SBC exchanges, sorted by name."""
        return [(name, v) for name, v, _ in entries(self._variables)]

    def others(self) -> List[tf.Variable]:
        """The model's other variables (non-trainable ones, e.g. BatchNorm statistics)."""
        ids = {id(v) for _, v in self.owned()}
        return [tf_variable(v) for v in self.model.variables if id(tf_variable(v)) not in ids]

    # -- commit / restore ----------------------------------------------------------------------
    def save(self) -> None:
        self._weights = [tf.identity(tf_variable(v)) for v in self.model.variables]
        self._optimizer = {_key(i, v): tf.identity(v)
                           for i, v in enumerate(_optimizer_variables(self.optimizer))}
        self._sbc = {k: tf.identity(v) for k, v in sbc_variables(self.sbc).items()}

    def restore(self) -> None:
        """Back to the last commit: the model's and optimizer's variables and SBC's state (its
        residuals, counters, ... created since are zeroed)."""
        for v, w in zip(self.model.variables, self._weights):
            tf_variable(v).assign(w)
        for i, v in enumerate(_optimizer_variables(self.optimizer)):
            saved = self._optimizer.get(_key(i, v))
            if saved is not None:
                v.assign(saved)
        for k, v in sbc_variables(self.sbc).items():
            if k in self._sbc:
                v.assign(self._sbc[k])
            elif not k.startswith("reference/"):
                v.assign(tf.zeros_like(v))

    def renew_world(self) -> None:
        renew_world(self.sbc)

    # -- sync ------------------------------------------------------------------------------------
    def source(self) -> int:
        """The lowest rank that trained in this job (0 at the job's first sync)."""
        flag = tf.constant([int(self.joined)], tf.int32)
        flags = _named_fn("sbc.elastic.joined", tf.int32, 0, gather=True)(flag).numpy()
        held = [r for r, f in enumerate(flags.tolist()) if f]
        return held[0] if held else 0

    def sync(self) -> int:
        """Make the world agree on what it shares, keep each survivor's own state (see the
        module docstring); returns the source rank."""
        self._check_mode()
        self.renew_world()
        source = self.source()
        owned = self.owned()
        self.sbc.build([v for _, v in owned])  # a new worker: W_ref = W, then overwritten
        shared = [self.sbc.reference[name] for name, _ in owned]
        keep = self.joined
        before = [tf.identity(r) for r in shared] if keep else []
        _broadcast(shared, source, "shared")
        if keep and _differs(before, shared):
            warnings.warn(f"horovod_sbc: rank {_hvd().rank()}'s shared weights differ from rank "
                          f"{source}'s (it restored an older commit): it continues from the "
                          "shared weights with a zero residual")
            keep = False
        _broadcast(_optimizer_variables(self.optimizer), source, "optimizer", take=not keep)
        _broadcast(self.others() + self._window(owned), source, "common")
        if not keep:
            self._start_from_shared(owned)
        self.joined = True
        return source

    def _window(self, owned) -> List[tf.Variable]:
        """What every rank holds alike besides ``W_ref``: the delay-window position and the
        outer step's state (created here on a new worker)."""
        outer = self.sbc.outer
        if not outer.decodes_into_reference:
            names = [n for n, _ in owned]
            res = [self.sbc.residuals[n].read_value() for n in names]
            with tf.init_scope():
                outer.build(names, res,
                            lambda init, n: state_variable(init, "outer_" + tf_name(n)))
        buffers = getattr(outer, "buffers", {})
        return [self.sbc.local_steps] + [buffers[k] for k in sorted(buffers)]

    def _start_from_shared(self, owned) -> None:
        """A new worker (or one behind the source): the shared weights, a zero residual."""
        for name, v in owned:
            v.assign(tf.cast(self.sbc.reference[name], v.dtype))
            r = self.sbc.residuals[name]
            r.assign(tf.zeros_like(r))
        self.sbc.pending.assign(0)


def _key(i: int, v) -> str:
    """An optimizer variable's key in a commit: its path (its place if it has none)."""
    with contextlib.suppress(TypeError):
        return variable_name(v)
    return f"#{i}"


class SBCState(ObjectState):
    """``hvd.elastic`` state for SBC (TensorFlow): ``SBCState(model, optimizer, sbc, **kwargs)``.

    ``sbc``: the weight-mode :class:`SBC` (of the drop-in tape, or an ``SBCCallback``);
    ``optimizer``: the Keras optimizer (None: ``model.optimizer``), built here if it is not yet;
    ``variables``: what ``sbc.step`` is given (default ``model.trainable_variables``). Other
    keyword arguments are plain attributes, broadcast from the source rank at every sync::

        state = SBCState(model, opt, sbc, epoch=0, batch=0)

        @horovod_sbc.tensorflow.elastic.run
        def train(state):
            ...
            state.commit()
    """

    def __init__(self, model, optimizer=None, compression=None, variables=None, **kwargs):
        hvd = _hvd()
        self.model, self.optimizer = model, optimizer or getattr(model, "optimizer", None)
        self.handler = SBCHandler(model, self.optimizer, compression, variables)
        self.compression = self.handler.sbc
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

    def save(self) -> None:
        self.handler.save()
        super().save()

    def restore(self) -> None:
        self.handler.restore()
        super().restore()

    def sync(self) -> None:
        """The SBC handler (module docstring), then the plain attributes from its source rank,
        and a commit."""
        with collectives():  # run_fn calls sync() outside the wrapped function
            source = self.handler.sync()
            if self._saved_state:  # ObjectState.sync, from the source instead of rank 0
                self._saved_state = _hvd().broadcast_object(self._saved_state, root_rank=source,
                                                            name="sbc.elastic.objects")
                self._set_attrs()
        self.save()

    def reset(self) -> None:
        self.handler.renew_world()
        super().reset()

    def stats(self) -> Dict[str, int]:
        """``stats()`` of the SBC object."""
        return self.compression.stats()


def _collective_failed(e: tf.errors.OpError) -> bool:
    """Did a Horovod collective fail (a peer died or left), by TensorFlow's error message?"""
    text = str(e)
    return any(s in text for s in ("Horovod", "horovod", "allgather.", "sbc.elastic.", "Gloo",
                                   "gloo"))


@contextlib.contextmanager
def collectives():
    """Turn a failed Horovod collective (a TensorFlow ``OpError`` naming Horovod) into
    ``HorovodInternalError``, which Horovod's elastic loop answers with restore, reset, sync."""
    try:
        yield
    except (tf.errors.UnknownError, tf.errors.InternalError, tf.errors.AbortedError,
            tf.errors.UnavailableError, tf.errors.FailedPreconditionError) as e:
        if _collective_failed(e):
            raise HorovodInternalError(e) from e
        raise


def run(func):
    """``hvd.elastic.run`` for TensorFlow that turns every failed Horovod collective into
    ``HorovodInternalError`` (:func:`collectives`) and raises other errors as they are."""
    def wrapper(state, *args, **kwargs):
        with collectives():
            return func(state, *args, **kwargs)

    def reset():
        hvd = _hvd()
        hvd.shutdown()
        hvd.init()
    return run_fn(wrapper, reset)


__all__ = ["SBCState", "SBCHandler", "compression_of", "run", "collectives", "sbc_variables",
           "renew_world"]
