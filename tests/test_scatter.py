"""SBC(topology="reduce_scatter") (horovod_sbc/torch/sync/scatter.py) on real 3- and 4-rank jobs
(tests/workers/torch_scatter.py; the 3-rank one with the C kernels off, so through the
tensor-op codec CUDA tensors take), and its region plan in this process."""
import dataclasses
import tempfile

import pytest
import torch

from harness import SharedJob, run_ranks
from horovod_sbc import wire
from horovod_sbc.config import SBCConfig
from horovod_sbc.torch.sync import scatter

CKPT = tempfile.mkdtemp(prefix="sbc-rs-ckpt-")
TRAIN = {(api, delay, lr): ["train", f"api={api}", f"delay={delay}", f"local_residual={lr}"]
         for api, delay, lr in (("stock", 1, 0), ("dropin", 1, 0), ("dropin", 2, 1))}
THREE = SharedJob("torch_scatter.py", 3, {
    **TRAIN, "allgather": ["train", "api=dropin", "topology=allgather"],
    "values": ["train", "api=dropin", "mode=values"], "equiv": ["equiv"], "nan": ["nan"],
    "binarized": ["train", "api=stock", "downlink_mode=sbc", "downlink_density=0.1"]},
    timeout=300, env={"HOROVOD_SBC_KERNELS": "0"})  # the tensor-op codec CUDA tensors take
FOUR = SharedJob("torch_scatter.py", 4, {
    **TRAIN, "allgather": ["train", "api=dropin", "topology=allgather"],
    "hier": ["train", "api=dropin", "hier=1", "delay=2"],
    "save": ["save", f"ckpt={CKPT}"]}, timeout=300)
LOAD = SharedJob("torch_scatter.py", 4, {"load": ["load", f"ckpt={CKPT}"]}, after=[FOUR],
                 timeout=200)
JOBS = {3: THREE, 4: FOUR}


# -- the plan, in this process -------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 64])
def test_plan_tiles_the_layout_and_balances_elements_plus_pieces(size):
    layout = (("a", (20, 256)), ("b", (256,)), ("empty", (0,)), ("c", (5, 256)), ("d", (5,)))
    p = scatter.Plan(layout, size)
    # the pieces tile every tensor in order, without gaps or overlaps
    for t, (name, shape) in enumerate(layout):
        mine = [pc for pc in p.pieces if pc.tensor == t]
        assert mine[0].start == 0 and mine[-1].stop == wire.layout_numel(shape)
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:]))
        if len(mine) == 1:  # a whole tensor keeps its name and shape
            assert (mine[0].name, mine[0].shape) == (name, shape)
    assert len(p.pieces) <= len(layout) + size - 1
    assert sum(len(lay) for lay in p.regions) == len(p.pieces)
    # no region's cost (elements + c per piece) exceeds the mean by more than one piece start
    total = 5120 + 256 + 1280 + 5
    c = total // (2 * (len(layout) + size - 1)) if size > 1 else 0
    costs = [sum(wire.layout_numel(s) + c for _, s in lay) for lay in p.regions]
    assert max(costs) <= sum(costs) / size + c + 1, costs


def test_a_region_of_many_small_tensors_gets_fewer_elements():
    layout = [(f"bias{i:02d}", (64,)) for i in range(40)] + [("w", (40_000,))]
    p = scatter.Plan(tuple(layout), 4)
    elements = [sum(wire.layout_numel(s) for _, s in lay) for lay in p.regions]
    assert len(p.regions[0]) > 20 and elements[0] < min(elements[1:]), elements


def test_plan_views_write_through_to_the_tensors():
    p = scatter.Plan((("a", (10,)), ("b", (3, 2))), 4)
    outs = [torch.zeros(10), torch.zeros(6)]
    for i, v in enumerate(p.split(outs)):
        v.fill_(i + 1)
    for i, pc in enumerate(p.pieces):
        assert outs[pc.tensor][pc.start:pc.stop].tolist() == [i + 1] * (pc.stop - pc.start)
    assert len(p.pieces) > 2 and all(bool((o > 0).all()) for o in outs)


