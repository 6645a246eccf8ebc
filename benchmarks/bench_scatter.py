"""Reduce-scatter vs allgather, N ranks simulated in one process: ``python -m benchmarks.bench
scatter [--ranks 4,8,16,32,64] [--layout resnet50] [--syncs 20] [--json FILE] [--quick]``.

Every simulated rank has its own :class:`~horovod_sbc.torch.sync.state.SyncState` (SBC at
``topology="reduce_scatter"``) over a fake transport whose ``world()`` is ``(N, r)``; the
functions of :mod:`horovod_sbc.torch.sync.scatter` run per rank and the collectives are done
here, by concatenating every rank's bytes in rank order:

1. every rank encodes its update piece by piece (:func:`~horovod_sbc.torch.sync.encode_uplink`
   over the :class:`~horovod_sbc.torch.sync.scatter.Plan`'s pieces, ``A = R + g`` in the
   residual as :func:`~horovod_sbc.torch.sync.synchronize` does) and re-frames it per region
   (``region_parts``);
2. alltoall: owner o receives part o of every rank, in rank order; ``owner_step`` decodes,
   adds its downlink residual and re-encodes;
3. allgather of the N region messages; ``decode_regions`` gives what every rank applies.

The allgather's *exact* average of the same uplink messages is ``backend.decode`` of all N
uplinks (as the allgather topology decodes), with scale 1/N.

Parts of the report:

* ``error`` (real gradients: a small CNN on scikit-learn's digits, each rank its own shard and
  mini-batches, ``--syncs`` consecutive SGD steps, the model moved by the exact average so
  that both topologies see the same gradients): per sync ``||avg_rs - avg_exact|| /
  ||avg_exact||`` and the cumulative ``||sum_t avg_rs - sum_t avg_exact|| / ||sum_t
  avg_exact||``, with ``uplink_err`` (``avg_exact`` against the dense mean of the gradients)
  for scale. Skew of the positions each region receives (max over regions / mean) for the
  implemented per-piece selection and for per-TENSOR top-k (a shadow allgather run with its own
  residuals on the same gradients) cut by the same regions.
* ``codec`` (a big layout, random normal gradients, zero residuals, one sync): bytes downloaded
  per rank (allgather: N - 1 messages; reduce-scatter: the parts and region messages from the
  other ranks), encode time (allgather: the per-tensor step message; reduce-scatter: the
  per-piece step message plus ``region_parts``) and decode time (allgather: N messages;
  reduce-scatter: the slowest owner's ``owner_step`` plus ``decode_regions``), each the best of
  ``--reps`` with ``time.perf_counter``, measured side by side (ratios only are meaningful on a
  shared machine). Rank 0 is timed for the encodes; every owner is timed for its step.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from horovod_sbc import advise, registry, wire
from horovod_sbc.config import SBCConfig
from horovod_sbc.torch.backend import Accumulate, Targets, frame
from horovod_sbc.torch.sync import Outgoing, encode_uplink, scatter
from horovod_sbc.torch.sync.state import SyncState

Layout = List[Tuple[str, Tuple[int, ...]]]
DEV = torch.device("cpu")
ACC = torch.float32
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ------------------------------------------------------------------------------------------------
# layouts and the simulated world
# ------------------------------------------------------------------------------------------------
def mlp_layout(sizes: Sequence[int] = (1024, 4096, 1536, 10)) -> Layout:
    """benchmarks/bench_net.py's 10.5M-parameter MLP (Linear weights and biases)."""
    out: Layout = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        out += [(f"fc{i}.weight", (b, a)), (f"fc{i}.bias", (b,))]
    return out


def cnn(seed: int = 0) -> torch.nn.Module:
    """The digits model: two 3x3 convolutions, a max-pool and two Linear layers (38k
    parameters, 8 tensors)."""
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))


def cnn_layout() -> Layout:
    return [(n, tuple(p.shape)) for n, p in cnn().named_parameters()]


LAYOUTS: Dict[str, Callable[[], Layout]] = {
    "mlp": mlp_layout, "resnet50": advise.resnet50_layout,
    "gpt2-small-ish": advise.gpt2_small_layout, "digits-cnn": cnn_layout}


