"""When does SBC pay? A step-time model fed with this machine's codec speed.

    python -m horovod_sbc.advise --layout resnet50 --bandwidth 10gbit --latency 20us \\
        --compute-ms 150 --density 0.01 --json advise.json --plot advise.png

It measures the torch codec here (encode of one rank's sync, decode of N ranks' messages, the
message size, and the drop-in optimizer's sync work outside the codec) for a layout:
``resnet50``, ``gpt2-small``, a comma list of tensor sizes (``4194304,4096,10``) or the user's
model as ``package.module:function`` (a callable returning a ``torch.nn.Module`` or a list of
``(name, shape)``). Then it predicts the step time of dense ring allreduce, SBC over
allgather, SBC's server topology, SBC's sparse reduce-scatter with re-compression and
hierarchical exchanges (dense inside a node of G ranks, SBC's allgather or reduce-scatter
across nodes) for N = 2 ... 1024, and the bandwidth below which SBC's allgather beats dense
allreduce. Every assumption is stated in docs/advise.md.

Each communication pattern costs ``bits / bandwidth + seconds`` (:class:`Cost`): linear in
1 / bandwidth, so two patterns cross at one bandwidth (:func:`crossover_bps`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import registry
from .config import SBCConfig

Layout = List[Tuple[str, Tuple[int, ...]]]
WORKERS = tuple(2 ** i for i in range(1, 11))  # 2 ... 1024


# ------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------
def _bn(pre: str, c: int) -> Layout:
    return [(pre + ".weight", (c,)), (pre + ".bias", (c,))]


def resnet50_layout() -> Layout:
    """torchvision's ResNet-50 parameters (161 tensors, 25,557,032 elements)."""
    out: Layout = [("conv1.weight", (64, 3, 7, 7))] + _bn("bn1", 64)
    cin = 64
    for li, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(blocks):
            pre, c_in = f"layer{li}.{b}.", cin if b == 0 else 4 * width
            out += [(pre + "conv1.weight", (width, c_in, 1, 1))] + _bn(pre + "bn1", width)
            out += [(pre + "conv2.weight", (width, width, 3, 3))] + _bn(pre + "bn2", width)
            out += [(pre + "conv3.weight", (4 * width, width, 1, 1))] + _bn(pre + "bn3", 4 * width)
            if b == 0:
                out += [(pre + "downsample.0.weight", (4 * width, c_in, 1, 1))]
                out += _bn(pre + "downsample.1", 4 * width)
        cin = 4 * width
    return out + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def gpt2_small_layout() -> Layout:
    """GPT-2 small (Hugging Face's ``GPT2Model``, 148 tensors, 124,439,808 elements)."""
    d, out = 768, [("wte.weight", (50257, 768)), ("wpe.weight", (1024, 768))]
    for i in range(12):
        p = f"h.{i}."
        out += _bn(p + "ln_1", d) + [(p + "attn.c_attn.weight", (d, 3 * d)),
                                      (p + "attn.c_attn.bias", (3 * d,)),
                                      (p + "attn.c_proj.weight", (d, d)),
                                      (p + "attn.c_proj.bias", (d,))]
        out += _bn(p + "ln_2", d) + [(p + "mlp.c_fc.weight", (d, 4 * d)),
                                      (p + "mlp.c_fc.bias", (4 * d,)),
                                      (p + "mlp.c_proj.weight", (4 * d, d)),
                                      (p + "mlp.c_proj.bias", (d,))]
    return out + _bn("ln_f", d)


NAMED = {"resnet50": resnet50_layout, "gpt2-small": gpt2_small_layout}


def _numel(shape) -> int:
    return int(math.prod(shape)) if len(shape) else 1


def parse_layout(spec: str) -> Layout:
    """A named layout, a comma list of tensor sizes, or ``module:callable`` (see the module
    docstring)."""
    if spec in NAMED:
        return NAMED[spec]()
    if re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", spec):
        sizes = [int(x) for x in spec.split(",")]
        if min(sizes) <= 0:
            raise ValueError(f"layout {spec!r}: tensor sizes must be positive")
        return [(f"t{i}", (n,)) for i, n in enumerate(sizes)]
    if ":" in spec:
        mod, _, fn = spec.partition(":")
        obj = getattr(importlib.import_module(mod), fn)()
        if hasattr(obj, "named_parameters"):
            return [(n, tuple(p.shape)) for n, p in obj.named_parameters() if p.requires_grad]
        return [(str(n), tuple(int(x) for x in s)) for n, s in obj]
    raise ValueError(f"layout {spec!r}: use one of {sorted(NAMED)}, a comma list of sizes, or "
                     "package.module:function")