@pytest.mark.parametrize("size", [1, 3, 4, 9])
@pytest.mark.parametrize("codec", ["tensor-op", "kernels"])
def test_parts_framed_on_the_device_are_the_host_reframing_byte_for_byte(size, codec):
    """The parts framed from the whole sync's encoding (the tensor-op codec's: no host read;
    the C kernels': the encoded body cut on the host, no message parsed) are the bytes the
    host re-framing of the step message gives."""
    from horovod_sbc import kernels
    from horovod_sbc.torch.backend.base import Accumulate
    from horovod_sbc.torch.backend.ckernels import KernelBackend, KernelSync
    from horovod_sbc.torch.backend.ops import OpsBackend
    if codec == "kernels" and not kernels.available():
        pytest.skip("no C kernels")
    layout = (("w", (60, 50)), ("b", (7,)), ("c", (3, 3, 4, 4)), ("e", (1,)), ("z", (900,)))
    p = scatter.Plan(layout, size)
    g = torch.Generator().manual_seed(size)
    flats = [torch.randn(wire.layout_numel(s), generator=g) for _, s in layout]
    flats[-1].zero_()  # a piece with nothing to send
    srcs = [Accumulate(f[pc.start:pc.stop], torch.zeros(pc.stop - pc.start))
            for pc in p.pieces for f in (flats[pc.tensor],)]
    fp = wire.layout_fingerprint(p.layout)
    backend = OpsBackend() if codec == "tensor-op" else KernelBackend()
    whole = backend.encode_many(srcs, 0.05, "sbc", "paper", [n for n, _ in p.layout], fp)
    assert isinstance(whole, KernelSync) == (codec == "kernels")
    step = whole.frame(fp)
    host, splits = scatter.region_parts(step, p, 0)
    dev, dev_splits = scatter.region_parts(step, p, 0, whole)
    assert dev_splits == splits and sum(splits) == dev.numel()
    assert dev.numpy().tobytes() == host.numpy().tobytes()


def test_config_says_what_the_topology_takes():
    cfg = SBCConfig(density=0.02, topology="reduce_scatter")
    assert cfg.downlink_fraction == 0.08 and cfg.downlink_compressor == "stc"  # 4x, ternary
    # a copy with another density (the density warm-up) re-validates, and follows it
    warm = dataclasses.replace(cfg, density=0.1)
    assert warm.downlink_fraction == 0.4 and warm.downlink_density is None
    assert dataclasses.replace(cfg, density=0.5).downlink_fraction == 1.0  # at most every one
    assert dataclasses.replace(cfg, downlink_density=0.02).downlink_fraction == 0.02
    assert dataclasses.replace(SBCConfig(), density=0.1).downlink_compressor == "values"
    assert SBCConfig(topology="server").downlink_fraction is None  # dense
    assert SBCConfig(topology="reduce_scatter", mode="values").downlink_compressor == "values"
    assert SBCConfig(topology="server").downlink_compressor == "values"
    assert SBCConfig(topology="server", downlink_mode="sbc").downlink_compressor == "sbc"
    for knob in ("downlink_binarize", "downlink_mode"):
        with pytest.raises(ValueError, match=f"{knob} applies to topology='server' or"):
            SBCConfig(**{knob: True if knob == "downlink_binarize" else "sbc"})
    with pytest.raises(ValueError, match=r"mode must be one of \('sbc', 'values'.*got 'tern'"):
        SBCConfig(topology="reduce_scatter", downlink_mode="tern")
    # the older spelling still works, says what replaces it, and is not said twice
    for binarize, mode in ((True, "sbc"), (False, "values")):
        with pytest.warns(DeprecationWarning, match=f"use downlink_mode='{mode}'"):
            old = SBCConfig(topology="reduce_scatter", mode="values", downlink_binarize=binarize)
        assert old.downlink_compressor == mode and old.downlink_binarize is None
    with pytest.raises(ValueError, match="give downlink_mode='sbc' alone"):
        SBCConfig(topology="server", downlink_mode="sbc", downlink_binarize=True)
    with pytest.raises(ValueError, match="fixed_size applies to topology='allgather'"):
        SBCConfig(topology="reduce_scatter", fixed_size=True)
    with pytest.raises(ValueError, match="topology must be one of"):
        SBCConfig(topology="ring")


