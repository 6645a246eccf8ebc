"""Codec speed at every density, for a flat tensor and a real many-tensor model, with peers.

``python -m benchmarks.bench codec`` calls :func:`run`. Every speed figure is a ratio to
``torch.add(a, b, out=c)`` over the same number of elements, timed in the same process on one
thread (``torch.set_num_threads(1)``), each time the minimum over repetitions (the machine is
shared; the minimum is the least disturbed run).

Workloads:

flat25m   one flat fp32 tensor of 25M elements
resnet18  the 62 parameter tensors of a ResNet-18 (11.7M elements), encoded and decoded as one
          sync: every tensor's message in one step message, 8 ranks' step messages decoded and
          scatter-added in one ``decode_gathered`` call

Per density p in {1e-4, 1e-3, 1e-2, 5e-2} and workload:

compress_over_add   a whole compress step of one rank: ``R += g``, select, binarize, encode,
                    frame the step message, ``R -= sent`` (as the package does it: with the
                    C kernels every tensor in one call, ``KernelBackend.encode_many``)
compress_per_tensor_over_add  the same step tensor by tensor (``encode_tensor``), beside it
decode_over_add     decode 8 ranks' step messages and add their average into dense tensors
topk_over_add       ``torch.topk(|a|, k)`` per tensor (what a plain top-k would pay to select)
bits_per_position_over_entropy  position-stream bits / (numel * H(k / numel)), summed over the
                    tensors of one message (headers excluded)

Peers on the same tensors (``peers``): top-k with values (``torch.topk`` selection, int32
positions + fp32 values, decode = scatter-add), DGC's sampled-threshold selection (Lin et al.
2018: threshold from the top of a 1 % random sample, then ``|a| >= t``; positions + values), and
PowerSGD rank 1/2/4 (Vogels et al. 2019, the math of PyTorch's ``powerSGD_hook``: matrices
``P = M Q``, orthogonalise P, ``Q = M^T P``, error feedback ``M - P Q^T``, buffers reused;
vectors (biases) are sent uncompressed as the hook does). Each peer reports encode and decode
time over add, bits per step (one rank's upload) and the one-step relative error
``||g - decoded|| / ||g||`` of a Gaussian gradient (no error feedback history).
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import numpy as np

from horovod_sbc.advise import min_time  # noqa: F401 (the benchmarks' timer)

DENSITIES = (1e-4, 1e-3, 1e-2, 5e-2)
WORKLOADS = ("flat25m", "resnet18")
N_RANKS = 8


def resnet18_shapes() -> List[Tuple[str, Tuple[int, ...]]]:
    """The parameter shapes of torchvision's ResNet-18 (62 tensors, 11,689,512 elements)."""
    shapes = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    cin = 64
    for li, cout in enumerate((64, 128, 256, 512), start=1):
        for bi in range(2):
            pre = f"layer{li}.{bi}."
            c_in = cin if bi == 0 else cout
            shapes += [(pre + "conv1.weight", (cout, c_in, 3, 3)), (pre + "bn1.weight", (cout,)),
                       (pre + "bn1.bias", (cout,)), (pre + "conv2.weight", (cout, cout, 3, 3)),
                       (pre + "bn2.weight", (cout,)), (pre + "bn2.bias", (cout,))]
            if bi == 0 and li > 1:
                shapes += [(pre + "downsample.0.weight", (cout, cin, 1, 1)),
                           (pre + "downsample.1.weight", (cout,)),
                           (pre + "downsample.1.bias", (cout,))]
        cin = cout
    shapes += [("fc.weight", (1000, 512)), ("fc.bias", (1000,))]
    return shapes


def workload_layout(workload: str, n_flat: int = 25_000_000):
    if workload == "flat25m":
        return [("w", (n_flat,))]
    if workload == "resnet18":
        return resnet18_shapes()
    raise ValueError(f"unknown workload {workload!r}; one of {WORKLOADS}")


