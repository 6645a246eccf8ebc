"""TensorFlow's hierarchical exchange, ``SBC(hierarchy=...)`` in weight mode
(horovod_sbc/tensorflow/hierarchy.py): the grouping and shard layout without a job (one module,
horovod_sbc/hierarchy.py, for TensorFlow and torch), then ONE 4-rank Horovod job
(tests/workers/tf_hier.py, 2 "nodes" of 2 ranks; across the nodes an allgather, or with
``topology="reduce_scatter"`` torch's sparse reduce-scatter) whose results every multi-rank
test reads; a mixed job (TF and torch ranks, one hierarchy) is marked slow."""
import math

import pytest

from harness import run_ranks
from horovod_sbc.reference import keep_count

GROUPS = ((0, 1), (2, 3))
DELAY, FIRST, MORE = 2, 3, 4  # as in the worker
MODEL = [("fc1/bias", 16), ("fc1/kernel", 192), ("fc2/bias", 4), ("fc2/kernel", 64)]  # sorted


# -- without a job ---------------------------------------------------------------------------
def test_both_frameworks_use_the_one_framework_free_module():
    """Grouping, process sets, layout and piece names live once, in horovod_sbc.hierarchy (no
    framework import): TensorFlow's and torch's exchanges take them from there."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None; sys.modules['tensorflow'] = None\n"
            "import horovod_sbc.hierarchy\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "ok", r.stderr
    from horovod_sbc import hierarchy as common
    from horovod_sbc.tensorflow import hierarchy as tfh
    for fn in ("check", "set_lists", "layout", "piece_name", "Layout", "parse", "describe"):
        assert getattr(tfh, fn) is getattr(common, fn), fn
    import horovod_sbc.tensorflow as hsbc
    assert hsbc.hierarchy_process_sets is tfh.hierarchy_process_sets
    torch = pytest.importorskip("torch")
    from horovod_sbc.torch import hierarchy as th
    for fn in ("check", "set_lists", "piece_name", "Layout"):
        assert getattr(th, fn) is getattr(common, fn), fn
    names, numels = [n for n, _ in MODEL], [k for _, k in MODEL]
    for i in (0, 1):  # torch's layout of parameters is the layout of their element counts
        assert th.layout([(n, torch.zeros(k)) for n, k in MODEL], 2, i) == \
            common.layout(names, numels, 2, i)


def test_layout_pieces_and_checks():
    from horovod_sbc import hierarchy as common
    a, b = (common.layout([n for n, _ in MODEL], [k for _, k in MODEL], 2, i) for i in (0, 1))
    assert a.shard == b.shard == 138 and a.offsets == [0, 16, 208, 212]
    assert [common.piece_name(a, p) for p in a.pieces] == ["fc1/bias[0:16]", "fc1/kernel[0:122]"]
    assert [common.piece_name(b, p) for p in b.pieces] == \
        ["fc1/kernel[122:192]", "fc2/bias[0:4]", "fc2/kernel[0:64]"]
    assert common.set_lists(((0, 3), (1, 2))) == [(0, 3), (1, 2), (0, 1), (2, 3)]
    assert common.position(((0, 3), (1, 2)), 2) == (1, 1, (2, 3))
    assert common.node_of_rank(((0, 3), (1, 2)), 4) == [0, 1, 1, 0]
    assert common.nodes_of_rows([[0, 0, 2], [1, 0, 2], [0, 1, 2], [1, 1, 2]]) == ((0, 2), (1, 3))
    for groups, message in ((((0, 1), (2,)), "rank(s) [3] of this job of 4 ranks are in no group"),
                            (((0, 1, 2), (3,)), "got node sizes [3, 1]"),
                            (((0, 1, 2, 3),), "at least 2 nodes of at least 2 ranks, got 1")):
        with pytest.raises(ValueError) as e:
            common.check(groups, 4, "SBC(hierarchy=...)")
        assert str(e.value).startswith("SBC(hierarchy=...): ") and message in str(e.value)
    assert common.checksum(((0, 1), (2, 3))) == __import__("zlib").crc32(b"((0, 1), (2, 3))")
    with pytest.raises(ValueError, match=r"rank\(s\) \[2\] were given another grouping than "
                       "rank 0; build the SBC object with"):
        common.check_agreement([[5], [5], [6], [5]], "x", "the SBC object")


def _pieces(index):
    from horovod_sbc import hierarchy as common
    lay = common.layout([n for n, _ in MODEL], [k for _, k in MODEL], 2, index)
    return [common.piece_name(lay, p) for p in lay.pieces]


def _region(model, index, owner):
    """The downlink residuals' names of the rank that owns region ``owner`` of shard ``index``
    of ``model`` (torch's: the shard's pieces cut by the framework-free plan over 2 nodes)."""
    from horovod_sbc import hierarchy as common, regions
    lay = common.layout([n for n, _ in model], [k for _, k in model], 2, index)
    plan = regions.Plan([(common.piece_name(lay, p), (p[2] - p[1],)) for p in lay.pieces], 2)
    return sorted(n for n, _ in plan.regions[owner])


# -- one 4-rank job ------------------------------------------------------------------------
_RESULTS = {}


def job():
    if "res" not in _RESULTS:
        _RESULTS["res"], _ = run_ranks("tf_hier.py", 4, [], timeout=240)
    return _RESULTS["res"]


@pytest.mark.multirank
def test_bad_groupings_raise_the_same_clear_error_on_every_rank():
    errors = [r["errors"] for r in job()]
    for key in ("missing", "uneven", "twice", "node", "server", "undeclared"):
        assert len({e[key] for e in errors}) == 1 and errors[0][key].startswith("ValueError"), key
    assert "rank(s) [3] of this job of 4 ranks are in no group" in errors[0]["missing"]
    assert "got node sizes [3, 1]" in errors[0]["uneven"]
    assert "rank 1 is in more than one group" in errors[0]["twice"]
    assert "SBC(hierarchy='node'): a hierarchy needs at least 2 nodes" in errors[0]["node"]
    assert "topology='server'" in errors[0]["server"]
    assert "no process set of ranks [0, 3]" in errors[0]["undeclared"]
    assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in errors[0]["undeclared"]
    for r, e in enumerate(errors):  # ranks 2 and 3 were given another grouping
        assert "rank(s) [2, 3] were given another grouping than rank 0" in e["disagree"]
        assert e["fp16"].startswith(f"ValueError: SBC(hierarchy=...) on rank {r}: variable 'w' "
                                    "is float16")


@pytest.mark.multirank
@pytest.mark.parametrize("config", ["stored", "in_weights", "scatter"])
def test_shared_weights_identical_on_every_rank_after_every_sync(config):
    """``scatter``: ``topology="reduce_scatter"`` across the nodes (in tf.function)."""
    runs = [r[config] for r in job()]
    shared = runs[0]["shared"]
    assert len(shared) == (FIRST + MORE) // DELAY and len(set(shared)) == len(shared)
    assert all(r["shared"] == shared for r in runs)
    syncs = [DELAY * (i + 1) - 1 for i in range(len(shared))]  # step index of each sync
    if config != "in_weights":  # local_residual=False: every rank continues from W_ref
        assert all(r["local_residual"] is False and all(r["on_shared"]) for r in runs)
        assert all(len({r["weights"][s] for r in runs}) == 1 for s in syncs)
    else:  # from W_ref + its node's residual: equal inside a node, not across nodes
        assert not any(any(r["on_shared"]) for r in runs)
        for s in syncs:
            assert runs[0]["weights"][s] == runs[1]["weights"][s]
            assert runs[2]["weights"][s] == runs[3]["weights"][s]
            assert runs[0]["weights"][s] != runs[2]["weights"][s]
        assert len({r["weights"][0] for r in runs}) == 4  # between syncs: own local steps


@pytest.mark.multirank
def test_residuals_live_only_where_the_compression_happens():
    for r, res in enumerate(job()):
        own = _pieces(r % 2)  # local rank i compresses shard i
        full = [n for n, _ in MODEL]
        for config in ("stored", "scatter"):
            stored = res[config]["residuals"]  # no per-variable residual: never used here
            assert sorted(stored) == sorted(own) and not set(stored) & set(full)
            assert all(stored[p] > 0 for p in own)
        assert res["stored"]["downlink"] == {}  # the allgather keeps no downlink residual
        kept = res["in_weights"]["residuals"]  # moved into the weights after every sync
        assert sorted(kept) == sorted(own) and all(v == 0 for v in kept.values())


@pytest.mark.multirank
@pytest.mark.parametrize("config", ["stored", "in_weights"])
def test_stats_count_the_bits_of_the_hierarchy(config):
    syncs = (FIRST + MORE) // DELAY
    stats = [r[config]["stats"] for r in job()]
    numel = sum(k for _, k in MODEL)
    shard = math.ceil(numel / 2)
    payload = shard * (2 if config == "in_weights" else 1) + 1
    for r, s in enumerate(stats):
        assert s["syncs"] == syncs and s["steps"] == FIRST + MORE
        # status flag + dense reduce-scatter of a shard + the shared payload, to 1 other rank
        assert s["intra_node_bits"] == syncs * (32 + 32 * (shard + payload))
        sizes = [int(b) - int(a) for a, b in (p.split("[")[1][:-1].split(":")
                                              for p in _pieces(r % 2))]
        assert 0.8 * syncs * sum(keep_count(n, 0.05) for n in sizes) <= s["positions_sent"] \
            <= syncs * sum(keep_count(n, 0.05) for n in sizes)
        # one message per node and shard: the other node's
        assert s["downstream_bits"] == stats[(r + 2) % 4]["upstream_bits"] > 0
    for node in GROUPS:  # the node's shards cover every element once per sync
        assert sum(stats[r]["elements_synced"] for r in node) == syncs * numel


@pytest.mark.multirank
def test_reduce_scatter_across_nodes_keeps_torchs_downlink_residuals():
    """Local rank i of rank r owns region r // 2 of shard i among the ranks i of both nodes
    (cross-node sets (0, 2) and (1, 3)): its downlink residuals, under torch's piece names,
    non-zero after a sync and in the checkpoint; each node's message reaches the other."""
    res = job()
    for r, out in enumerate(res):
        run = out["scatter"]
        names = _region(MODEL, r % 2, r // 2)
        assert sorted(run["downlink"]) == names and all(run["downlink"].values())
        for n in names:
            assert f"sbc/server_residuals/{n.replace('/', '.S')}/.ATTRIBUTES/VARIABLE_VALUE" \
                in run["keys"]
        s = run["stats"]
        assert s["syncs"] == (FIRST + MORE) // DELAY and s["upstream_bits"] > 0
        # 2 nodes: the part for the other owner and this owner's region message
        assert s["downstream_bits"] == res[(r + 2) % 4]["scatter"]["stats"]["upstream_bits"]
        assert s["intra_node_bits"] == out["stored"]["stats"]["intra_node_bits"]
    for node in GROUPS:
        assert sum(res[r]["scatter"]["stats"]["elements_synced"] for r in node) == \
            (FIRST + MORE) // DELAY * sum(k for _, k in MODEL)


@pytest.mark.multirank
@pytest.mark.parametrize("config", ["stored", "scatter"])
def test_checkpoint_resume_is_exact_and_refuses_another_grouping(config):
    """``scatter``: the downlink residuals resume too (the resumed run's shared weights and
    its downlink residuals at the end are the uninterrupted run's)."""
    for r, res in enumerate(job()):
        run, again = res[config], res[config]["resumed"]
        assert again["local_steps"] == FIRST % DELAY
        assert again["weights"] == run["weights"][FIRST:]
        assert again["shared"] == run["shared"][FIRST // DELAY:]
        assert again["losses"] == run["losses"][FIRST:]
        assert again["stats"] == run["stats"]
        # torch's names: the residual pieces, escaped by TensorFlow ('/' is '.S')
        for p in _pieces(r % 2):
            assert f"sbc/residuals/{p.replace('/', '.S')}/.ATTRIBUTES/VARIABLE_VALUE" in \
                run["keys"]
        assert "sbc/node_of_rank/.ATTRIBUTES/VARIABLE_VALUE" in run["keys"]
        assert not [k for k in run["keys"] if k.startswith("sbc/residuals/") and "[" not in k]
        assert [k for k in run["keys"] if k.startswith("sbc/reference/")]
        assert "saved with the nodes [0, 0, 1, 1]" in run["regrouped"]
        assert "this run has [0, 1, 0, 1]" in run["regrouped"]
        assert again["downlink_end"] == run["downlink_end"]


@pytest.mark.multirank
@pytest.mark.parametrize("config", ["stored", "in_weights", "scatter"])
def test_finish_gives_every_rank_torchs_average_of_the_residuals(config):
    """finish(average_residuals=True) after a sync: W_ref + the mean over every rank of its
    share of its node's residual (W - W_ref in the weights, else its pieces times the node
    size), identical on every rank, the residual pieces zeroed and W_ref = W."""
    fin = [r[config]["finish"] for r in job()]
    assert len({f["digest"] for f in fin}) == 1
    for f in fin:
        assert f["moved"] > 1e-4  # the residuals were not zero: the rule moved the weights
        assert f["max_error"] < 1e-6, f["max_error"]
        assert f["on_shared"] and all(v == 0 for v in f["residuals"].values())


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["nonfinite", "nonfinite_rs"])
def test_a_nan_raises_or_skips_on_every_rank(key):
    """``nonfinite_rs``: across the nodes by reduce-scatter, the error relayed by the owners."""
    res = job()
    for r in res:
        nf = r[key]
        assert nf["raise"]["error"].startswith(
            "ValueError: SBC: rank 3 could not encode this sync: the update of 'fc2/bias' "
            "contains NaN or Inf; SBC's nonfinite policy is 'raise'"), nf["raise"]["error"]
        assert "SBC(..., nonfinite='skip')" in nf["raise"]["error"]
        assert nf["raise"]["unchanged"] and nf["skip"]["unchanged"]
        assert nf["skip"]["error"] is None and nf["skip"]["finite"]
        assert nf["skip"]["syncs"] == 2  # the skipped sync is not counted, the next commits
        assert any("rank 1 could not encode this sync: the update of 'fc2/bias'" in w
                   for w in nf["skip"]["warnings"])
    assert len({r[key]["skip"]["after"] for r in res}) == 1


@pytest.mark.multirank
def test_keras_fit_with_the_callback_through_the_hierarchy():
    res = job()
    assert all(r["fit"]["stats"]["syncs"] == 4 and len(r["fit"]["digests"]) == 4 for r in res)
    for s in range(4):
        assert len({r["fit"]["digests"][s] for r in res}) == 1
    assert len(set(res[0]["fit"]["digests"])) == 4


@pytest.mark.multirank
@pytest.mark.slow
def test_tensorflow_and_torch_ranks_share_one_hierarchy():
    """TF on ranks 0 and 2, torch on 1 and 3, nodes [[0, 1], [2, 3]]: the same collectives
    (names, dtypes, shapes) and cross-node bytes, so every rank keeps identical shared
    weights. Then ``topology="reduce_scatter"`` on nodes [[0, 3], [1, 2]]: each cross-node
    set, (0, 1) and (2, 3), is a TF and a torch rank, whose parts, region messages and
    downlink residuals' names agree."""
    pytest.importorskip("torch")
    results, _ = run_ranks("tf_hier.py", 4, ["mixed"], timeout=240)
    assert [r["framework"] for r in results] == ["tf", "torch", "tf", "torch"]
    for s in range(3):
        assert len({r["digests"][s] for r in results}) == 1, f"sync {s}: ranks differ"
        assert len({r["weights"][s] for r in results}) == 1
    assert len(set(results[0]["digests"])) == 3
    for r in (0, 1):  # the same shard, the same bits on both frameworks
        assert results[r]["stats"]["upstream_bits"] == results[r + 2]["stats"]["downstream_bits"]
        assert results[r]["stats"]["intra_node_bits"] == results[r ^ 1]["stats"]["intra_node_bits"]
    rs = [r["scatter"] for r in results]
    for s in range(3):
        assert len({r["digests"][s] for r in rs}) == 1, f"reduce_scatter sync {s}: ranks differ"
        assert len({r["weights"][s] for r in rs}) == 1
    assert len(set(rs[0]["digests"])) == 3
    from horovod_sbc import hierarchy as common
    for r in range(4):
        _, local, cross = common.position(((0, 3), (1, 2)), r)
        assert rs[r]["downlink"] == _region([("a", 300), ("b", 50)], local, cross.index(r)), r
        peer = next(q for q in cross if q != r)  # a rank of the other framework
        assert results[r]["framework"] != results[peer]["framework"]
        assert rs[r]["stats"]["upstream_bits"] == rs[peer]["stats"]["downstream_bits"] > 0
