"""SBC(topology="reduce_scatter" | "server") in TensorFlow (horovod_sbc/tensorflow/sync/topology.py)
on a real 3-rank job (tests/workers/tf_topology.py), and in this process the knobs and the
region bytes the TF and torch sides share (horovod_sbc/regions.py). A job of TF and torch ranks
through the topologies: tests/test_mixed.py."""
import inspect

import numpy as np
import pytest

from harness import SharedJob
from horovod_sbc import protocol, reference, regions, wire

THREE = SharedJob("tf_topology.py", 3, {
    "rs-eager": ["train", "topology=reduce_scatter"],
    "rs-fn": ["train", "topology=reduce_scatter", "fn=1", "delay=2"],
    "rs-values": ["train", "topology=reduce_scatter", "mode=values"],
    "rs-stock": ["train", "topology=reduce_scatter", "api=stock", "steps=3"],
    "rs-sbc": ["train", "topology=reduce_scatter", "fn=1", "downlink_mode=sbc",
               "downlink_density=0.1"],
    "rs-nan": ["nan", "topology=reduce_scatter"],
    "rs-callback": ["callback"],
    "rs-equiv": ["equiv"],
    "server": ["train", "topology=server", "downlink_density=0.05"],
    "server-fn-dense": ["train", "topology=server", "fn=1"],
    "server-values": ["train", "topology=server", "mode=values", "downlink_density=0.05"],
    "server-nan": ["nan", "topology=server", "downlink_density=0.05"],
    "server-delay": ["train", "topology=server", "downlink_density=0.05", "fn=1", "delay=2"],
    "refuse": ["refuse", "api=stock"]}, timeout=480)
TRAIN = ["rs-eager", "rs-fn", "rs-values", "rs-stock", "rs-sbc", "server", "server-fn-dense",
         "server-values"]
NUMEL = 20 * 32 + 32 + 32 * 5 + 5


# -- in this process -----------------------------------------------------------------------------
def test_tf_sbc_takes_torch_topology_knobs_with_the_same_defaults_and_checks():
    import horovod_sbc.tensorflow as hsbc
    import horovod_sbc.torch as tsbc
    tf_params = inspect.signature(hsbc.SBC.__init__).parameters
    torch_params = inspect.signature(tsbc.SBC.__init__).parameters
    for knob in ("topology", "downlink_density", "downlink_mode", "downlink_binarize"):
        assert tf_params[knob].default == torch_params[knob].default
    s = hsbc.SBC(0.02, topology="reduce_scatter")
    assert (s.topology, s.config.downlink_fraction, s.config.downlink_compressor) == \
        ("reduce_scatter", 0.08, "stc")
    assert hsbc.SBC(topology="server", downlink_mode="sbc").config.downlink_compressor == "sbc"
    assert "topology='reduce_scatter'" in repr(s)
    for bad, match in ((dict(downlink_density=0.1), "downlink_density applies to topology="),
                       (dict(topology="ring"), "topology must be one of"),
                       (dict(topology="server", fixed_size=True), "fixed_size applies to")):
        for cls in (hsbc.SBC, tsbc.SBC):
            with pytest.raises(ValueError, match=match):
                cls(**bad)


