"""What one sync step would cost a GPU, counted on a CPU: ``python -m benchmarks.bench gpu-proxy``.

On CUDA tensors the C kernels do not run; the tensor-op codec does (the path
``HOROVOD_SBC_KERNELS=0`` selects on a CPU). There every dispatched aten op is a kernel launch
(host time), and every read of tensor data by the host is a device synchronisation. This
benchmark runs that path on the CPU (the kernels switched off with
:func:`horovod_sbc.kernels.disabled`) and counts, per sync step:

* ``ops``: aten ops dispatched (a :class:`TorchDispatchMode` sees each one); ``kernels``: those
  that are not mere views (``view``, ``reshape``, ``slice``, ``split``, ...: no kernel launch);
* ``reads``: host reads of tensor data, device to host: ``aten::_local_scalar_dense``
  (``item()``, ``bool()``, ``int()``, ``float()``), ``aten::nonzero``, ``aten::masked_select``,
  ``aten::unique*``, boolean-mask ``aten::index``/``index_put``, ``repeat_interleave`` without
  ``output_size``, plus the Python-level reads that do not dispatch (``Tensor.tolist``,
  ``Tensor.numpy``), each counted once however it is implemented underneath;
* ``uploads``: tensors made from host data (``torch.tensor``, ``as_tensor``, ``frombuffer``,
  ``from_numpy``) outside :func:`horovod_sbc.torch.backend.transfer.upload`: on CUDA each
  becomes a host-to-device copy, which PyTorch makes synchronous for pageable memory (it waits
  for the stream);
* ``async_uploads``: calls of :func:`~horovod_sbc.torch.backend.transfer.upload`, which on
  CUDA copies from pinned memory with ``non_blocking=True`` (queued on the stream, no wait);
* ``syncs = reads + uploads``: what would stall the device.

Paths, all in ONE process with a fake collective that returns this rank's step message as if
gathered from N ranks (its own work is not counted; the collective calls are, as
``collectives``):

* ``dropin``: :func:`horovod_sbc.torch.DistributedOptimizer`'s ``synchronize()`` (weights moved
  by a simulated local step; the residual in the weights, ``local_residual=True``: the default
  at delay > 1 and with Adam); ``dropin-shared``: the same with the residual beside the shared
  weights (the default for SGD at delay 1);
* ``stock``: stock ``hvd.DistributedOptimizer(compression=SBC(...))`` as Horovod drives it:
  ``SBC.compress`` per gradient in the backward pass, then ``decompress`` per gradient in
  ``synchronize()``; Horovod's allgather replaced by the fake;
* ``ddp``: :func:`horovod_sbc.torch.ddp.sbc_hook` on DDP-style buckets (reverse parameter
  order, 1 MiB first bucket, then 25 MiB), called for every bucket before the futures are
  waited for, as DDP does, through the real
  :class:`~horovod_sbc.torch.sync.transport.ProcessGroupTransport` over a fake all-gather;
* ``dropin-fixed``, ``stock-fixed``: the same with ``SBC(fixed_size=True)``; the DDP hook pads
  by default (``fixed_size=None``: its all-gather needs one size from every rank), and
  ``ddp-variable`` is the DDP hook with ``SBC(fixed_size=False)`` (the lengths exchanged first).

Layouts: ResNet-50's 161 parameter tensors and GPT-2 small's 148 (built here from their
architectures, no torchvision or transformers needed).

The tensor-op backend takes the same branches on the CPU as on CUDA (it adds each rank's
decoded positions with one ``index_add_`` per rank on every device), so the counts are those a
CUDA run dispatches.

Counts are deterministic (fixed seeds), so a few steps per cell suffice; the wall time of a cell
is that of the counting mode and says nothing about speed.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import json
import os
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Shape = Tuple[int, ...]
LAYOUTS = ("resnet50", "gpt2")
PATHS = ("dropin", "stock", "ddp", "dropin-fixed", "stock-fixed", "ddp-variable", "dropin-rs", "stock-rs",
         "dropin-shared")
DENSITIES = (1e-4, 1e-3, 1e-2, 5e-2)
RANKS = (2, 8)


# ------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------
def resnet50_layout() -> List[Tuple[str, Shape]]:
    """torchvision's ResNet-50 parameters in ``named_parameters()`` order (161 tensors)."""
    out = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for li, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), 1):
        for b in range(blocks):
            pre = f"layer{li}.{b}."
            convs = [(planes, inplanes, 1, 1), (planes, planes, 3, 3), (planes * 4, planes, 1, 1)]
            for ci, shape in enumerate(convs, 1):
                out += [(f"{pre}conv{ci}.weight", shape), (f"{pre}bn{ci}.weight", (shape[0],)),
                        (f"{pre}bn{ci}.bias", (shape[0],))]
            if b == 0:
                out += [(f"{pre}downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                        (f"{pre}downsample.1.weight", (planes * 4,)),
                        (f"{pre}downsample.1.bias", (planes * 4,))]
            inplanes = planes * 4
    return out + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def gpt2_layout() -> List[Tuple[str, Shape]]:
    """GPT-2 small's parameters (Hugging Face ``GPT2LMHeadModel``, the LM head tied to
    ``wte``): 148 tensors."""
    d = 768
    out = [("transformer.wte.weight", (50257, d)), ("transformer.wpe.weight", (1024, d))]
    for i in range(12):
        pre = f"transformer.h.{i}."
        out += [(pre + "ln_1.weight", (d,)), (pre + "ln_1.bias", (d,)),
                (pre + "attn.c_attn.weight", (d, 3 * d)), (pre + "attn.c_attn.bias", (3 * d,)),
                (pre + "attn.c_proj.weight", (d, d)), (pre + "attn.c_proj.bias", (d,)),
                (pre + "ln_2.weight", (d,)), (pre + "ln_2.bias", (d,)),
                (pre + "mlp.c_fc.weight", (d, 4 * d)), (pre + "mlp.c_fc.bias", (4 * d,)),
                (pre + "mlp.c_proj.weight", (4 * d, d)), (pre + "mlp.c_proj.bias", (d,))]
    return out + [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]


def synthetic_layout(n_tensors: int, numel: int = 4096) -> List[Tuple[str, Shape]]:
    """``n_tensors`` tensors of ``numel`` elements (for checks that vary only the count)."""
    return [(f"t{i:04d}", (numel,)) for i in range(n_tensors)]


def layout(name: str) -> List[Tuple[str, Shape]]:
    """``"resnet50"``, ``"gpt2"`` or ``"synthetic<N>"`` (N tensors of 4096 elements)."""
    if name == "resnet50":
        return resnet50_layout()
    if name == "gpt2":
        return gpt2_layout()
    if name.startswith("synthetic") and name[len("synthetic"):].isdigit():
        return synthetic_layout(int(name[len("synthetic"):]))
    raise ValueError(f"unknown layout {name!r}; one of {LAYOUTS} or synthetic<N>")


# ------------------------------------------------------------------------------------------------
# counting
# ------------------------------------------------------------------------------------------------
_READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
             "unique_dim", "unique_consecutive"}
