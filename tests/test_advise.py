"""horovod_sbc.advise: the cost model's formulas on hand-computed cases, the layouts' sizes, the
codec measurement's accounting, and the command line on a tiny layout."""
from __future__ import annotations

import json
import math

import pytest

from horovod_sbc import advise as ad
from horovod_sbc.advise import Cost, Net


def tiny_model():
    """A user's model for the ``module:function`` layout form."""
    import torch
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def codec(**kw) -> ad.CodecCost:
    """Made-up codec figures: 1M elements (32 Mbit dense), 64 kbit messages."""
    base = dict(numel=1_000_000, tensors=10, density=0.01, encode_s=0.010, decode_fixed_s=0.002,
                decode_per_message_s=0.001, message_bits=64_000, downlink_encode_s=0.003,
                downlink_decode_s=0.004, downlink_bits=32_000_000)
    base.update(kw)
    return ad.CodecCost(**base)


def close(a: Cost, bits: float, seconds: float) -> bool:
    return math.isclose(a.bits, bits, rel_tol=1e-12) and math.isclose(a.seconds, seconds,
                                                                     rel_tol=1e-12, abs_tol=1e-15)


# -- the formulas -------------------------------------------------------------------------------
def test_ring_allreduce_allgather_broadcast():
    # 2(N-1)/N * size and 2(N-1) latencies: N=4, 1 Gbit -> 1.5 Gbit, 6 latencies
    assert close(ad.ring_allreduce(1e9, 4, 1e-5), 1.5e9, 6e-5)
    assert ad.ring_allreduce(1e9, 4, 1e-5).at(1e9) == pytest.approx(1.5 + 6e-5)
    assert close(ad.ring_allreduce(1e9, 1, 1e-5), 0, 0)
    # each rank receives the other N-1 messages
    assert close(ad.ring_allgather(1000, 8, 1e-4), 7000, 7e-4)
    # scatter + allgather: 2(N-1)/N * size, log2(N) + N - 1 latencies
    assert close(ad.broadcast(800, 8, 1e-3), 1400, 10e-3)


def test_sbc_allgather_against_dense_and_crossover():
    c, net = codec(), Net(bps=1e9, latency_s=0.0)
    dense = ad.dense_step(c, 4, net)
    assert close(dense, 48e6, 0)  # 2 * 3/4 * 32 Mbit
    sbc = ad.sbc_allgather_step(c, 4, net)
    # 3 messages in, encode 10 ms + decode 2 ms + 4 x 1 ms (every rank's message, its own too)
    assert close(sbc, 192_000, 0.016)
    x, side = ad.crossover_bps(dense, sbc)
    assert side == "below" and x == pytest.approx((48e6 - 192e3) / 0.016)  # 2.988 Gbit/s
    assert dense.at(x) == pytest.approx(sbc.at(x))
    assert sbc.at(0.5 * x) < dense.at(0.5 * x) and sbc.at(2 * x) > dense.at(2 * x)
    # a sync every 4 steps: a quarter of everything per step
    assert close(ad.sbc_allgather_step(c, 4, net, delay=4), 48_000, 0.004)
    # the drop-in's sync work outside the codec is added once per sync, whatever N
    busy = codec(sync_overhead_s=0.003)
    assert close(ad.sbc_allgather_step(busy, 4, net), 192_000, 0.019)
    assert close(ad.sbc_allgather_step(busy, 16, net, delay=2), 15 * 64_000 / 2,
                 (0.010 + 0.002 + 16 * 0.001 + 0.003) / 2)


def test_crossover_sides():
    assert ad.crossover_bps(Cost(100, 1.0), Cost(10, 0.5)) == (None, "always")
    assert ad.crossover_bps(Cost(10, 0.5), Cost(100, 1.0)) == (None, "never")
    # more bits but less latency: pays above 90 / 0.5 = 180 bit/s
    assert ad.crossover_bps(Cost(10, 1.0), Cost(100, 0.5)) == (pytest.approx(180.0), "above")
    assert ad.crossover_bps(Cost(10, 1.0), Cost(10, 1.0)) == (None, "never")


