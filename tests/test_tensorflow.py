"""TensorFlow 2 integration on real multi-rank jobs: stock and drop-in tape (eager and
tf.function), delay, Keras model.fit, checkpoints, accounting, errors, interop with PyTorch.

Few jobs, each checking a lot: a horovodrun job with TensorFlow takes ~10 s just to start, so
the 2-rank scenarios share one job (and the checkpoint load, in fresh processes, another).
"""
import json
import os
import tempfile

import numpy as np
import pytest

from harness import ROOT, SharedJob, run_ranks
from horovod_sbc import reference

pytestmark = pytest.mark.multirank

# tests/workers/tf_sbc.py: fc1 (20->32), fc2 (32->5), and for the drop-in an aux head (32->5)
NUMEL = {"stock": 20 * 32 + 32 + 32 * 5 + 5, "dropin": 20 * 32 + 32 + 2 * (32 * 5 + 5)}
N_TENSORS = {"stock": 4, "dropin": 6}


def check_run(results, spec, steps):
    """Identical variables after the broadcast and after every sync; exact accounting."""
    api, mode, delay = spec.split(":")[-1].split("-")  # "[compressor:]api-how-delay"
    delay = int(delay)
    runs = [r[spec] for r in results]
    np_ = len(results)
    digests = [r["digests"] for r in runs]
    for s in range(0, steps + 1, delay):
        assert len({d[s] for d in digests}) == 1, f"{spec}: ranks differ after step {s}"
    assert len(set(digests[0])) == steps + 1, f"{spec}: weights must move every step"
    if delay > 1:  # between syncs the ranks train locally on their own data
        assert digests[0][1] != digests[1][1]
    for r in runs:
        st, g = r["stats"], r["gathered"]
        assert r["numel"] == NUMEL[api] and r["n_tensors"] == N_TENSORS[api]
        assert st["steps"] == steps and st["syncs"] == steps // delay, spec
        assert st["dense_bits"] == 32 * NUMEL[api] * steps, spec
        dummy = 16 * N_TENSORS[api] * steps if api == "stock" else 0  # Horovod's float16 allreduce
        assert st["upstream_bits"] == 8 * g["sent"] + dummy, spec
        assert st["downstream_bits"] == 8 * g["received"], spec
        assert st["upstream_bits"] * 10 < st["dense_bits"], spec
    # what one rank sent, every other rank received
    assert sum(r["gathered"]["sent"] for r in runs) * (np_ - 1) == \
        sum(r["gathered"]["received"] for r in runs)
    return runs


RUNS_2 = ["stock-eager-1", "stock-fn-1", "dropin-eager-1", "dropin-fn-1", "dropin-fn-3"]
# every compressor torch has through the drop-in tape
MODE_RUNS = ["sign-eager", "terngrad-eager", "values-eager", "stc-eager"]  # eager: tf.function
# of these encoders is tests/test_registry.py's
# SBC(fixed_size=True): the same runs with padded step messages
FIXED_RUNS = ["stock-eager-1", "dropin-eager-1"]
# the stock tape with hvd.DistributedGradientTape(..., groups=1)
GROUPED_RUNS = ["stock-eager-1", "stock-fn-1"]
STEPS_2 = 8
CKPT = tempfile.mkdtemp(prefix="sbc-tf-ckpt-")
# "save" first: Keras numbers layer names per process, and the load runs in a fresh one
TWO = SharedJob("tf_sbc.py", 2, {
    "save": ["save", f"ckpt={CKPT}"],
    "train": ["train", f"steps={STEPS_2}", "runs=" + ",".join(RUNS_2), "equiv=1",
              "modes=" + ",".join(MODE_RUNS), "fixed=" + ",".join(FIXED_RUNS),
              "grouped=" + ",".join(GROUPED_RUNS)],
    "errors": ["errors"], "outer": ["outer"], "exact": ["exact"],
    "save_outer": ["save", f"ckpt={CKPT}", "outer=nesterov"]}, timeout=1200)
LOAD = SharedJob("tf_sbc.py", 2, {"load": ["load", f"ckpt={CKPT}"],
                                  "load_outer": ["load", f"ckpt={CKPT}", "outer=nesterov"]},
                 after=[TWO], timeout=400)


