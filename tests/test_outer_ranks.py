"""The drop-in's outer step and checkpoints on real multi-rank Horovod jobs: the shared weights
and the outer state are identical on every rank, per-rank checkpoints resume bit-identically,
every rank resumes from rank 0's file alone, and the outer step changes the result (negative
control). Worker: tests/workers/torch_outer.py."""
import tempfile

import pytest

from harness import SharedJob

pytestmark = pytest.mark.multirank
FIRST, STEPS = 7, 20  # the checkpoint falls mid-delay (delay 3: syncs after steps 3, 6, 9, ...)
CKPT = tempfile.mkdtemp(prefix="sbc-outer-")
_RUN = [f"ckpt={CKPT}", f"first={FIRST}", f"steps={STEPS}"]
TRAIN = SharedJob("torch_outer.py", 2, {"train": ["train", "outers=plain,nesterov", *_RUN]},
                  timeout=300)
# the three ways of resuming, each from the checkpoint in a fresh process, in one job
RESUME = SharedJob("torch_outer.py", 2, {
    "self": ["resume", "outer=nesterov", "src=self", *_RUN],
    "rank0_file": ["resume", "outer=nesterov", "src=0", *_RUN],
    "rank0_loads": ["rank0_loads", "outer=nesterov", *_RUN]}, after=[TRAIN], timeout=400)


def _results(job, key):
    return [r["result"] for r in job[key]]


@pytest.fixture(scope="module")
def trained():
    return CKPT, _results(TRAIN, "train")


def test_shared_weights_and_outer_state_identical_on_every_rank(trained):
    _, (a, b) = trained
    for outer in ("plain", "nesterov"):
        assert len(a[outer]["shared"]) == (FIRST + STEPS) // 3
        assert a[outer]["shared"] == b[outer]["shared"], outer
        assert a[outer]["outer"] == b[outer]["outer"], outer
        assert len(set(a[outer]["shared"])) == len(a[outer]["shared"])  # they do move
        assert a[outer]["digests"][-1] != b[outer]["digests"][-1]  # residuals in the weights
    # the momentum buffers change at every sync (plain has none: the digest of nothing)
    assert len(set(a["nesterov"]["outer"])) == len(a["nesterov"]["outer"])
    assert len(set(a["plain"]["outer"])) == 1


def test_outer_step_changes_the_shared_weights(trained):
    """Negative control: plain and Nesterov agree before the first sync, differ after it."""
    _, (a, _) = trained
    assert a["plain"]["digests"][:2] == a["nesterov"]["digests"][:2]
    for s_plain, s_nest in zip(a["plain"]["shared"], a["nesterov"]["shared"]):
        assert s_plain != s_nest


def test_checkpoint_with_outer_state_resumes_bit_identically(trained):
    _, saved = trained
    for r, res in enumerate(_results(RESUME, "self")):
        ref = saved[r]["nesterov"]
        assert res["after_load"]["shared"] == ref["at_checkpoint"]["shared"]
        assert res["after_load"]["outer"] == ref["at_checkpoint"]["outer"]
        assert res["digests"] == ref["digests"][FIRST:]  # every step after the load
        assert res["shared"] == ref["shared"][FIRST // 3:]
        assert res["outer"] == ref["outer"][FIRST // 3:]
        assert res["losses"] == ref["losses"][FIRST:]


def test_every_rank_resumes_from_rank_0s_checkpoint(trained):
    """Horovod's habit: rank 0 saves, every rank loads that file. Rank 0 continues from its
    own state; rank 1 starts from the shared weights with no residual; the ranks agree on the shared
    weights and the outer state after the load and after every sync, and the loss keeps
    falling."""
    _, saved = trained
    a, b = _results(RESUME, "rank0_file")
    ref = saved[0]["nesterov"]
    # rank 0 loaded its own file: its local steps up to the next sync are exactly as before
    local = 3 - FIRST % 3 - 1
    assert a["digests"][:local] == ref["digests"][FIRST:FIRST + local]
    assert a["digests"][local] != ref["digests"][FIRST + local]  # rank 1's residual is gone
    for r in (a, b):
        assert r["after_load"]["shared"] == ref["at_checkpoint"]["shared"]
        assert r["after_load"]["outer"] == ref["at_checkpoint"]["outer"]
        assert r["after_load"]["local_steps"] == FIRST % 3  # the delay windows stay aligned
    assert b["after_load"]["on_shared_weights"] and not a["after_load"]["on_shared_weights"]
    assert a["shared"] == b["shared"] and a["outer"] == b["outer"]
    assert len(set(a["shared"])) == len(a["shared"]) == (FIRST + STEPS) // 3 - FIRST // 3
    for r in (a, b):
        first, last = sum(r["losses"][:5]) / 5, sum(r["losses"][-5:]) / 5
        assert last < 0.8 * first, r["losses"]


def test_rank_0_loads_and_broadcasts_the_outer_state(trained):
    """Horovod's other habit: rank 0 alone loads, broadcast_state makes the ranks equal, the
    Nesterov momentum included (the ranks would otherwise diverge at the next sync)."""
    _, saved = trained
    a, b = _results(RESUME, "rank0_loads")
    assert a["after_load"] == b["after_load"]
    assert a["after_load"]["outer"] == saved[0]["nesterov"]["at_checkpoint"]["outer"]
    assert a["shared"] == b["shared"] and a["outer"] == b["outer"]
