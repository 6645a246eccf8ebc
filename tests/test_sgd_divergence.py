"""The drop-in's folded SGD momentum must not turn a recipe that trains densely into one that
collapses (issue 45, item 3), and the fold's blow-up guard (horovod_sbc.torch.momentum.FoldGuard)
that makes sure of it.

The training test runs the real drop-in optimizer with its defaults (delay 1, the residual beside
the shared weights, the momentum folded) on 4 ranks simulated in ONE process: every rank is a
thread with its own model, optimizer and SBC state, joined by a loopback allgather. The threads
take turns (one lock, released only while a rank waits in the allgather): the package's codec
keeps module-level scratch buffers, which concurrent ranks in one process would share.

Task: mnist1d as ``benchmarks.tasks`` builds it (``make_dataset``, generated locally; the 1-D
CNN), IID shards, batch 32, SGD momentum 0.9 at lr 0.2. Measured on this setting (seed 0,
accuracy at 200/300/400 steps): the fold without the guard 43.9 / 21.0 / 31.4 % (it learns,
then collapses: plain SGD at lr / (1 - m) = 2.0), with the guard 43.9 / 58.2 / 66.7 %. Over
1,500 steps (200/600/1000/1500): dense heavy ball 80.5 / 92.3 / 88.7 / 89.5 %, the stock hook
(folded too) at chance from step 200 on, the drop-in without the guard 43.9 / 46.8 / 52.8 /
9.8 % (chance), with it 43.9 / 80.2 / 79.0 / 83.3 %. At the issue's lr 0.05 the guard fires
at most once and leaves the curve as it was (50.3 / 85.5 / 90.1 / 92.9 % vs 92.0 % at 1500).

The stock hook (``hvd.DistributedOptimizer(SGD, compression=SBC(0.01))``: the gradient
exchange, the fold applied to the decoded average) is driven the same way, through a stand-in
for Horovod's optimizer defined as if in Horovod's module (horovod_sbc.torch.owner reads its
frame). Seed 0 at lr 0.2, accuracy at 100/200/300 steps: without the guard 16.7 / 10.1 / 10.0 %
(chance), with it (one back-off, the same on every rank) 37.4 / 50.1 / 63.7 %, and over 1,500
steps (200/600/1000/1500) 50.1 / 89.7 / 92.5 / 91.1 %. At lr 0.05 the guard never fires: the
same 50.6 / 75.2 / 86.2 / 89.1 / 89.2 % at 200/400/600/800/1000 steps with and without it.
"""
import threading

import pytest
import torch

pytest.importorskip("mnist1d")

from horovod_sbc.torch import momentum as M  # noqa: E402


# --------------------------------------------------------------------------------------------
# the guard's rule
# --------------------------------------------------------------------------------------------
def test_a_gradient_norm_spike_backs_the_fold_off_and_calm_steps_bring_it_back():
    g = M.FoldGuard()
    for _ in range(M.GUARD_WARMUP + 10):
        assert not g.observe(1.0)
    assert g.scale == 1.0 and g.factor(10.0) == 10.0
    assert g.observe(1.0 + M.GUARD_SPIKE ** 2 * 1.01)   # a norm above GUARD_SPIKE x its RMS
    assert g.scale == pytest.approx(M.GUARD_BACKOFF) and g.backoffs == 1
    assert g.factor(10.0) == pytest.approx(1.0 + 9.0 * M.GUARD_BACKOFF)
    assert not g.observe(1.0)
    for _ in range(5 * M.GUARD_RECOVER):
        g.observe(1.0)
    assert g.scale == M.GUARD_CEILING   # back up to a ceiling each blow-up lowers
    assert g.observe(float("nan")) and g.observe(float("inf"))
    assert g.factor(0.5) == 0.5   # never above the steady factor, e.g. in the ramp


def test_no_verdict_during_the_warm_up():
    g = M.FoldGuard()
    assert not g.observe(1e-6)
    for _ in range(M.GUARD_WARMUP - 2):
        assert not g.observe(1e6)
    assert g.scale == 1.0


def test_a_back_off_cuts_the_folded_step_and_the_weight_space_backlog_with_it():
    """The spike's own step takes the reduced factor, and residuals of folded steps
    (lr_eff * g, not sent yet) are rescaled by new factor / old factor."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    guard = M.FoldGuard()
    res = torch.full((4,), 2.0)
    for _ in range(M.GUARD_WARMUP + 5):
        p.grad = torch.full((4,), 0.01)
        with M.folded(opt, None, guard=guard, residuals=[res]):
            opt.step()
    assert torch.equal(res, torch.full((4,), 2.0))
    before = p.detach().clone()
    p.grad = torch.full((4,), 1.0)   # 100x the norm
    with M.folded(opt, None, guard=guard, residuals=[res]):
        opt.step()
    cut = 1.0 + 9.0 * M.GUARD_BACKOFF
    torch.testing.assert_close(p.detach(), before - 0.1 * cut)
    torch.testing.assert_close(res, torch.full((4,), 2.0 * cut / 10.0))
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9


# --------------------------------------------------------------------------------------------
# four drop-in ranks on mnist1d
# --------------------------------------------------------------------------------------------
class _Loopback:
    """Rank ``rank``'s allgather among the threads of one process (ranks take turns)."""

    def __init__(self, shared, rank):
        self.s, self.rank = shared, rank

    def world(self):
        return self.s["size"], self.rank

    def allgather(self, step, tag):
        s = self.s
        s["slots"][self.rank] = step.clone()
        s["lock"].release()
        try:
            s["bar"].wait()
            out = torch.cat(s["slots"])
            s["bar"].wait()
        finally:
            s["lock"].acquire()
        return out


