"""The drop-in's outer step (horovod_sbc.torch.outer) without Horovod: its arithmetic against
hand computations, and two drop-in ranks run as two local processes whose allgather is a pipe
between them (nothing else is shared; the multi-rank Horovod job is tests/test_outer_ranks.py).
"""
import multiprocessing

import pytest
import torch

import horovod_sbc.torch as sbc
from horovod_sbc.outer import ErrorDecay, Nesterov, Plain
from horovod_sbc.torch.outer import make


class _PipeTransport:
    """Rank ``rank`` of 2: the allgather sends this rank's step message to the other rank and
    returns both in rank order (what Horovod's allgather returns)."""

    def __init__(self, rank, conn):
        self.rank, self.conn = rank, conn

    def world(self):
        return 2, self.rank

    def allgather(self, step, tag):
        self.conn.send_bytes(step.numpy().tobytes())
        other = torch.frombuffer(bytearray(self.conn.recv_bytes()), dtype=torch.uint8)
        return torch.cat([step, other] if self.rank == 0 else [other, step])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


_OUTERS = {"plain": Plain, "nesterov": lambda: Nesterov(lr=0.7, momentum=0.9),
           "nesterov_0.5_0.8": lambda: Nesterov(lr=0.5, momentum=0.8),
           "decay": lambda: ErrorDecay(decay=0.5), "plain_2": lambda: Plain(lr=2.0)}
_COMPS = {"dense": lambda **kw: sbc.SBC(density=1.0, mode="values", delay=2, **kw),
          "dense1": lambda **kw: sbc.SBC(density=1.0, mode="values", delay=1, **kw),
          "sbc": lambda **kw: sbc.SBC(density=0.3, delay=2, **kw)}


def _numpy(d):
    return {k: v.detach().reshape(-1).numpy().copy() for k, v in d.items()}


def _rank_main(rank, conn, runs, results):
    """Each run (comp, outer, steps, local_residual): train the same model on this rank's data
    through the drop-in; report its weights, shared weights, residuals and outer state."""
    torch.set_num_threads(1)
    out = []
    for comp, outer, steps, local_residual in runs:
        model = _model()
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = sbc.DistributedOptimizer(
            base, model.named_parameters(),
            compression=_COMPS[comp](local_residual=local_residual, outer=_OUTERS[outer]()))
        opt.compression.transport = _PipeTransport(rank, conn)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        st = opt.state_dict()["horovod_sbc"]["outer"]
        out.append({"local_residual": opt.local_residual,
                    "momentum_buffers": sum(1 for v in opt.state.values()
                                            if v.get("momentum_buffer") is not None),
                    "weights": _numpy(dict(model.named_parameters())),
                    "ref": _numpy(opt.compression.manager.reference),
                    "residuals": _numpy(opt.residuals()), "buffers": _numpy(opt.outer.buffers()),
                    "outer_state": {k: v for k, v in st.items() if k != "buffers"}})
    results.put((rank, out))


def spawn_two_ranks(target, *args):
    """``target(rank, conn, *args, queue)`` on two local processes joined by a pipe; each puts
    ``(rank, report)`` on the queue. Returns ``{rank: report}``."""
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, c, *args, q)) for r, c in enumerate((a, b))]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return got


def _run_two_ranks(*runs):
    """Run ``runs`` on two local processes; returns, per run, (rank 0's, rank 1's) report with
    torch tensors."""
    got = spawn_two_ranks(_rank_main, list(runs))
    return [(_tensors(got[0][i]), _tensors(got[1][i])) for i in range(len(runs))]


def _tensors(report):
    return {k: d if not isinstance(d, dict) or k == "outer_state"
            else {n: torch.from_numpy(v) for n, v in d.items()} for k, d in report.items()}


