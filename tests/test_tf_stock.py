"""Stock ``hvd.DistributedGradientTape(tape, compression=SBC(..., optimizer=opt))`` picks the
algorithm from the optimizer (horovod_sbc/policy.py): Keras Adam and SGD exchange weight changes
after their step (horovod_sbc/tensorflow/stock.py), the same algorithm as the drop-in tape. One
real 2-rank job (tests/workers/tf_stock.py)."""
import pytest

from harness import SharedJob

TWO = SharedJob("tf_stock.py", 2, {
    "adam": ["adam"],
    "adam-fn-delay2": ["adam", "fn=1", "delay=2"],
    "sgd": ["adam", "opt=sgd", "fn=1", "steps=3"],
    "resume": ["resume", "delay=2", "fn=1"],
    "errors": ["errors"]}, timeout=240)

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("key", ["adam", "adam-fn-delay2", "sgd"])
def test_stock_tape_exchanges_weight_changes_as_the_dropin_does(key):
    """Bit-identical shared weights on both ranks after every step, and the same shared weights
    and model weights (each rank's own, with its local residual) as the drop-in tape + sbc.step
    from the same seed and data: the same algorithm; the delay's syncs only every delay-th step;
    no warning."""
    res = TWO[key]
    delay = 2 if key == "adam-fn-delay2" else 1
    steps = len(res[0]["stock"]["refs"])
    for s in range(steps):
        assert res[0]["stock"]["refs"][s] == res[1]["stock"]["refs"][s], (key, s)
    for r in res:
        stock, dropin = r["stock"], r["dropin"]
        assert stock["refs"] == dropin["refs"] and stock["weights"] == dropin["weights"], key
        assert stock["losses"] == dropin["losses"]
        assert stock["local_residual"] is True and stock["iterations"] == steps
        assert stock["stats"]["syncs"] == dropin["stats"]["syncs"] == steps // delay
        assert stock["stats"]["steps"] == steps
        # Horovod's placeholder allreduce: a float16 per gradient and step, on top of the messages
        assert stock["stats"]["upstream_bits"] == dropin["stats"]["upstream_bits"] + 16 * 4 * steps
        assert stock["warnings"] == [], stock["warnings"]
    # the shared weights move at every sync (step s syncs when s + 1 is a multiple of delay) only
    refs = res[0]["stock"]["refs"]
    assert [refs[s] != refs[s - 1] for s in range(1, steps)] == \
        [(s + 1) % delay == 0 for s in range(1, steps)]
    if key != "sgd":
        assert res[0]["stock"]["frozen"]  # Adam's variance freeze armed


def test_stock_weight_exchange_resumes_exactly_from_a_checkpoint():
    """4 steps straight == 2 steps, tf.train.Checkpoint(model, opt, sbc), a fresh process state
    restored without sbc.build(), 2 more steps (delay 2, tf.function, local residuals). Adam with
    a delay gets the Nesterov outer step once its first step shows the optimizer, after the
    restore: its momentum buffers are restored too (the same runner, its spec set)."""
    for r in TWO["resume"]:
        assert r["resumed"] == r["straight"]
        assert r["straight"]["outer"] == "Nesterov(lr=1.0, momentum=0.5)"
        assert r["straight"]["stats"]["syncs"] == 2 and r["straight"]["iterations"] == 4
    assert TWO["resume"][0]["straight"]["refs"] == TWO["resume"][1]["straight"]["refs"]


def test_what_cannot_work_says_so_on_every_rank():
    for r in TWO["errors"]:
        assert "broadcast the initial weights BEFORE the first step" in r["apart"], r["apart"]
        assert "rank(s) hold other weights than rank 0" in r["apart"]
        assert "apply the gradients of every tape.gradient() call" in r["forgot"], r["forgot"]
        assert "SBC(momentum='fold') was removed" in r["momentum"], r["momentum"]
        assert "SBC(hierarchy=...) needs the weight exchange" in r["hierarchy"], r["hierarchy"]
        assert "op=hvd.Sum has no meaning" in r["op_sum"]
        for key, knob in (("delay_no_opt", "delay=2"), ("outer_no_opt", "outer=...")):
            assert f"SBC({knob}) applies where weight changes are exchanged" in r[key], r[key]
            assert "SBC(..., optimizer=opt)" in r[key]
        assert r["sgd_local"] is None and r["sgd_local_syncs"] == 1
