"""Screening study of momentum handling for SBC: W workers simulated in ONE process.

``python -m benchmarks.momentum_study CONFIGS.jsonl`` — one JSON object per line, e.g.
``{"mode": "drop_local", "p": 0.01, "n": 1}`` (keys: mode, p, n, W=4, steps=1500, seed=0,
opt=sgd|adam|adamw, lr, momentum=0.9, wd, part=iid|class, binar=true).

This is how the options of issue 11 were screened before the real multi-rank benchmark
(``python -m benchmarks.bench tasks``) measured the chosen ones: the mnist1d setting of the issue
(10,000 generated samples, 8,000 for training split IID or by class over W=4 workers, a small
1-D CNN, batch 32, 1,500 steps), with SBC re-implemented in a few lines of plain torch (the
paper's selection: top-k positive vs top-k negative, the side with the larger mean is sent as
that mean; ``binar=false``: top-k values). Single seed, so differences of a few points are
within run-to-run noise. Modes:

dense / local          allreduce of gradients / no communication at all
stock                  gradient SBC + error feedback; the optimizer (momentum) on the average
stock_mask             the same + DGC factor masking of the (global) momentum buffer where the
                       averaged update is non-zero
stock_dgc              DGC momentum correction (local velocity into the residual), factor
                       masking of the local velocity (``mask``), the optimizer's momentum
                       compensated so it applies the averaged update as is
dropin                 weight-space drop-in: dW = W_local - W_ref + residual; continue from W_ref
drop_mask / drop_umask the same + zero the local optimizer state (SGD momentum_buffer, Adam
                       exp_avg) where this rank sent / where the average moved
drop_reset             the same + zero all optimizer state at every sync
drop_local             continue from W_ref + own residual (horovod_sbc's local_residual=True)
drop_localmask         drop_local + masking of own sent positions
drop_gmom(_mask)       local steps without momentum, momentum applied to the averaged update
                       (optionally masked)
"""
import sys, json, time, math
import numpy as np, torch
import torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)

def data(seed=0, n=10000):
    import mnist1d.data as d
    st = np.random.get_state()
    a = d.get_dataset_args(); a.num_samples = n; a.seed = seed
    x = d.make_dataset(a); np.random.set_state(st)
    f = lambda v: torch.tensor(v, dtype=torch.float32).unsqueeze(1)
    return f(x['x']), torch.tensor(x['y']).long(), f(x['x_test']), torch.tensor(x['y_test']).long()

def net(w=32):
    return nn.Sequential(nn.Conv1d(1, w, 5, 2, 2), nn.ReLU(), nn.Conv1d(w, w, 3, 2, 1), nn.ReLU(),
                         nn.Conv1d(w, w, 3, 2, 1), nn.ReLU(), nn.Flatten(), nn.Linear(w * 5, 10))

def sbc(a, p, binar=True):
    n = a.numel(); k = max(1, int(math.floor(p * n + 0.5)))
    out = torch.zeros_like(a)
    if not binar:
        idx = a.abs().topk(k).indices; out[idx] = a[idx]; return out
    pv, pi = a.clamp(min=0).topk(k); nv, ni = (-a).clamp(min=0).topk(k)
    pi = pi[pv > 0]; pv = pv[pv > 0]; ni = ni[nv > 0]; nv = nv[nv > 0]
    mp = pv.mean() if pv.numel() else torch.tensor(0.); mn = nv.mean() if nv.numel() else torch.tensor(0.)
    if mp >= mn and mp > 0: out[pi] = mp
    elif mn > 0: out[ni] = -mn
    return out

