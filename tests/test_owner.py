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


@pytest.mark.parametrize("make, momentum, expect", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "fold", "AdamW: Adam-style optimizers normalise"),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3), "fold", "Adam: Adam-style optimizers normalise"),
    (lambda ps: torch.optim.NAdam(ps, lr=1e-3), "fold", "NAdam: Adam-style optimizers normalise"),
    (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9), "fold",
     "RMSprop: the optimizer's momentum"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "fold", None),  # folded
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "mask",
     "SBC(momentum='mask') through stock hvd.DistributedOptimizer with SGD momentum"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "fold", None),
])
def test_stock_hook_warns_once_for_optimizers_it_trains_badly_with(make, momentum, expect):
    """The one-line change names a better setting when the optimizer it finds is one the stock
    path trains worse with (Adam family, a momentum it does not fold, SGD's momentum left to
    masking), once per compressor; plain SGD and SGD with its momentum folded are quiet."""
    import warnings

    from horovod_sbc.torch import SBC
    from horovod_sbc.torch.hook import warn_momentum
    p = torch.nn.Parameter(torch.zeros(3))
    hook = SBC(0.01, momentum=momentum)
    owner = towner.Owner("w", make([p]), p)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn_momentum(hook, owner)
        warn_momentum(hook, owner)
    msgs = [str(w.message) for w in seen]
    if expect is None:
        assert msgs == []
        return
    assert len(msgs) == 1 and expect in msgs[0], msgs
    if momentum == "mask":
        assert "SBC(momentum='fold') (the default)" in msgs[0], msgs[0]
        return
    setting = "compression=SBC(0.01), freeze_variance_after=total_steps // 6" \
        if expect.startswith(("Adam", "AdamW")) else \
        "compression=SBC(0.01, delay=1), outer=Plain(lr=hvd.size() ** 0.5)" \
        if "Adam" in expect else \
        "compression=SBC(0.01, delay=16), outer=Nesterov(lr=1.0, momentum=0.5)"
    assert "horovod_sbc.torch.DistributedOptimizer(optimizer, named_parameters, " \
           f"{setting})" in msgs[0], msgs[0]