def _train_drop_in(steps, evals, lr, seed=0, size=4):
    """The drop-in with its defaults on ``size`` simulated ranks; rank 0's test accuracy
    (the shared weights) at each of ``evals``, and every rank's guard's back-offs."""
    import horovod_sbc.torch as sbc
    from benchmarks.tasks import make_task
    task = make_task("mnist1d", batch_size=32, lr=lr)
    torch.manual_seed(seed)
    init = task.build_model().state_dict()
    shared = {"size": size, "slots": [None] * size, "bar": threading.Barrier(size, timeout=120),
              "lock": threading.Lock()}
    out, errors = {}, []

    def rank_main(rank):
        with shared["lock"]:
            try:
                model = task.build_model()
                model.load_state_dict(init)
                opt = sbc.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                    model.named_parameters(), compression=sbc.SBC(0.01))
                assert not opt.local_residual
                opt.compression.transport = _Loopback(shared, rank)
                xs, ys = task.shard(rank, size, "iid")
                batches = task.batches(len(xs), 32, seed * 1000 + rank)
                for t in range(steps):
                    b = next(batches)
                    opt.zero_grad()
                    task.loss(model, xs[b], ys[b]).backward()
                    opt.step()
                    if rank == 0 and t + 1 in evals:
                        out[t + 1] = task.evaluate(model)
                guard = getattr(M, "_GUARDS", {}).get(opt)  # none before the guard existed
                out.setdefault("backoffs", [0] * size)[rank] = guard.backoffs if guard else 0
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                shared["bar"].abort()

    _run_ranks(rank_main, size, errors)
    return out


def _run_ranks(rank_main, size, errors):
    """Run ``rank_main(rank)`` on ``size`` threads (one torch thread) and re-raise the first
    of ``errors``."""
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=600)
    finally:
        torch.set_num_threads(prev)
    if errors:
        raise errors[0]


def test_the_folded_drop_in_does_not_collapse_where_the_heavy_ball_trains():
    acc = _train_drop_in(400, (200, 300, 400), lr=0.2)
    # it learns first (the heavy ball is at 80 % here), so a collapse after is the fold's
    assert acc[200] > 0.3, acc
    # without the guard: 43.9 % at 200 steps, then 21.0 % and 31.4 %
    assert acc[300] >= acc[200] and acc[400] >= acc[200], acc
    assert acc[400] > 0.5, acc
    assert sum(acc["backoffs"]) >= 1, acc  # each rank's guard watches its own gradients


# --------------------------------------------------------------------------------------------
# four ranks of stock hvd.DistributedOptimizer (the hook's gradient exchange) on mnist1d
# --------------------------------------------------------------------------------------------
#: what stock ``hvd.DistributedOptimizer`` does with ``compression=SBC(...)`` for torch SGD,
#: defined as if in Horovod's own module: ``compress(p.grad)`` from a method whose ``self`` has
#: ``_parameter_names`` and ``p`` among its locals (horovod_sbc.torch.owner reads that frame for
#: the name and the optimizer, as tests/test_owner.py pins), then ``decompress`` of each
#: gradient (the first one exchanges the step) and SGD's own step
_HOROVOD_SGD = """
import torch

class DistributedSGD(torch.optim.SGD):
    def __init__(self, named_parameters, compression, **kw):
        named = list(named_parameters)
        super().__init__([p for _, p in named], **kw)
        self._parameter_names = {p: n for n, p in named}
        self._compression = compression

    def _allreduce_grad_async(self, p):
        return self._compression.compress(p.grad)

    def step(self):
        ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        handles = [(p, self._allreduce_grad_async(p)) for p in ps]
        for p, (dummy, ctx) in handles:
            p.grad.set_(self._compression.decompress(dummy, ctx))
        return super().step()
"""


def _horovod_like() -> dict:
    """The namespace of :data:`_HOROVOD_SGD`, defined as if in ``horovod.torch.optimizer``."""
    import horovod.torch  # noqa: F401 - imported once here, not by the ranks' threads
    ns = {"__name__": "horovod.torch.optimizer"}
    exec(compile(_HOROVOD_SGD, "<horovod.torch.optimizer>", "exec"), ns)
    return ns


