"""The GPU-proxy benchmark (benchmarks/bench_gpu_proxy.py): what it counts, and that it runs."""
import json
import os
import subprocess
import sys

import numpy as np
import torch

from harness import ROOT
from benchmarks import bench_gpu_proxy as gp


def test_layouts_match_the_models():
    r50 = gp.resnet50_layout()
    assert len(r50) == 161
    assert sum(gp._numel(s) for _, s in r50) == 25_557_032  # torchvision resnet50
    gpt2 = gp.gpt2_layout()
    assert len(gpt2) == 148
    assert sum(gp._numel(s) for _, s in gpt2) == 124_439_808  # GPT-2 small, tied LM head
    assert len({n for n, _ in r50}) == 161 and len({n for n, _ in gpt2}) == 148


def test_counter_sees_every_kind_of_host_read():
    x = torch.arange(10.0)
    with gp.counting() as c:
        y = x * 2 + 1  # two ops, no read
    assert c.ops == 2 and c.snapshot()["reads"] == 0
    cases = {"item": lambda: x.sum().item(), "bool": lambda: bool(x[0] > 0),
             "int": lambda: int(x[3]), "tolist": lambda: x.tolist(),
             "numpy": lambda: x.numpy(), "nonzero": lambda: torch.nonzero(x > 4),
             "index[bool]": lambda: x[x > 4], "masked_select": lambda: x.masked_select(x > 4)}
    for kind, fn in cases.items():
        with gp.counting() as c:
            fn()
        assert c.reads == {kind: 1}, (kind, dict(c.reads))
    with gp.counting() as c:
        torch.tensor([1.0, 2.0])
        torch.frombuffer(bytearray(4), dtype=torch.uint8)
    assert c.uploads == 2 and c.snapshot()["syncs"] == 2
    assert torch.Tensor.item is not None and x.tolist() == list(range(10))  # wraps removed
    del y


def test_ddp_buckets_follow_ddp_defaults():
    named = [(f"p{i}", torch.zeros(n)) for i, n in enumerate([10, 300_000, 10, 7_000_000, 5])]
    # reverse order; the first bucket closes at 1 MiB, the others at 25 MiB
    assert gp.ddp_buckets(named) == [[4, 3], [2, 1, 0]]


def test_one_small_cell_per_path_writes_every_key(tmp_path):
    out = tmp_path / "gp.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench", "gpu-proxy",
                        "--layouts", "synthetic6", "--ranks", "2", "--densities", "0.01",
                        "--steps", "2", "--warmup", "0", "--json", str(out)],
                       cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res) >= {"cells", "settings", "command", "torch"}
    assert [c["path"] for c in res["cells"]] == list(gp.PATHS)
    for c in res["cells"]:
        for key in gp.COLUMNS + ("reads_by_kind", "per_step", "wall_s", "steps"):
            assert key in c, (c["path"], key)
        assert c["tensors"] == 6 and c["ranks"] == 2 and c["density"] == 0.01
        assert c["ops"] > 0 and c["reads"] > 0 and c["collectives"] > 0, c
        assert c["syncs"] == c["reads"] + c["uploads"] and c["async_uploads"] > 0
        assert len(c["per_step"]) == 2
    assert "| synthetic6 | stock |" in (tmp_path / "gp.md").read_text()


def _counts(path: str, n_tensors: int, ranks: int = 2):
    shapes = gp.synthetic_layout(n_tensors, 1000)  # 100 of them still fit DDP's first bucket
    return gp.run_cell(f"synthetic{n_tensors}", shapes, path, ranks, 0.01, gp.Noise(shapes),
                       steps=1, warmup=1)


def test_host_syncs_per_step_do_not_grow_with_the_number_of_tensors():
    # issue 25's target: at most 4 device synchronisations per sync step, whatever the number
    # of tensors; the DDP hook with fixed_size=False adds one, the read of the gathered lengths
    for path, syncs in (("dropin", 4), ("dropin-fixed", 4), ("stock-fixed", 4), ("ddp", 4),
                        ("ddp-variable", 5), ("dropin-shared", 4)):
        few, many = _counts(path, 10), _counts(path, 100)
        assert few["syncs"] == many["syncs"] <= syncs, (path, few["reads_by_kind"],
                                                        many["reads_by_kind"], many["uploads"])
        assert many["uploads"] == 0, (path, many["uploads"])  # every upload is asynchronous
        assert few["async_uploads"] == many["async_uploads"] <= 4, (path, few["async_uploads"],
                                                                    many["async_uploads"])
        # kernel launches too (only view ops, which launch nothing, grow with the tensors),
        # except in the stock hook, which Horovod calls once per tensor
        if not path.startswith("stock"):
            assert many["kernels"] == few["kernels"], (path, few["kernels"], many["kernels"])
        assert _counts(path, 100, ranks=8)["syncs"] == many["syncs"]


def test_the_reduce_scatter_syncs_a_fixed_number_of_times_whatever_the_tensors_and_ranks():
    # 8: the uplink encoder's two reads; the owner's parse of the parts and its verdict; the
    # owner's encoder's two; the parse of the region messages and their verdict. The parts are
    # framed on the device from the encoding (a ninth read before: the step's bytes re-framed
    # on the host and uploaded again)
    for path in ("dropin-rs", "stock-rs"):
        few, many = _counts(path, 10), _counts(path, 100)
        assert few["syncs"] == many["syncs"] == _counts(path, 100, ranks=8)["syncs"] == 8, (
            path, few["reads_by_kind"], many["reads_by_kind"])
        assert many["uploads"] == 0, (path, many["uploads"])
        # the encoder's, the parts' headers with their CRCs' plan, the owner's encoder's...
        assert few["async_uploads"] == many["async_uploads"] <= (9 if path == "dropin-rs"
                                                                 else 8), (path, many)


def test_the_reduce_scatter_never_frames_the_whole_step(monkeypatch):
    # its parts are framed from the encoding: the whole sync's step message (its CRC over the
    # whole body) would be work for nothing. Frames are counted by the tensors they hold: the
    # owners frame their region messages (part of the pieces), the allgather every tensor
    from horovod_sbc.torch.backend import ops
    from horovod_sbc.torch.sync import scatter
    framed = []
    real = ops.FusedSync.frame
    monkeypatch.setattr(ops.FusedSync, "frame",
                        lambda self, *a, **k: framed.append(len(self.targets))
                        or real(self, *a, **k))
    shapes = gp.synthetic_layout(10, 1000)
    pieces = len(scatter.plan(tuple((n, tuple(s)) for n, s in shapes), 2).pieces)
    for path in ("dropin-rs", "stock-rs", "dropin", "stock"):
        framed.clear()
        _counts(path, 10)  # one step after one warm-up step, one rank encoding
        if path.endswith("-rs"):
            assert len(framed) == 4 and max(framed) < pieces, (path, framed, pieces)
        else:
            assert framed == [10] * 2, (path, framed)


def test_uploads_keep_bytes_arrays_and_dtypes():
    from horovod_sbc.torch.backend.transfer import upload
    assert upload(b"\x01\xff", "cpu").tolist() == [1, 255]
    assert upload(b"", "cpu").dtype == torch.uint8 and upload(b"", "cpu").numel() == 0
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    t = upload(a, "cpu")
    assert t.dtype == torch.int64 and t.shape == (2, 3) and t.tolist() == a.tolist()
    raw = bytearray(b"abc")
    t = upload(raw, "cpu")
    raw[0] = 0  # the tensor holds its own copy of bytes
    assert t.tolist() == list(b"abc")