def test_nesterov_arithmetic_by_hand():
    """v <- m v + U; D = lr (U + m v), exact in binary fractions."""
    n = make(Nesterov(lr=0.5, momentum=0.5))
    u = [torch.tensor([1.0, -2.0, 4.0])]
    n.delta_(["w"], u)
    assert u[0].tolist() == [0.75, -1.5, 3.0]  # v = U; D = 0.5 (U + 0.5 U)
    u = [torch.tensor([2.0, 0.0, -4.0])]
    n.delta_(["w"], u)
    # v = 0.5 [1, -2, 4] + [2, 0, -4] = [2.5, -1, -2]; D = 0.5 ([2, 0, -4] + 0.5 v)
    assert u[0].tolist() == [1.625, -0.25, -2.5]
    assert n.buffers()["w"].tolist() == [2.5, -1.0, -2.0]


def test_plain_outer_lr_scales_the_average():
    """Plain(lr): D = lr U, in place; lr = 1 changes nothing and keeps the straight decode
    into W_ref (no dense buffer of U)."""
    u = [torch.tensor([1.0, -2.5]), torch.tensor([3.0])]
    make(Plain(lr=2.0)).delta_(["a", "b"], u)
    assert u[0].tolist() == [2.0, -5.0] and u[1].tolist() == [6.0]
    make(Plain()).delta_(["a", "b"], u)
    assert u[0].tolist() == [2.0, -5.0]
    assert not make(Plain()).needs_buffer and make(Plain(lr=2.0)).needs_buffer
    assert repr(Plain()) == "Plain()" and repr(Plain(lr=2.0)) == "Plain(lr=2.0)"


def test_outer_step_knobs_are_checked():
    with pytest.raises(ValueError, match=r"Plain: lr must be in \(0.0, 16.0\]"):
        Plain(lr=0.0)
    with pytest.raises(ValueError, match=r"Plain: lr must be in \(0.0, 16.0\]"):
        Plain(lr=17.0)
    with pytest.raises(ValueError, match="Nesterov: momentum must be below 1"):
        Nesterov(momentum=1.0)
    with pytest.raises(ValueError, match=r"Nesterov: lr must be in \(0.0, 2.0\]"):
        Nesterov(lr=0)
    with pytest.raises(ValueError, match=r"ErrorDecay: decay must be in \[0.0, 1.0\]"):
        ErrorDecay(decay=1.5)
    with pytest.raises(ValueError, match=r"outer must be None, horovod_sbc.outer.Plain\(...\)"):
        sbc.SBC(outer="nesterov")


def _simulate_dense(outer_lr, m, syncs, delay=2):
    """Float64 hand computation of two ranks with a dense exact exchange every ``delay`` local
    steps and DiLoCo's outer step: returns the shared weights after ``syncs`` syncs."""
    models = [_model().double() for _ in range(2)]
    opts = [torch.optim.SGD(mm.parameters(), lr=0.1, momentum=0.9) for mm in models]
    gens = [torch.Generator().manual_seed(100 + r) for r in range(2)]
    ref = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    vel = {n: torch.zeros_like(p) for n, p in ref.items()}
    for _ in range(syncs):
        for mm, oo, g in zip(models, opts, gens):
            for _ in range(delay):
                x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
                oo.zero_grad()
                torch.nn.functional.cross_entropy(mm(x.double()), y).backward()
                oo.step()
        for n in ref:
            ws = [dict(mm.named_parameters())[n].detach() for mm in models]
            u = ((ws[0] - ref[n]) + (ws[1] - ref[n])) / 2
            vel[n] = m * vel[n] + u
            ref[n] = ref[n] + outer_lr * (u + m * vel[n])
        with torch.no_grad():  # everything was sent: both ranks continue from W_ref
            for mm in models:
                for n, p in mm.named_parameters():
                    p.copy_(ref[n])
    return {n: t.view(-1) for n, t in ref.items()}


@pytest.fixture(scope="module")
def runs():
    """Every two-rank run of this module, in one pair of processes (each starts torch once)."""
    names = [("dense", "nesterov", 6, True), ("dense", "plain", 6, True),
             ("sbc", "plain", 2, True), ("sbc", "nesterov", 2, True),
             ("sbc", "plain", 2, False), ("sbc", "decay", 2, False),
             ("dense", "nesterov_0.5_0.8", 2, True), ("dense", "plain_2", 6, True),
             ("dense1", "plain", 4, None), ("dense1", "plain", 4, True)]
    return dict(zip(names, _run_two_ranks(*names)))


