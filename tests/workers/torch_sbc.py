"""Torch SBC worker. argv: OUT MODE [key=value ...] (or OUT --scenarios JSON: several in one
job, see tests/workers/common.py); writes OUT/rank<R>.json.

Modes:
  train        train a small model for `steps` steps through api=stock|dropin, record the sha256
               of all parameters after every step, stats and the bytes actually gathered.
  dense_equiv  density 1.0, mode="values" through api=stock|dropin beside a stock dense run.
  save / load  checkpoint mid-delay on every rank, then continue 20 steps (save: uninterrupted;
               load: in a new process from the checkpoint) and record digests.
  errors       bad configurations and a NaN on one rank; record each rank's error message.
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import catch, end_job, scenarios  # noqa: E402

import torch  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import horovod_sbc.torch as sbc  # noqa: E402
from horovod_sbc.torch.sync import transport  # noqa: E402

MODE, KW = None, {}  # of the scenario running (set by run_scenario)
hvd.init()
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()

# Record every step message this rank sends and every gathered buffer it receives.
GATHERED = {"sent": 0, "received": 0}
_ag = transport.allgather


def _rec_allgather(step, name):
    out = _ag(step, name)
    GATHERED["sent"] += step.numel()
    GATHERED["received"] += out.numel() - step.numel()
    return out


transport.allgather = _rec_allgather


class Net(torch.nn.Module):
    """Has a branch used only on some steps (and only on some ranks): its grads are None then."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 64)
        self.fc2 = torch.nn.Linear(64, 5)
        self.aux = torch.nn.Linear(64, 5)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x, use_aux):
        h = torch.relu(self.fc1(x))
        y = self.fc2(h)
        return y + self.aux(h) if use_aux else y


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    x = torch.randn(16, 20, generator=g)
    y = torch.randint(0, 5, (16,), generator=g)
    return x, y


def digest(model):
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        t = p.detach().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        h.update(t.numpy().tobytes())
    return h.hexdigest()


# These jobs check the exchange itself: bit-identical weights after every sync, exact accounting,
# errors, checkpoints. Bit-identical *weights* after a sync is the local_residual=False mode; the
# default (local_residual=True: each rank continues from the shared weights + its own residual)
# is covered by tests/test_training.py. "local_residual=1" on the command line selects it.
LOCAL_RESIDUAL = False


def build(api, density, delay, momentum=0.9, mode="sbc", lr=0.05, comp=None):
    torch.manual_seed(0)
    model = Net()
    # ranks start from different weights: the broadcast must make them equal
    with torch.no_grad():
        model.fc1.weight.add_(0.01 * RANK)
    base = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr,
                           momentum=momentum)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if api == "stock":
        comp = comp or sbc.SBC(density=density, mode=mode)
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=comp)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        opt.zero_grad()
        stats = comp.stats
    elif api == "dense":
        opt = hvd.DistributedOptimizer(base, named_parameters=named)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        opt.zero_grad()
        stats = None
    else:
        opt = sbc.DistributedOptimizer(base, named, compression=comp or sbc.SBC(
            density=density, delay=delay, mode=mode, local_residual=LOCAL_RESIDUAL))
        sbc.broadcast_state(model, opt, root_rank=0)
        opt.zero_grad()
        stats = opt.stats
    return model, opt, stats


def train_step(model, opt, step, nan=False):
    x, y = batch(step)
    if nan:  # a poisoned sample: NaN gradients reach the hooks during backward()
        x[0, 0] = float("nan")
    opt.zero_grad()
    use_aux = (step + RANK) % 3 == 0  # aux gets no grad on most steps, differently per rank
    loss = torch.nn.functional.cross_entropy(model(x, use_aux), y)
    loss.backward()
    opt.step()
    return loss.item()


def shared_digest(model, opt):
    """The weights every rank must share: the shared weights of an optimizer that keeps each
    rank's residual in its weights (the drop-in, or stock Horovod's once SBC adopted it at its
    first step: SGD exchanges weight changes), else the weights themselves."""
    shared = getattr(opt, "shared_weights", None)
    if shared is None:
        return digest(model)
    with shared():
        return digest(model)


