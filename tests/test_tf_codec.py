"""The TensorFlow backends (horovod_sbc/tensorflow/backend/): byte-identical to the numpy reference
on the golden vectors and on random tensors, eagerly and inside tf.function, with the kernel ops
and with TF ops; exact bit-level helpers; subnormal values survive graph mode; the single-tensor
API equals the reference."""
import contextlib
import json
import math
import os
import struct
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

tf = pytest.importorskip("tensorflow")

from horovod_sbc import protocol, reference, registry, kernels, wire  # noqa: E402
from horovod_sbc.tensorflow import backend as tfb  # noqa: E402
from horovod_sbc.tensorflow.backend import accumulate, codec, host  # noqa: E402
from horovod_sbc.tensorflow.backend import frame as tfframe  # noqa: E402

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "golden"))
import make_golden  # noqa: E402
from test_differential import tf_outcome_of_error  # noqa: E402

GOLDEN = json.load(open(os.path.join(HERE, "golden", "vectors.json")))
NP_DT = {"float32": np.float32, "float64": np.float64, "float16": np.float16}
_GRAPH = {}


def _graph(fn):
    """``fn`` as a ``tf.function`` without AutoGraph: the library's entry points run its code
    unconverted (``do_not_convert``, ``graphs.shared``), so this is the graph production traces;
    AutoGraph would only add conversion time to every trace (a tensor-dependent Python ``if``
    in the codec would fail here instead of being turned into a ``tf.cond``). The cheap
    single-trace tests (test_nonfinite_update_is_reported, the bit helpers,
    test_subnormal_mean_and_values_survive_graph_mode,
    test_decoder_matches_numpy_and_rejects_like_it) keep TensorFlow's default (AutoGraph on),
    as a user's own tf.function around the single-tensor API has it."""
    return tf.function(fn, autograph=False)


def _compress(u, r, density, mode, selection, graph, stock=False):
    """tfb.compress; ``stock``: with the kernel ops disabled (the TF-ops backend)."""
    with (kernels.disabled() if stock else contextlib.nullcontext()):
        if not graph:
            return tfb.compress(tf.constant(u), tf.constant(r), density, mode, selection)
        key = (density, str(mode), selection, u.dtype.str, r.dtype.str, u.shape, stock)
        fn = _GRAPH.get(key)
        if fn is None:
            fn = _GRAPH[key] = tf.function(
                lambda a, b: tfb.compress(a, b, density, mode, selection), autograph=False)
        return fn(tf.constant(u), tf.constant(r))