# ops that only make a new view of existing memory: dispatched, but no kernel on a GPU
_VIEW_OPS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "alias",
             "detach", "slice", "select", "split", "split_with_sizes", "expand", "t",
             "permute", "squeeze", "unsqueeze", "transpose", "unbind", "narrow", "lift_fresh",
             "view_as_real", "_to_copy_view"}
_PY_READS = ("tolist", "numpy")
_PY_SCALARS = ("item", "__bool__", "__int__", "__float__", "__index__")
_UPLOADS = ("tensor", "as_tensor", "frombuffer", "from_numpy")


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def host_read_kind(func, args, kwargs) -> str:
    """The kind of host read an aten call is ('' for none)."""
    name = func.overloadpacket.__name__
    if name in _READ_OPS:
        return name
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1 \
            and _bool_index(args[1]):
        return name + "[bool]"
    if name == "repeat_interleave" and kwargs.get("output_size") is None and \
            isinstance(args[0], torch.Tensor) and func._overloadname == "Tensor":
        return "repeat_interleave"
    return ""


class Counter(TorchDispatchMode):
    """Counts dispatched aten ops and host reads (see the module docstring) while active.

    :meth:`paused` excludes work (the fake collective's); Python-level reads count once and
    silence the reads dispatched inside them."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.views = 0
        self.reads: Dict[str, int] = collections.Counter()
        self.uploads = 0
        self.async_uploads = 0
        self._in_async = 0
        self.collectives = 0
        self.by_op: Dict[str, int] = collections.Counter()
        self._pause = 0
        self._inside_read = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._pause:
            self.ops += 1
            name = func.overloadpacket.__name__
            self.by_op[name] += 1
            self.views += name in _VIEW_OPS
            kind = host_read_kind(func, args, kwargs)
            if kind and not self._inside_read:
                self.reads[kind] += 1
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def paused(self):
        self._pause += 1
        try:
            yield
        finally:
            self._pause -= 1

    def snapshot(self) -> Dict[str, object]:
        reads = sum(self.reads.values())
        return {"ops": self.ops, "kernels": self.ops - self.views, "reads": reads,
                "uploads": self.uploads, "async_uploads": self.async_uploads,
                "syncs": reads + self.uploads,
                "collectives": self.collectives, "reads_by_kind": dict(self.reads)}


def _wrap_read(counter: Counter, orig, kind: str):
    def wrapped(*a, **kw):
        if counter._pause or counter._inside_read:
            return orig(*a, **kw)
        counter.reads[kind] += 1
        counter._inside_read += 1
        try:
            return orig(*a, **kw)
        finally:
            counter._inside_read -= 1
    return wrapped


def _wrap_async_upload(counter: Counter, orig):
    def wrapped(*a, **kw):
        if counter._pause or counter._inside_read:
            return orig(*a, **kw)
        counter.async_uploads += 1
        counter._in_async += 1  # its own tensor from host data is not a blocking upload
        try:
            return orig(*a, **kw)
        finally:
            counter._in_async -= 1
    return wrapped


def _wrap_upload(counter: Counter, orig):
    def wrapped(*a, **kw):
        if not counter._pause and not counter._inside_read and not counter._in_async:
            counter.uploads += 1
        return orig(*a, **kw)
    return wrapped


@contextlib.contextmanager
def counting():
    """A :class:`Counter` active for the block: the dispatch mode plus the Python-level wraps of
    ``Tensor.tolist/numpy/item/__bool__/__int__/__float__/__index__``, of the tensor
    constructors from host data and of :func:`horovod_sbc.torch.backend.transfer.upload`
    (restored afterwards)."""
    c = Counter()
    saved = []
    for name in _PY_READS + _PY_SCALARS:
        orig = getattr(torch.Tensor, name)
        saved.append((torch.Tensor, name, orig))
        setattr(torch.Tensor, name, _wrap_read(c, orig, name.strip("_")))
    for name in _UPLOADS:
        orig = getattr(torch, name)
        saved.append((torch, name, orig))
        setattr(torch, name, _wrap_upload(c, orig))
    from horovod_sbc.torch.backend import transfer
    saved.append((transfer, "upload", transfer.upload))
    transfer.upload = _wrap_async_upload(c, transfer.upload)
    try:
        with c:
            yield c
    finally:
        for owner, name, orig in saved:
            setattr(owner, name, orig)


# ------------------------------------------------------------------------------------------------
# fake collectives
# ------------------------------------------------------------------------------------------------
class FakeHorovodTransport:
    """:class:`~horovod_sbc.torch.sync.transport.HorovodTransport`'s interface: rank 0 of
    ``size``, every rank's message equal to this one's."""

    def __init__(self, size: int, counter_ref: Callable[[], Counter]):
        self.size = size
        self._counter = counter_ref

    def world(self) -> Tuple[int, int]:
        return self.size, 0

    def allgather(self, step: torch.Tensor, tag: str) -> torch.Tensor:
        if tag.endswith(".regions"):  # the reduce-scatter's region messages: every owner's
            return self._regions(step)
        return fake_gather(self._counter(), step, self.size)

    def alltoall(self, buf: torch.Tensor, splits, tag: str) -> torch.Tensor:
        """Every rank sends this one what this rank sends its region 0 (kept, for the other
        owners' region messages, which :meth:`_regions` makes uncounted)."""
        self._parts = (buf, list(splits))
        counter = self._counter()
        if counter is not None:
            counter.collectives += 1
        with _uncounted(counter):
            return buf[:splits[0]].repeat(self.size)

    def _regions(self, mine: torch.Tensor) -> torch.Tensor:
        """Rank 0's region message and, uncounted, every other owner's for the same parts."""
        from horovod_sbc.torch.sync import scatter
        from horovod_sbc.torch.sync.state import SyncState
        counter = self._counter()
        if counter is not None:
            counter.collectives += 1
        with _uncounted(counter):
            buf, splits = self._parts
            offs = [sum(splits[:r]) for r in range(self.size + 1)]
            if not hasattr(self, "_owners"):
                self._owners = [SyncState(self.config, self) for _ in range(self.size)]
            out = [mine]
            for r in range(1, self.size):
                st = self._owners[r]
                parts = buf[offs[r]:offs[r + 1]].repeat(self.size)
                out.append(scatter.owner_step(st, parts, self.plan, r, 1.0 / self.size,
                                              torch.float32, buf.device).step)
            return torch.cat(out)


@contextlib.contextmanager
def _uncounted(counter):
    """The fake collective's own work: paused in ``counter`` (if any) and, where the GPU check
    counts CUDA's synchronisation warnings, with those warnings off."""
    cuda_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    with counter.paused() if counter is not None else contextlib.nullcontext():
        if cuda_mode:
            torch.cuda.set_sync_debug_mode(0)
        try:
            yield
        finally:
            if cuda_mode:
                torch.cuda.set_sync_debug_mode(cuda_mode)


def fake_gather(counter, step: torch.Tensor, size: int) -> torch.Tensor:
    """``size`` copies of ``step`` concatenated, as one collective call (not its ops)."""
    if counter is None:
        return step.repeat(size)
    counter.collectives += 1
    with counter.paused():
        return step.repeat(size)


def fake_process_group_transport(size: int, counter_ref: Callable[[], Counter]):
    """A :class:`~horovod_sbc.torch.sync.transport.ProcessGroupTransport` whose all-gather
    copies this rank's input ``size`` times (its own length exchange and host read run for
    real)."""
    from horovod_sbc.torch.sync.transport import ProcessGroupTransport

    class _Fake(ProcessGroupTransport):
        def world(self):
            return size, 0

        def _all_gather(self, out, inp):
            counter = counter_ref()
            if counter is not None:
                counter.collectives += 1
            with counter.paused() if counter is not None else contextlib.nullcontext():
                out.copy_(inp.repeat(size))
    return _Fake()


_ACTIVE: List[Counter] = []


def _active():
    return _ACTIVE[-1] if _ACTIVE else None


# ------------------------------------------------------------------------------------------------
# the paths: each returns (perturb(step), sync_step())
# ------------------------------------------------------------------------------------------------
class Noise:
    """Deterministic updates: one standard normal pool per layout, rolled per step."""

    def __init__(self, shapes: Sequence[Tuple[str, Shape]], seed: int = 0):
        self.numels = [_numel(s) for _, s in shapes]
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(max(1, sum(self.numels)), generator=g)

    def segments(self, step: int) -> List[torch.Tensor]:
        rolled = self.pool.roll(7919 * step + 1)
        return list(torch.split(rolled[:sum(self.numels)], self.numels))


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _params(shapes):
    return [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in shapes]


def _fake_transport(comp, shapes, size: int) -> None:
    """``comp``'s transport: the fake Horovod one (knowing, for the reduce-scatter, the
    regions of the layout)."""
    from horovod_sbc.torch.sync import scatter
    comp.transport = FakeHorovodTransport(size, _active)
    comp.transport.config = comp.config
    comp.transport.plan = scatter.plan(tuple(sorted((n, tuple(s)) for n, s in shapes)), size)


def setup_dropin(shapes, density: float, size: int, noise: Noise, fixed=None,
                 local_residual: bool = True, topology: str = "allgather"):
    """The drop-in optimizer (residual in the weights, or beside the shared weights with
    ``local_residual=False``); a local step moves every weight. ``fixed``:
    ``SBC(fixed_size=True)``."""
    from horovod_sbc.torch import SBC, DistributedOptimizer
    named = _params(shapes)
    comp = SBC(density=density, fixed_size=fixed, topology=topology,
               local_residual=local_residual)
    _fake_transport(comp, shapes, size)
    opt = DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1),
                               named_parameters=named, compression=comp)
    opt._capture_reference()

    def perturb(step: int) -> None:
        with torch.no_grad():
            for (_, p), g in zip(named, noise.segments(step)):
                p.add_(g.view_as(p), alpha=1e-2)
    return perturb, opt.synchronize