# ------------------------------------------------------------------------------------------------
# measuring the codec
# ------------------------------------------------------------------------------------------------
@dataclass
class CodecCost:
    """This machine's codec on one layout (seconds, bits). Decoding N ranks' messages costs
    ``decode_fixed_s + N * decode_per_message_s``."""
    numel: int
    tensors: int
    density: float
    encode_s: float             # one rank's sync: R += g, select, binarize, encode, frame, R -= sent
    decode_fixed_s: float       # the pass over the dense output, whatever N
    decode_per_message_s: float  # one more rank's step message decoded and added
    message_bits: int           # one rank's step message (headers included)
    downlink_encode_s: float    # server: the average re-encoded (dense or top-k with values)
    downlink_decode_s: float    # every worker: the server's one message decoded
    downlink_bits: int
    # the same costs split per tensor and per element, from a layout of tiny tensors
    encode_per_tensor_s: float = 0.0
    encode_per_element_s: float = 0.0
    decode_per_tensor_s: float = 0.0
    decode_per_position_s: float = 0.0
    # the drop-in optimizer's sync work outside the codec: W - W_ref, the average added to the
    # reference, the weights and the reference renewed (passes over every element, once per sync)
    sync_overhead_s: float = 0.0
    # the reduce-scatter topology's extra step messages: parsing one more step message beyond
    # its tensors (header, CRC, split; from 64 one-tensor messages), decoding it as a job of
    # its own (the region messages have a layout each) beyond that, framing one more on the
    # encode side, and the mean tensor-message header of the measured message (bits)
    decode_per_step_s: float = 0.0
    frame_per_step_s: float = 0.0
    tensor_header_bits: float = 0.0
    # the reduce-scatter's owners re-encoding at another setting than the uplink's
    # (``downlink_mode`` / ``downlink_density``): the whole layout's step message at that
    # setting (bits), its encode, and its decode as one more message; 0: the uplink's figures
    rs_down_bits: int = 0
    rs_down_encode_s: float = 0.0
    rs_down_decode_per_message_s: float = 0.0

    def decode_s(self, n_messages: int) -> float:
        return self.decode_fixed_s + n_messages * self.decode_per_message_s

    @property
    def dense_bits(self) -> int:
        return 32 * self.numel


def min_time(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Fastest of ``reps`` runs after ``warmup`` runs (the machine may be shared)."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _encoder(layout: Layout, density: float, seed: int):
    """A zero-argument callable doing one rank's compress step; returns its step message."""
    import torch
    from horovod_sbc import wire
    from horovod_sbc.torch.backend import Accumulate, PositionBuffer, backend_for, frame
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(_numel(s), generator=g) for _, s in layout]
    res = [torch.zeros_like(x) for x in grads]
    bufs = [PositionBuffer() for _ in layout]
    fp = wire.layout_fingerprint(layout)
    backend = backend_for(grads[0].device)
    names = [name for name, _ in layout]

    def step():
        # as the package encodes a sync: every tensor at once where the backend can
        sync = backend.encode_many([Accumulate(r, x) for x, r in zip(grads, res)], density,
                                   "sbc", "paper", names)
        if sync is not None:
            out = sync.frame(fp)
            sync.commit()
            return out
        encs = [backend.encode_tensor(Accumulate(r, x), density, "sbc", name, positions=b)
                for (name, _), x, r, b in zip(layout, grads, res, bufs)]
        out = frame.frame([e.message for e in encs], fp, grads[0].device)
        for e in encs:
            e.commit()
        return out
    return step


def _time_decode(layout: Layout, steps, reps: int) -> float:
    import torch
    from horovod_sbc.torch.backend import Targets, backend_for
    gathered = torch.cat(steps)
    outs = [torch.zeros(_numel(s)) for _, s in layout]
    backend = backend_for(gathered.device)
    return min_time(lambda: backend.decode(gathered, layout, len(steps), Targets.add(outs),
                                           1.0 / len(steps)), reps)


class _OneRank:
    """A transport for one process: the world is this rank alone, the allgather returns its
    own step message (the drop-in's whole sync runs, without a collective)."""

    def world(self) -> Tuple[int, int]:
        return 1, 0

    def allgather(self, step, tag: str):
        return step


