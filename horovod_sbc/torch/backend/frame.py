"""Step messages in torch: the 24-byte step header around a rank's tensor messages.

The header (:mod:`horovod_sbc.wire`, "Step messages") carries the body's length and CRC-32 and
the layout fingerprint; a rank that cannot encode sends an ERROR (or SKIP) step instead, so the
other ranks learn of it from the same collective and nobody hangs. A PADDED step (``capacity``:
``SBC(fixed_size=True)``) is exactly ``capacity`` bytes, zero padded after the content, so every
rank's message has the same size every step. Compressed messages are kilobytes: the header is
computed from the body's bytes on the host here, for tensor messages encoded one by one (the
tensor-op backend's encoding of a whole sync computes the CRC on the device instead, with no
host read: :func:`horovod_sbc.torch.backend.fused.frame_device`).
"""
from __future__ import annotations

import functools
import zlib
from typing import Optional, Sequence, Tuple

import torch

from ... import reference, wire
from . import transfer


def host_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a (small) uint8 tensor on the host: one device-to-host copy."""
    return t.detach().to("cpu").numpy().tobytes()


def device_bytes(b: bytes, device) -> torch.Tensor:
    """``b`` as a uint8 tensor on ``device``: one asynchronous host-to-device copy."""
    return transfer.upload(b, device)


def frame(msgs: Sequence[torch.Tensor], layout_crc: int, device,
          capacity: Optional[int] = None) -> torch.Tensor:
    """One step message (uint8 tensor on ``device``) from tensor messages; with ``capacity``
    a PADDED one of exactly that many bytes (the body's CRC continues over the zero bytes
    without building them on the host)."""
    body = torch.cat(list(msgs)) if msgs else torch.zeros(0, dtype=torch.uint8, device=device)
    return frame_body(body, len(msgs), layout_crc, capacity)


def frame_body(body: torch.Tensor, n_tensors: int, layout_crc: int,
               capacity: Optional[int] = None) -> torch.Tensor:
    """The step message of ``body`` (``n_tensors`` tensor messages back to back)."""
    host = host_bytes(body)
    if capacity is None:
        head = wire.step_header_bytes(host, layout_crc, n_tensors)
        return torch.cat([device_bytes(head, body.device), body])
    pad = capacity - wire.STEP_HEADER_SIZE - len(host)
    if pad < 1:
        raise AssertionError(f"horovod_sbc: a step body of {len(host)} bytes exceeds its "
                             f"capacity of {capacity - wire.STEP_HEADER_SIZE}")
    crc = zlib.crc32(bytes(pad), zlib.crc32(host)) & 0xFFFFFFFF
    head = wire.STEP_HEADER.pack(wire.STEP_MAGIC, wire.VERSION, wire.STEP_FLAG_PADDED, 0,
                                 len(host) + pad, layout_crc, n_tensors, crc)
    return torch.cat([device_bytes(head, body.device), body, body.new_zeros(pad)])


def step_header_bytes(body_len: int, layout_crc: int, n_tensors: int) -> bytes:
    """The 24-byte header of a TENSORS step of a ``body_len``-byte body, its CRC field zero
    (for a CRC computed later, on the device)."""
    return wire.STEP_HEADER.pack(wire.STEP_MAGIC, wire.VERSION, 0, 0, body_len, layout_crc,
                                 n_tensors, 0)


def error_frame(reason: str, layout_crc: int, skip: bool, device, origin: int,
                capacity: Optional[int] = None) -> torch.Tensor:
    """The ERROR (``skip``: SKIP) step message naming rank ``origin`` and ``reason``."""
    return device_bytes(wire.error_step_message(reason, layout_crc, skip, origin, capacity),
                        device)


def error_padding(reason: str, layout_crc: int, skip: bool, origin: int,
                  capacity: Optional[int]) -> int:
    """Zero bytes a PADDED ERROR/SKIP step carries after its reason (0 without capacity): a
    reason holds no zero byte, so the padding is what ``rstrip`` drops."""
    if capacity is None:
        return 0
    raw = wire.error_step_message(reason, layout_crc, skip, origin, capacity)
    return len(raw) - len(raw.rstrip(b"\0"))


def step_capacity(layout: Sequence[Tuple[str, Sequence[int]]], config,
                  equal_sizes: bool = False) -> Optional[int]:
    """The bytes of every step message of ``layout`` under ``config`` (an
    :class:`~horovod_sbc.config.SBCConfig`) when its messages are padded
    (:meth:`~horovod_sbc.config.SBCConfig.padded`; ``equal_sizes``: the collective needs one
    size from every rank), else None."""
    if not config.padded(equal_sizes):
        return None
    return _step_capacity(tuple(wire.layout_numel(s) for _, s in layout), config.density,
                          config.mode)


@functools.lru_cache(maxsize=256)
def _step_capacity(numels: Tuple[int, ...], density: float, mode: str) -> int:
    return reference.step_capacity(numels, density, mode)
