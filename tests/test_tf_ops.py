"""The TF kernel backend (horovod_sbc/kernels/sbc_tf_ops.cc, tensorflow/backend/native.py): its
ops build and are used for float32 binary SBC on the CPU, eagerly and inside tf.function;
they give the bytes, residuals and decoded sums of the TF-ops backend and of numpy (golden
vectors: tests/test_tf_codec.py runs them through both backends); subnormals survive
TensorFlow's flush-to-zero; the TF-ops backend takes over when they are disabled or cannot be
built; NaN/Inf is rejected naming the tensor; the decoder's memory stays within 40 bytes per
message byte."""
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

tf = pytest.importorskip("tensorflow")

from horovod_sbc import reference, kernels, wire  # noqa: E402
import horovod_sbc.tensorflow as hsbc  # noqa: E402
from horovod_sbc.tensorflow import backend as tfb  # noqa: E402
from horovod_sbc.tensorflow.backend import frame as tfframe, host as tfhost  # noqa: E402
from horovod_sbc.tensorflow.sync import exchange as tfx  # noqa: E402

SBC_OPS = {"SbcEncode", "SbcDecode", "SbcScatterAdd"}


@pytest.fixture(scope="module", autouse=True)
def ops_built():
    assert kernels.tf_ops() is not None, "the TF kernel ops must build here"


def _op_types(fn, *args):
    """The op types in the graph of tf.function ``fn`` traced for ``args`` (branches included)."""
    graph = fn.get_concrete_function(*args).graph
    types = {op.type for op in graph.get_operations()}
    for f in graph.as_graph_def().library.function:  # tf.cond branches
        types |= {n.op for n in f.node_def}
    return types


def _step(msgs, layout):
    fp = wire.layout_fingerprint(layout)
    return b"".join(wire.step_message_bytes(b"".join(m), fp, len(m)) for m in msgs)


def _paths():
    return [("ops", contextlib.nullcontext), ("stock", kernels.disabled)]


def _graph(fn):
    """``fn`` as a ``tf.function`` without AutoGraph: the library's entry points run its code
    unconverted (``do_not_convert``, ``graphs.shared``), so this is the graph production traces
    (the graph the op-type checks below inspect); AutoGraph would only add conversion time to
    every trace. test_subnormals_survive_the_ops and
    test_nonfinite_update_is_rejected_naming_the_tensor keep TensorFlow's default (AutoGraph
    on), as a user's own tf.function around the single-tensor API has it."""
    return tf.function(fn, autograph=False)


def test_ops_are_used_in_graphs_and_not_when_disabled():
    u = tf.constant(np.random.default_rng(0).standard_normal(50_000).astype(np.float32))
    r = tf.zeros([50_000])
    layout = [("w", (50_000,))]
    g = tf.constant(np.frombuffer(_step([[reference.encode_tensor_np([1, 7], 50_000, 0.5)]], layout),
                                  np.uint8))
    got = {}
    for path, ctx in _paths():
        with ctx():
            comp = _graph(lambda a, b: tfb.compress(a, b, 0.01))
            dec = _graph(lambda x: tfb.decode_gathered(x, layout, 1, 0.5))
            used = _op_types(comp, u, r) | _op_types(dec, g)
            got[path] = (comp(u, r)[0].numpy().tobytes(), comp(u, r)[1].numpy().tobytes(),
                         dec(g)[0].numpy().tobytes())
        assert (SBC_OPS <= used) if path == "ops" else not (SBC_OPS & used), (path, used)
    assert got["ops"] == got["stock"]


@pytest.mark.xdist_group("tf_ops_kernels_off")  # one worker starts the process below once
def test_ops_follow_the_environment_switch(kernels_off_process):
    """A process started with ``HOROVOD_SBC_KERNELS=0``: no kernel ops, the TF-ops backend on
    the CPU (asked first thing in :data:`_KERNELS_OFF`'s process, before anything else ran)."""
    got, res = kernels_off_process
    assert got.get("switch") == [True, "OpsBackend"], (got.get("switch"), res.stderr[-2000:])


