"""The exchange (GRACE's *Communicator*): frame step messages, allgather them, decode, sum.

Sparse messages cannot be summed by allreduce, so every rank allgathers every rank's step message
(one ``uint8`` tensor each, variable length) and decodes all of them in rank order. Because every
rank decodes the same gathered bytes in the same order with the same arithmetic, all ranks get
bit-identical results. The step header declares its own length, so the concatenation is split
without a second allgather of sizes.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .. import protocol, wire
from . import decoder
from .codec import stream_stats


def _host_bytes(t: torch.Tensor) -> bytes:
    # Compressed messages are tiny (KBs); their framing is parsed on the host.
    return t.detach().to("cpu").numpy().tobytes()


def _device_bytes(b: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).to(device)


def frame(msgs: Sequence[torch.Tensor], layout_crc: int, device) -> torch.Tensor:
    """One step message (uint8 tensor on ``device``) from tensor messages."""
    body = torch.cat(list(msgs)) if msgs else torch.zeros(0, dtype=torch.uint8, device=device)
    head = wire.step_header_bytes(_host_bytes(body), layout_crc, len(msgs))
    return torch.cat([_device_bytes(head, device), body])


def error_frame(reason: str, layout_crc: int, skip: bool, device, origin: int) -> torch.Tensor:
    return _device_bytes(wire.error_step_message(reason, layout_crc, skip, origin), device)


def decode_gathered(gathered: torch.Tensor, layout: Sequence[Tuple[str, Sequence[int]]],
                    n_ranks: int, out: Optional[List[torch.Tensor]] = None, scale: float = 1.0,
                    out_dtype=torch.float32) -> List[torch.Tensor]:
    """Accumulate ``scale`` x every rank's decoded tensor, in rank order, into ``out``.

    ``out`` are flat tensors in ``layout`` order (e.g. the reference weights, or a gradient
    buffer just zeroed); None allocates zeros of ``out_dtype``. With ``scale = 1/size`` this is
    the average. Every rank adds the same values in the same order, so results are bit-identical.

    The verdict is the protocol layer's (:mod:`horovod_sbc.protocol`): headers are parsed on the
    host (the compressed bytes only), the streams are decoded on ``gathered``'s device and their
    statistics checked by :func:`horovod_sbc.protocol.check_streams`. Raises
    :class:`horovod_sbc.wire.PeerError` for a rank's ERROR/SKIP and ``ValueError`` for anything
    malformed; nothing is added to ``out`` unless every message is valid.
    """
    host = _host_bytes(gathered)
    step = protocol.parse_gathered(host, layout, n_ranks)
    flat = step.flat()
    dev = gathered.device
    # binary messages: all at once, in (tensor, rank) order; the rest one by one
    # (a tensor goes to the batch only if every rank's message for it does, so that each
    # tensor's sum is accumulated in rank order by one path)
    mixed = {i for _, i, msg, _ in flat if msg.count and not decoder.batchable(msg)}
    order = sorted((k for k, (_, i, msg, _) in enumerate(flat)
                    if i not in mixed and decoder.batchable(msg)),
                   key=lambda k: (flat[k][1], flat[k][0]))
    batch = decoder.decode_binary(gathered, [flat[k][2] for k in order]) if order else None
    if batch is not None and not batch.complete:  # corrupt: the exact per-message verdict
        order, batch = [], None
    stats: List[Optional[protocol.StreamStats]] = [None] * len(flat)
    single = {}
    for slot, k in enumerate(order):
        stats[k] = protocol.StreamStats(*batch.stats[slot])
    for k, (_, _, msg, _) in enumerate(flat):
        if stats[k] is None:
            pos, vals, st = stream_stats(gathered, msg)
            stats[k] = st
            single[k] = (pos, vals)
    protocol.check_streams(step, stats)
    if out is None:
        out = [torch.zeros(wire.layout_numel(shape), dtype=out_dtype, device=dev)
               for _, shape in layout]
    if order:
        _add_batch(out, flat, order, batch, scale, dev)
    for k, (pos, vals) in single.items():  # (rank, tensor) order: rank order per tensor
        msg, i = flat[k][2], flat[k][1]
        if not msg.count:
            continue
        t = out[i]  # positions within one message are unique: plain indexed add
        if vals is None:  # one value: the Python float product, rounded once by torch
            t[pos] += msg.signed_value * scale
        else:  # the protocol's decoded arithmetic: float64(value) * scale, rounded once
            t[pos] += (vals.to(torch.float64) * scale).to(t.dtype)
    return out


def _add_batch(out, flat, order, batch, scale: float, dev) -> None:
    """Add the batch's binary messages: per tensor, every rank's positions in rank order."""
    import numpy as np
    counts = np.diff(batch.seg_start)
    vals_host = [flat[k][2].signed_value * scale for k in order]
    per_tensor = {}
    for slot, k in enumerate(order):
        per_tensor.setdefault(flat[k][1], []).append(slot)
    seg = None
    for i, slots in per_tensor.items():
        t = out[i]
        lo, hi = int(batch.seg_start[slots[0]]), int(batch.seg_start[slots[-1] + 1])
        if dev.type == "cpu":  # index_add_ is sequential on CPU: rank order is kept
            v = torch.tensor([vals_host[s] for s in slots], dtype=t.dtype, device=dev)
            rep = torch.from_numpy(counts[slots[0]:slots[-1] + 1]).to(dev)
            src = torch.repeat_interleave(v, rep, output_size=hi - lo)
            t.index_add_(0, batch.pos[lo:hi], src)
        else:
            for s in slots:
                a, b = int(batch.seg_start[s]), int(batch.seg_start[s + 1])
                t.index_put_((batch.pos[a:b],), torch.tensor(vals_host[s], dtype=t.dtype,
                                                             device=dev), accumulate=True)
    del seg


def allgather(step: torch.Tensor, name: str) -> torch.Tensor:
    """Blocking allgather of step messages (every rank's, concatenated in rank order)."""
    import horovod.torch as hvd
    return hvd.allgather(step, name=name)


def allgather_async(step: torch.Tensor, name: str):
    import horovod.torch as hvd
    return hvd.allgather_async(step, name=name)


def synchronize(handle) -> torch.Tensor:
    import horovod.torch as hvd
    return hvd.synchronize(handle)