def _time_sync_overhead(layout: Layout, density: float, reps: int, codec_s: float) -> float:
    """The drop-in :func:`horovod_sbc.torch.DistributedOptimizer`'s step on one rank (SGD with
    momentum, a sync every step, one-rank transport) less the plain SGD step and ``codec_s``
    (encode + decode of one message, measured apart): what a sync costs beyond the codec."""
    import torch
    import horovod_sbc.torch as sbc
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.zeros(s)) for _, s in layout]
    grads = [torch.randn(s, generator=g) for _, s in layout]
    base = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    comp = sbc.SBC(density, delay=1)
    comp.transport = _OneRank()
    drop_in = sbc.DistributedOptimizer(base, [(n, p) for (n, _), p in zip(layout, params)],
                                       compression=comp)

    def stepper(opt):
        def step():
            for p, x in zip(params, grads):
                p.grad = x
            opt.step()
        return step
    t_sync, t_base = min_time(stepper(drop_in), reps), min_time(stepper(base), reps)
    return max(0.0, t_sync - t_base - codec_s)


def _average_encoder(layout: Layout, mode: str, density: float, seed: int):
    """A closure that encodes a random average of ``layout`` (seeded) at ``mode`` and
    ``density``, every tensor (nothing committed: the average stays), and frames it as one
    step message."""
    import torch
    from horovod_sbc import wire
    from horovod_sbc.torch.backend import backend_for, frame
    g = torch.Generator().manual_seed(seed)
    avg = [torch.randn(_numel(s), generator=g) for _, s in layout]
    fp, backend = wire.layout_fingerprint(layout), backend_for(avg[0].device)
    names = [n for n, _ in layout]

    def encode():  # as the package: every tensor at once where the backend can
        sync = backend.encode_many(list(avg), density, mode, "paper", names)
        if sync is not None:
            return sync.frame(fp)
        return frame.frame([backend.encode_tensor(a, density, mode, n).message
                            for n, a in zip(names, avg)], fp, avg[0].device)
    return encode


def _rs_downlink(layout: Layout, mode: str, density: float, reps: int
                 ) -> Tuple[float, float, int]:
    """Reduce-scatter: (encode s, decode s of one more message, bits) of the owners' downlink
    at ``mode`` and ``density``, from the whole layout's message of a random average."""
    enc = _average_encoder(layout, mode, density, 11)
    t_enc = min_time(enc, reps)
    steps = [enc(), _average_encoder(layout, mode, density, 12)()]
    t_dec = max(0.0, _time_decode(layout, steps, reps) - _time_decode(layout, steps[:1], reps))
    return t_enc, t_dec, 8 * int(steps[0].numel())


def _downlink(layout: Layout, density: Optional[float], reps: int) -> Tuple[float, float, int]:
    """Server: (encode s, decode s, bits) of the downlink for an average of ``layout``: dense
    fp32 values (``density`` None, the package's default) or top-k with values."""
    enc = _average_encoder(layout, "values", 1.0 if density is None else density, 7)
    t_enc = min_time(enc, reps)
    msg = enc()
    return t_enc, _time_decode(layout, [msg], reps), 8 * int(msg.numel())


def measure_codec(layout: Layout, density: float, downlink_density: Optional[float] = None,
                  reps: int = 3, decode_ranks: int = 4, sync_overhead: bool = True,
                  rs_downlink: Optional[Tuple[str, float]] = None) -> CodecCost:
    """Encode one sync, decode 1 and ``decode_ranks`` ranks' messages (the difference gives the
    cost per message), on this machine with the torch codec as configured (C kernels on the CPU
    unless HOROVOD_SBC_KERNELS=0); with ``sync_overhead`` also the drop-in's sync work outside
    the codec (:func:`_time_sync_overhead`; else 0). ``rs_downlink``: the reduce-scatter's
    owners' ``(mode, density)`` where it is not SBC at ``density`` (:func:`_rs_downlink`)."""
    enc = _encoder(layout, density, 0)
    t_enc = min_time(enc, reps)
    steps = [_encoder(layout, density, 100 + r)() for r in range(decode_ranks)]
    t1 = _time_decode(layout, steps[:1], reps)
    tn = _time_decode(layout, steps, reps)
    per_msg = max(0.0, (tn - t1) / (decode_ranks - 1))
    d_enc, d_dec, d_bits = _downlink(layout, downlink_density, reps)
    cost = CodecCost(sum(_numel(s) for _, s in layout), len(layout), density, t_enc,
                     max(0.0, t1 - per_msg), per_msg, 8 * int(steps[0].numel()),
                     d_enc, d_dec, d_bits)
    if sync_overhead:
        cost.sync_overhead_s = _time_sync_overhead(layout, density, reps, t_enc + t1)
    cost.tensor_header_bits = _mean_tensor_header_bits(steps[0])
    if rs_downlink is not None and tuple(rs_downlink) != ("sbc", density):
        cost.rs_down_encode_s, cost.rs_down_decode_per_message_s, cost.rs_down_bits = \
            _rs_downlink(layout, rs_downlink[0], rs_downlink[1], reps)
    return _per_step(_split_per_tensor(cost, density, reps), density, reps)


