"""What one sync needs and keeps between syncs: the narrow state of the torch sync driver.

:class:`SyncState` is all that :func:`horovod_sbc.torch.sync.synchronize` and the stock hook
read: the validated knobs (:class:`horovod_sbc.config.SBCConfig`), the
:class:`~horovod_sbc.residual.ResidualManager` (residuals, reference weights, counters), the
transport (Horovod's allgather, or ``torch.distributed`` for the DDP hook), the codec backend of
each device it meets (:func:`horovod_sbc.torch.backend.backend_for`, chosen once), and two
per-tensor scratch objects: the buffer a tensor's sent positions live in between encode and commit, and
TernGrad's random stream. The user-facing :class:`horovod_sbc.torch.SBC` owns one.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ... import registry
from ...config import SBCConfig
from ...residual import ResidualManager
from ..backend import Backend, PositionBuffer, backend_for


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 updates are accumulated in fp32 (small updates would vanish in 16 bits)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class SyncState:
    """Configuration, residual manager, transport and per-tensor scratch of one compressor."""

    def __init__(self, config: SBCConfig, transport, manager: Optional[ResidualManager] = None,
                 backend: Optional[Backend] = None):
        self.config = config
        self._backend = backend
        self._backends: Dict[str, Backend] = {}
        self.manager = manager if manager is not None else ResidualManager()
        self.manager.config.update(config.record())
        self.transport = transport
        self._positions: Dict[str, PositionBuffer] = {}
        self._gen: Optional[torch.Generator] = None
        self._saved_gen = None

    def backend(self, device) -> Backend:
        """The codec for tensors on ``device``: the one given at construction, else
        :func:`~horovod_sbc.torch.backend.backend_for`'s choice, made at this state's first use
        of the device and kept."""
        if self._backend is not None:
            return self._backend
        key = str(torch.device(device))
        b = self._backends.get(key)
        if b is None:
            b = self._backends[key] = backend_for(device)
        return b

    def world(self) -> Tuple[int, int]:
        """(size, rank) of the transport's job, recorded for checkpoint checks."""
        size, rank = self.transport.world()
        self.manager.config.update(world_size=size, rank=rank)
        return size, rank

    def residual(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The flat residual of ``name`` (created as zeros shaped like ``like``)."""
        return self.manager.residual(
            name, lambda: torch.zeros(like.numel(), dtype=residual_dtype(like.dtype),
                                      device=like.device))

    def position_buffer(self, name: str) -> PositionBuffer:
        """Where ``name``'s sent positions live between its encode and its error-feedback
        commit (reused every step: no fresh page-faulted tensor per tensor per step)."""
        buf = self._positions.get(name)
        if buf is None:
            buf = self._positions[name] = PositionBuffer()
        return buf

    def generator(self, device) -> Optional[torch.Generator]:
        """TernGrad's random stream on ``device`` (None for the deterministic modes), seeded by
        ``seed`` and the rank, resumed from a checkpoint's state where one was loaded."""
        if not registry.get(self.config.mode).random:
            return None
        if self._gen is None or self._gen.device != torch.device(device):
            _, rank = self.world()
            self._gen = torch.Generator(device=device)
            self._gen.manual_seed(self.config.seed + 1_000_003 * rank)
            saved, self._saved_gen = self._saved_gen, None
            if saved is not None:
                self._gen.set_state(saved)
        return self._gen

    def state_dict(self) -> dict:
        """This rank's residuals, reference weights, counters (and TernGrad's generator)."""
        st = self.manager.state_dict()
        if self._gen is not None:
            st["generator"] = self._gen.get_state()
        return st

    def load_state_dict(self, state: dict) -> None:
        """Restore residuals and counters (see :meth:`horovod_sbc.torch.SBC.load_state_dict`)."""
        try:
            self.world()  # record this job's size and rank to compare with the checkpoint's
        except (RuntimeError, ImportError, ValueError):
            pass

        def copy(dst, src):
            if dst is not None and dst.shape == src.shape:
                return dst.copy_(src)
            return src.detach().clone()
        self.manager.load_state_dict(state, copy)
        self._saved_gen, self._gen = state.get("generator"), None
