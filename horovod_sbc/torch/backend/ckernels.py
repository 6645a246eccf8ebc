"""The C kernel backend: SBC's codec in plain C on the CPU (:mod:`horovod_sbc.kernels`).

On the CPU a handful of tensor ops per stage means several passes over the tensor and int64
temporaries for every bit; the kernels do each stage in one pass, so encoding and decoding cost a
few passes over memory, like a ``torch.add`` of the same size. They take contiguous float32 CPU
tensors of at most :data:`horovod_sbc.kernels.MAX_NUMEL` elements in the modes SBC and top-k
values (and select STC's top k: the fused forms of :mod:`horovod_sbc.registry`), and streamed
messages when decoding:

* encode: the selection (``sbc_select``; forming ``A = R + g`` — and zeroing a consumed ``g`` —
  or ``A = W - W_ref`` in its own pass), the side and its Rice parameter, the streams; for SBC
  every tensor of a sync in one call (:meth:`KernelBackend.encode_many`, :class:`KernelSync`);
* decode: every binary message's stream statistics and positions in one call, the protocol's
  verdict, then one call adds every tensor's ranks in rank order (also to a second output, or
  masking a momentum buffer, in the same walk).

Everything else on the CPU — other dtypes, other compressors, SIGNS/VALUES/ALL messages, outputs
the kernels do not take — is the tensor-op backend's work, which :class:`KernelBackend`
inherits: each tensor goes whole (all its ranks) one way or the other, so its sums are added in
rank order by one path. Both give the same bytes, verdicts and sums (golden vectors,
differential tests).
"""
from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ... import kernels, protocol, registry, wire
from ...reference import choose_side, keep_count
from . import frame
from .base import (Accumulate, DecodeJob, Difference, Encoded, InPlace, NonFiniteError,
                   PositionBuffer, Source, as_source, check_request)
from .ops import OpsBackend, form, one_value, undo
from .select import Binarized, f32, rice_candidates
from .streams import encode_positions, stream_sizes

def kernels_for(a: torch.Tensor):
    """The kernel library when ``a`` is a contiguous float32 CPU tensor of at most
    ``kernels.MAX_NUMEL`` elements and the kernels are available, else None."""
    if not a.is_cpu or a.dtype is not torch.float32 or not a.is_contiguous() or \
            a.numel() > kernels.MAX_NUMEL:
        return None
    return kernels.lib()


def _flat_ok(*ts: torch.Tensor) -> bool:
    """Tensors one kernel pass can read together: 1-D, kernel-able, of one size."""
    return all(t.dim() == 1 and t.numel() == ts[0].numel() and kernels_for(t) is not None
               for t in ts)


_C_PAPER, _C_MAGNITUDE_SPLIT, _C_MAGNITUDE = 0, 1, 2


@dataclass
class _CSelection:
    """``sbc_select``'s result: the sides' sizes and fixed-order float64 tree sums (of ``a[P]``
    and of ``-a[N]``; the magnitude mode: of ``|a|`` over the k, and the count of non-zeros);
    the positions wait in the kernel's scratch for :meth:`take`."""
    lib: object
    counts: Tuple[int, int]
    sums: Tuple[float, float]
    in_dst: Optional[int] = None  # the side the kernel wrote to ``dst`` (then only that one)

    def take(self, side: int, buffer: Optional[PositionBuffer] = None) -> torch.Tensor:
        """Side 0 or 1's ascending positions (int64), copied out of the kernel's scratch (into
        ``buffer`` if given): call before the next selection on this thread."""
        if self.in_dst is not None:
            raise AssertionError("horovod_sbc: the selection wrote only one side, to dst")
        out = buffer.get(self.counts[side]) if buffer is not None else \
            torch.empty(self.counts[side], dtype=torch.int64)
        self.lib.sbc_take(side, out.data_ptr())
        return out


def _check_rc(rc: int, name: str, what: str) -> None:
    if rc == kernels.NONFINITE:
        raise NonFiniteError(f"the update of {name!r} contains NaN or Inf")
    if rc == kernels.NOMEM:
        raise MemoryError(f"horovod_sbc: out of memory in {what} of {name!r}")
    if rc != kernels.OK:
        raise AssertionError(f"horovod_sbc: {what} of {name!r} rejected its arguments ({rc})")


