"""PyTorch integration on real multi-rank jobs: both entry points, delay, state, accounting.

The scenarios run in the shared jobs of tests/torch_jobs.py."""
import json
import os
import tempfile

import pytest

from harness import ROOT, run_ranks
from torch_jobs import CKPT, CKPT_DIR, JOBS, KERNELS_OFF, STEPS, TRAIN

pytestmark = pytest.mark.multirank

# parameters of tests/workers/torch_sbc.py's Net with requires_grad: fc1, fc2, aux
TRAINABLE = 20 * 64 + 64 + 64 * 5 + 5 + 64 * 5 + 5
N_TENSORS = 6


@pytest.mark.parametrize("api,np_,delay,controller", TRAIN)
def test_identical_parameters_after_every_sync_and_exact_accounting(api, np_, delay, controller):
    results = JOBS[(np_, controller)][("train", api, delay)]
    check_train(results, api, np_, delay)
    want = "tensor ops" if (np_, controller) in KERNELS_OFF else "C kernels"
    assert {r["backend"] for r in results} == {want}


@pytest.mark.parametrize("api", ["stock", "dropin"])
def test_a_model_of_hundreds_of_tensors_syncs_through_the_c_kernels(api):
    """210 parameter tensors on 2 ranks with the C kernels: the job ends (a drop-in sync of 128
    or more tensors once crashed in the scatter kernel, tests/test_kernels.py), and the weights
    every rank shares are bit-identical; each rank's own weights differ by its residual (stock
    Horovod's SGD exchanges weight changes too)."""
    results = JOBS[(2, "mpi")][("many", api)]
    assert [r["tensors"] for r in results] == [210, 210]
    assert {r["backend"] for r in results} == {"C kernels"}
    assert len({r["shared"] for r in results}) == 1
    assert len({r["own"] for r in results}) == 2


@pytest.mark.parametrize("api", ["stock", "dropin"])
def test_a_compressor_with_its_own_encoders_runs_through_both_paths(api):
    """STC (``native_kernel=False``: its own encoders on the C kernels' path) through the
    stock hook and the drop-in: identical parameters after every sync, its bits counted
    exactly."""
    results = JOBS[(2, "mpi")][("train", api, 1, "stc")]
    check_train(results, api, 2, 1)
    k = sum(max(1, round(0.05 * n)) for n in (20 * 64, 64, 64 * 5, 5, 64 * 5, 5))
    for r in results:  # top-k of every tensor that had a gradient, every step
        assert 0 < r["stats"]["positions_sent"] <= k * STEPS


def check_train(results, api, np_, delay, steps=STEPS):
    digests = [r["digests"] for r in results]
    for s in range(0, steps + 1, delay):  # after the broadcast and after every sync
        assert len({d[s] for d in digests}) == 1, f"ranks differ after step {s}"
    assert len(set(digests[0][::delay])) == len(digests[0][::delay])  # weights do move
    if delay > 1:  # between syncs ranks train locally on their own data
        assert digests[0][1] != digests[1][1]
    for r in results:
        st, g = r["stats"], r["gathered"]
        assert st["steps"] == steps and st["syncs"] == steps // delay
        assert st["dense_bits"] == 32 * TRAINABLE * steps
        dummy = 16 * N_TENSORS * steps if api == "stock" else 0  # stock's float16 allreduce
        assert st["upstream_bits"] == 8 * g["sent"] + dummy
        assert st["downstream_bits"] == 8 * g["received"]
        assert st["upstream_bits"] * 20 < st["dense_bits"]
    # what one rank sent, the others received
    assert sum(r["gathered"]["sent"] for r in results) * (np_ - 1) == \
        sum(r["gathered"]["received"] for r in results)


@pytest.mark.parametrize("api", ["stock", "dropin"])
def test_density_one_without_binarization_equals_dense_averaging(api):
    results = JOBS[(2, "mpi")][("dense_equiv", api)]
    for r in results:
        assert r["max_abs_diff"] <= 1e-6  # fp32 rounding of the update path only
    assert results[0]["digest"] == results[1]["digest"]


