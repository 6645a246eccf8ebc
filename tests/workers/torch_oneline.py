"""The one-line change with an adaptive optimizer: stock ``hvd.DistributedOptimizer(opt,
named_parameters=..., compression=SBC(...))``. argv: OUT MODE [key=value ...] (or OUT --scenarios
JSON, see tests/workers/common.py).

Modes:
  adamw     AdamW with a warm-up + decay schedule through the stock hook: the shared weights'
            digest after every step, the class it ran as, the step hooks' calls per step,
            when the variance froze; with ``save_at=K`` each rank saves its checkpoint after
            K steps and a second run resumes from it (``resumed``), and with ``rank0=1`` every
            rank resumes from rank 0's file.
  hooks     the step hooks' calls per step with SBC and with Horovod's dense allreduce.
  train     digits, 2 ranks, ``opt=`` adamw/adam/rmsprop/adagrad/adamax/nadam/radam/sgd: test
            accuracy of dense Horovod, no communication, the stock hook (``SBC(density)``)
            and, with ``control=1``, the stock hook forced to exchange gradients (the
            behaviour before the policy: the negative control).
"""
import hashlib
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from common import scenarios, toy_batch, toy_mlp, write_result  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import horovod_sbc.torch as sbc  # noqa: E402
from horovod_sbc import policy  # noqa: E402

hvd.init()
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def mlp():
    return toy_mlp(32)


def batch(step, n=16):
    return toy_batch(step, RANK, n)


def warmup_decay(s, warm=5, total=40):
    return (s + 1) / warm if s < warm else 0.5 * (1 + np.cos(np.pi * (s - warm) / total))


def _adamw_run(steps, save_at=None, start=None):
    model = mlp()
    base = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.8), weight_decay=0.1)
    comp = sbc.SBC(0.2)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=comp)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_decay)
    first = 0
    if start is not None:
        ck = torch.load(io.BytesIO(start), weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        comp.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        first = ck["step"]
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    calls = {"pre": 0, "post": 0}
    opt.register_step_pre_hook(lambda *a: calls.__setitem__("pre", calls["pre"] + 1))
    opt.register_step_post_hook(lambda *a: calls.__setitem__("post", calls["post"] + 1))
    shared, saved = [], None
    for s in range(first, steps):
        x, y = batch(s)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        ref = comp.manager.reference
        shared.append(digest([ref[n] for n in sorted(ref)]))
        if s + 1 == save_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": s + 1}, buf)
            saved = buf.getvalue()
    freeze = getattr(opt, "_sbc_freeze", None)
    return {"shared": shared, "weights": digest([p for _, p in sorted(model.named_parameters())]),
            "mro": [c.__name__ + "@" + c.__module__ for c in type(opt).__mro__[:4]],
            "calls": calls, "steps": steps - first,
            "frozen_at": getattr(freeze, "frozen_at", None),
            "frozen": sum("sbc_variance_frozen" in st for st in opt.state.values()),
            "stats": comp.stats(), "has_finish": hasattr(opt, "finish")}, saved


def run_adamw(kw):
    steps, save_at = int(kw.get("steps", 40)), int(kw.get("save_at", 25))
    full, ck = _adamw_run(steps, save_at=save_at)
    if kw.get("rank0"):
        ck = hvd.broadcast_object(ck, root_rank=0)
    resumed, _ = _adamw_run(steps, start=ck)
    return {"full": full, "resumed": resumed}


def run_hooks(kw):
    out = {}
    for kind in ("sbc", "dense"):
        model = mlp()
        base = torch.optim.AdamW(model.parameters(), lr=0.01)
        opt = hvd.DistributedOptimizer(
            base, named_parameters=model.named_parameters(),
            compression=sbc.SBC(0.2) if kind == "sbc" else hvd.Compression.none)
        calls = []
        opt.register_step_pre_hook(lambda *a: calls.append("pre"))
        opt.register_step_post_hook(lambda *a: calls.append("post"))
        for s in range(3):
            x, y = batch(s)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[kind] = calls
    return out


OPTS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=3e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=3e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=3e-3),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=3e-3),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=3e-3),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


def _digits():
    from examples.common import digits_split
    xtr, ytr, xte, yte = digits_split(0)
    return (torch.from_numpy(xtr[RANK::SIZE]), torch.from_numpy(ytr[RANK::SIZE]),
            torch.from_numpy(xte), torch.from_numpy(yte))


def _train_digits(opt_name, how, steps, density):
    xtr, ytr, xte, yte = _digits()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    base = OPTS[opt_name](model.parameters())
    comp = None
    if how == "alone":
        opt = base
    else:
        comp = hvd.Compression.none if how == "dense" else sbc.SBC(density)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=comp)
    g = torch.Generator().manual_seed(RANK)
    for s in range(steps):
        idx = torch.randint(0, len(xtr), (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
    if hasattr(opt, "finish"):
        opt.finish()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    outer = getattr(opt, "outer", None)
    return {"accuracy": acc, "weights": digest([p for _, p in sorted(model.named_parameters())]),
            "stats": comp.stats() if isinstance(comp, sbc.SBC) else None,
            "outer_lr": getattr(outer, "lr", None) if how == "sbc" else None}


def run_train(kw):
    name, steps, density = kw.get("opt", "adamw"), int(kw.get("steps", 300)), \
        float(kw.get("density", 0.01))
    out = {how: _train_digits(name, how, steps, density) for how in ("dense", "alone", "sbc")}
    if kw.get("control"):
        real = policy.choose
        policy.choose = lambda family, **k: policy.Choice("gradients", False, False)
        try:
            out["gradients"] = _train_digits(name, "sbc", steps, density)
        finally:
            policy.choose = real
    return out


def run(mode, kw):
    return {"adamw": run_adamw, "hooks": run_hooks, "train": run_train}[mode](kw)


write_result(RANK, scenarios(sys.argv, run))
