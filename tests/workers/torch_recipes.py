"""What users copy from Horovod tutorials, with SBC. argv: OUT MODE [key=value ...] (or OUT
--scenarios JSON, see tests/workers/common.py).

Modes:
  broadcasts    drop-in optimizer (delay 4) with the stock helpers: hvd.broadcast_parameters,
                hvd.broadcast_optimizer_state (which runs a hidden step), hvd.broadcast_object,
                an LR scheduler; digests after every step, stats at the end.
  amp           drop-in (delay 2) driven by torch.amp.GradScaler; rank 1's gradients overflow at
                one step (the scaler skips its update) — the windows must stay aligned.
  stock_options stock hvd.DistributedOptimizer(compression=SBC(...)) with each option
                (sparse_as_dense, backward_passes, predivide, op_sum, groups, synchronize):
                digests and losses per step; for op_sum/groups/predivide also the first step's
                update at density 1 without binarization next to Horovod's dense update.
  noniid        digits split by class (rank r sees only half of the classes), SBC drop-in vs
                training without any exchange: test accuracy on all classes.
  kill_in_sync  rank 1 starts its allgather of the 5th sync and SIGKILLs itself inside it.
"""
import hashlib
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import catch, scenarios, write_result  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import horovod_sbc.torch as sbc  # noqa: E402

KW = {}  # of the scenario running
# These recipes check bit-identical weights after every sync (and the non-IID negative control
# trains on class-split shards): the drop-in's local_residual=False mode. The default
# (local_residual=True) is covered by tests/test_training.py.
LOCAL_RESIDUAL = False
hvd.init()
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()


def digest(model) -> str:
    h = hashlib.sha256()
    for _, t in sorted(model.state_dict().items()):
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def shared_digest(model, opt) -> str:
    """The weights every rank must share: an optimizer SBC adopted (stock Horovod's SGD
    exchanges weight changes, each rank's residual in its weights) shows its shared ones."""
    shared = getattr(opt, "shared_weights", None)
    if shared is None:
        return digest(model)
    with shared():
        return digest(model)


def mlp(seed=0, width=32):
    torch.manual_seed(seed + 17 * RANK)  # different on purpose: the broadcast must fix it
    return torch.nn.Sequential(torch.nn.Linear(20, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 5))


def batch(step, n=16):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    x = torch.randn(n, 20, generator=g)
    return x, (x[:, :5].argmax(1))  # a learnable target


def run_broadcasts():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    opt = sbc.DistributedOptimizer(opt, model.named_parameters(),
                                   compression=sbc.SBC(density=0.05, delay=4,
                                                       local_residual=LOCAL_RESIDUAL))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=40, gamma=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    epoch = hvd.broadcast_object(7 if RANK == 0 else -1, root_rank=0)
    digests, losses = [digest(model)], []
    for s in range(int(KW.get("steps", 160))):
        x, y = batch(s)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        digests.append(digest(model))
        losses.append(loss.item())
    return {"digests": digests, "stats": opt.stats(), "epoch": epoch, "losses": losses,
            "lr": opt.param_groups[0]["lr"]}


def run_amp():
    model = mlp()
    opt = sbc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   model.named_parameters(),
                                   compression=sbc.SBC(density=0.1, delay=2,
                                                       local_residual=LOCAL_RESIDUAL))
    sbc.broadcast_state(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    digests, skipped = [digest(model)], []
    for s in range(12):
        x, y = batch(s)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if s == 4 and RANK == 1:  # an overflow on this rank only, at a local (non-sync) step
            next(model.parameters()).grad[0, 0] = float("inf")
        before = digest(model)
        scaler.step(opt)
        scaler.update()
        skipped.append(s % 2 == 0 and digest(model) == before)  # local step (no sync) skipped?
        digests.append(digest(model))
    return {"digests": digests, "stats": opt.stats(), "skipped_local": skipped,
            "scale": scaler.get_scale()}


class EmbNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, sparse=True)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


OPTIONS = ("sparse_as_dense", "backward_passes", "predivide", "op_sum", "groups", "synchronize")


