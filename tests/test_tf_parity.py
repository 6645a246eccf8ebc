"""TensorFlow and PyTorch at parity: the same ``stats()`` keys, and the same state in a checkpoint
under the same names (residuals, reference weights, counters); docs/tensorflow.md lists what
only one of them keeps."""
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

import horovod_sbc.tensorflow as hsbc_tf  # noqa: E402
import horovod_sbc.torch as hsbc_torch  # noqa: E402
from horovod_sbc.residual import COUNTER_KEYS  # noqa: E402


def test_stats_have_the_keys_of_torch():
    tf_stats = hsbc_tf.SBC(density=0.01).stats()
    torch_stats = hsbc_torch.SBC(density=0.01).stats()
    assert list(tf_stats) == list(torch_stats) == list(COUNTER_KEYS)
    assert set(tf_stats.values()) == set(torch_stats.values()) == {0}


def test_checkpoint_holds_the_state_of_torch_under_its_names(tmp_path):
    """``tf.train.Checkpoint(sbc=...)`` holds ``residuals/<name>``, ``reference/<name>`` and
    ``counters/<key>``: the keys of torch's ``SBC.state_dict()`` for the same state."""
    sbc = hsbc_tf.SBC(density=0.01, delay=2)
    w = tf.Variable(tf.ones([3, 4]), name="w")
    sbc._residual("w", (3, 4), tf.float32)  # what the first sync creates
    sbc._reference("w", w)
    path = tf.train.Checkpoint(sbc=sbc).write(str(tmp_path / "ckpt"))
    saved = {n.split("/.ATTRIBUTES")[0] for n, _ in tf.train.list_variables(path)}
    groups = {}
    for n in saved:
        parts = n.split("/")
        if parts[0] == "sbc":
            groups.setdefault(parts[1], set()).add("/".join(parts[2:]))
    torch_state = hsbc_torch.SBC(density=0.01).state_dict()
    for key in ("residuals", "reference", "counters"):
        assert key in torch_state and key in groups, (key, sorted(groups))
    assert groups["residuals"] == groups["reference"] == {"w"}
    assert groups["counters"] == set(torch_state["counters"]) == set(COUNTER_KEYS)
    # the rest: the delay window and the job's shape (torch: the optimizer state and "config")
    assert set(groups) - {"residuals", "reference", "counters"} <= {
        "local_steps", "pending", "world", "draws", "calls"}, sorted(groups)


def test_the_default_residual_placement_is_torchs():
    """``SBC(local_residual=None)`` in weight mode chooses as the torch drop-in for the same
    recipe: in the weights (True) for every optimizer at every delay, and without the
    optimizer; an explicit choice stands."""
    import keras
    net = torch.nn.Linear(2, 2)
    recipes = [  # (torch optimizer, Keras optimizer, delay)
        (lambda: torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
         lambda: keras.optimizers.SGD(0.1, momentum=0.9), 1),
        (lambda: torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True),
         lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True), 1),
        (lambda: torch.optim.SGD(net.parameters(), lr=0.1),
         lambda: keras.optimizers.SGD(0.1), 1),
        (lambda: torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
         lambda: keras.optimizers.SGD(0.1, momentum=0.9), 4),
        (lambda: torch.optim.AdamW(net.parameters(), lr=1e-3),
         lambda: keras.optimizers.AdamW(1e-3), 1),
    ]
    for make_torch, make_keras, delay in recipes:
        opt = make_torch()
        dist = hsbc_torch.DistributedOptimizer(
            opt, named_parameters=net.named_parameters(),
            compression=hsbc_torch.SBC(density=0.01, delay=delay))
        kopt = make_keras()
        sbc = hsbc_tf.SBC(density=0.01, delay=delay)
        assert sbc.local_residual is None  # not chosen before the first step
        sbc._settle(kopt)
        what = f"{type(kopt).__name__} delay {delay}"
        assert dist._sbc_local_residual is True and sbc.local_residual is True, what
    # without the optimizer, and with Keras' decoupled weight decay: in the weights (and at 4
    # ranks only an adaptive optimizer whose second moment is not frozen has its average scaled
    # by sqrt(4): Keras' RMSprop, which TensorFlow does not freeze; torch's is frozen)
    for kopt, scaled in ((None, False),
                         (keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=5e-4), False),
                         (keras.optimizers.RMSprop(1e-3), True)):
        sbc = hsbc_tf.SBC(density=0.01)
        sbc._world_size = lambda: 4
        outer = sbc.outer
        sbc._settle(kopt)
        assert sbc.local_residual is True, kopt
        # the same runner (a checkpoint restored before the first step finds it), its spec set
        assert sbc.outer is outer and repr(outer) == ("Plain(lr=2.0)" if scaled else "Plain()")
    # Adam with a delay: DiLoCo's Nesterov with momentum 0.5, as torch's policy.outer_step
    for delay, want in ((1, "Plain()"), (4, "Nesterov(lr=1.0, momentum=0.5)")):
        sbc = hsbc_tf.SBC(density=0.01, delay=delay)
        sbc._settle(keras.optimizers.AdamW(1e-3))
        assert repr(sbc.outer) == want, delay
    # an explicit choice stands
    sbc = hsbc_tf.SBC(density=0.01, local_residual=False)
    sbc._settle(keras.optimizers.SGD(0.1, momentum=0.9))
    assert sbc.local_residual is False
    with pytest.raises(ValueError, match="local_residual must be None, True or False"):
        hsbc_tf.SBC(local_residual="yes")


