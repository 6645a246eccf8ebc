"""The ``"server"`` topology (Zou, De Sterck, Liu, "Downlink Compression Improves TopK
Sparsification", arXiv 2209.15203): rank 0 gathers every rank's step message, decodes and
averages them, adds its own server residual, compresses the average at ``downlink_density`` and
broadcasts that one message; every rank, rank 0 included, applies the same decoded downlink.

Transport: a real gather to the root and a broadcast back, by mpi4py
(:mod:`horovod_sbc.mpi`).
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from ... import wire
from ...mpi import server_communicator
from ...reference import keep_count
from ..backend import Encoded, Targets, frame
from ..backend.streams import empty_positions, encode_positions

def _comm():
    """The server's MPI communicator (:func:`horovod_sbc.mpi.server_communicator`)."""
    import horovod.torch as hvd
    return server_communicator(hvd)


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


def exchange(state, step: torch.Tensor, layout, size: int, rank: int, targets: Targets,
             acc_dtype) -> List[torch.Tensor]:
    """One sync through the server: the uplinks gathered to rank 0 (nothing goes to the other
    workers), one downlink broadcast and decoded into ``targets`` on every rank."""
    root = 0
    gathered = gather(step, root)
    state.manager.add(upstream_bits=8 * step.numel())
    down = None
    if rank == root:
        state.manager.add(server_in_bits=8 * (gathered.numel() - step.numel()))
        down = server_step(state, gathered, layout, size, acc_dtype, step.device)
    down = broadcast(down, root, step.device)
    if rank == root:
        state.manager.add(server_out_bits=8 * down.numel() * (size - 1))
    else:
        state.manager.add(downstream_bits=8 * down.numel())
    return list(state.backend(down.device).decode(down, layout, 1, targets, 1.0))


def server_step(state, gathered: torch.Tensor, layout, size: int, acc_dtype,
                dev) -> torch.Tensor:
    """Root only: the downlink step message for the gathered uplinks (or an error frame that
    makes every rank fail or skip together)."""
    fp = wire.layout_fingerprint(layout)
    backend = state.backend(gathered.device)
    try:
        avg = backend.decode(gathered, layout, size, Targets.new(layout, acc_dtype, dev),
                             1.0 / size)
    except wire.PeerError as e:
        return frame.error_frame(e.reason, fp, e.skip, dev, e.rank)  # relay it
    except ValueError as e:  # a malformed uplink: everybody must hear about it
        return frame.error_frame(f"the server rejected an uplink: {e}", fp, False, dev, 0)
    msgs = []
    srv = state.manager.server_residuals
    cfg = state.config
    for (name, _), a in zip(layout, avg):
        if cfg.downlink_density is None:  # dense downlink: exact average, no residual
            msgs.append(backend.encode_tensor(a, 1.0, "values", name).message)
            continue
        r = srv.get(name)
        if r is None or r.numel() != a.numel():
            r = srv[name] = torch.zeros_like(a)
        r.add_(a)  # server-side error feedback
        enc = encode_downlink(backend, r, cfg.downlink_density, cfg.downlink_compressor, name,
                              cfg.selection)
        enc.commit()
        msgs.append(enc.message)
    return frame.frame(msgs, fp, dev)


def encode_downlink(backend, r: torch.Tensor, density: float, mode: str, name: str,
                    selection: str) -> Encoded:
    """The server's message for the residual-corrected average ``r``: never a zero-valued
    position. With few ranks the average often has fewer non-zeros than the downlink's k (2 ranks
    at p=0.01 send 2k positions at most, the downlink keeps k of a sum of sparse messages), so k
    is min(k, non-zeros) (one count crosses to the host)."""
    n = r.numel()
    k = keep_count(n, density)
    nz = int(torch.count_nonzero(r)) if n else 0
    if nz == 0:
        empty = empty_positions(r.device)
        return Encoded(encode_positions(empty, n), empty, r.new_zeros(0), r,
                       backend.subtract_sent)
    return backend.encode_tensor(r, density if nz >= k else nz / n, mode, name,
                                 selection=selection)
