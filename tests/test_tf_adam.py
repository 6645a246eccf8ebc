"""Keras Adam's second moment frozen (horovod_sbc.tensorflow.adam): the frozen step against a
float64 hand computation (eagerly and in ``tf.function``), Keras' own Adam until the freeze, the
same steps as torch's frozen AdamW, linear in the gradient, and a checkpoint resume that freezes
where the first run did."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from horovod_sbc.tensorflow import SBC  # noqa: E402
from horovod_sbc.tensorflow.adam import freeze_variance_after  # noqa: E402

LR, B1, B2, EPS, WD, K = 0.01, 0.9, 0.95, 1e-8, 0.1, 2
W0 = np.linspace(-1.0, 1.0, 7).astype(np.float32)


def _grads(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(7).astype(np.float32) for _ in range(n)]


def _opt(kind="adamw", freeze=True):
    if kind == "adamw":
        opt = keras.optimizers.AdamW(learning_rate=LR, beta_1=B1, beta_2=B2, epsilon=EPS,
                                     weight_decay=WD)
    else:
        opt = keras.optimizers.Adam(learning_rate=LR, beta_1=B1, beta_2=B2, epsilon=EPS)
    return freeze_variance_after(opt, K) if freeze else opt


def _train(grads, kind="adamw", freeze=True, traced=False, opt=None, w=None):
    w = keras.Variable(W0.copy()) if w is None else w
    opt = _opt(kind, freeze) if opt is None else opt
    opt.build([w])

    def apply(g):
        opt.apply_gradients([(g, w)])
    run = tf.function(apply) if traced else apply
    for g in grads:
        run(tf.constant(g))
    return w, opt


def _by_hand(grads, wd):
    """Keras' Adam for K steps, then the frozen step, in float64."""
    w, m, v = W0.astype(np.float64), np.zeros(7), np.zeros(7)
    for i, g in enumerate(grads):
        t = i + 1
        w = w - w * wd * LR
        m += (g - m) * (1 - B1)
        if i < K:
            v += (g * g - v) * (1 - B2)
            w = w - m * LR * np.sqrt(1 - B2 ** t) / (1 - B1 ** t) / (np.sqrt(v) + EPS)
        else:
            if i == K:
                v = v / (1 - B2 ** K)
            w = w - LR / (1 - B1 ** t) * m / (np.sqrt(v) + EPS)
    return w