def test_two_ranks_identical_variables_exact_accounting_and_dense_equivalence():
    steps = STEPS_2
    results = TWO["train"]
    runs = {spec: check_run(results, spec, steps) for spec in RUNS_2}
    assert {r["backend"] for rs in runs.values() for r in rs} == {"tf-kernel-ops"}
    # eager and tf.function compute the same thing, bit for bit
    for api in ("stock", "dropin"):
        assert runs[f"{api}-eager-1"][0]["digests"] == runs[f"{api}-fn-1"][0]["digests"]
        assert runs[f"{api}-eager-1"][0]["stats"] == runs[f"{api}-fn-1"][0]["stats"]
    # density 1 without binarization is exactly Horovod's dense averaging
    for r in results:
        assert r["equiv"]["max_abs_diff"] <= 1e-6
    assert results[0]["equiv"]["digest"] == results[1]["equiv"]["digest"]


@pytest.mark.parametrize("spec", FIXED_RUNS)
def test_fixed_size_steps_are_padded_and_train_bit_identically(spec):
    """fixed_size=True: every rank's step message of a layout has the one capacity
    (reference.step_capacity), the padding is counted, and the weights are bit for bit those
    of the same run with variable-size messages."""
    results = TWO["train"]
    runs = check_run(results, "fixed:" + spec, STEPS_2)
    for r, res in zip(runs, results):
        st, var = r["stats"], res[spec]["stats"]
        assert r["digests"] == res[spec]["digests"], spec
        assert st["padding_bits"] > 0 and var["padding_bits"] == 0, spec
        dummy = 16 * N_TENSORS[spec.split("-")[0]] * STEPS_2 if spec.startswith("stock") else 0
        # the same content, plus the padding
        assert st["upstream_bits"] == var["upstream_bits"] + st["padding_bits"], spec
        assert st["upstream_bits"] - dummy == 8 * r["gathered"]["sent"], spec
        assert st["positions_sent"] == var["positions_sent"], spec
        if spec.startswith("dropin"):  # one step message of one capacity per sync
            cap = reference.step_capacity([20 * 32, 32, 32 * 5, 5, 32 * 5, 5], 0.05, "sbc")
            assert r["gathered"]["sent"] == st["syncs"] * cap, spec


@pytest.mark.parametrize("spec", GROUPED_RUNS)
def test_grouped_stock_tape_exchanges_once_per_group_bit_identically(spec):
    """With Horovod's grouped allreduce (groups=1) the stock hook encodes every gradient of the
    group into one step message: one exchange (one host parse) per step instead of one per
    gradient, and the weights bit for bit those of the ungrouped run."""
    results = TWO["train"]
    runs = check_run(results, "grouped:" + spec, STEPS_2)
    for r, res in zip(runs, results):
        per_tensor = res[spec]
        assert per_tensor["host_parses"] == N_TENSORS["stock"] * STEPS_2, spec
        assert r["host_parses"] == STEPS_2, spec
        assert r["digests"] == per_tensor["digests"], spec
        st, var = r["stats"], per_tensor["stats"]
        assert st["positions_sent"] == var["positions_sent"] > 0, spec
        # one 24-byte step header per step instead of one per gradient
        saved = 8 * 24 * (N_TENSORS["stock"] - 1) * STEPS_2
        assert st["upstream_bits"] == var["upstream_bits"] - saved, spec


@pytest.mark.parametrize("spec", MODE_RUNS)
def test_every_compressor_keeps_ranks_identical_with_exact_accounting(spec):
    """signSGD, TernGrad, top-k and STC through the
    drop-in tape: identical variables after every sync, the bits on the wire counted."""
    mode, how = spec.split("-")
    runs = check_run(TWO["train"], f"{mode}:dropin-{how}-1", 4)
    for r in runs:
        assert r["stats"]["positions_sent"] > 0, spec


def test_three_ranks_and_pytorch_decodes_tensorflow_messages():
    """3 ranks with the C kernels off: TensorFlow's TF-op backend (what GPU tensors take) and
    torch's tensor-op backend, end to end."""
    # eager == tf.function is the 2-rank test's; one of the two traced (a trace of the TF-op
    # codec on 3 ranks sharing 2 cores is most of this job's time)
    steps, runs = 4, ["stock-eager-1", "dropin-fn-2"]
    results, _ = run_ranks("tf_sbc.py", 3, ["train", f"steps={steps}", "runs=" + ",".join(runs),
                                            "interop=1"], timeout=600,
                           env={"HOROVOD_SBC_KERNELS": "0"})
    for spec in runs:
        check_run(results, spec, steps)
        assert {r[spec]["backend"] for r in results} == {"tf-ops"}, spec
    for r in results:  # a real sync: horovod_sbc.torch makes the same bytes from the same
        # update and decodes the gathered buffer into the same average
        assert r["interop"]["torch_encodes_identically"]
        assert r["interop"]["torch_decodes_identically"] and r["interop"]["nonzero"] > 0


