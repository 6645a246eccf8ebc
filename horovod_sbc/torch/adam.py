"""Adam's second moment frozen after a warm-up: local Adam steps that are linear in the gradient.

The drop-in optimizer averages the ranks' *weight changes*, and Adam's per-rank normalisation
makes that average up to sqrt(N) shorter than Adam's step on the averaged gradient. With the
second moment held fixed, Adam is momentum SGD with a fixed diagonal preconditioner: linear in
the gradients, so the average of the ranks' steps is the step on the averaged gradient (1-bit
Adam, Tang et al., ICML 2021, arXiv 2102.02888; 0/1 Adam, Lu et al., arXiv 2202.06009). Every
rank trains with its own Adam during the first ``freeze_variance_after`` steps (compressed),
and from then on :func:`frozen_step` replaces the user's ``step()``:

* the first moment ``exp_avg`` and the step count go on as in Adam (bias correction of the first
  moment included), weight decay as the optimizer does it (decoupled for AdamW, added to the
  gradient for Adam), ``maximize`` honoured;
* the second moment is the bias-corrected ``exp_avg_sq`` of the freeze (``max_exp_avg_sq`` with
  ``amsgrad``), stored in place once: ``exp_avg_sq / (1 - beta2 ** step)``;
* a parameter whose first gradient arrives after the freeze takes that gradient's square; the
  frozen variance is raised to ``config.ADAM_VARIANCE_FLOOR`` (1e-3) times its tensor's mean
  (where the whole tensor saw no gradient, set to the square of its gradient at the freeze),
  so that a coordinate dead through the warm-up does not divide a later gradient by ``eps``;
* the learning rate, betas, eps and weight decay are read from the parameter groups at every
  step, so LR schedulers act on it as on Adam.

Why, when ``"auto"`` freezes, and why the floor: docs/design.md#adams-variance-freeze.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..config import ADAM_VARIANCE_FLOOR
from ..policy import auto_freeze_step


def is_adam(optimizer) -> bool:
    """``torch.optim.Adam`` and its subclasses (``AdamW`` is one)."""
    return isinstance(optimizer, torch.optim.Adam)


def is_rmsprop(optimizer) -> bool:
    """``torch.optim.RMSprop`` and its subclasses: a second moment, ``square_avg``, averaged
    with weight ``1 - alpha``, which :func:`frozen_step` freezes as it does Adam's."""
    return isinstance(optimizer, torch.optim.RMSprop)


def freezable(optimizer) -> bool:
    """Can :func:`frozen_step` hold this optimizer's second moment fixed?"""
    return (is_adam(optimizer) or is_rmsprop(optimizer)) and not _unsupported_mode(optimizer)


def variance_beta(group: dict) -> float:
    """The weight of the old second moment in one step: Adam's ``beta2``, RMSprop's
    ``alpha``."""
    return float(group["betas"][1]) if "betas" in group else float(group["alpha"])


class FreezeAt:
    """Freeze after a fixed number of steps ``K`` (``freeze_variance_after=K``)."""
    auto = False

    def __init__(self, steps: int):
        self.steps = steps

    def due(self, optimizer, done: int) -> bool:
        """Is the step after ``done`` steps a frozen one?"""
        return done >= self.steps

    def state_dict(self) -> dict:
        return {"kind": "at", "steps": self.steps}

    def load_state_dict(self, st: dict) -> None:
        pass  # the user's K stands


class AutoFreeze:
    """Freeze when :func:`horovod_sbc.policy.auto_freeze_step` says, from the run itself: the
    learning rate of the parameter groups (host floats: no device read) tells where the
    warm-up ended; ``beta2`` how long the variance takes to forget it. Every rank sees the same
    schedule, so every rank freezes at the same step. Its state (the learning rate seen last,
    the end of the warm-up, the step it froze at) is saved with the optimizer's."""
    auto = True

    def __init__(self):
        self.last_lr: Optional[float] = None
        self.warmup_end = 0
        self.frozen_at: Optional[int] = None

    def due(self, optimizer, done: int) -> bool:
        if self.frozen_at is not None:
            return done >= self.frozen_at
        lr = max(float(g["lr"]) for g in optimizer.param_groups)
        rising = self.last_lr is not None and lr > self.last_lr
        self.last_lr = lr
        if rising or done == 0:
            self.warmup_end = done
            return False
        beta2 = max(variance_beta(g) for g in optimizer.param_groups)
        if done >= auto_freeze_step(self.warmup_end, beta2):
            self.frozen_at = done
            return True
        return False

    def state_dict(self) -> dict:
        return {"kind": "auto", "last_lr": self.last_lr, "warmup_end": self.warmup_end,
                "frozen_at": self.frozen_at}

    def load_state_dict(self, st: dict) -> None:
        if st.get("kind") == "auto":
            self.last_lr, self.warmup_end = st["last_lr"], int(st["warmup_end"])
            self.frozen_at = None if st["frozen_at"] is None else int(st["frozen_at"])


def check_freeze(freeze_after, optimizer):
    """``freeze_variance_after`` as given to the drop-in: ``"auto"`` (the default: for torch
    Adam/AdamW, :class:`AutoFreeze`; nothing for other optimizers), ``None`` (never), or a step
    count >= 1 (:class:`FreezeAt`, Adam only)."""
    if freeze_after is None:
        return None
    if freeze_after == "auto" and isinstance(freeze_after, str):
        return AutoFreeze() if freezable(optimizer) else None
    if isinstance(freeze_after, bool) or not isinstance(freeze_after, int) or freeze_after < 1:
        raise ValueError(f"freeze_variance_after must be 'auto', None or an int >= 1, got "
                         f"{freeze_after!r}")
    if not (is_adam(optimizer) or is_rmsprop(optimizer)):
        raise ValueError(f"freeze_variance_after applies to torch.optim.Adam, AdamW and "
                         f"RMSprop, not {type(optimizer).__name__}")
    if _unsupported_mode(optimizer):
        raise ValueError("freeze_variance_after does not support Adam's capturable, fused "
                         "or differentiable modes")
    return FreezeAt(freeze_after)


