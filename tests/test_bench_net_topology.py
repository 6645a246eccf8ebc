"""bench_net's ``topology`` field and validate_advise's reduce-scatter rows (no testbed run)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT
from benchmarks import bench_net as bn
from benchmarks import validate_advise as va
from horovod_sbc import advise as ad

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
RS = {"method": "sbc", "density": 0.01, "topology": "reduce_scatter"}


def test_method_label_names_the_topology():
    assert bn.method_label({"method": "sbc", "density": 0.01}) == "sbc p=0.01"
    assert bn.method_label(dict(RS, topology="allgather")) == "sbc p=0.01"
    assert bn.method_label(RS) == "sbc p=0.01 reduce_scatter"
    assert bn.method_label(dict(RS, api="stock")) == "sbc p=0.01 reduce_scatter (stock hook)"


def test_method_compressor_passes_the_topology():
    c = bn.method_compressor(RS, 1)
    assert c.topology == "reduce_scatter" and c.density == 0.01 and c.delay == 1
    assert bn.method_compressor({"method": "sbc", "density": 0.01}, 4).topology == "allgather"
    assert bn.method_compressor({"method": "sbc", "density": 0.01}, 4).delay == 4
    t = bn.method_compressor(dict(RS, method="topk"), 1)
    assert t.topology == "reduce_scatter" and t.mode == "values"
    with pytest.raises(ValueError, match="topology"):
        bn.method_compressor(dict(RS, topology="ring"), 1)
    with pytest.raises(ValueError, match="fedavg"):
        bn.method_compressor(dict(RS, method="fedavg"), 1)


def test_decode_timer_counts_a_nested_call_once():
    timer = bn.DecodeTimer()

    def inner():
        return 1

    inner_t = timer.wrap(inner)

    def outer():
        return inner_t() + inner_t()

    assert timer.wrap(outer)() == 2
    assert timer.calls == 1 and timer.seconds > 0
    assert inner_t() == 1 and timer.calls == 2


def test_decode_timer_sees_both_topologies_decode_calls():
    """Installed in a fresh process (it patches the backend classes): ``decode`` (the
    allgather's and the owner's) and ``decode_many`` (the region messages) are timed, once
    each, including the kernel backend's ``decode_many`` that calls its base class's."""
    code = """
import json, torch
from benchmarks import bench_net as bn
from horovod_sbc import advise as ad
from horovod_sbc.torch.backend import DecodeJob, Targets, backend_for
t = bn.DECODE_TIMER.install()
bn.DECODE_TIMER.install()  # idempotent
layout = [("w", (4000,)), ("b", (10,))]
steps = [ad._encoder(layout, 0.01, 100 + r)() for r in range(2)]
out = [torch.zeros(4000), torch.zeros(10)]
b = backend_for(steps[0].device)
b.decode(torch.cat(steps), layout, 2, Targets.add(out), 0.5)
one = t.calls
b.decode_many([DecodeJob(s, layout, 1, Targets.add(out)) for s in steps])
print(json.dumps([one, t.calls, t.seconds]))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    one, calls, seconds = json.loads(p.stdout.strip().splitlines()[-1])
    assert (one, calls) == (1, 2) and seconds > 0


def _run(net, label, method, step, down, decode, topology=None, api="drop-in"):
    return {"network": net, "label": label, "method": method, "topology": topology, "api": api,
            "steps": 8, "step_time_s": step, "upstream_bits_per_step": down / 3,
            "downstream_bits_per_step": down / 2 if method == "none" else down,
            "wire_bits_per_step": down if method == "none" else 3 * down,
            "decode_s_per_step": decode, "params": 1000}