def run(cfg, D):
    xtr, ytr, xte, yte = D
    W = cfg.get("W", 4); steps = cfg.get("steps", 1500); bs = 32; seed = cfg.get("seed", 0)
    torch.manual_seed(seed)
    models = [net() for _ in range(W)]
    for m in models[1:]: m.load_state_dict(models[0].state_dict())
    def mkopt(ps, mom=None):
        o = cfg.get("opt", "sgd")
        if o == "sgd": return torch.optim.SGD(ps, lr=cfg.get("lr", 0.05), momentum=cfg.get("momentum", 0.9) if mom is None else mom, nesterov=cfg.get("nesterov", False), weight_decay=cfg.get("wd", 0))
        if o == "adam": return torch.optim.Adam(ps, lr=cfg.get("lr", 1e-3), weight_decay=cfg.get("wd", 0))
        if o == "adamw": return torch.optim.AdamW(ps, lr=cfg.get("lr", 1e-3), weight_decay=cfg.get("wd", 0.01))
    mode = cfg["mode"]; p = cfg.get("p", 0.01); n = cfg.get("n", 1); binar = cfg.get("binar", True)
    gm = mode.startswith("drop_gmom")
    opts = [mkopt(list(m.parameters()), 0.0 if gm else None) for m in models]
    gbuf = [torch.zeros_like(q) for q in models[0].parameters()]
    params = [list(m.parameters()) for m in models]
    P = len(params[0])
    res = [[torch.zeros_like(q) .reshape(-1) for q in params[0]] for _ in range(W)]
    ref = [q.detach().clone() for q in params[0]]
    vel = [[torch.zeros_like(q).reshape(-1) for q in params[0]] for _ in range(W)]  # dgc local velocity
    shards = [(xtr[r::W], ytr[r::W]) for r in range(W)]
    if cfg.get("part") == "class":
        shards = [(xtr[ytr % W == r], ytr[ytr % W == r]) for r in range(W)]
    gens = [torch.Generator().manual_seed(seed * 1000 + r) for r in range(W)]
    ptr = [10**9] * W; perms = [None] * W
    for t in range(steps):
        grads = []
        for r in range(W):
            xs, ys = shards[r]
            if ptr[r] + bs > len(xs): perms[r] = torch.randperm(len(xs), generator=gens[r]); ptr[r] = 0
            b = perms[r][ptr[r]:ptr[r] + bs]; ptr[r] += bs
            opts[r].zero_grad(); F.cross_entropy(models[r](xs[b]), ys[b]).backward()
        if mode == "local":
            for o in opts: o.step()
            continue
        if mode == "dense":
            for i in range(P):
                g = sum(params[r][i].grad for r in range(W)) / W
                for r in range(W): params[r][i].grad = g.clone()
            for o in opts: o.step()
            continue
        if mode.startswith("stock"):
            # gradient compression; optimizer (identical on all ranks) applied to the average
            for i in range(P):
                agg = torch.zeros_like(res[0][i])
                for r in range(W):
                    q = params[r][i]; g = q.grad.reshape(-1)
                    if mode == "stock_dgc":  # momentum correction: velocity into residual
                        m = cfg.get("momentum", 0.9)
                        gg = g + cfg.get("wd", 0) * q.detach().reshape(-1)
                        vel[r][i].mul_(m).add_(gg)
                        res[r][i].add_(vel[r][i])
                    else:
                        res[r][i].add_(g)
                    s = sbc(res[r][i], p, binar); res[r][i].sub_(s)
                    if mode == "stock_dgc" and cfg.get("mask", True):
                        vel[r][i][s != 0] = 0
                    agg += s
                agg /= W
                for r in range(W):
                    q = params[r][i]
                    if mode == "stock_dgc":  # compensate the optimizer's momentum and wd
                        st = opts[r].state.get(q, {})
                        buf = st.get("momentum_buffer")
                        m = cfg.get("momentum", 0.9)
                        gp = agg - (m * buf.reshape(-1) if buf is not None else 0) - cfg.get("wd", 0) * q.detach().reshape(-1)
                        q.grad = gp.reshape(q.shape).clone()
                    else:
                        q.grad = agg.reshape(q.shape).clone()
                    if mode == "stock_mask":
                        st = opts[r].state.get(q, {}); buf = st.get("momentum_buffer")
                        if buf is not None: buf.view(-1)[agg != 0] = 0
            for o in opts: o.step()
            continue
        # drop-in (weight space)
        for o in opts: o.step()
        if (t + 1) % n: continue
        for i in range(P):
            agg = torch.zeros_like(res[0][i])
            sent_masks = []
            for r in range(W):
                dw = params[r][i].detach().reshape(-1) - ref[i].reshape(-1)
                if mode.startswith("drop_local"):
                    res[r][i].zero_()   # W_local - W_ref already holds the old residual
                res[r][i].add_(dw); s = sbc(res[r][i], p, binar); res[r][i].sub_(s); agg += s
                sent_masks.append(s != 0)
            agg /= W
            if gm:
                if mode == "drop_gmom_mask": gbuf[i].view(-1)[agg != 0] = 0
                gbuf[i].mul_(cfg.get("momentum", 0.9)).add_(agg.view_as(gbuf[i]))
                agg = gbuf[i].view(-1)
            ref[i].view(-1).add_(agg)
            for r in range(W):
                q = params[r][i]
                with torch.no_grad():
                    if mode.startswith("drop_local"):  # closed loop: local = shared + own residual
                        q.copy_(ref[i] + res[r][i].view_as(ref[i]))
                        # residual is now counted from W_local: dW next time is W_local - (ref + res)
                    else:
                        q.copy_(ref[i])
                st = opts[r].state.get(q, {})
                if mode == "drop_mask":   # DGC factor masking: own sent positions
                    msk = sent_masks[r]
                elif mode == "drop_umask":  # union: positions that moved
                    msk = agg != 0
                elif mode == "drop_localmask":
                    msk = sent_masks[r]
                elif mode == "drop_reset":
                    msk = torch.ones_like(agg, dtype=torch.bool)
                else:
                    msk = None
                if msk is not None:
                    for key in ("momentum_buffer", "exp_avg"):
                        if key in st: st[key].view(-1)[msk] = 0
    if mode.startswith("drop_local"):  # finish(): W_ref + mean residual on every rank
        for i in range(P):
            mean_r = sum(res[r][i] for r in range(W)) / W
            for r in range(W):
                with torch.no_grad(): params[r][i].copy_(ref[i] + mean_r.view_as(ref[i]))
    acc = []
    for m in models:
        with torch.no_grad(): acc.append(float((m(xte).argmax(1) == yte).float().mean()))
    with torch.no_grad():
        loss = float(F.cross_entropy(models[0](xtr[:2000]), ytr[:2000]))
    return float(np.mean(acc)), loss

if __name__ == "__main__":
    D = data(0)  # mnist1d.data.make_dataset, 10,000 samples, seed 0 (offline)
    cfgs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    for c in cfgs:
        t = time.time(); a, l = run(c, D)
        print(f"{json.dumps(c):<90} acc {100*a:5.1f}  trainloss {l:.3f}  ({time.time()-t:.0f}s)", flush=True)
