"""Transports: the collective a sync's step messages travel by (GRACE's *Communicator* seam).

Sparse messages cannot be summed by allreduce, so every rank allgathers every rank's step
message (one ``uint8`` tensor each, of varying length unless ``fixed_size``) and decodes all of
them in rank order. A transport has ``world() -> (size, rank)`` and ``allgather(step, tag) ->``
every rank's step message concatenated in rank order (uint8, on ``step``'s device); the step
header declares its own length, so the concatenation is split without a second allgather of
sizes. :class:`HorovodTransport` is Horovod's allgather, :class:`ProcessGroupTransport`
``torch.distributed``'s.
"""
from __future__ import annotations

from typing import Tuple

import torch


class HorovodTransport:
    """The default transport of :class:`~horovod_sbc.torch.SBC`: Horovod's ``allgather``.

    A *transport* is the seam between the exchange logic (:func:`horovod_sbc.torch.sync.synchronize`: encode, verdicts,
    decode, error feedback) and the collective library. It has ``world() -> (size, rank)`` and
    ``allgather(step, tag) -> every rank's step message concatenated in rank order`` (uint8, on
    ``step``'s device). :class:`ProcessGroupTransport` is the ``torch.distributed`` one.
    """

    def world(self) -> Tuple[int, int]:
        import horovod.torch as hvd
        if not hvd.is_initialized():
            raise RuntimeError("horovod is not initialized: call hvd.init() first")
        return hvd.size(), hvd.rank()

    def allgather(self, step: torch.Tensor, tag: str) -> torch.Tensor:
        return allgather(step, tag)  # looked up at call time (tests record the traffic)

    def alltoall(self, buf: torch.Tensor, splits, tag: str) -> torch.Tensor:
        """``buf`` (uint8) cut into ``splits[r]`` bytes for each rank r in rank order; returns
        what every rank sent this one, concatenated in rank order."""
        return alltoall(buf, splits, tag)


class ProcessGroupTransport:
    """Allgather of variable-length step messages with ``torch.distributed`` collectives only.

    Two collectives per exchange, nothing pickled: an all-gather of every rank's message length
    (one int64 each), then one all-gather of the messages zero-padded to the longest; each rank's
    bytes are then cut back to its length and concatenated in rank order, which is exactly what
    Horovod's ``allgather`` returns, so one decoder serves both. Works with gloo (CPU
    tensors) and NCCL (CUDA tensors): all buffers live on the step message's device and only the
    ``size`` lengths cross to the host.

    Args:
        group: the process group (``None``: the default group).
        equal_sizes: every rank's step message has the same length every time
            (``SBC(fixed_size=True)``: PADDED steps of the layout's capacity), so the lengths
            are not exchanged (one collective, no host read).

    Attributes (cumulative, this rank): ``sent_bytes`` the bytes this rank put into the collectives
    (its padded message plus its 8-byte length), ``received_bytes`` what it got from the other
    ranks, ``padding_bytes`` the zero padding among ``sent_bytes``.
    """

    def __init__(self, group=None, equal_sizes: bool = False):
        self.group = group
        self.equal_sizes = equal_sizes
        self.sent_bytes = 0
        self.received_bytes = 0
        self.padding_bytes = 0

    def world(self) -> Tuple[int, int]:
        import torch.distributed as dist
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "torch.distributed.init_process_group() first")
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        import torch.distributed as dist
        # all_gather_single is the newer name of all_gather_into_tensor (deprecated in 2.13)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, inp, group=self.group)

    def allgather(self, step: torch.Tensor, tag: str) -> torch.Tensor:
        size, _ = self.world()
        dev = step.device
        if self.equal_sizes:
            buf = torch.empty(size * step.numel(), dtype=torch.uint8, device=dev)
            self._all_gather(buf, step.contiguous())
            self.sent_bytes += step.numel()
            self.received_bytes += (size - 1) * step.numel()
            return buf
        lengths = torch.empty(size, dtype=torch.int64, device=dev)
        self._all_gather(lengths, torch.full((1,), step.numel(), dtype=torch.int64, device=dev))
        ls = [int(n) for n in lengths.tolist()]  # O(world size) control values
        width = max(ls)
        pad = width - step.numel()
        padded = torch.cat([step, step.new_zeros(pad)]) if pad else step
        buf = torch.empty(size * width, dtype=torch.uint8, device=dev)
        self._all_gather(buf, padded.contiguous())
        self.sent_bytes += width + 8
        self.received_bytes += (size - 1) * (width + 8)
        self.padding_bytes += pad
        if all(n == width for n in ls):
            return buf
        return torch.cat([buf[r * width:r * width + n] for r, n in enumerate(ls)])


def allgather(step: torch.Tensor, name: str) -> torch.Tensor:
    """Blocking allgather of step messages (every rank's, concatenated in rank order)."""
    import horovod.torch as hvd
    return hvd.allgather(step, name=name)


def alltoall(buf: torch.Tensor, splits, name: str) -> torch.Tensor:
    """Blocking alltoall of uint8 bytes with per-rank ``splits`` (Horovod's)."""
    import horovod.torch as hvd
    out, _ = hvd.alltoall(buf, splits=torch.tensor(splits, dtype=torch.int32), name=name)
    return out
