"""The MPI communicator of the ``"server"`` topology, for torch and TensorFlow alike.

Horovod has no gather (its allgather sends everything to everyone, which is what the server
topology avoids), so the server's messages travel by mpi4py's buffer-based ``Gatherv``/``Bcast``
(no pickling) on a duplicate of the MPI world communicator Horovod runs on; the duplicate keeps
them apart from Horovod's own traffic.
"""
from __future__ import annotations

_COMM = None


def server_communicator(hvd):
    """The duplicate of MPI's world communicator (created by the first call, a collective:
    every rank builds its first sync together); ``hvd`` is ``horovod.torch`` or
    ``horovod.tensorflow``. Raises ``ValueError`` under Gloo and ``ImportError`` without
    mpi4py, with what to do."""
    global _COMM
    if _COMM is None:
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
        _COMM = MPI.COMM_WORLD.Dup()
    return _COMM