class _KernelOut(threading.local):
    """The kernel calls' small output arrays, allocated once per thread (a fresh set of ctypes
    objects per tensor per step was a measurable part of the codec's per-tensor cost)."""

    def __init__(self):
        self.counts = (ctypes.c_int64 * 2)()
        self.sums = (ctypes.c_double * 2)()
        self.in_dst = ctypes.c_int(-1)
        self.bs = (ctypes.c_int64 * 3)()
        self.shift_sums = (ctypes.c_int64 * 3)()
        self.addr = tuple(ctypes.addressof(x) for x in
                          (self.counts, self.sums, self.in_dst, self.bs, self.shift_sums))



_OUT = _KernelOut()


def _select_c(lib, a: torch.Tensor, k: int, mode: int, name: str, source=None,
              dst: Optional[torch.Tensor] = None) -> _CSelection:
    """``sbc_select`` of ``a``; with an :class:`Accumulate` source ``a += g`` in the same pass,
    first (consumed: ``g`` zeroed too, ``sbc_select_consume``); with a :class:`Difference` the
    selection of ``W - W_ref`` itself, nothing written (``sbc_select_diff``). With ``dst`` (int64,
    k elements; paper rule only) the kernel may write only the winning side into it: see
    :attr:`_CSelection.in_dst`."""
    out = _OUT
    counts, sums, in_dst = out.counts, out.sums, out.in_dst
    c_addr, s_addr, d_addr = out.addr[:3]
    if dst is None:
        tail = (a.numel(), k, mode, c_addr, s_addr, None, None)
    else:
        tail = (a.numel(), k, mode, c_addr, s_addr, dst.data_ptr(), d_addr)
    if isinstance(source, Difference):
        rc = lib.sbc_select_diff(source.weights.data_ptr(), source.reference.data_ptr(), *tail)
    elif isinstance(source, Accumulate) and source.consume:
        rc = lib.sbc_select_consume(a.data_ptr(), source.addend.data_ptr(), *tail)
    elif isinstance(source, Accumulate):
        rc = lib.sbc_select(a.data_ptr(), source.addend.data_ptr(), *tail)
    else:
        rc = lib.sbc_select(a.data_ptr(), None, *tail)
    _check_rc(rc, name, "the selection")
    side = in_dst.value if dst is not None else -1
    return _CSelection(lib, (counts[0], counts[1]), (sums[0], sums[1]),
                       None if side < 0 else side)


def _rice_choice_c(lib, pos: torch.Tensor, numel: int) -> Tuple[int, int]:
    """(b, sum(gaps >> b)) by :func:`horovod_sbc.wire.choose_rice_b`, the sums from the kernel."""
    count = pos.numel()
    bs = rice_candidates(count, numel)
    out = _OUT
    out.bs[:len(bs)] = bs
    lib.sbc_gap_shift_sums(pos.data_ptr(), count, out.addr[3], len(bs), out.addr[4])
    table = dict(zip(bs, out.shift_sums[:len(bs)]))
    b = wire.choose_rice_b(count, numel, table.__getitem__)
    return b, table[b]


def _binarize_c(lib, a: torch.Tensor, k: int, selection: str, name: str, source=None,
                buffer=None) -> Binarized:
    """The selection, the side with the larger mean and its Rice parameter in two kernel
    calls (:func:`horovod_sbc.torch.backend.select.binarize_sides` of the selection)."""
    paper = selection == "paper"
    dst = (buffer.get(k) if buffer is not None else torch.empty(k, dtype=torch.int64)) \
        if paper else None
    sel = _select_c(lib, a, k, _C_PAPER if paper else _C_MAGNITUDE_SPLIT, name, source, dst)
    (np_, nn_), (s_pos, s_neg) = sel.counts, sel.sums
    side, mu = choose_side(f32(s_pos / np_) if np_ else 0.0, f32(s_neg / nn_) if nn_ else 0.0)
    if side == 0:
        return Binarized(torch.zeros(0, dtype=torch.int64), 0.0, False, 0, 0)
    chosen = 0 if side > 0 else 1
    if sel.in_dst is not None:  # only the winner was written (its mean is larger beyond doubt)
        if sel.in_dst != chosen:
            raise AssertionError(f"horovod_sbc: the kernel's side for {name!r} is not the "
                                 "chosen one")
        pos = dst[:sel.counts[chosen]]
    else:
        pos = sel.take(chosen, buffer)
    b, sum_q = _rice_choice_c(lib, pos, a.numel())
    return Binarized(pos, mu, side < 0, b, sum_q)


