"""Worker for SBC(topology="reduce_scatter") (horovod_sbc/torch/sync/scatter.py).
argv: OUT --scenarios JSON (tests/workers/common.py); writes OUT/rank<R>.json.

Scenarios:
  train   train `steps` steps through api=stock|dropin (delay, density, mode, topology,
          hier=1: dense inside [[0,1],[2,3]], local_residual, downlink_mode, downlink_density);
          record the digest of the shared
          weights after every step, stats, and the bytes the collectives actually moved.
  equiv   dense top-k (density 1, values) through both topologies from the same start:
          the largest difference of their weights after 6 steps.
  nan     rank 1 feeds a NaN at step 2: nonfinite="raise" (every rank's error) and "skip".
  save / load  checkpoint after `first` steps, continue 10 (load: in a new process).
  kill    rank 2 dies inside its third alltoall.
"""
import hashlib
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import catch, scenarios, write_result  # noqa: E402

import torch  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import horovod_sbc.torch as sbc  # noqa: E402
from horovod_sbc.torch.sync import transport  # noqa: E402

hvd.init(process_sets="dynamic")
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()
KW = {}
MOVED = {"sent": 0, "received": 0, "alltoalls": 0, "ternary": 0}
_a2a, _ag = transport.alltoall, transport.allgather


def _rec_alltoall(buf, splits, name):
    MOVED["alltoalls"] += 1
    if KW.get("_kill") and RANK == 2 and MOVED["alltoalls"] == 3:
        os._exit(3)  # a rank lost in the middle of a sync
    out = _a2a(buf, splits, name)
    MOVED["sent"] += sum(splits) - splits[RANK]
    MOVED["received"] += out.numel() - splits[RANK]
    return out


def _rec_allgather(step, name):
    out = _ag(step, name)
    MOVED["sent"] += step.numel()
    MOVED["received"] += out.numel() - step.numel()
    if name.endswith(".regions"):  # the owners' tensor messages with sign bits (wire flag 4)
        MOVED["ternary"] += bytes(out.cpu().numpy()).count(b"SB\x01\x04")
    return out


transport.alltoall, transport.allgather = _rec_alltoall, _rec_allgather


class Net(torch.nn.Module):
    """Four tensors of 5,120 / 256 / 1,280 / 5 elements: regions cut through them at 3 and 4
    ranks; ``aux`` gets a gradient only on some steps (the stock hook's layout changes)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(20, 256)
        self.fc2 = torch.nn.Linear(256, 5)
        self.aux = torch.nn.Linear(256, 5)

    def forward(self, x, use_aux):
        h = torch.relu(self.fc1(x))
        return self.fc2(h) + (self.aux(h) if use_aux else 0)


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)


def digest(model):
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode() + p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def build(api, comp, momentum=0.9):
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # ranks start apart: the broadcast must make them equal
        model.fc1.weight.add_(0.01 * RANK)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    named = list(model.named_parameters())
    if api == "stock":
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=comp)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    else:
        opt = sbc.DistributedOptimizer(base, named, compression=comp)
        sbc.broadcast_state(model, opt, root_rank=0)
    return model, opt


def shared_digest(model, opt):
    if hasattr(opt, "shared_weights"):
        with opt.shared_weights():
            return digest(model)
    return digest(model)


def train_step(model, opt, step, nan=False):
    x, y = batch(step)
    if nan:
        x[0, 0] = float("nan")
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x, (step + RANK) % 3 == 0), y)
    loss.backward()
    opt.step()
    return loss.item()


def compressor(**over):
    kw = dict(density=float(KW.get("density", 0.05)), delay=int(KW.get("delay", 1)),
              mode=KW.get("mode", "sbc"), topology=KW.get("topology", "reduce_scatter"),
              local_residual=False)  # the drop-in's shared weights: bit-identical everywhere
    if KW.get("hier") == "1":
        kw["hierarchy"] = [[0, 1], [2, 3]]
    if "downlink_mode" in KW:
        kw["downlink_mode"] = KW["downlink_mode"]
    if "downlink_density" in KW:
        kw["downlink_density"] = float(KW["downlink_density"])
    kw.update(over)
    return sbc.SBC(**kw)


def run_train():
    comp = compressor(local_residual=KW.get("local_residual") == "1")
    model, opt = build(KW.get("api", "dropin"), comp)
    digests, losses = [shared_digest(model, opt)], []
    for s in range(int(KW.get("steps", 8))):
        losses.append(train_step(model, opt, s))
        digests.append(shared_digest(model, opt))
    return {"digests": digests, "losses": losses, "stats": comp.stats(), "moved": dict(MOVED),
            "regions": {k: v.numel() for k, v in comp.manager.server_residuals.items()}}


def run_equiv():
    worst, models = 0.0, []
    for topo in ("allgather", "reduce_scatter"):
        comp = sbc.SBC(density=1.0, mode="values", topology=topo, local_residual=False)
        models.append(build("dropin", comp, momentum=0.0))
    for s in range(6):
        for m, o in models:
            train_step(m, o, s)
    for p1, p2 in zip(models[0][0].parameters(), models[1][0].parameters()):
        worst = max(worst, (p1 - p2).abs().max().item())
    return {"max_abs_diff": worst}


def run_nan():
    out = {}
    for api in ("dropin", "stock"):
        model, opt = build(api, compressor())
        train_step(model, opt, 0)
        out[f"raise_{api}"] = catch(lambda: train_step(model, opt, 1, nan=(RANK == 1)))
    comp = compressor(nonfinite="skip")
    model, opt = build("dropin", comp)
    train_step(model, opt, 0)
    before = shared_digest(model, opt)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        train_step(model, opt, 1, nan=(RANK == 1))
    out["skip_warning"] = str(w[0].message) if w else None
    out["skip_unchanged"] = shared_digest(model, opt) == before
    train_step(model, opt, 2)
    out["skip_after"] = shared_digest(model, opt)
    out["skip_syncs"] = comp.stats()["syncs"]
    return out


def run_save_load(mode):
    comp = compressor(delay=2)
    model, opt = build("dropin", comp)
    first, path = int(KW.get("first", 5)), os.path.join(KW["ckpt"], f"rank{RANK}.pt")
    if mode == "save":
        for s in range(first):
            train_step(model, opt, s)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    else:
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    residuals = len(comp.manager.server_residuals)
    digests = []
    for s in range(first, first + 10):
        train_step(model, opt, s)
        digests.append(shared_digest(model, opt))
    return {"digests": digests, "downlink_residuals": residuals}


def run_kill():
    model, opt = build("dropin", compressor())
    for s in range(6):
        train_step(model, opt, s)
    return {"finished": True}


MODES = {"train": run_train, "equiv": run_equiv, "nan": run_nan, "kill": run_kill,
         "save": lambda: run_save_load("save"), "load": lambda: run_save_load("load")}


def run_scenario(mode, kw):
    KW.clear()
    KW.update(kw, _kill=mode == "kill")
    MOVED.update(sent=0, received=0, alltoalls=0, ternary=0)
    result = MODES[mode]()
    result.update(rank=RANK, size=SIZE)
    return result


write_result(RANK, scenarios(sys.argv, run_scenario))
