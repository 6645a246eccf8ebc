"""A job that mixes frameworks: TensorFlow on even ranks, PyTorch on odd ranks, one horovodrun.
The wire format and the protocol layer are shared, so both kinds of rank decode the same bits
and reach the same verdicts."""
import pytest

from harness import run_ranks

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("np_", [2, 3])
def test_tensorflow_and_torch_ranks_sync_and_agree(np_):
    results, _ = run_ranks("mixed_sbc.py", np_, [], timeout=240)
    frameworks = [r["framework"] for r in results]
    assert frameworks == ["tf", "torch", "tf"][:np_]
    for s in range(3):  # identical averaged updates, whatever framework decoded them
        assert len({r["digests"][s] for r in results}) == 1, f"sync {s}: ranks differ"
    assert len({r["digests"][0] for r in results} | {r["digests"][1] for r in results}) == 2
    for r in results:  # a NaN on the torch rank 1: every rank fails, naming it and the tensor
        assert r["nan"] is not None and "rank 1 could not encode" in r["nan"], r
        assert "'b'" in r["nan"] and "NaN or Inf" in r["nan"]
        assert r["skip"] is True  # nonfinite="skip": every rank skips the sync


@pytest.mark.parametrize("topology", ["reduce_scatter"])
def test_tensorflow_and_torch_ranks_keep_identical_shared_weights_through_a_topology(topology):
    """The regions' alltoall and allgather (named as torch names them), their re-framing and
    the owners' messages are the same bytes in both frameworks: a job of TF and torch ranks
    keeps bit-identical shared weights. (``topology=server`` works the same way: the worker
    takes it; it is left out of the suite for time, the TF and torch server tests cover each
    side.)"""
    args = [f"topology={topology}"] + (["downlink_density=0.05"] if topology == "server" else [])
    results, _ = run_ranks("mixed_sbc.py", 3, args, timeout=240)
    assert [r["framework"] for r in results] == ["tf", "torch", "tf"]
    for s in range(3):
        assert len({r["digests"][s] for r in results}) == 1, f"sync {s}: ranks differ"
    assert len(set(results[0]["digests"])) == 3  # every sync moves them
    for r in results:  # a NaN on the torch rank 1: every rank fails, naming it and the tensor
        assert "rank 1 could not encode" in r["nan"] and "'b'" in r["nan"], r
    if topology == "reduce_scatter":  # every rank owns a region and its downlink residual
        assert all(r["downlink"] for r in results)
    else:  # the server (rank 0, TensorFlow) holds the downlink residuals
        assert [r["downlink"] for r in results] == [["a", "b"], [], []]
