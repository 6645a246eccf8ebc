"""Elastic Horovod with SBC on a real ``horovodrun`` elastic job (Gloo). argv: [k=v ...].

Every rank trains two models side by side on one linear-regression task (each rank draws its own
samples): one through the drop-in ``horovod_sbc.torch.DistributedOptimizer`` (SGD momentum 0.9,
``SBC(density=0.1, delay=2)``, the residual in the weights), one through stock
``hvd.DistributedOptimizer(compression=SBC(density=0.1))`` (SGD momentum 0.9; ``stock_topology=``
its topology, e.g. ``reduce_scatter``; the stock hook makes it exchange weight changes with the
residual in the weights too, adopted by ``SBCState``), both in one
``SBCState``, committed after every step. Every worker starts from its own random weights.

The schedule, by the step counter that ``SBCState`` carries across resets (the job starts on
3 ranks): at step ``shrink`` with 3 ranks and ``grow`` with 2, rank 0 prints a ``ready`` event
and all ranks commit in a loop until the driver reports the new hosts (the test rewrites the
discovery script when it reads ``ready``); from step ``kill`` with 3 ranks the worker on host
127.0.0.1 exits (``os._exit(1)``) inside the drop-in's allgather, mid-sync, and its host is
blacklisted.

Events, one ``EL {json}`` line each: ``entry`` (each time the training function starts, after
Horovod's sync: digests of the shared weights, residuals, the world SBC records, and the
worker's last committed snapshot), ``ready`` (with the shared models' evaluation losses),
``kill``, ``fail`` (a survivor's HorovodInternalError out of ``optimizer.step()``: are the
weights, shared weights and residuals as they were when the sync's allgather started?) and
``done`` (after ``optimizer.finish()``).
"""
import json
import os
import sys
import time

import torch
import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

import horovod_sbc
import horovod_sbc.torch as sbc
from horovod_sbc.torch.elastic import SBCState, compression_of

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import tensor_digest as digest  # noqa: E402

KW = dict(a.split("=", 1) for a in sys.argv[1:])
STEPS, KILL = int(KW.get("steps", 32)), int(KW.get("kill", 24))
WAITS = {int(KW.get("shrink", 8)): ("shrink", 3), int(KW.get("grow", 16)): ("grow", 2)}
WAIT_S = float(KW.get("wait", 60))
HOST, WID = os.environ.get("HOROVOD_HOSTNAME"), os.getpid()
hvd.init()
torch.set_num_threads(1)
TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
EVAL_X = torch.randn(256, 16, generator=torch.Generator().manual_seed(8))


def emit(ev, **kw):
    print("EL " + json.dumps(dict(ev=ev, wid=WID, rank=hvd.rank(), size=hvd.size(), host=HOST,
                                  **kw)), flush=True)


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    x = torch.randn(32, 16, generator=g)
    return x, x @ TEACHER


torch.manual_seed(WID)  # every worker starts apart: the first sync makes them agree
drop_model, stock_model = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)
drop = sbc.DistributedOptimizer(
    torch.optim.SGD(drop_model.parameters(), lr=0.05, momentum=0.9),
    [(f"d.{n}", p) for n, p in drop_model.named_parameters()],
    compression=sbc.SBC(density=0.1, delay=2))
stock_named = [(f"s.{n}", p) for n, p in stock_model.named_parameters()]
stock = hvd.DistributedOptimizer(torch.optim.SGD(stock_model.parameters(), lr=0.02, momentum=0.9),
                                 named_parameters=stock_named,
                                 compression=sbc.SBC(density=0.1, named_parameters=stock_named,
                                                     topology=KW.get("stock_topology",
                                                                     "allgather")))
STOCK_SBC = compression_of(stock)
state = SBCState(drop_model, drop, stock_model=stock_model, stock=stock, step=0)
last_commit = None


def residual_max(tensors):
    return max([float(t.abs().max()) for t in tensors if t.numel()] or [0.0])


