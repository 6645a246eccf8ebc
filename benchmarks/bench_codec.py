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
                    frame the step message, ``R -= sent``
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
import time
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

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


def min_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Minimum wall time of ``fn`` over ``reps`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def entropy_bits(p: float) -> float:
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _gradients(layout, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(_numel(s), generator=g) for _, s in layout]


def add_time(n: int, reps: int) -> float:
    import torch
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    return min_time(lambda: torch.add(a, b, out=c), reps)


def bench_sbc(layout, density: float, reps: int, t_add: float,
              selection: str = "paper") -> Dict[str, float]:
    """Our codec on one workload at one density (see the module docstring)."""
    import torch
    from horovod_sbc import wire
    from horovod_sbc.torch import codec, exchange
    fp = wire.layout_fingerprint(layout)
    grads = _gradients(layout, 0)
    residuals = [torch.zeros_like(g) for g in grads]
    names = [n for n, _ in layout]

    def compress_step():
        msgs, commits = [], []
        for name, g, r in zip(names, grads, residuals):
            r.add_(g)
            m, pos, sent = codec.encode_update(r, density, "sbc", name, selection=selection)
            msgs.append(m)
            commits.append((r, pos, sent))
        step = exchange.frame(msgs, fp, grads[0].device)
        for r, pos, sent in commits:
            codec.subtract_sent_(r, pos, sent)
        return step

    t_comp = min_time(compress_step, reps)
    steps, pos_bits, entropy = [], 0, 0.0
    for rank in range(N_RANKS):
        msgs = []
        for (name, _), g in zip(layout, _gradients(layout, 100 + rank)):
            m, _ = codec.compress_(g, density, "sbc", name, selection=selection)
            msgs.append(m)
            if rank == 0:
                hdr = wire.parse_tensor_header(bytes(m.numpy()), 0, g.numel())
                pos_bits += 8 * ((hdr.unary[1] - hdr.unary[0]) + (hdr.remainder[1] - hdr.remainder[0]))
                if 0 < hdr.count < g.numel():
                    entropy += g.numel() * entropy_bits(hdr.count / g.numel())
        steps.append(exchange.frame(msgs, fp, grads[0].device))
    gathered = torch.cat(steps)
    outs = [torch.zeros(_numel(s)) for _, s in layout]

    def decode():
        for o in outs:
            o.zero_()
        exchange.decode_gathered(gathered, layout, N_RANKS, outs, 1.0 / N_RANKS)

    t_dec = min_time(decode, reps)
    k_list = [min(_numel(s), max(1, round(density * _numel(s)))) for _, s in layout]
    absg = [g.abs() for g in grads]
    t_topk = min_time(lambda: [torch.topk(x, k, sorted=False) for x, k in zip(absg, k_list)],
                      max(2, reps // 2))
    return {"compress_s": t_comp, "decode_s": t_dec, "topk_s": t_topk,
            "compress_over_add": t_comp / t_add, "decode_over_add": t_dec / t_add,
            "topk_over_add": t_topk / t_add,
            "bits_per_position_over_entropy": pos_bits / entropy if entropy else float("nan"),
            "step_message_bytes": int(steps[0].numel()),
            "bits_per_step": 8 * int(steps[0].numel())}
