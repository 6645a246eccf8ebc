"""benchmarks/bench_ddp.py: aggregation rules (unit) and the --quick torchrun job (slow)."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

from harness import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import bench_ddp  # noqa: E402


def _run(label, family, seed, acc, bits, t, **kw):
    return dict(label=label, family=family, seed=seed, accuracy=acc, upstream_bits=bits,
                step_time_s=t, ranks_identical=True, steps=10, **kw)


def test_summary_ratios_are_per_seed_and_best_within_one_point_picks_the_most_compressed():
    runs = []
    for seed, (dense_bits, dense_t) in enumerate([(1000.0, 1.0), (1000.0, 2.0)]):
        runs += [_run("none", "none", seed, 0.70, dense_bits, dense_t),
                 _run("powersgd r=1", "powersgd", seed, 0.695, 100.0, 2 * dense_t, rank=1),
                 _run("powersgd r=4", "powersgd", seed, 0.70, 250.0, dense_t, rank=4),
                 _run("sbc-hook p=0.01", "sbc-hook", seed, 0.68, 10.0, 3 * dense_t,
                      density=0.01, message_bits=9.0, measured_density=0.01),
                 _run("sbc-avg p=0.01 n=4", "sbc-avg", seed, 0.6905 + 0.002 * seed, 4.0,
                      dense_t, density=0.01, period=4)]
    rows = {r["label"]: r for r in bench_ddp.summarise(runs)}
    assert rows["powersgd r=1"]["ratio"] == pytest.approx(10.0)
    assert rows["powersgd r=1"]["step_time_vs_none"] == pytest.approx(2.0)
    assert rows["sbc-hook p=0.01"]["message_bits"] == 9.0
    assert rows["sbc-avg p=0.01 n=4"]["accuracy_std"] > 0
    summary = bench_ddp.summarise(runs)
    assert bench_ddp.best_within(summary, "powersgd")["label"] == "powersgd r=1"
    # the SBC hook is 2 points below dense: only the averager (0.6915 mean) qualifies
    best = bench_ddp.best_within(summary, "sbc")
    assert best["label"] == "sbc-avg p=0.01 n=4" and best["ratio"] == pytest.approx(250.0)
    assert bench_ddp.best_within(summary, "sbc", points=0.5) is None
    md = bench_ddp.markdown({"summary": summary, "np": 2, "runs": runs,
                             "config": {"epochs": 1, "batch": 8, "lr": 0.1, "seeds": 2}})
    assert "| sbc-hook p=0.01 | 68.00 ± 0.00 | 10 | 100x |" in md
    assert "- sbc: sbc-avg p=0.01 n=4" in md


def test_methods_include_powersgd_defaults_a_ten_percent_and_a_minimal_warmup():
    ms = bench_ddp.methods(quick=False, steps=900)
    psgd = [m for m in ms if m["family"] == "powersgd"]
    assert {(m["rank"], m["start"]) for m in psgd} == {(r, s) for r in (1, 2, 4)
                                                       for s in (None, 90, 2)}
    assert {m["granularity"] for m in ms if m["family"] == "sbc-hook"} == {"parameter",
                                                                            "bucket"}


@pytest.mark.slow
@pytest.mark.multirank
def test_quick_head_to_head_runs_and_writes_its_table():
    out = os.path.join(tempfile.mkdtemp(prefix="sbc-bench-ddp-"), "ddp.json")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "benchmarks.bench_ddp", "--quick", "--json", out],
                   cwd=str(ROOT), env=env, check=True, timeout=600, capture_output=True)
    res = json.load(open(out))
    rows = {r["label"]: r for r in res["summary"]}
    assert all(r["ranks_identical"] for r in rows.values())
    assert rows["fp16"]["ratio"] == pytest.approx(2.0, rel=1e-3)
    assert rows["sbc-hook p=0.01"]["ratio"] > 100
    assert abs(rows["sbc-hook p=0.01"]["measured_density"] - 0.01) < 0.002
    assert rows["sbc-avg p=0.01 n=4"]["ratio"] > rows["sbc-hook p=0.01"]["ratio"]
    assert os.path.exists(out[:-5] + ".md") and os.path.exists(out[:-5] + "_accuracy_vs_bits.png")
