"""The ``"reduce_scatter"`` topology: a sparse reduce-scatter whose owners re-compress.

Ok-Topk's two phases (Li & Hoefler, PPoPP '22, arXiv 2201.07598) with SBC messages (Sattler et
al., arXiv 1805.08768) and the downlink error feedback of Zou et al. (arXiv 2209.15203):

1. :class:`Plan` cuts the model's concatenated index space into N regions (a tensor that
   straddles a cut becomes two *pieces*; :mod:`horovod_sbc.regions` balances elements and
   pieces). Every rank encodes each piece like any tensor (its top ``density``, so a region
   carries its share of the positions whatever the gradients) and sends region r's step
   message to rank r, all in one ``alltoall``.
2. Rank r decodes its region's N parts, averages them, adds its downlink residual, encodes the
   average again (``SBCConfig.downlink_fraction`` and ``downlink_compressor``: by default STC
   at 4x the density when the uplink is binarized) and keeps what it did not send in that
   residual (``ResidualManager.server_residuals``, keyed by piece name).
3. The N region messages are allgathered and every rank decodes them into the same average.

Per rank and sync: upload about one message, download and decode (N-1)/N of the parts (one
message's worth) and of the region messages (at the default STC at 4x the density, about 3.5
uplink messages), whatever N, plus 2N step headers. A
rank that cannot encode sends its ERROR/SKIP to every owner, every owner relays it, and every
rank raises (or skips) with it; uplink and downlink error feedback are committed only after
every region message decoded.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ... import protocol, regions, wire
from ..backend import Accumulate, DecodeJob, NonFiniteError, Targets, frame
from . import server

Layout = Tuple[Tuple[str, Tuple[int, ...]], ...]


class Plan(regions.Plan):
    """:class:`horovod_sbc.regions.Plan` (which rank owns which piece, the same in every
    framework) with the torch views of its pieces."""

    def split(self, flats: Optional[Sequence[Optional[torch.Tensor]]]):
        """Per piece, the view of its elements in the flat per-tensor ``flats`` (None stays)."""
        if flats is None:
            return None
        return tuple(None if flats[p.tensor] is None else
                     flats[p.tensor].view(-1)[p.start:p.stop] for p in self.pieces)

    def targets(self, t: Targets) -> Targets:
        """``t`` (per tensor) as per-piece views."""
        return dataclasses.replace(t, outs=self.split(t.outs), also=self.split(t.also),
                                   masks=self.split(t.masks))


@functools.lru_cache(maxsize=64)
def plan(layout: Layout, size: int) -> Plan:
    """The :class:`Plan` of ``layout`` (a tuple of ``(name, shape tuple)``) over ``size`` ranks."""
    return Plan(layout, size)


def region_parts(step: Optional[torch.Tensor], p: Plan, rank: int,
                 whole=None) -> Tuple[torch.Tensor, List[int]]:
    """This rank's step message (of ``p.layout``) re-framed as one step message per region,
    concatenated in rank order, and their lengths (the alltoall's splits). An ERROR/SKIP step
    goes to every owner. ``whole``: the step's encoding of every piece at once, which frames
    the regions on the device (no host read; ``step`` is not read and may be None); else host
    work: the step's bytes (one read) and every piece's header."""
    if whole is not None:
        return whole.frame_groups(p.bounds, p.fingerprints)
    host = frame.host_bytes(step)
    head = protocol.parse_step(host, 0, len(host), rank)
    err = None if head.kind is protocol.StepKind.TENSORS else protocol.peer_error(host, head)
    msgs = regions.region_messages(host, p, err)
    return frame.device_bytes(b"".join(msgs), step.device), [len(m) for m in msgs]


@dataclass
class Downlink:
    """An owner's region message and the commit of its downlink error feedback."""
    step: torch.Tensor
    commit: Callable[[], None] = lambda: None


def owner_step(state, parts: torch.Tensor, p: Plan, rank: int, scale: float, acc_dtype,
               dev) -> Downlink:
    """Region ``rank``: ``scale`` x the sum of every rank's part (``parts``, N step messages)
    plus the downlink residual, encoded again; an error step relaying a rank's ERROR/SKIP or
    naming what was malformed instead."""
    lay, fp = p.regions[rank], p.fingerprints[rank]
    backend = state.backend(dev)
    try:
        avg = backend.decode(parts, lay, p.size, Targets.new(lay, acc_dtype, dev), scale)
    except wire.PeerError as e:
        return Downlink(frame.error_frame(e.reason, fp, e.skip, dev, e.rank))
    except ValueError as e:
        return Downlink(frame.error_frame(f"region owner rank {rank} rejected an uplink: {e}",
                                          fp, False, dev, rank))
    srv = state.manager.server_residuals
    names = [n for n, _ in lay]
    for n, a in zip(names, avg):  # a region's residuals exist from its first sync on
        r = srv.get(n)
        if r is None or r.numel() != a.numel() or r.device != a.device:
            srv[n] = torch.zeros_like(a)
    # A = average + R formed in the average's buffer, which becomes R once committed
    srcs = [Accumulate(a, srv[n].to(a.dtype)) for n, a in zip(names, avg)]
    try:
        step, encs = _encode_region(state, backend, srcs, names, fp, dev)
    except NonFiniteError as e:
        return Downlink(frame.error_frame(f"the average of region {rank} is not finite: {e}",
                                          fp, False, dev, rank))

    def commit() -> None:
        for enc in encs:
            enc.commit()
        srv.update(zip(names, avg))
    return Downlink(step, commit)


def _encode_region(state, backend, srcs, names, fp: int, dev):
    """The region message of ``srcs`` at the downlink's density and mode, and its encodings."""
    cfg = state.config
    density, mode = cfg.downlink_fraction, cfg.downlink_compressor
    if mode != "values":  # SBC's side, STC's signs: never a zero, no position wasted
        fused = backend.encode_many(srcs, density, mode, cfg.selection, names, fp)
        if fused is not None:
            return fused.frame(fp, None), [fused]
        encs = [backend.encode_tensor(s, density, mode, n, cfg.selection)
                for s, n in zip(srcs, names)]
    else:  # top-k of a sum of sparse parts: never a zero-valued position
        for s in srcs:
            s.residual.add_(s.addend)
        encs = [server.encode_downlink(backend, s.residual, density, mode, n, cfg.selection)
                for s, n in zip(srcs, names)]
    return frame.frame([e.message for e in encs], fp, dev), encs


def decode_regions(state, gathered: torch.Tensor, p: Plan, targets: Targets) -> None:
    """Every owner's region message (``gathered``, in rank order) into the per-piece
    ``targets``; raises the first ERROR (then SKIP) in rank order before anything is written,
    or ``ValueError`` naming the owner whose message is malformed. The region bodies, checked,
    are decoded as ONE step of the whole piece layout (one decode job, not one per rank)."""
    host = frame.host_bytes(gathered)
    heads = [protocol.parse_step(host, s, e, r)
             for r, (s, e) in enumerate(protocol.split(host, p.size))]
    for kind in (protocol.StepKind.ERROR, protocol.StepKind.SKIP):
        for h in heads:
            if h.kind is kind:
                raise protocol.peer_error(host, h)
    whole = regions.join_regions(host, p, heads)
    job = DecodeJob(frame.device_bytes(whole, gathered.device), p.layout, 1, targets,
                    host=memoryview(whole))
    err = state.backend(gathered.device).decode_many([job])[0]
    if err is not None:
        raise ValueError(f"a region message: {err}") from None


def exchange(state, step: Optional[torch.Tensor], p: Plan, rank: int, targets: Targets,
             scale: float, tag: str, acc_dtype, whole=None) -> Callable[[], None]:
    """One sync (see the module docstring) into the per-piece ``targets``; returns the
    commit of this rank's downlink error feedback. ``stats()``: ``upstream_bits`` the parts
    sent to the other owners plus this rank's region message, ``downstream_bits`` the parts
    and region messages received from the other ranks (each collective counted as a direct
    exchange)."""
    if not hasattr(state.transport, "alltoall"):
        raise ValueError("SBC(topology='reduce_scatter') needs Horovod's alltoall; this "
                         f"transport ({type(state.transport).__name__}) has none")
    parts, splits = region_parts(step, p, rank, whole)
    received = state.transport.alltoall(parts, splits, tag + ".parts")
    down = owner_step(state, received, p, rank, scale, acc_dtype, parts.device)
    gathered = state.transport.allgather(down.step, tag + ".regions")
    mine = down.step.numel()
    state.manager.add(upstream_bits=8 * (sum(splits) - splits[rank] + mine),
                      downstream_bits=8 * (received.numel() - splits[rank]
                                           + gathered.numel() - mine))
    decode_regions(state, gathered, p, targets)
    return down.commit