class FakeTransport:
    """Simulated rank ``rank`` of ``size``: only ``world()``; the collectives are done by the
    caller (:func:`alltoall`, ``torch.cat`` for the allgather)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank

    def world(self) -> Tuple[int, int]:
        return self.size, self.rank


#: the owners' re-encode of the reduce-scatter (``--downlink-mode``, ``--downlink-density``)
DOWNLINK: Dict[str, object] = {}


def make_states(n: int, density: float, topology: str = "reduce_scatter") -> List[SyncState]:
    cfg = SBCConfig(density=density, topology=topology,
                    **(DOWNLINK if topology == "reduce_scatter" else {}))
    return [SyncState(cfg, FakeTransport(n, r)) for r in range(n)]


def alltoall(parts: Sequence[Tuple[torch.Tensor, List[int]]]) -> List[torch.Tensor]:
    """What every owner receives: part o of every rank's ``region_parts``, in rank order."""
    offs = []
    for _, splits in parts:
        o = [0]
        for s in splits:
            o.append(o[-1] + s)
        offs.append(o)
    return [torch.cat([buf[offs[r][o]:offs[r][o + 1]] for r, (buf, _) in enumerate(parts)])
            for o in range(len(parts))]


def piece_sources(p: scatter.Plan, residuals: Sequence[torch.Tensor],
                  grads: Sequence[torch.Tensor]) -> List[Accumulate]:
    """``A = R + g`` per piece (views of the per-tensor flat residuals and gradients)."""
    return [Accumulate(residuals[c.tensor].view(-1)[c.start:c.stop],
                       grads[c.tensor].reshape(-1)[c.start:c.stop]) for c in p.pieces]


def encode_pieces(state: SyncState, p: scatter.Plan, srcs, rank: int):
    """The reduce-scatter's uplink: every piece encoded (``encode_uplink``, as
    ``synchronize`` does for a plan's pieces)."""
    names = [c.name for c in p.pieces]
    out = Outgoing(names, wire.layout_fingerprint(p.layout), DEV, rank)
    return encode_uplink(state, out, srcs.__getitem__, whole=srcs, keys=list(p.pieces))


def encode_tensors(state: SyncState, layout: Layout, srcs, rank: int):
    """The allgather's uplink: one message per tensor."""
    names = [n for n, _ in layout]
    out = Outgoing(names, wire.layout_fingerprint(layout), DEV, rank)
    return encode_uplink(state, out, srcs.__getitem__, whole=srcs)


