"""TopK in the server topology (issue 11, part 4): constructor and the zero-free downlink."""
import numpy as np
import pytest
import torch

from horovod_sbc import wire
from horovod_sbc.reference import keep_count
from horovod_sbc.torch import SBC, TopK
from horovod_sbc.torch.backend import backend_for
from horovod_sbc.torch.sync.server import encode_downlink


def test_topk_takes_the_server_topology():
    t = TopK(0.01, topology="server", downlink_density=0.02)
    assert t.topology == "server" and t.downlink_density == 0.02 and not t.binarize
    with pytest.raises(ValueError, match="server"):
        TopK(0.01, downlink_density=0.02)  # a downlink density needs the server topology


@pytest.mark.parametrize("cls", [TopK, SBC])
@pytest.mark.parametrize("nonzeros", [0, 1, 7, 50, 400])
def test_downlink_never_sends_zero_valued_positions(cls, nonzeros):
    n, dd = 1000, 0.1
    k = keep_count(n, dd)
    comp = cls(0.01, topology="server", downlink_density=dd)
    g = torch.Generator().manual_seed(nonzeros)
    r = torch.zeros(n)
    idx = torch.randperm(n, generator=g)[:nonzeros]
    r[idx] = torch.randn(nonzeros, generator=g)
    enc = encode_downlink(backend_for("cpu"), r.clone(), comp.downlink_density,
                          comp.config.downlink_compressor, "w", comp.selection)
    msg, pos, sent = enc.message, enc.positions, enc.sent
    assert bool((r[pos] != 0).all()) and bool((sent != 0).all())
    if cls is TopK:
        assert pos.numel() == min(k, nonzeros)
    else:  # binarized: one sign side, at most min(k, that side's non-zeros)
        assert pos.numel() <= min(k, nonzeros)
    hdr = wire.parse_tensor_header(msg.numpy().tobytes(), 0, n, "w")
    assert hdr.count == pos.numel()
    if nonzeros:
        assert np.isin(pos.numpy(), idx.numpy()).all()
