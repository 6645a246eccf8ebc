"""The hierarchical exchange (``SBC(hierarchy=[[0, 1], [2, 3]])``) on one 4-rank job: 2 "nodes"
of 2 ranks. argv: OUT [k=v ...]; writes OUT/rank<R>.json.

Parts (each recorded under its own key):
  errors     bad groupings and combinations: the message each rank raised
  teacher    a small MLP on a linear teacher (every rank its own samples), SGD momentum,
             ``SBC(density=0.05, delay=2)``: per configuration (``res_in_weights`` with the
             plain outer step, ``res_stored`` with ``local_residual=False`` and Nesterov) the
             digests of the shared weights after every sync, of the weights after every step,
             the stored residuals' names and norms, ``stats()``; a checkpoint mid-delay, and
             two resumes in fresh optimizers (this rank's file, rank 0's file)
  flat       the same teacher run with flat SBC (for the bits comparison)
  stock      the ``res_in_weights`` teacher run through stock ``hvd.DistributedOptimizer`` with
             ``compression=SBC(density=0.05, delay=2, hierarchy=...)`` (weights per step)
  nonfinite  a NaN on rank 3 (``nonfinite="raise"``: every rank's error) and on rank 1
             (``"skip"``: every rank skips, then syncs again)
  mnist1d    test accuracy after ``steps`` steps of flat and of hierarchical SBC on mnist1d
             (p = 0.01, delay 4; data from ``data=<npz>``, made once by the test)
"""
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import tensor_digest as digest, write_result  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import horovod_sbc.torch as sbc  # noqa: E402
from horovod_sbc.torch.outer import Nesterov  # noqa: E402

OUT = sys.argv[1]
KW = dict(a.split("=", 1) for a in sys.argv[2:])
GROUPS = [[0, 1], [2, 3]]
hvd.init(process_sets=sbc.hierarchy_process_sets(GROUPS))
torch.set_num_threads(1)
RANK, SIZE = hvd.rank(), hvd.size()
DELAY, FIRST, MORE = 2, 5, 6  # the checkpoint falls mid-delay (syncs after steps 2, 4, 6, ...)


def error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def part_errors():
    def build(hierarchy, **kw):
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return sbc.DistributedOptimizer(opt, model.named_parameters(),
                                        compression=sbc.SBC(hierarchy=hierarchy, **kw))
    mine = [[0, 1], [2, 3]] if RANK < 2 else [[0, 2], [1, 3]]
    return {"missing": error_of(lambda: build([[0, 1], [2]])),
            "uneven": error_of(lambda: build([[0, 1, 2], [3]])),
            "twice": error_of(lambda: build([[0, 1], [1, 2, 3]])),
            "node": error_of(lambda: build("node")),
            "server": error_of(lambda: build(GROUPS, topology="server")),
            "disagree": error_of(lambda: build(mine)),
            "fp16": error_of(lambda: sbc.DistributedOptimizer(
                torch.optim.SGD(torch.nn.Linear(4, 2).half().parameters(), lr=0.1),
                compression=sbc.SBC(hierarchy=GROUPS))),
            "undeclared": error_of(lambda: build([[0, 3], [1, 2]]))}


def teacher_batch(step):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    x = torch.randn(32, 12, generator=g)
    w = torch.randn(12, 4, generator=torch.Generator().manual_seed(123))
    return x, (x @ w).argmax(1)


