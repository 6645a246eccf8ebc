"""Momentum SGD under error feedback: the velocity folded into the learning rate.

Error feedback delays an update until its coordinate is among the largest of the residual; a
heavy-ball velocity replays that stale burst for another ~1/(1 - momentum) steps, and momentum
SGD through error feedback trains well below dense (docs/recipes.md). *Folding* runs
``torch.optim.SGD`` without its velocity at the learning rate the velocity converges to,
``lr * (1 - dampening) / (1 - momentum)`` (Smith, Kindermans, Ying, Le, ICLR 2018, arXiv
1711.00489), reached as the velocity of a constant gradient reaches it: at step ``t`` (from 0)
the factor is multiplied by ``1 - momentum ** (t + 1)``. Error feedback then delays the gradient
itself, as in EF-SGD (Karimireddy et al., ICML 2019, arXiv 1901.09847). Weight decay is folded
with the gradient (``lr_eff * (g + wd * w)``). Only ``torch.optim.SGD`` (and subclasses) with
``momentum > 0`` is folded; other optimizers are left as they are. Two places fold:

* the drop-in at delay 1 with ``local_residual=False``: :func:`folded` runs the user's SGD step
  with ``momentum=0`` and the folded learning rate;
* the stock Horovod hook (``SBC(momentum="fold")``): :func:`stock_fold` scales the averaged
  gradient and empties the velocity (``momentum_buffer``), which gives the same step.

Both are backed off by the optimizer's :class:`FoldGuard` when the gradient norm blows up: the
drop-in's watches this rank's gradients, the stock hook's the decoded averaged gradient
(:meth:`StockFold.observe`: every rank takes the same decision); a step the stock hook skips is
not shown to it. The guard's state is saved with the drop-in's ``state_dict()``, not with the
stock hook's ``SBC.state_dict()``. Why: docs/design.md#the-momentum-fold.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

#: the stock hook's choices for the optimizer's momentum (``SBC(momentum=...)``)
CHOICES = ("fold", "mask", "keep", "dgc", "ef21")


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


#: the fold's blow-up guard (:class:`FoldGuard`): a step whose gradient norm is more than
#: ``GUARD_SPIKE`` times its running RMS is a blow-up ...
GUARD_SPIKE = 4.0
#: ... which multiplies the part of the fold above plain SGD (``F - 1``) by ``GUARD_BACKOFF``,
GUARD_BACKOFF = 0.25
#: ... and which grows back by ``1 / GUARD_RECOVER`` of itself per calm step (x2 in ~140 steps)
GUARD_RECOVER = 200
#: ... up to a ceiling that every blow-up multiplies by this: a run that blew up with the full
#: fold does not get all of it back (it would blow up again, later)
GUARD_CEILING = 0.5
#: steps that only feed the running RMS (no verdict before)
GUARD_WARMUP = 20
#: the running RMS's weight of the newest squared norm
GUARD_EMA = 0.05


class FoldGuard:
    """Detects a blow-up of a folded run and backs the fold off (one per optimizer).

    Folding replaces the heavy ball's velocity, a low-pass filter of the gradient (gain
    ``1 / (1 - m)`` for a steady gradient, ``1 / (1 + m)`` for one that flips sign every step),
    by its steady gain at every frequency: a direction of curvature ``h`` oscillates, and
    diverges, once ``lr / (1 - m) * h > 2``, where the heavy ball holds up to
    ``lr * h < 2 * (1 + m)``: (1 + m) / (1 - m) = 19 times more curvature at m = 0.9.
    Such an oscillation shows in the gradient norm: a step whose squared gradient norm is
    above ``GUARD_SPIKE ** 2`` times its running mean multiplies :attr:`scale` (the part of
    the folded factor above 1, i.e. above the heavy ball's first step ``lr * g``) by
    ``GUARD_BACKOFF``; every calm step lets it grow back (``GUARD_RECOVER``), up to a ceiling
    that every blow-up halves (``GUARD_CEILING``): the fold is kept where it proved stable.
    The spike's own step already takes the reduced factor."""

    def __init__(self):
        self.mean_sq = 0.0   # running mean of the squared gradient norm (bias-corrected below)
        self.weight = 0.0    # sum of the running mean's weights (bias correction)
        self.seen = 0
        self.scale = 1.0
        self.ceiling = 1.0
        self.backoffs = 0
        self.pending = None  # on a device: last step's squared norm, on its way to the host

    def observe(self, sq: float) -> bool:
        """Feed this step's squared gradient norm; True if it is a blow-up (scale cut)."""
        if sq != sq or sq == float("inf"):
            spike = True
        else:
            ref = self.mean_sq / self.weight if self.weight else 0.0
            spike = self.seen >= GUARD_WARMUP and sq > GUARD_SPIKE ** 2 * ref
            if self.weight:  # a spike enters the running mean clipped
                sq = min(sq, GUARD_SPIKE ** 2 * ref)
            self.mean_sq = (1.0 - GUARD_EMA) * self.mean_sq + GUARD_EMA * sq
            self.weight = (1.0 - GUARD_EMA) * self.weight + GUARD_EMA
        self.seen += 1
        if spike:
            self.scale *= GUARD_BACKOFF
            self.ceiling *= GUARD_CEILING
            self.backoffs += 1
        else:
            self.scale = min(self.ceiling, self.scale * (1.0 + 1.0 / GUARD_RECOVER))
        return spike

    def factor(self, steady: float) -> float:
        """The folded factor under the guard: ``1 + (steady - 1) * scale`` (never below the
        heavy ball's first step, never above ``steady``)."""
        return steady if steady <= 1.0 else 1.0 + (steady - 1.0) * self.scale

    def state_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "pending"}

    def load_state_dict(self, st: dict) -> None:
        for k in vars(self):
            if k in st:
                setattr(self, k, type(getattr(self, k))(st[k]))


_GUARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def guard_enabled() -> bool:
    """Screen: ``HOROVOD_SBC_FOLD_GUARD=0`` turns the fold's guard off."""
    import os
    return os.environ.get("HOROVOD_SBC_FOLD_GUARD", "1") != "0"


def guard_of(optimizer) -> FoldGuard:
    """The :class:`FoldGuard` of ``optimizer`` (created at its first folded step)."""
    g = _GUARDS.get(optimizer)
    if g is None:
        g = _GUARDS[optimizer] = FoldGuard()
    return g


def _grad_sq_norm(groups, guard: "FoldGuard") -> Optional[float]:
    """The squared norm of the folded gradients, for :meth:`FoldGuard.observe`. On the CPU this
    step's; on a device the previous step's, copied to the host without waiting
    (``non_blocking``) one step earlier, so the guard never stalls the device (None at the
    first step)."""
    return _sq_norm([p.grad for g in groups for p in g["params"] if p.grad is not None], guard)


def _sq_norm(tensors: Sequence[torch.Tensor], guard: "FoldGuard") -> Optional[float]:
    """The squared norm of ``tensors`` for :meth:`FoldGuard.observe`, read as
    :func:`_grad_sq_norm` says (on a device: the previous call's, without waiting)."""
    if not tensors:
        return 0.0
    sq = torch.stack([n.double() for n in torch._foreach_norm(list(tensors))]).square().sum()
    if sq.device.type == "cpu":
        return float(sq)
    pending, guard.pending = guard.pending, sq.to("cpu", non_blocking=True)
    return None if pending is None else float(pending)  # its copy is done by now