def test_server_and_hierarchical():
    c, net = codec(), Net(bps=1e9, latency_s=1e-3, intra_bps=1e11, intra_latency_s=1e-6)
    srv = ad.sbc_server_step(c, 4, net)
    # gather 3 x 64 kbit + 1 latency; broadcast 2 * 3/4 * 32 Mbit + (2 + 3) latencies;
    # encode 10 + decode (2 + 4 x 1) + downlink encode 3 + decode 4 ms
    assert close(srv, 3 * 64_000 + 48e6, 0.023 + 1e-3 + 5e-3)
    assert close(ad.sbc_server_step(codec(sync_overhead_s=0.003), 4, net), 3 * 64_000 + 48e6,
                 0.026 + 1e-3 + 5e-3)
    hier = ad.hierarchical_step(c, 16, 8, net)  # 2 nodes of 8
    intra = 2 * 7 / 8 * 32e6 / 1e11 + 14 * 1e-6
    assert close(hier, 64_000, intra + 0.010 + 0.002 + 2 * 0.001 + 1e-3)
    # one node: the dense allreduce inside it only
    assert close(ad.hierarchical_step(c, 8, 8, net), 0, intra)


def rs_codec(**kw) -> ad.CodecCost:
    """The made-up codec with the reduce-scatter's per-piece and per-step figures."""
    base = dict(tensor_header_bits=96, encode_per_tensor_s=1e-5, decode_per_tensor_s=1e-5,
                decode_per_step_s=2e-6, frame_per_step_s=3e-6)
    base.update(kw)
    return codec(**base)


def test_reduce_scatter_by_hand():
    from horovod_sbc import wire
    c, net = rs_codec(), Net(bps=1e9, latency_s=1e-3)
    assert ad.STEP_HEADER_BITS == 8 * wire.STEP_HEADER_SIZE
    # a region's step message: 24-byte header + (body + 3 more piece headers) / 4
    region = 192 + (64_000 - 192 + 3 * 96) / 4
    assert ad.reduce_scatter_region_bits(c, 4) == pytest.approx(16_216)
    assert ad.reduce_scatter_download_bits(c, 4) == pytest.approx(2 * 3 * region)
    # encode 10 ms + 3 more pieces and step messages; the region's re-encode (10 ms + 3 pieces)
    # / 4; decode: 2 ms x (1 + 1/4) + 2 x (one message 1 ms + 3 pieces + 3 step messages)
    encode, reencode = 0.010 + 3 * 13e-6, (0.010 + 3e-5) / 4
    decode = 0.0025 + 2 * (0.001 + 3 * 12e-6)
    assert ad.reduce_scatter_decode_s(c, 4) == pytest.approx(decode)
    # alltoall and allgather: 3 latencies each
    assert close(ad.sbc_reduce_scatter_step(c, 4, net), 6 * region,
                 encode + reencode + decode + 6e-3)
    # the drop-in's sync work once; one rank: the allgather's own (nothing exchanged)
    busy = rs_codec(sync_overhead_s=0.003)
    assert ad.sbc_reduce_scatter_step(busy, 4, net).seconds == pytest.approx(
        encode + reencode + decode + 6e-3 + 0.003)
    assert ad.sbc_reduce_scatter_step(c, 1, net) == ad.sbc_allgather_step(c, 1, net)
    # hierarchical: the intra-node allreduce, then the reduce-scatter among 2 nodes
    hier = ad.hierarchical_step(c, 16, 8, net, across=ad.sbc_reduce_scatter_step)
    assert hier == ad.hierarchical_step(c, 8, 8, net) + ad.sbc_reduce_scatter_step(c, 2, net)