@pytest.mark.parametrize("stock", [False, True], ids=["ops", "stock"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("case", GOLDEN, ids=[c["name"] for c in GOLDEN])
def test_golden_vectors_native(case, graph, stock):
    """Both TF backends: the kernel ops (float32 binary SBC on the CPU) and TF ops."""
    u, r = make_golden.make_inputs(case["index"], case["numel"], NP_DT[case["dtype"]],
                                   case["kind"])
    binarize, mode = make_golden.mode_args(case["binarize"])
    msg, res = _compress(u, r, case["density"], mode or binarize, case["selection"], graph,
                         stock)
    want = bytes.fromhex(case["message_hex"])
    assert msg.numpy().tobytes() == want
    assert make_golden.digest(res.numpy()) == case["new_residual_sha256"]
    dense = tfb.decompress(msg, (case["numel"],))
    assert dense.numpy().tobytes() == reference.decompress_np(want, (case["numel"],)).tobytes()


# ---------------------------------------------------------------------------------------------
# random tensors (hypothesis): messages and residuals identical to numpy, eager and graph
# ---------------------------------------------------------------------------------------------
# TensorFlow flushes subnormal float32 results of its arithmetic (R + dW, A - mu) to zero, numpy
# does not: inputs are 0 or of magnitude >= 1e-30, so no sum or difference of two of them is
# subnormal (the codec's own value paths are exact on bits and tested below).
_MAG = st.floats(1e-30, 1e30, allow_nan=False, allow_infinity=False)
_VAL = st.one_of(st.just(0.0), _MAG, _MAG.map(lambda x: -x),
                 st.sampled_from([1.0, -1.0, 0.5, -2.0, 3.0]))  # ties


@st.composite
def updates(draw):
    dt = draw(st.sampled_from([np.float32, np.float64, np.float16]))
    n = draw(st.integers(1, 3000))
    if dt == np.float16:
        vals = st.one_of(st.just(0.0), st.floats(-100, 100, width=16).filter(
            lambda x: x == 0 or abs(x) >= 1e-4))
    else:
        vals = _VAL
    u = np.array(draw(st.lists(vals, min_size=n, max_size=n)), dtype=dt)
    r_kind = draw(st.sampled_from(["zeros", "copy", "random"]))
    rdt = np.float64 if dt == np.float64 else np.float32
    if r_kind == "zeros":
        r = np.zeros(n, rdt)
    elif r_kind == "copy":  # exact cancellations and ties
        r = (-u).astype(rdt) if draw(st.booleans()) else u.astype(rdt)
    else:
        r = np.array(draw(st.lists(_VAL, min_size=n, max_size=n)), dtype=rdt)
    a = u.astype(rdt) + r
    if not np.all(np.isfinite(a)):
        r = np.zeros(n, rdt)
    return u, r


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(updates(), st.sampled_from([1e-3, 0.01, 0.05, 0.3, 1.0]),
       st.sampled_from(["sbc", "values", "sign"]), st.sampled_from(["paper", "magnitude"]),
       st.booleans())
def test_random_tensors_identical_to_numpy(ur, density, mode, selection, graph):
    u, r = ur
    want, want_res = reference.compress_np(u, r, density, mode=mode, selection=selection)
    msg, res = _compress(u, r, density, mode, selection, graph)
    assert msg.numpy().tobytes() == want
    assert res.numpy().tobytes() == want_res.astype(r.dtype).tobytes()
    dense = tfb.decompress(msg, u.shape)
    assert dense.numpy().tobytes() == reference.decompress_np(want, u.shape).tobytes()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("density", [1e-3, 0.01, 0.05, 0.2])
@pytest.mark.parametrize("selection", ["paper", "magnitude"])
def test_large_tensors_take_the_sampled_paths_and_stay_exact(graph, density, selection):
    # 100k elements: blocks (low density) or one candidate mask (high density); heavy ties and
    # a few-positives tensor make the sample misjudge and fall back to the whole tensor
    rng = np.random.default_rng(int(density * 1e4))
    n = 100_000
    cases = [rng.standard_normal(n).astype(np.float32) * rng.random(n).astype(np.float32) ** 3,
             np.round(3 * rng.standard_normal(n)).astype(np.float32),
             np.where(rng.random(n) < 1e-3, 1.0, -rng.random(n)).astype(np.float32)]
    for u in cases:
        r = np.zeros(n, np.float32)
        want, want_res = reference.compress_np(u, r, density, selection=selection)
        msg, res = _compress(u, r, density, "sbc", selection, graph)
        assert msg.numpy().tobytes() == want
        assert res.numpy().tobytes() == want_res.tobytes()


def test_nonfinite_update_is_reported():
    u = np.ones(50, np.float32)
    u[7] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        tfb.compress(tf.constant(u), tf.zeros(50), 0.1)
    a = tf.constant(np.where(np.arange(40000) == 5, np.inf, 1.0).astype(np.float32))
    for b in (tfb.backend_for("CPU"), tfb.OpsBackend()):  # the kernel op, the TF-op encoder
        (enc,) = b.encode(["w"], [None], [a], density=0.001)
        assert not bool(enc.finite), b
    with pytest.raises(tf.errors.InvalidArgumentError, match="NaN or Inf"):
        tf.function(lambda x: tfb.compress(x, tf.zeros(50), 0.1))(tf.constant(u))


# ---------------------------------------------------------------------------------------------
# exact bit helpers and subnormal values
# ---------------------------------------------------------------------------------------------
# traced once (inputs of one shape and dtype), called by every example
_F64_TO_F32_BITS = tf.function(codec.f64_to_f32_bits)
_F32_BITS_TO_F64 = tf.function(codec.f32_bits_to_f64)


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False, width=64))
def test_f64_to_f32_bits_rounds_like_numpy(x):
    with np.errstate(over="ignore"):
        want = np.array([x], np.float64).astype(np.float32).view(np.int32)[0]
    for fn in (codec.f64_to_f32_bits, _F64_TO_F32_BITS):
        assert int(fn(tf.constant([x], tf.float64))[0]) == int(want)