def test_checkpoint_mid_delay_window_resumes_bit_identically():
    saved = TWO["save"]
    assert sorted(os.listdir(os.path.join(CKPT, "plain"))) == ["rank0", "rank1"]
    names = saved[0]["saved"]
    assert any(n.startswith("sbc/residuals/") for n in names)
    assert any(n.startswith("sbc/reference/") for n in names)
    loaded = LOAD["load"]
    for r in range(2):
        # restored in a new process: same weights, stats and window position, and the next 10
        # steps (crossing 3 syncs) bit-identical to the uninterrupted run
        assert loaded[r]["at_checkpoint"] == saved[r]["at_checkpoint"]
        assert loaded[r]["digests"] == saved[r]["digests"]
        assert loaded[r]["stats"] == saved[r]["stats"]
        # without the SBC state (residuals, reference weights, window) it does not
        assert loaded[r]["without_sbc_state"][-1] != saved[r]["digests"][-1]
        assert "saved with world_size=2, rank=" in loaded[r]["other_rank"]
    assert saved[0]["at_checkpoint"]["stats"]["steps"] == 7
    assert saved[0]["at_checkpoint"]["local_steps"] == 1  # saved between syncs (delay 3)
    assert saved[0]["at_checkpoint"]["digest"] != saved[1]["at_checkpoint"]["digest"]


def test_checkpoint_with_the_outer_step_resumes_bit_identically():
    """SBC(outer=Nesterov(...)): the momentum buffers are in the checkpoint (``sbc/outer/
    buffers/<name>``) and a resumed run continues bit-identically."""
    saved, loaded = TWO["save_outer"], LOAD["load_outer"]
    assert any(n.startswith("sbc/outer/buffers/") for n in saved[0]["saved"])
    for r in range(2):
        assert loaded[r]["at_checkpoint"] == saved[r]["at_checkpoint"]
        assert loaded[r]["digests"] == saved[r]["digests"]
        assert loaded[r]["without_sbc_state"][-1] != saved[r]["digests"][-1]
    # the outer step changed the run: the plain run's checkpoint diverges from it
    assert saved[0]["digests"][-1] != TWO["save"][0]["digests"][-1]


def _flat(d):
    return {k: np.asarray(v, np.float64) for k, v in d.items()}


def test_outer_step_arithmetic_on_two_ranks():
    """Each sync's average U (here exact: dense values of every rank's window update) moves
    W_ref by U (Plain), by 2 U (Plain(2.0)), by lr * (U + m * v) with v <- m * v + U
    (Nesterov(1.0, 0.5)) or by lr * U (ErrorDecay(0.5, 0.8)); W_ref and the buffers are
    identical on both ranks, and the outer steps change training (negative control: their
    runs end elsewhere)."""
    out = TWO["outer"]
    for kind in ("plain", "plain2", "nesterov", "decay"):
        runs = [out[r][kind] for r in range(2)]
        assert len(runs[0]["syncs"]) == 3 and runs[0]["stats"]["syncs"] == 3
        v = None
        for i in range(3):
            recs = [runs[r]["syncs"][i] for r in range(2)]
            assert recs[0]["ref_before"] == recs[1]["ref_before"], (kind, i)
            assert recs[0]["ref_after"] == recs[1]["ref_after"], (kind, i)
            before, after = _flat(recs[0]["ref_before"]), _flat(recs[0]["ref_after"])
            ws = [_flat(rec["w"]) for rec in recs]
            for name in before:
                u = (ws[0][name] - before[name] + ws[1][name] - before[name]) / 2
                if kind == "plain":
                    want = before[name] + u
                elif kind == "plain2":
                    want = before[name] + 2.0 * u
                elif kind == "decay":
                    want = before[name] + 0.8 * u
                else:
                    vb = _flat(recs[0]["v_before"])[name] if recs[0]["v_before"] else 0.0
                    vn = 0.5 * vb + u
                    np.testing.assert_allclose(_flat(recs[0]["v_after"])[name], vn,
                                               rtol=1e-5, atol=1e-7, err_msg=f"v {name} {i}")
                    assert recs[0]["v_after"][name] == recs[1]["v_after"][name]
                    want = before[name] + 1.0 * (u + 0.5 * vn)
                np.testing.assert_allclose(after[name], want, rtol=1e-5, atol=1e-7,
                                           err_msg=f"{kind} {name} sync {i}")
                assert not np.any(_flat(recs[0]["res"])[name])  # all sent: no residual
    ends = {kind: out[0][kind]["syncs"][-1]["ref_after"] for kind in ("plain", "plain2",
                                                                        "nesterov", "decay")}
    assert ends["plain"] != ends["nesterov"] and ends["plain"] != ends["decay"]
    assert ends["plain"] != ends["plain2"]
    for r in range(2):
        assert "applies where weight changes are exchanged" in out[r]["stock_refused"]


