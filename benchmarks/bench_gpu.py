"""The GPU check: ``python -m benchmarks.bench gpu [--device cuda|cpu] [--json FILE] [--quick]``.

Needs only torch and numpy (no Horovod, no TensorFlow): every sync runs in ONE process over a
loopback transport (this rank's step message, or given ones, as if gathered from N ranks). The
C kernels are off throughout, so the CPU runs the codec CUDA tensors take (tensor ops, fused).

* correctness (exit 1 on any disagreement): the device codec's step messages byte-identical to
  the numpy reference at p in 1e-4, 1e-3, 1e-2, 5e-2, with the same residual and decoded values;
  8 ranks' messages decoded on the device equal to the reference decode; mutated gathered
  buffers (flipped bytes, truncations, streams corrupted under a fixed CRC) reaching the
  reference's verdict; float16/bfloat16, non-contiguous and channels-last tensors through the
  sync driver; the drop-in optimizer's step message; the reduce-scatter's parts framed on the
  device equal to the host's re-framing;
* host synchronisations per sync step (drop-in and stock hook, each also with the
  reduce-scatter over the proxy's fake Horovod transport): CUDA's own count
  (``torch.cuda.set_sync_debug_mode("warn")``) on cuda, the CPU proxy's counter
  (:mod:`benchmarks.bench_gpu_proxy`) on cpu; CUDA kernels per sync step (``torch.profiler``,
  cuda only);
* speed: encode ms at p = 0.01 and 0.05, decode ms of 8 and 64 messages, one drop-in sync of
  8 ranks, and that sync ÷ one forward+backward (ResNet-50, bf16 autocast on cuda; a tiny conv
  net at batch 8 on cpu, said in ``fwd_bwd``);
* device memory over many syncs (``torch.cuda.max_memory_allocated``; cuda only).

Layouts: ResNet-50's and GPT-2 small's on cuda; every few tensors of each, shrunk, on cpu.
Every JSON field is present (null where this device cannot measure it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from horovod_sbc import kernels, reference, wire
from horovod_sbc.config import SBCConfig
from horovod_sbc.torch.backend import Accumulate, OpsBackend, Targets
from horovod_sbc.torch.sync import Update, synchronize
from horovod_sbc.torch.sync.state import SyncState

from . import bench_gpu_proxy as gp

Layout = List[Tuple[str, Tuple[int, ...]]]
DENSITIES = (1e-4, 1e-3, 1e-2, 5e-2)
STC_DENSITY = 4e-2  # the reduce-scatter owners' default: STC at 4 x p = 0.01
SPEED_DENSITIES = (0.01, 0.05)
RANKS = 8
SUMMARY_KEYS = ("encode_bytes_equal", "decode_ranks_equal", "mutation_verdicts_equal",
                "tensor_kinds_equal", "dropin_step_equal", "regions_parts_equal",
                "host_syncs_dropin", "host_syncs_stock", "host_syncs_dropin_rs",
                "host_syncs_stock_rs", "kernels_dropin", "encode_ms_p01", "encode_ms_p05",
                "decode_ms_8", "decode_ms_64", "sync_ms", "fwd_bwd_ms", "sync_over_fwd_bwd",
                "memory_syncs", "memory_max_allocated", "memory_flat")


# ------------------------------------------------------------------------------------------------
# layouts, data, the loopback transport
# ------------------------------------------------------------------------------------------------
def shrunk(layout: Layout, every: int, div: int) -> Layout:
    """Every ``every``-th tensor of ``layout``, each dimension over 16 divided by ``div``."""
    return [(n, tuple(max(1, d // div) if d > 16 else d for d in s)) for n, s in layout[::every]]


def layouts(device: str) -> Dict[str, Layout]:
    if device == "cuda":
        return {"resnet50": gp.resnet50_layout(), "gpt2": gp.gpt2_layout()}
    return {"resnet50-small": shrunk(gp.resnet50_layout(), 16, 4),
            "gpt2-small": shrunk(gp.gpt2_layout(), 12, 8)}


def numels(layout: Layout) -> List[int]:
    return [wire.layout_numel(s) for _, s in layout]


def host_updates(layout: Layout, seed: int) -> List[np.ndarray]:
    """float32 normal updates, each tensor at its own scale (so either side can win), with
    some exact zeros, negative zeros and ties at the largest value."""
    rng = np.random.default_rng(seed)
    out = []
    for n in numels(layout):
        u = rng.standard_normal(n, dtype=np.float32) * np.float32(np.exp(rng.uniform(-3, 3)))
        if n > 8:
            u[::997], u[5::1009] = np.float32(-0.0), np.float32(0.0)
            u[3::4099] = u.max() if rng.random() < 0.5 else u.min()
        out.append(u)
    return out


class Loopback:
    """A transport of ``size`` ranks, this one rank 0: ``allgather`` returns this rank's step
    followed by ``others`` (device tensors), or ``size`` copies of it; keeps the last step."""

    def __init__(self, size: int, others: Optional[Sequence[torch.Tensor]] = None):
        self.size, self.others, self.last = size, others, None

    def world(self) -> Tuple[int, int]:
        return self.size, 0

    def allgather(self, step: torch.Tensor, tag: str) -> torch.Tensor:
        self.last = step
        if self.others is not None:
            return torch.cat([step, *self.others])
        return gp.fake_gather(gp._active(), step, self.size)


def _bytes(t) -> bytes:
    return bytes(t.detach().cpu().numpy().tobytes()) if isinstance(t, torch.Tensor) else bytes(t)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------
# comparisons (each None when equal, else what differs)
# ------------------------------------------------------------------------------------------------
def diff_bytes(ref: bytes, got: bytes) -> Optional[str]:
    ref, got = bytes(ref), bytes(got)
    if ref == got:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return f"{len(got)} bytes vs the reference's {len(ref)}, first difference at byte {at}"


def diff_arrays(ref: Sequence[np.ndarray], got: Sequence[np.ndarray]) -> Optional[str]:
    """Bit for bit (float32 compared as int32: -0.0 and NaN payloads count)."""
    if len(ref) != len(got):
        return f"{len(got)} tensors vs the reference's {len(ref)}"
    for i, (a, b) in enumerate(zip(ref, got)):
        a, b = np.ascontiguousarray(a).ravel(), np.ascontiguousarray(b).ravel()
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"tensor {i}: {b.dtype}{b.shape} vs the reference's {a.dtype}{a.shape}"
        if a.tobytes() != b.tobytes():
            j = int(np.flatnonzero(a.view(np.uint8) != b.view(np.uint8))[0]) // a.itemsize
            return f"tensor {i} element {j}: {b[j]!r} vs the reference's {a[j]!r}"
    return None


def outcome(fn: Callable[[], Sequence]) -> tuple:
    """A decoder's verdict: ("ok", outputs) or (kind, error type, rank or None, message)."""
    try:
        outs = fn()
    except wire.PeerError as e:
        return ("skip" if e.skip else "error", type(e).__name__, e.rank, e.reason)
    except ValueError as e:
        return ("invalid", type(e).__name__, None, str(e))
    return ("ok", [np.asarray(o) for o in outs])