def setup_stock(shapes, density: float, size: int, noise: Noise, fixed=None,
                topology: str = "allgather"):
    """Stock ``hvd.DistributedOptimizer``'s calls: ``compress`` per gradient (backward), then
    per gradient the allreduce of its placeholder (a collective) and ``decompress``.
    ``fixed``: ``SBC(fixed_size=True)``."""
    from horovod_sbc.torch import SBC
    named = _params(shapes)
    for _, p in named:
        p.grad = torch.zeros_like(p)
    comp = SBC(density=density, named_parameters=named, fixed_size=fixed, topology=topology)
    _fake_transport(comp, shapes, size)

    def perturb(step: int) -> None:
        for (_, p), g in zip(named, noise.segments(step)):
            p.grad.copy_(g.view_as(p))

    def sync_step() -> None:
        ctxs = [comp.compress(p.grad) for _, p in named]
        for dummy, ctx in ctxs:
            c = _active()
            if c is not None:
                c.collectives += 1  # Horovod's allreduce of the placeholder
            comp.decompress(dummy, ctx)
    return perturb, sync_step


class FakeBucket:
    """The parts of ``torch.distributed.GradBucket`` that :func:`sbc_hook` reads."""

    def __init__(self, index: int, params: List[torch.Tensor], last: bool):
        self._index, self._params, self._last = index, params, last
        self._buf = torch.zeros(sum(p.numel() for p in params))
        self._grads = [v.view_as(p) for v, p in
                       zip(torch.split(self._buf, [p.numel() for p in params]), params)]

    def buffer(self):
        return self._buf

    def parameters(self):
        return self._params

    def gradients(self):
        return self._grads

    def index(self):
        return self._index

    def is_last(self):
        return self._last


