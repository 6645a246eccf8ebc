"""Reliability on real multi-rank jobs: odd tensors, rank disagreement, rank failure, resume.
The scenarios run in the shared jobs of tests/torch_jobs.py."""
import pytest

from torch_jobs import JOBS

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("local_residual", [0, 1])
def test_odd_parameters_train_and_stay_identical(local_residual):
    """0-d, empty, 1-element, fp16/bf16/fp64, sparse-gradient embedding, frozen, integer buffer.
    local_residual=1: float32/float64 weights hold their residual, fp16/bf16 ones keep a
    float32 residual beside them; the shared weights are identical after every sync."""
    results = JOBS[(2, "mpi")][("odd", local_residual)]
    a, b = results
    for s in (1, 3, 5):  # delay 2: after every sync
        assert a["shared_digests"][s] == b["shared_digests"][s]
        if not local_residual:
            assert a["digests"][s] == b["digests"][s]
    if local_residual:  # the ranks' weights differ by their residuals
        assert a["digests"][5] != b["digests"][5]
    assert a["dtypes"]["p16"] == "torch.float16" and a["dtypes"]["pbf"] == "torch.bfloat16"
    assert a["dtypes"]["p64"] == "torch.float64"
    assert a["finite"] and b["finite"]
    moved = a["moved"]
    assert moved == {"scalar": True, "empty": False, "one": True, "p16": True, "pbf": True,
                     "p64": True, "emb.weight": True, "frozen": False, "steps": False}
    assert "frozen" not in a["layout"] and "steps" not in a["layout"]
    assert a["stats"]["syncs"] == 3


@pytest.mark.parametrize("kind", ["shape", "set"])
def test_rank_disagreement_fails_on_every_rank_without_hanging(kind):
    results = JOBS[(2, "mpi")][("mismatch", kind)]
    for r, res in enumerate(results):
        assert res["error"].startswith(f"ValueError: rank {1 - r} sent a different tensor layout")


def test_different_parameter_order_across_ranks_is_handled():
    results = JOBS[(2, "mpi")][("mismatch", "order")]
    a, b = results
    assert a["error"] is None and b["error"] is None
    assert a["values"] == b["values"]
    # grads 1 and 2, lr 0.1, density 0.5 -> the first 3 of 6 entries move by the mean -0.15
    assert a["values"]["a"] == pytest.approx([0.85] * 3 + [1.0] * 3)


def test_checkpoint_from_another_world_size_is_refused():
    JOBS[(2, "mpi")][("save", "world")]  # saved after step 4 by a job of 2 ranks
    results = JOBS["load3"][("world_size", 0)]
    for res in results:
        assert "saved with world_size=2 but this run uses world_size=3" in res["error"]
    # another rank's file of a job of this size is taken (its shared part; see
    # tests/test_outer_ranks.py): Horovod's save-on-rank-0 habit
    results = JOBS["load"][("world_size", 1)]
    assert results[0]["error"] is None and results[1]["error"] is None
    # another density is allowed: the residuals are still the update mass not sent yet
    results = JOBS["load"][("redensity",)]
    a, b = results
    assert a["error"] is None and b["error"] is None and a["finite"] and b["finite"]
    assert a["stats"]["steps"] == 4 + 6 and a["stats"]["syncs"] == 1 + 2  # continued counters
    # saved after step 4 of a delay-3 window (1 local step pending): syncs after steps 6 and 9
    assert a["digests"][1] == b["digests"][1] and a["digests"][4] == b["digests"][4]
