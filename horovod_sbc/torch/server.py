"""Transport of the ``"server"`` topology: a real gather to the root and a broadcast back.

Horovod has no gather (its allgather sends everything to everyone, which is what the server
topology avoids), so this uses mpi4py's buffer-based ``Gatherv``/``Bcast`` (no pickling) on a
duplicate of the MPI world communicator Horovod runs on. The duplicate keeps our messages apart
from Horovod's own traffic.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

_COMM = None


def _comm():
    global _COMM
    if _COMM is None:
        import horovod.torch as hvd
        if not hvd.mpi_enabled():
            raise ValueError("SBC(topology='server') needs Horovod's MPI controller: launch with "
                             "mpirun or horovodrun --mpi (Gloo has no gather)")
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ImportError("SBC(topology='server') needs mpi4py: pip install mpi4py") from e
        if MPI.COMM_WORLD.Get_size() != hvd.size():
            raise ValueError("SBC(topology='server'): mpi4py's world does not match Horovod's "
                             "(was Horovod initialised on a sub-communicator?)")
        _COMM = MPI.COMM_WORLD.Dup()  # collective: every rank reaches the first sync together
    return _COMM


def gather(step: torch.Tensor, root: int) -> Optional[torch.Tensor]:
    """Concatenation of every rank's ``step`` (uint8) in rank order at ``root``; None elsewhere."""
    comm = _comm()
    mine = np.ascontiguousarray(step.detach().to("cpu").numpy())
    sizes = np.zeros(comm.Get_size(), dtype=np.int64) if comm.Get_rank() == root else None
    comm.Gather(np.array([mine.size], dtype=np.int64), sizes, root=root)
    if comm.Get_rank() != root:
        comm.Gatherv(mine, None, root=root)
        return None
    buf = np.empty(int(sizes.sum()), dtype=np.uint8)
    comm.Gatherv(mine, (buf, sizes), root=root)
    return torch.from_numpy(buf).to(step.device)


def broadcast(msg: Optional[torch.Tensor], root: int, device) -> torch.Tensor:
    """``root``'s uint8 ``msg`` on every rank (its length is broadcast first)."""
    comm = _comm()
    if comm.Get_rank() == root:
        data = np.ascontiguousarray(msg.detach().to("cpu").numpy())
        n = np.array([data.size], dtype=np.int64)
    else:
        n = np.zeros(1, dtype=np.int64)
    comm.Bcast(n, root=root)
    if comm.Get_rank() != root:
        data = np.empty(int(n[0]), dtype=np.uint8)
    comm.Bcast(data, root=root)
    return msg if comm.Get_rank() == root else torch.from_numpy(data).to(device)