def _rice_encode_c(lib, pos: torch.Tensor, b: int, at: int, ubytes: int, rbytes: int) -> None:
    """The kernel's unary then remainder stream of ``pos`` at address ``at``."""
    rc = lib.sbc_rice_encode(pos.data_ptr(), pos.numel(), b, at, ubytes, at + ubytes, rbytes)
    _check_rc(rc, "positions", "the Rice encoder")


def encode_binary_c(lib, pos: torch.Tensor, numel: int, value: float, negative: bool,
                    rice_b: Optional[int] = None, sum_q: Optional[int] = None,
                    signs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A binary message of ``pos`` (int64, contiguous, on the CPU; count > 0): header and
    streams written into one buffer by the kernel; ``signs`` (bool per position, True =
    negative): a ternary message, its sign stream after the positions'."""
    b, sum_q = (rice_b, sum_q) if rice_b is not None else _rice_choice_c(lib, pos, numel)
    ubytes, rbytes = stream_sizes(pos.numel(), b, sum_q)
    head = wire.tensor_header(numel, pos.numel(), b, ubytes, value, negative,
                              has_signs=signs is not None)
    sbytes = 0 if signs is None else (pos.numel() + 7) // 8
    msg = torch.empty(len(head) + ubytes + rbytes + sbytes, dtype=torch.uint8)
    ctypes.memmove(msg.data_ptr(), head, len(head))
    _rice_encode_c(lib, pos, b, msg.data_ptr() + len(head), ubytes, rbytes)
    if sbytes:
        msg[-sbytes:] = torch.from_numpy(np.packbits(signs.numpy()))
    return msg


def _kernel_form(comp: registry.Compressor) -> bool:
    """The kernels encode ``comp``: a :data:`horovod_sbc.registry.NATIVE_FORMS` compressor, or
    the fused ternary form of :data:`horovod_sbc.registry.FUSED_FORMS` (STC: the non-zero
    entries among the top k of ``|A|`` as ``sign * mu``), whose top k the kernel selects."""
    return comp.native_kernel or (comp.fused and comp.message is registry.Message.SIGNS)


def _encode_signs_c(lib, a: torch.Tensor, k: int, name: str, source, positions):
    """The fused ternary form: the kernel's top k of ``|A|`` (ties: lower index; ``A`` formed
    in its pass from an :class:`Accumulate`), ``mu`` the fixed-order tree sum of their
    magnitudes (zeros included, in position order) over the count of non-zeros, rounded once
    to float32, the non-zeros sent with their signs (nothing when ``mu`` is 0): the bytes of
    :class:`horovod_sbc.compressors.stc.STC`'s encoders."""
    n = a.numel()
    sel = _select_c(lib, a, k, _C_MAGNITUDE, name, source)  # sums: |a|'s, the non-zeros
    top = sel.take(0, positions)
    total, nonzero = sel.sums[0], int(sel.sums[1])
    idx = top if nonzero == top.numel() else top[a[top] != 0]
    mu = f32(total / nonzero) if nonzero else 0.0
    if mu == 0.0:  # nothing non-zero, or subnormal magnitudes whose mean rounds to 0
        empty = idx[:0]
        return encode_positions(empty, n), empty, a.new_zeros(0)
    neg = a[idx] < 0
    return (encode_binary_c(lib, idx, n, mu, False, signs=neg), idx,
            torch.where(neg, -mu, mu).to(a.dtype))


# ------------------------------------------------------------------------------------------------
# a whole sync's SBC messages in one kernel call
# ------------------------------------------------------------------------------------------------
_KIND_PLAIN, _KIND_ADD, _KIND_CONSUME, _KIND_DIFF = 0, 1, 2, 3


def _batch_sources(srcs, comp: registry.Compressor):
    """(the kernel's kind per source and the tensors its error feedback is taken out of), or
    (None, None) unless every source is one the kernels form in their pass (:func:`_in_pass`)
    or a kernel-able tensor itself."""
    kinds, targets = [], []
    for src in srcs:
        if isinstance(src, InPlace) and kernels_for(src.a) is not None:
            kinds.append(_KIND_PLAIN)
            targets.append(src.a.view(-1))
        elif not _in_pass(src, comp):
            return None, None
        elif isinstance(src, Accumulate):
            kinds.append(_KIND_CONSUME if src.consume else _KIND_ADD)
            targets.append(src.residual)
        else:
            kinds.append(_KIND_DIFF)
            targets.append(src.weights)
    return kinds, targets


@functools.lru_cache(maxsize=64)
def _batch_plan(numels: Tuple[int, ...], density: float):
    """Per layout and density: k, the Rice tables (:func:`horovod_sbc.wire.rice_table`) as the
    kernel reads them, and the most bytes the messages can take."""
    ks = [keep_count(n, density) for n in numels]
    b1, off, ts = [], [0], []
    for n in numels:
        b, t = wire.rice_table(n) if n else (0, ())
        b1.append(b)
        ts.extend(t)
        off.append(len(ts))
    cap = sum(wire.tensor_capacity(n, k) for n, k in zip(numels, ks))
    arr = lambda x: np.ascontiguousarray(x, dtype=np.int64)  # noqa: E731
    return arr(ks), arr(b1), arr(off), arr(ts or [0]), cap, sum(ks)


def _encode_binary_many(lib, srcs, kinds, targets, density: float, selection: str, names,
                        subtract) -> "KernelSync":
    numels = tuple(t.numel() for t in targets)
    ks, b1, off, ts, cap, room = _batch_plan(numels, float(density))
    m = len(srcs)
    pa = np.fromiter((s.weights.data_ptr() if k == _KIND_DIFF else t.data_ptr()
                      for s, k, t in zip(srcs, kinds, targets)), np.int64, m)
    pb = np.fromiter((0 if k == _KIND_PLAIN else s.reference.data_ptr() if k == _KIND_DIFF
                      else s.addend.data_ptr() for s, k in zip(srcs, kinds)), np.int64, m)
    kind, n = np.asarray(kinds, np.int64), np.asarray(numels, np.int64)
    body = torch.empty(cap, dtype=torch.uint8)
    pos = torch.empty(max(1, room), dtype=torch.int64)
    ends, counts, neg = (np.zeros(m, np.int64) for _ in range(3))
    mus = np.zeros(m, np.float32)
    failed = np.zeros(1, np.int64)
    ptr = lambda x: x.ctypes.data  # noqa: E731
    rc = lib.sbc_encode_binary_many(
        m, ptr(kind), ptr(pa), ptr(pb), ptr(n), ptr(ks), 0 if selection == "paper" else 1,
        ptr(b1), ptr(off), ptr(ts), body.data_ptr(), cap, pos.data_ptr(), ptr(ends),
        ptr(counts), ptr(mus), ptr(neg), ptr(failed))
    sync = KernelSync(lib, body, pos, ends, counts, mus, neg, targets)
    if rc != kernels.OK:
        i = int(failed[0])
        if rc == kernels.NONFINITE:
            undo(srcs[i])
        try:
            _check_rc(rc, names[i], "the selection")
        except NonFiniteError as e:
            e.encoded = [sync.encoded(j, subtract) for j in range(i)]
            raise
    return sync


class KernelSync:
    """Every tensor of a sync encoded by one kernel call (:meth:`KernelBackend.encode_many`):
    the messages back to back in ``body``, the positions sent tensor after tensor, and what
    the error feedback takes out of each target once the sync succeeded (the interface of
    :class:`horovod_sbc.torch.backend.ops.FusedSync`, framed on the host)."""

    def __init__(self, lib, body, pos, ends, counts, mus, neg, targets):
        self.lib, self.targets = lib, targets
        self.ends, self.counts, self.mus, self.neg = ends, counts, mus, neg
        self.starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
        self.pos_off = np.concatenate([[0], np.cumsum(counts)])
        self.body = body[:int(ends.max()) if len(ends) else 0]  # after a failure: those done
        self.positions = pos[:int(self.pos_off[-1])]
        self.ptrs = np.fromiter((t.data_ptr() for t in targets), np.int64, len(targets))

    @property
    def encoding(self) -> "KernelSync":
        return self

    @property
    def body_bytes(self) -> int:
        return self.body.numel()

    def message(self, i: int) -> torch.Tensor:
        return self.body[int(self.starts[i]):int(self.ends[i])]

    def positions_of(self, i: int) -> torch.Tensor:
        """The positions sent of tensor ``i`` (ascending)."""
        return self.positions[int(self.pos_off[i]):int(self.pos_off[i + 1])]

    def encoded(self, i: int, subtract) -> Encoded:
        """Tensor ``i`` as :meth:`KernelBackend.encode_tensor` returns it."""
        pos = self.positions_of(i)
        v = -float(self.mus[i]) if self.neg[i] else float(self.mus[i])
        t = self.targets[i]
        return Encoded(self.message(i), pos, one_value(v, pos.numel(), t), t, subtract)

    def frame(self, layout_crc: int, capacity: Optional[int] = None) -> torch.Tensor:
        return frame.frame_body(self.body, len(self.targets), layout_crc, capacity)

    def frame_groups(self, groups: Sequence[int], layout_crcs: Sequence[int]
                     ) -> Tuple[torch.Tensor, List[int]]:
        """One step message per group of consecutive tensors (the reduce-scatter's regions),
        back to back, and their lengths."""
        host = memoryview(self.body.numpy())
        starts = [int(x) for x in self.starts] + [int(self.ends[-1]) if len(self.ends) else 0]
        msgs = []
        for a, b, crc in zip(groups[:-1], groups[1:], layout_crcs):
            part = host[starts[a]:starts[b]]
            msgs += [wire.step_header_bytes(part, crc, b - a), part]
        lens = [len(msgs[j]) + len(msgs[j + 1]) for j in range(0, len(msgs), 2)]
        return frame.device_bytes(b"".join(msgs), self.body.device), lens

    def commit(self) -> None:
        """Error feedback: ``t[pos] -= sent`` in every target."""
        ptr = lambda x: x.ctypes.data  # noqa: E731
        self.lib.sbc_commit_binary_many(len(self.targets), ptr(self.ptrs),
                                        self.positions.data_ptr() if self.positions.numel()
                                        else None, ptr(self.counts), ptr(self.mus),
                                        ptr(self.neg))


def select_topk(a: torch.Tensor, k: int, name: str = "tensor") -> torch.Tensor:
    """:func:`horovod_sbc.torch.backend.select.select_topk` in the kernel (``a`` kernel-able)."""
    return _select_c(kernels.lib(), a, k, _C_MAGNITUDE, name).take(0)


def select_sides(a: torch.Tensor, k: int, selection: str = "paper", name: str = "tensor"
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`horovod_sbc.torch.backend.select.select_sides` in the kernel."""
    mode = _C_PAPER if selection == "paper" else _C_MAGNITUDE_SPLIT
    sel = _select_c(kernels.lib(), a, k, mode, name)
    return sel.take(0), sel.take(1)


def _positions_ok(pos: torch.Tensor) -> bool:
    return pos.is_cpu and pos.dtype is torch.int64 and pos.is_contiguous()


class KernelBackend(OpsBackend):
    """The C kernels for what they take, the tensor-op backend for the rest (see the module
    docstring)."""

    name = "C kernels"

    # -- encode -------------------------------------------------------------------------------
    def encode_tensor(self, source: Source, density: float, mode="sbc", name: str = "tensor",
                      selection: str = "paper", generator=None, positions=None) -> Encoded:
        mode = check_request(mode, selection)
        comp = registry.get(mode)
        src = as_source(source)
        in_pass = _in_pass(src, comp)
        if in_pass:  # A is formed in the selection's pass
            a = target = src.weights if isinstance(src, Difference) else src.residual
        else:
            a, target = form(src)
        lib = kernels_for(a) if _kernel_form(comp) and a.numel() else None
        if lib is None:
            return self._encoded(src, target, mode, lambda: self.encode_formed(
                a, density, mode, name, selection, generator))
        return self._encoded(src, target, mode, lambda: self._encode_c(
            lib, a, density, comp, name, selection, src if in_pass else None, positions))

    def _encode_c(self, lib, a: torch.Tensor, density: float, comp: registry.Compressor,
                  name: str, selection: str, source, positions):
        """A compressor's encoding in the kernels (:func:`_kernel_form`): top-k with values,
        SBC's binarized sides, or the fused ternary form."""
        n = a.numel()
        k = keep_count(n, density)
        if comp.message is registry.Message.SIGNS:
            return _encode_signs_c(lib, a, k, name, source, positions)
        if comp.message is registry.Message.VALUES:
            idx = _select_c(lib, a, k, _C_MAGNITUDE, name, source).take(0, positions)
            vals = a[idx].to(torch.float32)
            return (encode_positions(idx, n, values=vals, all_positions=idx.numel() == n), idx,
                    vals.to(a.dtype))
        bz = _binarize_c(lib, a, k, selection, name, source, positions)
        msg = encode_binary_c(lib, bz.pos, n, bz.mu, bz.negative, bz.rice_b, bz.sum_q) \
            if bz.pos.numel() else encode_positions(bz.pos, n)
        return msg, bz.pos, one_value(-bz.mu if bz.negative else bz.mu, bz.pos.numel(), a)

    def encode_many(self, sources, density, mode, selection, names, layout_crc=None):
        """SBC (``native_kernel``, ``message=BINARY``) of every source in one kernel call
        (:class:`KernelSync`): the bytes of :meth:`encode_tensor`, without its per-tensor
        Python (about 30 us a tensor, what a reduce-scatter's many pieces pay); None where a
        source is not one the kernels form in their pass (then tensor by tensor). A NaN/Inf
        raises :class:`NonFiniteError` naming the tensor, its source put back as
        :meth:`encode_tensor` does, with ``encoded``: the tensors before it, encoded."""
        mode = check_request(mode, selection)
        comp = registry.get(mode)
        lib = kernels.lib()
        if lib is None or not sources or not comp.native_kernel or \
                comp.message is not registry.Message.BINARY:
            return None
        srcs = [as_source(s) for s in sources]
        kinds, targets = _batch_sources(srcs, comp)
        if kinds is None:
            return None
        return _encode_binary_many(lib, srcs, kinds, targets, density, selection, list(names),
                                   self.subtract_sent)

    def subtract_sent(self, a: torch.Tensor, pos: torch.Tensor, sent: torch.Tensor) -> None:
        """``a[pos] -= sent``; one value for every position (a stride-0 view) is subtracted by
        the kernel: ``a + (-v)`` is ``a - v`` exactly, as ``index_add_(alpha=-1)`` computes."""
        if not pos.numel():
            return
        if sent.dim() == 1 and sent.stride(0) == 0 and sent.dtype == torch.float32 and \
                sent.device.type == "cpu" and a.dim() == 1 and kernels_for(a) is not None and \
                _positions_ok(pos):
            v = ctypes.c_float.from_address(sent.data_ptr()).value  # the one value
            kernels.lib().sbc_add_at(a.data_ptr(), pos.data_ptr(), pos.numel(), -v)
            return
        a.index_add_(0, pos, sent, alpha=-1)

    # -- decode -------------------------------------------------------------------------------
    def decode_many(self, jobs: Sequence[DecodeJob]) -> List[Optional[BaseException]]:
        errors: List[Optional[BaseException]] = []
        for job in jobs:
            if job.gathered.device.type != "cpu" or not job.gathered.is_contiguous():
                errors += super().decode_many([job])
                continue
            if job.host is None:  # else the caller read it
                job.host = memoryview(frame.host_bytes(job.gathered))
            try:
                job.step = protocol.parse_gathered(job.host, job.layout, job.n_ranks)
                if any(m.count and not m.all_positions and not _streamed(m)
                       for _, _, m, _ in job.step.flat()):  # beyond the kernels' 32 bits
                    err = super().decode_many([job])[0]
                    if err is not None:
                        raise err
                else:
                    self._decode_parsed(job)
            except ValueError as e:  # PeerError too
                errors.append(e)
            else:
                errors.append(None)
        return errors

    def _decode_parsed(self, job: DecodeJob) -> None:
        """One parsed job: every message's position streams decoded by one kernel call (with
        their statistics), SIGNS and VALUES read from the step's bytes on the host, the
        verdict, then the additions (raises the verdict). A tensor whose messages are all
        binary, with outputs the kernels take, is added by one scatter call for all such
        tensors; any other tensor message by message, in rank order."""
        lib = kernels.lib()
        flat = job.step.flat()
        t = job.targets
        n_t = len(job.layout)
        per_tensor: Dict[int, List[int]] = {}
        for k, (_, i, msg, _) in enumerate(flat):  # flat is rank-major: rank order per tensor
            if msg.count:
                per_tensor.setdefault(i, []).append(k)
        outs2 = t.also if t.also is not None else (None,) * n_t
        scatter = {i for i, ks in per_tensor.items()
                   if all(_binary(flat[k][2]) for k in ks)
                   and _kernel_output(t.outs[i]) and _kernel_output(outs2[i])}
        ks = _KernelStreams(lib, job.gathered, flat)
        host = _HostValues(job.host, flat)
        protocol.check_streams(job.step, [host.stats(k, ks.stats.get(k, protocol.StreamStats()))
                                          for k in range(len(flat))])
        for i in range(n_t):
            if i in scatter:
                continue
            if t.fresh and not t.zeroed:
                for out in (t.outs[i], outs2[i]):
                    if out is not None:
                        out.zero_()
            for k in per_tensor.get(i, ()):  # rank by rank
                pos, vals = self._elements(ks, host, flat[k][2], k, job.scale)
                for out in (t.outs[i], outs2[i]):
                    if out is not None:
                        out.index_add_(0, pos.to(out.device), vals.to(out.device, out.dtype))
            if t.masks is not None and t.masks[i] is not None and i in per_tensor:
                t.masks[i].view(-1).masked_fill_(t.outs[i].view(-1) != 0, 0)
        groups = [(i, per_tensor[i]) for i in sorted(scatter)]
        if groups:
            _scatter_groups(ks, flat, groups, job, outs2)

    @staticmethod
    def _elements(ks, host, msg: wire.TensorMessage, k: int, scale: float):
        """(positions, float64 ``value * scale``) of message ``k`` (the protocol's decoded
        arithmetic; the caller rounds once to its output's dtype)."""
        pos = torch.arange(msg.count, dtype=torch.int64) if msg.all_positions else \
            ks.positions(k, msg.count)
        vals = host.values(k, msg)
        if vals is None:
            return pos, torch.full((msg.count,), msg.signed_value * scale, dtype=torch.float64)
        return pos, torch.from_numpy(vals.astype(np.float64) * scale)


class _HostValues:
    """SIGNS and VALUES of a step's messages, read from its bytes on the host (CPU tensors:
    they are there already), and their statistics."""

    def __init__(self, host, flat):
        self.buf = np.frombuffer(host, np.uint8)
        self.flat = flat

    def values(self, k: int, msg: wire.TensorMessage) -> Optional[np.ndarray]:
        """Each position's float32 value (SIGNS: +-value; VALUES: its own), or None for a
        binary message (one value for all)."""
        if msg.has_values:
            return self.buf[msg.values[0]:msg.values[1]].view("<f4")
        if msg.has_signs:
            bits = np.unpackbits(self.buf[msg.signs[0]:msg.signs[1]])[:msg.count]
            return np.where(bits == 1, np.float32(-msg.value), np.float32(msg.value))
        return None

    def stats(self, k: int, st: protocol.StreamStats) -> protocol.StreamStats:
        """The kernel's stream statistics of message ``k`` completed with its sign padding and
        its non-finite values (by bit pattern)."""
        msg = self.flat[k][2]
        if not msg.count:
            return st
        if msg.has_signs:
            last = self.buf[msg.signs[1] - 1]
            pad = 8 * (msg.signs[1] - msg.signs[0]) - msg.count
            st = st._replace(sign_pad_nonzero=bool(pad and int(last) & ((1 << pad) - 1)))
        if msg.has_values:
            bits = self.buf[msg.values[0]:msg.values[1]].view("<u4")
            st = st._replace(nonfinite=int(np.count_nonzero((bits >> 23) & 0xFF == 0xFF)))
        return st


def _in_pass(src, comp: registry.Compressor) -> bool:
    """Can the kernel form this source's ``A`` in its selection pass? Only for a compressor
    the kernels encode; a :class:`Difference` (``A`` formed in the weights) only when one value
    is sent for every position (a per-position one keeps ``A - sent`` of the formed ``A``)."""
    if not _kernel_form(comp):
        return False
    if isinstance(src, Accumulate):
        return _flat_ok(src.residual, src.addend)
    if isinstance(src, Difference):
        return comp.message is registry.Message.BINARY and _flat_ok(src.weights, src.reference)
    return False


def _streamed(msg: wire.TensorMessage) -> bool:
    """Messages with position streams (binary, SIGNS or VALUES; not ALL) of tensors of at most
    ``kernels.MAX_NUMEL`` elements: the C kernels decode their streams (uint32 positions)."""
    return bool(msg.count) and not msg.all_positions and msg.numel <= kernels.MAX_NUMEL


def _binary(msg: wire.TensorMessage) -> bool:
    """Streamed messages with one value for every position: the scatter kernel adds them."""
    return _streamed(msg) and not (msg.has_values or msg.has_signs)


def _kernel_output(t: Optional[torch.Tensor]) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu")


class _KernelStreams:
    """The stream statistics and positions of every streamed message, decoded by one kernel
    call; the positions stay in the kernel's buffer for the scatter (or :meth:`positions`)."""

    def __init__(self, lib, gathered: torch.Tensor, flat):
        self.lib = lib
        binary = [k for k, (_, _, msg, _) in enumerate(flat) if _streamed(msg)]
        desc = np.array([(m.unary[0], m.unary[1] - m.unary[0], m.remainder[0],
                          m.remainder[1] - m.remainder[0], m.count, m.rice_b, m.numel)
                         for m in (flat[k][2] for k in binary)], np.int64).reshape(-1, 7).T.copy()
        self.count = desc[4]
        self.offset = np.concatenate([[0], np.cumsum(desc[4])]).astype(np.int64)
        rows = np.zeros((len(binary), 6), np.int64)
        if binary:
            rc = lib.sbc_decode_batch(gathered.data_ptr(), gathered.numel(), len(binary),
                                      *[desc[i].ctypes.data for i in range(7)], rows.ctypes.data)
            if rc == kernels.NOMEM:
                raise MemoryError("horovod_sbc: out of memory decoding a step")
            if rc != kernels.OK:  # the parser guarantees the ranges: a bug, not bad input
                raise AssertionError("horovod_sbc: the decoding kernel rejected its arguments "
                                     f"({rc})")
        self.stats = {k: protocol.StreamStats(r[0], r[1] != 0, r[2], r[3], r[4] != 0, r[5])
                      for k, r in zip(binary, rows.tolist())}
        self.slot = {k: j for j, k in enumerate(binary)}  # message k -> its row

    def positions(self, k: int, count: int) -> torch.Tensor:
        """Message ``k``'s positions (int64), copied out of the kernel's buffer."""
        p = torch.empty(count, dtype=torch.int64)
        self.lib.sbc_positions(int(self.offset[self.slot[k]]), count, p.data_ptr())
        return p


def _scatter_groups(ks: _KernelStreams, flat, groups, job: DecodeJob, seconds) -> None:
    """One scatter kernel call adds every group's messages, in rank order, to its output (and to
    its second output, or masks its momentum buffer, in the same walk); masks the kernel cannot
    take are applied with tensor ops afterwards."""
    lib = ks.lib
    t = job.targets
    out = t.outs
    masks = t.masks if t.masks is not None else (None,) * len(out)
    zero_first, zeroed = t.fresh and not t.zeroed, t.fresh and t.zeroed
    kmsgs = [(i, k) for i, msgs in groups for k in msgs]
    g = np.cumsum([0] + [len(msgs) for _, msgs in groups]).astype(np.int64)
    addr = np.array([out[i].data_ptr() for i, _ in groups], np.int64)
    numel = np.array([out[i].numel() for i, _ in groups], np.int64)
    js = [ks.slot[k] for _, k in kmsgs]
    off = ks.offset[js].astype(np.int64)
    cnt = ks.count[js].astype(np.int64)
    # the value each position gets: the Python float product rounded once to float32
    val = np.array([flat[k][2].signed_value * job.scale for _, k in kmsgs], np.float32)
    bufs, not_taken = [], []  # masks the kernel zeroes at the decoded positions (0: none)
    for i, _ in groups:
        buf = masks[i]
        ok = buf is not None and buf.numel() == out[i].numel() and \
            buf.dtype == torch.float32 and buf.is_contiguous() and buf.device.type == "cpu"
        if buf is not None and not ok:
            not_taken.append(i)
        bufs.append(buf.data_ptr() if ok else 0)
    kalso = [0 if seconds[i] is None else seconds[i].data_ptr() for i, _ in groups]
    n = len(groups)
    # the address arrays are named so that they outlive the kernel call: a temporary's
    # ``.ctypes.data`` is a bare integer, and its buffer is freed (and reused) before the call
    bufs_a, also_a = np.array(bufs, np.int64), np.array(kalso, np.int64)
    if any(bufs):
        rc = lib.sbc_scatter_add_mask_groups(n, g.ctypes.data, addr.ctypes.data,
                                             bufs_a.ctypes.data,
                                             numel.ctypes.data, off.ctypes.data,
                                             cnt.ctypes.data, val.ctypes.data, int(zeroed))
    elif any(kalso):  # (a second output comes without fresh outputs)
        rc = lib.sbc_scatter_add_also_groups(n, g.ctypes.data, addr.ctypes.data,
                                             also_a.ctypes.data,
                                             numel.ctypes.data, off.ctypes.data,
                                             cnt.ctypes.data, val.ctypes.data)
    else:
        rc = lib.sbc_scatter_add_groups(n, g.ctypes.data, addr.ctypes.data, numel.ctypes.data,
                                        off.ctypes.data, cnt.ctypes.data, val.ctypes.data,
                                        int(zero_first))
    if rc != kernels.OK:
        raise AssertionError(f"horovod_sbc: the scatter kernel rejected its arguments ({rc})")
    for i in not_taken:
        masks[i].view(-1).masked_fill_(out[i].view(-1) != 0, 0)
