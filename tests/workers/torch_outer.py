"""The drop-in's outer step and checkpoints on a real multi-rank job. argv: OUT MODE [k=v ...]
(or OUT --scenarios JSON: several in one job, see tests/workers/common.py); writes
OUT/rank<R>.json.

A small MLP learns a fixed linear teacher (every rank draws its own samples), SGD momentum 0.9,
``SBC(density=0.05, delay=3)``, the residual in the weights (the drop-in's default).

Modes:
  train   for each outer step in ``outers`` (comma-separated: plain, nesterov): train
          ``first`` steps, save ``ckpt/<outer>/rank<R>.pt`` (model and optimizer, mid-delay),
          continue ``steps`` more; record digests of the weights after every step, of the
          shared weights and of the outer state after every sync, and the losses.
  resume  a new process: load ``ckpt/<outer>/rank<src>.pt`` (``src=self``: this rank's own
          file; ``src=0``: rank 0's, as with Horovod's save-on-rank-0 habit), record the
          digests right after the load, continue ``steps`` steps and record as ``train``.
  rank0_loads  only rank 0 loads its file, then ``broadcast_state``; continue as ``resume``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import scenarios, write_result, tensor_digest as digest  # noqa: E402

import torch  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import horovod_sbc.torch as sbc  # noqa: E402
from horovod_sbc.torch.outer import Nesterov, Plain  # noqa: E402

KW = {}  # of the scenario running
hvd.init()
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()
DELAY = 3
OUTERS = {"plain": Plain, "nesterov": lambda: Nesterov(lr=0.7, momentum=0.9)}


def teacher():
    return torch.randn(12, 4, generator=torch.Generator().manual_seed(123))


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    x = torch.randn(32, 12, generator=g)
    return x, (x @ teacher()).argmax(1)


def build(outer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with torch.no_grad():  # ranks start apart: the broadcast makes them equal
        model[0].weight.add_(0.01 * RANK)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = sbc.DistributedOptimizer(base, model.named_parameters(),
                                   compression=sbc.SBC(density=0.05, delay=DELAY,
                                                       outer=OUTERS[outer]()))
    sbc.broadcast_state(model, opt)
    return model, opt


def shared(opt):
    ref = opt.compression.manager.reference
    return digest([ref[n] for n, _ in opt._sbc_params])


def outer_state(opt):
    bufs = opt.outer.buffers()
    return digest([bufs[n] for n in sorted(bufs)])


def train(model, opt, start, steps, rec):
    for s in range(start, start + steps):
        x, y = batch(s)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        rec["losses"].append(loss.item())
        rec["digests"].append(digest(model.parameters()))
        if opt.local_steps_pending == 0:
            rec["shared"].append(shared(opt))
            rec["outer"].append(outer_state(opt))


def ckpt(outer, rank):
    return os.path.join(KW["ckpt"], outer, f"rank{rank}.pt")


def run_train():
    first, steps = int(KW.get("first", 7)), int(KW.get("steps", 20))
    out = {}
    for outer in KW["outers"].split(","):
        model, opt = build(outer)
        rec = {"losses": [], "digests": [], "shared": [], "outer": []}
        train(model, opt, 0, first, rec)
        os.makedirs(os.path.dirname(ckpt(outer, RANK)), exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt(outer, RANK))
        rec["at_checkpoint"] = {"shared": shared(opt), "outer": outer_state(opt)}
        train(model, opt, first, steps, rec)
        out[outer] = rec
    return out


def run_resume():
    first, steps, outer = int(KW.get("first", 7)), int(KW.get("steps", 20)), KW["outer"]
    src = RANK if KW.get("src", "self") == "self" else int(KW["src"])
    model, opt = build(outer)
    state = torch.load(ckpt(outer, src), weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    ref = opt.compression.manager.reference
    on_shared = all(torch.equal(p, ref[n]) for n, p in model.named_parameters())
    rec = {"losses": [], "digests": [], "shared": [], "outer": [],
           "after_load": {"weights": digest(model.parameters()), "shared": shared(opt),
                          "outer": outer_state(opt), "on_shared_weights": on_shared,
                          "local_steps": opt.local_steps_pending}}
    train(model, opt, first, steps, rec)
    return rec


def run_rank0_loads():
    """Horovod's other habit: only rank 0 loads its file, then broadcast_state makes every rank
    equal (weights, optimizer state, the outer step's momentum)."""
    first, steps, outer = int(KW.get("first", 7)), int(KW.get("steps", 20)), KW["outer"]
    model, opt = build(outer)
    if RANK == 0:
        state = torch.load(ckpt(outer, 0), weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    sbc.broadcast_state(model, opt)  # the weights become the shared weights at the next step
    rec = {"losses": [], "digests": [], "shared": [], "outer": [],
           "after_load": {"weights": digest(model.parameters()), "outer": outer_state(opt)}}
    train(model, opt, first, steps, rec)
    return rec


MODES = {"train": run_train, "resume": run_resume, "rank0_loads": run_rank0_loads}


def run_scenario(mode, kw):
    global KW
    KW = kw
    return {"result": MODES[mode](), "rank": RANK, "size": SIZE}


write_result(RANK, scenarios(sys.argv, run_scenario))