def outputs(layout: Layout) -> List[torch.Tensor]:
    return [torch.zeros(wire.layout_numel(s), dtype=ACC) for _, s in layout]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (float64)."""
    a, b = a.double(), b.double()
    nb = float(b.norm())
    return float((a - b).norm()) / nb if nb > 0 else float("nan")


# ------------------------------------------------------------------------------------------------
# part 1 and 2: re-compression error and region skew on real gradients
# ------------------------------------------------------------------------------------------------
def digits() -> Tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    return x, torch.tensor(d.target, dtype=torch.int64)


def rank_gradients(model, x, y, shards, gens, batch: int) -> Tuple[List[List[torch.Tensor]],
                                                                   float]:
    """Every rank's flat per-tensor gradient on its own mini-batch (drawn from its shard),
    and the mean loss."""
    grads, losses = [], []
    for shard, g in zip(shards, gens):
        idx = shard[torch.randint(len(shard), (batch,), generator=g)]
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        grads.append([q.grad.detach().reshape(-1).clone() for q in model.parameters()])
        losses.append(float(loss.detach()))
    return grads, sum(losses) / len(losses)


def piece_counts(step: torch.Tensor, layout) -> List[int]:
    """Positions per tensor message of a step message (its tensor headers)."""
    host, off, out = frame.host_bytes(step), wire.STEP_HEADER_SIZE, []
    for name, shape in layout:
        m = wire.parse_tensor_header(host, off, wire.layout_numel(shape), name)
        out.append(m.count)
        off = m.nbytes
    return out


def region_totals(p: scatter.Plan, per_piece: Sequence[int]) -> List[int]:
    return [sum(per_piece[p.bounds[r]:p.bounds[r + 1]]) for r in range(p.size)]


def skew(totals: Sequence[int]) -> float:
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else float("nan")


def tensor_topk_counts(states, layout: Layout, p: scatter.Plan, grads) -> List[int]:
    """The shadow allgather (per-TENSOR top-k, own residuals, committed): every rank's sent
    positions counted per piece of ``p``, summed over ranks."""
    per_piece = [0] * len(p.pieces)
    for r, (st, g) in enumerate(zip(states, grads)):
        res = [st.residual(n, t) for (n, _), t in zip(layout, g)]
        up = encode_tensors(st, layout, [Accumulate(a, b) for a, b in zip(res, g)], r)
        whole = up.encoded[0][1] if len(up.encoded) == 1 else None
        if hasattr(whole, "positions_of"):  # the C kernels: every tensor in one call
            positions_of = whole.positions_of
        elif len(up.encoded) == len(layout):
            positions_of = lambda i: up.encoded[i][1].positions  # noqa: E731
        else:
            raise RuntimeError("the backend encoded the sync at once: no per-tensor positions")
        for i, c in enumerate(p.pieces):
            pos = positions_of(c.tensor)
            per_piece[i] += int(((pos >= c.start) & (pos < c.stop)).sum())
        for _, enc in up.encoded:
            enc.commit()
    return per_piece


def simulate_sync(states, p: scatter.Plan, layout: Layout, grads) -> Dict[str, object]:
    """One reduce-scatter sync of every rank's ``grads``: what it delivers, the exact average
    of the same uplinks, the positions per piece of the uplinks; both error feedbacks
    committed, in ``synchronize``'s order."""
    n = p.size
    uplinks = []
    for r, st in enumerate(states):
        res = [st.residual(name, g) for (name, _), g in zip(layout, grads[r])]
        uplinks.append(encode_pieces(st, p, piece_sources(p, res, grads[r]), r))
    parts = [scatter.region_parts(u.step, p, r) for r, u in enumerate(uplinks)]
    received = alltoall(parts)
    downs = [scatter.owner_step(states[o], received[o], p, o, 1.0 / n, ACC, DEV)
             for o in range(n)]
    gathered = torch.cat([d.step for d in downs])
    rs, exact = outputs(layout), outputs(layout)
    scatter.decode_regions(states[0], gathered, p, p.targets(Targets.replace(rs)))
    states[0].backend(DEV).decode(torch.cat([u.step for u in uplinks]), p.layout, n,
                                  p.targets(Targets.replace(exact)), 1.0 / n)
    counts = [0] * len(p.pieces)
    for u in uplinks:
        counts = [a + b for a, b in zip(counts, piece_counts(u.step, p.layout))]
    for d in downs:
        d.commit()
    for u in uplinks:
        for _, enc in u.encoded:
            enc.commit()
    return {"rs": torch.cat(rs), "exact": torch.cat(exact), "piece_counts": counts}


def downlink_residual_norm(states, p: scatter.Plan) -> float:
    """||R_down||: every owner's downlink residual of its region, together (float64)."""
    sq = 0.0
    for o, st in enumerate(states):
        for name, _ in p.regions[o]:
            r = st.manager.server_residuals.get(name)
            sq += 0.0 if r is None else float(r.double().pow(2).sum())
    return math.sqrt(sq)