# -- real jobs ---------------------------------------------------------------------------------
@pytest.mark.multirank
@pytest.mark.parametrize("np_", [3, 4])
@pytest.mark.parametrize("key", list(TRAIN))
def test_shared_weights_identical_on_every_rank_and_moving(np_, key):
    res = JOBS[np_][key]
    steps = len(res[0]["digests"]) - 1
    for s in range(steps + 1):
        assert len({r["digests"][s] for r in res}) == 1, f"ranks differ after step {s}"
    delay = int(key[1])
    assert len(set(res[0]["digests"][::delay])) == steps // delay + 1  # every sync moves them
    assert all(r["stats"]["syncs"] == steps // delay for r in res)
    # every owner keeps a downlink residual of its region only, and together they tile it
    assert sum(sum(r["regions"].values()) for r in res) == 5120 + 256 + 2 * (1280 + 5) \
        or key[0] == "stock"  # the stock hook's layout changes with the aux branch


@pytest.mark.multirank
def test_bits_are_counted_exactly_and_only_the_allgathers_download_grows_with_n():
    for np_, job in JOBS.items():
        for key in list(TRAIN) + ["allgather"]:
            for r in job[key]:
                # the stock hook also counts Horovod's allreduce of a float16 placeholder per
                # gradient and step (6 gradients, 8 steps)
                dummies = 16 * 6 * 8 if key[0] == "stock" else 0
                assert r["stats"]["upstream_bits"] == 8 * r["moved"]["sent"] + dummies, key
                assert r["stats"]["downstream_bits"] == 8 * r["moved"]["received"], key
    # per rank, the allgather downloads N - 1 messages (x1.5 from 3 to 4 ranks); the
    # reduce-scatter (N - 1) / N of one part message and of the region messages (x1.125),
    # which at the default owners (STC at 4x the density) outweigh the allgather's at few ranks
    per_rank = {np_: {key: sum(r["stats"]["downstream_bits"] for r in job[key]) / np_
                      for key in (("dropin", 1, 0), "allgather")} for np_, job in JOBS.items()}
    grows = {key: per_rank[4][key] / per_rank[3][key] for key in per_rank[3]}
    assert grows[("dropin", 1, 0)] < 1.3 < grows["allgather"], grows


@pytest.mark.multirank
def test_a_binarized_downlink_keeps_ranks_identical_and_counts_its_bits():
    # the owners re-compress with another compressor than the default (STC, fused here: the
    # C kernels are off), SBC's one side at twice the uplink's density: every rank applies
    # the same decoded regions
    res, base = THREE["binarized"], THREE[("stock", 1, 0)]
    for s in range(len(res[0]["digests"])):
        assert len({r["digests"][s] for r in res}) == 1, f"ranks differ after step {s}"
    assert len(set(res[0]["digests"])) == len(res[0]["digests"])  # every sync moves them
    for r in res:
        assert r["stats"]["upstream_bits"] == 8 * r["moved"]["sent"] + 16 * 6 * 8
        assert r["stats"]["downstream_bits"] == 8 * r["moved"]["received"]
    # the default's region messages are ternary (SIGNS), these binarized
    assert all(r["moved"]["ternary"] == 0 for r in res), [r["moved"] for r in res]
    assert all(r["moved"]["ternary"] > 0 for r in base), [r["moved"] for r in base]


@pytest.mark.multirank
def test_dense_values_through_both_topologies_agree():
    for r in THREE["equiv"]:
        assert r["max_abs_diff"] <= 1e-6, r


@pytest.mark.multirank
def test_training_through_the_regions_stays_close_to_the_allgather():
    for key in (("dropin", 1, 0), "values"):
        rs = THREE[key][0]["losses"]
        ag = THREE["allgather"][0]["losses"]
        assert abs(sum(rs[-3:]) - sum(ag[-3:])) / 3 < 0.25, (key, rs, ag)


@pytest.mark.multirank
def test_a_nan_on_one_rank_fails_or_skips_every_rank_alike():
    res = THREE["nan"]
    for api in ("dropin", "stock"):
        for r in res:
            msg = r[f"raise_{api}"]
            assert msg and msg.startswith("ValueError") and "rank 1" in msg and "NaN" in msg, msg
    assert all(r["skip_warning"] and "rank 1" in r["skip_warning"] for r in res)
    assert all(r["skip_unchanged"] for r in res)
    assert len({r["skip_after"] for r in res}) == 1
    assert all(r["skip_syncs"] == 2 for r in res)  # the skipped sync is not counted


@pytest.mark.multirank
def test_hierarchy_with_reduce_scatter_across_nodes():
    res = FOUR["hier"]
    for s in range(len(res[0]["digests"])):
        assert len({r["digests"][s] for r in res}) == 1, f"ranks differ after step {s}"
    assert len(set(res[0]["digests"][::2])) == len(res[0]["digests"][::2])


@pytest.mark.multirank
def test_checkpoint_resumes_bit_identically_with_the_downlink_residuals():
    saved, loaded = FOUR["save"], LOAD["load"]
    for r in range(4):
        assert loaded[r]["digests"] == saved[r]["digests"]
        assert loaded[r]["downlink_residuals"] == saved[r]["downlink_residuals"] > 0


@pytest.mark.multirank
def test_a_rank_killed_inside_a_sync_ends_the_job_with_an_error():
    _, out = run_ranks("torch_scatter.py", 3, ["--scenarios", '[["kill"]]'], timeout=150,
                       expect_fail=True)
    assert "finished" not in out


def test_ddp_refuses_the_topology_by_name():
    from horovod_sbc.torch import SBC
    from horovod_sbc.torch.ddp import SBCState
    with pytest.raises(ValueError, match="reduce_scatter"):
        SBCState(torch.nn.Linear(2, 2), compression=SBC(topology="reduce_scatter"))