@pytest.mark.parametrize("density", [0.5, 1.0])
@pytest.mark.parametrize("zeros", [True, False])
def test_downlink_top_k_sends_no_zero_valued_position(density, zeros):
    """The aggregate of a few sparse messages has fewer non-zeros than the downlink's k: its
    message keeps min(k, non-zeros) positions, as torch's server does (every position, an ALL
    message, only when none is zero); what it decodes to and the residual are unchanged."""
    import tensorflow as tf
    from horovod_sbc.tensorflow.backend import codec, decompress
    from horovod_sbc.tensorflow.sync.downlink import without_zeros
    a = np.random.default_rng(3).standard_normal(40).astype(np.float32)
    if zeros:  # fewer non-zeros than k at either density
        a[::3] = a[1::3] = 0.0
    enc = codec.encode_update(tf.constant(a), density, "values")
    enc.new_residual = enc.residual(tf.constant(a))
    out = without_zeros(enc, density)
    k, nz = reference.keep_count(40, density), int(np.count_nonzero(a))
    assert int(out.header[2]) == min(k, nz)
    assert bool(tf.reduce_all(tf.not_equal(out.sent, 0)))
    msg = out.message.numpy().tobytes()
    assert (msg == enc.message.numpy().tobytes()) == (nz >= k)  # else fewer positions
    full = decompress(tf.constant(np.frombuffer(msg, np.uint8)), (40,)).numpy()
    kept = a - enc.new_residual.numpy()  # what the unfiltered message sent
    np.testing.assert_array_equal(full, kept)


def _step(layout, seed=0, density=0.1):
    rng = np.random.default_rng(seed)
    body = b"".join(reference.compress_np(rng.standard_normal(wire.layout_numel(s)),
                                          np.zeros(wire.layout_numel(s)), density)[0]
                    for _, s in layout)
    return wire.step_message_bytes(body, wire.layout_fingerprint(layout), len(layout))


def _heads(buf, n):
    return [protocol.parse_step(buf, s, e, r) for r, (s, e) in enumerate(protocol.split(buf, n))]


@pytest.mark.parametrize("size", [1, 3, 4])
def test_region_bytes_reframe_and_join_back_to_the_step(size):
    layout = (("a", (20, 16)), ("b", (16,)), ("c", (7, 3)))
    p = regions.Plan(layout, size)
    step = _step(p.layout)
    msgs = regions.region_messages(step, p)
    for r, m in enumerate(msgs):  # every region's part is a step of its own layout
        protocol.parse_gathered(m, p.regions[r], 1)
    assert regions.join_regions(b"".join(msgs), p, _heads(b"".join(msgs), size)) == step


def test_region_bytes_relay_an_error_and_refuse_another_region():
    p = regions.Plan((("a", (40,)), ("b", (9,))), 3)
    err = wire.PeerError(2, "the update of 'b' contains NaN or Inf", False)
    for r, m in enumerate(regions.region_messages(b"", p, err)):
        with pytest.raises(wire.PeerError) as e:
            protocol.parse_gathered(m, p.regions[r], 1)
        assert (e.value.rank, e.value.reason, e.value.skip) == (2, err.reason, False)
    msgs = regions.region_messages(_step(p.layout), p)
    swapped = b"".join([msgs[1], msgs[0], msgs[2]])
    with pytest.raises(ValueError, match="rank 0 sent the message of another region"):
        regions.join_regions(swapped, p, _heads(swapped, 3))


# -- real jobs ---------------------------------------------------------------------------------
@pytest.mark.multirank
@pytest.mark.parametrize("key", TRAIN)
def test_shared_weights_bit_identical_on_every_rank_after_every_sync(key):
    res = THREE[key]
    steps = len(res[0]["digests"]) - 1
    for s in range(steps + 1):
        assert len({r["digests"][s] for r in res}) == 1, f"{key}: ranks differ after step {s}"
    delay = 2 if key == "rs-fn" else 1
    assert len(set(res[0]["digests"][::delay])) == steps // delay + 1  # every sync moves them
    assert all(r["stats"]["syncs"] == steps // delay for r in res)


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["rs-eager", "rs-fn", "rs-values", "rs-stock", "rs-sbc"])
def test_reduce_scatter_counts_the_bytes_it_moved_and_keeps_its_region_residuals(key):
    res = THREE[key]
    dummies = 16 * 4 * 3 if key == "rs-stock" else 0  # Horovod's placeholder allreduces
    for r in res:
        m = r["moved"]
        assert r["stats"]["upstream_bits"] == 8 * (m["a2a_sent"] + m["ag_sent"]) + dummies
        assert r["stats"]["downstream_bits"] == 8 * (m["a2a_received"] + m["ag_received"])
        assert r["checkpoint"] and len(r["checkpoint"]) == len(r["downlink"])  # saved
    # every byte a rank sends another in the alltoall is received there
    assert sum(r["moved"]["a2a_sent"] for r in res) == sum(r["moved"]["a2a_received"] for r in res)
    # the owners' downlink residuals tile the model, one region each
    assert sum(sum(r["downlink"].values()) for r in res) == NUMEL
    assert all(r["downlink"] for r in res)


