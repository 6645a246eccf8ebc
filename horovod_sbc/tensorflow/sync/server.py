"""The ``"server"`` topology in TensorFlow graph pieces, as torch's
(:mod:`horovod_sbc.torch.sync.server`; Zou, De Sterck, Liu, arXiv 2209.15203): rank 0 gathers
every rank's step message, decodes and averages them, adds its server residual, compresses the
average again at ``downlink_density`` (:mod:`.downlink`) and broadcasts that one message; every
rank, rank 0 included, decodes the same downlink.

Horovod has no gather, so the gather and the broadcast are mpi4py's buffer-based ``Gatherv`` and
``Bcast`` (no pickling) on a duplicate of the MPI world communicator Horovod runs on, in
``tf.numpy_function`` host steps: the MPI controller only (Gloo has no gather; the sync says so
while it is built).
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ...mpi import server_communicator
from ..backend import Backend
from .downlink import Downlink, reencode

ROOT = 0
def communicator():
    """The server's MPI communicator (:func:`horovod_sbc.mpi.server_communicator`)."""
    import horovod.tensorflow as hvd
    return server_communicator(hvd)


def gather_host(step: np.ndarray) -> np.ndarray:
    """Every rank's uint8 ``step`` concatenated in rank order at the root; empty elsewhere."""
    comm = communicator()
    mine = np.ascontiguousarray(step, np.uint8)
    root = comm.Get_rank() == ROOT
    sizes = np.zeros(comm.Get_size(), np.int64) if root else None
    comm.Gather(np.array([mine.size], np.int64), sizes, root=ROOT)
    buf = np.empty(int(sizes.sum()) if root else 0, np.uint8)
    comm.Gatherv(mine, (buf, sizes) if root else None, root=ROOT)
    return buf


def broadcast_host(msg: np.ndarray) -> np.ndarray:
    """The root's uint8 ``msg`` on every rank (its length first)."""
    comm = communicator()
    root = comm.Get_rank() == ROOT
    n = np.array([msg.size if root else 0], np.int64)
    comm.Bcast(n, root=ROOT)
    data = np.ascontiguousarray(msg, np.uint8) if root else np.empty(int(n[0]), np.uint8)
    comm.Bcast(data, root=ROOT)
    return data


def _host(fn, t: tf.Tensor, name: str) -> tf.Tensor:
    out = tf.numpy_function(fn, [t], tf.uint8, stateful=True, name=name)
    out.set_shape([None])
    return out


def exchange_server(backend: Backend, step: tf.Tensor, layout, *, rank: int, size: int,
                    scale: float, downlink: Downlink, server_residuals: Sequence[tf.Tensor],
                    acc_dtype: tf.DType,
                    count: Callable[..., list]) -> Tuple[tf.Tensor, List[tf.Tensor]]:
    """This rank's ``step`` (of ``layout``) through the server (``scale`` x the sum of the
    uplinks is the average compressed again): ``(downlink step, new server residuals)`` (the residuals: rank 0's, else empty). ``count(**bits)`` returns the ops that
    count the traffic as torch does (``upstream_bits``; rank 0 ``server_in_bits`` and
    ``server_out_bits``, the others ``downstream_bits``)."""
    communicator()  # a missing MPI controller is an error now, not inside the graph
    gathered = _host(gather_host, step, "sbc_server_gather")
    size_of = lambda t: tf.size(t, out_type=tf.int64)  # noqa: E731
    new = list(server_residuals)
    if rank == ROOT:
        ops = count(server_in_bits=8 * (size_of(gathered) - size_of(step)))
        with tf.control_dependencies(ops):
            down, new = reencode(backend, gathered, layout, size, scale, server_residuals,
                                 downlink, ROOT, "the server rejected an uplink", acc_dtype)
    else:
        down = gathered  # empty here; the broadcast must follow the gather (MPI's order)
    down = _host(broadcast_host, down, "sbc_server_broadcast")
    if rank == ROOT:
        ops = count(upstream_bits=8 * size_of(step),
                    server_out_bits=8 * size_of(down) * (size - 1))
    else:
        ops = count(upstream_bits=8 * size_of(step), downstream_bits=8 * size_of(down))
    with tf.control_dependencies(ops):
        return tf.identity(down), new