def test_reduce_scatter_with_the_owners_at_another_setting_by_hand():
    """Owners re-encoding at another setting (e.g. a ternary downlink at 4x the density): the
    allgathered region messages, their decode and the re-encode take its measured figures; the
    alltoall's parts keep the uplink's."""
    c, net = rs_codec(rs_down_bits=200_000, rs_down_encode_s=0.030,
                      rs_down_decode_per_message_s=0.005), Net(bps=1e9, latency_s=1e-3)
    up, down = 192 + (64_000 - 192 + 3 * 96) / 4, 192 + (200_000 - 192 + 3 * 96) / 4
    assert ad.reduce_scatter_region_bits(c, 4) == pytest.approx(up)
    assert ad.reduce_scatter_region_bits(c, 4, down=True) == pytest.approx(down)
    assert ad.reduce_scatter_download_bits(c, 4) == pytest.approx(3 * (up + down))
    decode = 0.0025 + 2 * 3 * 12e-6 + 0.001 + 0.005
    assert ad.reduce_scatter_decode_s(c, 4) == pytest.approx(decode)
    encode, reencode = 0.010 + 3 * 13e-6, (0.030 + 3e-5) / 4
    assert close(ad.sbc_reduce_scatter_step(c, 4, net), 3 * up + 3 * down,
                 encode + reencode + decode + 6e-3)
    # unset (0), the uplink's figures: the model of the default reduce-scatter
    same = rs_codec()
    assert ad.reduce_scatter_region_bits(same, 4, down=True) == \
        ad.reduce_scatter_region_bits(same, 4)


def test_reduce_scatter_download_does_not_grow_with_n():
    """A ResNet-50-sized message (2.09 Mbit, 14-byte tensor headers): what a rank receives is
    2 (n-1)/n of the message body plus 2 (n-1) step headers and the region cuts' piece headers;
    from 8 to 1,024 ranks it grows 1.31x (the allgather's 146x)."""
    c = rs_codec(message_bits=2_090_960, tensor_header_bits=112)
    body = 2_090_960 - 192

    def expect(n):
        return 2 * (n - 1) / n * (body + (n - 1) * 112) + 2 * (n - 1) * 192
    for n in (8, 1024):
        assert ad.reduce_scatter_download_bits(c, n) == pytest.approx(expect(n))
    d8, d1024 = ad.reduce_scatter_download_bits(c, 8), ad.reduce_scatter_download_bits(c, 1024)
    assert d8 == pytest.approx(3_662_904) and d1024 == pytest.approx(4_799_212.6875)
    assert d1024 / d8 < 1.32
    # without the headers exactly the (n-1)/n factor
    assert (d1024 - 2 * 1023 * 192 - 2 * 1023 / 1024 * 1023 * 112) / \
        (d8 - 2 * 7 * 192 - 2 * 7 / 8 * 7 * 112) == pytest.approx((1023 / 1024) / (7 / 8))
    (r8, r1024) = ad.predict(c, Net(1e10, 2e-5), 0.1, workers=[8, 1024])
    assert r1024["reduce_scatter_download_bits"] == pytest.approx(d1024)
    assert r1024["allgather_download_bits"] / r8["allgather_download_bits"] == 1023 / 7


def test_reduce_scatter_picked_over_allgather_at_large_n_on_a_slow_link():
    c, net = rs_codec(), Net(bps=1e8, latency_s=2e-5)
    (small, large) = ad.predict(c, net, 0.1, workers=[2, 1024], gpus_per_node=1)
    assert small["step_s"]["sbc_allgather"] <= small["step_s"]["sbc_reduce_scatter"]
    s = large["step_s"]
    assert large["best"] == "sbc_reduce_scatter"
    assert s["sbc_reduce_scatter"] < 0.2 * s["sbc_allgather"] and s["sbc_reduce_scatter"] < s["dense"]
    assert large["reduce_scatter_decode_s"] < large["allgather_decode_s"] / 20


def test_reduce_scatter_delay_divides_it():
    c, net = rs_codec(sync_overhead_s=0.002), Net(bps=1e9, latency_s=2e-5)
    for n in (2, 64, 1024):
        one = ad.sbc_reduce_scatter_step(c, n, net)
        assert close(ad.sbc_reduce_scatter_step(c, n, net, delay=4), one.bits / 4,
                     one.seconds / 4)
    (d1,), (d4,) = (ad.predict(c, net, 0.1, workers=[256], delay=d) for d in (1, 4))
    assert d4["step_s"]["sbc_reduce_scatter"] - 0.1 == pytest.approx(
        (d1["step_s"]["sbc_reduce_scatter"] - 0.1) / 4)
    assert d4["reduce_scatter_decode_s"] == pytest.approx(d1["reduce_scatter_decode_s"] / 4)
    assert d4["reduce_scatter_download_bits"] == pytest.approx(
        d1["reduce_scatter_download_bits"] / 4)
    assert d4["step_s"]["dense"] == d1["step_s"]["dense"]