def run_error(n: int, density: float, syncs: int, batch: int, lr: float,
              seed: int, data) -> Dict[str, object]:
    """``syncs`` SGD steps of the digits CNN over ``n`` simulated ranks at ``density``."""
    x, y = data
    model = cnn(seed)
    layout = [(nm, tuple(q.shape)) for nm, q in model.named_parameters()]
    p = scatter.plan(tuple(layout), n)
    shards = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed)).chunk(n)
    gens = [torch.Generator().manual_seed(seed * 1009 + 17 * r + 1) for r in range(n)]
    rs_states, ag_states = make_states(n, density), make_states(n, density, "allgather")
    per, cum, up, sk_a, sk_b, losses, gap = [], [], [], [], [], [], []
    sum_rs = sum_ex = None
    for _ in range(syncs):
        grads, loss = rank_gradients(model, x, y, shards, gens, batch)
        losses.append(loss)
        out = simulate_sync(rs_states, p, layout, grads)
        sk_a.append(skew(region_totals(p, out["piece_counts"])))
        sk_b.append(skew(region_totals(p, tensor_topk_counts(ag_states, layout, p, grads))))
        rs, ex = out["rs"], out["exact"]
        dense = torch.stack([torch.cat(g) for g in grads]).mean(0)
        sum_rs = rs.double() if sum_rs is None else sum_rs + rs
        sum_ex = ex.double() if sum_ex is None else sum_ex + ex
        per.append(rel(rs, ex))
        cum.append(rel(sum_rs, sum_ex))
        # downlink error feedback: sum_t avg_rs = sum_t avg_exact - R_down, so the cumulative
        # error is ||R_down|| / ||sum_t avg_exact|| (up to rounding)
        gap.append(abs(cum[-1] - downlink_residual_norm(rs_states, p) / float(sum_ex.norm())))
        up.append(rel(ex, dense))
        with torch.no_grad():  # the model moves by the exact average: same gradients for both
            off = 0
            for q in model.parameters():
                q -= lr * ex[off:off + q.numel()].view_as(q)
                off += q.numel()
    return {"ranks": n, "density": density, "syncs": syncs, "pieces": len(p.pieces),
            "elements": sum(wire.layout_numel(s) for _, s in layout),
            "err_sync_mean": sum(per) / len(per), "err_sync_last": per[-1],
            "err_cum_final": cum[-1], "uplink_err_mean": sum(up) / len(up),
            "downlink_identity_gap_max": max(gap),
            "skew_piece_mean": sum(sk_a) / len(sk_a), "skew_piece_max": max(sk_a),
            "skew_tensor_mean": sum(sk_b) / len(sk_b), "skew_tensor_max": max(sk_b),
            "loss_first": losses[0], "loss_last": losses[-1],
            "err_sync": per, "err_cum": cum, "uplink_err": up,
            "skew_piece": sk_a, "skew_tensor": sk_b, "loss": losses}


# ------------------------------------------------------------------------------------------------
# part 3: bytes and codec time on a big layout
# ------------------------------------------------------------------------------------------------
def best_of(fn: Callable[[], object], reps: int, setup: Optional[Callable[[], None]] = None
            ) -> float:
    """The best of ``reps`` wall times of ``fn`` (``setup`` untimed before each)."""
    best = math.inf
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class BigRanks:
    """Random normal gradients of a big layout for rank r (one reused flat buffer, seeded by
    r), with a zero residual: the first sync of every rank."""

    def __init__(self, layout: Layout, seed: int):
        self.layout, self.seed = layout, seed
        self.numels = [wire.layout_numel(s) for _, s in layout]
        total = sum(self.numels)
        self.grad = torch.empty(total)
        self.res = torch.zeros(total)
        self.grads = list(self.grad.split(self.numels))
        self.residuals = list(self.res.split(self.numels))

    def draw(self, rank: int) -> None:
        torch.randn(self.grad.numel(), out=self.grad,
                    generator=torch.Generator().manual_seed(self.seed * 7919 + rank))

    def zero(self) -> None:
        self.res.zero_()

    def tensor_sources(self) -> List[Accumulate]:
        return [Accumulate(r, g) for r, g in zip(self.residuals, self.grads)]


def time_encodes(big: BigRanks, plans: Dict[int, scatter.Plan], st: SyncState,
                 ag_st: SyncState, reps: int) -> Dict[str, object]:
    """Rank 0's encodes, the reps interleaved (best of ``reps`` each, residual zeroed before
    each, untimed): the allgather's per-tensor step; the reduce-scatter's per-piece step plus
    ``region_parts``, and ``region_parts`` alone."""
    best = {"ag": math.inf, **{("rs", n): math.inf for n in plans},
            **{("parts", n): math.inf for n in plans}}
    steps = {}
    for n, p in plans.items():
        big.zero()
        steps[n] = encode_pieces(st, p, piece_sources(p, big.residuals, big.grads), 0).step
    for _ in range(reps):
        best["ag"] = min(best["ag"], best_of(
            lambda: encode_tensors(ag_st, big.layout, big.tensor_sources(), 0), 1, big.zero))
        for n, p in plans.items():
            best["rs", n] = min(best["rs", n], best_of(lambda: scatter.region_parts(
                encode_pieces(st, p, piece_sources(p, big.residuals, big.grads), 0).step,
                p, 0), 1, big.zero))
            best["parts", n] = min(best["parts", n], best_of(
                lambda: scatter.region_parts(steps[n], p, 0), 1))
    return {"ag_encode_s": best["ag"], "rs_encode_s": {n: best["rs", n] for n in plans},
            "region_parts_s": {n: best["parts", n] for n in plans}}