def test_a_backend_is_chosen_once_per_device_type_and_switch():
    """backend_for: the kernel backend on the CPU, the TF-ops backend on a GPU and wherever the
    kernels are disabled, the same object every time; an SBC keeps the one of its first sync."""
    cpu = tfb.backend_for("/job:localhost/replica:0/task:0/device:CPU:0")
    assert isinstance(cpu, tfb.KernelBackend) and tfb.backend_for("CPU") is cpu
    assert isinstance(tfb.backend_for("/device:GPU:0"), tfb.OpsBackend)
    with kernels.disabled():
        ops = tfb.backend_for("CPU")
        assert isinstance(ops, tfb.OpsBackend) and tfb.backend_for("CPU") is ops
    assert tfb.backend_for("CPU") is cpu
    sbc = hsbc.SBC(density=0.1)
    assert sbc.backend is None
    with kernels.disabled():
        assert sbc._backend_of([tf.Variable(tf.zeros([3]))]) is ops
    assert sbc._backend_of([tf.Variable(tf.zeros([3]))]) is ops and sbc.backend is ops


def test_without_a_compiler_the_stock_ops_run_and_warn_once(tmp_path):
    code = textwrap.dedent("""
        import warnings
        import numpy as np, tensorflow as tf
        from horovod_sbc import reference, kernels
        from horovod_sbc.tensorflow import backend as tfb
        u = np.random.default_rng(1).standard_normal(30000).astype(np.float32)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(2):
                msg, res = tfb.compress(tf.constant(u), tf.zeros(30000), 0.01)
        assert kernels.tf_ops() is None
        assert isinstance(tfb.backend_for("CPU"), tfb.OpsBackend)
        warned = [x for x in w if "TensorFlow kernel ops unavailable" in str(x.message)]
        assert len(warned) == 1, [str(x.message) for x in w]
        want, want_res = reference.compress_np(u, np.zeros(30000, np.float32), 0.01)
        assert msg.numpy().tobytes() == want and res.numpy().tobytes() == want_res.tobytes()
        print("ok")
    """)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-cxx"),
           "HOROVOD_SBC_KERNELS_DIR": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ok")


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_subnormals_survive_the_ops(graph):
    """TensorFlow flushes subnormals on the CPU; the ops clear FTZ/DAZ: a subnormal mean, a
    subnormal residual R + dW and a subnormal decoded average come out as numpy's."""
    n = 40_000  # above the exact-path size: the sampled selection too
    rng = np.random.default_rng(3)
    u = np.zeros(n, np.float32)
    idx = rng.choice(n, 60, replace=False)
    u[idx] = (rng.random(60) * 1e-39).astype(np.float32)  # subnormal positives
    u[idx[:10]] = -u[idx[:10]]
    r = np.zeros(n, np.float32)
    r[::97] = np.float32(3e-41)  # R + dW subnormal where dW is 0 (and also where it is not)
    want, want_res = reference.compress_np(u, r, 0.001)
    assert 0 < wire.parse_tensor_header(want, 0).value < 1.2e-38
    fn = (tf.function(lambda a, b: tfb.compress(a, b, 0.001)) if graph
          else (lambda a, b: tfb.compress(a, b, 0.001)))
    msg, res = fn(tf.constant(u), tf.constant(r))
    assert msg.numpy().tobytes() == want
    assert res.numpy().tobytes() == want_res.tobytes()
    assert np.count_nonzero(res.numpy()) > 300
    # decode two ranks' subnormal messages, scale 0.5 (the average is subnormal too)
    layout = [("w", (n,))]
    buf = _step([[want], [want]], layout)
    ref = np.zeros(n, np.float32)
    reference.accumulate_np(reference.decode_step_np(buf, layout, 2), [ref], 0.5)
    dec = (tf.function(lambda x: tfb.decode_gathered(x, layout, 2, 0.5)) if graph
           else (lambda x: tfb.decode_gathered(x, layout, 2, 0.5)))
    got = dec(tf.constant(np.frombuffer(buf, np.uint8)))[0].numpy()
    assert got.tobytes() == ref.tobytes() and np.count_nonzero(got) > 0


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_nonfinite_update_is_rejected_naming_the_tensor(graph):
    u = np.ones(30_000, np.float32)
    u[1234] = np.inf
    name = "dense_3/kernel:0"
    fn = (tf.function(lambda a, b: tfb.compress(a, b, 0.01, name=name)) if graph
          else (lambda a, b: tfb.compress(a, b, 0.01, name=name)))
    err = tf.errors.InvalidArgumentError if graph else ValueError
    with pytest.raises(err, match=r"NaN or Inf \(\\?'dense_3/kernel:0\\?'\)"):
        fn(tf.constant(u), tf.zeros(30_000))
    (enc,) = tfb.backend_for("CPU").encode([name], [tf.constant(u)], [tf.zeros(30_000)],
                                           density=0.01)
    assert enc.new_residual is not None and not bool(enc.finite)
    # the exchange's step message names it (what the other ranks are told)
    step, _ = tfframe.frame([30_000], [enc.header], [enc.body], 0, None)
    step, _ = tfframe.step_or_error(step, tf.constant(0, tf.int64), [enc.finite], [name], 0, 0,
                                    False, None)
    with pytest.raises(wire.PeerError, match="dense_3/kernel:0"):
        reference.decode_step_np(step.numpy().tobytes(), [(name, (30_000,))], 1)


