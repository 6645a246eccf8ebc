"""The device path of a sync (:func:`horovod_sbc.torch.sync.synchronize`) for the tensors the C
kernels do not take (CUDA tensors, or the kernels off): every update encoded by the fused encoder
(:mod:`horovod_sbc.torch.fused`), and every rank's binary messages decoded and added together,
so that the host reads, uploads and tensor ops of a sync do not grow with the number of tensors.

Used for SBC (``mode="sbc"``, ``selection="paper"``) on float32 updates on one device, when every
update keeps its residual in the weights (the drop-in optimizer's default, ``Update.in_weights``)
or every update is a plain value added to its residual (the DDP hook). The messages, the decoded
sums and the weights and residuals afterwards are bit for bit those of the per-tensor path
(``tests/test_fused.py``). An update with NaN/Inf leaves everything untouched here and is
handed to the per-tensor path, which reports it.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .. import protocol, wire
from . import decoder, exchange
from .codec import NonFiniteError, _kernels_for
from .fused import FusedEncoding, encode_fused, frame_fixed


def eligible(state, updates) -> bool:
    """Does this sync take the fused device path? (See the module docstring.)"""
    cfg = state.config
    if not updates or cfg.mode != "sbc" or cfg.selection != "paper":
        return False
    dev = updates[0].value.device
    in_weights = updates[0].in_weights
    for u in updates:
        if u.value.dtype != torch.float32 or u.value.device != dev or \
                u.base_offset is not None or u.in_weights != in_weights:
            return False
        if in_weights and (u.base is None or u.base.dtype != torch.float32):
            return False
        if not in_weights and u.base is not None:
            return False
    return _kernels_for(updates[0].value.reshape(-1)[:1]) is None


@dataclass
class FusedStep:
    """One encoded sync: the framed step message, and the error feedback to commit once every
    rank's message decoded (``positions``/``residual`` sized as the per-tensor path's).
    ``targets``: the flat tensors that hold the residual (the weights, or the residuals)."""
    step: torch.Tensor
    encoding: FusedEncoding
    targets: List[torch.Tensor]

    @property
    def positions(self) -> torch.Tensor:
        return self.encoding.positions

    @property
    def residual(self) -> torch.Tensor:
        return self.encoding.flat

    def commit(self) -> None:
        """What was sent leaves the residual: ``R[pos] -= mu`` (``R - 0`` elsewhere, exact)."""
        enc = self.encoding
        if not enc.positions.numel():
            return
        sent = torch.zeros_like(enc.flat).index_add_(0, enc.positions, enc.values)
        torch._foreach_sub_(self.targets, list(torch.split(sent, [t.numel() for t in
                                                                  self.targets])))


def encode(state, updates, layout_crc: int, capacity: Optional[int] = None
           ) -> Optional[FusedStep]:
    """Encode every update at once and frame the step message, or None (nothing written)
    when an update holds NaN/Inf: the per-tensor path then reports it with its own rules for
    the residuals. Kept in the weights, the update is ``W - W_ref``; otherwise ``R + dW``,
    which becomes the residuals (as the per-tensor path's ``R += dW``) once it encoded."""
    if updates[0].in_weights:
        targets = [u.weights_flat() for u in updates]
        flat = torch.cat(targets) - torch.cat([u.base.reshape(-1) for u in updates])
    else:
        targets = [state.residual(u.name, u.value) for u in updates]
        for u, r in zip(updates, targets):
            if r.numel() != u.value.numel() or r.dtype != torch.float32:
                return None  # the per-tensor path explains the mismatch
        flat = torch.cat(targets) + torch.cat([u.value.reshape(-1) for u in updates])
    try:
        enc = encode_fused(flat, [t.numel() for t in targets], state.config.density,
                           [u.name for u in updates])
    except NonFiniteError:
        return None
    if not updates[0].in_weights:
        torch._foreach_copy_(targets, list(torch.split(flat, [t.numel() for t in targets])))
    return FusedStep(frame(enc.body, layout_crc, len(updates), capacity), enc, targets)


def frame(body: torch.Tensor, layout_crc: int, n_tensors: int,
          capacity: Optional[int] = None) -> torch.Tensor:
    """The step message of a body of ``n_tensors`` tensor messages (one host read of the body
    for its CRC, one upload of the 24-byte header); with ``capacity`` a PADDED one, whose CRC
    is computed on the device (:func:`horovod_sbc.torch.fused.frame_fixed`): no host read."""
    if capacity is not None:
        pad = capacity - wire.STEP_HEADER_SIZE - body.numel()
        if pad < 1:
            raise AssertionError(f"horovod_sbc: a step body of {body.numel()} bytes exceeds "
                                 f"its capacity of {capacity - wire.STEP_HEADER_SIZE}")
        return frame_fixed(torch.cat([body, body.new_zeros(pad)]), layout_crc, n_tensors)
    head = wire.step_header_bytes(exchange._host_bytes(body), layout_crc, n_tensors)
    return torch.cat([exchange._device_bytes(head, body.device), body])


def decodable(step: protocol.GatheredStep) -> bool:
    """Every message binary (or empty) with a Rice parameter the batch decoder takes."""
    return all(not (m.all_positions or m.has_values or m.has_signs) and
               m.rice_b <= decoder.MAX_BATCH_RICE_B for _, _, m, _ in step.flat())


def decode_gathered(gathered: torch.Tensor, layout, n_ranks: int,
                    targets: Sequence[Sequence[torch.Tensor]], scale: float) -> bool:
    """Add ``scale`` x every rank's decoded tensors, rank by rank, to each list of flat
    ``targets`` (e.g. the shared and the local weights), as
    :func:`horovod_sbc.torch.exchange.decode_gathered` does with ``also``; False (nothing
    done) when a message is not binary (then the caller decodes the per-tensor way). Raises
    like it for a rank's error or a malformed step; nothing is added unless every message is
    valid."""
    step = protocol.parse_gathered(exchange._host_bytes(gathered), layout, n_ranks)
    if not decodable(step):
        return False
    flat = step.flat()  # rank-major: each rank's messages lie together
    sent = [k for k, (_, _, m, _) in enumerate(flat) if m.count]
    batch = decoder.decode_binary(gathered, [flat[k][2] for k in sent]) if sent else None
    if batch is not None and not batch.complete:
        return False  # corrupt: the per-message path gives the exact verdict
    stats = [protocol.StreamStats(sign_pad_nonzero=False, nonfinite=0)] * len(flat)
    for slot, k in enumerate(sent):
        stats[k] = protocol.StreamStats(*batch.stats[slot])
    protocol.check_streams(step, stats)
    if batch is not None:
        _add_rank_by_rank(batch, [flat[k] for k in sent], layout, n_ranks, targets, scale)
    return True


def _add_rank_by_rank(batch, msgs, layout, n_ranks: int, targets, scale: float) -> None:
    """One ``index_add_`` per rank and target list into the concatenated targets (positions
    are unique within a rank), then the sums copied back: each element receives its ranks'
    values in rank order, as the per-tensor decoder adds them."""
    numels = [wire.layout_numel(shape) for _, shape in layout]
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    dev = batch.pos.device
    counts = [m.count for _, _, m, _ in msgs]
    dtype = targets[0][0].dtype
    n = len(msgs)
    # one upload: offsets, counts and the values as float64 (rounded once to dtype on the
    # device, as a host tensor of dtype would be)
    vals = struct.unpack(f"<{n}q", struct.pack(f"<{n}d", *(m.signed_value * scale
                                                           for _, _, m, _ in msgs)))
    meta = torch.tensor([starts[i] for _, i, _, _ in msgs] + counts + list(vals),
                        dtype=torch.int64).to(dev)
    vals = meta[2 * n:].view(torch.float64).to(dtype)
    total = int(batch.seg_start[-1])
    gpos = batch.pos + torch.repeat_interleave(meta[:n], meta[n:2 * n], output_size=total)
    src = torch.repeat_interleave(vals, meta[n:2 * n], output_size=total)
    bounds = [0] * (n_ranks + 1)
    for (r, _, _, _), c in zip(msgs, counts):
        bounds[r + 1] += c
    for r in range(n_ranks):
        bounds[r + 1] += bounds[r]
    for outs in targets:
        acc = torch.cat(list(outs))
        for r in range(n_ranks):
            lo, hi = bounds[r], bounds[r + 1]
            if hi > lo:
                acc.index_add_(0, gpos[lo:hi], src[lo:hi])
        torch._foreach_copy_(list(outs), list(torch.split(acc, numels)))