def _train_stock(steps, evals, lr, seed=0, size=4):
    """Stock ``hvd.DistributedOptimizer(SGD(lr, momentum=0.9), compression=SBC(0.01))`` (the
    fold is its default) on ``size`` simulated ranks: rank 0's test accuracy at each of
    ``evals``, every rank's guard's back-offs and every rank's final weights."""
    import horovod_sbc.torch as sbc
    from benchmarks.tasks import make_task
    hvd_like = _horovod_like()
    task = make_task("mnist1d", batch_size=32, lr=lr)
    torch.manual_seed(seed)
    init = task.build_model().state_dict()
    shared = {"size": size, "slots": [None] * size, "bar": threading.Barrier(size, timeout=120),
              "lock": threading.Lock()}
    out, errors = {"backoffs": [0] * size, "weights": [None] * size}, []

    def rank_main(rank):
        with shared["lock"]:
            try:
                model = task.build_model()
                model.load_state_dict(init)
                comp = sbc.SBC(0.01)
                comp.transport = _Loopback(shared, rank)
                opt = hvd_like["DistributedSGD"](model.named_parameters(), comp, lr=lr,
                                                 momentum=0.9)
                xs, ys = task.shard(rank, size, "iid")
                batches = task.batches(len(xs), 32, seed * 1000 + rank)
                for t in range(steps):
                    b = next(batches)
                    opt.zero_grad()
                    task.loss(model, xs[b], ys[b]).backward()
                    opt.step()
                    if rank == 0 and t + 1 in evals:
                        out[t + 1] = task.evaluate(model)
                assert comp.stats()["steps"] == steps
                guard = getattr(M, "_GUARDS", {}).get(opt)
                out["backoffs"][rank] = guard.backoffs if guard else 0
                out["weights"][rank] = [p.detach().clone() for p in model.parameters()]
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                shared["bar"].abort()

    _run_ranks(rank_main, size, errors)
    return out


def test_the_stock_hooks_fold_does_not_collapse_and_the_ranks_stay_identical():
    acc = _train_stock(300, (200, 300), lr=0.2)
    w = acc.pop("weights")
    # without the guard: 10.1 % at 200 steps, 10.0 % at 300 (chance; 16.7 % at 100)
    assert acc[300] > 0.4 and acc[300] >= acc[200], acc
    b = acc["backoffs"]
    assert b[0] >= 1 and b == [b[0]] * len(b), acc  # one verdict on the average: every rank's
    for r in range(1, len(w)):
        assert all(torch.equal(a, c) for a, c in zip(w[0], w[r])), f"rank {r} drifted: {acc}"


class _Solo:
    """A one-rank job's allgather."""

    def world(self):
        return 1, 0

    def allgather(self, step, tag):
        return step.clone()


def test_the_stock_hook_guards_its_fold_on_applied_steps_only():
    """A guarded back-off scales the gradient the hook returns; a skipped step
    (``nonfinite="skip"``) is not shown to the guard (no NaN verdict: a run that skips an
    overflow now and then keeps its fold)."""
    import horovod_sbc.torch as sbc
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4, bias=False)
    comp = sbc.SBC(0.25, nonfinite="skip")
    comp.transport = _Solo()
    opt = _horovod_like()["DistributedSGD"](lin.named_parameters(), comp, lr=0.1, momentum=0.9)
    x = torch.randn(16, 8)
    for _ in range(M.GUARD_WARMUP + 5):
        opt.zero_grad()
        lin(x).square().mean().backward()
        opt.step()
    guard = M.guard_of(opt)
    assert guard.seen == M.GUARD_WARMUP + 5 and guard.backoffs == 0
    before = lin.weight.detach().clone()
    opt.zero_grad()
    lin(x).square().mean().backward()
    lin.weight.grad[0, 0] = float("nan")
    with pytest.warns(UserWarning, match="skipping"):
        opt.step()
    assert torch.equal(lin.weight.detach(), before)
    assert guard.seen == M.GUARD_WARMUP + 5 and guard.backoffs == 0 and guard.scale == 1.0
    opt.zero_grad()
    (1e3 * lin(x).square().mean()).backward()   # a spike
    opt.step()
    assert guard.seen == M.GUARD_WARMUP + 6 and guard.backoffs == 1
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize("nesterov", [False, True])
def test_the_stock_fold_scales_the_average_by_the_guarded_factor(nesterov):
    from horovod_sbc.torch.owner import Owner
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    a = 1.9 if nesterov else 1.0
    fold = M.StockFold()
    (k, c, buf), = fold.plan([Owner("p", opt, p)])
    assert k == pytest.approx(10.0 / a) and c == pytest.approx((10.0 / a - 1.0) * 0.01)
    M.guard_of(opt).scale = M.GUARD_BACKOFF
    (k, c, buf), = fold.plan([Owner("p", opt, p)])
    assert k == pytest.approx((1.0 + 9.0 * M.GUARD_BACKOFF) / a)
    assert c == pytest.approx((k - 1.0) * 0.01) and buf is opt.state[p]["momentum_buffer"]
    (k, _, _), = fold.plan([Owner("p", opt, p)], guard=False)
    assert k == pytest.approx(10.0 / a)
