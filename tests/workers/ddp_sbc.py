"""DDP worker (torchrun, gloo): SBC comm hook and SBC model averager. argv: OUT MODE [key=value]
(or OUT --scenarios JSON: several in one job, see tests/workers/common.py).

Writes OUT/rank<R>.json. Modes:
  train  non-IID digits (rank r sees only the labels = r mod size): the SBC hook, a no-op hook
         (no exchange: the negative control) and the SBC averager with post-local SGD; records
         the sha256 of the parameters after every step, the test accuracy and stats.
  nan    a NaN gradient on rank 1: hook with nonfinite="raise" and "skip", averager "raise".
  kill   rank 1 SIGKILLs itself at step 5 of hook training.
  save / load  checkpoint the hook run and the averager run mid-training (save), continue; or
         load that checkpoint in a fresh job and continue (load). Records the digests after it.
"""
import gc
import hashlib
import os
import signal
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import catch, scenarios, write_result  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (  # noqa: E402
    PostLocalSGDState, post_localSGD_hook)
from torch.distributed.optim import PostLocalSGDOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from horovod_sbc.torch import SBC  # noqa: E402
from horovod_sbc.torch.ddp import SBCModelAverager, SBCState, sbc_hook, shutdown  # noqa: E402

MODE, KW = None, {}  # of the scenario running
dist.init_process_group("gloo")
torch.set_num_threads(1)
RANK, SIZE = dist.get_rank(), dist.get_world_size()


def digits():
    """scikit-learn's digits, standardised, 80/20 split with a fixed permutation."""
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    idx = np.random.default_rng(0).permutation(len(x))
    x = x.astype(np.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    n_test = len(x) // 5
    te, tr = idx[:n_test], idx[n_test:]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return t(x[tr]), t(y[tr]), t(x[te]), t(y[te])


X, Y, XT, YT = digits()
MINE = torch.nonzero(Y % SIZE == RANK).squeeze(1)  # non-IID: this rank's classes only


def batch(step, bs=32):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    i = MINE[torch.randint(0, MINE.numel(), (bs,), generator=g)]
    return X[i], Y[i]


def net():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    with torch.no_grad():  # ranks start different: DDP's broadcast must make them equal
        m[0].weight.add_(0.01 * RANK)
    return m


def digest(model):
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def accuracy(model):
    with torch.no_grad():
        return float((model(XT).argmax(1) == YT).float().mean())


def step(model, opt, s, nan=False):
    x, y = batch(s)
    if nan:
        x = x.clone()
        x[0, 0] = float("nan")
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def hook_model(density=0.05, nonfinite="raise", granularity="parameter", fixed_size=None):
    model = DDP(net())
    state = SBCState(model, SBC(density=density, nonfinite=nonfinite, fixed_size=fixed_size),
                     granularity=granularity)
    model.register_comm_hook(state, sbc_hook)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state


def averager_model(period=4, warmup=0, density=0.05, nonfinite="raise"):
    model = DDP(net())
    if warmup:  # dense gradient averaging for `warmup` steps, then purely local steps
        model.register_comm_hook(PostLocalSGDState(None, None, warmup,
                                                   post_local_gradient_allreduce=False),
                                 post_localSGD_hook)
    else:
        model.register_comm_hook(None, noop_hook)
    avg = SBCModelAverager(model, period=period, warmup_steps=warmup,
                           compression=SBC(density=density, nonfinite=nonfinite))
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), avg)
    return model, opt, avg


def run(model, opt, steps):
    digests = [digest(model.module)]
    for s in range(steps):
        step(model, opt, s)
        digests.append(digest(model.module))
    return digests