@settings(max_examples=200, deadline=None)
@given(st.integers(-2 ** 31, 2 ** 31 - 1).filter(lambda b: (b >> 23) & 0xFF != 0xFF))
def test_f32_bits_to_f64_is_exact(bits):
    want = float(np.array([bits], np.int32).view(np.float32)[0])
    got = float(_F32_BITS_TO_F64(tf.constant([bits], tf.int32))[0])
    assert got == want and math.copysign(1, got) == math.copysign(1, want)


def test_subnormal_mean_and_values_survive_graph_mode():
    # a float64 tensor whose mean is a float32 subnormal: TF's cast would flush it
    u = np.zeros(100, np.float64)
    u[[3, 50]] = 1e-40
    want, want_res = reference.compress_np(u, None, 0.02)
    fn = tf.function(lambda x, r: tfb.compress(x, r, 0.02))
    msg, res = fn(tf.constant(u), tf.zeros(100, tf.float64))
    assert msg.numpy().tobytes() == want
    assert res.numpy().tobytes() == want_res.tobytes()
    hdr = wire.parse_tensor_header(want, 0)
    assert 0 < hdr.value < 1.2e-38  # subnormal on the wire
    dense = tf.function(lambda m: tfb.decompress(m, (100,)))(msg)
    assert dense.numpy().tobytes() == reference.decompress_np(want, (100,)).tobytes()
    assert dense.numpy()[3] != 0
    # a VALUES message with subnormal values, decoded and averaged over two ranks in graph mode
    vals = np.array([1e-40, -3e-39, 2.5, 1e-45], np.float32)
    m = reference.encode_tensor_np([1, 4, 6, 9], 10, values=vals)
    layout = [("w", (10,))]
    step = wire.step_message_bytes(m, wire.layout_fingerprint(layout), 1)
    per = reference.decode_step_np(step + step, layout, 2)
    ref = np.zeros(10, np.float32)
    reference.accumulate_np(per, [ref], 0.5)
    g = tf.constant(np.frombuffer(step + step, np.uint8))
    for fn in (lambda x: tfb.decode_gathered(x, layout, 2, 0.5),
               tf.function(lambda x: tfb.decode_gathered(x, layout, 2, 0.5))):
        assert fn(g)[0].numpy().tobytes() == ref.tobytes()


def test_rice_table_matches_wire_rice_parameter():
    for numel in (1, 2, 7, 100, 4096, 10 ** 6 + 3):
        counts = sorted({1, 2, numel, *np.unique(np.geomspace(1, numel, 60).astype(int))})
        c = tf.constant(counts, tf.int64)
        b1, ts = wire.rice_table(numel)
        got = b1 - tf.reduce_sum(tf.cast(tf.constant(ts, tf.int64)[None, :] <= c[:, None], tf.int64), 1)
        assert got.numpy().tolist() == [wire.rice_parameter(k / numel) for k in counts]


