"""Adam's second moment frozen after a warm-up (horovod_sbc.torch.adam): the frozen step against a
float64 hand computation, its linearity in the gradient (what the drop-in's average needs), and
the drop-in's ``freeze_variance_after`` on two ranks joined by a pipe (tests/test_outer.py's
harness): shared weights identical, the freeze where it was asked, checkpoint resume bit-exact.
"""
import io

import pytest
import torch

import horovod_sbc.torch as sbc
from horovod_sbc.config import ADAM_VARIANCE_FLOOR
from horovod_sbc.torch.adam import check_freeze, family, frozen_step
from test_outer import _PipeTransport, _model, spawn_two_ranks

BETAS, LR, EPS = (0.9, 0.95), 0.01, 1e-8
KINDS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, weight_decay=0.1),
         "adam_l2": lambda ps: torch.optim.Adam(ps, lr=LR, betas=BETAS, weight_decay=0.01),
         "amsgrad": lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, amsgrad=True),
         "maximize": lambda ps: torch.optim.Adam(ps, lr=LR, betas=BETAS, maximize=True)}


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64)),
            torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]


def _grads(t, ps, scale=1.0):
    g = torch.Generator().manual_seed(1000 + t)
    return [scale * torch.randn(p.shape, generator=g, dtype=torch.float64) for p in ps]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_frozen_step_is_adams_with_the_variance_of_the_freeze(kind):
    """K plain steps, then frozen steps: the first moment, the step count and weight decay go on
    as in Adam, the second moment is the bias-corrected one of step K and stays."""
    ps = _params()
    opt = KINDS[kind](ps)
    K, T = 3, 7
    for t in range(K):
        for p, g in zip(ps, _grads(t, ps)):
            p.grad = g
        opt.step()
    group = opt.param_groups[0]
    b1, b2 = BETAS
    wd, decoupled = group["weight_decay"], group["decoupled_weight_decay"]
    sign = -1.0 if group["maximize"] else 1.0
    key = "max_exp_avg_sq" if group["amsgrad"] else "exp_avg_sq"
    w = [p.detach().clone() for p in ps]
    m = [opt.state[p]["exp_avg"].clone() for p in ps]
    v = [opt.state[p][key] / (1 - b2 ** K) for p in ps]
    for t in range(K, T):
        gs = _grads(t, ps)
        for p, g in zip(ps, gs):
            p.grad = g
        frozen_step(opt)
        for i, g in enumerate(gs):  # Adam's step, written out, with v fixed
            g = sign * g
            if decoupled:
                w[i] = w[i] * (1 - LR * wd)
            elif wd:
                g = g + wd * w[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            w[i] = w[i] - LR / (1 - b1 ** (t + 1)) * m[i] / (v[i].sqrt() + EPS)
    for i, p in enumerate(ps):
        assert torch.allclose(p.detach(), w[i], rtol=0, atol=1e-12), (kind, i)
        assert torch.equal(opt.state[p][key], v[i]), kind  # frozen, in place
        assert float(opt.state[p]["step"]) == T
    # negative control: Adam's own steps from the same start move elsewhere
    qs = _params()
    ref = KINDS[kind](qs)
    for t in range(T):
        for q, g in zip(qs, _grads(t, qs)):
            q.grad = g
        ref.step()
    assert max((p - q).abs().max().item() for p, q in zip(ps, qs)) > 1e-4


def _two_copies_step(step, frozen):
    """The change of weights after 3 steps from one state under gradients g1, g2 (two ranks)
    and under their average: returns (mean of the two changes, change under the average)."""
    deltas = []
    for which in ("g1", "g2", "mean"):
        ps = _params()
        opt = KINDS["adamw"](ps)
        for t in range(2):  # a shared warm-up
            for p, g in zip(ps, _grads(t, ps)):
                p.grad = g
            opt.step()
        start = [p.detach().clone() for p in ps]
        for t in range(2, 5):
            g1, g2 = _grads(t, ps), _grads(100 + t, ps, scale=3.0)
            gs = {"g1": g1, "g2": g2, "mean": [(a + b) / 2 for a, b in zip(g1, g2)]}[which]
            for p, g in zip(ps, gs):
                p.grad = g
            frozen_step(opt) if frozen else opt.step()
        deltas.append([p.detach() - s for p, s in zip(ps, start)])
    mean = [(a + b) / 2 for a, b in zip(deltas[0], deltas[1])]
    return mean, deltas[2]


def test_frozen_steps_are_linear_in_the_gradient():
    """The average of two ranks' frozen steps is the frozen step on their average gradient
    (weight decay 0.1 included); Adam's own steps are not (the negative control)."""
    mean, of_mean = _two_copies_step(frozen_step, frozen=True)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-13) for a, b in zip(mean, of_mean))
    mean, of_mean = _two_copies_step(None, frozen=False)
    assert max((a - b).abs().max().item() for a, b in zip(mean, of_mean)) > 1e-3


