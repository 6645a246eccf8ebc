"""PyTorch adapter of horovod_sbc.

* :class:`SBC` — the compressor; ``hvd.DistributedOptimizer(opt, named_parameters=...,
  compression=SBC(density=0.01))`` with stock ``horovod.torch``.
* :func:`DistributedOptimizer` — drop-in with communication delay, one fused allgather per sync,
  checkpointable residuals.
* :class:`TopK`, :class:`FedAvg`, :class:`SignSGD`, :class:`TernGrad` — baselines in the same
  exchange (values instead of one mean; dense with communication delay; 1 bit per element;
  stochastic ternary).
* :func:`broadcast_state` — start all ranks equal (parameters, optimizer state, reference weights).
* :class:`Plain`, :class:`Nesterov`, :class:`ErrorDecay` — the outer step, the same classes as
  TensorFlow's (``SBC(0.01, delay=16, outer=Nesterov(lr=0.7, momentum=0.9))``,
  :mod:`horovod_sbc.outer`).
* :func:`hierarchy_process_sets` — the Horovod process sets ``SBC(hierarchy=[[0, 1], [2, 3]])``
  needs, to declare at ``hvd.init`` (see :mod:`horovod_sbc.torch.hierarchy`).
* :mod:`horovod_sbc.torch.ddp` — without Horovod: a DistributedDataParallel comm hook
  (``SBCState``, ``sbc_hook``) and ``SBCModelAverager`` for ``torch.distributed``.
"""
try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by tests/test_package.py in a subprocess
    raise ImportError("horovod_sbc.torch needs PyTorch: pip install 'horovod_sbc[torch]' "
                      "(and Horovod built with HOROVOD_WITH_PYTORCH=1; see scripts/install.sh)") from e

from .compressor import SBC, FedAvg, SignSGD, TernGrad, TopK
from .hierarchy import hierarchy_process_sets
from .dropin import DistributedOptimizer
from .optimizer import broadcast_state
from ..outer import ErrorDecay, Nesterov, Plain

__all__ = ["SBC", "TopK", "FedAvg", "SignSGD", "TernGrad", "DistributedOptimizer", "broadcast_state",
           "Plain", "Nesterov", "ErrorDecay", "hierarchy_process_sets"]
