"""The GPU check (benchmarks/bench_gpu.py) on the CPU, that its comparisons catch a corrupted
message, and the synthetic benchmark (examples/pytorch_synthetic_benchmark.py) on 2 ranks."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from harness import ROOT, run_ranks
from benchmarks import bench_gpu as bg

TOP = {"device", "device_name", "torch", "numpy", "quick", "backend", "layouts", "summary",
       "correctness", "host_syncs", "kernels_per_sync", "speed", "fwd_bwd", "memory",
       "failures", "ok", "wall_s", "command"}
SUMMARY = {"encode_bytes_equal", "decode_ranks_equal", "mutation_verdicts_equal",
           "tensor_kinds_equal", "dropin_step_equal", "regions_parts_equal",
           "host_syncs_dropin", "host_syncs_stock", "host_syncs_dropin_rs", "host_syncs_stock_rs",
           "kernels_dropin", "encode_ms_p01", "encode_ms_p05", "decode_ms_8", "decode_ms_64",
           "sync_ms", "fwd_bwd_ms", "sync_over_fwd_bwd", "memory_syncs",
           "memory_max_allocated", "memory_flat"}


def test_gpu_check_on_the_cpu_agrees_and_writes_every_field(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench", "gpu", "--device", "cpu",
                        "--quick", "--json", str(out)], cwd=str(ROOT), env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    assert "all checks agree" in p.stdout
    res = json.loads(out.read_text())
    assert TOP <= set(res), TOP - set(res)
    assert set(bg.SUMMARY_KEYS) == SUMMARY <= set(res["summary"])
    s = res["summary"]
    assert res["device"] == "cpu" and res["ok"] and res["failures"] == []
    for key in ("encode_bytes_equal", "decode_ranks_equal", "mutation_verdicts_equal",
                "tensor_kinds_equal", "dropin_step_equal", "regions_parts_equal"):
        assert s[key] is True, key
    for key in ("encode_ms_p01", "encode_ms_p05", "decode_ms_8", "decode_ms_64", "sync_ms",
                "fwd_bwd_ms", "sync_over_fwd_bwd"):
        assert s[key] > 0, key
    # the CPU proxy's count: a handful of host syncs per sync step, whatever the layout
    assert 0 < s["host_syncs_dropin"] <= 8 and 0 < s["host_syncs_stock"] <= 8, s
    assert s["host_syncs_dropin_rs"] == s["host_syncs_stock_rs"] == 8, s  # two rounds of 4
    assert [r["regions"] for r in res["correctness"]["regions"]] == [8, 8]
    assert s["kernels_dropin"] is None and s["memory_max_allocated"] is None
    assert s["memory_flat"] is None and res["memory"]["flat"] is None
    corr = res["correctness"]
    assert {(r["mode"], r["density"]) for r in corr["encode"]} == \
        {("sbc", d) for d in bg.DENSITIES} | {("stc", bg.STC_DENSITY)}
    assert len(corr["encode"]) == 2 * (len(bg.DENSITIES) + 1)
    assert all(r["ok"] for r in corr["encode"])
    assert all(r["ranks"] == 8 and r["ok"] for r in corr["decode_ranks"])
    verdicts = {r["reference"] for r in corr["mutations"]}
    assert "ok" in verdicts and "invalid" in verdicts and len(corr["mutations"]) >= 15
    assert {r["case"] for r in corr["tensor_kinds"]} == {"float16", "bfloat16",
                                                         "non_contiguous", "channels_last"}
    assert "tiny conv net" in res["fwd_bwd"]["model"] and res["fwd_bwd"]["batch"] == 8
    for name, sp in res["speed"]["layouts"].items():
        assert set(sp["encode_ms"]) == {"0.01", "0.05"} and set(sp["decode_ms"]) == {"8", "64"}


def test_the_comparisons_report_a_corrupted_message():
    from horovod_sbc import kernels
    from horovod_sbc.torch.backend import OpsBackend
    layout = bg.layouts("cpu")["resnet50-small"][:4]
    ups = bg.host_updates(layout, 1)
    with kernels.disabled():
        backend = OpsBackend()
        ref, ref_res = bg.reference_step(layout, ups, 0.01)
        step, res = bg.device_step(backend, layout, ups, 0.01, "cpu")
        got = bg._bytes(step)
        assert bg.diff_bytes(ref, got) is None
        assert bg.diff_arrays(ref_res, [r.numpy() for r in res]) is None
        bad = bytearray(got)
        bad[len(bad) // 2] ^= 0x04  # one bit of the body
        assert "first difference at byte" in bg.diff_bytes(ref, bytes(bad))
        assert bg.diff_bytes(ref, got[:-1]) is not None  # truncated
        # a decoded value off by one ulp is a disagreement
        off = [r.numpy().copy() for r in res]
        off[1][3] = np.nextafter(off[1][3], np.float32(np.inf))
        assert bg.diff_arrays(ref_res, off) is not None
        # the verdicts: a device that accepts what the reference rejects disagrees
        ref_v = bg.reference_decode(bytes(bad), layout, 1, 1.0)
        assert ref_v[0] == "invalid"
        assert bg.diff_outcomes(ref_v, bg.reference_decode(ref, layout, 1, 1.0)) is not None
        assert bg.compare_decode(backend, bytes(bad), layout, 1, "cpu", 1.0) is None
        assert bg.compare_decode(backend, ref, layout, 1, "cpu", 1.0) is None
        # a device decoder one ulp off, or one that accepts a corrupted step, is caught
        class OneUlpOff(OpsBackend):
            def decode(self, *a, **kw):
                outs = super().decode(*a, **kw)
                first = outs[0][:1]
                first.copy_(torch.nextafter(first, torch.full_like(first, float("inf"))))
                return outs

        class AcceptsAll(OpsBackend):
            def decode(self, gathered, layout, n_ranks, targets, scale=1.0):
                return tuple(t.zero_() for t in targets.outs)
        assert "tensor 0 element 0" in bg.compare_decode(OneUlpOff(), ref, layout, 1, "cpu", 1.0)
        assert "device ok" in bg.compare_decode(AcceptsAll(), bytes(bad), layout, 1, "cpu", 1.0)
        # another rank's message corrupted under a recomputed CRC: both decoders see it
        for name, data in bg.mutations([got, got], layout):
            assert bg.compare_decode(backend, data, layout, 2, "cpu") is None, name


_IMG = re.compile(r"Img/sec per CPU: ([0-9.]+) \+-([0-9.]+)")
_TOTAL = re.compile(r"Total img/sec on 2 CPU\(s\): ([0-9.]+) \+-([0-9.]+)")


# under mpirun: Horovod's MPI controller, what `horovodrun --mpi` starts, without horovodrun's
# start-up check (tens of seconds on a loaded 2-core machine; test_harness.py covers horovodrun)
@pytest.mark.multirank
@pytest.mark.parametrize("compression", ["sbc", "none"])
def test_synthetic_benchmark_on_two_ranks(compression):
    script = str(ROOT / "examples" / "pytorch_synthetic_benchmark.py")
    args = ["--model", "small", "--image-size", "32", "--batch-size", "4", "--num-iters", "2",
            "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-classes", "10",
            "--compression", compression, "--no-cuda"]
    _, out = run_ranks(script, 2, args, timeout=150, raw=True)
    assert len(re.findall(r"Iter #\d+: [0-9.]+ img/sec per CPU", out)) == 2, out[-3000:]
    per, total = _IMG.search(out), _TOTAL.search(out)
    assert per and total, out[-3000:]
    assert float(per.group(1)) > 0
    assert abs(float(total.group(1)) - 2 * float(per.group(1))) <= 0.2
    if compression == "sbc":
        assert "SBC p=0.01 delay=1 (stock hook)" in out and "compression ratio" in out, out
    else:
        assert "dense allreduce" in out