def _unsupported_mode(optimizer) -> bool:
    return any(g.get("capturable") or g.get("fused") or g.get("differentiable")
               for g in optimizer.param_groups)


def _second_moment(state: dict, amsgrad: bool) -> torch.Tensor:
    return state["max_exp_avg_sq"] if amsgrad else state["exp_avg_sq"]


def _freeze(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """Store the bias-corrected second moment of ``p`` in place (once per parameter)."""
    beta2 = float(group["betas"][1])
    amsgrad = group.get("amsgrad", False)
    if "exp_avg_sq" not in state:  # first gradient after the freeze: Adam's first step's
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = grad.square()
        if amsgrad:
            state["max_exp_avg_sq"] = state["exp_avg_sq"].clone()
    else:
        # Adam's CPU step counter (capturable mode, refused above, would keep it on the device)
        _second_moment(state, amsgrad).div_(1.0 - beta2 ** float(state["step"]))
    _floor_variance(_second_moment(state, amsgrad), grad)
    state["sbc_variance_frozen"] = torch.tensor(1.0)


def _floor_variance(v: torch.Tensor, grad: torch.Tensor) -> None:
    """The frozen variance ``v`` raised to ``ADAM_VARIANCE_FLOOR`` times the tensor's mean, or
    where the whole tensor is zero set to ``grad ** 2``; on the device, no host read."""
    mean = v.mean()
    v.copy_(torch.where(mean > 0, torch.maximum(v, mean * ADAM_VARIANCE_FLOOR), grad.square()))


def _freeze_rmsprop(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """RMSprop's second moment, once per parameter: ``square_avg`` (minus the squared mean
    gradient when ``centered``), floored as Adam's is; stored as ``square_avg``."""
    if "square_avg" not in state:  # first gradient after the freeze
        state["step"] = torch.tensor(0.0)
        state["square_avg"] = grad.square()
        if group.get("momentum", 0) > 0:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    elif group.get("centered", False):
        state["square_avg"].addcmul_(state["grad_avg"], state["grad_avg"], value=-1)
    _floor_variance(state["square_avg"], grad)
    state["sbc_variance_frozen"] = torch.tensor(1.0)


def _rmsprop_frozen_step(optimizer, group: dict, params, grads, states) -> None:
    """RMSprop's step with ``square_avg`` held fixed (momentum and weight decay as RMSprop)."""
    for p, g, st in zip(params, grads, states):
        if "sbc_variance_frozen" not in st:
            _freeze_rmsprop(p, g, st, group)
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    if wd:
        grads = torch._foreach_add(grads, params, alpha=wd)
    torch._foreach_add_([st["step"] for st in states], 1.0)
    denom = torch._foreach_sqrt([st["square_avg"] for st in states])
    torch._foreach_add_(denom, eps)
    mu = float(group.get("momentum", 0))
    if mu > 0:
        bufs = [st["momentum_buffer"] for st in states]
        torch._foreach_mul_(bufs, mu)
        torch._foreach_addcdiv_(bufs, grads, denom)
        torch._foreach_add_(params, bufs, alpha=-lr)
    else:
        torch._foreach_addcdiv_(params, grads, denom, value=-lr)


@torch.no_grad()
def frozen_step(optimizer) -> None:
    """One step of ``optimizer`` (torch Adam/AdamW or RMSprop) with the second moment held
    fixed."""
    for group in optimizer.param_groups:
        if is_rmsprop(optimizer):
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if group.get("maximize", False):
                grads = torch._foreach_neg(grads)
            if params:
                _rmsprop_frozen_step(optimizer, group, params, grads,
                                     [optimizer.state[p] for p in params])
            continue
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        beta1 = float(group["betas"][0])
        lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        amsgrad = group.get("amsgrad", False)
        grads: List[torch.Tensor] = [p.grad for p in params]
        if group.get("maximize", False):
            grads = torch._foreach_neg(grads)
        states = [optimizer.state[p] for p in params]
        for p, g, st in zip(params, grads, states):
            if "sbc_variance_frozen" not in st:
                _freeze(p, g, st, group)
        if wd:
            if group.get("decoupled_weight_decay", False):
                torch._foreach_mul_(params, 1.0 - lr * wd)
            else:
                grads = torch._foreach_add(grads, params, alpha=wd)
        steps = [st["step"] for st in states]
        torch._foreach_add_(steps, 1.0)
        exp_avgs = [st["exp_avg"] for st in states]
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        denom = torch._foreach_sqrt([_second_moment(st, amsgrad) for st in states])
        torch._foreach_add_(denom, eps)
        scales = [-lr / (1.0 - beta1 ** float(s)) for s in steps]
        torch._foreach_addcdiv_(params, exp_avgs, denom, scales)


def family(optimizer) -> str:
    """The optimizer's family for :func:`horovod_sbc.policy.choose`: ``"sgd"`` for
    ``torch.optim.SGD`` (and subclasses), ``"adam"`` for Adam/AdamW whose variance
    :func:`frozen_step` can freeze, ``"adaptive"`` for everything else."""
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if freezable(optimizer):
        return "adam"
    return "adaptive"