def run_stock_options():
    """Every option for 30 steps with SBC; op_sum/groups/predivide also one step at density 1
    without binarization and one with Horovod's dense allreduce, to compare the updates."""
    out = {}
    for option in OPTIONS:
        if option == "op_sum":  # weight changes are averaged: the sum is refused, clearly
            out[option] = {"error": catch(lambda: run_stock_option(option, 2, 0.1, "sbc",
                                                                   False))}
            continue
        out[option] = run_stock_option(option, steps=30, density=0.1, mode="sbc", dense=False)
    for option in ("groups", "predivide"):
        out[option + "_exact"] = run_stock_option(option, 1, 1.0, "values", False)
        out[option + "_dense"] = run_stock_option(option, 1, 1.0, "values", True)
    return out


def run_stock_option(option, steps, density, mode, dense):
    torch.manual_seed(0)
    model = EmbNet() if option == "sparse_as_dense" else mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    kw = {}
    if option == "sparse_as_dense":
        kw["sparse_as_dense"] = True
    elif option == "backward_passes":
        kw["backward_passes_per_step"] = 2
    elif option == "predivide":
        kw["gradient_predivide_factor"] = 2.0
    elif option == "op_sum":
        kw["op"] = hvd.Sum
    elif option == "groups":
        kw["groups"] = 2
    comp = hvd.Compression.none if dense else sbc.SBC(density=density, mode=mode)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=comp, **kw)
    digests, losses = [digest(model)], []
    first_update = None
    for s in range(steps):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        passes = 2 if option == "backward_passes" else 1
        for k in range(passes):
            if option == "sparse_as_dense":
                g = torch.Generator().manual_seed(1000 * s + 10 * k + RANK)
                idx = torch.randint(0, 50, (16, 4), generator=g)
                y = idx[:, 0] % 5
                loss = torch.nn.functional.cross_entropy(model(idx), y)
            else:
                x, y = batch(100 * s + k)
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        if option == "synchronize":  # the gradient-clipping recipe
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        if first_update is None:
            first_update = {n: (p.detach() - before[n]).reshape(-1).tolist()
                            for n, p in model.named_parameters()}
        digests.append(shared_digest(model, opt))
        losses.append(loss.item())
    res = {"digests": digests, "losses": losses, "first_update": first_update}
    if not dense:
        res["stats"] = comp.stats()
    return res


def digits_by_class():
    from examples.common import digits_split
    xtr, ytr, xte, yte = digits_split(0)
    mine = (ytr < 5) if RANK % 2 == 0 else (ytr >= 5)
    return (torch.from_numpy(xtr[mine]), torch.from_numpy(ytr[mine]),
            torch.from_numpy(xte), torch.from_numpy(yte))


def run_noniid():
    return {"sbc": train_noniid(True), "alone": train_noniid(False)}


def train_noniid(exchange: bool):
    xtr, ytr, xte, yte = digits_by_class()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if exchange:
        opt = sbc.DistributedOptimizer(opt, model.named_parameters(),
                                       compression=sbc.SBC(density=0.05, delay=1,
                                                           local_residual=LOCAL_RESIDUAL))
        sbc.broadcast_state(model, opt)
    else:  # the negative control: same start, same data, no communication at all
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(RANK)
    for _ in range(int(KW.get("steps", 600))):
        i = torch.randint(0, len(xtr), (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xtr[i]), ytr[i]).backward()
        opt.step()
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    return {"accuracy": acc, "digest": digest(model)}


def run_kill_in_sync():
    from horovod_sbc.torch.sync import transport as ex
    model = mlp()
    opt = sbc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   model.named_parameters(),
                                   compression=sbc.SBC(density=0.1, local_residual=LOCAL_RESIDUAL))
    sbc.broadcast_state(model, opt)
    real = ex.allgather
    calls = {"n": 0}

    def allgather(step, name):
        calls["n"] += 1
        print(f"rank {RANK} entering SBC sync {calls['n']}", flush=True)
        if RANK == 1 and calls["n"] == 5:
            hvd.allgather_async(step, name=name)  # the allgather has started ...
            print("rank 1 dies inside its allgather", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # ... and this rank dies in it
        return real(step, name)

    ex.allgather = allgather
    for s in range(20):
        x, y = batch(s)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {"finished": True}


MODES = {"broadcasts": run_broadcasts, "amp": run_amp, "stock_options": run_stock_options,
         "noniid": run_noniid, "kill_in_sync": run_kill_in_sync}


def run_scenario(mode, kw):
    global KW, LOCAL_RESIDUAL
    KW = kw
    LOCAL_RESIDUAL = KW.get("local_residual", "0") == "1"
    return MODES[mode]()


if __name__ == "__main__":
    write_result(RANK, scenarios(sys.argv, run_scenario))