# ---------------------------------------------------------------------------------------------
# property test: the op path and the stock path agree (bytes, residuals, decoded sums)
# ---------------------------------------------------------------------------------------------
# inputs are 0 or of magnitude >= 1e-30 (TensorFlow's own arithmetic on the stock path flushes
# subnormal results; the ops keep them: see test_subnormals_survive_the_ops)
_MAG = st.floats(1e-30, 1e30, allow_nan=False, allow_infinity=False)
_VAL = st.one_of(st.just(0.0), _MAG, _MAG.map(lambda x: -x),
                 st.sampled_from([1.0, -1.0, 0.5, -2.0, 3.0]))
_FNS = {}


def _fns(path, density, selection, layout, n_ranks, scale):
    key = (path, density, selection, tuple(layout), n_ranks, scale)
    if key not in _FNS:
        with dict(_paths())[path]():
            _FNS[key] = (
                _graph(lambda a, b: tfb.compress(a, b, density, True, selection)),
                _graph(lambda g: tfb.decode_gathered(g, layout, n_ranks, scale)))
    return _FNS[key]


@st.composite
def _case(draw):
    n = draw(st.sampled_from([1, 17, 500, 3000, 20_000]))
    n_ranks = draw(st.integers(1, 3))
    us = []
    for _ in range(n_ranks):
        if n > 3000:  # large: random normal data with a few drawn values (sampled paths)
            u = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1))).standard_normal(
                n).astype(np.float32)
            u[:8] = draw(st.lists(_VAL, min_size=8, max_size=8))
        else:
            u = np.array(draw(st.lists(_VAL, min_size=n, max_size=n)), np.float32)
        us.append(u)
    r = np.array(draw(st.lists(_VAL, min_size=min(n, 64), max_size=min(n, 64))), np.float32)
    r = np.resize(r, n) if n else r
    if not all(np.all(np.isfinite(u + r)) for u in us):
        r = np.zeros(n, np.float32)
    return us, r, draw(st.sampled_from([1e-3, 0.01, 0.05, 0.3, 1.0])), \
        draw(st.sampled_from(["paper", "magnitude"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(_case(), st.booleans())
def test_ops_and_stock_ops_agree(case, graph):
    us, r, density, selection = case
    n, n_ranks = r.size, len(us)
    layout = [("w", (n,))]
    scale = 1.0 / n_ranks
    got = {}
    for path, ctx in _paths():
        with ctx():
            if graph:
                comp, dec = _fns(path, density, selection, layout, n_ranks, scale)
            else:
                comp = lambda a, b: tfb.compress(a, b, density, True, selection)  # noqa: E731
                dec = lambda g: tfb.decode_gathered(g, layout, n_ranks, scale)  # noqa: E731
            out = [comp(tf.constant(u), tf.constant(r)) for u in us]
            msgs = [m.numpy().tobytes() for m, _ in out]
            buf = _step([[m] for m in msgs], layout)
            dense = dec(tf.constant(np.frombuffer(buf, np.uint8)))[0].numpy()
            got[path] = (msgs, [x.numpy().tobytes() for _, x in out], dense.tobytes())
    assert got["ops"] == got["stock"]
    want = [reference.compress_np(u, r, density, selection=selection)[0] for u in us]
    assert got["ops"][0] == want


def test_close_means_choose_the_reference_side():
    """SbcEncode writes only the winning side when the two means are decisively apart and both
    sides when they are close: around that boundary (means equal, one float32 ulp apart, ...,
    1e-5 apart, either side ahead) the message is numpy's and the residual the stock path's."""
    rng = np.random.default_rng(5)
    for n in (1000, 120_000):
        base = np.abs(rng.standard_normal(n // 2)).astype(np.float32) + 0.5
        for eps in (0.0, 2.0 ** -24, -2.0 ** -24, 1e-7, -1e-6, 1e-5, -1e-5, 1e-2):
            a = np.concatenate([base, -(base * np.float32(1 + eps))]).astype(np.float32)
            a = a[rng.permutation(n)]
            for density in (0.01, 0.3):
                got = {}
                for path, ctx in _paths():
                    with ctx():
                        msg, res = tfb.compress(tf.zeros([n]), tf.constant(a), density, True,
                                                  "paper")
                    got[path] = (msg.numpy().tobytes(), res.numpy().tobytes())
                want, _ = reference.compress_np(a.copy(), None, density)
                assert got["ops"] == got["stock"] and got["ops"][0] == want, (n, eps, density)


# ---------------------------------------------------------------------------------------------
# decoder memory (issue 12: <= 40 bytes per message byte)
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
def test_tf_decoder_memory_is_bounded_by_the_message_size():
    """A valid ~1.5 MiB message (2M positions at density 0.05) decoded by the kernel ops: the
    peak extra memory beyond the float32 result tensor itself (TensorFlow outputs are fresh
    tensors; torch's probe decodes into a preallocated one) is <= 40 bytes per message byte
    (positions: 4 bytes each; the host parse's copies of the message: a few bytes per byte)."""
    from harness import decoder_peak_memory
    got = decoder_peak_memory("""
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        from horovod_sbc import kernels
        from horovod_sbc.tensorflow import backend as tfb
        assert kernels.tf_ops() is not None

        def make(buf, layout, numel):
            gathered = tf.constant(np.frombuffer(buf, np.uint8))
            return lambda: tfb.decode_gathered(gathered, layout, 1)[0]
    """)
    assert got["ok"]
    assert got["bytes"] > 1 << 20
    per_byte = (got["extra"] - got["output"]) / got["bytes"]
    print(f"TF decoder: {per_byte:.1f} bytes per message byte beyond the output")
    assert per_byte <= 40, got


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_decode_into_outputs_matches_the_stock_path(graph):
    """Accumulating into given outputs (the drop-in optimizer's reference weights), three ranks,
    two tensors, one rank sending nothing for one of them: the ops add in rank order onto the
    bases exactly as the stock path does, and leave the inputs untouched."""
    rng = np.random.default_rng(11)
    layout = [("a", (300, 7)), ("b", (5000,))]
    msgs = []
    for r in range(3):
        ms = []
        for name, shape in layout:
            n = int(np.prod(shape))
            u = rng.standard_normal(n).astype(np.float32)
            if r == 1 and name == "a":
                u = np.zeros(n, np.float32)  # nothing to send
            ms.append(reference.compress_np(u, None, 0.05)[0])
        msgs.append(ms)
    buf = tf.constant(np.frombuffer(_step(msgs, layout), np.uint8))
    bases = [rng.standard_normal(s).astype(np.float32) for _, s in layout]
    got = {}
    for path, ctx in _paths():
        with ctx():
            outs = [tf.constant(b) for b in bases]
            fn = lambda g, o0, o1: tfb.decode_gathered(g, layout, 3, 1 / 3, [o0, o1])  # noqa
            res = (_graph(fn) if graph else fn)(buf, *outs)
            got[path] = [x.numpy().tobytes() for x in res]
            assert [o.numpy().tobytes() for o in outs] == [b.tobytes() for b in bases]
    assert got["ops"] == got["stock"]
    ref = [b.copy().reshape(-1) for b in bases]
    reference.accumulate_np(reference.decode_step_np(buf.numpy().tobytes(), layout, 3), ref, 1 / 3)
    assert got["ops"] == [x.tobytes() for x in ref]


@pytest.mark.parametrize("density", [0.9, 1.0])
def test_stock_path_paper_rule_at_high_density_on_large_tensors(density):
    """Regression (found by the property test above): the stock path's sampled band selected
    the wrong P/N for the paper rule once k exceeded half of a large tensor."""
    u = np.random.default_rng(1).standard_normal(20_000).astype(np.float32)
    u[:8] = 0
    want, want_res = reference.compress_np(u, None, density)
    with kernels.disabled():
        msg, res = tfb.compress(tf.constant(u), tf.zeros(20_000), density)
    assert msg.numpy().tobytes() == want and res.numpy().tobytes() == want_res.tobytes()


_SEGMENT_REDUCTIONS = {"SegmentSum", "SegmentMax", "SegmentMin", "SegmentProd",
                       "UnsortedSegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin",
                       "UnsortedSegmentProd"}


def _segment_dtypes(fn, *args):
    """``{(op type, dtype)}`` of the segment reductions in tf.function ``fn`` traced for
    ``args``, nested functions included."""
    graph = fn.get_concrete_function(*args).graph
    found = {(op.type, op.get_attr("T")) for op in graph.get_operations()
             if op.type in _SEGMENT_REDUCTIONS}
    for f in graph.as_graph_def().library.function:
        found |= {(n.op, tf.as_dtype(n.attr["T"].type)) for n in f.node_def
                  if n.op in _SEGMENT_REDUCTIONS}
    return found


@pytest.mark.parametrize("mode", [True, False, "sign"])
def test_the_tensor_op_path_has_no_int64_segment_reduction(mode):
    """TensorFlow registers its GPU segment reductions for floats and int32 only: an int64 one
    would be placed on the host, a device-to-host round trip per call. The path GPU tensors take
    (the TF-ops backend: kernels off) encodes and decodes without one, for every message kind
    (binary, values, signs; VALUES messages also go through the non-finite check), one rank and
    three."""
    rng = np.random.default_rng(3)
    layout = [("a", (3000,)), ("b", (40,))]
    found = set()
    with kernels.disabled():
        comp = _graph(lambda u, r: tfb.compress(u, r, 0.01, mode))
        u = tf.constant(rng.standard_normal(3000).astype(np.float32))
        found |= _segment_dtypes(comp, u, tf.zeros([3000]))
        msgs = [[comp(u, tf.zeros([3000]))[0].numpy().tobytes(),
                 tfb.compress(tf.constant(rng.standard_normal(40).astype(np.float32)),
                              tf.zeros([40]), 0.1, mode)[0].numpy().tobytes()]]
        for n_ranks in (1, 3):
            g = tf.constant(np.frombuffer(_step(msgs * n_ranks, layout), np.uint8))
            dec = _graph(lambda x, n=n_ranks: tfb.decode_gathered(x, layout, n, 0.5))
            found |= _segment_dtypes(dec, g)
            dec(g)  # and it runs
    assert found, "the trace holds no segment reduction: the test no longer sees the codec"
    assert not {t for t in found if t[1] == tf.int64}, sorted(found)


def test_the_device_stream_verdict_is_the_protocols():
    """``host.stream_faults`` (the verdict in TF ops, on the device) flags a message exactly
    when ``protocol.check_stream`` raises for it: every kind of message, and statistics at the
    edges of each check, ``(max_q << b) + max_r`` far beyond int64 included."""
    from horovod_sbc import protocol, wire
    from horovod_sbc.tensorflow.backend import host as tfhost
    from horovod_sbc.tensorflow.backend.table import (C_B, C_COUNT, C_KIND, C_NUMEL, K_ALL_SIGNS,
                                                      K_ALL_VALUES, K_SIGNS, K_VALUES, N_COLS)
    rng = np.random.default_rng(5)
    rows, stats, want = [], [], []
    for case in range(4000):
        kind = int(rng.integers(0, 5))
        numel = int(rng.choice([1, 2, 7, 1000, 2 ** 40, 2 ** 62 - 1]) if case % 3 else
                    rng.integers(1, 5000))
        count = 0 if case % 11 == 0 else int(rng.integers(1, min(numel, 10 ** 6) + 1))
        every = kind in (K_ALL_SIGNS, K_ALL_VALUES)
        b = 0 if every else int(rng.choice([0, 1, 5, 31, 61, 62]))
        edge = lambda x: int(rng.choice([0, 1, max(x - 1, 0), x, x + 1, 2 ** 62]))  # noqa: E731
        max_r = edge(numel) if case % 4 == 0 else int(rng.integers(0, 2 ** min(b, 62) + 1))
        room = max(numel - 1 - max_r, 0) >> b
        st = protocol.StreamStats(
            ones=count if case % 7 else count + int(rng.choice([-1, 1])),
            unary_last_zero=case % 13 == 0, max_q=edge(room), max_r=max_r,
            rem_pad_nonzero=case % 17 == 0, pos_max=edge(numel) - 1,
            sign_pad_nonzero=case % 5 == 0, nonfinite=int(case % 9 == 0))
        msg = wire.TensorMessage(numel, count, b, 0.0, False, kind in (K_VALUES, K_ALL_VALUES),
                                 (0, 0), (0, 0), (0, 0), kind in (K_SIGNS, K_ALL_SIGNS), every)
        try:
            protocol.check_stream(msg, st, "t")
            want.append(False)
        except ValueError:
            want.append(True)
        row = [0] * N_COLS
        row[C_COUNT], row[C_B], row[C_KIND], row[C_NUMEL] = count, b, kind, numel
        rows.append(row)
        stats.append([int(v) for v in st])
    got = tfhost.stream_faults(tf.constant(rows, tf.int64), tf.constant(stats, tf.int64))
    assert got.numpy().tolist() == want
    assert 0.2 < np.mean(want) < 0.9  # both verdicts are exercised


def test_int64_segment_max_through_int32_is_exact():
    """The int32 replacement of int64 ``segment_max`` (position and gap statistics the verdict
    reads) gives TensorFlow's own results, extremes and empty segments included."""
    from horovod_sbc.tensorflow.backend.streams import _segment_max64
    rng = np.random.default_rng(7)
    i64 = np.iinfo(np.int64)
    edges = np.array([i64.min, -2 ** 32, -1, 0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32,
                      i64.max], np.int64)
    for case in range(200):
        n = int(rng.integers(1, 40))
        x = rng.choice(edges, n) if case % 2 else \
            rng.integers(i64.min, i64.max, n, dtype=np.int64, endpoint=True)
        seg = np.sort(rng.integers(0, 6, n)).astype(np.int32)  # some segments empty
        got = _segment_max64(tf.constant(x), tf.constant(seg)).numpy()
        want = tf.math.segment_max(tf.constant(x), tf.constant(seg)).numpy()
        np.testing.assert_array_equal(got, want, err_msg=f"x={x.tolist()} seg={seg.tolist()}")


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_the_step_is_framed_on_the_device_with_the_wire_bytes(graph):
    """The step header (CRC-32 of the body, lengths, layout) and the ERROR/SKIP step of a
    non-finite tensor, built in TF ops (the ops backend's frame, which GPU tensors take), are
    the bytes of the host frame (the CPU kernel backend's, from the wire module), with and
    without a fixed size, for bodies across the CRC's chunk boundaries; the CRC is zlib's."""
    import zlib
    rng = np.random.default_rng(11)
    for n in (0, 1, 1023, 1024, 1025, 4096 * 3 + 7, 70_000):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        crc = _graph(tfframe.crc32) if graph else tfframe.crc32
        for bound in (2 ** 32 - 1, n, n + 5000):  # the combination sized by the bound
            assert int(crc(tf.constant(data), bound)) == zlib.crc32(data.tobytes()), (n, bound)
    names = ["a", "b/kernel:0", "c"]
    numels = [5000, 40, 1_000_000]
    for case in range(12):
        sizes = [int(rng.integers(0, 3000)) for _ in names]
        headers = [np.array([0, int(rng.integers(0, 20)), int(rng.integers(0, 300)),
                             int(rng.integers(0, 2000)), int(rng.integers(0, 2 ** 32))],
                            np.int64) for _ in names]
        bodies = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
        finite = [True] * 3 if case % 3 else [True, bool(case % 2), False]
        capacity = None if case % 2 else 24 + sum(sizes) + 3 * 30 + 17
        layout_crc, rank, skip = int(rng.integers(0, 2 ** 32)), case % 4, case % 4 == 1

        def build(hs, bs, fs):
            step, pad = tfframe.frame(numels, hs, bs, layout_crc, capacity)
            return tfframe.step_or_error(step, pad, fs, names, layout_crc, rank, skip, capacity)
        fn = _graph(build) if graph else build
        step, pad = fn([tf.constant(h) for h in headers], [tf.constant(b) for b in bodies],
                       [tf.constant(f) for f in finite])
        want, want_pad = tfhost.frame_host(names, numels, layout_crc, rank, skip, capacity,
                                           np.array(finite), np.stack(headers), *bodies)
        assert step.numpy().tobytes() == want.tobytes() and int(pad) == want_pad, case


# One process with the kernels disabled by the environment (HOROVOD_SBC_KERNELS=0: the path GPU
# tensors take) answers test_ops_follow_the_environment_switch and both cases of
# test_an_exchange_has_one_host_step_and_none_before_the_allgather, one JSON line per part (each
# part's failure reported as its own): a TensorFlow and Horovod start costs seconds of CPU each.
_KERNELS_OFF = textwrap.dedent("""
    import json, traceback


    def report(part, fn):
        try:
            out = fn()
        except Exception:
            out = {"error": traceback.format_exc()}
        print(json.dumps({"part": part, "result": out}), flush=True)


    def switch():  # first, before anything else is imported or built
        from horovod_sbc import kernels
        from horovod_sbc.tensorflow import backend
        return [kernels.tf_ops() is None, type(backend.backend_for("CPU")).__name__]


    report("switch", switch)
    import numpy as np, tensorflow as tf, horovod.tensorflow as hvd
    hvd.init()
    from horovod_sbc.tensorflow.sync import exchange as tfx
    from horovod_sbc.tensorflow.backend import backend_for


    def host_steps(capacity):  # what an exchange's graph runs on the host, what its
        # allgather waits for (capacity: fixed-size steps or not)
        names, shapes = ["a", "b", "c"], [(500,), (20,), (3, 7)]

        def run(*t):
            return tfx.exchange(backend_for("CPU"), names, shapes, list(t[:3]), list(t[3:]),
                                density=0.05, skip=False, rank=0, size=1, scale=1.0, tag="t",
                                capacity=capacity)[1]

        args = [tf.constant(np.random.default_rng(0).standard_normal(s).astype(np.float32))
                for s in shapes] + [tf.zeros(s) for s in shapes]
        graph = tf.function(run).get_concrete_function(*args).graph
        nodes = {op.name: (op.type, [i.op.name for i in op.inputs] +
                           [c.name for c in op.control_inputs]) for op in graph.get_operations()}
        for f in graph.as_graph_def().library.function:  # nested functions: types only
            for n in f.node_def:
                nodes.setdefault(f.signature.name + "/" + n.name, (n.op, []))
        gather = [k for k, (t, _) in nodes.items() if t == "HorovodAllgather"]
        seen, todo = set(), list(gather)
        while todo:  # everything the allgather waits for
            k = todo.pop()
            if k not in seen:
                seen.add(k)
                todo += nodes.get(k, ("", []))[1]
        lib = {f.signature.name: f for f in graph.as_graph_def().library.function}
        branches = {n.attr[a].func.name for f in [graph.as_graph_def()] + list(lib.values())
                    for n in (f.node if hasattr(f, "node") else f.node_def)
                    if n.op in ("If", "StatelessIf") for a in ("then_branch", "else_branch")}
        host = [("main", op.name.split("/")[-1]) for op in graph.get_operations()
                if op.type in ("PyFunc", "EagerPyFunc")]
        host += [("branch" if fn in branches else "function", n.name.split("/")[-1])
                 for fn, f in lib.items() for n in f.node_def
                 if n.op in ("PyFunc", "EagerPyFunc")]
        return {"host": sorted({(w, n.rstrip("_0123456789")) for w, n in host}),
                "pyfunc": len(host),
                "before": sorted(nodes[k][0] for k in seen if "PyFunc" in nodes[k][0]),
                "gathers": len(gather)}


    for capacity in (None, 4000):
        report(repr(capacity), lambda: host_steps(capacity))
""")


@pytest.fixture(scope="module")
def kernels_off_process():
    """({part: result} of :data:`_KERNELS_OFF`'s process, the finished process)."""
    res = subprocess.run([sys.executable, "-c", _KERNELS_OFF], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, HOROVOD_SBC_KERNELS="0"))
    got = {}
    for line in res.stdout.splitlines():
        if line.startswith('{"part": '):
            d = json.loads(line)
            got[d["part"]] = d["result"]
    return got, res


@pytest.mark.xdist_group("tf_ops_kernels_off")
@pytest.mark.parametrize("capacity", [None, 4000], ids=["variable", "fixed-size"])
def test_an_exchange_has_one_host_step_and_none_before_the_allgather(capacity,
                                                                      kernels_off_process):
    """On the ops backend (the path GPU tensors take) the step message is framed in TF ops on
    the device: nothing the allgather waits for runs on the host; the decode's parse is the
    exchange's one host step, and the stream verdict's host step lies only in the branch a
    failed verdict takes (to word its error)."""
    parts, out = kernels_off_process  # HOROVOD_SBC_KERNELS=0: the GPU's path
    got = parts.get(repr(capacity))
    assert got is not None and "error" not in got, ((got or {}).get("error"), out.stderr[-3000:])
    # the parse on every step; the stream verdict's host step only in the branch a failed
    # verdict takes (its exact error message), the verdict itself in TF ops
    assert got == {"host": [["branch", "sbc_verdict"], ["main", "sbc_parse"]], "pyfunc": 2,
                   "before": [], "gathers": 1}, got
