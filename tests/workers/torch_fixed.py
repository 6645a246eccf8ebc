"""Fixed-size messages on a real job. argv: OUT; writes OUT/rank<R>.json.

For the stock hook and the drop-in (``local_residual=False``), with the C kernels on and off,
trains a small model 4 steps with ``SBC(fixed_size=True)`` and again without it, recording the
sha256 of all parameters after every step, stats, the bytes this rank put into allgathers and
the distinct allgather sizes per name.
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_result  # noqa: E402

import torch  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import horovod_sbc.torch as sbc  # noqa: E402
from horovod_sbc import kernels  # noqa: E402
from horovod_sbc.torch.sync import transport  # noqa: E402

hvd.init()
torch.set_num_threads(1)
RANK = hvd.rank()
SENT = {"bytes": 0, "sizes": {}}
_ag = transport.allgather


def _record(step, name):
    SENT["bytes"] += step.numel()
    SENT["sizes"].setdefault(name, set()).add(step.numel())


def _rec_allgather(step, name):
    _record(step, name)
    return _ag(step, name)


transport.allgather = _rec_allgather


def digest(model):
    h = hashlib.sha256()
    for _, p in sorted(model.state_dict().items()):
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def shared_digest(model, opt):
    """The weights every rank must share: the shared weights of an optimizer that keeps each
    rank's residual in its weights (the drop-in, or stock Horovod's once SBC adopted it)."""
    shared = getattr(opt, "shared_weights", None)
    if shared is None:
        return digest(model)
    with shared():
        return digest(model)


def run(api: str, fixed: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    with torch.no_grad():
        model[0].weight.add_(0.01 * RANK)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    named = list(model.named_parameters())
    comp = sbc.SBC(density=0.05, fixed_size=fixed)
    if api == "stock":
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=comp)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        stats = comp.stats
    else:
        comp = sbc.SBC(density=0.05, fixed_size=fixed, local_residual=False)
        opt = sbc.DistributedOptimizer(base, named, compression=comp)
        sbc.broadcast_state(model, opt, root_rank=0)
        stats = opt.stats
    SENT["bytes"], SENT["sizes"] = 0, {}
    digests = []
    for step in range(4):
        g = torch.Generator().manual_seed(1000 * step + RANK)
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        digests.append(shared_digest(model, opt))
    return {"digests": digests, "stats": stats(), "sent": SENT["bytes"],
            "sizes": {k: sorted(v) for k, v in SENT["sizes"].items()}}


out = {}
for api in ("stock", "dropin"):
    for kern in ("on", "off"):
        for fixed in (True, False):
            if kern == "off":
                with kernels.disabled():
                    out[f"{api}/{kern}/{int(fixed)}"] = run(api, fixed)
            else:
                out[f"{api}/{kern}/{int(fixed)}"] = run(api, fixed)
write_result(RANK, out)
