"""benchmarks/quality.py (issue 27's study): seeds joined, finish() counted, goals judged."""
import json

from benchmarks import quality
from benchmarks.bench_train import _add_ratios, merge_seed_runs


def _run(method, seeds, scores, shared=None, up=1000.0, dense_bits=1e7, part="iid", **kw):
    r = dict(method=method, density=kw.pop("density", 1.0), delay=kw.pop("delay", 1),
             label=kw.pop("label", method), task="mnist1d_long", metric="accuracy",
             partition="iid" if part == "iid" else "by_class", workers=4, part=part,
             seeds=list(seeds), score_seeds=list(scores), score=sum(scores) / len(scores),
             score_std=0.0, upstream_bits=up, downstream_bits=up, dense_bits=dense_bits,
             syncs=1.0, positions_sent=0.0, elements_synced=0.0, step_time_s=0.1, wall_s=1.0,
             steps=1500, ranks_identical=True, **kw)
    if shared is not None:
        r.update(score_shared_seeds=list(shared), score_shared=sum(shared) / len(shared),
                 score_shared_std=0.0, finish_bits=32 * 8010.0)
    if method == "local":
        r["upstream_bits"] = 0.0
    _add_ratios(r)
    return r


def test_finish_is_counted_and_seeds_are_joined():
    a = _run("sbc", [0], [0.90], shared=[0.93], up=1000.0, density=0.01, delay=16,
             label="sbc p=0.01 n=16")
    b = _run("sbc", [1, 2], [0.92, 0.94], shared=[0.95, 0.97], up=1000.0, density=0.01,
             delay=16, label="sbc p=0.01 n=16")
    assert a["compression_ratio"] == 1e7 / 1000
    assert a["ratio_with_finish"] == 1e7 / (1000 + 32 * 8010)
    (m,) = merge_seed_runs([a, b])
    assert m["seeds"] == [0, 1, 2] and m["score_seeds"] == [0.90, 0.92, 0.94]
    assert abs(m["score_shared"] - 0.95) < 1e-12 and len(m["score_shared_seeds"]) == 3
    assert m["ratio_with_finish"] == 1e7 / (1000 + 32 * 8010)


def test_goals_use_three_seed_rows_and_both_models():
    runs = [_run("none", [0, 1, 2], [0.945] * 3, up=1e7),
            _run("local", [0, 1, 2], [0.86] * 3),
            # within 1 point by its shared weights at x20,000, but only 1 seed: not counted
            _run("sbc", [0], [0.80], shared=[0.95], up=500.0, density=0.01, delay=128,
                 label="one seed"),
            # 3 seeds: shared weights within 1 point at x10,000; after finish() far below
            _run("sbc", [0, 1, 2], [0.90] * 3, shared=[0.94] * 3, up=1000.0, density=0.01,
                 delay=64, label="three seeds"),
            _run("sbc", [0, 1, 2], [0.93] * 3, up=1e7 / 77, api="stock", density=0.01,
                 label="stock")]
    res = {"runs": runs}
    g = {x["goal"]: x for x in quality.goals(res)}
    iid = next(v for k, v in g.items() if k.startswith("mnist1d_long IID"))
    assert iid["reached"] and iid["largest_ratio_within"]["ratio"] == 10_000
    assert iid["largest_ratio_within"]["model"] == "shared weights"
    stock = next(v for k, v in g.items() if k.startswith("stock hook") and v["part"] == "iid")
    assert stock["reached"] and not stock["within_1pt_of_dense"]
    skew = next(v for k, v in g.items() if "skewed" in k)
    assert skew["measured"] is False
    md = quality.markdown(res)
    assert "×10,000" in md and "not measured" in md
    json.dumps(quality.goals(res))  # the goals go into the JSON


def test_quick_study_is_small_and_every_part_has_baselines():
    jobs = quality.study_jobs(list(quality.PARTS), quick=True)
    assert {j["workers"] for _, j in jobs} == {2}
    assert all(r.get("steps") == 40 for _, j in jobs for r in j["runs"])
    for part, runs in quality.STUDY.items():
        methods = [s["method"] for s, _ in runs]
        assert "none" in methods and "local" in methods, part
        assert all(seeds for _, seeds in runs)


def test_the_screen_measures_its_own_baselines_and_every_setting_with_their_seed():
    """The one-seed screen judges each setting against dense and no communication measured in
    the same run with the same seed (0); a setting given more seeds has seed 0 among them."""
    jobs = quality.study_jobs(list(quality.SCREEN), study=quality.SCREEN)
    assert jobs and {j["workers"] for _, j in jobs} == {4}
    for part in quality.SCREEN:
        seeds_of = {}
        for p, j in jobs:
            if p == part:
                key = json.dumps(j["runs"][0], sort_keys=True)
                seeds_of.setdefault(key, set()).update(j["seeds"])
        methods = {json.loads(k)["method"] for k in seeds_of}
        assert {"none", "local"} <= methods, part
        for key, seeds in seeds_of.items():
            assert 0 in seeds, (part, key)