def build_teacher(hierarchy, local_residual, outer, nonfinite="raise"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = sbc.DistributedOptimizer(
        base, model.named_parameters(),
        compression=sbc.SBC(density=0.05, delay=DELAY, hierarchy=hierarchy, nonfinite=nonfinite,
                            local_residual=local_residual, outer=outer))
    sbc.broadcast_state(model, opt)
    return model, opt


def shared(opt):
    ref = opt.compression.manager.reference
    return digest([ref[n] for n, _ in opt._sbc_params])


def train(model, opt, start, steps, rec):
    for s in range(start, start + steps):
        x, y = teacher_batch(s)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        rec["losses"].append(loss.item())
        rec["weights"].append(digest(model.parameters()))
        if opt.local_steps_pending == 0:
            rec["shared"].append(shared(opt))
            ref = opt.compression.manager.reference
            rec["on_shared"].append(all(torch.equal(p, ref[n])
                                        for n, p in opt._sbc_params))


def new_rec():
    return {"losses": [], "weights": [], "shared": [], "on_shared": []}


def run_teacher(hierarchy, local_residual, outer):
    model, opt = build_teacher(hierarchy, local_residual, outer())
    rec = new_rec()
    train(model, opt, 0, FIRST, rec)
    name = f"{'in_weights' if local_residual else 'stored'}"
    path = os.path.join(KW["ckpt"], f"{name}.rank{{}}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path.format(RANK))
    res = opt.compression.manager.residuals
    rec["residuals"] = {k: float(v.abs().sum()) for k, v in sorted(res.items())}
    train(model, opt, FIRST, MORE, rec)
    rec["stats"] = opt.stats()
    rec["numel"] = sum(p.numel() for p in model.parameters())
    hvd.allreduce(torch.zeros(1), name=f"ckpt.barrier.{name}")  # every file is written
    resumed = {}
    for src in ("self", 0):
        m2, o2 = build_teacher(hierarchy, local_residual, outer())
        st = torch.load(path.format(RANK if src == "self" else src), weights_only=False)
        m2.load_state_dict(st["model"])
        o2.load_state_dict(st["opt"])
        r2 = new_rec()
        r2["after_load"] = {"shared": shared(o2), "weights": digest(m2.parameters()),
                            "local_steps": o2.local_steps_pending}
        train(m2, o2, FIRST, MORE, r2)
        resumed[str(src)] = r2
    rec["resumed"] = resumed
    if not local_residual:
        rec["finish"] = finish_check(model, opt)
    return rec


def finish_check(model, opt):
    """``finish(average_residuals=True)`` with the residual beside the shared weights: every
    rank ends on W_ref + the average over ranks of its node's residual pieces times the node
    size (each piece is one local rank's share of its node's residual), computed here from
    the pieces themselves."""
    opt.synchronize()  # the pending window: the expectation sees the final residuals
    local_size = len(GROUPS[0])
    share = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}
    pieces = opt.compression.manager.residuals
    for key, t in pieces.items():
        name, span = key.rsplit("[", 1)
        a, b = (int(x) for x in span[:-1].split(":"))
        share[name][a:b] = t.double() * local_size
    with opt.shared_weights():
        ref = {n: p.detach().double().reshape(-1).clone() for n, p in model.named_parameters()}
    want = {n: ref[n] + hvd.allreduce(v, op=hvd.Average, name=f"test.finish.{n}")
            for n, v in share.items()}
    opt.finish(average_residuals=True)
    got = {n: p.detach().double().reshape(-1) for n, p in model.named_parameters()}
    return {"max_diff": max(float((got[n] - want[n]).abs().max()) for n in got),
            "moved": max(float((want[n] - ref[n]).abs().max()) for n in got),
            "digest": digest(model.parameters()),
            "pieces_zero": all(float(t.abs().sum()) == 0.0 for t in pieces.values()),
            "on_shared": shared(opt) == digest([p for _, p in opt._sbc_params])}


def part_nonfinite():
    out = {}
    for mode, bad_rank in (("raise", 3), ("skip", 1)):
        model, opt = build_teacher(GROUPS, True, None, nonfinite=mode)
        rec = new_rec()
        train(model, opt, 0, DELAY, rec)
        before = shared(opt)
        x, y = teacher_batch(99)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # a local step, then the NaN, then the step that syncs
        if RANK == bad_rank:
            with torch.no_grad():
                model[2].bias[1] = float("nan")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            err = error_of(opt.step)
        after = shared(opt)
        out[mode] = {"error": err, "unchanged": before == after,
                     "warnings": [str(w.message) for w in caught]}
        if mode == "skip":  # training goes on
            out[mode]["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            train(model, opt, 100, DELAY, rec)
            out[mode]["synced_again"] = rec["shared"][-1] != after
    return out


def part_mnist1d():
    from benchmarks.tasks import mnist1d_cnn
    d = np.load(KW["data"])
    xtr, ytr = torch.from_numpy(d["x_train"]), torch.from_numpy(d["y_train"])
    xte, yte = torch.from_numpy(d["x_test"]), torch.from_numpy(d["y_test"])
    xs, ys = xtr[RANK::SIZE], ytr[RANK::SIZE]
    steps = int(KW.get("steps", 500))
    out = {}
    for label, hierarchy in (("flat", None), ("hier", GROUPS)):
        torch.manual_seed(0)
        model = mnist1d_cnn(32, xtr.shape[1])
        opt = sbc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                       model.named_parameters(),
                                       compression=sbc.SBC(density=0.01, delay=4,
                                                           hierarchy=hierarchy))
        sbc.broadcast_state(model, opt)
        g = torch.Generator().manual_seed(RANK)
        for _ in range(steps):
            idx = torch.randint(len(xs), (64,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
            opt.step()
        with opt.shared_weights(), torch.no_grad():
            acc = float((model(xte).argmax(-1) == yte).float().mean())
        out[label] = {"accuracy": acc, "stats": opt.stats()}
    return out


def part_stock():
    """The one-line change, ``hvd.DistributedOptimizer(..., compression=SBC(hierarchy=...))``:
    SGD at delay 2 exchanges weight changes (horovod_sbc.policy), the hierarchy's exchange."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=sbc.SBC(density=0.05, delay=DELAY,
                                                       hierarchy=GROUPS))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rec = new_rec()
    for s in range(FIRST + MORE):
        x, y = teacher_batch(s)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        rec["weights"].append(digest(model.parameters()))
    rec["stats"] = opt.stats()
    return rec


def part_flat():
    model, opt = build_teacher(None, True, None)
    train(model, opt, 0, FIRST + MORE, new_rec())
    return {"stats": opt.stats()}


T0 = time.time()
result = {"rank": RANK, "size": SIZE, "path": sbc.__file__, "seconds": {}}
parts = [("errors", part_errors),
         ("res_in_weights", lambda: run_teacher(GROUPS, True, lambda: None)),
         ("res_stored", lambda: run_teacher(GROUPS, False, lambda: Nesterov(0.7, 0.9))),
         ("flat", part_flat), ("stock", part_stock), ("nonfinite", part_nonfinite)]
if "data" in KW:
    parts.append(("mnist1d", part_mnist1d))
for key, fn in parts:
    t = time.time()
    result[key] = fn()
    result["seconds"][key] = round(time.time() - t, 2)
result["seconds"]["start"] = round(T0 - float(os.environ.get("SBC_T0", T0)), 2)
write_result(RANK, result)