#: what each framework's SBC takes beyond the shared knobs (framework types only)
FRAMEWORK_ONLY = {"torch": ["named_parameters"], "tf": ["optimizer", "name"]}


def test_sbc_has_the_same_knobs_in_the_same_order_with_the_same_defaults():
    """The signature of ``SBC`` in torch and TF: the same knobs (SBCConfig's fields, in its
    order), keyword-only after ``density, delay``, the same defaults; then each framework's own
    (torch ``named_parameters``; TF ``optimizer``, ``name``). The outer steps are one set of
    classes."""
    import dataclasses
    import inspect
    from horovod_sbc.config import SBCConfig

    def knobs(cls, extra):
        params = list(inspect.signature(cls).parameters.values())
        assert [p.name for p in params[-len(extra):]] == extra
        return [(p.name, p.default, p.kind) for p in params[:-len(extra)]]

    torch_knobs = knobs(hsbc_torch.SBC, FRAMEWORK_ONLY["torch"])
    tf_knobs = knobs(hsbc_tf.SBC, FRAMEWORK_ONLY["tf"])
    assert torch_knobs == tf_knobs
    fields = {f.name: f.default for f in dataclasses.fields(SBCConfig)}
    assert sorted(n for n, _, _ in torch_knobs) == sorted(fields)
    assert all(fields[n] == d for n, d, _ in torch_knobs), torch_knobs
    assert [k for _, _, k in torch_knobs[2:]] == [inspect.Parameter.KEYWORD_ONLY] * (
        len(torch_knobs) - 2)
    for step in ("Plain", "Nesterov", "ErrorDecay"):
        assert getattr(hsbc_torch, step) is getattr(hsbc_tf, step)
    # the drop-in entry points take the optimizer/tape, the names (torch) and SBC: no knob
    assert list(inspect.signature(hsbc_torch.DistributedOptimizer).parameters) == [
        "optimizer", "named_parameters", "compression"]
    assert list(inspect.signature(hsbc_tf.DistributedGradientTape).parameters) == [
        "gradtape", "compression"]


def test_a_knob_is_checked_the_same_way_in_both_frameworks():
    bad = [dict(local_residual="yes"), dict(outer="nesterov"), dict(momentum="heavy"),
           dict(freeze_variance_after=0), dict(hierarchy=[[0, 1], [1, 2]]),
           dict(hierarchy=[[0, 1]], topology="server")]
    for kw in bad:
        errors = []
        for cls in (hsbc_torch.SBC, hsbc_tf.SBC):
            with pytest.raises(ValueError) as e:
                cls(0.01, **kw)
            errors.append(str(e.value))
        assert errors[0] == errors[1], (kw, errors)