def _numel(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def entropy_bits(p: float) -> float:
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _gradients(layout, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(_numel(s), generator=g) for _, s in layout]


def compress_(a, density: float, mode="sbc", name: str = "tensor", selection: str = "paper"):
    """Encode the flat update ``a`` and commit at once (one rank's message of a gradient):
    (message, positions sent)."""
    from horovod_sbc.torch.backend import backend_for
    enc = backend_for(a.device).encode_tensor(a, density, mode, name, selection)
    enc.commit()
    return enc.message, enc.positions.numel()


def add_time(n: int, reps: int) -> float:
    import torch
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    return min_time(lambda: torch.add(a, b, out=c), reps)


def bench_sbc(layout, density: float, reps: int, t_add: float,
              selection: str = "paper") -> Dict[str, float]:
    """Our codec on one workload at one density (see the module docstring)."""
    import torch
    from horovod_sbc import wire
    from horovod_sbc.torch.backend import (Accumulate, PositionBuffer, Targets, backend_for,
                                           frame)
    backend = backend_for("cpu")
    fp = wire.layout_fingerprint(layout)
    grads = _gradients(layout, 0)
    residuals = [torch.zeros_like(g) for g in grads]
    names = [n for n, _ in layout]
    buffers = [PositionBuffer() for _ in layout]  # per tensor, as the hook and sync keep

    def compress_step():
        # the package's path (the drop-in's and the stock hook's): every tensor in one kernel
        # call where the backend can, else tensor by tensor
        sync = backend.encode_many([Accumulate(r, g) for g, r in zip(grads, residuals)],
                                   density, "sbc", selection, names)
        if sync is not None:
            step = sync.frame(fp)
            sync.commit()
            return step
        return per_tensor_step()

    def per_tensor_step():
        msgs, commits = [], []
        for name, g, r, buf in zip(names, grads, residuals, buffers):  # r += g, then encode
            enc = backend.encode_tensor(Accumulate(r, g), density, "sbc", name, selection,
                                        positions=buf)
            msgs.append(enc.message)
            commits.append(enc)
        step = frame.frame(msgs, fp, grads[0].device)
        for enc in commits:
            enc.commit()
        return step

    t_comp = min_time(compress_step, reps)
    t_per_tensor = min_time(per_tensor_step, reps)  # the same, one call per tensor (beside it)
    steps, pos_bits, entropy = [], 0, 0.0
    for rank in range(N_RANKS):
        msgs = []
        for (name, _), g in zip(layout, _gradients(layout, 100 + rank)):
            m, _ = compress_(g, density, "sbc", name, selection=selection)
            msgs.append(m)
            if rank == 0:
                hdr = wire.parse_tensor_header(bytes(m.numpy()), 0, g.numel())
                pos_bits += 8 * ((hdr.unary[1] - hdr.unary[0]) + (hdr.remainder[1] - hdr.remainder[0]))
                if 0 < hdr.count < g.numel():
                    entropy += g.numel() * entropy_bits(hdr.count / g.numel())
        steps.append(frame.frame(msgs, fp, grads[0].device))
    gathered = torch.cat(steps)
    outs = [torch.zeros(_numel(s)) for _, s in layout]

    def decode():  # into the gradient buffers, as the stock hook does (zero_out)
        backend.decode(gathered, layout, N_RANKS, Targets.replace(outs), 1.0 / N_RANKS)

    t_dec = min_time(decode, reps)
    k_list = [min(_numel(s), max(1, round(density * _numel(s)))) for _, s in layout]
    absg = [g.abs() for g in grads]
    t_topk = min_time(lambda: [torch.topk(x, k, sorted=False) for x, k in zip(absg, k_list)],
                      max(2, reps // 2))
    return {"compress_s": t_comp, "decode_s": t_dec, "topk_s": t_topk,
            "compress_over_add": t_comp / t_add, "decode_over_add": t_dec / t_add,
            "compress_per_tensor_over_add": t_per_tensor / t_add,
            "topk_over_add": t_topk / t_add,
            "bits_per_position_over_entropy": pos_bits / entropy if entropy else float("nan"),
            "step_message_bytes": int(steps[0].numel()),
            "bits_per_step": 8 * int(steps[0].numel())}


# ----------------------------------------------------------------------------------------------
# peers
# ----------------------------------------------------------------------------------------------
def _rel_error(grads, decoded) -> float:
    num = sum(float((g - d).pow(2).sum()) for g, d in zip(grads, decoded))
    den = sum(float(g.pow(2).sum()) for g in grads)
    return math.sqrt(num / den)


def _sparse_peer(grads, select, reps, t_add) -> Dict[str, float]:
    """A values-carrying sparsifier: ``select(|g|) -> indices``; int32 positions + fp32 values."""
    import torch
    absg = [g.abs() for g in grads]
    t_enc = min_time(lambda: [(i, g.index_select(0, i)) for g, a in zip(grads, absg)
                              for i in (select(a),)], reps)
    msgs = [(i, g.index_select(0, i)) for g, a in zip(grads, absg) for i in (select(a),)]
    outs = [torch.zeros_like(g) for g in grads]

    def decode():
        for o in outs:
            o.zero_()
        for _ in range(N_RANKS):
            for o, (i, v) in zip(outs, msgs):
                o.index_add_(0, i, v, alpha=1.0 / N_RANKS)

    t_dec = min_time(decode, reps)
    decoded = [torch.zeros_like(g).index_put_((i,), v) for g, (i, v) in zip(grads, msgs)]
    bits = sum(64 * i.numel() for i, _ in msgs)
    return {"encode_over_add": t_enc / t_add, "decode_over_add": t_dec / t_add,
            "bits_per_step": bits, "relative_error": _rel_error(grads, decoded)}


def dgc_select(density: float, sample_frac: float = 0.01):
    """DGC (Lin et al. 2018): threshold = the k_s-th largest of a random 1 % sample of |g|,
    then every |g| >= threshold (about k entries, not exactly k)."""
    import torch
    gen = torch.Generator().manual_seed(0)

    def select(a):
        n = a.numel()
        k = max(1, round(density * n))
        if n < 1000:
            return torch.topk(a, k, sorted=False).indices
        m = max(1, int(n * sample_frac))
        s = a.index_select(0, torch.randint(0, n, (m,), generator=gen))
        ks = max(1, round(density * m))
        thr = torch.topk(s, ks, sorted=False).values.min()
        return torch.nonzero(a >= thr).squeeze(1)
    return select


def topk_select(density: float):
    import torch
    return lambda a: torch.topk(a, max(1, round(density * a.numel())), sorted=False).indices


class PowerSGD:
    """The math of PyTorch's ``powerSGD_hook`` (rank r, error feedback, warm-started Q, buffers
    reused) for one rank: tensors with ndim > 1 are viewed as (shape[0], -1) matrices M
    (with the error added), ``P = M Q``, P orthogonalised (QR), ``Q = M^T P``; the
    decompressed update is ``P Q^T`` and the error ``M - P Q^T``; vectors are sent dense."""

    def __init__(self, layout, rank: int):
        import torch
        self.rank = rank
        self.mats = []
        for _, shape in layout:
            if len(shape) > 1:
                n, m = shape[0], _numel(shape) // shape[0]
                r = min(rank, n, m)
                g = torch.Generator().manual_seed(0)
                self.mats.append((n, m, torch.randn(m, r, generator=g), torch.zeros(n, m),
                                  torch.empty(n, r)))
            else:
                self.mats.append(None)

    def encode(self, grads):
        import torch
        sent = []
        for g, st in zip(grads, self.mats):
            if st is None:
                sent.append(("dense", g))
                continue
            n, m, q, err, p = st
            mat = err.add_(g.view(n, m))  # M = g + error
            torch.matmul(mat, q, out=p)
            p.copy_(torch.linalg.qr(p).Q)
            torch.matmul(mat.t(), p, out=q)
            sent.append(("lowrank", p, q))
        return sent

    def commit(self, sent):
        """error = M - P Q^T (after encode; the hook does it after the allreduce)."""
        for s, st in zip(sent, self.mats):
            if st is not None:
                st[3].sub_(s[1] @ s[2].t())

    @staticmethod
    def decode(sent_per_rank, outs):
        for sent in sent_per_rank:
            for o, s in zip(outs, sent):
                if s[0] == "dense":
                    o.add_(s[1], alpha=1.0 / N_RANKS)
                else:
                    o.view(s[1].shape[0], -1).addmm_(s[1], s[2].t(), alpha=1.0 / N_RANKS)

    def bits(self, sent) -> int:
        return sum(32 * (s[1].numel() if s[0] == "dense" else s[1].numel() + s[2].numel())
                   for s in sent)


def bench_powersgd(layout, grads, rank: int, reps: int, t_add: float) -> Dict[str, float]:
    import torch
    ps = PowerSGD(layout, rank)

    def enc():
        s = ps.encode(grads)
        ps.commit(s)
        return s
    t_enc = min_time(enc, reps)
    fresh = PowerSGD(layout, rank)
    sent = fresh.encode(grads)
    outs = [torch.zeros_like(g) for g in grads]

    def dec():
        for o in outs:
            o.zero_()
        PowerSGD.decode([sent] * N_RANKS, outs)
    t_dec = min_time(dec, reps)
    decoded = [torch.zeros_like(g) for g in grads]
    for o, s in zip(decoded, sent):
        if s[0] == "dense":
            o.copy_(s[1])
        else:
            o.view(s[1].shape[0], -1).copy_(s[1] @ s[2].t())
    return {"encode_over_add": t_enc / t_add, "decode_over_add": t_dec / t_add,
            "bits_per_step": fresh.bits(sent), "relative_error": _rel_error(grads, decoded)}


def bench_peers(layout, density: float, reps: int, t_add: float) -> Dict[str, Dict]:
    grads = _gradients(layout, 0)
    out = {"topk": _sparse_peer(grads, topk_select(density), max(2, reps // 2), t_add),
           "dgc": _sparse_peer(grads, dgc_select(density), reps, t_add)}
    return out


def sbc_relative_error(layout, density: float) -> float:
    import torch
    from horovod_sbc.torch.backend import backend_for
    grads = _gradients(layout, 0)
    decoded = []
    for (name, _), g in zip(layout, grads):
        enc = backend_for(g.device).encode_tensor(g.clone(), density, "sbc", name)
        pos, sent = enc.positions, enc.sent
        decoded.append(torch.zeros_like(g).index_put_((pos,), sent))
    return _rel_error(grads, decoded)


def run(densities: Sequence[float] = DENSITIES, workloads: Sequence[str] = WORKLOADS,
        reps: int = 5, n_flat: int = 25_000_000, powersgd_ranks=(1, 2, 4)) -> Dict[str, object]:
    """Every density x workload: our codec and the peers (see the module docstring)."""
    rows, peers = [], []
    for wl in workloads:
        layout = workload_layout(wl, n_flat)
        n = sum(_numel(s) for _, s in layout)
        t_add = add_time(n, reps)
        for p in densities:
            r = bench_sbc(layout, p, reps, t_add)
            r.update(p=p, workload=wl, add_s=t_add, relative_error=sbc_relative_error(layout, p))
            rows.append(r)
            for name, f in bench_peers(layout, p, reps, t_add).items():
                f.update(method=name, p=p, workload=wl)
                peers.append(f)
        if wl == "resnet18":
            grads = _gradients(layout, 0)
            for rank in powersgd_ranks:
                f = bench_powersgd(layout, grads, rank, reps, t_add)
                f.update(method=f"powersgd_r{rank}", p=None, workload=wl)
                peers.append(f)
    return {"densities": rows, "peers": peers}


def print_table(res: Dict[str, object]) -> None:
    print(f"\n{'workload':<9}{'p':>8}{'compress':>10}{'per tensor':>11}{'decode x8':>11}"
          f"{'topk':>7}{'bits/H':>8}{'rel.err':>9}{'bits/step':>12}"
          "   (time / torch.add, 1 thread)")
    for r in res["densities"]:
        print(f"{r['workload']:<9}{r['p']:>8g}{r['compress_over_add']:>9.2f}x"
              f"{r.get('compress_per_tensor_over_add', float('nan')):>10.2f}x"
              f"{r['decode_over_add']:>10.2f}x{r['topk_over_add']:>6.1f}x"
              f"{r['bits_per_position_over_entropy']:>8.3f}{r['relative_error']:>9.3f}"
              f"{r['bits_per_step']:>12,}")
    print(f"\n{'peer':<12}{'workload':<9}{'p':>8}{'encode':>9}{'decode x8':>11}{'rel.err':>9}"
          f"{'bits/step':>14}")
    for f in res["peers"]:
        p = "-" if f["p"] is None else f"{f['p']:g}"
        print(f"{f['method']:<12}{f['workload']:<9}{p:>8}{f['encode_over_add']:>8.2f}x"
              f"{f['decode_over_add']:>10.2f}x{f['relative_error']:>9.3f}{f['bits_per_step']:>14,}")


# ----------------------------------------------------------------------------------------------
# the worst cells (issue 48, item 4): ResNet-18 at p = 5e-2 (and 1e-2), stage by stage, against
# DGC's sampled threshold and exact torch.topk, with each pass's bytes over add's bandwidth
# ----------------------------------------------------------------------------------------------
WORST_DENSITIES = (5e-2, 1e-2)


class _Timed:
    """A kernel library whose ``sbc_*`` calls add their wall time to ``acc[name]`` and their
    thread CPU time to ``acc[name + "@cpu"]`` (seconds)."""

    def __init__(self, handle, acc: Dict[str, float]):
        self._h, self._acc = handle, acc

    def __getattr__(self, name):
        f = getattr(self._h, name)
        if not name.startswith("sbc_"):
            return f
        import time
        acc, cpu = self._acc, name + "@cpu"

        def timed(*args):
            u0, t0 = time.thread_time(), time.perf_counter()
            r = f(*args)
            t1, u1 = time.perf_counter(), time.thread_time()
            acc[name] = acc.get(name, 0.0) + t1 - t0
            acc[cpu] = acc.get(cpu, 0.0) + u1 - u0
            return r
        return timed


def _load_kernels(path: str = None):
    """The current build (``path`` None) or a library file (an older build to compare)."""
    import ctypes
    from horovod_sbc import kernels
    h = ctypes.CDLL(str(kernels.build()) if path is None else path)
    kernels._bind(h)
    return h


def _use_kernels(handle) -> None:
    """Make ``handle`` the library :func:`horovod_sbc.kernels.lib` returns."""
    from horovod_sbc import kernels
    kernels._tried, kernels._lib = True, handle


class _SbcCell:
    """``bench_sbc``'s compress step and decode for one layout and density, with their state
    (residuals, position buffers, the 8 ranks' gathered step, outputs) built once."""

    def __init__(self, layout, density: float):
        import torch
        from horovod_sbc import wire
        from horovod_sbc.torch.backend import (Accumulate, PositionBuffer, Targets, backend_for,
                                               frame)
        backend = backend_for("cpu")
        fp = wire.layout_fingerprint(layout)
        grads = _gradients(layout, 0)
        residuals = [torch.zeros_like(g) for g in grads]
        names = [n for n, _ in layout]
        buffers = [PositionBuffer() for _ in layout]
        self.sent = [None] * len(layout)

        def compress_step():
            msgs, commits = [], []
            for name, g, r, buf in zip(names, grads, residuals, buffers):
                enc = backend.encode_tensor(Accumulate(r, g), density, "sbc", name, "paper",
                                            positions=buf)
                msgs.append(enc.message)
                commits.append(enc)
            step = frame.frame(msgs, fp, grads[0].device)
            for i, enc in enumerate(commits):
                enc.commit()
                self.sent[i] = enc.positions
            return step

        steps = []
        for rank in range(N_RANKS):
            msgs = [compress_(g, density, "sbc", name)[0]
                    for (name, _), g in zip(layout, _gradients(layout, 100 + rank))]
            steps.append(frame.frame(msgs, fp, grads[0].device))
        self.gathered = torch.cat(steps)
        self.step_bytes = int(steps[0].numel())
        outs = [torch.zeros(_numel(s)) for _, s in layout]
        self.outs = outs

        def decode():
            backend.decode(self.gathered, layout, N_RANKS, Targets.replace(outs), 1.0 / N_RANKS)

        self.compress_step, self.decode = compress_step, decode


def _min_wall_cpu(fn, reps: int, warmup: int = 1) -> Tuple[float, float]:
    """The fastest of ``reps`` runs in wall time and, separately, in this thread's CPU time
    (``time.thread_time``: what the thread ran, not counting the time another process held
    its core, the larger noise on a shared machine)."""
    import time
    for _ in range(warmup):
        fn()
    w = u = math.inf
    for _ in range(reps):
        u0, w0 = time.thread_time(), time.perf_counter()
        fn()
        w1, u1 = time.perf_counter(), time.thread_time()
        w, u = min(w, w1 - w0), min(u, u1 - u0)
    return w, u


def _lines_touched(pos, numel: int) -> int:
    """Distinct 64-byte lines of a float32 tensor holding one of the (ascending) positions."""
    import torch
    if not pos.numel():
        return 0
    return int(torch.unique_consecutive(pos // 16).numel())


def worst_cells(densities: Sequence[float] = WORST_DENSITIES, rounds: int = 5, reps: int = 5,
                baseline: str = None) -> Dict[str, object]:
    """ResNet-18 at each density: our compress and decode (and, with ``baseline``, an older
    kernel library's, alternated with the current build in every round), the C kernels' share of
    each (per kernel), DGC's sampled-threshold selection and exact ``torch.topk`` of the same k
    on the same tensors (selection alone, and the whole values-carrying peer), and the bytes
    each pass must move over the bandwidth of ``torch.add`` (3 x 4 bytes x n per add).

    Each round measures everything once (``reps`` repetitions each, the minimum; ``add``
    3 x reps); a figure is the minimum over rounds, divided by the minimum ``torch.add`` of the
    run; ``over_add_rounds`` gives each round's own ratio (time / that round's add) for the
    spread. Keys ending ``@cpu`` are the same in this thread's CPU time (over add's CPU time):
    on a shared machine the wall-time minimum of a 20 ms step of 62 tensors rarely escapes
    preemption while a 5 ms add's does; CPU time leaves out the time another process held the
    core (not its use of memory bandwidth). ``{lib}.{step}.sbc_*``: the kernels' time within
    the step (each the minimum over reps of its per-step sum); ``derived_s``: the step minus
    its kernels (Python, ctypes, framing, the step's header parse)."""
    import torch
    layout = workload_layout("resnet18")
    n = sum(_numel(s) for _, s in layout)
    libs = {"current": _load_kernels()}
    if baseline:
        libs = {"baseline": _load_kernels(baseline), **libs}
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    grads = _gradients(layout, 0)
    absg = [g.abs() for g in grads]
    cells = []
    for p in densities:
        k_list = [min(_numel(s), max(1, round(p * _numel(s)))) for _, s in layout]
        state = {}
        for name, h in libs.items():
            _use_kernels(h)
            state[name] = _SbcCell(layout, p)
        dgc, topk = dgc_select(p), topk_select(p)
        peer_msgs = {}
        peer_outs = [torch.zeros_like(g) for g in grads]

        def peer_encode(sel):  # positions and values, as _sparse_peer's encode
            return [(i, g.index_select(0, i)) for g, x in zip(grads, absg) for i in (sel(x),)]

        def peer_decode(msgs):  # 8 ranks' messages scatter-added into zeroed outputs
            for o in peer_outs:
                o.zero_()
            for _ in range(N_RANKS):
                for o, (i, v) in zip(peer_outs, msgs):
                    o.index_add_(0, i, v, alpha=1.0 / N_RANKS)

        for peer, sel in (("dgc", dgc), ("topk", topk)):
            peer_msgs[peer] = peer_encode(sel)
        timed = {"add": lambda: torch.add(a, b, out=c),
                 "dgc.select": lambda: [dgc(x) for x in absg],
                 "topk.select": lambda: [torch.topk(x, k, sorted=False)
                                         for x, k in zip(absg, k_list)],
                 "dgc.encode": lambda: peer_encode(dgc),
                 "dgc.decode": lambda: peer_decode(peer_msgs["dgc"]),
                 "topk.encode": lambda: peer_encode(topk),
                 "topk.decode": lambda: peer_decode(peer_msgs["topk"])}
        best: Dict[str, float] = {}
        per_round: Dict[str, List[float]] = {}
        rounds_add: Dict[str, float] = {}

        def keep(key, t, clock="wall"):
            full = key if clock == "wall" else f"{key}@cpu"
            best[full] = min(best.get(full, math.inf), t)
            if key != "add":
                per_round.setdefault(full, []).append(t / rounds_add[clock])

        def measure(key, fn, n_reps):
            w, u = _min_wall_cpu(fn, n_reps)
            if key == "add":
                rounds_add["wall"], rounds_add["cpu"] = w, u
            keep(key, w)
            keep(key, u, "cpu")

        for _ in range(rounds):
            measure("add", timed["add"], 3 * reps)
            for name, h in libs.items():
                cell = state[name]
                _use_kernels(h)
                measure(f"{name}.compress", cell.compress_step, reps)
                measure(f"{name}.decode", cell.decode, reps)
                for what, fn in (("compress", cell.compress_step), ("decode", cell.decode)):
                    stage: Dict[str, float] = {}
                    for _ in range(reps):
                        acc: Dict[str, float] = {}
                        _use_kernels(_Timed(h, acc))
                        fn()
                        for kname, v in acc.items():
                            stage[kname] = min(stage.get(kname, math.inf), v)
                    _use_kernels(h)
                    for kname, v in stage.items():
                        if kname.endswith("@cpu"):
                            keep(f"{name}.{what}.{kname[:-4]}", v, "cpu")
                        else:
                            keep(f"{name}.{what}.{kname}", v)
            for key, fn in timed.items():
                if key != "add":
                    measure(key, fn, reps if "topk" not in key else max(2, reps // 2))
        derived = {}
        for name in libs:
            for what in ("compress", "decode"):
                for sfx in ("", "@cpu"):
                    pre = f"{name}.{what}"
                    ks = sum(v for k, v in best.items()
                             if k.startswith(pre + ".sbc_") and k.endswith("@cpu") == bool(sfx))
                    derived[f"{pre}.outside_kernels{sfx}"] = best[pre + sfx] - ks
        t_add = best["add"]
        bw = 12 * n / t_add
        cur = state["current"]
        _use_kernels(libs["current"])
        cur.compress_step()  # its sent positions (the commit's lines)
        sent = sum(int(s.numel()) for s in cur.sent)
        lines = sum(_lines_touched(s, _numel(sh)) for s, (_, sh) in zip(cur.sent, layout))
        from horovod_sbc import protocol
        from horovod_sbc.torch.backend import frame
        step = protocol.parse_gathered(memoryview(frame.host_bytes(cur.gathered)), layout,
                                       N_RANKS)
        positions = sum(m.count for _, _, m, _ in step.flat())
        msg_bytes = int(cur.gathered.numel())
        # the bytes each pass must move to or from memory (the ResNet-18 tensors, 47 MB, do not
        # fit this machine's caches; candidates, positions of one tensor and chunks do)
        passes = {
            "compress": {
                "R += g, select (read R and g, write R)": 12 * n,
                "commit R[pos] -= mu (read + write the lines holding a sent position)":
                    2 * 64 * lines,
                "positions out, streams (int64 positions, message)": 8 * sent + cur.step_bytes,
            },
            "decode": {
                "read 8 ranks' messages": msg_bytes,
                "positions: write then read (uint32)": 8 * positions,
                "output written once (non-temporal stores, no read for ownership)": 4 * n,
            },
        }
        row = {"p": p, "workload": "resnet18", "numel": n, "add_s": t_add,
               "add_bytes_per_s": bw, "k_per_rank": sum(k_list), "sent_positions": sent,
               "commit_lines": lines, "decoded_positions": positions,
               "step_message_bytes": cur.step_bytes, "gathered_bytes": msg_bytes,
               "times_s": best, "derived_s": derived,
               "derived_over_add": {k: v / (best["add@cpu"] if k.endswith("@cpu") else t_add)
                                    for k, v in derived.items()},
               "over_add": {k: v / (best["add@cpu"] if k.endswith("@cpu") else t_add)
                            for k, v in best.items()},
               "over_add_rounds": per_round, "bytes": passes,
               # bytes / (add's 12 n bytes): the time floor at add's bandwidth, over add
               "memory_floor_over_add": {
                   what: sum(v.values()) / (12 * n) for what, v in passes.items()}}
        cells.append(row)
    return {"rounds": rounds, "reps": reps, "threads": torch.get_num_threads(),
            "baseline": baseline, "cells": cells}


def print_worst_cells(res: Dict[str, object]) -> None:
    for row in res["cells"]:
        o = row["over_add"]
        print(f"\nResNet-18, p = {row['p']:g}: add {1e3 * row['add_s']:.2f} ms "
              f"({row['add_bytes_per_s'] / 1e9:.1f} GB/s as 12 B x n)")
        for key in sorted(o):
            if key in ("add", "add@cpu"):
                continue
            rr = row["over_add_rounds"].get(key, [])
            spread = f"  rounds {min(rr):.2f}-{max(rr):.2f}x" if rr else ""
            print(f"  {key:52s} {1e3 * row['times_s'][key]:8.2f} ms {o[key]:6.2f}x{spread}")
        for key, v in row["derived_s"].items():
            print(f"  {key:52s} {1e3 * v:8.2f} ms {row['derived_over_add'][key]:6.2f}x")
        for what, parts in row["bytes"].items():
            print(f"  {what} memory floor {row['memory_floor_over_add'][what]:.2f}x add:")
            for label, v in parts.items():
                print(f"     {v / 1e6:8.1f} MB  {v / (12 * row['numel']):.2f}x  {label}")


if __name__ == "__main__":
    import argparse
    import json
    import sys
    ap = argparse.ArgumentParser(description="the codec's worst cells (see worst_cells)")
    ap.add_argument("--densities", type=lambda v: [float(x) for x in v.split(",")],
                    default=list(WORST_DENSITIES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline", help="an older build of sbc_kernels.c (.so) to alternate with")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    out = worst_cells(args.densities, args.rounds, args.reps, args.baseline)
    out["command"] = "python -m benchmarks.bench_codec " + " ".join(sys.argv[1:])
    print_worst_cells(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
