"""SGD momentum folded into the learning rate (horovod_sbc.torch.momentum): the arithmetic.

The stock hook's fold (scale the averaged gradient, empty the velocity, let Horovod's SGD step)
and the drop-in's (step SGD without momentum at the folded learning rate) must both move the
weights by ``lr * (1 - dampening) / (1 - momentum) * (g + wd * w)`` at every step, for heavy
ball, dampening and Nesterov, with weight decay, and leave the user's settings as they were."""
import pytest
import torch

from horovod_sbc.torch.momentum import StockFold, check_choice, folded, stock_fold
from horovod_sbc.torch.owner import Owner

SETTINGS = [dict(momentum=0.9), dict(momentum=0.9, weight_decay=5e-4),
            dict(momentum=0.8, dampening=0.3, weight_decay=1e-2),
            dict(momentum=0.9, nesterov=True, weight_decay=5e-4)]


def _expected(w, grads, lr, momentum, dampening=0.0, weight_decay=0.0, nesterov=False):
    """Plain SGD at the folded learning rate, in float64."""
    w = w.double().clone()
    for g in grads:
        w -= lr * (1 - dampening) / (1 - momentum) * (g.double() + weight_decay * w)
    return w


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_the_stock_fold_steps_as_sgd_at_the_effective_learning_rate(kw):
    torch.manual_seed(0)
    w0 = torch.randn(40, 3)
    p = torch.nn.Parameter(w0.clone())
    other = torch.nn.Parameter(torch.randn(5))   # a group without momentum is not folded
    opt = torch.optim.SGD([{"params": [p], **kw}, {"params": [other], "momentum": 0.0}],
                          lr=0.05)
    fold = StockFold()
    grads = [torch.randn(40, 3) for _ in range(4)]
    o_before = other.detach().clone()
    for g in grads:
        avg = g.clone()
        og = torch.ones(5)
        plan = fold.plan([Owner("p", opt, p), Owner("other", opt, other)])
        assert plan[1] is None
        stock_fold(plan, [avg, og], [p, other])
        p.grad, other.grad = avg, og
        opt.step()
        assert float(opt.state[p]["momentum_buffer"].abs().max()) > 0  # SGD's own velocity ...
    # ... emptied before every step by the fold: the result is plain SGD at lr / (1 - m)
    torch.testing.assert_close(p.detach().double(), _expected(w0, grads, 0.05, **kw),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(other.detach(), o_before - 0.05 * 4 * torch.ones(5))


def test_without_the_fold_momentum_sgd_takes_other_steps():
    """The negative control: the same gradients through SGD's own momentum end elsewhere."""
    torch.manual_seed(0)
    w0 = torch.randn(40, 3)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=0.05, momentum=0.9)
    grads = [torch.randn(40, 3) for _ in range(4)]
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert not torch.allclose(p.detach().double(), _expected(w0, grads, 0.05, 0.9), atol=1e-3)


def test_a_skipped_step_empties_the_velocity_and_leaves_the_gradient():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    opt.state[p]["momentum_buffer"] = torch.full((3,), 7.0)
    g = torch.zeros(3)
    stock_fold(StockFold().plan([Owner("p", opt, p)]), None, [p])
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.zeros(3))
    assert torch.equal(g, torch.zeros(3))


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_the_drop_in_fold_steps_as_sgd_at_the_effective_learning_rate(kw):
    torch.manual_seed(1)
    w0 = torch.randn(7, 5)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=0.05, **kw)
    before = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    grads = [torch.randn(7, 5) for _ in range(3)]
    for g in grads:
        p.grad = g.clone()
        with folded(opt):
            opt.step()
        assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == before
    torch.testing.assert_close(p.detach().double(), _expected(w0, grads, 0.05, **kw),
                               rtol=1e-5, atol=1e-6)
    assert "momentum_buffer" not in opt.state[p] or opt.state[p]["momentum_buffer"] is None


def test_other_optimizers_are_not_folded_and_bad_choices_are_refused():
    p = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([p], lr=0.1)
    assert StockFold().plan([Owner("p", adam, p)]) == [None]
    rms = torch.optim.RMSprop([p], lr=0.1, momentum=0.9)
    with folded(rms):
        assert rms.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="momentum must be one of 'fold', 'mask', 'keep'"):
        check_choice("masking")


def test_the_fold_grows_as_the_velocity_of_a_constant_gradient():
    """At step t the folded factor is (1 - m^(t+1)) / (1 - m): the first step is SGD's own
    first momentum step (lr * g), and a constant gradient moves the weights as the heavy ball
    does at every step."""
    g = torch.tensor([1.0, -2.0, 0.5])
    heavy = torch.nn.Parameter(torch.zeros(3))
    fold_p = torch.nn.Parameter(torch.zeros(3))
    stock_p = torch.nn.Parameter(torch.zeros(3))
    h_opt = torch.optim.SGD([heavy], lr=0.1, momentum=0.9)
    f_opt = torch.optim.SGD([fold_p], lr=0.1, momentum=0.9)
    s_opt = torch.optim.SGD([stock_p], lr=0.1, momentum=0.9)
    fold = StockFold()
    for t in range(30):
        heavy.grad, fold_p.grad = g.clone(), g.clone()
        h_opt.step()
        with folded(f_opt, t):
            f_opt.step()
        avg = g.clone()
        stock_fold(fold.plan([Owner("p", s_opt, stock_p)], t), [avg], [stock_p])
        stock_p.grad = avg
        s_opt.step()
        torch.testing.assert_close(fold_p.detach(), heavy.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stock_p.detach(), heavy.detach(), rtol=1e-5, atol=1e-6)


def test_the_stock_fold_guard_survives_a_checkpoint():
    """The stock hook's state_dict carries its fold guards (what a blow-up cut and the running
    norm), restored for the folding optimizer met first after loading, before or after it."""
    from horovod_sbc.torch import SBC
    from horovod_sbc.torch.momentum import guard_of

    def setup():
        p = torch.nn.Parameter(torch.zeros(4))
        return p, torch.optim.SGD([p], lr=0.1, momentum=0.9)
    comp = SBC(0.5)
    p, opt = setup()
    comp._fold.plan([Owner("p", opt, p)], 0)
    for sq in [1.0] * 30 + [1e6]:  # calm steps, then a blow-up: the scale is cut
        guard_of(opt).observe(sq)
    saved = comp.state_dict()
    assert saved["fold_guards"] == [guard_of(opt).state_dict()]
    assert saved["fold_guards"][0]["backoffs"] == 1
    for first in ("load", "fold"):  # load into a fresh hook, or into one that folded already
        comp2, (p2, opt2) = SBC(0.5), setup()
        if first == "fold":
            comp2._fold.plan([Owner("p", opt2, p2)], 0)
        comp2.load_state_dict(saved)
        comp2._fold.plan([Owner("p", opt2, p2)], 1)
        assert guard_of(opt2).state_dict() == saved["fold_guards"][0], first