@pytest.mark.parametrize("method,local_residual", CKPT)
def test_checkpoint_mid_delay_resumes_bit_identically(method, local_residual):
    """local_residual=1 (the default): the residual lives in the weights, the checkpoint is the
    model's weights plus the optimizer's reference weights."""
    c = (method, local_residual)
    saved = JOBS[(2, "mpi")][("save", *c)]
    assert sorted(os.listdir(CKPT_DIR[c])) == ["ckpt_rank0.pt", "ckpt_rank1.pt"]
    loaded = JOBS["load"][c]
    for r in range(2):
        assert loaded[r]["digests"] == saved[r]["digests"]  # next 20 steps bit-identical
        assert loaded[r]["stats_at_checkpoint"] == saved[r]["stats_at_checkpoint"]
    assert saved[0]["stats_at_checkpoint"]["steps"] == 7  # saved between syncs (delay 3)


@pytest.mark.parametrize("local_residual", [0, 1])
def test_errors_are_clear_and_raised_on_every_rank(local_residual):
    results = JOBS[(2, "mpi")][("errors", local_residual)]
    for r in results:
        assert r["delay_stock"] is None
        assert "exchanges weight changes; its topology='server' needs " \
               "horovod_sbc.torch.DistributedOptimizer" in r["server_stock"]
        assert "op=hvd.Adasum" in r["adasum"]
        assert r["groups"] is None  # grouped allreduce works: data still goes by allgather
        assert "density must be in (0, 1]" in r["density"]
        assert "compression must be horovod_sbc.torch.SBC" in r["dropin_wrong_compression"]
        for key in ("nan_dropin", "nan_stock"):
            assert r[key].startswith("ValueError: SBC: rank 1 could not encode")
            assert "contains NaN or Inf" in r[key] and "'fc" in r[key]
        assert "skipping this sync" in r["skip_warning"]
        # the shared weights did not move; every rank's weights are finite again
        assert r["skip_shared_unchanged"] and r["skip_finite_now"] and r["skip_finite"]
    if local_residual:
        # the healthy rank keeps its local step (in its weights, sent next time); the failing
        # rank's NaN weights restarted from the shared weights
        assert not results[0]["skip_unchanged"] and results[1]["skip_unchanged"]
        assert results[0]["skip_after_shared"] == results[1]["skip_after_shared"]
    else:  # the weights are the shared ones
        assert results[0]["skip_unchanged"] and results[1]["skip_unchanged"]
        assert results[0]["skip_after"] == results[1]["skip_after"]


@pytest.mark.slow
@pytest.mark.parametrize("api,delay", [("stock", 1), ("dropin", 4)])
def test_digits_accuracy_within_one_point_of_dense(api, delay):
    out = os.path.join(tempfile.mkdtemp(prefix="sbc-digits-"), "res.json")
    run_ranks(str(ROOT / "examples" / "pytorch_sbc_digits.py"), 2,
              ["--methods", "dense,sbc", "--api", api, "--delay", str(delay), "--density", "0.01",
               "--json", out, "--no-progress"], timeout=300, raw=True)
    dense, sbc = json.load(open(out))["runs"]
    assert dense["method"] == "dense" and sbc["method"] == "sbc" and sbc["density"] == 0.01
    assert dense["final_accuracy"] > 0.95
    assert sbc["final_accuracy"] >= dense["final_accuracy"] - 0.01
    assert sbc["ranks_identical"] and dense["ranks_identical"]
    assert sbc["compression_ratio"] > (300 if delay == 1 else 1000)


def test_baseline_compressors_keep_ranks_identical_and_count_their_bits():
    results = JOBS[(2, "mpi")][("baselines",)]
    a, b = results
    dense_per_step = 32 * TRAINABLE
    for name in ("topk", "fedavg", "signsgd", "terngrad"):
        ra, rb = a[name], b[name]
        d = ra["delay"]
        for s in range(0, 7, d):
            assert ra["digests"][s] == rb["digests"][s], (name, s)
        assert len(set(ra["digests"][::d])) == len(ra["digests"][::d])
        st = ra["stats"]
        assert st["upstream_bits"] == 8 * ra["sent"] and st["dense_bits"] == dense_per_step * 6
        per_sync_bits = st["upstream_bits"] / st["syncs"]
        if name == "signsgd":  # one bit per element plus small headers
            assert TRAINABLE <= per_sync_bits <= TRAINABLE + 8 * 40 * N_TENSORS
        if name == "fedavg":  # dense values (+1 bit per element of implicit positions)
            assert per_sync_bits >= 32 * TRAINABLE
        if name == "topk":  # 5 % of the entries, 32-bit values + coded positions each
            assert 32 * 0.05 * TRAINABLE < per_sync_bits < 45 * 0.05 * TRAINABLE + 2000
