"""TensorFlow 2 adapter of horovod_sbc (Sparse Binary Compression, arXiv 1805.08768).

* :class:`SBC` — the compressor and its state (a ``tf.Module``: residuals, reference weights and
  counters are ``tf.Variable`` s tracked by ``tf.train.Checkpoint``). One-line change to stock
  Horovod: ``hvd.DistributedGradientTape(tape, compression=SBC(density=0.01))``.
* :func:`DistributedGradientTape` — drop-in: weight updates exchanged by :meth:`SBC.step` after
  each optimizer step (one fused allgather per sync, any delay), Keras 3 variables accepted; eager
  and ``tf.function``.
* :class:`SBCCallback` — Keras 3 ``model.fit`` with SBC (imported lazily: needs ``keras``).
* :func:`broadcast_variables` — start all ranks equal (accepts Keras 3 variables).
* :func:`compress` / :func:`decompress` — the single-tensor codec (TF ops).
* :class:`SBCState` — elastic Horovod (:mod:`horovod_sbc.tensorflow.elastic`: each survivor
  keeps its residual; run the training function under its ``run``).
* :class:`Plain`, :class:`Nesterov`, :class:`ErrorDecay` — the outer step, the same classes as
  torch's (``SBC(0.01, delay=16, outer=Nesterov(lr=1.0, momentum=0.5))``, :mod:`horovod_sbc.outer`).
* :func:`hierarchy_process_sets` — the Horovod process sets of ``SBC(hierarchy=groups)``, to
  declare at initialisation (:mod:`horovod_sbc.tensorflow.hierarchy`).

See docs/tensorflow.md.
"""
try:
    import tensorflow  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by tests/test_package.py in a subprocess
    raise ImportError("horovod_sbc.tensorflow needs TensorFlow: pip install "
                      "'horovod_sbc[tensorflow]' (and Horovod built with HOROVOD_WITH_TENSORFLOW=1; "
                      "see scripts/install.sh)") from e

from .backend import compress, decompress
from .compressor import SBC
from .hierarchy import hierarchy_process_sets
from ..outer import ErrorDecay, Nesterov, Plain
from .tape import DistributedGradientTape, broadcast_variables

__all__ = ["SBC", "DistributedGradientTape", "SBCCallback", "broadcast_variables", "compress",
           "decompress", "Plain", "Nesterov", "ErrorDecay", "SBCState",
           "hierarchy_process_sets"]


def __getattr__(name):
    if name == "SBCCallback":  # keras is imported only when the callback is asked for
        from .callback import SBCCallback
        return SBCCallback
    if name == "SBCState":  # elastic Horovod (horovod_sbc.tensorflow.elastic), when asked for
        from .elastic import SBCState
        return SBCState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