def test_nesterov_on_two_ranks_matches_the_hand_computation(runs):
    """Dense exchange (density 1, exact values) every 2 local steps, 3 syncs: W_ref follows
    DiLoCo's formula on the mean of both ranks' updates (float64 hand computation), it is
    bit-identical on both ranks, and a rank whose whole update was sent sits exactly on it."""
    a, b = runs[("dense", "nesterov", 6, True)]
    expect = _simulate_dense(0.7, 0.9, syncs=3)
    for name in expect:
        assert torch.equal(a["ref"][name], b["ref"][name]), name
        assert torch.allclose(a["ref"][name].double(), expect[name], rtol=0, atol=2e-6), name
        for r in (a, b):
            assert torch.equal(r["weights"][name], a["ref"][name]), name
        assert torch.equal(a["buffers"][name], b["buffers"][name]), name  # shared state


def test_plain_outer_step_is_the_plain_average(runs):
    """Negative control: the same run with outer=Plain() (W_ref += U) follows the plain
    hand computation and ends elsewhere than Nesterov's."""
    plain, _ = runs[("dense", "plain", 6, True)]
    nest, _ = runs[("dense", "nesterov", 6, True)]
    expect = _simulate_dense(1.0, 0.0, syncs=3)
    for name in expect:
        assert torch.allclose(plain["ref"][name].double(), expect[name], rtol=0, atol=2e-6)
    assert max((plain["ref"][n] - nest["ref"][n]).abs().max().item() for n in expect) > 1e-3
    assert plain["buffers"] == {} and plain["outer_state"] == {"kind": "plain", "lr": 1.0}


def test_plain_outer_lr_on_two_ranks_matches_the_hand_computation(runs):
    """Plain(lr=2) (the sqrt(N) of two ranks): W_ref += 2 U at every sync, as the float64 hand
    computation, bit-identical on both ranks; it ends elsewhere than lr = 1."""
    a, b = runs[("dense", "plain_2", 6, True)]
    plain, _ = runs[("dense", "plain", 6, True)]
    expect = _simulate_dense(2.0, 0.0, syncs=3)
    for name in expect:
        assert torch.equal(a["ref"][name], b["ref"][name]), name
        assert torch.allclose(a["ref"][name].double(), expect[name], rtol=0, atol=4e-6), name
    assert max((a["ref"][n] - plain["ref"][n]).abs().max().item() for n in expect) > 1e-3
    assert a["outer_state"] == {"kind": "plain", "lr": 2.0}


def test_sparse_residual_in_the_weights_is_left_to_the_rank(runs):
    """SBC at density 0.3 with the residual in the weights: the outer step moves each rank's
    weights with W_ref, so W - W_ref after the first sync (the unsent update) is the plain
    step's, up to rounding; W_ref is bit-identical on both ranks."""
    plain, _ = runs[("sbc", "plain", 2, True)]
    nest, nest1 = runs[("sbc", "nesterov", 2, True)]
    for name in plain["residuals"]:
        assert torch.allclose(plain["residuals"][name], nest["residuals"][name], rtol=0,
                              atol=1e-6), name
        assert nest["residuals"][name].abs().max() > 0  # something was left unsent
        assert torch.equal(nest["ref"][name], nest1["ref"][name]), name
        # the first sync's Nesterov change is lr (1 + m) U = 1.33 x the plain one
        start = dict(_model().named_parameters())[name].detach().reshape(-1)
        assert torch.allclose(nest["ref"][name] - start, 1.33 * (plain["ref"][name] - start),
                              rtol=0, atol=1e-6), name


def test_error_decay_scales_the_stored_residual(runs):
    """ErrorDecay(decay=0.5) with local_residual=False: after the first sync every residual is
    half the plain one (which is A - sent), and W_ref moved by the plain average."""
    plain, _ = runs[("sbc", "plain", 2, False)]
    dec, _ = runs[("sbc", "decay", 2, False)]
    for name in plain["residuals"]:
        assert torch.allclose(dec["residuals"][name], 0.5 * plain["residuals"][name], rtol=0,
                              atol=1e-7), name
        assert torch.allclose(plain["ref"][name], dec["ref"][name], rtol=0, atol=1e-6), name
        assert plain["residuals"][name].abs().max() > 0