def _mean_tensor_header_bits(step) -> float:
    """Mean header (magic ... value, before the position streams) of a step message's tensor
    messages, in bits."""
    from horovod_sbc import wire
    buf, off, sizes = step.cpu().numpy().tobytes(), wire.STEP_HEADER_SIZE, []
    while off < len(buf):
        tm = wire.parse_tensor_header(buf, off)
        sizes.append(tm.unary[0] - off)
        off = tm.nbytes
    return 8.0 * sum(sizes) / max(1, len(sizes))


def _per_step(cost: CodecCost, density: float, reps: int, k: int = 64) -> CodecCost:
    """The cost of one more step message beyond its one tensor: decode 1 and ``k`` messages of
    one 64-element tensor (the difference / (k - 1) less ``decode_per_tensor_s``), the same
    ``k`` as ``k`` jobs (the difference / (k - 1) beyond that: one more job), and frame ``k``
    such messages (/ k)."""
    from horovod_sbc import wire
    from horovod_sbc.torch.backend import frame
    one = [("t0", (64,))]
    steps = [_encoder(one, density, 100 + r)() for r in range(k)]
    tk, t1 = _time_decode(one, steps, reps), _time_decode(one, steps[:1], reps)
    cost.decode_per_step_s = max(0.0, (tk - t1) / (k - 1) - cost.decode_per_tensor_s)
    import torch
    from horovod_sbc.torch.backend import backend_for
    body, fp = steps[0][wire.STEP_HEADER_SIZE:], wire.layout_fingerprint(one)
    # a backend that encodes a sync at once frames the regions' parts from that encoding,
    # the others frame each part's messages
    xs = [torch.randn(64, generator=torch.Generator().manual_seed(i)) for i in range(k)]
    sync = backend_for(xs[0].device).encode_many(xs, density, "sbc", "paper",
                                                 [f"t{i}" for i in range(k)])
    if sync is not None and hasattr(sync, "frame_groups"):
        groups, fps = list(range(k + 1)), [fp] * k
        cost.frame_per_step_s = min_time(lambda: sync.frame_groups(groups, fps), reps) / k
    else:
        cost.frame_per_step_s = min_time(lambda: [frame.frame([body], fp, body.device)
                                                  for _ in range(k)], reps) / k
    return cost


def _split_per_tensor(cost: CodecCost, density: float, reps: int) -> CodecCost:
    """The per-tensor share from 256 tensors of 64 elements; the rest is per element
    (encode) or per position sent (decode)."""
    tiny = [(f"t{i}", (64,)) for i in range(256)]
    t_enc = min_time(_encoder(tiny, density, 0), reps) / len(tiny)
    steps = [_encoder(tiny, density, 100 + r)() for r in range(2)]
    t_dec = max(0.0, _time_decode(tiny, steps, reps) - _time_decode(tiny, steps[:1], reps))
    t_dec /= len(tiny)
    positions = max(1.0, density * cost.numel)
    cost.encode_per_tensor_s = min(t_enc, cost.encode_s / cost.tensors)
    cost.encode_per_element_s = (cost.encode_s - cost.tensors * cost.encode_per_tensor_s) / cost.numel
    cost.decode_per_tensor_s = min(t_dec, cost.decode_per_message_s / cost.tensors)
    cost.decode_per_position_s = (cost.decode_per_message_s
                                  - cost.tensors * cost.decode_per_tensor_s) / positions
    return cost


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cost:
    """Time of a communication pattern: ``bits / bandwidth + seconds``."""
    bits: float
    seconds: float

    def at(self, bps: float) -> float:
        return self.bits / bps + self.seconds

    def __add__(self, o: "Cost") -> "Cost":
        return Cost(self.bits + o.bits, self.seconds + o.seconds)

    def scaled(self, f: float) -> "Cost":
        return Cost(self.bits * f, self.seconds * f)


