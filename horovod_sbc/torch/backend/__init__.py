"""The torch backends, chosen once per device (see :mod:`horovod_sbc.torch.backend.base`).

=====================  ==========================================================================
device                 backend
=====================  ==========================================================================
CPU, kernels built     :class:`~horovod_sbc.torch.backend.ckernels.KernelBackend`: the C kernels
                       for float32 SBC/top-k values and binary messages, tensor ops for the rest
anything else          :class:`~horovod_sbc.torch.backend.ops.OpsBackend`: tensor ops on the
                       device (CUDA; the CPU with ``HOROVOD_SBC_KERNELS=0`` or
                       :func:`horovod_sbc.kernels.disabled`)
=====================  ==========================================================================

Both produce the same bytes, verdicts and sums; the choice is only about speed.
"""
from __future__ import annotations

import torch

from ... import kernels
from .base import (Accumulate, Backend, DecodeJob, Difference, Encoded, InPlace,
                   NonFiniteError, PositionBuffer, Targets, reset_nonfinite_, restore_,
                   scratch)
from .ckernels import KernelBackend
from .ops import OpsBackend
# building blocks for a compressor's ``encode_torch`` (horovod_sbc/compressors/)
from .select import select_topk, tree_sum
from .streams import empty_positions, encode_positions

__all__ = ["Backend", "OpsBackend", "KernelBackend", "backend_for",
           "InPlace", "Accumulate", "Difference", "Encoded", "Targets", "DecodeJob",
           "NonFiniteError", "PositionBuffer", "reset_nonfinite_", "restore_", "scratch",
           "select_topk", "tree_sum", "empty_positions", "encode_positions"]

_OPS = OpsBackend()
_KERNELS = KernelBackend()


def backend_for(device) -> Backend:
    """The backend for tensors on ``device``: the C kernels on the CPU when they are built
    and enabled, else tensor ops."""
    if torch.device(device).type == "cpu" and kernels.lib() is not None:
        return _KERNELS
    return _OPS
