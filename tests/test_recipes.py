"""Tutorial recipes with SBC on real multi-rank jobs: the stock Horovod helpers around the drop-in
optimizer, AMP's step skipping, every option of stock hvd.DistributedOptimizer, a training task
that fails without the exchange (negative control), and a rank killed inside a sync. All but
the killed-rank jobs are scenarios of one shared job."""
import time

import numpy as np
import pytest

from harness import SharedJob, run_ranks

pytestmark = pytest.mark.multirank


JOB = SharedJob("torch_recipes.py", 2, {m: [m, *a] for m, *a in (
    ("broadcasts", "steps=160"), ("amp",), ("stock_options",), ("noniid",))}, timeout=900)


def _identical(results, key="digests"):
    for s, ds in enumerate(zip(*[r[key] for r in results])):
        assert len(set(ds)) == 1, f"ranks differ after step {s}"


def test_stock_broadcasts_and_scheduler_keep_the_delay_window():
    results = JOB["broadcasts"]
    for r in results:
        assert r["stats"]["steps"] == 160 and r["stats"]["syncs"] == 160 // 4
        assert r["epoch"] == 7 and r["lr"] == pytest.approx(0.1 * 0.5 ** 4)
        assert np.mean(r["losses"][-20:]) < 0.6 * np.mean(r["losses"][:20])
    a, b = results
    for s in range(0, 161, 4):  # bit-identical after the broadcast and after every sync
        assert a["digests"][s] == b["digests"][s], f"ranks differ after step {s}"
    assert a["digests"][1] != b["digests"][1]  # local steps in between really are local


def test_gradscaler_overflow_on_one_rank_keeps_ranks_together():
    results = JOB["amp"]
    a, b = results
    for r in results:
        assert r["stats"]["steps"] == 12 and r["stats"]["syncs"] == 6
    for s in range(0, 13, 2):
        assert a["digests"][s] == b["digests"][s], f"ranks differ after step {s}"
    assert b["skipped_local"][4] and not a["skipped_local"][4]  # only rank 1 skipped its update
    assert b["scale"] < a["scale"]  # and its scaler backed off


OPTIONS = ("sparse_as_dense", "backward_passes", "predivide", "op_sum", "groups", "synchronize")


@pytest.fixture(scope="module")
def stock_options():
    return JOB["stock_options"]


def test_op_sum_is_refused_on_every_rank(stock_options):
    """SGD through stock Horovod exchanges weight changes, which are averaged: op=hvd.Sum
    (the sum of gradients, an N-fold step for SGD but not for Adam) is refused by name."""
    for r in stock_options:
        msg = r["op_sum"]["error"]
        assert msg and msg.startswith("ValueError: SBC through stock hvd.DistributedOptimizer "
                                      "with SGD averages the ranks' weight changes"), msg
        assert "op=hvd.Average" in msg, msg


@pytest.mark.parametrize("option", [o for o in OPTIONS if o != "op_sum"])
def test_every_stock_optimizer_option_with_sbc(stock_options, option):
    runs = [r[option] for r in stock_options]
    _identical(runs)
    for r in runs:
        assert len(set(r["digests"])) > 20  # the weights move
        assert np.mean(r["losses"][-8:]) < np.mean(r["losses"][:8]), r["losses"]
        assert r["stats"]["syncs"] == 30 and r["stats"]["upstream_bits"] > 0


@pytest.mark.parametrize("option", ["groups", "predivide"])
def test_stock_options_apply_the_same_update_as_dense_horovod(stock_options, option):
    """SBC at density 1 without binarization sends exact values: the first update must equal
    what the same stock option does with Horovod's dense allreduce."""
    exact, dense = stock_options[0][option + "_exact"], stock_options[0][option + "_dense"]
    for name, want in dense["first_update"].items():
        np.testing.assert_allclose(exact["first_update"][name], want, rtol=1e-5, atol=1e-7)
    assert exact["digests"][-1] == stock_options[1][option + "_exact"]["digests"][-1]


def test_training_needs_the_exchange_negative_control():
    """Each rank sees only half of the classes: without communication a rank cannot classify
    the others, with SBC every rank learns all ten."""
    results = JOB["noniid"]
    assert results[0]["sbc"]["digest"] == results[1]["sbc"]["digest"]
    for r in results:
        assert r["alone"]["accuracy"] < 0.6, r  # the control fails the bar ...
        assert r["sbc"]["accuracy"] > 0.85, r  # ... that SBC clears


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_rank_killed_inside_an_sbc_sync_ends_the_job(controller):
    t0 = time.monotonic()
    _, out = run_ranks("torch_recipes.py", 2, ["kill_in_sync"], timeout=120,
                       controller=controller, expect_fail=True)
    assert time.monotonic() - t0 < 60
    assert "rank 1 dies inside its allgather" in out and "rank 0 entering SBC sync 5" in out
    assert ("exited on signal 9" in out) or ("exited with non-zero status" in out), out[-2000:]
