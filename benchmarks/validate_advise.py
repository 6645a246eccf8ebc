"""The advise cost model against the network-namespace benchmark: predicted vs measured step time.

    python -m benchmarks.validate_advise --workers 2 --bandwidth 100mbit --bandwidth 1gbit \\
        --json benchmarks/results/advise_validation.json        (root: needs ip netns and tc)

1. :func:`probe_link` measures the rate rank 0 gets sending to rank 1 one way and while both
   send to each other at once (mpi4py Send / Sendrecv), and the latency term of the model
   (:func:`latency_worker`: Horovod's allgather of an almost empty tensor over N - 1). Every
   veth end has its own tbf, so the two directions of a link are shaped separately: the
   one-way rate is the model's bandwidth here (the two-way probe read half of it at 4 ranks,
   100 Mbit/s, on an idle machine, repeatably; see docs/advise.md).
2. :func:`benchmarks.bench_net.run_net` measures, on an MLP, the step time of a compute-only run
   (``local``, plain localhost), dense allreduce (``none``) and the drop-in SBC at each shaped
   link, every rank in its own network namespace: with the allgather and, with ``--topology``
   ``both`` (the default) or ``reduce_scatter``, ``SBC(topology="reduce_scatter")`` beside it
   (predicted by :func:`horovod_sbc.advise.sbc_reduce_scatter_step`). The benchmark also times
   the codec's decode calls in the job (``decode_s_per_step``), which the rows set beside the
   model's decode term.
3. :mod:`horovod_sbc.advise` measures the codec on the same MLP's layout and predicts the dense
   and SBC step times from the measured compute time, the link rate and the given latency. The
   codec is measured the way the job runs it (:func:`codec_in_job`): on all N ranks at once
   under ``mpirun`` on localhost, one torch thread each, so that N ranks share this machine's
   cores as in the benchmark (the compute-only step is measured the same way): advise's figures
   (each the fastest of a few runs, which catches a run that had a core to itself) times the
   CPU share (wall time per sync with every rank encoding and decoding back to back, over
   advise's encode + decode of N); the median over ranks of each figure is the model's input.
   ``--codec-regime alone`` measures it in this one process instead (the earlier validations;
   on 2 cores it under-states the codec at 4 and 8 ranks by the ranks' sharing of the cores).
   Both are kept in the JSON. The drop-in's sync work outside the codec (advise's
   ``sync_overhead_s``) is timed in this process and multiplied by the ranks' median CPU share:
   timed on all ranks at once it would be the difference of two contended figures. Open MPI's
   allreduce is forced to the ring at N > 2 and to
   recursive doubling at N = 2 (``--ompi-allreduce auto``, see there).
4. The table gives predicted, measured and the error (predicted / measured - 1), and per
   network the reduce-scatter's step time over the allgather's, measured and predicted
   (:func:`topology_ratios`); the JSON keeps the benchmark's runs, the codec figures and every
   prediction.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
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


def compute_wall(sizes: List[int], batch: int, rank: int, iters: int) -> float:
    """The benchmark's compute-only step (``local``: forward, backward, SGD with momentum on
    the MLP, one thread), ``iters`` of them back to back on every rank at once: wall seconds
    per step. Unlike the benchmark's per-step median of ranks that never wait for each other,
    this is the rate at which N ranks sharing the cores get their steps done, which is what
    bounds a synchronous job's step."""
    import torch
    from mpi4py import MPI
    from .bench_train import make_mlp
    torch.manual_seed(0)
    model = make_mlp(sizes)
    gen = torch.Generator().manual_seed(1 + rank)
    xs = torch.randn(4, batch, sizes[0], generator=gen)
    ys = torch.randint(0, sizes[-1], (4, batch), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(i):
        opt.zero_grad()
        loss_fn(model(xs[i % 4]), ys[i % 4]).backward()
        opt.step()
    for i in range(2):
        step(i)
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    for i in range(iters):
        step(i)
    wall = (time.perf_counter() - t0) / iters
    MPI.COMM_WORLD.Barrier()
    return wall


def codec_worker(sizes: List[int], density: float, reps: int, batch: int = 32,
                 iters: int = 10) -> None:
    """On every rank at once: advise's codec measurement (one torch thread, as the benchmark's
    ranks), then the CPU share: the same sync (encode + decode of N messages) run ``iters``
    times back to back on every rank at once, wall time per sync over advise's figure for it
    (the fastest of a few runs, which on a shared core catches a run that had the core to
    itself). Every time figure is multiplied by that share; rank 0 prints the median over
    ranks of each figure and every rank's figures."""
    import statistics
    import torch
    from mpi4py import MPI
    from horovod_sbc.torch.backend import Targets, backend_for
    import horovod.torch as hvd
    hvd.init()  # its background thread runs beside the codec and the compute, as in the job
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    layout = mlp_layout(sizes)
    comm.Barrier()
    cost = ad.measure_codec(layout, density, reps=reps, sync_overhead=False)  # see main
    enc = ad._encoder(layout, density, 100 + rank)
    gathered = torch.cat([ad._encoder(layout, density, 200 + r)() for r in range(size)])
    outs = [torch.zeros(ad._numel(s)) for _, s in layout]
    backend = backend_for(gathered.device)

    def sync():
        enc()
        backend.decode(gathered, layout, size, Targets.add(outs), 1.0 / size)
    sync()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        sync()
    wall = (time.perf_counter() - t0) / iters
    comm.Barrier()
    share = wall / (cost.encode_s + cost.decode_s(size))
    compute = compute_wall(sizes, batch, rank, iters=2 * iters)
    fig = asdict(cost)
    fig = {k: (v * share if k.endswith("_s") else v) for k, v in fig.items()}
    every = comm.gather({"figures": fig, "alone": asdict(cost), "sync_wall_s": wall,
                         "cpu_share": share, "compute_wall_s": compute}, root=0)
    if rank == 0:
        med = {k: (statistics.median(c["figures"][k] for c in every) if isinstance(v, float)
                   else v) for k, v in every[0]["figures"].items()}
        print(RESULT_TAG + json.dumps({
            "median": med, "cpu_share": [c["cpu_share"] for c in every],
            "compute_s": statistics.median(c["compute_wall_s"] for c in every),
            "ranks": every}), flush=True)


def codec_in_job(workers: int, sizes: List[int], density: float, reps: int,
                 batch: int = 32) -> Dict:
    """advise's codec figures measured on ``workers`` ranks at once on this machine (plain
    ``mpirun`` on localhost, as the benchmark's compute-only reference)."""
    from horovod_sbc.launch import ENV_NAMES, job_env, launcher_prefix
    from .bench_train import run_job
    cmd = launcher_prefix(workers, "mpirun", ENV_NAMES) + [
        bn.python_exe(), "-m", "benchmarks.validate_advise", "codec",
        ",".join(map(str, sizes)), repr(density), str(reps), str(batch)]
    (res,) = run_job(cmd, job_env(), 600)
    return res


def latency_worker(reps: int = 40, warmup: int = 5) -> None:
    """On the ranks: the latency term L of the model, calibrated as alpha-beta models are (alpha
    from an almost empty message): Horovod's allgather of 8 or 9 float32 per rank (the length
    changes every call, as SBC's step message does, so Horovod negotiates it every time as it
    does SBC's), between barriers; the median over calls, the median over ranks; L is that time
    over the model's N - 1 message steps of an allgather. Rank 0 prints it as a result line."""
    import statistics
    import torch
    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    n, ts = hvd.size(), []
    for i in range(warmup + reps):
        x = torch.zeros(8 + i % 2)
        hvd.allreduce(torch.zeros(1), name="lat.barrier")
        t0 = time.perf_counter()
        hvd.allgather(x, name="lat.allgather")
        if i >= warmup:
            ts.append(time.perf_counter() - t0)
    per_rank = hvd.allgather_object(statistics.median(ts))
    if hvd.rank() == 0:
        t = statistics.median(per_rank)
        print(RESULT_TAG + json.dumps({"small_allgather_s": t, "latency_s": t / max(1, n - 1),
                                       "small_allgather_per_rank_s": per_rank}), flush=True)


def probe_link(workers: int, bandwidth: str, nbytes: int) -> Dict[str, float]:
    """The rate a rank gets sending one way, and sending while receiving, across the testbed
    shaped at ``bandwidth``; and the latency term (:func:`latency_worker`)."""
    from .bench_train import run_job
    with bn.Testbed(workers) as tb:
        tb.set_rate(bn.parse_bandwidth(bandwidth))
        cmd = tb.mpirun_cmd([bn.python_exe(), "-m", "benchmarks.validate_advise", "probe",
                             str(nbytes)])
        (res,) = run_job(cmd, tb.env(), 300)
        cmd = tb.mpirun_cmd([bn.python_exe(), "-m", "benchmarks.validate_advise", "latency"])
        (lat,) = run_job(cmd, tb.env(), 300)
    return dict(res, **lat)


def mlp_layout(sizes: List[int]) -> ad.Layout:
    from .bench_train import make_mlp
    return [(n, tuple(p.shape)) for n, p in make_mlp(sizes).named_parameters()]


RATES = {"one_way": "the rate of one TCP stream across the link (bench_net's measure_link)",
         "two_way": "the rate rank 0 gets while rank 1 sends to it at once (probe_link)"}


def link_bps(info: Dict, rate: str) -> float:
    return 1e6 * info["link_measured_mbit"] if rate == "one_way" else info["two_way_bps"]


def method_model(r: Dict, codec: ad.CodecCost, workers: int, net: ad.Net) -> Optional[ad.Cost]:
    """advise's cost of the benchmark run ``r``'s exchange: dense allreduce, SBC over the
    allgather or SBC's sparse reduce-scatter (``r["topology"]``; runs without the key are
    allgather runs); None for a method the model has no formula for here."""
    if r["method"] == "none":
        return ad.dense_step(codec, workers, net)
    if r["method"] != "sbc" or r.get("api", "drop-in") != "drop-in" or r.get("delay", 1) != 1:
        return None
    if r.get("topology") == "reduce_scatter":
        return ad.sbc_reduce_scatter_step(codec, workers, net)
    return ad.sbc_allgather_step(codec, workers, net)


def latency_steps(r: Dict, workers: int) -> int:
    """The model's message steps of a sparse exchange: N - 1 for the ring allgather, and
    N - 1 more for the reduce-scatter's alltoall."""
    return (2 if r.get("topology") == "reduce_scatter" else 1) * (workers - 1)


def decode_model_s(r: Dict, codec: ad.CodecCost, workers: int) -> Optional[float]:
    """The model's decode seconds per sync of a sparse run (None for dense)."""
    if r["method"] != "sbc":
        return None
    if r.get("topology") == "reduce_scatter":
        return ad.reduce_scatter_decode_s(codec, workers)
    return codec.decode_s(workers)


def predictions(res: Dict, codec: ad.CodecCost, latency_s: Optional[float],
                rate: str) -> List[Dict]:
    """One row per (shaped network, method) of the benchmark: measured and predicted step
    seconds, with the link's ``rate`` (a key of RATES) as the model's bandwidth and
    ``latency_s`` as its latency (None: the one measured on that network)."""
    runs, workers = res["runs"], res["workers"]
    local = next(r for r in runs if r["method"] == "local")
    if res.get("compute_in_job_s") is not None:  # see compute_wall
        local = dict(local, step_time_s=res["compute_in_job_s"])
    rows = []
    for info in res["networks"]:
        if info.get("link_measured_mbit") is None:
            continue  # loopback: shared memory, no link to model
        net = ad.Net(link_bps(info, rate), info["latency_s"] if latency_s is None else latency_s)
        for r in runs:
            cost = method_model(r, codec, workers, net) if r["network"] == info["network"] \
                else None
            if cost is not None:
                row = _row(r, info, cost, net, local, _loopback(runs, r))
                dec = decode_model_s(r, codec, workers)
                if dec is not None:
                    row["decode_predicted_s"] = dec
                    row["decode_measured_s"] = r.get("decode_s_per_step")
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
        comm += latency_steps(r, r["workers"]) * net.latency_s
    net_only = loop["step_time_s"] + comm
    return {"network": info["network"], "link_mbit": net.bps / 1e6,
            "latency_us": 1e6 * net.latency_s,
            "method": r["label"], "topology": r.get("topology") or (
                "allgather" if r["method"] != "none" else None),
            "workers": r["workers"], "measured_s": r["step_time_s"],
            "predicted_s": pred, "error": pred / r["step_time_s"] - 1,
            "network_only_s": net_only, "network_only_error": net_only / r["step_time_s"] - 1}


def _latency(s: str) -> Optional[float]:
    return None if s == "measured" else ad.parse_seconds(s)


def all_rows(res: Dict, codec: ad.CodecCost, latency_s: Optional[float]) -> List[Dict]:
    """The rows for each bandwidth reading at ``latency_s``, and with the one-way rate and the
    latency measured on each network (rate ``one_way+L``) where the run measured it."""
    rows = [r for rate in RATES for r in predictions(res, codec, latency_s, rate)]
    if latency_s is not None and all("latency_s" in i for i in res["networks"]
                                     if i.get("link_measured_mbit") is not None):
        rows += [dict(r, rate="one_way+L") for r in predictions(res, codec, None, "one_way")]
    return rows


def format_rows(rows: List[Dict], compute_s: float) -> str:
    width = max([12] + [len(r["method"]) for r in rows])
    out = [f"compute only (the model's input): {1e3 * compute_s:.1f} ms per step",
           f"{'rate':<9} {'network':<9} {'link':>9} {'L':>8} {'N':>3} {'method':<{width}} "
           f"{'measured':>10} {'predicted':>10} {'error':>7} {'net only':>10} {'error':>7} "
           f"{'decode meas/pred':>17}"]
    for r in rows:
        dec = ""
        if r.get("decode_measured_s") is not None:
            dec = (f"{1e3 * r['decode_measured_s']:>7.1f}/{1e3 * r['decode_predicted_s']:.1f}"
                   " ms")
        out.append(f"{r['rate']:<9} {r['network']:<9} {r['link_mbit']:>6.0f} Mb "
                   f"{r.get('latency_us', float('nan')):>5.0f} us {r['workers']:>3} "
                   f"{r['method']:<{width}} {1e3 * r['measured_s']:>7.1f} ms "
                   f"{1e3 * r['predicted_s']:>7.1f} ms {100 * r['error']:>+6.1f}% "
                   f"{1e3 * r['network_only_s']:>7.1f} ms {100 * r['network_only_error']:>+6.1f}%"
                   f" {dec:>17}")
    ratios = topology_ratios(rows)
    if ratios:
        out.append("reduce-scatter step / allgather step:")
        for t in ratios:
            out.append(f"  {t['rate']:<9} {t['network']:<9} N={t['workers']}: measured "
                       f"{t['measured']:.2f}x, predicted {t['predicted']:.2f}x")
    return "\n".join(out)


def topology_ratios(rows: List[Dict]) -> List[Dict]:
    """Per (rate, network): the reduce-scatter's step time over the allgather's (the same
    density, the drop-in), measured and predicted."""
    by = {}
    for r in rows:
        if r.get("topology") in ("allgather", "reduce_scatter"):
            by.setdefault((r["rate"], r["network"], r["workers"]), {})[r["topology"]] = r
    out = []
    for (rate, network, workers), d in by.items():
        if len(d) == 2:
            ag, rs = d["allgather"], d["reduce_scatter"]
            out.append({"rate": rate, "network": network, "workers": workers,
                        "measured": rs["measured_s"] / ag["measured_s"],
                        "predicted": rs["predicted_s"] / ag["predicted_s"]})
    return out


def validation_methods(density: float, topology: str = "both") -> List[Dict]:
    """The benchmark's method entries: compute only, dense allreduce, and the drop-in SBC at
    ``density`` with the allgather, the reduce-scatter or both (``topology``)."""
    if topology not in ("allgather", "reduce_scatter", "both"):
        raise ValueError(f"topology {topology!r}: allgather, reduce_scatter or both")
    methods = [{"method": "local"}, {"method": "none"}]
    if topology in ("allgather", "both"):
        methods.append({"method": "sbc", "density": density})
    if topology in ("reduce_scatter", "both"):
        methods.append({"method": "sbc", "density": density, "topology": "reduce_scatter"})
    return methods


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["probe"]:
        probe_worker(int(argv[1]))
        return 0
    if argv[:1] == ["latency"]:
        latency_worker()
        return 0
    if argv[:1] == ["codec"]:
        codec_worker([int(x) for x in argv[1].split(",")], float(argv[2]), int(argv[3]),
                     int(argv[4]))
        return 0
    if argv[:1] == ["reanalyse"]:  # the table again from a JSON this script wrote
        saved = json.load(open(argv[1]))  # [latency]: another latency than the run's
        res = saved["bench_net"]
        lat = ad.parse_seconds(argv[2]) if len(argv) > 2 else saved["args"]["latency"]
        codec = ad.CodecCost(**res["codec"])
        rows = all_rows(res, codec, lat)
        print(format_rows(rows, res.get("compute_in_job_s") or next(
            r for r in res["runs"] if r["method"] == "local")["step_time_s"]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--bandwidth", action="append", help="tc rate, repeatable (100mbit, 1gbit)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--topology", choices=["allgather", "reduce_scatter", "both"], default="both",
                    help="SBC's exchange(s) measured and predicted (default both, side by side)")
    ap.add_argument("--latency", type=_latency, default=ad.parse_seconds("100us"),
                    help="per message step across the veth testbed (default 100us); "
                         "'measured': the one measured on each shaped network (latency_worker)."
                         " The table has rows with the measured one either way (rate one_way+L)")
    ap.add_argument("--sizes", default=",".join(map(str, bn.QUICK_SIZES)),
                    help="MLP layer sizes (default the benchmark's quick 2.1M-parameter MLP)")
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=4,
                    help="methods stepped in turns: rounds x 2 steps each (0: one block each)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--codec-regime", choices=["job", "alone"], default="job",
                    help="job: the codec measured on all N ranks at once on this machine (the "
                         "CPU share the job's ranks have); alone: in this one process")
    ap.add_argument("--compute-regime", choices=["job", "median"], default="median",
                    help="job: compute time = wall time per compute-only step with all N ranks "
                         "stepping at once (compute_wall); median: the benchmark's compute-only "
                         "(local) per-step median at loopback")
    ap.add_argument("--probe-mbyte", type=int, default=8, help="link probe message (MiB)")
    ap.add_argument("--ompi-allreduce", choices=["auto", "ring", "rd", "default"], default="auto",
                    help="ring: Open MPI's ring allreduce (the model's formula; NCCL's too); "
                         "rd: recursive doubling (at 2 ranks the same wire bits as the ring, "
                         "S each way); auto (default): ring, but rd at 2 ranks, where Open MPI's "
                         "ring took 3 ring steps' time here instead of 2 (see docs/advise.md); "
                         "default: Open MPI's own choice (at 2 ranks over TCP about twice the "
                         "ring's time here)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    algo = args.ompi_allreduce
    if algo == "auto":
        algo = "rd" if args.workers == 2 else "ring"
    args.ompi_allreduce_used = algo
    if algo != "default":  # mpirun hands OMPI_MCA_* on to the ranks
        os.environ.update(OMPI_MCA_coll_tuned_use_dynamic_rules="1",
                          OMPI_MCA_coll_tuned_allreduce_algorithm="4" if algo == "ring" else "3")
    methods = validation_methods(args.density, args.topology)
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
    sizes = res["config"]["sizes"]
    alone = ad.measure_codec(mlp_layout(sizes), args.density, reps=args.reps)
    in_job = codec_in_job(args.workers, sizes, args.density, args.reps,
                          res["config"]["batch_size"])
    res["codec_alone"], res["codec_in_job"] = asdict(alone), in_job
    if args.compute_regime == "job":
        res["compute_in_job_s"] = in_job["compute_s"]
    # the drop-in's sync work outside the codec, timed in this process (timed on all ranks at
    # once it is a difference of two contended figures), times the ranks' median CPU share
    in_job["median"]["sync_overhead_s"] = alone.sync_overhead_s * statistics.median(
        in_job["cpu_share"])
    codec = ad.CodecCost(**in_job["median"]) if args.codec_regime == "job" else alone
    res["codec"] = asdict(codec)
    for name, c in (("alone", alone), ("in job", ad.CodecCost(**in_job["median"]))):
        print(f"codec {name:<6}: encode {1e3 * c.encode_s:.2f} ms, decode of {args.workers} "
              f"{1e3 * c.decode_s(args.workers):.2f} ms, other sync work "
              f"{1e3 * c.sync_overhead_s:.2f} ms")
    print("CPU share per rank (sync wall time with all ranks at once / alone): "
          + ", ".join(f"{x:.2f}" for x in in_job["cpu_share"]))
    rows = all_rows(res, codec, args.latency)
    local_s = next(r for r in res["runs"] if r["method"] == "local")["step_time_s"]
    print(f"compute-only step: benchmark median {1e3 * local_s:.1f} ms, all ranks at once "
          f"{1e3 * in_job['compute_s']:.1f} ms")
    print(format_rows(rows, res.get("compute_in_job_s") or local_s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "validation": rows,
                       "rs_vs_allgather": topology_ratios(rows), "bench_net": res,
                       "load_average": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