# ---------------------------------------------------------------------------------------------
# decoder: verdicts and values like numpy (the thorough version is tests/test_differential.py)
# ---------------------------------------------------------------------------------------------
def test_decoder_matches_numpy_and_rejects_like_it():
    rng = np.random.default_rng(3)
    layout = [("a", (300,)), ("b", (7, 5)), ("c", ())]
    fp = wire.layout_fingerprint(layout)
    steps = []
    for r in range(3):
        msgs = [reference.compress_np(rng.standard_normal(wire.layout_numel(s)).astype(np.float32),
                                 None, 0.1, mode=m)[0]
                for (_, s), m in zip(layout, ["sbc", "values", "sign"])]
        steps.append(wire.step_message_bytes(b"".join(msgs), fp, len(msgs)))
    data = b"".join(steps)
    ref = [np.zeros(wire.layout_numel(s), np.float32) for _, s in layout]
    reference.accumulate_np(reference.decode_step_np(data, layout, 3), ref, 1 / 3)
    fn = tf.function(lambda g: tfb.decode_gathered(g, layout, 3, 1 / 3))
    for dec in (lambda g: tfb.decode_gathered(g, layout, 3, 1 / 3), fn):
        got = dec(tf.constant(np.frombuffer(data, np.uint8)))
        assert [x.numpy().tobytes() for x in got] == [x.tobytes() for x in ref]
    # a flipped bit in the middle of rank 1's unary stream: the same verdict text
    bad = bytearray(data)
    bad[len(steps[0]) + 40] ^= 0x10
    with pytest.raises(ValueError) as np_err:
        reference.decode_step_np(bytes(bad), layout, 3)
    with pytest.raises(tf.errors.InvalidArgumentError) as tf_err:
        fn(tf.constant(np.frombuffer(bytes(bad), np.uint8)))
    assert tf_outcome_of_error(tf_err.value) == ("invalid", str(np_err.value))
    with pytest.raises(ValueError, match=str(np_err.value)[:30]):
        tfb.decode_gathered(tf.constant(np.frombuffer(bytes(bad), np.uint8)), layout, 3)


def test_single_tensor_api_agrees_with_the_reference():
    rng = np.random.default_rng(5)
    u = rng.standard_normal((30, 40)).astype(np.float32)
    r = (0.1 * rng.standard_normal((30, 40))).astype(np.float32)
    for sel in ("paper", "magnitude"):
        m1, r1 = tfb.compress(tf.constant(u), tf.constant(r), 0.02, True, sel)
        m2, r2 = reference.compress_np(u, r, 0.02, True, selection=sel)
        assert m1.numpy().tobytes() == m2
        assert r1.numpy().tobytes() == r2.astype(np.float32).tobytes() and r1.shape == (30, 40)
        assert np.array_equal(tfb.decompress(m1, (30, 40)).numpy(),
                              reference.decompress_np(m2, (30, 40)))


def test_encoded_positions_and_sent_values_commit_the_residual():
    a = tf.constant(np.linspace(-1, 1, 1000, dtype=np.float32))
    enc = codec.encode_update(a, 0.01)
    hdr = wire.parse_tensor_header(enc.message.numpy().tobytes(), 0)
    assert hdr.count == int(tf.size(enc.positions)) == 10
    assert np.all(enc.sent.numpy() == np.float32(-hdr.value if hdr.negative else hdr.value))
    new = codec.apply_sent(a, enc.positions, enc.sent).numpy()
    _, want = reference.compress_np(a.numpy(), None, 0.01)
    assert new.tobytes() == want.tobytes()
    assert struct.unpack("<f", enc.message.numpy().tobytes()[hdr.unary[0] - 4:hdr.unary[0]])[0] \
        == hdr.value


def _masks_taken(data: bytes, layout, n_ranks: int) -> bool:
    """Does the TF-ops backend accumulate this step by rank masks (accumulate.by_rank_masks)?"""
    buf = np.frombuffer(data, np.uint8)
    _, table = host.parse_host(buf, layout, n_ranks, False, False, True)
    numels = [wire.layout_numel(s) for _, s in layout]
    return (accumulate.masks_fit(numels, n_ranks, None, [tf.float32] * len(layout))
            and bool(accumulate.binary_step(tf.constant(table))))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("masks", ["sorted", "dense"])
