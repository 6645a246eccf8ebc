"""The drop-in's entry point: :func:`DistributedOptimizer` wraps your optimizer for SBC with
communication delay (the machinery is :mod:`horovod_sbc.torch.optimizer`)."""
from __future__ import annotations

from typing import Optional

import torch

from ..config import resolve_compression
from .compressor import SBC
from .optimizer import dropin_class


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression: Optional[SBC] = None):
    """Wrap ``optimizer`` for SBC training with communication delay (the full feature set).

    Args:
        optimizer: your torch optimizer; the result is an instance of a subclass of its class.
        named_parameters: ``model.named_parameters()``; names key the residuals and checkpoint
            state and fix the message order (sorted by name on every rank).
        compression: an :class:`SBC` (default ``SBC()``) holding every knob: ``delay`` local
            steps between syncs, ``local_residual``, ``outer``, ``freeze_variance_after``,
            ``hierarchy`` (:class:`horovod_sbc.config.SBCConfig`). The drop-in exchanges
            weight changes whatever the optimizer (SGD's momentum is the optimizer's own);
            ``SBC(named_parameters=...)`` is refused here (pass ``named_parameters``).

    Stock Horovod helpers work as with any optimizer: ``hvd.broadcast_parameters`` and
    ``hvd.broadcast_optimizer_state`` before training (its internal initialisation step is not
    counted as a training step), LR schedulers, and ``torch.amp.GradScaler`` (a rank whose
    gradients overflow skips its local update but keeps the delay window). If you overwrite the
    weights mid-training (a broadcast or a load of model weights only), call
    :meth:`reset_reference` on every rank afterwards.

    Checkpoints: ``optimizer.state_dict()`` includes this rank's residuals, the reference weights,
    the outer step's state and the step counter within the delay window. Saved **on every rank**
    (residuals differ per rank) and loaded by the same rank, training continues exactly. Saved
    on rank 0 only and loaded by every rank (``model.load_state_dict`` first, then
    ``optimizer.load_state_dict``), every other rank starts from the shared weights with a zero
    residual (see :meth:`load_state_dict`): the ranks agree on ``W_ref`` and the outer state,
    only the other ranks' unsent updates are lost.
    """
    compression = resolve_compression(SBC, compression, "horovod_sbc.torch.SBC")
    cls = dropin_class(optimizer.__class__)
    return cls(optimizer.param_groups, named_parameters, compression)


