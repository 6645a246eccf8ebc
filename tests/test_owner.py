"""The owner lookup of the stock hooks (horovod_sbc/torch/owner.py and tensorflow/owner.py):
what they read of Horovod is pinned to the release they were written against, and they read the
frames of Horovod's own packages only."""
import inspect

import pytest
import torch

from horovod_sbc.torch import owner as towner


def _run_as(module: str, src: str, **names):
    """Define the functions in ``src`` as if they lived in ``module`` and return its namespace."""
    ns = {"__name__": module, **names}
    exec(compile(src, f"<{module}>", "exec"), ns)
    return ns


_HOROVOD_LIKE = """
class Opt:
    op = 'average'
    def __init__(self, p, name):
        self._parameter_names = {p: name}
    def _allreduce_grad_async(self, p):
        return compress(p.grad)
"""


def _compress(tensor):
    return towner.identify(tensor, None)


def test_torch_owner_reads_horovods_frame_for_the_name():
    import horovod.torch as hvd
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    ns = _run_as("horovod.torch.optimizer", _HOROVOD_LIKE, compress=_compress)
    opt = ns["Opt"](p, "layer.weight")
    opt.op = hvd.Average
    got = opt._allreduce_grad_async(p)
    assert got.name == "layer.weight" and got.parameter is p and got.op_sum is False
    opt.op = hvd.Sum
    assert opt._allreduce_grad_async(p).op_sum is True


def test_torch_owner_ignores_frames_outside_horovod():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    ns = _run_as("my_training_script", _HOROVOD_LIKE, compress=_compress)
    with pytest.raises(ValueError, match="could not tell which parameter"):
        ns["Opt"](p, "layer.weight")._allreduce_grad_async(p)
    # named_parameters given to SBC(...) always work, Horovod frame or not
    assert towner.identify(p.grad, [("w", p)]).name == "w"


def test_torch_owner_matches_the_horovod_source_it_reads():
    import horovod
    import horovod.torch.functions as hfun
    import horovod.torch.optimizer as hopt
    assert horovod.__version__ == towner.HOROVOD_VERSION, (
        "horovod_sbc/torch/owner.py reads Horovod's frames as of "
        f"{towner.HOROVOD_VERSION}; check it against Horovod {horovod.__version__}")
    single = inspect.getsource(hopt._DistributedOptimizer._allreduce_grad_async)
    assert "def _allreduce_grad_async(self, p):" in single
    assert "tensor = p.grad" in single and "self._compression.compress(tensor)" in single
    grouped = inspect.getsource(hopt._DistributedOptimizer._grouped_allreduce_grad_async)
    assert "self._compression.compress(p.grad) for p in ps" in grouped
    init = inspect.getsource(hopt._DistributedOptimizer.__init__)
    assert "self._parameter_names" in init and "self.op = op" in init
    assert "self._starting_models" in inspect.getsource(hopt._DistributedAdasumOptimizer.__init__)
    assert "optimizer.step()" in inspect.getsource(hfun.broadcast_optimizer_state)
    assert hopt.__name__.startswith(towner.HOROVOD_MODULE)


def test_tf_owner_matches_the_horovod_source_it_reads():
    tf = pytest.importorskip("tensorflow")  # noqa: F841
    import horovod
    import horovod.tensorflow as htf
    from horovod_sbc.tensorflow import owner as tfowner
    assert horovod.__version__ == tfowner.HOROVOD_VERSION
    src = inspect.getsource(htf)
    assert "def allreduce_grads(grads, vars=None, use_generic_names=False):" in src
    assert "compression.compress(tensor)" in src
    assert htf.__name__.startswith(tfowner.HOROVOD_MODULE)


def test_tf_owner_reads_horovods_locals_only():
    tf = pytest.importorskip("tensorflow")
    import horovod.tensorflow as htf
    from horovod_sbc.tensorflow import owner as tfowner
    v = tf.Variable([1.0, 2.0], name="dense/kernel")
    g = tf.constant([0.5, 0.5])
    src = "def allreduce_grads(grads, vars, op):\n    return compress(grads[0])\n"

    def compress(tensor):  # as SBC.compress calls it
        return tfowner.identify(tensor)
    inside = _run_as("horovod.tensorflow", src, compress=compress)
    assert inside["allreduce_grads"]([g], [v], htf.Sum) == ("dense/kernel", True)
    with pytest.raises(ValueError, match="Adasum"):
        inside["allreduce_grads"]([g], [v], htf.Adasum)
    outside = _run_as("my_training_script", src, compress=compress)
    with pytest.raises(ValueError, match="could not tell which variable"):
        outside["allreduce_grads"]([g], [v], htf.Average)


CHOICES = [  # optimizer -> its family (every one the hook finds exchanges weight changes)
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "adam"),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3), "adam"),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False, capturable=True), "adaptive"),
    (lambda ps: torch.optim.NAdam(ps, lr=1e-3), "adaptive"),
    (lambda ps: torch.optim.RAdam(ps, lr=1e-3), "adaptive"),
    (lambda ps: torch.optim.Adamax(ps, lr=1e-3), "adaptive"),
    (lambda ps: torch.optim.Adagrad(ps, lr=1e-3), "adaptive"),
    (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9), "adam"),
    (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True), "adam"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "sgd"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), "sgd"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "sgd"),
]