@dataclass(frozen=True)
class Net:
    """Link bandwidth (bit/s) and latency (s) between nodes and inside a node."""
    bps: float
    latency_s: float
    intra_bps: float = 800e9
    intra_latency_s: float = 5e-6


def ring_allreduce(bits: float, n: int, latency_s: float) -> Cost:
    """Ring allreduce of ``bits`` over ``n`` ranks: 2(n-1)/n * bits on the slowest link,
    2(n-1) latencies."""
    if n <= 1:
        return Cost(0.0, 0.0)
    return Cost(2 * (n - 1) / n * bits, 2 * (n - 1) * latency_s)


def ring_allgather(bits_each: float, n: int, latency_s: float) -> Cost:
    """Ring allgather of one message of ``bits_each`` per rank: each rank receives n-1."""
    return Cost((n - 1) * bits_each, (n - 1) * latency_s)


def broadcast(bits: float, n: int, latency_s: float) -> Cost:
    """Large-message broadcast as scatter + ring allgather (van de Geijn)."""
    if n <= 1:
        return Cost(0.0, 0.0)
    return Cost(2 * (n - 1) / n * bits, (math.ceil(math.log2(n)) + n - 1) * latency_s)


def dense_step(c: CodecCost, n: int, net: Net) -> Cost:
    return ring_allreduce(c.dense_bits, n, net.latency_s)


def sbc_allgather_step(c: CodecCost, n: int, net: Net, delay: int = 1) -> Cost:
    """Encode, allgather of every rank's message, decode all n (the package decodes its own
    too, so every rank adds the same values in the same order), the drop-in's passes outside
    the codec; once per ``delay`` steps."""
    work = Cost(0.0, c.encode_s + c.decode_s(n) + c.sync_overhead_s)
    return (work + ring_allgather(c.message_bits, n, net.latency_s)).scaled(1 / delay)


def sbc_server_step(c: CodecCost, n: int, net: Net, delay: int = 1) -> Cost:
    """Rank 0 gathers n-1 messages over its one link, decodes n, re-encodes the average and
    broadcasts it; every rank decodes that one message."""
    work = Cost(0.0, c.encode_s + c.decode_s(n) + c.downlink_encode_s + c.downlink_decode_s
                + c.sync_overhead_s)
    gather = Cost((n - 1) * c.message_bits, net.latency_s)
    return (work + gather + broadcast(c.downlink_bits, n, net.latency_s)).scaled(1 / delay)


def hierarchical_step(c: CodecCost, n: int, g: int, net: Net, delay: int = 1,
                      across: Optional[Callable[..., Cost]] = None) -> Cost:
    """Dense allreduce inside each node of ``g`` ranks (intra-node link), then SBC over
    allgather (``across``: another ``(c, nodes, net, delay)`` step) among the n/g nodes (one
    message per node, inter-node link). The intra-node part is converted to bits at the
    inter-node bandwidth so that the whole stays one Cost."""
    g = min(g, n)
    nodes = math.ceil(n / g)
    intra = ring_allreduce(c.dense_bits, g, net.intra_latency_s)
    intra = Cost(0.0, intra.at(net.intra_bps) / delay)  # once per sync; the intra link is given
    if nodes == 1:
        return intra
    return intra + (across or sbc_allgather_step)(c, nodes, net, delay)


STEP_HEADER_BITS = 8 * 24  # horovod_sbc.wire.STEP_HEADER_SIZE


def reduce_scatter_region_bits(c: CodecCost, n: int, down: bool = False) -> float:
    """One region's step message: a step header and 1/n of the message's body (its positions
    and tensor headers) plus 1/n of the n - 1 tensor headers the region cuts add; ``down``: the
    owners' region message (:attr:`CodecCost.rs_down_bits` where they re-encode at another
    setting)."""
    message = c.rs_down_bits if down and c.rs_down_bits else c.message_bits
    body = message - STEP_HEADER_BITS + (n - 1) * c.tensor_header_bits
    return STEP_HEADER_BITS + body / n


def reduce_scatter_download_bits(c: CodecCost, n: int) -> float:
    """What a rank receives per sync: n - 1 region messages in the alltoall, n - 1 in the
    allgather."""
    return (n - 1) * (reduce_scatter_region_bits(c, n) + reduce_scatter_region_bits(c, n, True))


