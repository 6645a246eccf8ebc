"""The advise cost model against the network-namespace benchmark: predicted vs measured step time.

    python -m benchmarks.validate_advise --workers 2 --bandwidth 100mbit --bandwidth 1gbit \\
        --json benchmarks/results/advise_validation.json        (root: needs ip netns and tc)

1. :func:`probe_link` measures the rate rank 0 gets sending to rank 1 one way and while both
   send to each other at once (mpi4py Send / Sendrecv): on this veth + tc testbed the two
   directions share the shaped rate, so a rank that sends and receives at once (as in every
   ring collective) gets about half of it. That two-way rate is the model's bandwidth.
2. :func:`benchmarks.bench_net.run_net` measures, on an MLP, the step time of a compute-only run
   (``local``, plain localhost), dense allreduce (``none``) and the drop-in SBC at each shaped
   link, every rank in its own network namespace.
3. :mod:`horovod_sbc.advise` measures the codec on the same MLP's layout in this process and
   predicts the dense and SBC step times from the measured compute time, the two-way rate and
   the given latency.
4. The table gives predicted, measured and the error (predicted / measured - 1); the JSON keeps
   the benchmark's runs, the codec figures and every prediction.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Dict, List, Optional

from horovod_sbc import advise as ad

from . import bench_net as bn
from .bench_train import RESULT_TAG


def probe_worker(nbytes: int, reps: int = 3) -> None:
    """On the ranks: rank 0 <-> rank 1, one way (Send) and both ways at once (Sendrecv), the
    fastest of ``reps``; rank 0 prints the rates as a result line."""
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    r, buf, inbox = comm.Get_rank(), np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    peer = 1 - r if r < 2 else None

    def one_way():
        if r == 0:
            comm.Send(buf, dest=1)
        elif r == 1:
            comm.Recv(inbox, source=0)

    def two_way():
        if peer is not None:
            comm.Sendrecv(buf, dest=peer, recvbuf=inbox, source=peer)
    out = {}
    for name, fn in (("one_way_bps", one_way), ("two_way_bps", two_way)):
        fn()
        comm.Barrier()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            comm.Barrier()
            best = min(best, time.perf_counter() - t0)
        out[name] = 8 * nbytes / best
    if r == 0:
        print(RESULT_TAG + json.dumps(out), flush=True)


def probe_link(workers: int, bandwidth: str, nbytes: int) -> Dict[str, float]:
    """The rate a rank gets sending one way, and sending while receiving, across the testbed
    shaped at ``bandwidth``."""
    from .bench_train import run_job
    with bn.Testbed(workers) as tb:
        tb.set_rate(bn.parse_bandwidth(bandwidth))
        cmd = tb.mpirun_cmd([bn.python_exe(), "-m", "benchmarks.validate_advise", "probe",
                             str(nbytes)])
        (res,) = run_job(cmd, tb.env(), 300)
    return res


def mlp_layout(sizes: List[int]) -> ad.Layout:
    from .bench_train import make_mlp
    return [(n, tuple(p.shape)) for n, p in make_mlp(sizes).named_parameters()]


RATES = {"one_way": "the rate of one TCP stream across the link (bench_net's measure_link)",
         "two_way": "the rate rank 0 gets while rank 1 sends to it at once (probe_link)"}


def link_bps(info: Dict, rate: str) -> float:
    return 1e6 * info["link_measured_mbit"] if rate == "one_way" else info["two_way_bps"]


def predictions(res: Dict, codec: ad.CodecCost, latency_s: float, rate: str) -> List[Dict]:
    """One row per (shaped network, method) of the benchmark: measured and predicted step
    seconds, with the link's ``rate`` (a key of RATES) as the model's bandwidth."""
    runs, workers = res["runs"], res["workers"]
    local = next(r for r in runs if r["method"] == "local")
    rows = []
    for info in res["networks"]:
        if info.get("link_measured_mbit") is None:
            continue  # loopback: shared memory, no link to model
        net = ad.Net(link_bps(info, rate), latency_s)
        model = {"none": ad.dense_step(codec, workers, net),
                 "sbc": ad.sbc_allgather_step(codec, workers, net)}
        for r in runs:
            if r["network"] == info["network"] and r["method"] in model:
                row = _row(r, info, model[r["method"]], net, local, _loopback(runs, r))
                rows.append(dict(row, rate=rate))
    return rows


def _loopback(runs: List[Dict], r: Dict) -> Dict:
    return next(x for x in runs if x["network"] == "loopback" and x["label"] == r["label"])


def _row(r: Dict, info: Dict, cost: ad.Cost, net: ad.Net, local: Dict, loop: Dict) -> Dict:
    """``predicted_s``: compute measured + the model (codec measured here + communication);
    ``network_only_s``: the same method's step time at loopback + the model's communication
    (the codec and optimizer as measured inside the job), which isolates the link formulas."""
    pred = local["step_time_s"] + cost.at(net.bps)
    comm = cost.bits / net.bps
    if r["method"] == "none":
        comm = cost.at(net.bps)
    else:  # latencies only: the codec share of ``cost`` is already inside the loopback step
        comm += (r["workers"] - 1) * net.latency_s
    net_only = loop["step_time_s"] + comm
    return {"network": info["network"], "link_mbit": net.bps / 1e6,
            "method": r["label"], "workers": r["workers"], "measured_s": r["step_time_s"],
            "predicted_s": pred, "error": pred / r["step_time_s"] - 1,
            "network_only_s": net_only, "network_only_error": net_only / r["step_time_s"] - 1}


def format_rows(rows: List[Dict], compute_s: float) -> str:
    out = [f"compute only (measured, loopback): {1e3 * compute_s:.1f} ms per step",
           f"{'rate':<8} {'network':<9} {'link':>9} {'N':>3} {'method':<12} {'measured':>10} "
           f"{'predicted':>10} {'error':>7} {'net only':>10} {'error':>7}"]
    for r in rows:
        out.append(f"{r['rate']:<8} {r['network']:<9} {r['link_mbit']:>6.0f} Mb {r['workers']:>3} "
                   f"{r['method']:<12} {1e3 * r['measured_s']:>7.1f} ms {1e3 * r['predicted_s']:>7.1f}"
                   f" ms {100 * r['error']:>+6.1f}% {1e3 * r['network_only_s']:>7.1f} ms"
                   f" {100 * r['network_only_error']:>+6.1f}%")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["probe"]:
        probe_worker(int(argv[1]))
        return 0
    if argv[:1] == ["reanalyse"]:  # the table again from a JSON this script wrote
        saved = json.load(open(argv[1]))
        res, lat = saved["bench_net"], saved["args"]["latency"]
        codec = ad.CodecCost(**res["codec"])
        rows = [r for rate in RATES for r in predictions(res, codec, lat, rate)]
        print(format_rows(rows, next(r for r in res["runs"] if r["method"] == "local")
                          ["step_time_s"]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--bandwidth", action="append", help="tc rate, repeatable (100mbit, 1gbit)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--latency", type=ad.parse_seconds, default=ad.parse_seconds("100us"),
                    help="per message across the veth testbed (default 100us)")
    ap.add_argument("--sizes", default=",".join(map(str, bn.QUICK_SIZES)),
                    help="MLP layer sizes (default the benchmark's quick 2.1M-parameter MLP)")
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=4,
                    help="methods stepped in turns: rounds x 2 steps each (0: one block each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--probe-mbyte", type=int, default=8, help="link probe message (MiB)")
    ap.add_argument("--ompi-allreduce", choices=["ring", "default"], default="ring",
                    help="ring: Open MPI's ring allreduce (the model's formula; NCCL's too); "
                         "default: Open MPI's own choice (at 2 ranks over TCP about twice the "
                         "ring's time here)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.ompi_allreduce == "ring":  # mpirun hands OMPI_MCA_* on to the ranks
        os.environ.update(OMPI_MCA_coll_tuned_use_dynamic_rules="1",
                          OMPI_MCA_coll_tuned_allreduce_algorithm="4")
    methods = [{"method": "local"}, {"method": "none"}, {"method": "sbc", "density": args.density}]
    bws = args.bandwidth or ["100mbit", "1gbit"]
    probes = {b: probe_link(args.workers, b, args.probe_mbyte << 20) for b in bws}
    res = bn.run_net(bws, loopback=True, unlimited=False,
                     workers=args.workers, methods=methods,
                     sizes=[int(x) for x in args.sizes.split(",")], budget_s=args.budget_s,
                     max_steps=args.max_steps,
                     interleave={"rounds": args.rounds, "block": 2} if args.rounds else None)
    if res["errors"]:
        print(json.dumps(res["errors"], indent=1), file=sys.stderr)
        return 1
    for info in res["networks"]:
        info.update(probes.get(info["network"], {}))
    import torch
    torch.set_num_threads(1)  # as the benchmark's ranks
    codec = ad.measure_codec(mlp_layout(res["config"]["sizes"]), args.density, reps=args.reps)
    res["codec"] = asdict(codec)
    rows = [r for rate in RATES for r in predictions(res, codec, args.latency, rate)]
    compute_s = next(r for r in res["runs"] if r["method"] == "local")["step_time_s"]
    print(format_rows(rows, compute_s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "validation": rows, "bench_net": res,
                       "load_average": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
