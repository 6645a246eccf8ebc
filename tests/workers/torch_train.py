"""Training-stability worker: a small conv + BatchNorm + linear net on scikit-learn digits (8x8
images), one multi-rank job running a list of configurations one after the other.

argv: OUTDIR CONFIGS_JSON. Each configuration (a dict) says

  api        "dropin" (horovod_sbc.torch.DistributedOptimizer), "stock" (hvd.DistributedOptimizer
             with compression=SBC/TopK), "dense" (stock, no compression), "local" (no exchange)
  method     "sbc" or "topk" (compressor class), density, delay, and any extra SBC keyword
             arguments under "compressor"; "local_residual" for the drop-in
  opt        "sgd" | "adam" | "adamw", lr, momentum, nesterov, weight_decay
  steps, log_every, seed, batch

Each rank writes, per configuration: the mean training loss of every ``log_every``-step window,
the test accuracy, a digest of the parameters and the compressor's stats.
"""
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import horovod.torch as hvd  # noqa: E402
import horovod_sbc.torch as sbc  # noqa: E402
from common import write_result  # noqa: E402
from examples.common import digits_split, stock_horovod_optimizer  # noqa: E402


def make_net(width=16, pool=True):
    pooled = [torch.nn.MaxPool2d(2)] if pool else []
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, width, 3, padding=1), torch.nn.BatchNorm2d(width), torch.nn.ReLU(),
        torch.nn.Conv2d(width, 2 * width, 3, padding=1), torch.nn.BatchNorm2d(2 * width),
        torch.nn.ReLU(), *pooled, torch.nn.Flatten(),
        torch.nn.Linear(2 * width * (16 if pool else 64), 10))


def make_opt(cfg, params):
    name = cfg.get("opt", "sgd")
    wd = cfg.get("weight_decay", 0.0)
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg["lr"], momentum=cfg.get("momentum", 0.0),
                               nesterov=cfg.get("nesterov", False), weight_decay=wd)
    if name == "adam":
        return torch.optim.Adam(params, lr=cfg["lr"], weight_decay=wd)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=wd or 0.01)
    raise ValueError(name)


def make_comp(cfg):
    cls = {"sbc": sbc.SBC, "topk": sbc.TopK}[cfg.get("method", "sbc")]
    kw = {"local_residual": cfg["local_residual"]} if "local_residual" in cfg else {}
    return cls(density=cfg["density"], delay=cfg.get("delay", 1), **cfg.get("compressor", {}),
               **kw)


def digest(tensors):
    return hashlib.sha256(torch.cat([t.detach().reshape(-1) for t in tensors])
                          .numpy().tobytes()).hexdigest()


def shared_state(opt):
    """Right after a sync: the digest of the shared weights W_ref and whether every parameter
    holds exactly W_ref (local_residual=False) or, with True (the residual lives in the
    weights), whether the checkpoint's residuals are exactly W - W_ref."""
    ref = opt.compression.manager.reference
    res = opt.residuals()
    params = opt._sbc_params
    with opt.shared_weights():
        d = digest([p for _, p in params])
    if opt.local_residual:
        saved = opt.state_dict()["horovod_sbc"]["residuals"]
        exact = all(torch.equal(saved[n], (p - ref[n]).view(-1)) for n, p in params)
    else:
        exact = all(torch.equal(p, ref[n]) for n, p in params)
    moved = any(bool(res[n].abs().sum() > 0) for n, _ in params if n in res)
    return {"digest": d, "exact": exact, "residual_nonzero": moved,
            "local_digest": digest([p for _, p in params])}


def run(cfg, data):
    xtr, ytr, xte, yte = data
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(cfg.get("seed", 0))
    model = make_net(cfg.get("width", 16), cfg.get("pool", True))
    base = make_opt(cfg, model.parameters())
    api = cfg["api"]
    comp = None
    if api == "dropin":
        comp = make_comp(cfg)
        opt = sbc.DistributedOptimizer(base, model.named_parameters(), compression=comp)
        sbc.broadcast_state(model, opt, root_rank=0)
    elif api in ("stock", "dense"):
        comp = make_comp(cfg) if api == "stock" else hvd.Compression.none
        opt = stock_horovod_optimizer(base, model, comp)
        if api == "dense":
            comp = None
    elif api == "local":
        opt = base
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    else:
        raise ValueError(api)
    xs, ys = xtr[rank::size], ytr[rank::size]
    g = torch.Generator().manual_seed(1000 * cfg.get("seed", 0) + rank)
    bs, every = cfg.get("batch", 32), cfg.get("log_every", 8)
    losses, window, step_losses, shared = [], [], [], []
    perm = torch.randperm(len(xs), generator=g)
    at = 0
    for step in range(cfg["steps"]):
        if at + bs > len(xs):
            perm, at = torch.randperm(len(xs), generator=g), 0
        b = perm[at:at + bs]
        at += bs
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs[b]), ys[b])
        loss.backward()
        opt.step()
        window.append(float(loss))
        step_losses.append(float(loss))
        if cfg.get("record_shared") and opt.local_steps_pending == 0:
            shared.append(shared_state(opt))
        if len(window) == every:
            losses.append(sum(window) / every)
            window = []
    if hasattr(opt, "finish"):  # the drop-in, and the stock hook's weight exchange (Adam)
        opt.finish()  # every rank ends with the same weights
    model.eval()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"losses": losses, "step_losses": step_losses, "shared": shared, "accuracy": acc,
            "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
            "stats": comp.stats() if comp is not None else None}


def main():
    hvd.init()
    torch.set_num_threads(1)
    configs = json.loads(sys.argv[2])
    data = [torch.from_numpy(a) for a in digits_split(0)]
    data[0] = data[0].reshape(-1, 1, 8, 8)
    data[2] = data[2].reshape(-1, 1, 8, 8)
    out = [run(cfg, data) for cfg in configs]
    write_result(hvd.rank(), {"runs": out})


if __name__ == "__main__":
    main()