def reduce_scatter_decode_s(c: CodecCost, n: int) -> float:
    """Decode of one sync: the owner's n parts of its region (one job: a pass over numel / n)
    and every rank's n region messages (their headers checked, then one job of the whole
    piece layout: a pass over numel); each is one message's positions (the region messages'
    at the owners' setting) in T + n - 1 pieces and n step messages. One rank: its own
    message, as the allgather."""
    if n <= 1:
        return c.decode_s(1)
    spread = (n - 1) * c.decode_per_tensor_s + (n - 1) * c.decode_per_step_s
    down = c.rs_down_decode_per_message_s if c.rs_down_bits else c.decode_per_message_s
    return c.decode_fixed_s * (1 + 1 / n) + 2 * spread + c.decode_per_message_s + down


def sbc_reduce_scatter_step(c: CodecCost, n: int, net: Net, delay: int = 1) -> Cost:
    """Sparse reduce-scatter with re-compression (``horovod_sbc.torch.sync.scatter``), per sync:

    1. every rank cuts the flat model (numel E, T tensors) into n regions of E/n elements
       (T + n - 1 pieces), encodes every piece at density p (one encode of the layout plus
       n - 1 more pieces' per-tensor share, n step messages framed: n - 1 more than one) and
       sends region r's step message to rank r in one pairwise alltoall: n - 1 messages of
       :func:`reduce_scatter_region_bits` out and in, (n - 1) latencies;
    2. the owner decodes its region's n parts and re-encodes its region (its downlink residual
       added) at the owners' setting (the package's default: STC at 4p; SBC at p where
       :attr:`CodecCost.rs_down_bits` is 0): the encode of E/n elements and (T + n - 1)/n
       pieces;
    3. the owners' region messages (the same size) are ring-allgathered, (n - 1) latencies,
       and every rank decodes all n as one job (:func:`reduce_scatter_decode_s` holds both
       decodes).

    Per-message and per-header figures are this machine's (:class:`CodecCost`), the
    drop-in's sync work outside the codec is added once; once per ``delay`` steps."""
    if n <= 1:
        return sbc_allgather_step(c, n, net, delay)
    region, down = reduce_scatter_region_bits(c, n), reduce_scatter_region_bits(c, n, True)
    encode = c.encode_s + (n - 1) * (c.encode_per_tensor_s + c.frame_per_step_s)
    reencode = ((c.rs_down_encode_s if c.rs_down_bits else c.encode_s)
                + (n - 1) * c.encode_per_tensor_s) / n
    work = Cost(0.0, encode + reencode + reduce_scatter_decode_s(c, n) + c.sync_overhead_s)
    alltoall = Cost((n - 1) * region, (n - 1) * net.latency_s)
    return (work + alltoall + ring_allgather(down, n, net.latency_s)).scaled(1 / delay)


def crossover_bps(a: Cost, b: Cost) -> Tuple[Optional[float], str]:
    """Bandwidth where ``b`` and ``a`` take equal time, and on which side ``b`` is faster:
    ``(B, "below")`` b is faster below B; ``(B, "above")`` faster above B; ``(None,
    "always")`` / ``(None, "never")`` at every bandwidth / at none."""
    db, ds = a.bits - b.bits, b.seconds - a.seconds  # b faster iff db / B > ds
    if db > 0:
        return (db / ds, "below") if ds > 0 else (None, "always")
    if db < 0:
        return (db / ds, "above") if ds < 0 else (None, "never")
    return (None, "always") if ds < 0 else (None, "never")


def predict(c: CodecCost, net: Net, compute_s: float, workers: Sequence[int] = WORKERS,
            gpus_per_node: int = 8, delay: int = 1) -> List[Dict[str, object]]:
    """One row per worker count: step seconds per topology (compute + communication + codec,
    no overlap), the fastest, and the crossover of SBC's allgather against dense."""
    rows = []
    for n in workers:
        costs = {"dense": dense_step(c, n, net), "sbc_allgather": sbc_allgather_step(c, n, net, delay),
                 "sbc_server": sbc_server_step(c, n, net, delay),
                 "hierarchical": hierarchical_step(c, n, gpus_per_node, net, delay),
                 "sbc_reduce_scatter": sbc_reduce_scatter_step(c, n, net, delay),
                 "hierarchical_rs": hierarchical_step(c, n, gpus_per_node, net, delay,
                                                      sbc_reduce_scatter_step)}
        step = {k: compute_s + v.at(net.bps) for k, v in costs.items()}
        x, side = crossover_bps(costs["dense"], costs["sbc_allgather"])
        rows.append({"workers": n, "step_s": step, "best": min(step, key=step.get),
                     "crossover_bps": x, "sbc_pays": side,
                     "allgather_decode_s": c.decode_s(n) / delay,
                     "allgather_download_bits": (n - 1) * c.message_bits / delay,
                     "reduce_scatter_decode_s": reduce_scatter_decode_s(c, n) / delay,
                     "reduce_scatter_download_bits": reduce_scatter_download_bits(c, n) / delay,
                     "dense_download_bits": 2 * (n - 1) / n * c.dense_bits})
    return rows