def run_train():
    steps = int(KW.get("steps", 150))
    out = {}
    fixed = {"": None, "0": False, "1": True}[KW.get("fixed_size", "")]
    model, opt, state = hook_model(granularity=KW.get("granularity", "parameter"),
                                   fixed_size=fixed)
    out["hook"] = {"digests": run(model, opt, steps), "accuracy": accuracy(model.module),
                   "stats": state.stats(),
                   "backend": state.compression.state.backend("cpu").name}
    model = DDP(net())
    model.register_comm_hook(None, noop_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out["noop"] = {"digests": run(model, opt, steps), "accuracy": accuracy(model.module)}
    model, opt, avg = averager_model(period=4, warmup=10)
    out["averager"] = {"digests": run(model, opt, steps), "accuracy": accuracy(model.module),
                       "stats": avg.stats(), "period": 4, "warmup": 10}
    return out


def run_nan():
    out = {}
    model, opt, state = hook_model()
    step(model, opt, 0)
    out["hook_raise"] = catch(lambda: step(model, opt, 1, nan=RANK == 1))
    model, opt, state = hook_model(nonfinite="skip")
    before, skipped, digests = None, [], []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for s in range(4):
            if s == 2:
                before = digest(model.module)
                opt.zero_grad()
                x, y = batch(s)
                if RANK == 1:
                    x[0, 0] = float("nan")
                torch.nn.functional.cross_entropy(model(x), y).backward()
                skipped.append(state.last_step_skipped)
                if not state.last_step_skipped:
                    opt.step()
            else:
                step(model, opt, s)
                skipped.append(state.last_step_skipped)
            digests.append(digest(model.module))
    out["skip"] = {"skipped": skipped, "digests": digests, "unchanged": digests[2] == before,
                   "warning": next((str(x.message) for x in w if "skipping" in str(x.message)),
                                   None),
                   "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                   "stats": state.stats()}
    model, opt, avg = averager_model(period=2)
    step(model, opt, 0)
    step(model, opt, 1, nan=RANK == 1)  # a local step: rank 1's weights become NaN
    out["averager_raise"] = catch(lambda: step(model, opt, 2))  # the average must fail
    return out


def run_kill():
    model, opt, _ = hook_model()
    for s in range(100_000):
        if s == 5 and RANK == 1:
            print(f"rank {RANK}: killing myself at step {s}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        step(model, opt, s)
    return {}


def run_save_load():
    first, more = int(KW.get("first", 7)), 10
    out = {}
    # load only: "fresh" restores model and optimizer but not the SBC state (a negative control:
    # without the residuals the continuation must differ)
    for kind in ("hook", "averager") + (("fresh",) if MODE == "load" else ()):
        path = os.path.join(KW["ckpt"], f"{'hook' if kind == 'fresh' else kind}_rank{RANK}.pt")
        if kind in ("hook", "fresh"):
            model, opt, state = hook_model()
        else:
            model, opt, state = averager_model(period=3)
        if MODE == "save":
            for s in range(first):
                step(model, opt, s)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sbc": state.state_dict()}, path)
        else:
            ck = torch.load(path, weights_only=False)
            model.module.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            if kind != "fresh":
                state.load_state_dict(ck["sbc"])
        at_ckpt = state.stats()
        digests = []
        for s in range(first, first + more):
            step(model, opt, s)
            digests.append(digest(model.module))
        out[kind] = {"digests": digests, "stats_at_checkpoint": at_ckpt, "stats": state.stats()}
    return out


def run_exact():
    """The hook with SGD lr 0.1 momentum 0.9 weight decay 0.01 on dense values (density 1,
    ``mode="values"``: the exchange is exact), one bucket per parameter pair (``bucket_cap_mb``
    small) and per bucket (``granularity="bucket"``), the optimizer given to ``SBCState`` or not:
    per step the parameters before and after and this rank's own gradients (the module alone,
    outside DDP), and the warnings ``SBCState`` gave."""
    import warnings
    out = {}
    for kind, give, granularity in (("param", True, "parameter"), ("bucket", True, "bucket"),
                                    ("no_opt", False, "parameter")):
        model = DDP(net(), bucket_cap_mb=0.01)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            state = SBCState(model, SBC(density=1.0, mode="values"), granularity=granularity,
                             optimizer=opt if give else None)
        model.register_comm_hook(state, sbc_hook)
        steps = []
        for s in range(4):
            x, y = batch(s)
            params = list(model.module.parameters())
            own = torch.autograd.grad(
                torch.nn.functional.cross_entropy(model.module(x), y), params)
            rec = {"before": [p.detach().double().flatten().tolist() for p in params],
                   "g": [g.double().flatten().tolist() for g in own]}
            step(model, opt, s)
            rec["after"] = [p.detach().double().flatten().tolist() for p in params]
            steps.append(rec)
        out[kind] = {"steps": steps, "warnings": [str(w.message) for w in seen]}
    return out


MODES = {"train": run_train, "nan": run_nan, "kill": run_kill, "save": run_save_load,
         "load": run_save_load, "exact": run_exact}


def run_scenario(mode, kw):
    global MODE, KW
    MODE, KW = mode, kw
    result = MODES[mode]()
    result.update(rank=RANK, size=SIZE)
    return result


write_result(RANK, scenarios(sys.argv, run_scenario))
# the scenarios' DDP models (their reducers hold the process group) are freed while the group
# is alive, not in arbitrary order at interpreter exit: a reducer left from a hook that raised
# aborted one rank there once ("terminate called without an active exception")
gc.collect()
shutdown()