@pytest.mark.multirank
@pytest.mark.parametrize("key", ["server", "server-fn-dense", "server-values"])
def test_server_counts_the_gather_and_the_broadcast(key):
    root, *others = THREE[key]
    for r in THREE[key]:
        assert r["stats"]["upstream_bits"] == 8 * r["host"]["gather_sent"]
        assert r["moved"]["a2a_sent"] == r["moved"]["ag_sent"] == 0  # no Horovod collective
    assert root["stats"]["server_in_bits"] == 8 * sum(r["host"]["gather_sent"] for r in others)
    assert root["stats"]["server_out_bits"] == 8 * root["host"]["bcast"] * len(others)
    for r in others:
        assert r["stats"]["downstream_bits"] == 8 * r["host"]["bcast"] == 8 * root["host"]["bcast"]
        assert r["stats"]["server_in_bits"] == r["stats"]["server_out_bits"] == 0
        assert r["downlink"] == {}
    dense = key == "server-fn-dense"  # downlink_density=None: the exact average, no residual
    assert (root["downlink"] == {}) == dense and len(root["checkpoint"]) == (0 if dense else 4)


@pytest.mark.multirank
def test_server_in_tf_function_with_delay():
    res = THREE["server-delay"]
    for s in range(len(res[0]["digests"])):
        assert len({r["digests"][s] for r in res}) == 1
    assert res[0]["stats"]["syncs"] == 2 and len(set(res[0]["digests"][::2])) == 3
    assert res[0]["stats"]["server_out_bits"] == sum(r["stats"]["downstream_bits"]
                                                      for r in res[1:]) > 0


@pytest.mark.multirank
@pytest.mark.parametrize("job,key", [(THREE, "rs-nan"), (THREE, "server-nan")])
def test_a_nan_on_one_rank_fails_or_skips_every_rank_alike(job, key):
    res = job[key]
    for r in res:
        assert r["raise_eager"].startswith("ValueError: SBC: rank 1 could not encode"), r
        assert "NaN or Inf" in r["raise_eager"]
        # inside tf.function the same text arrives as InvalidArgumentError
        assert r["raise_fn"].startswith("InvalidArgumentError") and \
            "SBC: rank 1 could not encode" in r["raise_fn"], r["raise_fn"][:300]
        assert r["skip_warning"] and "rank 1" in r["skip_warning"]
        assert r["skip_unchanged"] and r["skip_syncs"] == 2  # the skipped sync is not counted
    assert len({r["skip_after"] for r in res}) == 1


@pytest.mark.multirank
def test_keras_callback_through_the_regions():
    res = THREE["rs-callback"]
    assert all(r["syncs"] == 4 for r in res)
    for s in range(4):
        assert len({r["digests"][s] for r in res}) == 1
    # the callback's fit and the drop-in tape's eager loop take the same steps
    assert res[0]["digests"] == THREE["rs-eager"][0]["digests"][1:]


@pytest.mark.multirank
def test_dense_values_through_the_regions_agree_with_the_allgather():
    assert all(r["max_abs_diff"] <= 1e-6 for r in THREE["rs-equiv"])


@pytest.mark.multirank
def test_stock_tape_refuses_the_server_naming_what_to_use():
    for r in THREE["refuse"]:
        assert "SBC(topology='server') needs the fused exchange" in r["stock_server"]
        assert "horovod_sbc.tensorflow.DistributedGradientTape" in r["stock_server"]
