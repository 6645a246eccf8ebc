"""benchmarks/bench_scatter.py: the simulated reduce-scatter agrees with the allgather where it
must, and ``python -m benchmarks.bench scatter --quick`` runs and writes its report."""
import json
import os
import subprocess
import sys
import tempfile

import torch

from harness import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import bench_scatter as bs  # noqa: E402
from horovod_sbc.torch.sync import scatter  # noqa: E402


def test_alltoall_hands_each_owner_its_part_of_every_rank_in_rank_order():
    parts = [(torch.tensor([10 * r + o for o in range(3) for _ in range(o + 1)],
                           dtype=torch.uint8), [1, 2, 3]) for r in range(3)]
    got = bs.alltoall(parts)
    assert [g.tolist() for g in got] == [[0, 10, 20], [1, 1, 11, 11, 21, 21],
                                         [2, 2, 2, 12, 12, 12, 22, 22, 22]]


def test_one_rank_delivers_the_exact_average():
    # N = 1: the owner re-encodes one SBC message at its own density with a zero residual,
    # which selects the same positions and mean again: the plumbing must lose nothing
    layout = [("a", (6, 5)), ("b", (7,))]
    p = scatter.plan(tuple(layout), 1)
    states = bs.make_states(1, 0.3)
    g = [[torch.randn(30), torch.randn(7)]]
    out = bs.simulate_sync(states, p, layout, g)
    assert torch.equal(out["rs"], out["exact"])
    assert sum(out["piece_counts"]) > 0


def test_quick_run_writes_json_markdown_and_plot():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "scatter.json")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, "-m", "benchmarks.bench", "scatter", "--quick",
                               "--json", path], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        res = json.load(open(path))
        (err,) = res["error"]
        assert err["ranks"] == 4 and len(err["err_cum"]) == 3
        # per-piece selection: a region's positions follow its elements (the cuts also weigh
        # pieces), never the clustering per-tensor selection would give
        assert err["skew_piece_mean"] < min(1.5, err["skew_tensor_mean"])
        # the downlink error feedback loses nothing: sum avg_rs = sum avg_exact - R_down
        assert err["downlink_identity_gap_max"] < 1e-5
        assert [r["ranks"] for r in res["codec"]] == [4, 8]
        # the allgather's download grows as N - 1, the reduce-scatter's as (N - 1) / N: with
        # the default owners (STC at 4x the density) it is the smaller from 8 ranks on
        four, eight = res["codec"]
        assert eight["rs_down_bytes"] < eight["ag_down_bytes"]
        assert eight["rs_down_bytes"] / four["rs_down_bytes"] < 1.4 < \
            eight["ag_down_bytes"] / four["ag_down_bytes"]
        assert os.path.exists(os.path.join(d, "scatter.md"))
        assert os.path.exists(os.path.join(d, "scatter_error.png"))