@pytest.mark.parametrize("kw", [{}, {"momentum": 0.9}, {"centered": True},
                                {"momentum": 0.9, "weight_decay": 0.01}])
def test_rmsprops_frozen_step_is_rmsprop_with_its_second_moment_held(kw):
    """RMSprop joins the frozen family: after the freeze its step is RMSprop's with
    ``square_avg`` (centered: minus the squared mean gradient) held at the freeze's value, the
    momentum buffer and weight decay going on as RMSprop's; steps are then linear in g."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(50))
    ref = torch.nn.Parameter(p.detach().clone())
    opt, want = (torch.optim.RMSprop([q], lr=0.01, **kw) for q in (p, ref))
    for _ in range(5):
        g = torch.randn(50)
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        want.step()
    st = want.state[ref]
    held = st["square_avg"] - (st["grad_avg"] ** 2 if kw.get("centered") else 0)
    held = torch.maximum(held, held.mean() * 1e-3)  # the frozen variance's floor
    buf = st.get("momentum_buffer")
    for _ in range(3):
        g = torch.randn(50)
        p.grad = g.clone()
        frozen_step(opt)
        with torch.no_grad():
            d = g + kw.get("weight_decay", 0) * ref
            d = d / (held.sqrt() + 1e-8)
            if buf is not None:
                buf.mul_(0.9).add_(d)
                d = buf
            ref.sub_(0.01 * d)
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    assert family(opt) == "adam" and check_freeze("auto", opt) is not None


def test_a_parameter_first_seen_after_the_freeze_steps_as_adams_first_step():
    ps = _params()
    opt = KINDS["adamw"](ps)
    ps[0].grad = _grads(0, ps)[0]
    opt.step()  # only ps[0] has state
    late = ps[1].detach().clone()
    g = _grads(1, ps)
    ps[0].grad, ps[1].grad = g[0], g[1]
    frozen_step(opt)
    q = torch.nn.Parameter(late.clone())
    fresh = KINDS["adamw"]([q])
    q.grad = g[1]
    fresh.step()
    assert torch.allclose(ps[1].detach(), q.detach(), rtol=0, atol=1e-15)
    assert torch.equal(opt.state[ps[1]]["exp_avg_sq"], g[1].square())


def _dead_warm_up(opt, ps, steps=3):
    """Adam steps in which row 1 of the matrix and the whole bias get no gradient (a dead unit)."""
    for t in range(steps):
        gs = _grads(t, ps)
        gs[0][1, :] = 0.0
        gs[1].zero_()
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()


def test_a_coordinate_without_gradient_until_the_freeze_takes_the_floor():
    """A zero (or tiny) second moment at the freeze would divide a later gradient by eps alone:
    it is raised to ADAM_VARIANCE_FLOOR x the tensor's mean, or (all of the tensor zero) set to
    the square of the freeze's gradient."""
    ps = _params()
    opt = KINDS["adamw"](ps)
    _dead_warm_up(opt, ps)
    v = [opt.state[p]["exp_avg_sq"] / (1 - BETAS[1] ** 3) for p in ps]
    assert int((v[0] == 0).sum()) == 3 and not bool(v[1].any())
    gs = _grads(3, ps)
    for p, g in zip(ps, gs):
        p.grad = g
    frozen_step(opt)
    floor = v[0].mean() * ADAM_VARIANCE_FLOOR
    assert 0 < floor < v[0][v[0] > 0].min()  # only the dead row is raised
    assert torch.equal(opt.state[ps[0]]["exp_avg_sq"], torch.maximum(v[0], floor))
    assert torch.equal(opt.state[ps[1]]["exp_avg_sq"], gs[1].square())
    # and the dead row, now given gradients 100x larger, takes bounded steps, not g / eps
    before = ps[0].detach().clone()
    for t in range(4, 10):
        gs = _grads(t, ps, scale=100.0)
        for p, g in zip(ps, gs):
            p.grad = g
        frozen_step(opt)
    assert (ps[0].detach() - before).abs().max().item() < 1e3


def test_freeze_variance_after_is_checked():
    model = _model()
    with pytest.raises(ValueError, match="applies to torch.optim.Adam, AdamW and RMSprop, not SGD"):
        sbc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 model.named_parameters(),
                                 compression=sbc.SBC(freeze_variance_after=10))
    for bad in (0, -3, 2.5, True, "10"):
        with pytest.raises(ValueError, match="freeze_variance_after must be 'auto', None or an"):
            sbc.SBC(freeze_variance_after=bad)
    with pytest.raises(ValueError, match="capturable, fused or differentiable"):
        sbc.DistributedOptimizer(torch.optim.AdamW(model.parameters(), capturable=True),
                                 model.named_parameters(),
                                 compression=sbc.SBC(freeze_variance_after=10))


