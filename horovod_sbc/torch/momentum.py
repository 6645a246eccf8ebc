"""Momentum SGD under error feedback: the velocity folded into the learning rate.

Error feedback delays an update until its coordinate is among the largest of the residual (every
~1/density steps at delay 1). A heavy-ball velocity computed meanwhile from gradients taken where
nothing has moved yet keeps pushing the same way, and the coordinate then arrives in one stale
burst that the velocity replays for another ~1/(1 - momentum) steps: momentum SGD through error
feedback trains well below dense (docs/recipes.md), on IID and label-skewed shards alike.

*Folding* runs ``torch.optim.SGD`` without its velocity at the learning rate the velocity
converges to, ``lr * (1 - dampening) / (1 - momentum)`` (the "effective learning rate" of
momentum SGD; Smith, Kindermans, Ying, Le, "Don't Decay the Learning Rate, Increase the Batch
Size", ICLR 2018, arXiv 1711.00489), reached as the velocity of a constant gradient reaches it:
at step ``t`` (from 0) the factor is multiplied by ``1 - momentum ** (t + 1)``, so the first
steps are as short as the heavy ball's. Error feedback then delays the gradient itself, as in
EF-SGD (Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
Schemes", ICML 2019, arXiv 1901.09847), and every coordinate's delayed step is applied once. Weight decay is
folded with the gradient (``lr_eff * (g + wd * w)``, the heavy ball's steady state). Only
``torch.optim.SGD`` (and subclasses) with ``momentum > 0`` is folded; other optimizers are left
as they are.

Two places fold:

* the drop-in optimizer at delay 1 with the residual kept beside the weights
  (``local_residual=False``, its default for SGD at delay 1): :func:`folded` runs the user's SGD step with ``momentum=0`` and the folded learning rate;
* the stock Horovod hook (``SBC(momentum="fold")``): Horovod's optimizer steps after the hook
  returns the averaged gradient, so :func:`stock_fold` scales that gradient and empties the
  velocity (``momentum_buffer``) instead, which gives the same step.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

#: the stock hook's choices for the optimizer's momentum (``SBC(momentum=...)``)
CHOICES = ("fold", "mask", "keep")


def check_choice(momentum) -> str:
    if momentum not in CHOICES:
        raise ValueError(f"momentum must be one of {', '.join(map(repr, CHOICES))}, "
                         f"got {momentum!r}")
    return momentum


def _sgd_groups(optimizer) -> List[dict]:
    """The parameter groups of ``optimizer`` that folding changes: torch SGD with momentum
    (not ``maximize``)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return []
    return [g for g in optimizer.param_groups
            if g.get("momentum", 0) and not g.get("maximize", False)]


def steady_factor(group: dict, step: Optional[int] = None) -> float:
    """The factor between the step a constant gradient converges to under the group's
    momentum and the plain SGD step: ``(1 - dampening) / (1 - momentum)`` (heavy ball and
    Nesterov alike); at ``step`` (from 0), the part of it the velocity has reached,
    times ``1 - momentum ** (step + 1)``."""
    mu, d = float(group["momentum"]), float(group.get("dampening", 0.0))
    factor = (1.0 - d) / (1.0 - mu)
    return factor if step is None else factor * (1.0 - mu ** (step + 1))


_FOLDED_KEYS = ("lr", "momentum", "dampening", "nesterov")


@contextlib.contextmanager
def folded(optimizer, step: Optional[int] = None):
    """Within this context ``optimizer``'s SGD groups with momentum step as plain SGD at the
    folded learning rate of ``step`` (:func:`steady_factor`); their settings (and any LR
    scheduler's ``lr``) are restored after."""
    groups = _sgd_groups(optimizer)
    saved = [{k: g.get(k) for k in _FOLDED_KEYS} for g in groups]
    try:
        for g in groups:
            g.update(lr=g["lr"] * steady_factor(g, step), momentum=0.0, dampening=0.0,
                     nesterov=False)
        yield
    finally:
        for g, s in zip(groups, saved):
            g.update(s)


class StockFold:
    """The stock hook's fold for one optimizer: per parameter, the gradient scale and the
    weight-decay term that turn the zero-velocity SGD step into the folded step. A parameter of
    a group without momentum (or of another optimizer) is not folded."""

    def __init__(self):
        self._groups: Dict[int, Tuple[object, Dict[int, dict]]] = {}

    def _group_of(self, optimizer, p: torch.Tensor) -> Optional[dict]:
        """The folded group of ``p`` (None: not folded); looked up again when ``p`` is new
        (``add_param_group``)."""
        cached = self._groups.get(id(optimizer))
        if cached is None or cached[0] is not optimizer or id(p) not in cached[1]:
            folded_groups = [id(g) for g in _sgd_groups(optimizer)]
            by_param = {id(q): (g if id(g) in folded_groups else None)
                        for g in getattr(optimizer, "param_groups", []) for q in g["params"]}
            cached = self._groups[id(optimizer)] = (optimizer, by_param)
        return cached[1].get(id(p))

    def plan(self, owners: Sequence, step: Optional[int] = None
             ) -> List[Optional[Tuple[float, float, torch.Tensor]]]:
        """Per owner at ``step``: ``(scale, weight-decay term, velocity)`` or None (not
        folded).

        Horovod's SGD step after the hook, with its velocity set to zero, moves the weight by
        ``lr * a * (grad + wd * w)`` with ``a = 1 - dampening`` (heavy ball) or ``1 + momentum``
        (Nesterov). The folded step is ``lr * F * (avg + wd * w)`` with ``F`` the steady
        factor at ``step``, so the hook returns ``grad = k * avg + (k - 1) * wd * w``,
        ``k = F / a``."""
        out = []
        for o in owners:
            p = o.parameter
            g = self._group_of(o.optimizer, p) if o.optimizer is not None and p is not None \
                else None
            if g is None:
                out.append(None)
                continue
            mu = float(g["momentum"])
            a = (1.0 + mu) if g.get("nesterov", False) else 1.0 - float(g.get("dampening", 0.0))
            k = steady_factor(g, step) / a
            state = o.optimizer.state[p]
            buf = state.get("momentum_buffer")
            if not isinstance(buf, torch.Tensor) or buf.shape != p.shape:
                # a zero velocity from the first step on, so that SGD takes its buffered branch
                buf = state["momentum_buffer"] = torch.zeros_like(
                    p, memory_format=torch.preserve_format)
            out.append((k, (k - 1.0) * float(g.get("weight_decay", 0.0)), buf))
        return out


def stock_fold(plan, grads: Optional[Sequence[torch.Tensor]],
               params: Sequence[torch.Tensor]) -> None:
    """Apply :meth:`StockFold.plan`: every folded parameter's velocity set to zero and, unless
    ``grads`` is None (a skipped step), its averaged gradient turned into ``k * grad + c * w``
    in place (a few foreach kernels per distinct ``(k, c)``, no host read)."""
    by_scale: Dict[Tuple[float, float], List[int]] = {}
    bufs = []
    for i, item in enumerate(plan):
        if item is not None:
            by_scale.setdefault(item[:2], []).append(i)
            bufs.append(item[2])
    if bufs:
        torch._foreach_zero_(bufs)
    if grads is None:
        return
    for (k, c), idx in by_scale.items():
        gs = [grads[i] for i in idx]
        torch._foreach_mul_(gs, k)
        if c:
            torch._foreach_add_(gs, [params[i].detach() for i in idx], alpha=c)