def snapshot():
    """What each rank must keep or agree on (names sorted: the same order on every rank)."""
    ref, res = drop.compression.manager.reference, drop.residuals()
    # the stock optimizer runs the drop-in's step (SBCState adopted it): its shared weights,
    # its residual W - W_ref, the reduce-scatter's downlink residuals of the regions it owns
    sref, sres = STOCK_SBC.manager.reference, stock.residuals()
    sdown = STOCK_SBC.manager.server_residuals
    return {"wref": digest([ref[k] for k in sorted(ref)]),
            "res": digest([res[k] for k in sorted(res)]),
            "res_max": residual_max(res.values()),
            "stock_w": digest([sref[k] for k in sorted(sref)]),
            "stock_weights": digest([p for _, p in sorted(stock_named)]),
            "stock_res": digest([sres[k] for k in sorted(sres)]),
            "stock_res_max": residual_max(sres.values()),
            "stock_down": digest([sdown[k] for k in sorted(sdown)]),
            "stock_down_max": residual_max(sdown.values()),
            "local_steps": drop.local_steps_pending,
            "weights": digest([p for _, p in sorted(drop_model.named_parameters())])}


class Watched:
    """The drop-in's transport: a snapshot when each sync's allgather starts; on host
    127.0.0.1 from step ``kill`` on (3 ranks), this worker dies there."""

    def __init__(self, inner):
        self.inner, self.before = inner, None

    def world(self):
        return self.inner.world()

    def allgather(self, step, tag):
        self.before = snapshot()
        if HOST == "127.0.0.1" and state.step >= KILL and hvd.size() == 3:
            emit("kill", step=state.step)
            os._exit(1)
        return self.inner.allgather(step, tag)


drop.compression.transport = Watched(drop.compression.transport)


def losses():
    y = EVAL_X @ TEACHER
    with torch.no_grad(), drop.shared_weights():
        a = float(torch.nn.functional.mse_loss(drop_model(EVAL_X), y))
    with torch.no_grad(), stock.shared_weights():
        b = float(torch.nn.functional.mse_loss(stock_model(EVAL_X), y))
    return a, b


def wait_for_hosts(state, name):
    global last_commit
    if hvd.rank() == 0:
        emit("ready", name=name, step=state.step, loss=losses())
    deadline = time.time() + WAIT_S
    while time.time() < deadline:  # commit() raises HostsUpdatedInterrupt on the driver's news
        time.sleep(0.1)
        last_commit = snapshot()
        state.commit()
    raise RuntimeError(f"rank {hvd.rank()}: no host update within {WAIT_S:.0f} s ({name})")


def one_step(state):
    x, y = batch(state.step)
    stock.zero_grad()
    torch.nn.functional.mse_loss(stock_model(x), y).backward()
    stock.step()
    drop.zero_grad()
    torch.nn.functional.mse_loss(drop_model(x), y).backward()
    try:
        drop.step()
    except HorovodInternalError:
        before = drop.compression.transport.before
        emit("fail", step=state.step, unchanged=before == snapshot(), before=before)
        raise


@hvd.elastic.run
def train(state):
    global last_commit
    sd = drop.compression.manager.config
    so = STOCK_SBC.manager.config
    emit("entry", step=state.step, last=last_commit, pkg=horovod_sbc.__file__,
         world=[sd.get("world_size"), sd.get("rank"), so.get("world_size"), so.get("rank")],
         stats=[drop.stats(), STOCK_SBC.stats()], **snapshot())
    while state.step < STEPS:
        wait = WAITS.get(state.step)
        if wait and hvd.size() == wait[1]:
            wait_for_hosts(state, wait[0])
        one_step(state)
        state.step += 1
        last_commit = snapshot()
        state.commit()
    drop.finish()
    stock.finish()
    emit("done", step=state.step, loss=losses(), weights=digest(drop_model.parameters()),
         stock_w=digest(stock_model.parameters()), stats=[drop.stats(), STOCK_SBC.stats()])


train(state)