@contextlib.contextmanager
def folded(optimizer, step: Optional[int] = None, guard: Optional[FoldGuard] = None,
           residuals=None):
    """Within this context ``optimizer``'s SGD groups with momentum step as plain SGD at the
    folded learning rate of ``step`` (:func:`steady_factor`), backed off by the optimizer's
    :class:`FoldGuard` (``guard``: another one; ``False``: none) when the gradient norm blows
    up; their settings (and any LR scheduler's ``lr``) are restored after.

    ``residuals``: the error-feedback residuals of these parameters that hold *folded steps*
    (weight space: the drop-in's ``lr_eff * g`` not sent yet), or a callable that returns them
    when a back-off needs them (None: none). On a back-off they are rescaled by the new factor over the old one, so
    the backlog is cut with the fold, as the stock hook's gradient-space residual is (its
    factor applies when a coordinate is sent)."""
    groups = _sgd_groups(optimizer)
    saved = [{k: g.get(k) for k in _FOLDED_KEYS} for g in groups]
    if not guard_enabled():
        guard = False
    if guard is None and groups:
        guard = guard_of(optimizer)
    try:
        if guard and groups:  # one verdict per step, on all folded gradients (one host read)
            steady = steady_factor(groups[0], step)
            before = guard.factor(steady)
            sq = _grad_sq_norm(groups, guard)
            if sq is not None and guard.observe(sq):
                cut = guard.factor(steady) / before
                rs = list(residuals() if callable(residuals) else residuals or ())
                if rs and cut < 1.0:
                    torch._foreach_mul_(rs, cut)
        for g in groups:
            factor = guard.factor(steady_factor(g, step)) if guard else steady_factor(g, step)
            g.update(lr=g["lr"] * factor, momentum=0.0, dampening=0.0, nesterov=False)
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
        #: :class:`FoldGuard` states from a checkpoint, for the folding optimizers in the order
        #: they are met (:meth:`guard_states`)
        self.pending_guards: List[dict] = []

    def guard_states(self) -> List[dict]:
        """The :class:`FoldGuard` state of every folding optimizer met, in the order met (the
        stock hook's ``state_dict()["fold_guards"]``)."""
        return [guard_of(opt).state_dict() for opt, _ in self._groups.values()
                if _sgd_groups(opt)]

    def load_guard_states(self, states: Sequence[dict]) -> None:
        """Restore :meth:`guard_states`: the folding optimizers met so far take theirs now, in
        order; the rest wait for their optimizer's first fold."""
        met = [opt for opt, _ in self._groups.values() if _sgd_groups(opt)]
        for opt, st in zip(met, states):
            guard_of(opt).load_state_dict(st)
        self.pending_guards = [dict(st) for st in states[len(met):]]

    def _group_of(self, optimizer, p: torch.Tensor) -> Optional[dict]:
        """The folded group of ``p`` (None: not folded); looked up again when ``p`` is new
        (``add_param_group``). A folding optimizer met for the first time takes the next
        checkpointed guard state."""
        cached = self._groups.get(id(optimizer))
        if cached is None and self.pending_guards and _sgd_groups(optimizer):
            guard_of(optimizer).load_state_dict(self.pending_guards.pop(0))
        if cached is None or cached[0] is not optimizer or id(p) not in cached[1]:
            folded_groups = [id(g) for g in _sgd_groups(optimizer)]
            by_param = {id(q): (g if id(g) in folded_groups else None)
                        for g in getattr(optimizer, "param_groups", []) for q in g["params"]}
            cached = self._groups[id(optimizer)] = (optimizer, by_param)
        return cached[1].get(id(p))

    def observe(self, owners: Sequence, grads: Sequence[torch.Tensor]) -> None:
        """Feed the :class:`FoldGuard` of each folding optimizer among ``owners`` the squared
        norm of its folded parameters' decoded averaged gradients ``grads`` (one verdict per
        optimizer and step; on a device the previous step's norm, read without waiting). The
        average is the same on every rank, so is every rank's verdict: the ranks' weights stay
        identical. Called after the decode, before :meth:`plan`, on steps that are applied
        only (a skipped step is not observed)."""
        by_opt: Dict[int, Tuple[object, List[torch.Tensor]]] = {}
        for o, g in zip(owners, grads):
            if o.optimizer is not None and o.parameter is not None and \
                    self._group_of(o.optimizer, o.parameter) is not None:
                by_opt.setdefault(id(o.optimizer), (o.optimizer, []))[1].append(g)
        for opt, gs in by_opt.values():
            guard = guard_of(opt)
            sq = _sq_norm(gs, guard)
            if sq is not None:
                guard.observe(sq)

    def plan(self, owners: Sequence, step: Optional[int] = None, guard: bool = True
             ) -> List[Optional[Tuple[float, float, torch.Tensor]]]:
        """Per owner at ``step``: ``(scale, weight-decay term, velocity)`` or None (not
        folded).

        Horovod's SGD step after the hook, with its velocity set to zero, moves the weight by
        ``lr * a * (grad + wd * w)`` with ``a = 1 - dampening`` (heavy ball) or ``1 + momentum``
        (Nesterov). The folded step is ``lr * F * (avg + wd * w)`` with ``F`` the steady
        factor at ``step`` under the optimizer's :class:`FoldGuard` (``guard=False``: the
        steady factor itself), so the hook returns ``grad = k * avg + (k - 1) * wd * w``,
        ``k = F / a``. The hook's residual is in gradient space (a coordinate takes the
        factor of the step that sends it), so a back-off needs no rescaling of it."""
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
            steady = steady_factor(g, step)
            k = (guard_of(o.optimizer).factor(steady) if guard else steady) / a
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
