"""Benchmarks (python -m benchmarks.bench): quick training run, network testbed, analysis math."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from harness import ROOT
from benchmarks import bench_net as bn
from benchmarks import bench_train as bt

needs_root_net = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the network testbed needs root and iproute2 (ip, tc)")


def _bench(args, timeout):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench", *args], cwd=str(ROOT), env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return p.stdout


# -- pure functions ---------------------------------------------------------------------------
def test_parse_bandwidth_uses_tc_units():
    assert bn.parse_bandwidth("100mbit") == 1e8
    assert bn.parse_bandwidth("1gbit") == 1e9
    assert bn.parse_bandwidth("10Mbit") == 1e7
    assert bn.parse_bandwidth("500kbit") == 5e5
    assert bn.parse_bandwidth("2.5gbit") == 2.5e9
    assert bn.parse_bandwidth("loopback") is None
    for bad in ("fast", "-1mbit", "10 parsecs", "0mbit"):
        with pytest.raises(ValueError):
            bn.parse_bandwidth(bad)


def test_crossover_and_fit():
    # dense: 10 ms + 8e6 bits/B; sbc: 30 ms + 8e3 bits/B -> equal at (8e6 - 8e3) / 0.02
    b = bn.crossover_bps(0.010, 8e6, 0.030, 8e3)
    assert b == pytest.approx((8e6 - 8e3) / 0.02)
    assert bn.crossover_bps(0.010, 8e6, 0.005, 8e3) == math.inf  # cheaper even at loopback
    assert bn.crossover_bps(0.010, 8e6, 0.030, 9e6) is None      # more bits and slower
    pts = [(1e7, 0.5 + 4e6 / 1e7), (1e8, 0.5 + 4e6 / 1e8), (1e9, 0.5 + 4e6 / 1e9)]
    a, c = bn.fit_line(pts)
    assert a == pytest.approx(0.5) and c == pytest.approx(4e6)
    assert bn.fit_line(pts[:1]) is None
    assert bn.net_order(["10mbit", "1gbit", "100mbit"], True, True) == \
        ["loopback", "unlimited", "1gbit", "100mbit", "10mbit"]


def test_analyse_reports_crossover_from_measurements():
    runs = []
    for net, bps, eff in (("loopback", None, None), ("unlimited", None, 1.5e10),
                          ("1gbit", 1e9, 1e9), ("100mbit", 1e8, 1e8), ("10mbit", 1e7, 1e7)):
        for lab, a, bits in (("none", 0.10, 3.2e8), ("sbc p=0.001", 0.16, 2e5)):
            t = a + (bits / eff if eff else 0.0)
            runs.append({"label": lab, "method": lab.split()[0], "network": net,
                         "bandwidth_bps": bps, "effective_bps": eff, "step_time_s": t,
                         "wire_bits_per_step": bits})
    res = bn.analyse(runs)
    cx = res["sbc p=0.001"]
    want = (3.2e8 - 2e5) / 0.06  # bits saved / extra cost per step
    assert cx["from_loopback_bps"] == pytest.approx(want)
    assert cx["from_fast_link_bps"] == pytest.approx(want)
    assert cx["from_fit_bps"] == pytest.approx(want, rel=1e-6)
    assert cx["step_time_over_dense"]["10mbit"] < 1 < cx["step_time_over_dense"]["loopback"]
    assert res["none"]["effective_rate_over_nominal"]["100mbit"] == pytest.approx(1.0)


def test_partitions_give_every_rank_the_same_number_of_steps():
    import torch
    y = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9] * 7 + [0, 2, 4])
    x = torch.arange(len(y)).float()[:, None]
    for size in (2, 3, 4):
        seen = []
        for r in range(size):
            xs, ys, n = bt.shard(x, y, r, size, "by_class")
            assert set((ys % size).tolist()) == {r}       # label skew: own classes only
            assert len(ys) >= n
            seen += xs[:, 0].tolist()
            xi, yi, ni = bt.shard(x, y, r, size, "iid")
            assert len(yi) >= ni == len(y) // size
        assert sorted(seen) == x[:, 0].tolist()            # a partition of the data
    with pytest.raises(ValueError):
        bt.shard(x, y, 0, 2, "dirichlet")
    assert bt.label(dict(method="sbc", density=0.01, delay=4, workers=2,
                         partition="by_class")) == "sbc p=0.01 n=4 non-iid"


def test_codec_subcommand_still_works(tmp_path):
    from benchmarks import bench
    out = tmp_path / "codec.json"
    assert bench.main(["codec", "--n", "200000", "--n-positions", "200000", "--reps", "1",
                       "--skip-numpy", "--skip-tf", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["codec"]["bits_per_position_over_entropy"] < 1.05
    assert res["command"].startswith("python -m benchmarks.bench codec")


def _live_pids_with(token):
    """Pids of live (non-zombie) processes whose command line holds ``token``."""
    found = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and token in open(f"/proc/{d}/cmdline").read() and \
                    open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(d))
        except OSError:
            pass
    return found


@pytest.mark.multirank
@pytest.mark.waits
def test_a_job_past_its_timeout_is_ended_with_all_its_ranks():
    token = f"sbc-timeout-test-{os.getpid()}-{time.time_ns()}"
    cmd = bt.launcher_prefix(2, "mpirun", bt.ENV_NAMES) + [
        sys.executable, "-c", "import os, time; print('@@progress {\"pid\": %d}' % os.getpid(), "
        "flush=True); time.sleep(120)", token]
    # both ranks report within a second on an idle machine, but mpirun has taken over 25 s to
    # start them on the loaded 2-core machine: when they had not both started before a deadline,
    # try again with a longer one
    for timeout in (10, 30, 90):
        pids = []
        t0 = time.perf_counter()
        with pytest.raises(bt.JobError, match="did not finish"):
            bt.run_job(cmd, bt.job_env(), timeout=timeout,
                       on_progress=lambda p: pids.append(p["pid"]))
        assert time.perf_counter() - t0 < timeout + 30  # killing the job does not hang
        time.sleep(0.5)
        assert not _live_pids_with(token), "a rank outlived its job's timeout"
        if len(pids) == 2:
            break
    assert len(pids) == 2, pids  # both ranks had started, so the check above saw them die


# -- the training benchmark, for real (3 mpirun jobs) ---------------------------------------------
@pytest.mark.multirank
def test_train_quick_runs_real_jobs_and_shows_the_headline(tmp_path):
    out = tmp_path / "train.json"
    t0 = time.perf_counter()
    text = _bench(["train", "--quick", "--no-progress", "--json", str(out)], timeout=300)
    wall = time.perf_counter() - t0
    assert "training benchmark" in text and "ratio" in text  # the table was printed
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert not res["skipped"], res["skipped"]
    keys = {"method", "density", "delay", "workers", "final_accuracy", "upstream_bits",
            "downstream_bits", "dense_bits", "step_time_s", "compression_ratio", "command"}
    for r in runs:
        assert keys <= set(r), keys - set(r)
        assert 0.0 <= r["final_accuracy"] <= 1.0
        assert r["step_time_s"] > 0 and r["workers"] == 2
        assert r["ranks_identical"], r["label"]  # every rank ends on the same weights
        assert r["dense_bits"] == 32 * r["params"] * r["steps"]
    by = {r["method"]: r for r in runs}
    assert set(by) >= {"none", "sbc", "topk"}
    none, sbc, topk = by["none"], by["sbc"], by["topk"]
    assert none["compression_ratio"] == 1
    assert none["upstream_bits"] == none["dense_bits"]
    assert (sbc["density"], sbc["delay"]) == (bt.HEADLINE["density"], bt.HEADLINE["delay"])
    assert sbc["compression_ratio"] > 1000
    assert sbc["compression_ratio"] > 3 * topk["compression_ratio"]  # one mean vs fp32 values
    assert none["final_accuracy"] > 0.9
    assert sbc["final_accuracy"] >= none["final_accuracy"] - 0.03  # ~ baseline accuracy
    assert res["summary"]["headline"]["compression_ratio"] == sbc["compression_ratio"]
    assert (tmp_path / "accuracy_vs_bits.png").stat().st_size > 10_000
    assert "| none |" in (tmp_path / "train.md").read_text()
    print(f"train --quick: {wall:.0f} s")


# -- the network testbed ------------------------------------------------------------------------
def _root_addrs():
    return subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout


@needs_root_net
def test_testbed_lives_only_in_its_namespaces_and_teardown_is_idempotent():
    tb = bn.Testbed(2, tag=f"sbcnet{os.getpid()}")
    before = _root_addrs()
    try:
        tb.setup()
        assert set(tb.namespaces()) <= set(bn.list_netns())
        assert "10.231." not in _root_addrs() and _root_addrs() == before  # host untouched
        tb.set_rate(1e8)
        tb.set_rate(None)
    finally:
        tb.teardown()
    tb.teardown()  # second call: nothing left, no error
    assert not set(tb.namespaces()) & set(bn.list_netns())
    assert _root_addrs() == before


@needs_root_net
def test_a_two_level_testbed_puts_each_nodes_ranks_in_one_namespace():
    """4 ranks as 2 nodes of 2: two rank namespaces, mpirun starts 2 ranks in each (consecutive
    ranks share a node, as the hierarchy's groups [[0, 1], [2, 3]]), the shaped link joins the
    nodes; a node size that does not divide the ranks is refused."""
    with pytest.raises(ValueError, match="ranks_per_node=3 must divide workers=4"):
        bn.Testbed(4, ranks_per_node=3)
    tb = bn.Testbed(4, tag=f"sbcnet2l{os.getpid()}", ranks_per_node=2)
    try:
        tb.setup()
        assert len(tb.ranks) == 2 and len(tb.addrs) == 2
        assert set(tb.namespaces()) <= set(bn.list_netns())
        cmd = tb.mpirun_cmd(["python", "-c", "pass"])
        starts = [i for i, a in enumerate(cmd) if a == "-np"]
        assert [cmd[i + 1] for i in starts] == ["2", "2"]
        assert [cmd[i + 5] for i in starts] == tb.ranks  # -np 2 ip netns exec NS
        tb.set_rate(1e8)
        assert 60 < tb.measure_link(0.3) < 110  # node 0 -> node 1 crosses the shaped link
    finally:
        tb.teardown()
    assert not set(tb.namespaces()) & set(bn.list_netns())


_HOLD = """
import sys, time
from benchmarks.bench_net import Testbed
tb = Testbed(2).setup()
print(" ".join(tb.namespaces()), flush=True)
time.sleep(120)
"""


@needs_root_net
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_testbed_is_removed_when_the_benchmark_is_signalled(sig):
    p = subprocess.Popen([sys.executable, "-c", _HOLD], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        names = p.stdout.readline().split()
        assert len(names) == 3 and set(names) <= set(bn.list_netns())
        p.send_signal(sig)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not set(names) & set(bn.list_netns())


@needs_root_net
def test_namespaces_of_a_killed_run_are_removed_at_the_next_start():
    p = subprocess.Popen([sys.executable, "-c", _HOLD], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    names = p.stdout.readline().split()
    p.kill()  # SIGKILL: no handler can run
    p.wait()
    assert set(names) <= set(bn.list_netns())
    removed = bn.remove_stale()
    assert set(names) <= set(removed)
    assert not set(names) & set(bn.list_netns())


@needs_root_net
@pytest.mark.multirank
def test_net_quick_measures_a_shaped_link(tmp_path):
    out = tmp_path / "net.json"
    _bench(["net", "--quick", "--no-unlimited", "--no-progress", "--json", str(out)], timeout=300)
    res = json.loads(out.read_text())
    assert not res["errors"], res["errors"]
    shaped = next(n for n in res["networks"] if n["network"] == "100mbit")
    assert 60 < shaped["link_measured_mbit"] < 110  # tc really limits the veths
    cell = {(r["method"], r["network"]): r for r in res["runs"]}
    none, sbc = cell[("none", "100mbit")], cell[("sbc", "100mbit")]
    assert none["params"] > 2_000_000
    # dense moves ~67 Mbit per step through a 100 Mbit/s link: at least 0.6 s per step
    assert none["step_time_s"] > 0.6 * none["wire_bits_per_step"] / 1e8
    assert sbc["wire_bits_per_step"] * 100 < none["wire_bits_per_step"]
    assert sbc["step_time_s"] < none["step_time_s"]
    assert ("local", "loopback") in cell  # compute-only reference
    assert not [ns for ns in bn.list_netns() if ns in res.get("namespaces", [])]
    assert (tmp_path / "step_time_vs_bandwidth.png").stat().st_size > 10_000


def test_steptime_takes_turns_and_reports_every_method(tmp_path):
    """``bench steptime`` steps the methods in turns (rounds x block steps each) on real
    2-rank jobs and reports every method's median step and its ratio to dense allreduce."""
    out = tmp_path / "steptime.json"
    _bench(["steptime", "--sizes", "64,128,32,10", "--rounds", "3", "--block", "2",
            "--no-progress", "--json", str(out)], timeout=300)
    res = json.loads(out.read_text())
    assert not res["errors"], res["errors"]
    assert res["config"]["interleave"] == {"rounds": 3, "block": 2}
    runs = {r["label"]: r for r in res["runs"]}
    assert set(runs) == {bn.method_label(m) for m in bn.STEP_METHODS}
    assert all(r["steps"] == 6 for r in runs.values())
    assert res["ratios"]["none"] == 1.0 and all(v > 0 for v in res["ratios"].values())
    sbc = runs["sbc p=0.01"]
    assert 0 < sbc["upstream_bits_per_step"] < sbc["dense_bits_per_step"] / 10
    md = out.with_suffix(".md").read_text()  # the table docs/benchmarks.md quotes
    for label, r in runs.items():
        assert f"| {label} | {1000 * r['step_time_s']:.1f} ms | " \
               f"{res['ratios'][label]:.2f}x |" in md


# -- cluster examples ------------------------------------------------------------------------------
def test_cluster_examples_are_well_formed():
    sbatch = ROOT / "examples" / "slurm" / "sbc_job.sbatch"
    subprocess.run(["bash", "-n", str(sbatch)], check=True)
    text = sbatch.read_text()
    assert "#SBATCH --ntasks-per-node=4" in text and "#SBATCH --gpus-per-node=4" in text
    hosts = [line.split() for line in (ROOT / "examples" / "hostfile").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert hosts and all(len(h) == 2 and h[1].startswith("slots=") for h in hosts)