# ------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------
_UNIT = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bps(s: str) -> float:
    """'10gbit', '100mbit', '25g', '1e9' -> bit/s (powers of 1000, as tc)."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kmgtKMGT]?)(?:bit|b)?(?:/s|ps)?\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"bandwidth {s!r}: e.g. 100mbit, 10gbit, 1e9")
    v = float(m.group(1)) * _UNIT[m.group(2).lower()]
    if v <= 0:
        raise argparse.ArgumentTypeError(f"bandwidth {s!r} must be positive")
    return v


def parse_seconds(s: str) -> float:
    """'20us', '0.5ms', '1e-5' -> seconds."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us|ns)?\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"time {s!r}: e.g. 20us, 0.5ms, 1e-5")
    return float(m.group(1)) * {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}[m.group(2) or "s"]


def _fmt_bps(x: Optional[float], side: str) -> str:
    if x is None:
        return side
    return f"{side} {x / 1e9:.3g} Gbit/s"


def format_table(rows: List[Dict[str, object]]) -> str:
    """Step time per topology, the fastest, and the decode and download of SBC's allgather and
    reduce-scatter (per step: a sync's divided by the delay)."""
    head = (f"{'N':>5} {'dense':>9} {'sbc allgather':>13} {'sbc server':>10} {'hierarch.':>9}"
            f" {'sbc r-scatter':>13} {'hier. rs':>9}  {'best':<18} {'ag decode':>9}"
            f" {'ag download':>11} {'rs decode':>9} {'rs download':>11}  SBC allgather pays")
    unit = f"{'ms/step':>9}"
    lines = [head, f"{'':>5} {unit} {'ms/step':>13} {'ms/step':>10} {unit} {'ms/step':>13} {unit}"
                   f"  {'':<18} {unit} {'Mbit/step':>11} {unit} {'Mbit/step':>11}"]
    for r in rows:
        s = {k: 1e3 * v for k, v in r["step_s"].items()}
        lines.append(f"{r['workers']:>5} {s['dense']:>9.1f} {s['sbc_allgather']:>13.1f}"
                     f" {s['sbc_server']:>10.1f} {s['hierarchical']:>9.1f}"
                     f" {s['sbc_reduce_scatter']:>13.1f} {s['hierarchical_rs']:>9.1f}"
                     f"  {r['best']:<18} {1e3 * r['allgather_decode_s']:>9.1f}"
                     f" {r['allgather_download_bits'] / 1e6:>11.1f}"
                     f" {1e3 * r['reduce_scatter_decode_s']:>9.1f}"
                     f" {r['reduce_scatter_download_bits'] / 1e6:>11.1f}"
                     f"  {_fmt_bps(r['crossover_bps'], r['sbc_pays'])}")
    return "\n".join(lines)


