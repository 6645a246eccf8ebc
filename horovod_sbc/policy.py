"""Which algorithm an optimizer gets: one framework-free rule, read by torch and TensorFlow.

SBC can exchange two things. The *gradients*: every rank's gradient is compressed with error
feedback, the average decoded, and your optimizer steps on it (stock Horovod's contract). Or the
*weight change*: every rank runs your optimizer on its own gradients and the change of its
weights since the shared weights ``W_ref`` is compressed, the unsent rest staying in the rank's
weights (the SBC paper's communication delay with error feedback; DiLoCo, arXiv 2311.08105,
with ``delay`` local steps). Every optimizer whose step the package can wrap exchanges weight
changes, at every ``delay``: an optimizer with state (SGD's velocity, Adam's moments) then sees
its own steps at once instead of the average's late bursts, and the task matrix
(``benchmarks/matrix.json``, docs/recipes.md) chose it over every gradient-exchange variant
screened for momentum SGD. Per family:

* SGD (with or without momentum, Nesterov, weight decay): the user's step, nothing changed;
  the average applied as it is (``outer=Plain()``).
* Adam, AdamW and RMSprop: their second moment frozen automatically (:func:`auto_freeze_step`;
  1-bit Adam, arXiv 2102.02888), which makes their steps linear in the gradient as SGD's are;
  with a delay the average is applied by ``Nesterov(lr=1.0, momentum=0.5)`` (DiLoCo's outer
  step with less momentum).
* other adaptive optimizers (Adagrad, Adamax, NAdam, RAdam, ...) keep normalising each rank's
  step by its own statistics: where noise dominates the average of N such steps is up to
  sqrt(N) shorter, so at delay 1 it is applied times sqrt(N) (``outer=Plain(lr=sqrt(N))``).
* an optimizer the adapter was not given (TF's stock tape without ``SBC(optimizer=)``, torch's
  stock hook given ``named_parameters`` alone): the gradients, the user's optimizer applying the
  average as it would the dense one.

:func:`choose` is the whole rule; the torch hook, the torch drop-in, the DDP averager and the
TensorFlow adapters ask it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

#: an optimizer's family, as the adapters describe it: ``"sgd"`` (step linear in the gradient,
#: with or without momentum), ``"adam"`` (Adam/AdamW/RMSprop, whose second moment the package
#: can freeze), ``"adaptive"`` (any other optimizer with per-coordinate state: Adagrad, Adamax,
#: NAdam, RAdam, LAMB-style, ...), ``"unknown"`` (an optimizer the adapter was not given: TF's
#: ``sbc.step(variables)`` without one, or its stock tape without ``SBC(optimizer=)``)
FAMILIES = ("sgd", "adam", "adaptive", "unknown")

#: the automatic freeze waits this many variance time constants ``1 / (1 - beta2)`` after the
#: warm-up: the moving average has then forgotten the warm-up's gradients (the weight left on
#: them, ``beta2 ** (3 / (1 - beta2))``, is about e^-3 = 5 %)...
FREEZE_TIME_CONSTANTS = 3
#: ...but no more than this many steps (with beta2 = 0.999 three time constants are 3,000
#: steps; 100 steps already average 100 gradients per coordinate)
FREEZE_MAX_WAIT = 100


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` decided for one optimizer."""
    exchange: str          # "gradients" or "weights"
    local_residual: bool   # weights: the unsent update stays in each rank's weights
    auto_freeze: bool      # the second moment frozen at auto_freeze_step()
    outer: str = "plain"   # weights: the outer step when SBC(outer=None), see outer_step()


def choose(family: str, *, delay: int = 1, api: str = "stock",
           local_residual: Optional[bool] = None) -> Choice:
    """The algorithm for an optimizer of ``family`` at ``delay``, through ``api`` (``"stock"``:
    Horovod's optimizer or tape with ``compression=SBC``; ``"dropin"``: the package's own).
    ``local_residual`` is the user's override (None: in the weights). An ``"unknown"`` optimizer
    exchanges gradients through the stock API (there is no step to wrap) and weight changes in
    the drop-in."""
    if family not in FAMILIES:
        raise ValueError(f"optimizer family must be one of {FAMILIES}, got {family!r}")
    if api not in ("stock", "dropin"):
        raise ValueError(f"api must be 'stock' or 'dropin', got {api!r}")
    if family == "unknown" and api == "stock":
        return Choice("gradients", False, False)
    lr = True if local_residual is None else local_residual
    outer = "plain"
    if family == "adaptive" and delay == 1:
        outer = "sqrt_n"
    elif family == "adam" and delay > 1 and lr:
        outer = "nesterov"
    return Choice("weights", lr, family == "adam", outer)


#: ``Choice.outer == "nesterov"``: DiLoCo's outer step with a milder momentum
NESTEROV_LR, NESTEROV_MOMENTUM = 1.0, 0.5


def outer_step(choice: Choice, ranks: int):
    """The outer step (:mod:`horovod_sbc.outer`) the package applies when the user left
    ``SBC(outer=None)``: ``Plain()``, ``Plain(lr=sqrt(ranks))`` or ``Nesterov(1.0, 0.5)``."""
    from .outer import Nesterov, Plain
    if choice.outer == "sqrt_n":
        return Plain(lr=math.sqrt(max(1, ranks)))
    if choice.outer == "nesterov":
        return Nesterov(lr=NESTEROV_LR, momentum=NESTEROV_MOMENTUM)
    return Plain()


def auto_freeze_step(warmup_end: int, beta2: float) -> int:
    """The step after which the second moment is frozen: ``FREEZE_TIME_CONSTANTS`` time
    constants of its moving average (``beta2``: Adam's ``betas[1]``, RMSprop's ``alpha``) after
    the learning-rate warm-up ended (``warmup_end``: the last step whose learning rate was above
    the one before; 0 without a warm-up), at most ``FREEZE_MAX_WAIT`` steps after it. 1-bit Adam
    (arXiv 2102.02888) freezes by hand after 15-25 % of training; this asks no total step
    count."""
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"the second moment's beta2 (RMSprop's alpha) must be in [0, 1) to "
                         f"freeze it, got {beta2!r}")
    wait = min(FREEZE_MAX_WAIT, math.ceil(FREEZE_TIME_CONSTANTS / (1.0 - beta2) - 1e-6))
    return int(warmup_end) + max(1, wait)


def refuse_weight_knobs(config, where: str) -> None:
    """Raise ValueError if ``config`` (an :class:`horovod_sbc.config.SBCConfig`) sets a knob of
    the drop-in's weight exchange (``outer``, a number for ``freeze_variance_after``) where
    ``where`` (e.g. "torch SGD through stock Horovod at delay 1, which exchanges gradients")
    cannot apply it, instead of ignoring it."""
    given = [k for k, v in (("outer", config.outer),
                            ("freeze_variance_after", config.freeze_variance_after))
             if v is not None and v != "auto"]
    if given:
        raise ValueError(f"SBC({given[0]}=...) applies to the weight exchange of "
                         f"horovod_sbc.policy.choose; {where}: leave it out")