def test_topology_rows_and_table():
    methods = [m for m in bn.TOPOLOGY_METHODS]
    assert bn.topology_pairs(methods) == [
        ("sbc p=0.01", "sbc p=0.01 reduce_scatter"),
        ("sbc p=0.01 (stock hook)", "sbc p=0.01 reduce_scatter (stock hook)")]
    assert bn.topology_pairs([RS]) == []  # no allgather twin
    runs = [_run("100mbit", "none", "none", 2.0, 6e8, 0.0),
            _run("100mbit", "sbc p=0.01", "sbc", 0.5, 8e6, 0.04, "allgather"),
            _run("100mbit", "sbc p=0.01 reduce_scatter", "sbc", 0.25, 2e6, 0.01,
                 "reduce_scatter")]
    res = {"config": {"sizes": [10, 10], "interleave": {"rounds": 2, "block": 1}},
           "by_workers": {"8": {"runs": runs}}}
    res["rows"] = rows = bn.topology_rows(res["by_workers"], methods)
    assert [r["workers"] for r in rows] == [8, 8, 8]
    rs = rows[2]
    assert rs["step_over_dense"] == pytest.approx(0.125)
    assert rs["rs_over_allgather"] == pytest.approx(
        {"step_time": 0.5, "downstream_bits": 0.25, "decode": 0.25})
    assert "rs_over_allgather" not in rows[1]
    md = bn.markdown_topology(res)
    assert "| 8 | 100mbit | sbc p=0.01 reduce_scatter | 250.0 ms | 0.12x | 2.000 | 10.0 ms | " \
           "0.50x / 0.25x / 0.25x |" in md
    # dense: what a rank receives in the ring allreduce (the wire bits), not stats' model size
    assert "| 8 | 100mbit | none | 2000.0 ms | 1.00x | 600.000 | - |  |" in md