def diff_outcomes(ref: tuple, got: tuple) -> Optional[str]:
    """Same verdict: both accept with bit-identical sums, or both reject with the same kind,
    error type and rank (the messages are reported, not compared)."""
    if ref[0] != got[0]:
        return f"device {got[0]} ({got[-1] if got[0] != 'ok' else ''}) vs reference {ref[0]} " \
               f"({ref[-1] if ref[0] != 'ok' else ''})"
    if ref[0] == "ok":
        return diff_arrays(ref[1], got[1])
    if ref[1:3] != got[1:3]:
        return f"device {got[1:3]} vs reference {ref[1:3]}"
    return None


def reference_decode(data: bytes, layout: Layout, n_ranks: int, scale: float) -> tuple:
    def run():
        per = reference.decode_step_np(data, layout, n_ranks)
        outs = [np.zeros(n, np.float32) for n in numels(layout)]
        reference.accumulate_np(per, outs, scale)
        return outs
    return outcome(run)


def device_decode(backend, data, layout: Layout, n_ranks: int, scale: float, device: str):
    def run():
        buf = data if isinstance(data, torch.Tensor) else (
            torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
            torch.zeros(0, dtype=torch.uint8)).to(device)
        outs = backend.decode(buf, layout, n_ranks, Targets.new(layout, torch.float32, device),
                              scale)
        return [o.cpu().numpy() for o in outs]
    return outcome(run)


def compare_decode(backend, data: bytes, layout: Layout, n_ranks: int, device: str,
                   scale: Optional[float] = None) -> Optional[str]:
    """The device's decode of a gathered buffer against the reference's (None: same)."""
    scale = 1.0 / n_ranks if scale is None else scale
    return diff_outcomes(reference_decode(data, layout, n_ranks, scale),
                         device_decode(backend, data, layout, n_ranks, scale, device))