def encode_all_ranks(big: BigRanks, plans: Dict[int, scatter.Plan], density: float,
                     reps: int) -> Dict[str, object]:
    """Every rank's allgather message and, for every N it belongs to, its per-piece message
    re-framed per region; rank 0's encodes timed side by side (best of ``reps``)."""
    nmax = max(plans)
    st = make_states(nmax, density)[0]  # one encoder: only the bytes are kept
    ag_st = make_states(nmax, density, "allgather")[0]
    ag_steps, parts = [], {n: [] for n in plans}
    for r in range(nmax):
        big.draw(r)
        big.zero()
        ag_steps.append(encode_tensors(ag_st, big.layout, big.tensor_sources(), r).step.clone())
        for n, p in plans.items():
            if r < n:
                big.zero()
                up = encode_pieces(st, p, piece_sources(p, big.residuals, big.grads), r)
                buf, splits = scatter.region_parts(up.step, p, r)
                parts[n].append((buf.clone(), splits))
        if r == 0:
            times = time_encodes(big, plans, st, ag_st, reps)
    return {"ag_steps": ag_steps, "parts": parts, "times": times}


def codec_row(n: int, p: scatter.Plan, layout: Layout, ag_steps, parts, enc_times,
              density: float, reps: int) -> Dict[str, object]:
    """One N: bytes per rank, decode-side times (every owner timed), and the reduce-scatter's
    one-sync error against the exact average."""
    received = alltoall(parts)
    states = make_states(n, density)
    owner_s, downs = [], []
    for o in range(n):
        owner_s.append(best_of(lambda: scatter.owner_step(
            states[o], received[o], p, o, 1.0 / n, ACC, DEV), reps))
        downs.append(scatter.owner_step(states[o], received[o], p, o, 1.0 / n, ACC, DEV))
    gathered = torch.cat([d.step for d in downs])
    rs, ex = outputs(layout), outputs(layout)
    rs_t = p.targets(Targets.replace(rs))
    ag_gathered = torch.cat(ag_steps[:n])
    backend = states[0].backend(DEV)
    regions_s = best_of(lambda: scatter.decode_regions(states[0], gathered, p, rs_t), reps)
    ag_s = best_of(lambda: backend.decode(ag_gathered, layout, n, Targets.replace(ex), 1.0 / n),
                   reps)
    ag_len = [s.numel() for s in ag_steps[:n]]
    region_len = [d.step.numel() for d in downs]
    rs_down = [received[o].numel() - parts[o][1][o] + gathered.numel() - region_len[o]
               for o in range(n)]
    rs_up = [sum(parts[o][1]) - parts[o][1][o] + region_len[o] for o in range(n)]
    row = {"ranks": n, "pieces": len(p.pieces),
           "ag_down_bytes": sum(ag_len) * (n - 1) / n, "rs_down_bytes": sum(rs_down) / n,
           "ag_up_bytes": sum(ag_len) / n, "rs_up_bytes": sum(rs_up) / n,
           "rs_region_bytes_max": max(region_len), "rs_region_bytes_min": min(region_len),
           "ag_encode_s": enc_times["ag_encode_s"], "rs_encode_s": enc_times["rs_encode_s"][n],
           "rs_region_parts_s": enc_times["region_parts_s"][n],
           "ag_decode_s": ag_s, "rs_owner_max_s": max(owner_s),
           "rs_owner_mean_s": sum(owner_s) / n, "rs_decode_regions_s": regions_s,
           "rs_owner_max_pieces": len(p.regions[owner_s.index(max(owner_s))]),
           "rs_owner_s": owner_s, "rs_region_pieces": [len(lay) for lay in p.regions],
           "rs_rel_err": rel(torch.cat(rs), torch.cat(ex))}
    row["rs_decode_s"] = row["rs_owner_max_s"] + regions_s
    row["down_ratio"] = row["rs_down_bytes"] / row["ag_down_bytes"]
    row["encode_ratio"] = row["rs_encode_s"] / row["ag_encode_s"]
    row["decode_ratio"] = row["rs_decode_s"] / row["ag_decode_s"]
    return row