def test_density_warm_up_is_geometric_and_reaches_the_density_the_sync_uses():
    """DGC's warm-up in the study's worker: 0.25 at step 0, geometric down to p at step n, p
    after; the compressor's sync configuration takes each value."""
    from benchmarks.bench_train import _set_density, _warm_density
    import horovod_sbc.torch as sbc
    ds = [_warm_density([0.25, 100], 0.01, s) for s in range(0, 130, 10)]
    assert ds[0] == 0.25 and ds[10:] == [0.01] * 3
    assert all(a > b for a, b in zip(ds[:10], ds[1:11]))
    assert abs(ds[5] - (0.25 * 0.01) ** 0.5) < 1e-12  # halfway: the geometric mean
    comp = sbc.SBC(0.01, delay=1)
    _set_density(comp, 0.05)
    assert comp.density == comp.state.config.density == 0.05 and comp.delay == 1


def test_goals_judge_against_the_users_dense_and_rows_against_their_own_recipe():
    """A dense run with Adam's variance frozen is not the goals' dense (the user's AdamW is);
    a row with the freeze is compared with dense of the same frozen optimizer in its table."""
    frozen = {"freeze_variance_after": 100}
    runs = [_run("none", [0, 1, 2], [0.99] * 3, up=1e7, label="none freeze=100", **frozen),
            _run("none", [0, 1, 2], [0.945] * 3, up=1e7),
            _run("local", [0, 1, 2], [0.86] * 3),
            _run("sbc", [0, 1, 2], [0.94] * 3, shared=[0.94] * 3, up=1000.0, density=0.01,
                 delay=64, label="sbc p=0.01 n=64 freeze=100", **frozen)]
    res = {"runs": runs}
    iid = next(v for v in quality.goals(res) if v["goal"].startswith("mnist1d_long IID"))
    assert iid["dense"] == 0.945 and iid["reached"]
    md = quality.markdown(res)
    row = next(ln for ln in md.splitlines() if ln.startswith("| drop-in `SBC(0.01, delay=64)`"))
    assert "[Adam's variance frozen after 100 steps]" in row and row.endswith("| -5.0 pt |")


def test_a_row_with_the_learning_rate_raised_after_the_freeze_is_compared_with_its_own_dense():
    """``lr_after_freeze`` is a change of the user's recipe: its row names it and is compared
    with dense of the same recipe, not with the frozen dense at the recipe's learning rate."""
    frozen, boosted = {"freeze_variance_after": 100}, {"freeze_variance_after": 100,
                                                        "lr_after_freeze": 2.0}
    runs = [_run("none", [0, 1, 2], [0.945] * 3, up=1e7),
            _run("none", [0, 1, 2], [0.96] * 3, up=1e7, label="none freeze=100", **frozen),
            _run("none", [0], [0.98], up=1e7, label="none freeze=100 lr x2", **boosted),
            _run("local", [0, 1, 2], [0.86] * 3),
            _run("sbc", [0, 1, 2], [0.95] * 3, shared=[0.95] * 3, density=0.01, delay=4,
                 label="sbc p=0.01 n=4 freeze=100 lr x2", **boosted)]
    md = quality.markdown({"runs": runs})
    row = next(ln for ln in md.splitlines() if ln.startswith("| drop-in `SBC(0.01, delay=4)`"))
    assert ("[Adam's variance frozen after 100 steps, learning rate x2 from then on]" in row
            and row.endswith("| -3.0 pt |"))
    iid = next(v for v in quality.goals({"runs": runs}) if v["goal"].startswith("mnist1d"))
    assert iid["dense"] == 0.945


def test_the_learning_rate_after_the_freeze_starts_with_the_first_frozen_step():
    from benchmarks.bench_train import lr_schedule
    from benchmarks.tasks import Recipe
    recipe = Recipe(lr=3e-3, momentum=0.0, batch_size=16, steps=600, optimizer="adamw",
                    warmup=30, schedule="cosine")
    plain = lr_schedule(recipe, {"freeze_variance_after": 100}, 600)
    raised = lr_schedule(recipe, {"freeze_variance_after": 100, "lr_after_freeze": 2.0}, 600)
    assert [raised(s) / plain(s) for s in (0, 50, 99, 100, 101, 599)] == [1, 1, 1, 2, 2, 2]
    assert plain(300) == recipe.lr_factor(300, 600)
    import pytest
    with pytest.raises(ValueError, match="lr_after_freeze needs freeze_variance_after"):
        lr_schedule(recipe, {"lr_after_freeze": 2.0}, 600)
