"""The one-line change with any optimizer (horovod_sbc.policy): stock ``hvd.DistributedOptimizer(
opt, named_parameters=..., compression=SBC(...))`` on 2 real ranks. With AdamW the hook makes
Horovod's optimizer run the drop-in's step: shared weights bit-identical on both ranks after every
step, the variance frozen where the policy says, the step hooks fired as with dense Horovod,
per-rank checkpoints resumed bit-exactly, rank 0's checkpoint resumed on both ranks. Adaptive
optimizers train within 2 points of dense and above no communication on digits, and the
gradient exchange the hook used before (the negative control) falls behind with RMSprop."""
import pytest

from harness import SharedJob

pytestmark = pytest.mark.multirank

TRAINED = ("adamw", "rmsprop", "radam", "adagrad")
JOB = SharedJob("torch_oneline.py", 2, {
    "adamw": ["adamw"], "rank0": ["adamw", "rank0=1"], "hooks": ["hooks"],
    **{f"train-{o}": ["train", f"opt={o}", "steps=300"] + (["control=1"] if o == "rmsprop"
                                                             else [])
       for o in TRAINED}}, timeout=900)


def test_adamw_through_the_stock_hook_runs_the_drop_in_step():
    for r in JOB["adamw"]:
        full = r["full"]
        assert full["mro"][:3] == ["AdamW@horovod.torch.optimizer",
                                   "AdamW@horovod_sbc.torch.optimizer",
                                   "AdamW@torch.optim.adamw"]
        assert full["has_finish"]
        # every step is a sync (delay 1) and its traffic is counted
        st = full["stats"]
        assert st["steps"] == 40 and st["syncs"] == 40 and 0 < st["positions_sent"]
        assert st["downstream_bits"] > 0 and st["upstream_bits"] < st["dense_bits"] / 3
        # warm-up of 5 steps (the last rising learning rate at step 4), beta2 = 0.8: frozen
        # 3 / (1 - 0.8) = 15 steps after it, every parameter
        assert full["frozen_at"] == 4 + 15 and full["frozen"] == 4


def test_shared_weights_identical_and_per_rank_resume_bit_exact():
    a, b = JOB["adamw"]
    assert a["full"]["shared"] == b["full"]["shared"]  # after every step
    assert len(set(a["full"]["shared"])) == 40          # and they move
    for r in (a, b):
        assert r["resumed"]["weights"] == r["full"]["weights"]
        assert r["resumed"]["shared"] == r["full"]["shared"][25:]
        assert r["resumed"]["frozen_at"] == r["full"]["frozen_at"]
        assert r["resumed"]["stats"] == r["full"]["stats"]  # the resumed step counted too
    assert a["full"]["weights"] != b["full"]["weights"]  # each rank's residual is its own


def test_rank0_checkpoint_resumes_every_rank_from_the_shared_weights():
    a, b = JOB["rank0"]
    assert a["resumed"]["shared"] == b["resumed"]["shared"]
    # the other rank's unsent update is the one thing not in rank 0's file
    assert a["resumed"]["shared"][-1] != a["full"]["shared"][-1]


def test_step_hooks_fire_as_with_dense_horovod():
    """Horovod's optimizer and the user's both fire torch's step hooks (pre, pre, post, post):
    the same with the hook's weight exchange as with Horovod's dense allreduce."""
    for r in JOB["hooks"]:
        assert r["sbc"] == r["dense"] == ["pre", "pre", "post", "post"] * 3


@pytest.mark.parametrize("opt", TRAINED)
def test_adaptive_optimizers_train_through_the_one_line_change(opt):
    a, b = JOB[f"train-{opt}"]
    assert a["sbc"]["weights"] == b["sbc"]["weights"]  # finish(): one model on every rank
    acc = {k: v["accuracy"] for k, v in a.items()}
    assert acc["sbc"] >= acc["dense"] - 0.02 and acc["sbc"] > acc["alone"], acc
    assert a["sbc"]["stats"]["upstream_bits"] < a["sbc"]["stats"]["dense_bits"] / 30
    # an optimizer whose second moment is not frozen applies the average times sqrt(2 ranks)
    frozen = opt in ("adamw", "rmsprop")
    assert a["sbc"]["outer_lr"] == pytest.approx(1.0 if frozen else 2 ** 0.5)


def test_the_gradient_exchange_is_the_negative_control():
    """RMSprop through the gradient exchange (the hook's behaviour before the policy): each
    coordinate's late burst is normalised away, and it ends well below the weight exchange."""
    acc = {k: v["accuracy"] for k, v in JOB["train-rmsprop"][0].items()}
    assert acc["gradients"] < acc["sbc"] - 0.04, acc