def plot(rows: List[Dict[str, object]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ns = [r["workers"] for r in rows]
    for key, label in (("dense", "dense ring allreduce"), ("sbc_allgather", "SBC allgather"),
                       ("sbc_server", "SBC server"), ("hierarchical", "hierarchical"),
                       ("sbc_reduce_scatter", "SBC reduce-scatter"),
                       ("hierarchical_rs", "hierarchical reduce-scatter")):
        ax.plot(ns, [1e3 * r["step_s"][key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m horovod_sbc.advise", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="resnet50",
                    help="resnet50 | gpt2-small | sizes '1000,20' | package.module:function")
    ap.add_argument("--density", type=float, default=0.01, help="SBC's p (default 0.01)")
    ap.add_argument("--delay", type=int, default=1, help="steps between syncs (default 1)")
    ap.add_argument("--downlink-density", type=float, default=None,
                    help="server topology: top-k density of the downlink (default dense); "
                         "reduce-scatter: the owners' density (default SBCConfig's: 4 x "
                         "--density)")
    ap.add_argument("--downlink-mode", default=None,
                    help="reduce-scatter: the owners' compressor, a registered mode (default "
                         "SBCConfig's: stc)")
    ap.add_argument("--register", action="append", default=[], metavar="FILE",
                    help="a Python file that registers a compressor (e.g. "
                         "tests/user_compressor.py); may be repeated")
    ap.add_argument("--bandwidth", type=parse_bps, default=parse_bps("10gbit"),
                    help="each rank's (node's) link, e.g. 10gbit (default)")
    ap.add_argument("--latency", type=parse_seconds, default=parse_seconds("20us"),
                    help="per message, e.g. 20us (default)")
    ap.add_argument("--intra-bandwidth", type=parse_bps, default=parse_bps("800gbit"),
                    help="inside a node (hierarchical), default 800gbit")
    ap.add_argument("--intra-latency", type=parse_seconds, default=parse_seconds("5us"))
    ap.add_argument("--gpus-per-node", type=int, default=8, help="G of the hierarchical variant")
    ap.add_argument("--compute-ms", type=float, default=100.0,
                    help="forward + backward + optimizer step of one rank, ms (default 100)")
    ap.add_argument("--workers", default=",".join(map(str, WORKERS)),
                    help="comma list of N (default 2,4,...,1024)")
    ap.add_argument("--reps", type=int, default=3, help="timing repetitions (fastest kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads while measuring")
    ap.add_argument("--json", help="write inputs, measured codec and predictions here")
    ap.add_argument("--plot", help="write a PNG of step time against N here")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    layout = parse_layout(args.layout)
    workers = [int(x) for x in args.workers.split(",") if x]
    net = Net(args.bandwidth, args.latency, args.intra_bandwidth, args.intra_latency)
    for path in args.register:
        registry.load_file(path)
    rs = SBCConfig(density=args.density, topology="reduce_scatter",  # the package's defaults
                   downlink_mode=args.downlink_mode, downlink_density=args.downlink_density)
    rs_down = (rs.downlink_compressor, rs.downlink_fraction)
    cost = measure_codec(layout, args.density, args.downlink_density, args.reps,
                         rs_downlink=rs_down)
    rows = predict(cost, net, args.compute_ms / 1e3, workers, args.gpus_per_node, args.delay)
    print(f"layout {args.layout}: {cost.tensors} tensors, {cost.numel:,} elements; SBC p="
          f"{args.density:g}, delay {args.delay}; message {cost.message_bits / 8e3:.1f} kB "
          f"(dense {cost.dense_bits / 8e6:.1f} MB)")
    print(f"codec here ({args.threads} thread): encode {1e3 * cost.encode_s:.2f} ms per sync, "
          f"decode {1e3 * cost.decode_fixed_s:.2f} ms + {1e3 * cost.decode_per_message_s:.3f} ms "
          f"per rank's message, the drop-in's other sync work {1e3 * cost.sync_overhead_s:.2f} ms")
    print(f"reduce-scatter: one more step message {1e6 * cost.decode_per_step_s:.1f} us to "
          f"parse, "
          f"{1e6 * cost.frame_per_step_s:.1f} us to frame; one more piece "
          f"{1e6 * cost.encode_per_tensor_s:.1f} us to encode; tensor headers "
          f"{cost.tensor_header_bits / 8:.1f} B")
    if cost.rs_down_bits:
        print(f"reduce-scatter owners: {rs_down[0]} at {rs_down[1]:g}, the whole "
              f"layout's message {cost.rs_down_bits / 8e3:.1f} kB, encode "
              f"{1e3 * cost.rs_down_encode_s:.2f} ms, decode "
              f"{1e3 * cost.rs_down_decode_per_message_s:.3f} ms per message")
    print(f"link {args.bandwidth / 1e9:g} Gbit/s, latency {1e6 * args.latency:g} us; compute "
          f"{args.compute_ms:g} ms; hierarchical: {args.gpus_per_node} ranks per node at "
          f"{args.intra_bandwidth / 1e9:g} Gbit/s\n")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "codec": asdict(cost),
                       "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot, f"{args.layout}, p={args.density:g}, "
                              f"{args.bandwidth / 1e9:g} Gbit/s, compute {args.compute_ms:g} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