def run_train():
    api = KW.get("api", "dropin")
    density, delay = float(KW.get("density", 0.05)), int(KW.get("delay", 1))
    steps = int(KW.get("steps", 12))
    comp = None
    if "topology" in KW:
        down = KW.get("downlink")
        comp = sbc.SBC(density=density, delay=delay, topology=KW["topology"],
                       downlink_density=None if down in (None, "none") else float(down),
                       local_residual=LOCAL_RESIDUAL)
    if "mode" in KW:  # another compressor
        comp = sbc.SBC(density=density, delay=delay, mode=KW["mode"],
                       local_residual=LOCAL_RESIDUAL)
    model, opt, stats = build(api, density, delay, comp=comp)
    # the drop-in here keeps the residual beside the weights (LOCAL_RESIDUAL): its weights are
    # what ranks share after a sync and train apart between syncs
    seen = (lambda: shared_digest(model, opt)) if api == "stock" else (lambda: digest(model))
    digests = [seen()]
    losses = []
    for s in range(steps):
        losses.append(train_step(model, opt, s))
        digests.append(seen())
    st = stats()
    from horovod_sbc.torch.backend import backend_for
    return {"digests": digests, "losses": losses, "stats": st, "gathered": dict(GATHERED),
            "sync_every": delay, "backend": backend_for("cpu").name}


def run_dense_equiv():
    api = KW.get("api", "dropin")
    steps = 6
    ref, ref_opt, _ = build("dense", 1.0, 1, momentum=0.0)
    m, opt, _ = build(api, 1.0, 1, momentum=0.0, mode="values")
    worst = 0.0
    for s in range(steps):
        for mm, oo in ((ref, ref_opt), (m, opt)):
            x, y = batch(s)
            oo.zero_grad()
            torch.nn.functional.cross_entropy(mm(x, True), y).backward()
            oo.step()
        for (n1, p1), (n2, p2) in zip(ref.named_parameters(), m.named_parameters()):
            if p1.requires_grad:
                worst = max(worst, (p1 - p2).abs().max().item())
    return {"max_abs_diff": worst, "digest": digest(m)}


def ckpt_path():
    return os.path.join(KW["ckpt"], f"ckpt_rank{RANK}.pt")


def run_save_load():
    density, delay = 0.05, 3
    comp = None
    if KW.get("topology") == "server":
        comp = sbc.SBC(density=density, delay=delay, topology="server", downlink_density=0.1,
                       local_residual=LOCAL_RESIDUAL)
    if KW.get("method") == "terngrad":  # stochastic: resuming needs its generator state
        comp = sbc.TernGrad(delay=delay, seed=3, local_residual=LOCAL_RESIDUAL)
    model, opt, stats = build("dropin", density, delay, comp=comp)
    first = int(KW.get("first", 7))
    if MODE == "save":
        for s in range(first):
            train_step(model, opt, s)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt_path())
        saved_stats = stats()
    else:
        state = torch.load(ckpt_path(), weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        saved_stats = stats()
    digests = []
    for s in range(first, first + 20):
        train_step(model, opt, s)
        digests.append(digest(model))
    return {"digests": digests, "stats_at_checkpoint": saved_stats}


def run_errors():
    out = {}
    base = lambda: torch.optim.SGD(Net().parameters(), lr=0.1)  # noqa: E731
    # SGD with a delay through the stock hook exchanges weight changes (horovod_sbc.policy);
    # the server topology needs the drop-in there
    out["delay_stock"] = catch(lambda: _stock_step(sbc.SBC(density=0.1, delay=2)))
    out["server_stock"] = catch(lambda: _stock_step(sbc.SBC(density=0.1, delay=2,
                                                            topology="server")))
    out["adasum"] = catch(lambda: _stock_step(sbc.SBC(density=0.1), op=hvd.Adasum))
    out["groups"] = catch(lambda: _stock_step(sbc.SBC(density=0.1), groups=2))
    out["density"] = catch(lambda: sbc.SBC(density=0))
    out["dropin_wrong_compression"] = catch(
        lambda: sbc.DistributedOptimizer(base(), compression=hvd.Compression.fp16))
    # NaN on rank 1 only: every rank must raise, naming rank 1 and the parameter
    model, opt, _ = build("dropin", 0.1, 1)
    out["nan_dropin"] = catch(lambda: train_step(model, opt, 0, nan=(RANK == 1)))
    model, opt, _ = build("stock", 0.1, 1)
    out["nan_stock"] = catch(lambda: train_step(model, opt, 0, nan=(RANK == 1)))
    # skip mode: the sync is skipped everywhere, training continues, ranks stay identical
    torch.manual_seed(0)
    model = Net()
    opt = sbc.DistributedOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05),
        [(n, p) for n, p in model.named_parameters() if p.requires_grad],
        compression=sbc.SBC(density=0.1, nonfinite="skip", local_residual=LOCAL_RESIDUAL))
    sbc.broadcast_state(model, opt)
    before = digest(model)
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        train_step(model, opt, 0, nan=(RANK == 1))
    out["skip_warning"] = str(w[0].message) if w else None
    out["skip_unchanged"] = digest(model) == before
    with opt.shared_weights():
        out["skip_shared_unchanged"] = digest(model) == before
    # local_residual=1: the failing rank's non-finite weights restart from the shared ones
    out["skip_finite_now"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    train_step(model, opt, 1)
    out["skip_after"] = digest(model)
    with opt.shared_weights():
        out["skip_after_shared"] = digest(model)
    out["skip_finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out


def _stock_step(comp, **kw):
    model = Net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        named_parameters=[(n, p) for n, p in model.named_parameters() if p.requires_grad],
        compression=comp, **kw)
    x, y = batch(0)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x, True), y).backward()
    opt.step()


