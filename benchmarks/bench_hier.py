"""The hierarchical exchange (``SBC(hierarchy=...)``, horovod_sbc/torch/hierarchy.py): figures.

    python -m benchmarks.bench_hier design [--json benchmarks/results/hier_design.json]
    python -m benchmarks.bench_hier train  [--seeds 0 1 2] [--steps 500]
                                           [--json benchmarks/results/hier_train.json]
    python -m benchmarks.bench_hier net    [--bandwidth 100mbit --bandwidth 1gbit]
                                           [--json benchmarks/results/hier_net.json]  (root)

``design`` — the two ways to compress between nodes, measured with the real codec in one
process (no job needed: sizes and codec times do not depend on who runs them), on a node's
average update (Gaussian values, seed 0) of two layouts (the mnist1d CNN, 8,010 elements;
ResNet-18, 11.7M elements) at p = 0.01:

* **per node**: one message per node (local rank 0 compresses the node's average, the cross
  allgather runs among local ranks 0, the gathered bytes are broadcast inside the node, every
  rank decodes one message per node);
* **per shard**: local rank i compresses shard i (1/L of the flat update), one cross allgather
  per local rank index, the decoded shard shared inside the node (what the package does).

For each: upstream bits per node per sync (the real step messages' bytes), step and tensor
messages and positions each rank decodes per sync, the codec time on the busiest rank (encode
+ decode, median of 5), and the dense elements a rank sends inside its node per sync (ring
collectives: allreduce 2N(L-1)/L, reduce-scatter and allgather N(L-1)/L each; with the residual
in the weights, the node's residual travels too).

``train`` — mnist1d (benchmarks/tasks.py, 4,000 training sequences), 4 ranks as 2 nodes of 2
(one local Horovod job per method and seed): dense allreduce (stock ``hvd.DistributedOptimizer``),
flat SBC and hierarchical SBC (both the drop-in, p = 0.01, ``--delay`` (1), SGD lr 0.05 momentum 0.9,
batch 64 per rank, the task's 500 steps): test accuracy of the shared weights, upstream bits
per node, messages decoded per rank per sync, seconds per step on this machine.

``net`` — step time on a two-level network (benchmarks/bench_net.py's namespace testbed with
``ranks_per_node``): 4 ranks as 2 nodes of 2, each node one network namespace (its two ranks
talk over the kernel's local path, unshaped) and one ``tc``-shaped veth between the nodes, the
2.1M-parameter MLP of ``bench net --quick``: dense allreduce, flat SBC and hierarchical SBC
(groups ``[[0, 1], [2, 3]]``), p = 0.01, delay 1, the methods stepped in turns; and the same at
loopback (shared memory, no link).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from horovod_sbc import wire  # noqa: E402
from horovod_sbc.torch import hierarchy  # noqa: E402
from horovod_sbc.torch.backend import Targets, backend_for, frame  # noqa: E402


def _median(fn, reps: int = 5) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _step(items, density: float) -> bytes:
    """One step message of ``items`` ((name, flat tensor)); the tensors are left untouched."""
    layout = [(n, (t.numel(),)) for n, t in items]
    msgs = [backend_for("cpu").encode_tensor(t.clone(), density, "sbc", n).message
            for n, t in items]
    return frame.frame(msgs, wire.layout_fingerprint(layout), "cpu")


def _decode_time(steps: List[torch.Tensor], layout) -> float:
    gathered = torch.cat(steps)
    out = [torch.zeros(n) for _, (n,) in layout]
    return _median(lambda: backend_for("cpu").decode(gathered, layout, len(steps),
                                                     Targets.add(out), 1.0 / len(steps)))


def _encode_time(items, density: float) -> float:
    return _median(lambda: _step(items, density))


def design_case(layout, nodes: int, local: int, density: float = 0.01) -> Dict[str, object]:
    g = torch.Generator().manual_seed(0)
    named = [(n, torch.randn(*s, generator=g).reshape(-1)) for n, s in sorted(layout)]
    numel = sum(t.numel() for _, t in named)
    # per node: one message of the whole update per node
    whole = [(n, t) for n, t in named]
    msg = _step(whole, density)
    lay_whole = [(n, (t.numel(),)) for n, t in whole]
    per_node = {
        "upstream_bits_per_node": 8 * msg.numel(),
        "step_messages_decoded_per_rank": nodes,
        "tensor_messages_decoded_per_rank": nodes * len(whole),
        "positions_decoded_per_rank": nodes * sum(codec_keep(t.numel(), density) for _, t in whole),
        "busiest_rank_codec_s": _encode_time(whole, density) +
        _decode_time([msg] * nodes, lay_whole),
        "intra_dense_elements_per_rank": 2 * numel * (local - 1) / local,
        "intra_dense_elements_per_rank_residual_in_weights": 2 * numel * (local - 1) / local
        + numel,
    }
    # per shard: local rank i compresses shard i
    shards, codec_s, pieces = [], [], []
    flat = torch.cat([t for _, t in named])
    for i in range(local):
        lay = hierarchy.layout(named, local, i)
        items = [(hierarchy.piece_name(lay, p), flat[lay.offsets[p[0]] + p[1]:
                                                  lay.offsets[p[0]] + p[2]]) for p in lay.pieces]
        step = _step(items, density)
        shards.append(step)
        pieces.append(items)
        codec_s.append(_encode_time(items, density) +
                       _decode_time([step] * nodes, [(n, (t.numel(),)) for n, t in items]))
    per_shard = {
        "upstream_bits_per_node": sum(8 * s.numel() for s in shards),
        "step_messages_decoded_per_rank": nodes,
        "tensor_messages_decoded_per_rank": nodes * max(len(p) for p in pieces),
        "positions_decoded_per_rank": nodes * max(sum(codec_keep(t.numel(), density)
                                                      for _, t in p) for p in pieces),
        "busiest_rank_codec_s": max(codec_s),
        "intra_dense_elements_per_rank": 2 * numel * (local - 1) / local,
        "intra_dense_elements_per_rank_residual_in_weights": 3 * numel * (local - 1) / local,
    }
    flat_sbc = {"upstream_bits_per_node": local * 8 * msg.numel(),
                "step_messages_decoded_per_rank": nodes * local,
                "tensor_messages_decoded_per_rank": nodes * local * len(whole)}
    return {"nodes": nodes, "local": local, "numel": numel, "tensors": len(whole),
            "density": density, "per_node": per_node, "per_shard": per_shard,
            "flat": flat_sbc}


def codec_keep(n: int, density: float) -> int:
    from horovod_sbc.reference import keep_count
    return keep_count(n, density)


def cmd_design(args) -> Dict[str, object]:
    from benchmarks.bench_codec import resnet18_shapes
    from benchmarks.tasks import mnist1d_cnn
    torch.manual_seed(0)
    cnn = [(n, tuple(p.shape)) for n, p in mnist1d_cnn().named_parameters()]
    cases = []
    for name, layout, shapes in (("mnist1d_cnn", cnn, ((2, 2), (4, 8))),
                                 ("resnet18", resnet18_shapes(), ((2, 2), (4, 8)))):
        for nodes, local in shapes:
            c = design_case(layout, nodes, local)
            c["layout"] = name
            cases.append(c)
            _print_design(c)
    return {"cases": cases, "torch_threads": torch.get_num_threads()}


def _print_design(c) -> None:
    print(f"\n{c['layout']} ({c['numel']:,} elements, {c['tensors']} tensors), "
          f"{c['nodes']} nodes x {c['local']} ranks, p = {c['density']}")
    keys = ["upstream_bits_per_node", "step_messages_decoded_per_rank",
            "tensor_messages_decoded_per_rank", "positions_decoded_per_rank",
            "busiest_rank_codec_s", "intra_dense_elements_per_rank",
            "intra_dense_elements_per_rank_residual_in_weights"]
    print(f"  {'':52s} {'per node':>14s} {'per shard':>14s} {'flat':>14s}")
    for k in keys:
        row = [c["per_node"].get(k), c["per_shard"].get(k), c["flat"].get(k)]
        print(f"  {k:52s} " + " ".join(f"{v:>14,.4g}" if v is not None else f"{'-':>14s}"
                                         for v in row))


# -- train ---------------------------------------------------------------------------------
WORKER = r'''
import json, sys, time
import numpy as np, torch, horovod.torch as hvd
import horovod_sbc.torch as sbc
from benchmarks.tasks import mnist1d_cnn
method, seed, steps, data, out, delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
GROUPS = [[0, 1], [2, 3]]
hvd.init(process_sets=sbc.hierarchy_process_sets(GROUPS))
torch.set_num_threads(1)
rank, size = hvd.rank(), hvd.size()
d = np.load(data)
xtr, ytr = torch.from_numpy(d["x_train"]), torch.from_numpy(d["y_train"])
xte, yte = torch.from_numpy(d["x_test"]), torch.from_numpy(d["y_test"])
xs, ys = xtr[rank::size], ytr[rank::size]
torch.manual_seed(seed)
model = mnist1d_cnn(32, xtr.shape[1])
base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
if method == "dense":
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), 0)
else:
    opt = sbc.DistributedOptimizer(base, model.named_parameters(), compression=sbc.SBC(
        density=0.01, delay=delay, hierarchy=GROUPS if method == "hier" else None))
    sbc.broadcast_state(model, opt)
g = torch.Generator().manual_seed(1000 * seed + rank)
t0 = time.perf_counter()
for _ in range(steps):
    idx = torch.randint(len(xs), (64,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
    opt.step()
secs = (time.perf_counter() - t0) / steps
ctx = opt.shared_weights() if method != "dense" else torch.no_grad()
with ctx, torch.no_grad():
    acc = float((model(xte).argmax(-1) == yte).float().mean())
stats = opt.stats() if method != "dense" else {}
numel = sum(p.numel() for p in model.parameters())
if rank == 0 or True:
    json.dump({"rank": rank, "accuracy": acc, "stats": stats, "sec_per_step": secs,
               "numel": numel}, open(f"{out}/rank{rank}.json", "w"))
'''


def cmd_train(args) -> Dict[str, object]:
    from benchmarks.tasks import mnist1d_arrays
    from horovod_sbc import launch
    import numpy as np
    tmp = tempfile.mkdtemp(prefix="sbc-hier-bench-")
    xtr, ytr, xte, yte = mnist1d_arrays(6000, 2 / 3, 0)
    np.savez(f"{tmp}/d.npz", x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    script = Path(tmp) / "worker.py"
    script.write_text(WORKER)
    runs = []
    for seed in args.seeds:
        for method in ("dense", "flat", "hier"):
            out = tempfile.mkdtemp(dir=tmp)
            cmd = launch.launcher_prefix(4, "mpirun") + [
                sys.executable, str(script), method, str(seed), str(args.steps),
                f"{tmp}/d.npz", out, str(args.delay)]
            rc, log = launch.run(cmd, 1800, launch.job_env())
            if rc != 0:
                raise RuntimeError(f"{method} seed {seed} failed:\n{log[-3000:]}")
            ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(4)]
            run = _summarise(method, seed, ranks, args.steps, args.delay)
            runs.append(run)
            print(json.dumps(run))
    return {"runs": runs, "summary": _summary(runs), "steps": args.steps, "delay": args.delay}


def _summarise(method, seed, ranks, steps, delay) -> Dict[str, object]:
    accs = {r["accuracy"] for r in ranks}
    run = {"method": method, "seed": seed, "accuracy": ranks[0]["accuracy"],
           "accuracy_identical_on_ranks": len(accs) == 1,
           "sec_per_step": max(r["sec_per_step"] for r in ranks)}
    if method == "dense":
        numel = ranks[0]["numel"]
        # ring allreduce: each rank sends 2 (N-1)/N of the fp32 tensor per step
        run["upstream_bits_per_node_per_step"] = 2 * 32 * numel * 2 * 3 / 4
        run["messages_decoded_per_rank_per_step"] = 0
        return run
    syncs = ranks[0]["stats"]["syncs"]
    node = [sum(ranks[r]["stats"]["upstream_bits"] for r in g) for g in ((0, 1), (2, 3))]
    run["upstream_bits_per_node_per_step"] = statistics.mean(node) / steps
    run["messages_decoded_per_rank_per_step"] = (2 if method == "hier" else 4) / delay
    run["downstream_bits_per_rank_per_step"] = statistics.mean(
        r["stats"]["downstream_bits"] for r in ranks) / steps
    run["intra_node_bits_per_rank_per_step"] = statistics.mean(
        r["stats"]["intra_node_bits"] for r in ranks) / steps
    run["syncs"] = syncs
    return run


def _summary(runs) -> Dict[str, object]:
    out = {}
    for m in ("dense", "flat", "hier"):
        rs = [r for r in runs if r["method"] == m]
        accs = [r["accuracy"] for r in rs]
        out[m] = {"accuracy_mean": statistics.mean(accs),
                  "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                  "seeds": len(rs),
                  "upstream_bits_per_node_per_step": statistics.mean(
                      r["upstream_bits_per_node_per_step"] for r in rs),
                  "messages_decoded_per_rank_per_step": rs[0]["messages_decoded_per_rank_per_step"],
                  "sec_per_step": statistics.median(r["sec_per_step"] for r in rs)}
    return out


NET_METHODS = [{"method": "none"}, {"method": "sbc", "density": 0.01},
               {"method": "sbc", "density": 0.01, "hierarchy": [[0, 1], [2, 3]]}]


def cmd_net(args) -> Dict[str, object]:
    from benchmarks import bench_net as bn
    res = bn.run_net(args.bandwidth or ["100mbit", "1gbit"], loopback=True, unlimited=False,
                     workers=4, methods=NET_METHODS, sizes=bn.QUICK_SIZES,
                     budget_s=args.budget_s, max_steps=8, ranks_per_node=2,
                     interleave={"rounds": args.rounds, "block": 2})
    rows = []
    for r in res["runs"]:
        per_node = 2 * r["upstream_bits_per_step"]  # a node's 2 ranks each send (a shard)
        rows.append({"network": r["network"], "method": r["label"],
                     "step_ms": 1e3 * r["step_time_s"],
                     "upstream_bits_per_node_per_step": per_node})
        print(f"{r['network']:<9} {r['label']:<26} {1e3 * r['step_time_s']:8.1f} ms/step "
              f"{per_node:>12,.0f} bits per node upstream")
    if res["errors"]:
        print(json.dumps(res["errors"], indent=1), file=sys.stderr)
    return {"bench_net": res, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("design", help="per-node vs per-shard messages (one process)")
    d.add_argument("--json", default="benchmarks/results/hier_design.json")
    t = sub.add_parser("train", help="mnist1d, 4 ranks as 2x2: dense, flat SBC, hierarchical")
    t.add_argument("--seeds", type=int, nargs="+", default=[0])
    t.add_argument("--steps", type=int, default=500)
    t.add_argument("--delay", type=int, default=1)
    t.add_argument("--json", default="benchmarks/results/hier_train.json")
    n = sub.add_parser("net", help="step time, 2 nodes of 2 ranks on a shaped link (root)")
    n.add_argument("--bandwidth", action="append", help="tc rate between nodes, repeatable")
    n.add_argument("--rounds", type=int, default=12)
    n.add_argument("--budget-s", type=float, default=6.0)
    n.add_argument("--json", default="benchmarks/results/hier_net.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {"design": cmd_design, "train": cmd_train, "net": cmd_net}[args.cmd](args)
    res["command"] = "python -m benchmarks.bench_hier " + " ".join(argv or sys.argv[1:])
    if args.cmd == "train":
        print(json.dumps(res["summary"], indent=1))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
