"""Foundation: the Horovod build, the multi-rank harness and the allgather transport."""
import subprocess
import time

import pytest

from harness import BIN, WORKERS, RankJobError, run_ranks

pytestmark = pytest.mark.multirank


def test_horovod_is_built_with_both_frameworks_and_controllers():
    """What ``horovodrun --check-build`` reports ([X] TensorFlow, PyTorch, MPI, Gloo), read from
    Horovod's own API in one process (the command imports each framework in a process of its
    own, about a minute of CPU here); the launcher itself runs in the allgather test below
    and in every Gloo job."""
    code = ("import horovod.torch as ht, horovod.tensorflow as htf; "
            "print(ht.mpi_built(), ht.gloo_built(), htf.mpi_built(), htf.gloo_built())")
    res = subprocess.run([str(BIN / "python"), "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["True"] * 4, res.stdout


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


@pytest.mark.waits
def test_hung_worker_fails_within_timeout():
    """A hung job fails within its timeout, and its error shows where it hung: the stack of
    each rank (rank 1 asleep in hang.py, rank 0 waiting in Horovod's allreduce) and the
    processes that were alive."""
    t0 = time.monotonic()
    with pytest.raises(RankJobError, match="did not finish within 20 s") as e:
        run_ranks("hang.py", 2, timeout=20)
    assert time.monotonic() - t0 < 40
    out = e.value.output
    assert "processes alive at the timeout" in out and "hang.py" in out.split("alive")[-1], out
    assert 'File "' + str(WORKERS / "hang.py") + '", line 10' in out, out  # time.sleep
    assert "synchronize" in out, out  # rank 0 inside hvd.allreduce


@pytest.mark.waits
def test_hung_torchrun_job_shows_its_stacks_and_leaves_no_process():
    """torchrun starts its workers in sessions of their own: a hung job's workers are still
    found, print their stacks, and none outlives the job (one once did, for 44 minutes)."""
    worker = str(WORKERS / "hang_ddp.py")
    with pytest.raises(RankJobError, match="did not finish within 15 s") as e:
        run_ranks(worker, 2, timeout=15, controller="torchrun", raw=True)
    out = e.value.output
    assert f'File "{worker}", line 8' in out, out  # rank 1 in time.sleep
    assert f'File "{worker}", line 9' in out, out  # rank 0 in the barrier
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", worker], capture_output=True, text=True).stdout
    assert not left.strip(), left