def run_many():
    """A model of 210 parameter tensors (more than ResNet-50's 161), 4 steps through the
    stock hook and the drop-in (residual in the weights): the digest of the weights every rank
    must share (the drop-in's shared weights) and of this rank's own live weights."""
    from horovod_sbc.torch.backend import backend_for
    torch.manual_seed(0)
    shapes = [(16, 3, 3), (16,), (16,)] * 70
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s)) for s in shapes])
    named = [(f"p{i:03d}", p) for i, p in enumerate(params)]
    base = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if KW["api"] == "stock":
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=sbc.SBC(0.05))
    else:
        opt = sbc.DistributedOptimizer(base, named,
                                       compression=sbc.SBC(0.05, delay=1, local_residual=True))
    g = torch.Generator().manual_seed(RANK)
    for _ in range(4):
        opt.zero_grad()
        sum((p * torch.randn(p.shape, generator=g)).sum() for p in params).backward()
        opt.step()

    own = digest(params)
    with opt.shared_weights():  # stock Horovod's optimizer too: SBC adopted it (SGD)
        shared = digest(params)
    return {"tensors": len(named), "shared": shared, "own": own,
            "backend": backend_for("cpu").name}


def run_baselines():
    """Every baseline compressor through the drop-in optimizer: identical ranks, real bits."""
    out = {}
    lr = dict(local_residual=LOCAL_RESIDUAL)
    comps = {"topk": lambda: sbc.TopK(density=0.05, **lr),
             "fedavg": lambda: sbc.FedAvg(delay=3, **lr),
             "signsgd": lambda: sbc.SignSGD(**lr), "terngrad": lambda: sbc.TernGrad(seed=1, **lr)}
    for name, make in comps.items():
        GATHERED.update(sent=0, received=0)
        comp = make()
        model, opt, stats = build("dropin", 0, 0, comp=comp)
        digests = [digest(model)]
        for s in range(6):
            train_step(model, opt, s)
            digests.append(digest(model))
        out[name] = {"digests": digests, "stats": stats(), "sent": GATHERED["sent"],
                     "delay": comp.delay}
    return out


class Odd(torch.nn.Module):
    """Every awkward parameter kind in one model."""

    def __init__(self):
        super().__init__()
        self.scalar = torch.nn.Parameter(torch.tensor(0.5))            # 0-d
        self.empty = torch.nn.Parameter(torch.empty(0, 4))             # no elements
        self.one = torch.nn.Parameter(torch.ones(1))                   # 1 element
        self.p16 = torch.nn.Parameter(torch.randn(8, 4).half())      # fp16
        self.pbf = torch.nn.Parameter(torch.randn(8, 4).bfloat16())    # bf16
        self.p64 = torch.nn.Parameter(torch.randn(3, 4).double())     # fp64
        self.emb = torch.nn.Embedding(50, 4, sparse=True)             # sparse gradients
        self.frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
        self.steps = torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
        self.register_buffer("count", torch.zeros(1, dtype=torch.int64))  # integer state

    def forward(self, idx):
        h = self.emb(idx)                                              # (B, 4)
        h = h + (self.p16.float().sum(0) + self.pbf.float().sum(0)) * self.one
        out = (h * self.scalar).sum(1, keepdim=True) + h[:, :3].double().matmul(
            self.p64).sum(1, keepdim=True).float() + self.empty.sum()
        self.count += 1
        return out


