"""Server topology (downlink compression, Zou et al. arXiv 2209.15203) on real multi-rank jobs.
Most scenarios run in the shared jobs of tests/torch_jobs.py."""
import json
import os
import tempfile

import pytest

from harness import ROOT, run_ranks
from test_torch import TRAINABLE
from torch_jobs import JOBS, SERVER_CKPT, SERVER_STEPS, SERVER_TRAIN

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("np_,downlink,delay", SERVER_TRAIN)
def test_server_topology_identical_parameters_and_accounting(np_, downlink, delay):
    steps = SERVER_STEPS
    results = JOBS[(np_, "mpi")][("server", np_, downlink, delay)]
    for s in range(0, steps + 1, delay):
        assert len({r["digests"][s] for r in results}) == 1, f"ranks differ after step {s}"
    assert len(set(results[0]["digests"][::delay])) == steps // delay + 1
    root, others = results[0]["stats"], [r["stats"] for r in results[1:]]
    syncs = steps // delay
    assert root["syncs"] == syncs and all(o["syncs"] == syncs for o in others)
    # the root received exactly what the others sent, and sent each of them the same downlink
    assert root["server_in_bits"] == sum(o["upstream_bits"] for o in others)
    assert root["server_out_bits"] == sum(o["downstream_bits"] for o in others)
    assert len({o["downstream_bits"] for o in others}) == 1
    assert root["downstream_bits"] == 0
    assert all(o["server_in_bits"] == o["server_out_bits"] == 0 for o in others)
    per_sync = others[0]["downstream_bits"] / syncs
    if downlink == "none":  # dense downlink: 32 bits per element plus headers
        assert 32 * TRAINABLE <= per_sync < 32 * TRAINABLE + 2000
    else:  # top-k at 10 %: values + coded positions, far below dense
        assert 32 * 0.1 * TRAINABLE < per_sync < 0.5 * 32 * TRAINABLE


@pytest.mark.parametrize("local_residual", SERVER_CKPT)
def test_server_topology_checkpoint_resumes_bit_identically(local_residual):
    """local_residual=1: the residual lives in the weights, which move with the downlink."""
    saved = JOBS[(2, "mpi")][("save", "server", local_residual)]
    loaded = JOBS["load"][("server", local_residual)]
    for r in range(2):
        assert loaded[r]["digests"] == saved[r]["digests"]
    if local_residual:  # the ranks' weights differ by their residuals
        assert saved[0]["digests"] != saved[1]["digests"]


def test_server_topology_needs_mpi_and_says_so():
    _, out = run_ranks("torch_sbc.py", 2, ["train", "topology=server", "steps=2"], timeout=120,
                       controller="gloo", expect_fail=True)
    assert "topology='server') needs Horovod's MPI controller" in out


@pytest.mark.slow
def test_server_topology_accuracy_within_one_point_of_allgather():
    acc = {}
    for topo in ("allgather", "server"):
        out = os.path.join(tempfile.mkdtemp(prefix="sbc-digits-"), "res.json")
        extra = ["--downlink-density", "0.02"] if topo == "server" else []
        run_ranks(str(ROOT / "examples" / "pytorch_sbc_digits.py"), 2,
                  ["--methods", "sbc", "--density", "0.01", "--delay", "4", "--topology", topo,
                   "--json", out, "--no-progress", *extra], timeout=300, raw=True)
        (run,) = json.load(open(out))["runs"]
        assert run["ranks_identical"] and run["topology"] == topo
        acc[topo] = run["final_accuracy"]
    assert acc["server"] >= acc["allgather"] - 0.01, acc