def ddp_buckets(named, first_cap: int = 1 << 20, cap: int = 25 << 20) -> List[List[int]]:
    """DDP's default bucket assignment by size: parameters in reverse order, a bucket closed
    once it holds ``first_cap`` bytes (the first) or ``cap`` bytes (the others)."""
    buckets, cur, nbytes = [], [], 0
    for i in reversed(range(len(named))):
        cur.append(i)
        nbytes += 4 * named[i][1].numel()
        if nbytes >= (first_cap if not buckets else cap):
            buckets.append(cur)
            cur, nbytes = [], 0
    return buckets + ([cur] if cur else [])


def setup_ddp(shapes, density: float, size: int, noise: Noise, fixed=None):
    """:func:`sbc_hook` over every bucket of a backward pass (granularity ``"parameter"``).
    ``fixed``: ``SBC(fixed_size=fixed)``; the default pads (the transport exchanges no
    lengths), ``False`` exchanges the lengths first."""
    from horovod_sbc.torch import SBC
    from horovod_sbc.torch.ddp import SBCState, sbc_hook
    named = _params(shapes)
    state = SBCState(named, compression=SBC(density=density, fixed_size=fixed))
    fake = fake_process_group_transport(size, _active)
    fake.equal_sizes = state.compression.config.padded(True)
    state.transport = state.compression.transport = fake
    groups = ddp_buckets(named)
    buckets = [FakeBucket(b, [named[i][1] for i in idx], b == len(groups) - 1)
               for b, idx in enumerate(groups)]
    where = {i: (b, j) for b, idx in enumerate(groups) for j, i in enumerate(idx)}

    def perturb(step: int) -> None:
        for i, g in enumerate(noise.segments(step)):
            b, j = where[i]
            buckets[b].gradients()[j].copy_(g.view_as(named[i][1]))

    def sync_step() -> None:  # as DDP does: every bucket's hook, then wait for the futures
        for fut in [sbc_hook(state, bucket) for bucket in buckets]:
            fut.wait()
    return perturb, sync_step