def test_predict_rows():
    c, net = codec(), Net(bps=1e9, latency_s=0.0)
    (row,) = ad.predict(c, net, compute_s=0.1, workers=[4], gpus_per_node=2)
    assert row["step_s"]["dense"] == pytest.approx(0.1 + 0.048)
    assert row["step_s"]["sbc_allgather"] == pytest.approx(0.1 + 0.016 + 192e-6)
    assert row["step_s"][row["best"]] == min(row["step_s"].values())
    assert row["sbc_pays"] == "below" and row["crossover_bps"] == pytest.approx(2.988e9)
    assert row["allgather_download_bits"] == 3 * 64_000
    assert row["allgather_decode_s"] == pytest.approx(0.006)


# -- layouts and parsing -----------------------------------------------------------------------
def test_named_layouts_have_the_models_sizes():
    r50 = ad.parse_layout("resnet50")
    assert len(r50) == 161 and sum(ad._numel(s) for _, s in r50) == 25_557_032
    gpt2 = ad.parse_layout("gpt2-small")
    assert len(gpt2) == 148 and sum(ad._numel(s) for _, s in gpt2) == 124_439_808


def test_parse_layout_forms_and_errors():
    assert ad.parse_layout("10, 3") == [("t0", (10,)), ("t1", (3,))]
    assert ad.parse_layout("test_advise:tiny_model") == [
        ("0.weight", (4, 8)), ("0.bias", (4,)), ("2.weight", (2, 4)), ("2.bias", (2,))]
    with pytest.raises(ValueError, match="resnet50"):
        ad.parse_layout("vgg")
    with pytest.raises(ValueError, match="positive"):
        ad.parse_layout("10,0")


def test_parse_units():
    assert ad.parse_bps("10gbit") == 1e10 and ad.parse_bps("100mbit") == 1e8
    assert ad.parse_bps("2.5e9") == 2.5e9
    assert ad.parse_seconds("20us") == pytest.approx(2e-5)
    assert ad.parse_seconds("0.5ms") == pytest.approx(5e-4)
    with pytest.raises(Exception, match="bandwidth"):
        ad.parse_bps("fast")


# -- measuring and the command line ------------------------------------------------------------
def test_measure_codec_accounts_real_messages():
    layout = [("a", (3000,)), ("b", (50,))]
    c = ad.measure_codec(layout, 0.01, reps=1, decode_ranks=2)
    assert c.numel == 3050 and c.tensors == 2 and c.dense_bits == 32 * 3050
    step = ad._encoder(layout, 0.01, 100)()  # the first decoded rank's message
    assert c.message_bits == 8 * step.numel() < c.dense_bits / 10
    assert c.downlink_bits > c.dense_bits  # dense fp32 values plus headers
    assert c.encode_s > 0 and c.decode_s(8) >= c.decode_s(2) > 0
    assert c.encode_per_tensor_s * c.tensors + c.encode_per_element_s * c.numel == \
        pytest.approx(c.encode_s)
    assert c.sync_overhead_s >= 0
    assert ad.measure_codec(layout, 0.01, reps=1, decode_ranks=2,
                            sync_overhead=False).sync_overhead_s == 0
    # the reduce-scatter's figures: a step message's parse and framing, the tensor headers
    # (magic 2, version, flags, b, 3 varints, value 4: 12 to 30 bytes)
    assert c.decode_per_step_s >= 0 and c.frame_per_step_s > 0
    assert 8 * 12 <= c.tensor_header_bits <= 8 * 30
    assert c.rs_down_bits == 0  # the owners at the uplink's setting: its figures
    # the owners as top-k values at 4x the density: the layout's message at that setting
    v = ad.measure_codec(layout, 0.01, reps=1, decode_ranks=2, sync_overhead=False,
                         rs_downlink=("values", 0.04))
    k = 30 + 1  # keep_count of 3,000 and 50 elements at 0.04 (at least one)
    assert 8 * 4 * k < v.rs_down_bits - v.message_bits  # float32 values at 4x the positions
    assert v.rs_down_encode_s > 0 and v.rs_down_decode_per_message_s >= 0