def run_codec(layout_name: str, ranks: Sequence[int], density: float, reps: int,
              seed: int, progress=print) -> List[Dict[str, object]]:
    layout = LAYOUTS[layout_name]()
    plans = {n: scatter.plan(tuple((nm, tuple(s)) for nm, s in layout), n) for n in ranks}
    big = BigRanks(layout, seed)
    progress(f"[scatter] codec: encoding {max(ranks)} ranks of {layout_name} "
             f"({sum(big.numels):,} elements) ...")
    enc = encode_all_ranks(big, plans, density, reps)
    del big
    rows = []
    for n in ranks:
        rows.append(codec_row(n, plans[n], layout, enc["ag_steps"], enc["parts"][n],
                              enc["times"], density, reps))
        progress(f"[scatter] codec N={n}: decode ratio {rows[-1]['decode_ratio']:.3f}")
    return rows


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def tables(res: Dict[str, object]) -> List[Tuple[str, str]]:
    """(title, markdown table) per part of the report."""
    out = []
    if res.get("error"):
        head = ["density", "N", "pieces", "err/sync mean", "err/sync last", "cum err final",
                "uplink err mean", "skew per-piece mean (max)", "skew per-tensor mean (max)",
                "max abs(cum err - norm(R_down) / norm(sum avg_exact))"]
        rows = [[f"{r['density']:g}", str(r["ranks"]), str(r["pieces"]),
                 f"{r['err_sync_mean']:.3f}", f"{r['err_sync_last']:.3f}",
                 f"{r['err_cum_final']:.3f}", f"{r['uplink_err_mean']:.3f}",
                 f"{r['skew_piece_mean']:.3f} ({r['skew_piece_max']:.3f})",
                 f"{r['skew_tensor_mean']:.3f} ({r['skew_tensor_max']:.3f})",
                 f"{r['downlink_identity_gap_max']:.1e}"]
                for r in res["error"]]
        cfg = res["config"]
        owners = "".join(f", {k} {cfg[k]}" for k in ("downlink_mode", "downlink_density")
                         if cfg.get(k) is not None)
        out.append((f"re-compression error and region skew: digits CNN "
                    f"({res['error'][0]['elements']:,} parameters), {cfg['syncs']} syncs, "
                    f"batch {cfg['batch']} per rank{owners}", _table(head, rows)))
    if res.get("codec"):
        head = ["N", "pieces", "down KB AG", "down KB RS", "RS/AG down", "RS/AG encode",
                "AG encode ms", "RS region_parts ms", "RS/AG decode", "AG decode ms", "RS owner max (mean) ms",
                "slowest owner's pieces (max, mean)", "RS regions ms",
                "RS one-sync err"]
        rows = [[str(r["ranks"]), str(r["pieces"]), f"{r['ag_down_bytes'] / 1e3:,.1f}",
                 f"{r['rs_down_bytes'] / 1e3:,.1f}", f"{r['down_ratio']:.3f}",
                 f"{r['encode_ratio']:.3f}", f"{1e3 * r['ag_encode_s']:.1f}",
                 f"{1e3 * r['rs_region_parts_s']:.1f}", f"{r['decode_ratio']:.3f}",
                 f"{1e3 * r['ag_decode_s']:.1f}",
                 f"{1e3 * r['rs_owner_max_s']:.1f} ({1e3 * r['rs_owner_mean_s']:.1f})",
                 f"{r['rs_owner_max_pieces']} ({max(r['rs_region_pieces'])}, "
                 f"{r['pieces'] / r['ranks']:.1f})",
                 f"{1e3 * r['rs_decode_regions_s']:.1f}", f"{r['rs_rel_err']:.3f}"]
                for r in res["codec"]]
        cfg = res["config"]
        out.append((f"bytes and codec time per rank and sync: {cfg['layout']} "
                    f"({res['codec_elements']:,} elements), density {cfg['density']:g}, best "
                    f"of {cfg['reps']} (ratios side by side; ms are this shared machine's)",
                    _table(head, rows)))
    return out