# -- the drop-in on two ranks ------------------------------------------------------------------
def _train(rank, conn, freeze, steps, start=None, save_at=None):
    """Train the test model through the drop-in (AdamW, SBC(0.3), delay 1); ``start``: a
    checkpoint to resume from. Returns the report and the checkpoint saved at ``save_at``."""
    model = _model()
    base = torch.optim.AdamW(model.parameters(), lr=0.01, betas=BETAS, weight_decay=0.1)
    opt = sbc.DistributedOptimizer(base, model.named_parameters(),
                                   compression=sbc.SBC(0.3, freeze_variance_after=freeze))
    opt.compression.transport = _PipeTransport(rank, conn)
    first = 0
    if start is not None:
        ck = torch.load(io.BytesIO(start), weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        first = ck["step"]
    g = torch.Generator().manual_seed(100 + rank)
    saved = None
    for t in range(steps):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        if t < first:
            continue  # the resumed run skips the batches already trained on
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if t + 1 == save_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": t + 1},
                       buf)
            saved = buf.getvalue()
    frozen = [float(st["sbc_variance_frozen"]) if "sbc_variance_frozen" in st else 0.0
              for st in opt.state.values()]
    # numpy copies: tensors put on a queue travel as shared memory that dies with the process
    return {"weights": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
            "ref": {n: r.numpy().copy() for n, r in opt.compression.manager.reference.items()},
            "frozen": frozen}, saved


def _rank_main(rank, conn, results):
    torch.set_num_threads(1)
    out = {}
    for freeze, steps in ((None, 2), (2, 2), (2, 3)):
        out[(freeze, steps)] = _train(rank, conn, freeze, steps)[0]
    out["full"], ck = _train(rank, conn, 3, 8, save_at=5)
    out["resumed"] = _train(rank, conn, 3, 8, start=ck)[0]  # each rank its own file
    out["plain"] = _train(rank, conn, None, 8)[0]
    results.put((rank, out))


@pytest.fixture(scope="module")
def ranks():
    got = spawn_two_ranks(_rank_main)
    return {r: {k: {kk: {n: torch.from_numpy(a) for n, a in vv.items()} if kk != "frozen"
                        else vv for kk, vv in v.items()} for k, v in out.items()}
            for r, out in got.items()}


def test_the_drop_in_freezes_after_the_given_steps(ranks):
    for r in (0, 1):
        assert not any(ranks[r][(None, 2)]["frozen"])
        assert not any(ranks[r][(2, 2)]["frozen"])  # 2 steps done: the third one freezes
        assert all(ranks[r][(2, 3)]["frozen"]) and ranks[r][(2, 3)]["frozen"]
        # the first two steps are Adam's own: the same weights with or without the freeze
        assert all(torch.equal(ranks[r][(None, 2)]["weights"][n], ranks[r][(2, 2)]["weights"][n])
                   for n in ranks[r][(2, 2)]["weights"])


def test_the_shared_weights_are_identical_and_the_resume_is_bit_exact(ranks):
    full0, full1 = ranks[0]["full"], ranks[1]["full"]
    for n in full0["ref"]:
        assert torch.equal(full0["ref"][n], full1["ref"][n]), n
    for r in (0, 1):
        full, resumed = ranks[r]["full"], ranks[r]["resumed"]
        for n in full["weights"]:
            assert torch.equal(full["weights"][n], resumed["weights"][n]), (r, n)
            assert torch.equal(full["ref"][n], resumed["ref"][n]), (r, n)
    # negative control: without the freeze the same run ends elsewhere
    plain = ranks[0]["plain"]
    assert max((full0["ref"][n] - plain["ref"][n]).abs().max().item() for n in plain["ref"]) \
        > 1e-4


def test_the_benchmarks_dense_baseline_freezes_as_the_drop_in_does():
    """benchmarks/bench_train.py's dense rows with ``freeze_variance_after``: the user's AdamW
    for K steps, then :func:`frozen_step` (the same arithmetic as the drop-in's)."""
    from benchmarks.bench_train import _frozen_class
    ps, qs = _params(), _params()
    a = KINDS["adamw"](ps)
    a.__class__ = _frozen_class(type(a), 2)
    b = KINDS["adamw"](qs)
    for t in range(5):
        for p, q, g in zip(ps, qs, _grads(t, ps)):
            p.grad, q.grad = g, g.clone()
        a.step()
        b.step() if t < 2 else frozen_step(b)
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    assert "sbc_variance_frozen" in a.state[ps[0]]