def test_outer_state_in_the_checkpoint(runs):
    """The outer step's knobs and momentum buffers travel in state_dict(); loading them into
    another kind of outer step names both."""
    a, _ = runs[("dense", "nesterov_0.5_0.8", 2, True)]
    st = a["outer_state"]
    assert st == {"kind": "nesterov", "lr": 0.5, "momentum": 0.8}
    full = dict(st, buffers={n: v.clone() for n, v in a["buffers"].items()})
    fresh = make(Nesterov())
    fresh.load_state_dict(full)
    assert all(torch.equal(fresh.buffers()[n], v) for n, v in a["buffers"].items())
    with pytest.raises(ValueError, match=r"outer step is 'nesterov' but this optimizer uses "
                                         r"Plain\(\)"):
        make(Plain()).load_state_dict(full)


def _simulate(steps, lr=0.1, m=0.9, folded=False):
    """Float64 hand computation of two ranks exchanging exactly at every step: momentum SGD on
    the average gradient (the heavy ball, ``v = m v + g``, ``w -= lr v``), or with ``folded``
    SGD without a velocity at ``lr (1 - m^(t+1)) / (1 - m)`` (the negative control)."""
    model = _model().double()
    gens = [torch.Generator().manual_seed(100 + r) for r in range(2)]
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    v = {n: torch.zeros_like(t) for n, t in w.items()}
    for t in range(steps):
        grads = []
        for g in gens:
            x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x.double()), y).backward()
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for n, p in model.named_parameters():
                avg = (grads[0][n] + grads[1][n]) / 2
                if folded:
                    w[n] -= lr * (1 - m ** (t + 1)) / (1 - m) * avg
                else:
                    v[n] = m * v[n] + avg
                    w[n] -= lr * v[n]
                p.copy_(w[n])
    return {n: t.view(-1) for n, t in w.items()}


def test_sgd_at_delay_1_with_an_exact_exchange_is_momentum_sgd_on_the_average(runs):
    """The default for torch SGD at delay 1 (the residual in the weights, every rank its own
    velocity): with an exact exchange the shared weights follow the float64 heavy ball on the
    average gradient, both ranks hold exactly them (nothing is left unsent), and the default is
    ``local_residual=True``. Negative control: the momentum fold this replaced ends elsewhere."""
    a, b = runs[("dense1", "plain", 4, None)]
    own, _ = runs[("dense1", "plain", 4, True)]
    assert a["local_residual"] is True and a["momentum_buffers"] > 0
    expect, folded = _simulate(4), _simulate(4, folded=True)
    for name in expect:
        assert torch.equal(a["ref"][name], b["ref"][name]), name
        assert torch.equal(a["ref"][name], own["ref"][name]), name
        for r in (a, b):
            assert torch.equal(r["weights"][name], a["ref"][name]), name
        assert torch.allclose(a["ref"][name].double(), expect[name], rtol=0, atol=2e-6), name
    assert max((folded[n] - expect[n]).abs().max().item() for n in expect) > 1e-3


def test_the_default_residual_placement_follows_the_optimizer_and_the_delay():
    model = _model()
    for base, comp, local in ((torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               sbc.SBC(0.01), True),
                              (torch.optim.SGD(model.parameters(), lr=0.1), sbc.SBC(0.01), True),
                              (torch.optim.SGD(model.parameters(), lr=0.1),
                               sbc.SBC(0.01, local_residual=False), False),
                              (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               sbc.SBC(0.01, delay=4), True),
                              (torch.optim.AdamW(model.parameters(), lr=1e-3), sbc.SBC(0.01),
                               True)):
        opt = sbc.DistributedOptimizer(base, model.named_parameters(), compression=comp)
        assert opt.local_residual is local, (type(base).__name__, comp.delay)
    with pytest.raises(ValueError, match="local_residual must be None, True or False"):
        sbc.SBC(local_residual="yes")