@pytest.mark.parametrize("make, fam", CHOICES)
def test_every_optimizer_the_hook_finds_exchanges_weight_changes(make, fam):
    """horovod_sbc.policy: every optimizer, at every delay and through either API, exchanges
    weight changes with the residual in the weights; Adam, AdamW and RMSprop freeze their
    second moment automatically."""
    from horovod_sbc import policy
    from horovod_sbc.torch.adam import family
    opt = make([torch.nn.Parameter(torch.zeros(3))])
    assert family(opt) == fam
    one, four = (policy.choose(fam, delay=d, api="stock") for d in (1, 4))
    for c in (one, four, policy.choose(fam, delay=1, api="dropin")):
        assert c.exchange == "weights" and c.local_residual
        assert c.auto_freeze == (fam == "adam")
    # the outer step left to the package: sqrt(N) x the average for the other adaptive ones at
    # delay 1, DiLoCo's Nesterov (momentum 0.5) for the frozen family with a delay
    assert one.outer == ("sqrt_n" if fam == "adaptive" else "plain")
    assert four.outer == ("nesterov" if fam == "adam" else "plain")
    assert repr(policy.outer_step(one, 4)) == ("Plain(lr=2.0)" if fam == "adaptive" else "Plain()")
    assert (repr(policy.outer_step(four, 4)) ==
            ("Nesterov(lr=1.0, momentum=0.5)" if fam == "adam" else "Plain()"))
    # ... and the plain average where the residual is beside the shared weights
    assert policy.choose(fam, delay=4, api="stock", local_residual=False).outer == "plain"


def test_an_optimizer_not_given_exchanges_gradients_through_the_stock_api():
    from horovod_sbc import policy
    assert policy.choose("unknown", api="stock") == policy.Choice("gradients", False, False)
    assert policy.choose("unknown", api="dropin") == policy.Choice("weights", True, False)
    with pytest.raises(ValueError, match="family must be one of"):
        policy.choose("lamb")


def test_the_momentum_knob_is_gone_with_a_clear_error():
    from horovod_sbc.torch import SBC
    for m in ("fold", "mask", "keep"):
        with pytest.raises(ValueError, match="momentum=.* was removed.*leave momentum= out"):
            SBC(0.01, momentum=m)


def test_the_automatic_freeze_waits_for_the_warm_up_and_the_variance():
    """policy.auto_freeze_step and torch's AutoFreeze: three time constants of the variance's
    average after the last rising learning rate, at most 100 steps; never during a warm-up."""
    from horovod_sbc import policy
    from horovod_sbc.torch.adam import AutoFreeze
    assert policy.auto_freeze_step(29, 0.95) == 29 + 60
    assert policy.auto_freeze_step(0, 0.999) == 100
    assert policy.auto_freeze_step(10, 0.0) == 13
    with pytest.raises(ValueError, match=r"beta2 \(RMSprop.s alpha\) must be in"):
        policy.auto_freeze_step(0, 1.0)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=1.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / 30 if s < 30 else 1.0 - s / 1000)
    auto, due = AutoFreeze(), []
    for step in range(200):
        due.append(auto.due(opt, step))
        sched.step()
    assert due.index(True) == 89 and all(due[89:]) and auto.frozen_at == 89
    # a warm-up longer than the wait: frozen only once the learning rate stops rising
    opt = torch.optim.AdamW([p], lr=1.0, betas=(0.9, 0.9))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    auto = AutoFreeze()
    due = [auto.due(opt, s) or sched.step() for s in range(200)]
    assert due.index(True) == 99 + 30
    # its decision is saved and restored
    again = AutoFreeze()
    again.load_state_dict(auto.state_dict())
    assert again.frozen_at == auto.frozen_at and again.due(opt, 300)


def test_knobs_that_do_not_apply_raise_where_they_are_passed():
    """One way to say each thing: the drop-in refuses the stock hook's knobs instead of
    ignoring them; top-k is TopK() or mode="values"; the drop-in takes an SBC, no shorthands."""
    import horovod_sbc.torch as sbc
    model = torch.nn.Linear(3, 2)

    def dropin(comp, opt=None):
        return sbc.DistributedOptimizer(opt or torch.optim.SGD(model.parameters(), lr=0.1),
                                        model.named_parameters(), compression=comp)
    with pytest.raises(ValueError, match="give named_parameters to horovod_sbc.torch"):
        dropin(sbc.SBC(0.1, named_parameters=model.named_parameters()))
    with pytest.raises(TypeError, match="delay"):
        sbc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 model.named_parameters(), delay=4)
    with pytest.raises(TypeError, match="binarize"):
        sbc.SBC(0.1, binarize=False)
    assert dropin(sbc.TopK(0.1)).compression.config.momentum is None  # a preset, nothing set after
    assert dropin(sbc.SBC(0.1, mode="values")).compression.mode == "values"
