"""The hierarchical exchange, ``SBC(hierarchy=...)`` (horovod_sbc/torch/hierarchy.py).

The grouping checks and the shard layout without a job; then ONE 4-rank Horovod job
(tests/workers/torch_hier.py, 4 ranks as 2 "nodes" of 2) whose results every multi-rank test
below reads: identical shared weights, where the residuals live, the bits in ``stats()``,
checkpoint resume, errors on every rank, and mnist1d accuracy against flat SBC.
"""
import math
import os
import tempfile

import numpy as np
import pytest
import torch

from harness import run_ranks
from horovod_sbc.reference import keep_count
from horovod_sbc.torch import SBC, hierarchy

GROUPS = ((0, 1), (2, 3))
DELAY, FIRST, MORE = 2, 5, 6  # as in the worker
TEACHER = [("0.bias", 32), ("0.weight", 384), ("2.bias", 4), ("2.weight", 128)]  # sorted


# -- without a job ---------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ("nodes", "give None, 'node' or a list of groups"),
    ([[0, 1], 2], "every group must be a list of ranks, got 2"),
    ([[0, -1]], "ranks must be integers >= 0"),
    ([[0, 1], [1, 2]], "rank 1 is in more than one group"),
])
def test_parse_refuses_malformed_groupings(spec, message):
    with pytest.raises(ValueError, match="SBC\\(hierarchy=.*" + message):
        SBC(hierarchy=spec)


@pytest.mark.parametrize("groups, message", [
    (((0, 1), (2,)), r"rank\(s\) \[3\] of this job of 4 ranks are in no group"),
    (((0, 1), (2, 3, 4)), r"rank\(s\) \[4\] do not exist in this job of 4 ranks"),
    (((0, 1, 2), (3,)), r"got node sizes \[3, 1\]"),
    (((0, 1, 2, 3),), "at least 2 nodes of at least 2 ranks, got 1 node"),
    (((0,), (1,), (2,), (3,)), "at least 2 nodes of at least 2 ranks, got 4 node"),
])
def test_check_refuses_groupings_that_do_not_fit_the_job(groups, message):
    with pytest.raises(ValueError, match=message):
        hierarchy.check(groups, 4, "SBC(hierarchy=...)")
    assert hierarchy.check(GROUPS, 4, "x") == GROUPS


def test_parse_sorts_and_sets_name_every_collective_group():
    assert hierarchy.parse([[3, 2], [1, 0]]) == GROUPS
    assert hierarchy.set_lists(((0, 3), (1, 2))) == [(0, 3), (1, 2), (0, 1), (2, 3)]


def test_layout_splits_the_flat_update_in_equal_shards():
    named = [(n, torch.zeros(k)) for n, k in TEACHER]
    a, b = (hierarchy.layout(named, 2, i) for i in (0, 1))
    assert a.shard == b.shard == 274 and a.offsets == [0, 32, 416, 420]
    assert [hierarchy.piece_name(a, p) for p in a.pieces] == ["0.bias[0:32]", "0.weight[0:242]"]
    assert [hierarchy.piece_name(b, p) for p in b.pieces] == \
        ["0.weight[242:384]", "2.bias[0:4]", "2.weight[0:128]"]
    odd = hierarchy.layout([("w", torch.zeros(5))], 2, 1)
    assert odd.shard == 3 and odd.pieces == [(0, 3, 5)]  # the padding is in no piece


def test_stock_hook_gradient_exchange_and_ddp_refuse_a_hierarchy():
    w = torch.nn.Parameter(torch.zeros(4))
    w.grad = torch.ones(4)
    comp = SBC(hierarchy=[[0, 1], [2, 3]], named_parameters=[("w", w)])
    with pytest.raises(ValueError, match="needs the per-sync exchange of weight changes"):
        comp.compress(w.grad)  # no optimizer found: gradients
    from horovod_sbc.torch import ddp
    with pytest.raises(ValueError, match="needs the drop-in"):
        ddp._make_compression(comp, None, "sbc_hook")