# ------------------------------------------------------------------------------------------------
# correctness
# ------------------------------------------------------------------------------------------------
def reference_step(layout: Layout, updates: Sequence[np.ndarray], density: float,
                   accumulate: bool = True, mode: str = "sbc"):
    """(step message, residuals) of the numpy reference; ``accumulate``: each update added to
    a zero residual first, as the sync driver does (``-0.0`` becomes ``+0.0``), else taken
    as it is (the drop-in's ``W - W_ref``)."""
    msgs, res = zip(*(reference.compress_np(u, np.zeros_like(u) if accumulate else None,
                                            density, mode=mode) for u in updates)) \
        if updates else ((), ())
    return wire.step_message_bytes(b"".join(msgs), wire.layout_fingerprint(layout),
                                   len(layout)), list(res)


def device_step(backend, layout: Layout, updates, density: float, device: str,
                mode: str = "sbc"):
    """(step message, residuals after the commit) of the device's fused encoder; ``updates``
    numpy arrays or device tensors (flat float32)."""
    g = [u if isinstance(u, torch.Tensor) else torch.from_numpy(u).to(device) for u in updates]
    res = [torch.zeros_like(x) for x in g]
    fp = wire.layout_fingerprint(layout)
    fs = backend.encode_many([Accumulate(r, x) for r, x in zip(res, g)], density, mode,
                             "paper", [n for n, _ in layout], fp)
    if fs is None:
        raise AssertionError("the device backend did not encode the sync at once (fused)")
    step = fs.frame(fp)
    fs.commit()
    return step, res


def check_encode(backend, name: str, layout: Layout, density: float, device: str,
                 updates: Sequence[np.ndarray], mode: str = "sbc") -> Dict[str, object]:
    ref_step, ref_res = reference_step(layout, updates, density, mode=mode)
    step, res = device_step(backend, layout, updates, density, device, mode)
    d_bytes = diff_bytes(ref_step, _bytes(step))
    d_res = diff_arrays(ref_res, [r.cpu().numpy() for r in res])
    d_dec = compare_decode(backend, ref_step, layout, 1, device, 1.0)
    return {"layout": name, "mode": mode, "density": density, "bytes": len(ref_step),
            "bytes_equal": d_bytes is None, "residual_equal": d_res is None,
            "decoded_equal": d_dec is None, "ok": d_bytes is None and d_res is None and
            d_dec is None, "detail": d_bytes or d_res or d_dec}


def rank_steps(backend, layout: Layout, density: float, device: str, n: int,
               first: Sequence[np.ndarray]) -> List[torch.Tensor]:
    """``n`` ranks' step messages from the device encoder (rank 0 from ``first``, the others
    from device-generated normal updates)."""
    steps = [device_step(backend, layout, first, density, device)[0]]
    for r in range(1, n):
        gen = torch.Generator(device=device).manual_seed(1000 + r)
        ups = [torch.randn(k, generator=gen, device=device) * (0.5 + r) for k in numels(layout)]
        steps.append(device_step(backend, layout, ups, density, device)[0])
        del ups
    return steps


def check_ranks(backend, name: str, layout: Layout, density: float, device: str,
                first) -> Dict[str, object]:
    data = _bytes(torch.cat(rank_steps(backend, layout, density, device, RANKS, first)))
    d = compare_decode(backend, data, layout, RANKS, device)
    return {"layout": name, "density": density, "ranks": RANKS, "bytes": len(data),
            "ok": d is None, "detail": d}