def test_rank_mask_accumulation_edge_steps(graph, masks, monkeypatch):
    """The TF-ops backend's accumulation by rank masks (tensorflow/backend/accumulate.py) on
    the steps that stress it: no positions at all, every rank sending the same positions (all
    2**8 rank sets of the sum table are exercised by random signs), subnormal values and sums,
    empty tensors between others — bit-identical to numpy, with either way of building the rank
    masks; the kernel backend on the same steps too."""
    monkeypatch.setattr(accumulate, "SORT_FACTOR", 0 if masks == "sorted" else 1 << 40)
    layout = [("a", (4000,)), ("e", (0,)), ("b", (9,)), ("c", (700,))]
    fp = wire.layout_fingerprint(layout)
    rng = np.random.default_rng(11)
    base = [rng.standard_normal(wire.layout_numel(s)).astype(np.float32) for _, s in layout]

    def step_of(rank, kind):
        parts = []
        for t, u in enumerate(base):
            if kind == "empty":
                x = np.zeros_like(u)
            elif kind == "same":  # identical positions on every rank, sign and scale per rank
                x = u * np.float32(rng.choice([-1.0, 1.0]) * (1 + rank))
            else:  # subnormal magnitudes: the means and their sums are subnormal
                x = (u * np.float32(1e-39 * (1 + rank % 3))).astype(np.float32)
            parts.append(reference.compress_np(x, None, 0.05)[0])
        return wire.step_message_bytes(b"".join(parts), fp, len(parts))

    backends = [tfb.OpsBackend(), tfb.backend_for("CPU")]
    assert isinstance(backends[1], tfb.KernelBackend)
    decoders = {}  # (backend, ranks): inside tf.function traced once for the steps of both kinds
    for n_ranks, kind in [(3, "empty"), (8, "same"), (8, "subnormal"), (1, "same")]:
        data = b"".join(step_of(r, kind) for r in range(n_ranks))
        assert _masks_taken(data, layout, n_ranks)
        ref = [np.zeros(wire.layout_numel(s), np.float32) for _, s in layout]
        reference.accumulate_np(reference.decode_step_np(data, layout, n_ranks), ref, 1 / n_ranks)
        for i, b in enumerate(backends):
            if (i, n_ranks) not in decoders:
                def dec(g, b=b, n_ranks=n_ranks):
                    return b.decode(g, layout, n_ranks, scale=1 / n_ranks)[1]
                # the gathered length unknown while tracing, as an allgather's output
                decoders[i, n_ranks] = tf.function(
                    dec, input_signature=[tf.TensorSpec([None], tf.uint8)],
                    autograph=False) if graph else dec
            got = decoders[i, n_ranks](tf.constant(np.frombuffer(data, np.uint8)))
            assert [x.numpy().tobytes() for x in got] == [x.tobytes() for x in ref], \
                (n_ranks, kind, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_residual_update_ways_agree(dtype):
    """codec.ResidualUpdate: scatter, dense (SparseToDense + subtract) and all-positions give the
    same bits (negative zeros kept)."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal(5000).astype(dtype)
    a[::7] = -0.0
    pos = np.sort(rng.choice(5000, 400, replace=False)).astype(np.int64)
    sent = rng.standard_normal(400).astype(dtype)
    want = a.copy()
    want[pos] -= sent
    for way in (codec.ResidualUpdate.SCATTER, codec.ResidualUpdate.DENSE):
        got = codec.apply_sent(tf.constant(a), tf.constant(pos), tf.constant(sent), way)
        assert got.numpy().tobytes() == want.tobytes(), way
    full = rng.standard_normal(5000).astype(dtype)
    got = codec.apply_sent(tf.constant(a), tf.range(5000, dtype=tf.int64), tf.constant(full),
                           codec.ResidualUpdate.ALL)
    assert got.numpy().tobytes() == (a - full).tobytes()
    # the TF-op encoder's choice (the kernel op commits the residual itself)
    assert codec.encode_update(tf.constant(a), 0.01).update is codec.ResidualUpdate.DENSE
    assert codec.encode_update(tf.constant(a), 1e-3).update is codec.ResidualUpdate.SCATTER
    assert codec.encode_update(tf.constant(a), 1.0, "sign").update is codec.ResidualUpdate.ALL


# ---------------------------------------------------------------------------------------------
# empty tensors and peers' reasons with NUL bytes (issue 47, item 6: found by fuzzing the
# decoders and encoders against each other)
# ---------------------------------------------------------------------------------------------
_MODES = ["sbc", "values", "sign", "terngrad"]


def _backends():
    backends = [tfb.backend_for("CPU"), tfb.OpsBackend()]
    assert isinstance(backends[0], tfb.KernelBackend)  # the kernel ops build here
    return backends


def _seeds(n: int):
    return [tf.constant([47, i], tf.int64) for i in range(n)]


def _reference_message(r: np.ndarray, density: float, mode: str, seed) -> bytes:
    """numpy's message of ``A = r``; TernGrad with the TF encoder's draws for ``seed``."""
    uniform = None
    if mode == "terngrad":
        uniform = tf.random.stateless_uniform([r.size], seed=seed, dtype=tf.float32).numpy()
    return reference.compress_np(r, None, density, mode=mode, uniform=uniform)[0]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("mode", _MODES)
def test_an_empty_tensor_has_the_references_one_encoding(mode, graph):
    """A tensor of no elements: every TF encoder (the kernel backend, the TF-ops backend, the
    single-tensor API, the compressor's own encode_tf) gives the reference's one message, in
    every mode, eagerly and inside tf.function (it raised ZeroDivisionError: the Rice table of
    0 elements)."""
    want = protocol.empty_tensor_message()
    for shape in [(0,), (3, 0)]:
        for dt in (np.float32, np.float64):
            assert _reference_message(np.zeros(shape, dt), 0.1, mode, _seeds(1)[0]) == want
            for b in _backends():
                def enc(r, b=b):
                    (e,) = b.encode(["e"], [None], [r], density=0.1, mode=mode,
                                    seeds=_seeds(1) if mode == "terngrad" else None)
                    return e.message, e.new_residual, e.finite
                msg, res, finite = (_graph(enc) if graph else enc)(tf.zeros(shape, dt))
                assert msg.numpy().tobytes() == want, (b, shape, dt)
                assert res.numpy().size == 0 and bool(finite)

            def single(u, r):
                return tfb.compress(u, r, 0.1, mode)
            msg, res = (_graph(single) if graph else single)(tf.zeros(shape, dt),
                                                                   tf.zeros(shape, dt))
            assert msg.numpy().tobytes() == want and res.shape == shape
            if mode in ("sign", "terngrad"):  # the compressor's own encoder, called directly

                def own(a):
                    return registry.get(mode).encode_tf(a, density=0.1, selection="paper",
                                                        name="e", generator=_seeds(1)[0]).message
                assert (_graph(own) if graph else own)(
                    tf.zeros([0], dt)).numpy().tobytes() == want


@pytest.mark.parametrize("capacity", [False, True], ids=["variable", "fixed-size"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_empty_tensors_among_others_give_the_references_step(graph, capacity):
    """Empty tensors first, between and last among non-empty ones: each backend's step message
    (encode, then frame: on the device for the TF-ops backend, on the host for the kernel
    backend; PADDED to the layout's capacity or not) is numpy's, byte for byte, in every mode,
    and every TF decoder reads it like numpy."""
    layout = [("e0", (0,)), ("w", (40, 30)), ("e1", (3, 0)), ("b", (7,)), ("e2", (0,))]
    names = [n for n, _ in layout]
    numels = [wire.layout_numel(s) for _, s in layout]
    fp = wire.layout_fingerprint(layout)
    rng = np.random.default_rng(47)
    rs = [rng.standard_normal(s).astype(np.float32) for _, s in layout]
    seeds = _seeds(len(layout))
    for mode in _MODES:
        body = b"".join(_reference_message(r, 0.1, mode, s) for r, s in zip(rs, seeds))
        cap = reference.step_capacity(numels, 0.1, mode) if capacity else None
        want = (wire.padded_step_message(body, fp, len(layout), cap) if capacity
                else wire.step_message_bytes(body, fp, len(layout)))
        ref = [np.zeros(n, np.float32) for n in numels]
        reference.accumulate_np(reference.decode_step_np(want + want, layout, 2), ref, 0.5)
        for b in _backends():
            def run(*xs, b=b):
                enc = b.encode(names, [None] * len(xs), list(xs), density=0.1, mode=mode,
                               seeds=seeds if mode == "terngrad" else None)
                step, _ = b.frame(enc, names, numels, fp, 0, False, cap,
                                  tfframe.step_bound(tuple(numels), 0.1, mode))
                return step, b.decode(tf.concat([step, step], 0), layout, 2, scale=0.5)[1]
            step, got = (_graph(run) if graph else run)(*[tf.constant(r) for r in rs])
            assert step.numpy().tobytes() == want, (mode, b)
            assert [x.numpy().tobytes() for x in got] == [x.tobytes() for x in ref], (mode, b)


_NUL_REASONS = [("bad\0news \0x", False), ("\0", True), ("\0\0 caf\u00e9\0", False),
                ("NaN in 'w'\0", True)]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_a_peer_reason_with_nul_bytes_keeps_its_verdict(graph):
    """A rank's ERROR/SKIP step whose (unpadded, so any UTF-8) reason holds NUL bytes: both
    TF decoders report the PeerError of numpy, same rank, same reason, eagerly and inside
    tf.function (where TensorFlow's error text ended at the NUL, so the verdict was lost:
    "invalid"); inside tf.function the error's text carries the whole reason, NUL as \\x00. Not
    strict, an ERROR's ValueError comes back with its exact text."""
    layout = [("w", (8,))]
    fp = wire.layout_fingerprint(layout)
    good = wire.step_message_bytes(
        reference.compress_np(np.arange(8, dtype=np.float32), None, 0.25)[0], fp, 1)
    decoders = {}  # (backend, strict): one decoder, inside tf.function traced once for all steps
    for reason, skip in _NUL_REASONS:
        data = good + wire.error_step_message(reason, fp, skip=skip, origin=1) + good
        with pytest.raises(wire.PeerError) as np_err:
            reference.decode_step_np(data, layout, 3)
        want = ("skip" if skip else "error", 1, reason)
        assert (np_err.value.rank, np_err.value.reason, np_err.value.skip) == (1, reason, skip)
        g = tf.constant(np.frombuffer(data, np.uint8))
        for i, b in enumerate(_backends()):
            for strict in (True, False):
                if skip and not strict:
                    continue  # a SKIP is no error when not strict
                if (i, strict) not in decoders:
                    def dec(x, b=b, strict=strict):
                        return b.decode(x, layout, 3, strict=strict)[1]
                    # the gathered length unknown while tracing, as an allgather's output
                    decoders[i, strict] = tf.function(
                        dec, input_signature=[tf.TensorSpec([None], tf.uint8)],
                        autograph=False) if graph else dec
                with pytest.raises((ValueError, tf.errors.InvalidArgumentError)) as err:
                    decoders[i, strict](g)
                e = host.original_error(err.value)
                if strict:
                    assert type(e) is wire.PeerError, (b, reason, err.value)
                    assert (e.rank, e.reason, e.skip) == (1, reason, skip)
                    assert tf_outcome_of_error(err.value) == want
                else:
                    assert type(e) is ValueError, (b, reason, err.value)
                    assert str(e) == f"SBC: {np_err.value}"
                if graph:  # the whole reason in TensorFlow's text, NUL as \x00
                    assert isinstance(err.value, tf.errors.InvalidArgumentError)
                    assert ("could not encode this sync: " + reason.replace("\0", "\\x00")
                            in err.value.message)
