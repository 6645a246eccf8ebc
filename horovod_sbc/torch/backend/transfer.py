"""Host data onto the device without stalling it: every host-to-device copy of the torch
backends goes through :func:`upload`.

PyTorch copies pageable host memory to CUDA synchronously: ``t.to("cuda")`` of a tensor made
from host data waits until every kernel queued before it on the stream has run, so each such
upload is a host synchronisation, like a read. Staged in pinned (page-locked) memory, the copy
is asynchronous (``non_blocking=True``): it is queued on the current stream behind the kernels
that produced what it depends on, and the host goes on. PyTorch's caching host allocator keeps
the pinned block alive until the copy has run, so the staging buffer needs no care here.

What the backends upload are small plans and headers (kilobytes), never an O(numel) tensor.
"""
from __future__ import annotations

from typing import Union

import numpy as np
import torch

HostData = Union[bytes, bytearray, np.ndarray]


def upload(data: HostData, device) -> torch.Tensor:
    """``data`` as a tensor on ``device``: ``bytes``/``bytearray`` become uint8, a numpy array
    keeps its dtype and shape. On the CPU the tensor shares a private copy of ``bytes`` (or the
    array's memory); on CUDA it is an asynchronous copy from pinned memory (see the module
    docstring); other devices take a plain copy."""
    if isinstance(data, (bytes, bytearray)):
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
            torch.zeros(0, dtype=torch.uint8)
    else:
        host = torch.from_numpy(np.ascontiguousarray(data))
    dev = torch.device(device)
    if dev.type == "cpu":
        return host
    if dev.type == "cuda":
        return host.pin_memory().to(dev, non_blocking=True)
    return host.to(dev)