def test_sgd_momentum_through_an_exact_exchange_is_dense_sgd_momentum():
    """A Keras SGD with momentum 0.9 (heavy ball, Nesterov; Keras' decoupled weight decay) in
    weight mode, through the drop-in tape and the stock tape given the optimizer, with an exact
    exchange: every step's weights equal a dense replica's (the same optimizer on Horovod's
    allreduce of the gradients) and both ranks hold them; the optimizer keeps its velocity and
    the residual is in the weights (the default); the stock tape does not warn. Negative
    control: a rank alone moves elsewhere."""
    out = TWO["exact"]
    for kind in ("heavy", "nesterov", "stock_heavy", "stock_nesterov"):
        runs = [out[r][kind] for r in range(2)]
        assert [r["local_residual"] for r in runs] == [True, True], kind
        for t in range(4):
            recs = [r["steps"][t] for r in runs]
            assert recs[0]["digest"] == recs[1]["digest"], (kind, t)
            for rec in recs:
                assert rec["from_dense"] < 1e-5, (kind, t, rec)
        assert max(rec["from_alone"] for rec in runs[0]["steps"]) > 1e-3, kind
        assert runs[0]["steps"][-1]["velocity"] > 0, kind
        assert all(r["warnings"] == [] for r in runs), kind


def test_errors_are_clear_and_raised_on_every_rank():
    results = TWO["errors"]
    nan = "SBC: rank 1 could not encode this sync: the update of 'fc"
    for r in results:
        assert "use horovod_sbc.tensorflow.DistributedGradientTape" in r["delay_stock"]
        assert "op=hvd.Adasum" in r["adasum"]
        assert r["groups"] is None  # Horovod's grouped allreduce: the data still goes by allgather
        # once each per SBC object, however many gradients and steps: the tape exchanges
        # gradients (name the drop-in); without groups one gradient at a time (name groups)
        warning, ungrouped = r["stock_warnings"]
        assert "exchanges sparse gradients" in warning and \
            "horovod_sbc.tensorflow.DistributedGradientTape" in warning and "sbc.step" in warning
        assert "one gradient at a time" in ungrouped and "num_groups=1" in ungrouped
        assert r["grouped_warnings"] == [warning]
        assert "density must be in (0, 1]" in r["density"]
        assert "compression must be horovod_sbc.tensorflow.SBC" in r["wrong_compression"]
        assert r["plain_tensor"].startswith("TypeError: SBC needs variables")
        assert "call sbc.step(variables) after applying the gradients" in r["forgot_step"]
        assert "cannot also be used through hvd.DistributedGradientTape" in r["mixed_modes"]
        # eager and Keras fit: a ValueError; inside tf.function TensorFlow wraps it
        assert r["nan_eager"].startswith("ValueError: " + nan)
        assert r["nan_keras"].startswith("ValueError: " + nan)
        for key in ("nan_fn", "nan_stock"):
            assert r[key].startswith("InvalidArgumentError") and ("ValueError: " + nan) in r[key]
        for key in ("nan_eager_stats", "nan_fn_stats"):
            assert r[key]["syncs"] == 0 and r[key]["steps"] == 1 and r[key]["upstream_bits"] > 0
        assert "horovod_sbc: skipping this sync: rank 1 could not encode" in r["skip_warning"]
        assert r["skip_back_to_reference"] and r["skip_residual_finite"] and r["skip_finite"]
        assert r["skip_stats"]["steps"] == 4 and r["skip_stats"]["syncs"] == 1
    assert results[0]["skip_after"] == results[1]["skip_after"]


def test_keras_fit_digits_within_one_point_of_dense():
    out = os.path.join(tempfile.mkdtemp(prefix="sbc-tf-digits-"), "res.json")
    run_ranks(str(ROOT / "examples" / "tensorflow2_keras_sbc.py"), 2,
              ["--methods", "dense,sbc", "--density", "0.01", "--delay", "4", "--json", out,
               "--no-progress"], timeout=300, raw=True)
    dense, sbc = json.load(open(out))["runs"]
    assert dense["method"] == "dense" and sbc["method"] == "sbc" and sbc["density"] == 0.01
    assert dense["final_accuracy"] > 0.95
    assert sbc["final_accuracy"] >= dense["final_accuracy"] - 0.01
    assert sbc["ranks_identical"] and dense["ranks_identical"]
    assert sbc["steps"] == dense["steps"] and sbc["syncs"] == sbc["steps"] // 4
    assert sbc["compression_ratio"] > 1000