SETUPS = {"dropin": setup_dropin, "stock": setup_stock, "ddp": setup_ddp,
          "dropin-fixed": functools.partial(setup_dropin, fixed=True),
          "stock-fixed": functools.partial(setup_stock, fixed=True),
          "ddp-variable": functools.partial(setup_ddp, fixed=False),
          "dropin-shared": functools.partial(setup_dropin, local_residual=False),
          "dropin-rs": functools.partial(setup_dropin, topology="reduce_scatter"),
          "stock-rs": functools.partial(setup_stock, topology="reduce_scatter")}


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
def run_cell(layout_name: str, shapes, path: str, size: int, density: float, noise: Noise,
             steps: int = 2, warmup: int = 1) -> Dict[str, object]:
    """Counts of ``steps`` sync steps (after ``warmup`` uncounted ones) of one path, with the
    C kernels off; per step and their mean."""
    from horovod_sbc import kernels
    t0 = time.perf_counter()
    with kernels.disabled():
        if kernels.lib() is not None:
            raise AssertionError("the C kernels are still on: the counts would not be the "
                                 "tensor-op path's")
        perturb, sync_step = SETUPS[path](shapes, density, size, noise)
        per_step = []
        for s in range(warmup + steps):
            perturb(s)
            if s < warmup:
                sync_step()
                continue
            with counting() as c:
                _ACTIVE.append(c)
                try:
                    sync_step()
                finally:
                    _ACTIVE.pop()
            per_step.append(c.snapshot())
    del perturb, sync_step
    gc.collect()
    row = {"layout": layout_name, "path": path, "ranks": size, "density": density,
           "tensors": len(shapes), "steps": steps}
    for key in ("ops", "kernels", "reads", "uploads", "async_uploads", "syncs", "collectives"):
        row[key] = sum(p[key] for p in per_step) / max(1, steps)
        row[key + "_max"] = max(p[key] for p in per_step) if per_step else 0
    kinds = collections.Counter()
    for p in per_step:
        kinds.update(p["reads_by_kind"])
    row["reads_by_kind"] = {k: v / max(1, steps) for k, v in sorted(kinds.items())}
    row["per_step"] = per_step
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def run(layouts=LAYOUTS, paths=PATHS, ranks=RANKS, densities=DENSITIES, steps: int = 2,
        warmup: int = 1, progress: bool = True) -> Dict[str, object]:
    cells = []
    for name in layouts:
        shapes = layout(name)
        noise = Noise(shapes)
        for path in paths:
            for size in ranks:
                for d in densities:
                    row = run_cell(name, shapes, path, size, d, noise, steps, warmup)
                    cells.append(row)
                    if progress:
                        print(_line(row), flush=True)
        del noise
        gc.collect()
    return {"cells": cells, "settings": {"layouts": list(layouts), "paths": list(paths),
                                         "ranks": list(ranks), "densities": list(densities),
                                         "steps": steps, "warmup": warmup,
                                         "kernels": "off (tensor-op path)"}}


