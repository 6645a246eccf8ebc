"""Train a small MLP on scikit-learn's digits (shipped with the package, no download) on several
ranks, dense (Horovod allreduce) and with SBC, and print accuracy and measured compression.

    horovodrun -np 2 python examples/pytorch_sbc_digits.py
    horovodrun -np 2 python examples/pytorch_sbc_digits.py --methods sbc --api stock --density 0.01

``--api dropin`` uses horovod_sbc.torch.DistributedOptimizer (supports --delay); ``--api stock``
uses the one-line change to stock Horovod: hvd.DistributedOptimizer(..., compression=SBC(...)).
"""
import argparse
import hashlib
import sys
import time

import numpy as np
import torch
import horovod.torch as hvd

import horovod_sbc.torch as sbc
from common import digits_split, print_runs


def load_digits_split(seed: int = 0):
    """scikit-learn's digits (offline), 80/20 split, as torch tensors."""
    return tuple(torch.from_numpy(a) for a in digits_split(seed))


def make_model(hidden: int = 256) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def train(method: str, args, data, progress: bool):
    xtr, ytr, xte, yte = data
    torch.manual_seed(args.seed)
    model = make_model(args.hidden)
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    numel = sum(p.numel() for p in model.parameters())
    if method == "dense":
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    elif args.api == "stock":
        comp = sbc.SBC(density=args.density)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=comp)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    else:
        comp = sbc.SBC(density=args.density, delay=args.delay, topology=args.topology,
                       downlink_density=args.downlink_density,
                       downlink_mode="sbc" if args.downlink_binarize else None)
        opt = sbc.DistributedOptimizer(base, model.named_parameters(), compression=comp)
        sbc.broadcast_state(model, opt, root_rank=0)
    # each rank trains on its own shard of the training set
    rank, size = hvd.rank(), hvd.size()
    xs, ys = xtr[rank::size], ytr[rank::size]
    g = torch.Generator().manual_seed(args.seed + rank)
    steps_per_epoch = len(xs) // args.batch_size
    total = steps_per_epoch * args.epochs
    step_times = []
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(xs), generator=g)
        for i in range(steps_per_epoch):
            b = perm[i * args.batch_size:(i + 1) * args.batch_size]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(model(xs[b]), ys[b])
            loss.backward()
            opt.step()
            step_times.append(time.perf_counter() - t0)
        if progress:  # a line per epoch: readable through mpirun's per-line output tags
            done = (epoch + 1) / args.epochs
            print(f"{method:>5} [{'#' * int(30 * done):<30}] {100 * done:3.0f}% "
                  f"epoch {epoch + 1}/{args.epochs} loss {loss.item():.4f}", flush=True)
    if hasattr(opt, "finish"):  # sync a partial delay window, average the ranks' residuals
        opt.finish()
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digests = hvd.allgather_object(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    res = {"method": method, "api": args.api if method != "dense" else "horovod",
           "topology": args.topology if method != "dense" else "allreduce",
           "downlink_density": args.downlink_density if method != "dense" else None,
           "density": args.density if method != "dense" else 1.0,
           "delay": args.delay if method != "dense" else 1, "workers": size,
           "final_accuracy": acc, "step_time_s": float(np.mean(step_times[5:])),
           "steps": total, "params": numel, "ranks_identical": len(set(digests)) == 1}
    if method == "dense":
        res.update(upstream_bits=32 * numel * total, dense_bits=32 * numel * total,
                   downstream_bits=32 * numel * total * (size - 1))
    else:
        st = comp.stats() if args.api == "stock" else opt.stats()
        res.update(st)
        res["per_rank"] = hvd.allgather_object(st)  # every rank's own figures, rank order
    res["compression_ratio"] = res["dense_bits"] / max(1, res["upstream_bits"])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="dense,sbc", help="comma list of dense,sbc")
    ap.add_argument("--api", choices=["dropin", "stock"], default="dropin")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--delay", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--topology", choices=["allgather", "server"], default="allgather",
                    help="server: rank 0 gathers, averages, re-compresses and broadcasts")
    ap.add_argument("--downlink-density", type=float, default=None,
                    help="server topology: top-k density of the downlink (default dense)")
    ap.add_argument("--downlink-binarize", action="store_true",
                    help="server topology: binarize the downlink like SBC (one mean)")
    ap.add_argument("--json", help="write the results (rank 0) to this file")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.api == "stock" and args.delay != 1:
        args.delay = 1  # stock Horovod syncs every step
    hvd.init()
    torch.set_num_threads(1)
    data = load_digits_split(args.seed)
    results = []
    for method in args.methods.split(","):
        results.append(train(method, args, data, hvd.rank() == 0 and not args.no_progress))
    if hvd.rank() == 0:
        print_runs(results, args.json)
    return results


if __name__ == "__main__":
    main()