# -- one 4-rank job ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job():
    from benchmarks.tasks import mnist1d_arrays
    pytest.importorskip("mnist1d")
    tmp = tempfile.mkdtemp(prefix="sbc-hier-")
    data = os.path.join(tempfile.gettempdir(), "horovod_sbc-mnist1d-6000-seed0.npz")
    if not os.path.exists(data):  # generated once (about 12 s), read by every rank
        xtr, ytr, xte, yte = mnist1d_arrays(6000, 2 / 3, 0)
        np.savez(f"{tmp}/mnist1d.npz", x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
        os.replace(f"{tmp}/mnist1d.npz", data)
    results, _ = run_ranks("torch_hier.py", 4, [f"ckpt={tmp}", f"data={data}", "steps=400"],
                           timeout=600)
    return results


def _pieces(index):
    named = [(n, torch.zeros(k)) for n, k in TEACHER]
    lay = hierarchy.layout(named, 2, index)
    return [hierarchy.piece_name(lay, p) for p in lay.pieces]


@pytest.mark.multirank
def test_job_runs_this_checkout(job):
    import horovod_sbc
    assert all(r["path"].startswith(str(__import__("pathlib").Path(horovod_sbc.__file__)
                                         .parent)) for r in job)


@pytest.mark.multirank
def test_bad_groupings_raise_the_same_error_on_every_rank(job):
    errors = [r["errors"] for r in job]
    for key in ("missing", "uneven", "twice", "node", "server", "undeclared"):
        assert len({e[key] for e in errors}) == 1 and errors[0][key], key
    assert "rank(s) [3] of this job of 4 ranks are in no group" in errors[0]["missing"]
    assert "got node sizes [3, 1]" in errors[0]["uneven"]
    assert "rank 1 is in more than one group" in errors[0]["twice"]
    assert "SBC(hierarchy='node'): a hierarchy needs at least 2 nodes" in errors[0]["node"]
    assert "topology='server'" in errors[0]["server"]
    assert "no process set of ranks [0, 3]" in errors[0]["undeclared"]
    assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in errors[0]["undeclared"]
    # ranks 2 and 3 were given another grouping: every rank names them
    for e in errors:
        assert "rank(s) [2, 3] were given another grouping than rank 0" in e["disagree"]
    for r, e in enumerate(errors):
        assert e["fp16"].startswith(f"SBC(hierarchy=...) on rank {r}: parameter 'param.0.0' "
                                    "is torch.float16")


@pytest.mark.multirank
@pytest.mark.parametrize("config", ["res_in_weights", "res_stored"])
def test_shared_weights_identical_on_every_rank_after_every_sync(job, config):
    runs = [r[config] for r in job]
    shared = runs[0]["shared"]
    assert len(shared) == (FIRST + MORE) // DELAY and len(set(shared)) == len(shared)
    assert all(r["shared"] == shared for r in runs)
    syncs = [DELAY * (i + 1) - 1 for i in range(len(shared))]  # step index of each sync
    if config == "res_stored":  # every rank continues from the shared weights
        assert all(all(r["on_shared"]) for r in runs)
        assert all(len({r["weights"][s] for r in runs}) == 1 for s in syncs)
    else:  # from W_ref + its node's residual: equal inside a node, not across nodes
        assert not any(any(r["on_shared"]) for r in runs)
        for s in syncs:
            assert runs[0]["weights"][s] == runs[1]["weights"][s]
            assert runs[2]["weights"][s] == runs[3]["weights"][s]
            assert runs[0]["weights"][s] != runs[2]["weights"][s]
        # between syncs every rank's own local steps
        assert len({r["weights"][0] for r in runs}) == 4


@pytest.mark.multirank
def test_the_one_line_change_runs_the_hierarchy_as_the_drop_in_does(job):
    """Stock hvd.DistributedOptimizer with SBC(delay=2, hierarchy=...) and SGD exchanges weight
    changes through the hierarchy: every step's weights and the counts equal the drop-in's,
    the bits up plus Horovod's allreduce of a float16 placeholder per gradient and step."""
    for r in job:
        assert r["stock"]["weights"] == r["res_in_weights"]["weights"][:FIRST + MORE], r["rank"]
        stock, dropin = dict(r["stock"]["stats"]), dict(r["res_in_weights"]["stats"])
        dummies = 16 * len(TEACHER) * (FIRST + MORE)
        assert stock.pop("upstream_bits") == dropin.pop("upstream_bits") + dummies
        assert stock == dropin, r["rank"]


@pytest.mark.multirank
def test_residuals_live_only_where_the_compression_happens(job):
    for r, res in enumerate(job):
        own = _pieces(r % 2)  # local rank i compresses shard i
        stored = res["res_stored"]["residuals"]
        assert sorted(stored) == sorted(own)
        assert all(v > 0 for v in stored.values())
        # residual in the weights: the pieces are moved into the weights after every sync
        assert sorted(res["res_in_weights"]["residuals"]) == sorted(own)
        assert all(v == 0 for v in res["res_in_weights"]["residuals"].values())


@pytest.mark.multirank
@pytest.mark.parametrize("config", ["res_in_weights", "res_stored"])
def test_stats_count_the_bits_of_the_hierarchy(job, config):
    syncs = (FIRST + MORE) // DELAY
    stats = [r[config]["stats"] for r in job]
    flat = [r["flat"]["stats"] for r in job]
    numel = sum(k for _, k in TEACHER)
    shard = math.ceil(numel / 2)
    payload = shard * (2 if config == "res_in_weights" else 1) + 1
    for r, s in enumerate(stats):
        assert s["syncs"] == syncs and s["steps"] == FIRST + MORE
        # status flag + dense reduce-scatter of a shard + the shared payload, to 1 other rank
        assert s["intra_node_bits"] == syncs * (32 + 32 * (shard + payload))
        pieces = _pieces(r % 2)
        sizes = [int(p.split("[")[1].split(":")[1][:-1]) - int(p.split("[")[1].split(":")[0])
                 for p in pieces]
        assert s["positions_sent"] <= syncs * sum(keep_count(n, 0.05) for n in sizes)
        assert s["positions_sent"] >= 0.8 * syncs * sum(keep_count(n, 0.05) for n in sizes)
        # one message per node and shard: the other node's, the same size as this one's
        assert s["downstream_bits"] == stats[(r + 2) % 4]["upstream_bits"]
        assert flat[r]["intra_node_bits"] == 0
    for node in ((0, 1), (2, 3)):  # the node's shards cover every element once per sync
        assert sum(stats[r]["elements_synced"] for r in node) == syncs * numel
    for node in ((0, 1), (2, 3)):  # a node sends about half of what its 2 flat ranks sent
        hier = sum(stats[r]["upstream_bits"] for r in node)
        assert hier < 0.75 * sum(flat[r]["upstream_bits"] for r in node)
        assert sum(stats[r]["positions_sent"] for r in node) <= \
            0.55 * sum(flat[r]["positions_sent"] for r in node)
    # every rank decodes 1 message of the other node instead of 3 of the other ranks
    assert all(s["downstream_bits"] < 0.5 * f["downstream_bits"] for s, f in zip(stats, flat))


@pytest.mark.multirank
@pytest.mark.parametrize("config", ["res_in_weights", "res_stored"])
def test_checkpoint_resume_per_rank_files_is_bit_identical(job, config):
    for res in job:
        run, again = res[config], res[config]["resumed"]["self"]
        assert again["after_load"]["local_steps"] == FIRST % DELAY
        assert again["weights"] == run["weights"][FIRST:]
        assert again["shared"] == run["shared"][FIRST // DELAY:]
        assert again["losses"] == run["losses"][FIRST:]


@pytest.mark.multirank
@pytest.mark.parametrize("config", ["res_in_weights", "res_stored"])
def test_every_rank_resumes_from_rank_0s_file(job, config):
    runs = [r[config]["resumed"]["0"] for r in job]
    saved = job[0][config]
    assert all(r["after_load"]["shared"] == runs[0]["after_load"]["shared"] for r in runs)
    assert all(r["shared"] == runs[0]["shared"] for r in runs)  # identical after every sync
    assert len(set(runs[0]["shared"])) == len(runs[0]["shared"]) == MORE // DELAY
    assert all(r["after_load"]["local_steps"] == FIRST % DELAY for r in runs)
    for r in runs:
        assert sum(r["losses"][-2:]) < sum(saved["losses"][:2])


@pytest.mark.multirank
def test_a_nan_raises_or_skips_on_every_rank(job):
    for r in job:
        nf = r["nonfinite"]
        assert nf["raise"]["error"].startswith(
            "SBC: rank 3 could not encode this sync: the update of '2.bias' contains NaN or "
            "Inf; SBC's nonfinite policy is 'raise'"), nf["raise"]["error"]
        assert "SBC(..., nonfinite='skip')" in nf["raise"]["error"]
        assert nf["raise"]["unchanged"] and nf["skip"]["unchanged"]
        assert nf["skip"]["error"] is None and nf["skip"]["finite"] and nf["skip"]["synced_again"]
        assert any("rank 1 could not encode this sync: the update of '2.bias'" in w
                   for w in nf["skip"]["warnings"])
    assert len({r["nonfinite"]["skip"]["synced_again"] for r in job}) == 1


@pytest.mark.multirank
def test_mnist1d_accuracy_within_one_point_of_flat_sbc(job):
    accs = {k: [r["mnist1d"][k]["accuracy"] for r in job] for k in ("flat", "hier")}
    assert len(set(accs["flat"])) == 1 and len(set(accs["hier"])) == 1  # the shared weights
    flat, hier = accs["flat"][0], accs["hier"][0]
    assert flat > 0.6, flat  # it learned (a rank alone ends near 0.7)
    assert hier >= flat - 0.01, (hier, flat)
    up_flat = sum(r["mnist1d"]["flat"]["stats"]["upstream_bits"] for r in job)
    up_hier = sum(r["mnist1d"]["hier"]["stats"]["upstream_bits"] for r in job)
    assert up_hier < 0.7 * up_flat


@pytest.mark.multirank
def test_finish_averages_the_nodes_residual_pieces_into_every_rank(job):
    """``finish(average_residuals=True)`` with the residual beside the shared weights: every
    rank ends on the same weights, W_ref + the average of the ranks' pieces times the node size
    (computed in the worker from the pieces), the pieces cleared."""
    runs = [r["res_stored"]["finish"] for r in job]
    assert len({f["digest"] for f in runs}) == 1
    assert all(f["max_diff"] < 1e-6 for f in runs), [f["max_diff"] for f in runs]
    assert all(f["moved"] > 1e-4 for f in runs), runs  # the residuals were not zero
    assert all(f["pieces_zero"] and f["on_shared"] for f in runs), runs