def mutations(steps: Sequence[bytes], layout: Layout) -> List[Tuple[str, bytes]]:
    """(name, gathered buffer) of corrupted versions of the gathered ``steps``."""
    fp, n = wire.layout_fingerprint(layout), len(layout)
    whole = b"".join(steps)
    first = len(steps[0])
    H = wire.STEP_HEADER_SIZE

    def flip(buf: bytes, at: int, mask: int = 0xFF) -> bytes:
        b = bytearray(buf)
        b[at] ^= mask
        return bytes(b)

    def refit(i: int, body_at: int, mask: int) -> bytes:  # a body byte flipped, CRC recomputed
        s = steps[i]
        body = flip(s[H:], body_at % max(1, len(s) - H), mask)
        return b"".join(steps[:i]) + wire.step_message_bytes(body, fp, n) + b"".join(steps[i + 1:])

    out = [("valid", whole)]
    for at, what in ((0, "magic"), (4, "version"), (5, "flags"), (8, "body length"),
                     (12, "layout fingerprint"), (16, "tensor count"), (20, "body CRC")):
        out.append((f"flip {what} (rank 0)", flip(whole, at, 0x01)))
    out += [("flip body first byte", flip(whole, H)),
            ("flip body middle byte (rank 1)", flip(whole, first + H + (len(steps[1]) - H) // 2)),
            ("truncate last byte", whole[:-1]), ("truncate to rank 0", whole[:first]),
            ("truncate inside a header", whole[:first + H // 2]),
            ("one zero byte appended", whole + b"\0")]
    for j, (at, mask) in enumerate(((0, 0x01), (3, 0x80), (7, 0x10), (-1, 0x01), (-5, 0x40),
                                    ("1/2", 0x08), ("1/3", 0x01), ("2/3", 0x80))):
        body = len(steps[j % 2]) - H
        i = body * int(at[0]) // int(at[2]) if isinstance(at, str) else at % body
        out.append((f"body byte {at} ^ {mask:#x}, CRC fixed (rank {j % 2})",
                    refit(j % 2, i, mask)))
    return out


def check_mutations(backend, name: str, layout: Layout, device: str) -> List[Dict[str, object]]:
    ups = host_updates(layout, 7)
    steps = [_bytes(s) for s in rank_steps(backend, layout, 0.01, device, 2, ups)]
    rows = []
    for what, data in mutations(steps, layout):
        ref = reference_decode(data, layout, 2, 0.5)
        got = device_decode(backend, data, layout, 2, 0.5, device)
        d = diff_outcomes(ref, got)
        rows.append({"layout": name, "mutation": what, "reference": ref[0],
                     "reference_error": None if ref[0] == "ok" else f"{ref[1]}: {ref[3]}",
                     "device": got[0], "ok": d is None, "detail": d})
    return rows


def tensor_cases(device: str) -> Dict[str, List[Tuple[str, torch.Tensor]]]:
    """Syncs of unusual tensors, each beside a plain float32 one."""
    g = torch.Generator().manual_seed(3)
    base = ("plain", torch.randn(300, generator=g).to(device))
    w = torch.randn(16, 8, 3, 3, generator=g).to(device)  # the views are made on the device
    m = torch.randn(40, 24, generator=g).to(device)
    return {"float16": [base, ("half", torch.randn(50, 30, generator=g).half().to(device))],
            "bfloat16": [base, ("bf16", torch.randn(64, 9, generator=g).bfloat16().to(device))],
            "non_contiguous": [base, ("transposed", m.t()), ("strided", m[::2, 1::3])],
            "channels_last": [base, ("conv", w.contiguous(memory_format=torch.channels_last))]}


def check_tensor_kinds(device: str, density: float = 0.05) -> List[Dict[str, object]]:
    """Each case through the sync driver (:func:`horovod_sbc.torch.sync.synchronize`) on 2
    loopback ranks: step message and averaged result against the reference."""
    rows = []
    for case, named in tensor_cases(device).items():
        layout = [(n, tuple(t.shape)) for n, t in named]
        ref_step, _ = reference_step(
            layout, [t.detach().float().cpu().numpy().ravel() for _, t in named], density)
        tr = Loopback(2)
        state = SyncState(SBCConfig(density=density), tr, backend=OpsBackend())
        out = synchronize(state, [Update(n, t, tuple(t.shape)) for n, t in named])
        d = diff_bytes(ref_step, _bytes(tr.last)) or diff_outcomes(
            reference_decode(ref_step * 2, layout, 2, 0.5),
            ("ok", [o.cpu().numpy() for o in out]))
        kinds = sorted({str(t.dtype).replace("torch.", "") + (
            "" if t.is_contiguous() else " channels-last" if t.dim() == 4 and
            t.is_contiguous(memory_format=torch.channels_last) else " non-contiguous")
            for _, t in named})
        rows.append({"case": case, "tensors": kinds, "ok": d is None, "detail": d})
    return rows


# ------------------------------------------------------------------------------------------------
# the sync paths on the device (drop-in optimizer, stock hook) over the loopback transport
# ------------------------------------------------------------------------------------------------
class DeviceNoise:
    """One normal pool on the device, rolled per step (as :class:`bench_gpu_proxy.Noise`)."""

    def __init__(self, layout: Layout, device: str, seed: int = 0):
        self.numels = numels(layout)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.pool = torch.randn(max(1, sum(self.numels)), generator=gen, device=device)

    def segments(self, step: int) -> List[torch.Tensor]:
        return list(torch.split(self.pool.roll(7919 * step + 1), self.numels))


def _transport(comp, layout: Layout, size: int, topology: str):
    """The loopback (allgather), or for the reduce-scatter the proxy's fake Horovod transport
    (every rank's parts equal to this one's; the other owners' region messages built aside)."""
    if topology == "allgather":
        comp.transport = Loopback(size)
    else:
        gp._fake_transport(comp, layout, size)
    return comp.transport


def setup_dropin(layout: Layout, density: float, size: int, device: str, noise: DeviceNoise,
                 topology: str = "allgather"):
    """The drop-in optimizer (residual in the weights), a local step moving every weight;
    returns (perturb(step), sync(), transport, params)."""
    from horovod_sbc.torch import SBC, DistributedOptimizer
    named = [(n, torch.nn.Parameter(torch.zeros(s, device=device))) for n, s in layout]
    comp = SBC(density=density, local_residual=True, topology=topology)
    tr = _transport(comp, layout, size, topology)
    opt = DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1),
                               named_parameters=named, compression=comp)
    opt._capture_reference()

    def perturb(step: int) -> None:
        with torch.no_grad():
            for (_, p), x in zip(named, noise.segments(step)):
                p.add_(x.view_as(p), alpha=1e-2)
    return perturb, opt.synchronize, tr, named


def setup_stock(layout: Layout, density: float, size: int, device: str, noise: DeviceNoise,
                topology: str = "allgather"):
    """Stock ``hvd.DistributedOptimizer``'s calls: ``compress`` per gradient, ``decompress``
    per gradient, Horovod's allgather replaced by the loopback."""
    from horovod_sbc.torch import SBC
    named = [(n, torch.nn.Parameter(torch.zeros(s, device=device))) for n, s in layout]
    for _, p in named:
        p.grad = torch.zeros_like(p)
    comp = SBC(density=density, named_parameters=named, topology=topology)
    _transport(comp, layout, size, topology)

    def perturb(step: int) -> None:
        for (_, p), x in zip(named, noise.segments(step)):
            p.grad.copy_(x.view_as(p))

    def sync() -> None:
        for dummy, ctx in [comp.compress(p.grad) for _, p in named]:
            comp.decompress(dummy, ctx)
    return perturb, sync, comp.transport, named


RS = "reduce_scatter"
SETUPS = {"dropin": setup_dropin, "stock": setup_stock,
          "dropin-rs": lambda *a: setup_dropin(*a, topology=RS),
          "stock-rs": lambda *a: setup_stock(*a, topology=RS)}


def check_regions(name: str, layout: Layout, device: str, density: float = 0.01):
    """The reduce-scatter's parts (one step message per region, framed on the device from the
    encoding of the whole sync) against the host's re-framing of the step message."""
    from horovod_sbc.torch.sync import scatter
    p = scatter.plan(tuple((n, tuple(s)) for n, s in layout), RANKS)
    flats = [x.clone() for x in DeviceNoise(layout, device, seed=9).segments(0)]
    srcs = [Accumulate(flats[pc.tensor][pc.start:pc.stop],
                       torch.zeros(pc.stop - pc.start, device=device)) for pc in p.pieces]
    fp = wire.layout_fingerprint(p.layout)
    whole = OpsBackend().encode_many(srcs, density, "sbc", "paper", [n for n, _ in p.layout],
                                     fp)
    detail = "not encoded at once" if whole is None else None
    if whole is not None:
        step = whole.frame(fp)
        host, splits = scatter.region_parts(step, p, 0)
        dev, dev_splits = scatter.region_parts(step, p, 0, whole)
        detail = diff_bytes(_bytes(host), _bytes(dev)) or (
            None if dev_splits == splits else f"splits {dev_splits} != {splits}")
    return {"layout": name, "density": density, "regions": RANKS, "ok": detail is None,
            "detail": detail}


def check_dropin(name: str, layout: Layout, device: str, density: float = 0.01):
    """The drop-in's step message against the reference encode of ``W - W_ref`` (its tensors
    in the drop-in's order: sorted by name)."""
    noise = DeviceNoise(layout, device, seed=5)
    perturb, sync, tr, named = setup_dropin(layout, density, RANKS, device, noise)
    perturb(0)
    order = sorted(range(len(named)), key=lambda i: named[i][0])  # the drop-in's: by name
    upd = [named[i][1].detach().reshape(-1).cpu().numpy().copy() for i in order]  # W_ref = 0
    sync()
    ref_step, _ = reference_step([layout[i] for i in order], upd, density, accumulate=False)
    d = diff_bytes(ref_step, _bytes(tr.last))
    return {"layout": name, "density": density, "ranks": RANKS, "ok": d is None, "detail": d}


def count_host_syncs(path: str, layout: Layout, device: str, steps: int,
                     density: float = 0.01) -> Dict[str, object]:
    """Host synchronisations per sync step (mean, max): CUDA's sync debug warnings on cuda,
    the proxy's reads + synchronous uploads on cpu; CUDA kernels per step on cuda."""
    noise = DeviceNoise(layout, device)
    perturb, sync, _, _ = SETUPS[path](layout, density, RANKS, device, noise)
    perturb(0)
    sync()  # warm-up: one-time allocations, tables
    counts, launches = [], None
    for s in range(1, steps + 1):
        perturb(s)
        _sync(device)
        if device == "cuda":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    sync()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
        else:
            with gp.counting() as c:
                gp._ACTIVE.append(c)
                try:
                    sync()
                finally:
                    gp._ACTIVE.pop()
            counts.append(c.snapshot()["syncs"])
    if device == "cuda":
        launches = count_kernels(lambda: (perturb(steps + 1), _sync(device))[0], sync)
    return {"path": path, "steps": steps, "mean": statistics.mean(counts), "max": max(counts),
            "kernels": launches}


def count_kernels(prepare: Callable[[], None], sync: Callable[[], None]) -> Optional[int]:
    """CUDA kernels (and memcpy/memset) of one ``sync()`` seen by ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile
    prepare()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sync()
            torch.cuda.synchronize()
        cuda = torch.autograd.DeviceType.CUDA
        events = list(prof.events())
        on_device = sum(1 for e in events if e.device_type == cuda)
        # a profiler that keeps no device events still shows the runtime's launch calls
        return on_device or sum(1 for e in events if "LaunchKernel" in e.name or
                                e.name.startswith(("cudaMemcpy", "cudaMemset")))
    except Exception as e:  # a profiler that cannot run here: report null, say why
        print(f"kernel count unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return None


# ------------------------------------------------------------------------------------------------
# speed and memory
# ------------------------------------------------------------------------------------------------
def timed_ms(fn: Callable[[], object], device: str, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def speed(backend, layout: Layout, device: str, reps: int) -> Dict[str, object]:
    fp = wire.layout_fingerprint(layout)
    gen = torch.Generator(device=device).manual_seed(11)
    g = [torch.randn(k, generator=gen, device=device) for k in numels(layout)]
    res = [torch.zeros_like(x) for x in g]
    names = [n for n, _ in layout]
    out: Dict[str, object] = {"encode_ms": {}, "decode_ms": {}}

    def encode(d):
        fs = backend.encode_many([Accumulate(r, x) for r, x in zip(res, g)], d, "sbc", "paper",
                                 names, fp)
        step = fs.frame(fp)
        fs.commit()
        return step

    for d in SPEED_DENSITIES:
        out["encode_ms"][str(d)] = timed_ms(lambda: encode(d), device, reps)
    steps = [encode(SPEED_DENSITIES[0]) for _ in range(RANKS)]  # 8 successive syncs' messages
    targets = Targets.add([torch.zeros(k, device=device) for k in numels(layout)])
    for n in (8, 64):
        gathered = torch.cat(steps * (n // RANKS))
        out["decode_ms"][str(n)] = timed_ms(
            lambda: backend.decode(gathered, layout, n, targets, 1.0 / n), device, reps)
        del gathered
    noise = DeviceNoise(layout, device)
    perturb, sync, _, _ = setup_dropin(layout, SPEED_DENSITIES[0], RANKS, device, noise)
    i = [0]

    def one_sync():
        i[0] += 1
        perturb(i[0])
        _sync(device)
        t0 = time.perf_counter()
        sync()
        _sync(device)
        return 1e3 * (time.perf_counter() - t0)
    one_sync()
    out["sync_ms"] = statistics.median([one_sync() for _ in range(reps)])
    return out


class TinyConvNet(torch.nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32),
            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
            torch.nn.Linear(32, classes))

    def forward(self, x):
        return self.body(x)


def fwd_bwd(device: str, reps: int) -> Dict[str, object]:
    """ms of one forward+backward: ResNet-50 under bf16 autocast on cuda (torchvision), else a
    tiny conv net at batch 8 (float32)."""
    tv = None
    if device == "cuda":
        try:
            import torchvision as tv
        except Exception:  # no torchvision: the small net, said in the JSON
            tv = None
    if tv is not None:
        model = tv.models.resnet50().to(device, memory_format=torch.channels_last)
        batch, size, name, dtype = 64, 224, "torchvision resnet50", "bfloat16 autocast"
    else:
        model = TinyConvNet().to(device)
        batch, size, name, dtype = 8, 32, "tiny conv net (2 conv layers)", "float32"
    x = torch.randn(batch, 3, size, size, device=device)
    if tv is not None:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        model.zero_grad(set_to_none=True)
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if tv is not None else \
            contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(x), y)
        loss.backward()
    ms = timed_ms(step, device, reps, warmup=2)
    del model, x
    return {"model": name, "batch": batch, "image_size": size, "dtype": dtype, "ms": ms}


def memory(layout: Layout, device: str, first: int, total: int) -> Dict[str, object]:
    """``torch.cuda.max_memory_allocated`` after ``first`` and after ``total`` drop-in syncs
    (8 ranks, p = 0.01); flat: grown by at most max(1 MiB, 0.5 %)."""
    row = {"syncs": [first, total], "max_allocated": None, "flat": None}
    if device != "cuda":
        return row
    noise = DeviceNoise(layout, device)
    perturb, sync, _, _ = setup_dropin(layout, 0.01, RANKS, device, noise)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    peaks = []
    for s in range(total):
        perturb(s)
        sync()
        if s + 1 in (first, total):
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
    row["max_allocated"] = peaks
    row["flat"] = peaks[1] - peaks[0] <= max(1 << 20, peaks[0] // 200)
    return row


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
def run(device: str, quick: bool = False, progress: bool = True) -> Dict[str, object]:
    t_start = time.perf_counter()
    say = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    backend = OpsBackend()
    lays = layouts(device)
    first_name = next(iter(lays))
    corr: Dict[str, list] = {"encode": [], "decode_ranks": [], "mutations": [],
                             "tensor_kinds": [], "dropin": [], "regions": []}
    rank_densities = (1e-3, 1e-2) if device == "cuda" else DENSITIES
    for name, layout in lays.items():
        ups = host_updates(layout, 0)
        for mode, d in [("sbc", d) for d in DENSITIES] + [("stc", STC_DENSITY)]:
            corr["encode"].append(check_encode(backend, name, layout, d, device, ups, mode))
            say(f"encode {mode} {name} p={d:g}: "
                f"{'ok' if corr['encode'][-1]['ok'] else 'DIFFERS'}")
        for d in rank_densities if name == first_name or not quick else rank_densities[-1:]:
            corr["decode_ranks"].append(check_ranks(backend, name, layout, d, device, ups))
            say(f"decode {RANKS} ranks {name} p={d:g}: "
                f"{'ok' if corr['decode_ranks'][-1]['ok'] else 'DIFFERS'}")
        del ups
        corr["dropin"].append(check_dropin(name, layout, device))
        corr["regions"].append(check_regions(name, layout, device))
    small = layouts("cpu")
    corr["mutations"] = check_mutations(backend, "resnet50-small", small["resnet50-small"], device)
    corr["tensor_kinds"] = check_tensor_kinds(device)
    say(f"mutations: {sum(r['ok'] for r in corr['mutations'])}/{len(corr['mutations'])} agree; "
        f"tensor kinds: {sum(r['ok'] for r in corr['tensor_kinds'])}/"
        f"{len(corr['tensor_kinds'])} equal")

    steps = 2 if quick else 3
    host = {f"{path}/{name}": count_host_syncs(path, layout, device, steps)
            for path in SETUPS for name, layout in lays.items()}
    say("host syncs per step: " + ", ".join(f"{k} {v['mean']:g}" for k, v in host.items()))
    reps = 3 if quick else 10
    spd = {name: speed(backend, layout, device, reps) for name, layout in lays.items()}
    fb = fwd_bwd(device, reps)
    for s in spd.values():
        s["sync_over_fwd_bwd"] = s["sync_ms"] / fb["ms"]
    mem = memory(lays[first_name], device, *((20, 100) if quick else (100, 1000)))

    failures = [f"encode {r['layout']} p={r['density']:g}: {r['detail']}"
                for r in corr["encode"] if not r["ok"]]
    failures += [f"decode {r['ranks']} ranks {r['layout']} p={r['density']:g}: {r['detail']}"
                 for r in corr["decode_ranks"] if not r["ok"]]
    failures += [f"mutation {r['mutation']}: {r['detail']}" for r in corr["mutations"]
                 if not r["ok"]]
    failures += [f"{r['case']}: {r['detail']}" for r in corr["tensor_kinds"] if not r["ok"]]
    failures += [f"drop-in step {r['layout']}: {r['detail']}" for r in corr["dropin"]
                 if not r["ok"]]
    failures += [f"reduce-scatter parts {r['layout']}: {r['detail']}" for r in corr["regions"]
                 if not r["ok"]]
    if mem["flat"] is False:
        failures.append(f"device memory grew over {mem['syncs']} syncs: {mem['max_allocated']}")
    corr["all_ok"] = not failures

    s0, h0 = spd[first_name], host
    summary = {
        "encode_bytes_equal": all(r["bytes_equal"] and r["residual_equal"] and
                                  r["decoded_equal"] for r in corr["encode"]),
        "decode_ranks_equal": all(r["ok"] for r in corr["decode_ranks"]),
        "mutation_verdicts_equal": all(r["ok"] for r in corr["mutations"]),
        "tensor_kinds_equal": all(r["ok"] for r in corr["tensor_kinds"]),
        "dropin_step_equal": all(r["ok"] for r in corr["dropin"]),
        "regions_parts_equal": all(r["ok"] for r in corr["regions"]),
        "host_syncs_dropin": h0[f"dropin/{first_name}"]["max"],
        "host_syncs_stock": h0[f"stock/{first_name}"]["max"],
        "host_syncs_dropin_rs": h0[f"dropin-rs/{first_name}"]["max"],
        "host_syncs_stock_rs": h0[f"stock-rs/{first_name}"]["max"],
        "kernels_dropin": h0[f"dropin/{first_name}"]["kernels"],
        "encode_ms_p01": s0["encode_ms"]["0.01"], "encode_ms_p05": s0["encode_ms"]["0.05"],
        "decode_ms_8": s0["decode_ms"]["8"], "decode_ms_64": s0["decode_ms"]["64"],
        "sync_ms": s0["sync_ms"], "fwd_bwd_ms": fb["ms"],
        "sync_over_fwd_bwd": s0["sync_over_fwd_bwd"], "memory_syncs": mem["syncs"],
        "memory_max_allocated": mem["max_allocated"], "memory_flat": mem["flat"]}
    return {
        "device": device, "device_name": torch.cuda.get_device_name() if device == "cuda"
        else platform.processor() or platform.machine(), "torch": torch.__version__,
        "numpy": np.__version__, "quick": quick, "backend": repr(backend),
        "layouts": {n: {"tensors": len(l), "elements": sum(numels(l))} for n, l in lays.items()},
        "summary": summary, "correctness": corr,
        "host_syncs": {"method": "torch.cuda.set_sync_debug_mode('warn') warnings"
                       if device == "cuda" else "CPU proxy counter (benchmarks.bench_gpu_proxy:"
                       " host reads + synchronous uploads)", "ranks": RANKS, "density": 0.01,
                       "per_path": host},
        "kernels_per_sync": {k: v["kernels"] for k, v in host.items()},
        "speed": {"ranks": RANKS, "reps": reps, "layouts": spd},
        "fwd_bwd": fb, "memory": mem, "failures": failures, "ok": not failures,
        "wall_s": round(time.perf_counter() - t_start, 1)}


def _fmt(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_table(res: Dict[str, object]) -> None:
    print(f"\nGPU check on {res['device']} ({res['device_name']}), torch {res['torch']}, "
          f"{res['backend']}; layouts: " + ", ".join(
              f"{n} ({v['tensors']} tensors, {v['elements']:,} elements)"
              for n, v in res["layouts"].items()))
    for k in SUMMARY_KEYS:
        print(f"  {k:<26}{_fmt(res['summary'][k])}")
    for name, s in res["speed"]["layouts"].items():
        print(f"  {name}: encode ms "
              + ", ".join(f"p={p} {v:.3g}" for p, v in s["encode_ms"].items())
              + "; decode ms " + ", ".join(f"{n} msgs {v:.3g}" for n, v in s["decode_ms"].items())
              + f"; drop-in sync of {RANKS} ranks {s['sync_ms']:.3g} ms "
              f"(÷ fwd+bwd {s['sync_over_fwd_bwd']:.3g})")
    print(f"  fwd+bwd: {res['fwd_bwd']['model']}, batch {res['fwd_bwd']['batch']}, "
          f"{res['fwd_bwd']['dtype']}: {res['fwd_bwd']['ms']:.3g} ms")
    for f in res["failures"]:
        print(f"  DISAGREES: {f}")
    print("all checks agree" if res["ok"] else f"{len(res['failures'])} disagreement(s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and syncs")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on cpu")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    with kernels.disabled():
        res = run(args.device, args.quick)
    res["command"] = " ".join(["python -m benchmarks.bench gpu"] +
                              list(sys.argv[1:] if argv is None else argv))
    print_table(res)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
