"""SBCState in one process, without a Horovod job: which optimizers it takes, and commit /
restore of the drop-in (weights, shared weights, residual in the weights, momentum, position in
the delay window). The multi-rank resets are tests/test_elastic.py."""
import pytest
import torch

pytest.importorskip("horovod.torch")
import horovod_sbc.torch as sbc  # noqa: E402
from horovod_sbc.torch.elastic import SBCState, compression_of  # noqa: E402


def drop_in(delay=4):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = sbc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters(),
                                   compression=sbc.SBC(density=0.2, delay=delay))
    return model, opt


def local_step(model, opt, seed):
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()  # delay 4: a local step, no sync, no Horovod collective


def test_an_optimizer_without_sbc_is_refused_with_what_to_use():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="SBCState needs an optimizer with SBC compression.*"
                                         "hvd.elastic.TorchState"):
        SBCState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert compression_of(torch.optim.SGD(model.parameters(), lr=0.1)) is None


def test_restore_returns_the_drop_in_to_its_last_commit_bit_for_bit():
    model, opt = drop_in()
    state = SBCState(model, opt, step=0)
    local_step(model, opt, 1)
    state.step = 1
    state.save()  # what commit() saves (commit() also asks the driver for host updates)
    saved = {"w": [p.detach().clone() for p in model.parameters()],
             "ref": {k: v.clone() for k, v in opt.compression.manager.reference.items()},
             "res": {k: v.clone() for k, v in opt.residuals().items()},
             "mom": [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()],
             "local": opt.local_steps_pending}
    assert saved["local"] == 1 and max(float(r.abs().max()) for r in saved["res"].values()) > 0
    for seed in (2, 3):
        local_step(model, opt, seed)
    state.step = 3
    assert not torch.equal(model.weight, saved["w"][0])
    state.restore()
    assert state.step == 1 and opt.local_steps_pending == 1
    for p, w in zip(model.parameters(), saved["w"]):
        assert torch.equal(p, w)
    for k, v in opt.compression.manager.reference.items():
        assert torch.equal(v, saved["ref"][k])
    for k, v in opt.residuals().items():
        assert torch.equal(v, saved["res"][k])
    for p, m in zip(model.parameters(), saved["mom"]):
        assert torch.equal(opt.state[p]["momentum_buffer"], m)
    # the restored state is a copy: training on does not change what a second restore loads
    local_step(model, opt, 4)
    state.restore()
    for p, w in zip(model.parameters(), saved["w"]):
        assert torch.equal(p, w)
    for p, m in zip(model.parameters(), saved["mom"]):
        assert torch.equal(opt.state[p]["momentum_buffer"], m)