def write(res: Dict[str, object], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    md = os.path.splitext(path)[0] + ".md"
    with open(md, "w") as f:
        f.write(f"<!-- generated by: {res['command']} -->\n")
        for title, body in tables(res):
            f.write(f"\n### {title}\n\n{body}\n")
    print(f"wrote {path} and {md}")
    if res.get("error"):
        png = os.path.splitext(path)[0] + "_error.png"
        plot_error(res["error"], png)
        print(f"wrote {png}")


def plot_error(rows: Sequence[Dict[str, object]], path: str) -> None:
    """Per-sync and cumulative re-compression error over the syncs, one line per (p, N)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for r in rows:
        t = range(1, len(r["err_sync"]) + 1)
        label = f"p={r['density']:g}, N={r['ranks']}"
        axes[0].plot(t, r["err_sync"], label=label)
        axes[1].plot(t, r["err_cum"], label=label)
    axes[0].set_title("per sync: ||avg_rs - avg_exact|| / ||avg_exact||")
    axes[1].set_title("cumulative: ||sum avg_rs - sum avg_exact|| / ||sum avg_exact||")
    for ax in axes:
        ax.set_xlabel("sync")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench scatter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=_ints, default=None,
                    help="N for the codec part (default 4,8,16,32,64; --quick 4,8)")
    ap.add_argument("--error-ranks", type=_ints, default=None,
                    help="N for the error part (default 4,8,16; --quick 4)")
    ap.add_argument("--densities", type=_floats, default=None,
                    help="densities of the error part (default 0.01,0.05; --quick 0.05)")
    ap.add_argument("--density", type=float, default=0.01, help="density of the codec part")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default=None,
                    help="codec part's layout (default resnet50; --quick digits-cnn)")
    ap.add_argument("--syncs", type=int, default=None, help="SGD steps (default 20; --quick 3)")
    ap.add_argument("--batch", type=int, default=32, help="mini-batch per rank")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--reps", type=int, default=None, help="timing reps (default 3; --quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=("error", "codec"), default=None)
    ap.add_argument("--downlink-mode", default=None,
                    help="the owners' compressor, a registered mode (default: SBC's)")
    ap.add_argument("--downlink-density", type=float, default=None,
                    help="the owners' density (default: the uplink's)")
    ap.add_argument("--register", action="append", default=[], metavar="FILE",
                    help="a Python file that registers a compressor (tests/user_compressor.py)")
    ap.add_argument("--json", default=None, help="write JSON here and markdown beside it")
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    return ap


def _defaults(a) -> None:
    q = a.quick
    a.ranks = a.ranks or ([4, 8] if q else [4, 8, 16, 32, 64])
    a.error_ranks = a.error_ranks or ([4] if q else [4, 8, 16])
    a.densities = a.densities or ([0.05] if q else [0.01, 0.05])
    a.layout = a.layout or ("digits-cnn" if q else "resnet50")
    a.syncs = a.syncs or (3 if q else 20)
    a.reps = a.reps or (1 if q else 3)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    _defaults(a)
    for path in a.register:
        registry.load_file(path)
    DOWNLINK.clear()
    DOWNLINK.update({k: v for k, v in (("downlink_mode", a.downlink_mode),
                                       ("downlink_density", a.downlink_density)) if v is not None})
    t0 = time.monotonic()
    res: Dict[str, object] = {
        "command": " ".join(["python -m benchmarks.bench scatter"] + argv),
        "config": {k: v for k, v in vars(a).items() if k not in ("json",)},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                    "backend": repr(SyncState(SBCConfig(), None).backend(DEV))}}
    if a.only != "codec":
        data = digits()
        res["error"] = []
        for d in a.densities:
            for n in a.error_ranks:
                print(f"[scatter] error: density {d:g}, N={n}, {a.syncs} syncs ...", flush=True)
                res["error"].append(run_error(n, d, a.syncs, a.batch, a.lr, a.seed, data))
    if a.only != "error":
        res["codec_elements"] = sum(wire.layout_numel(s) for _, s in LAYOUTS[a.layout]())
        res["codec"] = run_codec(a.layout, a.ranks, a.density, a.reps, a.seed,
                                 lambda s: print(s, flush=True))
    res["wall_s"] = time.monotonic() - t0
    for title, body in tables(res):
        print(f"\n{title}\n{body}")
    if a.json:
        write(res, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