def run_odd():
    out = {}
    torch.manual_seed(0)
    model = Odd()
    # every parameter goes to the optimizer, frozen and integer ones included: the drop-in
    # must leave those alone (and keep them out of the layout)
    named = list(model.named_parameters())
    opt = sbc.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named,
                                   compression=sbc.SBC(density=0.3, delay=2,
                                                       local_residual=LOCAL_RESIDUAL))
    sbc.broadcast_state(model, opt)
    digests, shared = [], []
    for s in range(6):
        g = torch.Generator().manual_seed(100 * s + RANK)
        idx = torch.randint(0, 50, (5,), generator=g)
        opt.zero_grad()
        (model(idx).tanh() - 0.5).pow(2).mean().backward()
        opt.step()
        digests.append(digest(model))
        with opt.shared_weights():
            shared.append(digest(model))
    out["digests"], out["shared_digests"] = digests, shared
    out["dtypes"] = {n: str(p.dtype) for n, p in model.named_parameters()}
    out["finite"] = all(bool(torch.isfinite(p.float()).all()) for p in model.parameters())
    torch.manual_seed(0)
    fresh = dict(Odd().named_parameters())
    out["moved"] = {n: bool((p.detach().float() != fresh[n].detach().float()).any())
                    for n, p in named}
    out["layout"] = [n for n, _ in opt._sbc_params]
    out["stats"] = opt.stats()
    return out


def run_mismatch():
    """Ranks that disagree on the parameter set / shapes must fail on every rank, not hang."""
    out = {}
    kind = KW["kind"]
    torch.manual_seed(0)
    if kind == "shape":
        lin = torch.nn.Linear(4, 3 if RANK == 0 else 5)
        named = list(lin.named_parameters())
    elif kind == "set":
        named = [("a", torch.nn.Parameter(torch.randn(6)))]
        if RANK == 1:
            named.append(("b", torch.nn.Parameter(torch.randn(2))))
    else:  # order: same set, built in a different order: must just work
        ps = [("a", torch.nn.Parameter(torch.ones(6))), ("b", torch.nn.Parameter(torch.ones(2)))]
        named = ps if RANK == 0 else ps[::-1]
    opt = sbc.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named,
                                   compression=sbc.SBC(density=0.5, local_residual=LOCAL_RESIDUAL))
    for _, p in named:
        p.grad = torch.full_like(p, 1.0 + RANK)
    out["error"] = catch(opt.step)
    out["values"] = {n: p.detach().tolist() for n, p in named}
    return out


def run_redensity():
    """Resume a checkpoint with another density: allowed (residuals are unsent update mass)."""
    model, opt, stats = build("dropin", float(KW["density"]), 3)
    state = torch.load(os.path.join(KW["ckpt"], f"ckpt_rank{RANK}.pt"), weights_only=False)
    model.load_state_dict(state["model"])
    err = catch(lambda: opt.load_state_dict(state["opt"]))
    digests = []
    for s in range(4, 10):
        train_step(model, opt, s)
        digests.append(digest(model))
    return {"error": err, "digests": digests, "stats": stats(),
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def run_world_size():
    """Load a checkpoint written by a job of another size (or by another rank)."""
    model, opt, _ = build("dropin", 0.05, 3)
    src = KW.get("src_rank")
    path = os.path.join(KW["ckpt"], f"ckpt_rank{src if src is not None else RANK}.pt")
    state = torch.load(path, weights_only=False)
    return {"error": catch(lambda: opt.load_state_dict(state["opt"]))}


MODES = {"train": run_train, "dense_equiv": run_dense_equiv, "save": run_save_load,
         "load": run_save_load, "errors": run_errors, "odd": run_odd, "baselines": run_baselines,
         "mismatch": run_mismatch, "many": run_many, "world_size": run_world_size, "redensity": run_redensity}


def run_scenario(mode, kw):
    global MODE, KW, LOCAL_RESIDUAL
    MODE, KW = mode, kw
    LOCAL_RESIDUAL = KW.get("local_residual", "0") == "1"
    GATHERED.update(sent=0, received=0)
    result = MODES[mode]()
    result.update(rank=RANK, size=SIZE)
    return result


RESULT = scenarios(sys.argv, run_scenario)
end_job(RANK, RESULT, "torch")