@pytest.mark.parametrize("kind", ["adamw", "adam"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_the_frozen_step_is_the_hand_computation(kind, traced):
    grads = _grads(6)
    w, opt = _train(grads, kind, traced=traced)
    want = _by_hand(grads, WD if kind == "adamw" else 0.0)
    np.testing.assert_allclose(w.numpy(), want, rtol=0, atol=2e-6)
    plain, _ = _train(grads, kind, freeze=False, traced=traced)
    assert np.abs(plain.numpy() - want).max() > 1e-3  # negative control: Keras' own Adam
    assert type(opt).__name__ == type(_opt(kind, freeze=False)).__name__
    assert isinstance(opt, keras.optimizers.Adam)


def test_until_the_freeze_it_is_keras_adam_bit_for_bit():
    grads = _grads(K + 1)
    for n in range(1, K + 1):
        a, _ = _train(grads[:n])
        b, _ = _train(grads[:n], freeze=False)
        assert np.array_equal(a.numpy(), b.numpy()), n
    a, _ = _train(grads)
    b, _ = _train(grads, freeze=False)
    assert not np.array_equal(a.numpy(), b.numpy())


def test_keras_and_torch_take_the_same_frozen_steps():
    torch = pytest.importorskip("torch")
    from horovod_sbc.torch.adam import frozen_step
    grads = _grads(7, seed=3)
    w, _ = _train(grads)
    p = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    opt = torch.optim.AdamW([p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    for i, g in enumerate(grads):
        p.grad = torch.from_numpy(g)
        opt.step() if i < K else frozen_step(opt)
    np.testing.assert_allclose(w.numpy(), p.detach().numpy(), rtol=0, atol=2e-6)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_coordinates_without_gradient_until_the_freeze_step_as_torchs(traced):
    """Coordinates 1 and 4 get no gradient in the warm-up: at the freeze they are raised to the
    floor (torch's rule), and the steps stay torch's; a variable that saw no gradient at all
    takes the square of the freeze's gradient."""
    torch = pytest.importorskip("torch")
    from horovod_sbc.torch.adam import frozen_step
    grads = _grads(7, seed=5)
    for g in grads[:K]:
        g[[1, 4]] = 0.0
    zero = [np.zeros(7, np.float32)] * K + _grads(7 - K, seed=6)
    ws = [keras.Variable(W0.copy()), keras.Variable(W0.copy() + 1.0)]
    opt = _opt()
    opt.build(ws)

    def apply(g, h):
        opt.apply_gradients([(g, ws[0]), (h, ws[1])])
    run = tf.function(apply) if traced else apply
    for g, h in zip(grads, zero):
        run(tf.constant(g), tf.constant(h))
    ps = [torch.nn.Parameter(torch.from_numpy(W0.copy())),
          torch.nn.Parameter(torch.from_numpy(W0.copy() + 1.0))]
    topt = torch.optim.AdamW(ps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    for i, (g, h) in enumerate(zip(grads, zero)):
        ps[0].grad, ps[1].grad = torch.from_numpy(g), torch.from_numpy(h)
        topt.step() if i < K else frozen_step(topt)
    for w, p in zip(ws, ps):
        np.testing.assert_allclose(w.numpy(), p.detach().numpy(), rtol=0, atol=2e-6)
        v = opt._velocities[opt._get_variable_index(w)].numpy() / (1 - B2 ** K)
        np.testing.assert_allclose(v, topt.state[p]["exp_avg_sq"].numpy(), rtol=1e-5)
    assert np.all(opt._velocities[0].numpy() > 0)


def test_frozen_steps_are_linear_in_the_gradient():
    """The mean of two ranks' frozen steps from the same state is the step on the mean
    gradient: what the drop-in's average of the ranks' weight changes needs."""
    warm, g1, g2 = _grads(K), *_grads(2, seed=9)

    def step(g, freeze=True):
        w, opt = _train(warm, freeze=freeze)
        before = w.numpy().astype(np.float64)
        _train([g], opt=opt, w=w)
        return w.numpy() - before
    mean = (step(g1) + step(g2)) / 2
    np.testing.assert_allclose(step((g1 + g2) / 2), mean, rtol=0, atol=1e-7)
    adam = (step(g1, False) + step(g2, False)) / 2
    assert np.abs(step((g1 + g2) / 2, False) - adam).max() > 1e-4  # Adam's own steps are not


@pytest.mark.parametrize("cut", [K, K + 2])
def test_a_restored_run_freezes_where_the_first_one_did(tmp_path, cut):
    grads = _grads(6)
    straight, _ = _train(grads)
    w, opt = _train(grads[:cut])
    path = tf.train.Checkpoint(w=w, opt=opt).write(str(tmp_path / "ckpt"))
    w2, opt2 = keras.Variable(np.zeros(7, np.float32)), _opt(freeze=False)
    opt2.build([w2])
    tf.train.Checkpoint(w=w2, opt=opt2).read(path).assert_consumed()
    freeze_variance_after(opt2, K)
    _train(grads[cut:], opt=opt2, w=w2)
    assert np.array_equal(w2.numpy(), straight.numpy())


def test_freeze_variance_after_is_checked():
    with pytest.raises(ValueError, match="applies to keras.optimizers.Adam and AdamW, not SGD"):
        freeze_variance_after(keras.optimizers.SGD(0.1, momentum=0.9), 10)
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="needs a number of steps >= 1, got"):
            freeze_variance_after(_opt(freeze=False), bad)
    with pytest.raises(ValueError, match="does not support Adam's amsgrad"):
        freeze_variance_after(keras.optimizers.Adam(amsgrad=True), 10)


def test_the_stock_tape_warning_names_the_freeze_for_keras_adam():
    import warnings
    from horovod_sbc.tensorflow import SBC
    for opt, named in ((keras.optimizers.AdamW(1e-3), True),
                       (keras.optimizers.RMSprop(1e-3), False)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            SBC(0.01, optimizer=opt)._warn_stock()
        (w,) = [str(x.message) for x in seen]
        assert "exchanges sparse gradients" in w and type(opt).__name__ in w
        assert ("freezes its second moment" in w) == named, w


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_eagerly_the_freeze_is_decided_once_per_step_not_per_variable(monkeypatch, traced):
    """Eagerly each ``tf.cond``/``tf.switch_case`` reads its index on the host (a device sync on a
    GPU): the eager step reads ``iterations`` once and branches in Python; a traced step keeps
    one ``tf.switch_case`` per variable, decided on the device. Same weights either way."""
    calls = []
    for name in ("cond", "switch_case"):
        real = getattr(tf, name)
        monkeypatch.setattr(tf, name,
                            lambda *a, _real=real, **kw: calls.append(1) or _real(*a, **kw))
    ws = [keras.Variable(W0.copy() * (i + 1)) for i in range(3)]
    opt = _opt()
    opt.build(ws)

    def apply(gs):
        opt.apply_gradients(zip(gs, ws))
    run = tf.function(apply) if traced else apply
    grads = _grads(5)
    for g in grads:
        run([tf.constant(g * (i + 1)) for i in range(3)])
    assert len(calls) == (3 if traced else 0)  # traced once, three variables
    for i, w in enumerate(ws):
        w_ref, _ = _train([g * (i + 1) for g in grads], w=keras.Variable(W0.copy() * (i + 1)),
                          traced=True)
        np.testing.assert_array_equal(w.numpy(), w_ref.numpy())


class _WarmupCosine(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, warm, total):
        self.warm, self.total = warm, total

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        cos = 0.5 * (1.0 + tf.cos(np.pi * (step - self.warm) / self.total))
        return tf.where(step < self.warm, (step + 1.0) / self.warm, cos)


def test_the_automatic_freeze_step_is_torchs():
    """freeze_variance_after(opt) ("auto"): the warm-up read off the Keras schedule, then
    horovod_sbc.policy's rule: the step torch's AutoFreeze finds on the same schedule."""
    import torch
    from horovod_sbc.tensorflow.adam import auto_freeze_steps, is_frozen
    from horovod_sbc.torch.adam import AutoFreeze
    opt = keras.optimizers.AdamW(learning_rate=_WarmupCosine(30, 600), beta_2=0.95)
    p = torch.nn.Parameter(torch.zeros(1))
    topt = torch.optim.AdamW([p], lr=1.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        topt, lambda s: (s + 1) / 30 if s < 30 else 0.5 * (1 + np.cos(np.pi * (s - 30) / 600)))
    auto = AutoFreeze()
    torch_k = next(s for s in range(400) if auto.due(topt, s) or sched.step())
    assert auto_freeze_steps(opt) == torch_k == 29 + 60
    assert auto_freeze_steps(keras.optimizers.Adam(1e-3)) == 100  # constant lr, beta_2 0.999
    # the drop-in (weight mode) freezes a Keras Adam it is handed eagerly, as torch's does
    sbc = SBC(0.1)
    sbc._settle(opt)
    assert is_frozen(opt) and opt._sbc_freeze_after == 89 and sbc.local_residual
    with pytest.raises(ValueError, match="applies to keras.optimizers.Adam"):
        auto_freeze_steps(keras.optimizers.SGD(0.1))
