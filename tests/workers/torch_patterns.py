"""Horovod's own training patterns through the one-line change (issue 61, item 4). argv: OUT
MODE [key=value ...] (or OUT --scenarios JSON, see tests/workers/common.py).

Every mode builds stock ``hvd.DistributedOptimizer(opt, named_parameters=...,
compression=SBC(...))`` as Horovod's documentation does, ``opt`` given by ``opt=sgd`` (SGD
momentum 0.9, weight decay 1e-4) or ``opt=adamw``, and trains a small MLP on a learnable
target, each rank its own batches.

Modes:
  clip       ``optimizer.synchronize()``, ``clip_grad_norm_``, then ``optimizer.step()`` inside
             ``optimizer.skip_synchronize()``: the gradient norm after clipping at every step,
             the warnings Horovod gave, the losses and the weights' digest after ``finish()``.
  amp        ``torch.amp.GradScaler`` as Horovod documents it with clipping
             (``scaler.scale(loss).backward()``, ``optimizer.synchronize()``,
             ``scaler.unscale_(optimizer)``, ``clip_grad_norm_``, ``scaler.step`` inside
             ``skip_synchronize()``, ``scaler.update()``); rank 1's loss is scaled to overflow
             at step 3.
  schedule   a ``StepLR`` (gamma 0.5 every 5 steps) on the wrapped optimizer: the learning
             rate of every step and the size of the shared weights' move at each step.
  errors     what a user sees on every rank: a sparse gradient (``nn.Embedding(sparse=True)``
             without ``sparse_as_dense``), ``process_set=`` (needs
             ``HOROVOD_DYNAMIC_PROCESS_SETS=1``) and a NaN in rank 1's gradient.
"""
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import catch, end_job, scenarios, tensor_digest, toy_batch, toy_mlp  # noqa: E402

import torch  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import horovod_sbc.torch as sbc  # noqa: E402

hvd.init()
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()


def mlp():
    return toy_mlp(64)


def batch(step, n=32):
    return toy_batch(step, RANK, n)


def build(kw, model, **hvd_kw):
    if kw.get("opt", "sgd") == "sgd":
        base = torch.optim.SGD(model.parameters(), lr=float(kw.get("lr", 0.05)), momentum=0.9,
                               weight_decay=1e-4)
    else:
        base = torch.optim.AdamW(model.parameters(), lr=float(kw.get("lr", 3e-3)))
    comp = sbc.SBC(float(kw.get("density", 0.05)), delay=int(kw.get("delay", 1)))
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=comp, **hvd_kw)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return opt, comp


def finish(opt):
    if hasattr(opt, "finish"):
        opt.finish()


def grad_norm(model):
    return float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters()
                                         if p.grad is not None])))


def run_clip(kw):
    model = mlp()
    opt, comp = build(kw, model)
    clip = float(kw.get("clip", 0.1))
    norms, losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(int(kw.get("steps", 60))):
            x, y = batch(s)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(grad_norm(model))
            with opt.skip_synchronize():
                opt.step()
            losses.append(float(loss))
    finish(opt)
    return {"norms": norms, "losses": losses, "digest": tensor_digest(model.parameters()),
            "warnings": [str(w.message) for w in caught], "stats": comp.stats()}


def run_amp(kw):
    model = mlp()
    opt, comp = build(kw, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    skipped, losses, norms = [], [], []
    for s in range(int(kw.get("steps", 30))):
        x, y = batch(s)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scale_up = 1e38 if (RANK == 1 and s == 3) else 1.0  # rank 1 overflows once
        scaler.scale(loss * scale_up).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(grad_norm(model))
        before = scaler.get_scale()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        losses.append(float(loss))
    finish(opt)
    return {"skipped": skipped, "losses": losses, "norms": norms,
            "digest": tensor_digest(model.parameters()), "stats": comp.stats()}


def run_schedule(kw):
    model = mlp()
    opt, comp = build(kw, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    lrs, losses = [], []
    for s in range(int(kw.get("steps", 20))):
        x, y = batch(s)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        losses.append(float(loss))
    finish(opt)
    return {"lrs": lrs, "losses": losses, "digest": tensor_digest(model.parameters()),
            "stats": comp.stats()}


def _one_step(model, opt, loss_fn):
    opt.zero_grad()
    loss_fn().backward()
    opt.step()


def run_errors(kw):
    out = {}
    emb = torch.nn.Embedding(50, 8, sparse=True)
    opt, _ = build(kw, emb)
    idx = torch.arange(4) + RANK
    out["sparse"] = catch(lambda: _one_step(emb, opt, lambda: emb(idx).sum()))
    if hvd.size() > 1:
        sets = [hvd.add_process_set([r for r in range(SIZE) if r % 2 == k]) for k in (0, 1)]
        ps = sets[RANK % 2]  # every rank registers both, in the same order (as Horovod asks)
        model = mlp()
        opt, _ = build(kw, model, process_set=ps)
        x, y = batch(0)
        out["process_set"] = catch(lambda: _one_step(
            model, opt, lambda: torch.nn.functional.cross_entropy(model(x), y)))
    model = mlp()
    opt, _ = build(kw, model)
    x, y = batch(0)
    if RANK == 1:
        x[0, 0] = float("nan")
    out["nan"] = catch(lambda: _one_step(
        model, opt, lambda: torch.nn.functional.cross_entropy(model(x), y)))
    return out


def run(mode, kw):
    return {"clip": run_clip, "amp": run_amp, "schedule": run_schedule,
            "errors": run_errors}[mode](kw)


if __name__ == "__main__":
    end_job(RANK, scenarios(sys.argv, run), "torch")
