"""SBC in plain PyTorch DistributedDataParallel: the comm hook (one line) or the model averager.

    torchrun --nproc_per_node=2 examples/pytorch_ddp_sbc.py                      # SBC hook, gloo
    torchrun --nproc_per_node=2 examples/pytorch_ddp_sbc.py --method averager --period 4
    torchrun --nproc_per_node=2 examples/pytorch_ddp_sbc.py --method dense       # no hook
    torchrun --nproc_per_node=4 examples/pytorch_ddp_sbc.py --backend nccl       # one GPU per rank

The data is generated or shipped locally, never downloaded: scikit-learn's digits (default) or
``--data mnist1d`` (made by ``mnist1d.data.make_dataset``, if the mnist1d package is installed).
Each rank trains on its own shard; rank 0 prints accuracy, upstream bits, the compression ratio
against a dense fp32 upload, the step time and whether all ranks ended bit-identical.
"""
import argparse
import hashlib
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_sbc.torch import SBC
from horovod_sbc.torch.ddp import SBCModelAverager, SBCState, sbc_hook, shutdown


def load_data(name: str):
    """(x_train, y_train, x_test, y_test) as float32 / int64 numpy arrays, standardised."""
    if name == "mnist1d":
        from mnist1d.data import get_dataset_args, make_dataset
        d = make_dataset(get_dataset_args())  # generated locally (no download)
        x, y, xt, yt = d["x"], d["y"], d["x_test"], d["y_test"]
    else:
        from sklearn.datasets import load_digits
        xa, ya = load_digits(return_X_y=True)
        idx = np.random.default_rng(0).permutation(len(xa))
        n_test = len(xa) // 5
        x, y, xt, yt = xa[idx[n_test:]], ya[idx[n_test:]], xa[idx[:n_test]], ya[idx[:n_test]]
    mu, sd = x.mean(0), x.std(0) + 1e-6
    f = lambda a: torch.from_numpy(((a - mu) / sd).astype(np.float32))  # noqa: E731
    return f(x), torch.from_numpy(y.astype(np.int64)), f(xt), torch.from_numpy(yt.astype(np.int64))


def digest(model: torch.nn.Module) -> torch.Tensor:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return torch.tensor(list(h.digest()), dtype=torch.uint8)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="hook",
                    choices=["hook", "averager", "dense", "powersgd"])
    ap.add_argument("--density", type=float, default=0.01, help="SBC's p")
    ap.add_argument("--period", type=int, default=4, help="averager: local steps per average")
    ap.add_argument("--granularity", default="parameter", choices=["parameter", "bucket"])
    ap.add_argument("--rank-powersgd", type=int, default=1)
    ap.add_argument("--data", default="digits", choices=["digits", "mnist1d"])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cpu")
    if args.backend == "nccl":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
    x, y, xt, yt = (t.to(dev) for t in load_data(args.data))
    xs, ys = x[rank::size], y[rank::size]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10)).to(dev)
    model = DDP(net, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    stats = None
    if args.method == "hook":
        # the one-line change: SBC as DDP's communication hook
        state = SBCState(model, SBC(density=args.density), granularity=args.granularity)
        model.register_comm_hook(state, sbc_hook)
        stats = state.stats
    elif args.method == "averager":
        # communication delay: local steps (no gradient exchange), then the SBC weight update
        model.register_comm_hook(None, noop_hook)
        averager = SBCModelAverager(model, period=args.period, density=args.density)
        opt = PostLocalSGDOptimizer(opt, averager)
        stats = averager.stats
    elif args.method == "powersgd":
        model.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=args.rank_powersgd),
                                 powerSGD_hook)
    numel = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(rank)
    steps, t_steps = 0, 0.0
    for _ in range(args.epochs):
        perm = torch.randperm(len(xs), generator=g).to(dev)
        for i in range(0, len(xs) - args.batch + 1, args.batch):
            b = perm[i:i + args.batch]
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[b]), ys[b]).backward()
            opt.step()
            t_steps += time.perf_counter() - t0
            steps += 1
    if args.method == "averager" and averager.local_steps_pending:
        averager.synchronize()  # end on shared weights: average the pending local steps
    with torch.no_grad():
        acc = float((net(xt).argmax(1) == yt).float().mean())
    d = digest(net).to(dev)
    ds = [torch.empty_like(d) for _ in range(size)]
    dist.all_gather(ds, d)
    identical = all(bool((o == d).all()) for o in ds)
    if rank == 0:
        st = stats() if stats else None
        dense = 32 * numel * steps
        up = st["upstream_bits"] if st else None
        ratio = f"{dense / up:.0f}x" if up else "n/a (measured in benchmarks/bench_ddp.py)"
        print(f"{args.method} on {size} ranks ({args.backend}, {args.data}): accuracy "
              f"{100 * acc:.2f}%, {steps} steps, {1000 * t_steps / steps:.2f} ms/step, "
              f"upstream {up} bits/rank, compression {ratio}, ranks identical: {identical}")
        if st:
            print(f"measured density {st['positions_sent'] / max(1, st['elements_synced']):.4f}, "
                  f"syncs {st['syncs']}, bits on the wire incl. padding "
                  f"{st['transport_upstream_bits']}")
    shutdown()  # barrier, then the group torn down (see horovod_sbc.torch.ddp.shutdown)


if __name__ == "__main__":
    main()