def test_topology_reanalyse_rewrites_table_and_plot(tmp_path):
    runs = [_run("1gbit", "none", "none", 1.0, 6e8, 0.0),
            _run("1gbit", "sbc p=0.01", "sbc", 0.5, 8e6, 0.04, "allgather"),
            _run("1gbit", "sbc p=0.01 reduce_scatter", "sbc", 0.4, 2e6, 0.01, "reduce_scatter")]
    saved = tmp_path / "topo.json"
    saved.write_text(json.dumps({
        "config": {"sizes": [10, 10], "interleave": {"rounds": 2, "block": 1},
                   "methods": bn.TOPOLOGY_METHODS},
        "by_workers": {"4": {"runs": runs}}, "rows": [], "errors": [], "command": "x"}))
    out = tmp_path / "again.json"
    assert bn.topology_main(["--reanalyse", str(saved), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["rows"][2]["rs_over_allgather"]["step_time"] == pytest.approx(0.8)
    assert "| 4 | 1gbit | sbc p=0.01 reduce_scatter | 400.0 ms |" in \
        (tmp_path / "again.md").read_text()
    assert (tmp_path / "again.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_topology_command_line():
    args = bn.topology_parser().parse_args(
        ["--workers", "4", "--workers", "8", "--bandwidth", "1gbit", "--density", "0.001",
         "--no-stock", "--rounds", "3", "--json", "x.json"])
    assert args.workers == [4, 8] and args.bandwidth == ["1gbit"] and args.rounds == 3
    ms = bn.topology_methods(args)
    assert [bn.method_label(m) for m in ms] == [
        "local", "none", "sbc p=0.001", "sbc p=0.001 reduce_scatter"]
    assert bn.TOPOLOGY_METHODS[2]["density"] == 0.01  # the defaults are not mutated
    args = bn.topology_parser().parse_args([])
    assert len(bn.topology_methods(args)) == len(bn.TOPOLOGY_METHODS)


def test_validation_methods_take_the_topology():
    labels = [bn.method_label(m) for m in va.validation_methods(0.01)]
    assert labels == ["local", "none", "sbc p=0.01", "sbc p=0.01 reduce_scatter"]
    assert [bn.method_label(m) for m in va.validation_methods(0.01, "allgather")][-1] == \
        "sbc p=0.01"
    assert [bn.method_label(m) for m in va.validation_methods(0.01, "reduce_scatter")][2:] == \
        ["sbc p=0.01 reduce_scatter"]
    with pytest.raises(ValueError):
        va.validation_methods(0.01, "server")


def test_validation_rows_predict_the_reduce_scatter():
    """A committed allgather validation with a reduce-scatter run added beside each SBC run:
    its rows use advise's sbc_reduce_scatter_step, twice the latency steps, the model's
    reduce-scatter decode, and the table gives RS / AG measured and predicted."""
    saved = json.loads((RESULTS / "advise_validation_4ranks.json").read_text())
    res = saved["bench_net"]
    extra = []
    for r in res["runs"]:
        if r["method"] == "sbc":
            r["decode_s_per_step"] = 0.004
            extra.append(dict(r, label="sbc p=0.01 reduce_scatter", topology="reduce_scatter",
                              step_time_s=0.8 * r["step_time_s"], decode_s_per_step=0.002))
    res["runs"] += extra
    c = ad.CodecCost(**res["codec"])
    lat = saved["args"]["latency"]
    rows = va.predictions(res, c, lat, "one_way")
    assert {(r["network"], r["method"]) for r in rows} == {
        (n, m) for n in ("1gbit", "100mbit")
        for m in ("none", "sbc p=0.01", "sbc p=0.01 reduce_scatter")}
    local = next(r for r in res["runs"] if r["method"] == "local")["step_time_s"]
    n = res["workers"]
    for r in rows:
        net = ad.Net(r["link_mbit"] * 1e6, lat)
        if r["topology"] == "reduce_scatter":
            want = ad.sbc_reduce_scatter_step(c, n, net)
            assert r["decode_predicted_s"] == pytest.approx(ad.reduce_scatter_decode_s(c, n))
            assert r["decode_measured_s"] == 0.002
            loop = next(x for x in res["runs"] if x["network"] == "loopback"
                        and x["label"] == r["method"])
            assert r["network_only_s"] == pytest.approx(
                loop["step_time_s"] + want.bits / net.bps + 2 * (n - 1) * lat)
        elif r["topology"] == "allgather":
            want = ad.sbc_allgather_step(c, n, net)
            assert r["decode_predicted_s"] == pytest.approx(c.decode_s(n))
        else:
            want = ad.dense_step(c, n, net)
            assert "decode_predicted_s" not in r
        assert r["predicted_s"] == pytest.approx(local + want.at(net.bps))
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
    ratios = va.topology_ratios(rows)
    assert {t["network"] for t in ratios} == {"1gbit", "100mbit"}
    for t in ratios:
        assert t["measured"] == pytest.approx(0.8) and t["workers"] == n
        ag = next(r for r in rows if r["network"] == t["network"]
                  and r["topology"] == "allgather")
        rs = next(r for r in rows if r["network"] == t["network"]
                  and r["topology"] == "reduce_scatter")
        assert t["predicted"] == pytest.approx(rs["predicted_s"] / ag["predicted_s"])
    table = va.format_rows(rows, local)
    assert "reduce-scatter step / allgather step:" in table
    assert "sbc p=0.01 reduce_scatter" in table


def test_validation_skips_methods_without_a_formula():
    c = ad.CodecCost(**json.loads((RESULTS / "advise_validation_2ranks.json").read_text())[
        "bench_net"]["codec"])
    net = ad.Net(1e8, 1e-4)
    assert va.method_model({"method": "local"}, c, 2, net) is None
    assert va.method_model({"method": "sbc", "api": "stock"}, c, 2, net) is None
    assert va.method_model({"method": "sbc", "delay": 4}, c, 2, net) is None
    assert va.method_model({"method": "sbc"}, c, 4, net) == ad.sbc_allgather_step(c, 4, net)
    assert va.method_model(RS, c, 4, net) == ad.sbc_reduce_scatter_step(c, 4, net)
    assert va.latency_steps(RS, 8) == 14 and va.latency_steps({"method": "sbc"}, 8) == 7
