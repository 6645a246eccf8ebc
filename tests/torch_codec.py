"""The torch backends as the tests call them (:mod:`horovod_sbc.torch.backend`): a gathered step
decoded into new outputs, one flat tensor encoded (or encoded and committed), by the backend a
device gets or a given one."""
from typing import Optional

import torch

from horovod_sbc.torch.backend import Backend, Targets, backend_for


def as_bytes_tensor(buf) -> torch.Tensor:
    if isinstance(buf, torch.Tensor):
        return buf
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8)


def decode(gathered, layout, n_ranks: int, scale: float = 1.0, dtype=torch.float32,
           backend: Optional[Backend] = None):
    """``scale`` x every rank's tensors of ``gathered`` (uint8 tensor or bytes) summed, in rank
    order, into new outputs of ``dtype`` (a list in layout order)."""
    g = as_bytes_tensor(gathered)
    b = backend if backend is not None else backend_for(g.device)
    return list(b.decode(g, layout, n_ranks, Targets.new(layout, dtype, g.device), scale))


def encode(a: torch.Tensor, density: float, mode="sbc", name: str = "tensor",
           selection: str = "paper", backend: Optional[Backend] = None, **kw):
    """(message, positions, values sent) of one flat update (a source or a tensor)."""
    src_dev = a.device if isinstance(a, torch.Tensor) else next(
        v for v in vars(a).values() if isinstance(v, torch.Tensor)).device
    b = backend if backend is not None else backend_for(src_dev)
    enc = b.encode_tensor(a, density, mode, name, selection, **kw)
    return enc.message, enc.positions, enc.sent


def compress_(a: torch.Tensor, density: float, mode="sbc", name: str = "tensor",
              selection: str = "paper"):
    """Encode the flat update ``a`` and commit at once (``a`` becomes the new residual):
    (message, positions sent)."""
    enc = backend_for(a.device).encode_tensor(a, density, mode, name, selection)
    enc.commit()
    return enc.message, enc.positions.numel()


def decode_into(gathered, layout, n_ranks: int, targets: Targets, scale: float = 1.0,
                backend: Optional[Backend] = None):
    """Decode into the given :class:`~horovod_sbc.torch.backend.Targets`; returns the outputs."""
    g = as_bytes_tensor(gathered)
    b = backend if backend is not None else backend_for(g.device)
    return list(b.decode(g, layout, n_ranks, targets, scale))
