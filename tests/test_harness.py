"""Foundation: the Horovod build, the multi-rank harness and the allgather transport."""
import subprocess
import time

import pytest

from harness import BIN, RankJobError, run_ranks

pytestmark = pytest.mark.multirank


def test_check_build_lists_frameworks_and_controllers():
    out = subprocess.run([str(BIN / "horovodrun"), "--check-build"], capture_output=True,
                         text=True, timeout=120).stdout
    for line in ("[X] TensorFlow", "[X] PyTorch", "[X] MPI", "[X] Gloo"):
        assert line in out, out


def _expected(r):
    return [((i % 251) + r) % 256 for i in range(10 + 7 * r)]


# "horovodrun-mpi": the launcher users type (the other MPI jobs start under mpirun directly)
@pytest.mark.parametrize("fw,np_,controller", [("torch", 2, "horovodrun-mpi"),
                                                ("torch", 3, "mpi"), ("torch", 2, "gloo"),
                                                ("tf", 2, "mpi"), ("tf", 3, "gloo")])
def test_variable_length_uint8_allgather(fw, np_, controller):
    results, _ = run_ranks("allgather_transport.py", np_, [fw], timeout=180,
                           controller=controller)
    want = sum((_expected(r) for r in range(np_)), [])
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == np_
        assert res["dtype"] == "uint8"
        assert res["bytes"] == want  # concatenation in rank order, lengths differ per rank
    assert len({res["sha"] for res in results}) == 1


def test_hung_worker_fails_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankJobError, match="did not finish within 20 s"):
        run_ranks("hang.py", 2, timeout=20)
    assert time.monotonic() - t0 < 40