def test_the_sync_overhead_runs_the_drop_in_through_a_one_rank_transport(monkeypatch):
    """The drop-in's whole step is timed with the one-rank transport (its step message handed
    back, decoded and added: the shared weights move), beside the plain SGD step."""
    import horovod_sbc.torch as sbc
    seen = []
    real = sbc.DistributedOptimizer

    def spy(*a, **kw):
        opt = real(*a, **kw)
        seen.append(opt)
        return opt
    monkeypatch.setattr(sbc, "DistributedOptimizer", spy)
    layout = [("a", (3000,)), ("b", (50,))]
    assert ad._time_sync_overhead(layout, 0.01, reps=2, codec_s=0.0) > 0
    (opt,) = seen
    st = opt._sbc.stats()
    assert st["syncs"] >= 3 and st["positions_sent"] > 0 and st["upstream_bits"] > 0
    assert any(float(r.abs().sum()) > 0 for r in opt._sbc.manager.reference.values())


def test_cli_prints_the_table_and_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    assert ad.main(["--layout", "2000,30", "--workers", "2,8,1024", "--reps", "1",
                    "--bandwidth", "1gbit", "--latency", "10us", "--compute-ms", "5",
                    "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "sbc allgather" in text and "SBC allgather pays" in text
    rows = [ln.split() for ln in text.splitlines() if ln.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["2", "8", "1024"]
    res = json.loads(out.read_text())
    assert [r["workers"] for r in res["rows"]] == [2, 8, 1024]
    c = ad.CodecCost(**res["codec"])
    dense = res["rows"][1]["step_s"]["dense"]  # compute + 2 * 7/8 * 32 * 2030 bits / 1 Gbit/s
    assert dense == pytest.approx(0.005 + 2 * 7 / 8 * 32 * 2030 / 1e9 + 14 * 1e-5)
    assert res["rows"][2]["allgather_download_bits"] == 1023 * c.message_bits
    assert "sbc r-scatter" in text and "rs download" in text
    # the default owners (STC at 4x the density): their region messages are the larger
    assert c.rs_down_bits > c.message_bits and "owners: stc at 0.04" in text
    assert res["rows"][2]["reduce_scatter_download_bits"] == pytest.approx(
        1023 * (ad.reduce_scatter_region_bits(c, 1024)
                + ad.reduce_scatter_region_bits(c, 1024, down=True)))
    assert set(res["rows"][2]["step_s"]) >= {"sbc_reduce_scatter", "hierarchical_rs"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_models_owners_with_a_registered_compressor(tmp_path, capsys):
    from pathlib import Path
    user = Path(__file__).resolve().parent / "user_compressor.py"
    out = tmp_path / "a.json"
    assert ad.main(["--layout", "2000,30", "--workers", "8,1024", "--reps", "1",
                    "--register", str(user), "--downlink-mode", "stc_user",
                    "--downlink-density", "0.04", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "reduce-scatter owners: stc_user at 0.04" in text
    c = ad.CodecCost(**json.loads(out.read_text())["codec"])
    assert c.rs_down_bits > c.message_bits  # 4x the positions, a sign bit each
    with pytest.raises(ValueError, match="mode must be one of"):
        ad.main(["--layout", "2000,30", "--downlink-mode", "nope"])


def test_validation_rows_from_a_committed_benchmark_run():
    """benchmarks/validate_advise's table, recomputed from its committed JSON: every shaped
    link and method has a row per bandwidth reading, and the error is predicted / measured - 1."""
    from pathlib import Path
    from benchmarks import validate_advise as va
    saved = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" /
                        "advise_validation_2ranks.json").read_text())
    res = saved["bench_net"]
    c = ad.CodecCost(**res["codec"])
    rows = va.predictions(res, c, saved["args"]["latency"], "one_way")
    assert {(r["network"], r["method"]) for r in rows} == {
        (n, m) for n in ("1gbit", "100mbit") for m in ("none", "sbc p=0.01")}
    local = next(r for r in res["runs"] if r["method"] == "local")["step_time_s"]
    for r in rows:
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        if r["method"] == "none":  # compute + 2(N-1)/N * 32 * numel / B + 2(N-1) L at N=2
            bps = r["link_mbit"] * 1e6
            assert r["predicted_s"] == pytest.approx(local + 32 * c.numel / bps
                                                     + 2 * saved["args"]["latency"])