COLUMNS = ("layout", "path", "ranks", "density", "tensors", "ops", "kernels", "reads", "uploads",
           "async_uploads",
           "syncs", "collectives")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:g}" if v < 1 or v != int(v) else f"{int(v):,}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _line(row) -> str:
    return "  ".join(f"{_fmt(row[k]):>9}" for k in COLUMNS)


def print_table(res) -> None:
    print("  ".join(f"{k:>9}" for k in COLUMNS))
    for row in res["cells"]:
        print(_line(row))


def markdown(res) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(_fmt(r[k]) for k in COLUMNS) + " |\n"
                          for r in res["cells"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench gpu-proxy",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    csv = lambda f: (lambda v: [f(x) for x in v.split(",")])  # noqa: E731
    ap.add_argument("--layouts", type=csv(str), default=list(LAYOUTS))
    ap.add_argument("--paths", type=csv(str), default=list(PATHS))
    ap.add_argument("--ranks", type=csv(int), default=list(RANKS))
    ap.add_argument("--densities", type=csv(float), default=list(DENSITIES))
    ap.add_argument("--steps", type=int, default=1, help="counted sync steps per cell")
    ap.add_argument("--warmup", type=int, default=0,
                    help="uncounted sync steps first (0: the counted step includes the "
                         "one-time allocations of a fresh state, under 1 %% of its ops)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--json", default="benchmarks/results/gpu_proxy.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bad = [p for p in args.paths if p not in PATHS]
    if bad:
        ap.error(f"unknown path {bad}; one of {PATHS}")
    for name in args.layouts:
        try:
            layout(name)
        except ValueError as e:
            ap.error(str(e))
    print("  ".join(f"{k:>9}" for k in COLUMNS))
    res = run(args.layouts, args.paths, args.ranks, args.densities, args.steps, args.warmup)
    res["command"] = " ".join(["python -m benchmarks.bench gpu-proxy"] + list(argv or sys.argv[1:]))
    res["torch"] = torch.__version__
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        md = os.path.splitext(args.json)[0] + ".md"
        with open(md, "w") as f:
            f.write(f"<!-- generated by: {res['command']} -->\n\n"
                    "### Per sync step on the tensor-op path (C kernels off), counted on a CPU\n\n"
                    + markdown(res))
        print(f"wrote {args.json} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
