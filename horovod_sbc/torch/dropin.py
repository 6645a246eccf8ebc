"""The drop-in's entry point: :func:`DistributedOptimizer` wraps your optimizer for SBC with
communication delay (the machinery is :mod:`horovod_sbc.torch.optimizer`)."""
from __future__ import annotations

from typing import Optional

import torch

from ..config import resolve_compression
from .compressor import SBC
from .optimizer import dropin_class


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression: Optional[SBC] = None,
                         local_residual: Optional[bool] = None,
                         outer=None, freeze_variance_after="auto"):
    """Wrap ``optimizer`` for SBC training with communication delay (the full feature set).

    Args:
        optimizer: your torch optimizer; the result is an instance of a subclass of its class.
        named_parameters: ``model.named_parameters()``; names key the residuals and checkpoint
            state and fix the message order (sorted by name on every rank).
        compression: an :class:`SBC` (default ``SBC()``); its ``delay`` is the number of local
            steps between syncs; ``SBC(hierarchy=...)`` exchanges densely inside each node
            and compresses between nodes (:mod:`horovod_sbc.torch.hierarchy`; built on every
            rank, it checks the grouping and adds Horovod's process sets here).
        local_residual: ``None`` (default): ``False`` for ``torch.optim.SGD`` (plain or with
            momentum) at ``delay=1``, ``True`` otherwise (the module docstring says why).
            ``True``: after a sync every rank continues from the shared weights plus its own
            unsent residual (with ``SBC(hierarchy=...)``: its node's); ranks' weights differ by
            their residuals until :meth:`finish`. ``False``: every rank continues from the
            shared weights (bit-identical after every sync); at ``delay=1`` SGD's momentum is
            then folded into its learning rate (:mod:`horovod_sbc.torch.momentum`).
        outer: the outer step that turns each sync's averaged update ``U`` into the change of
            the shared weights (:mod:`horovod_sbc.torch.outer`): ``None`` or ``Plain()``
            (default): ``W_ref += U``, as in the SBC paper; ``Plain(lr=sqrt(N))`` for N ranks
            with an adaptive optimizer at ``delay=1`` (Adam, AdamW: the average of N
            normalized updates is up to sqrt(N) shorter than one step on the averaged
            gradient);
            ``Nesterov(lr=0.7, momentum=0.9)``: DiLoCo's outer Nesterov momentum on the
            pseudo-gradient ``-U`` (arXiv 2311.08105); ``ErrorDecay(decay, lr)``: SparseLoCo's
            decayed error feedback (arXiv 2508.15706). The live weights of a rank whose
            residual lives in them move by the same change, so its unsent residual stays. Its
            state (momentum buffers) is identical on every rank and saved in
            ``state_dict()``.
        freeze_variance_after: for torch Adam and AdamW, when every rank's second moment is
            frozen (bias-corrected, in place) so that its steps go on with the first moment
            only, linear in the gradients: their average is then the step on the averaged
            gradient (1-bit Adam's variance freeze; :mod:`horovod_sbc.torch.adam`).
            ``"auto"`` (default): chosen from the run, :func:`horovod_sbc.policy.auto_freeze_step`
            (three time constants of the variance's average after the learning-rate warm-up,
            at most 100 steps after it); a number K: after K steps; ``None``: never. Other
            optimizers: ``"auto"`` and ``None`` do nothing, a number is an error. The
            frozen state and the decision live in ``state_dict()``, so a resumed run freezes
            where the first one would have.

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
    return cls(optimizer.param_groups, named_parameters, compression, local_residual, outer,
               freeze_variance_after)


