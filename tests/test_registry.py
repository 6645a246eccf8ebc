"""The compressor registry: a compressor is one file (``horovod_sbc/compressors/stc.py``, STC,
is the newest; ``tests/user_compressor.py`` is one a user loads from outside the package) and
every backend and every decoder takes it unchanged.

For STC: the numpy reference reproduces its golden vectors; the torch encoder
(kernels on and off) and the TensorFlow encoder (eager and inside ``tf.function``) write the
same bytes and leave the same residual; valid and mutated step messages of it reach the same
verdict and values in every decoder. Its multi-rank runs (drop-in and stock hook in torch, the
drop-in tape in TF) are scenarios of the shared jobs in tests/torch_jobs.py and
tests/test_tensorflow.py.
"""
import contextlib
import json
import random

import numpy as np
import pytest
import torch

import stc_golden
import torch_codec
from horovod_sbc import kernels, reference, registry, wire
from horovod_sbc.config import SBCConfig
from horovod_sbc.torch import backend as tcodec
from test_differential import TFDecoders, _mutate_bytes, _step, decode_numpy, decode_torch

BUILTIN = ("sbc", "values", "sign", "terngrad", "stc")


def test_builtin_compressors_are_registered_and_unknown_modes_are_named():
    assert registry.names()[:5] == BUILTIN
    assert registry.get("stc").summary.startswith("top-k positions + their signs")
    with pytest.raises(ValueError, match=r"mode must be one of \('sbc', 'values', 'sign', "
                                         r"'terngrad', 'stc'.*got 'nope'"):
        SBCConfig(mode="nope")
    assert SBCConfig(mode="stc").binarize
    assert not SBCConfig(mode="values").binarize


def test_a_second_compressor_of_the_same_name_is_refused():
    class Other(registry.Compressor):
        name = "sbc"
    with pytest.raises(ValueError, match="a compressor named 'sbc' is already registered"):
        registry.register(Other())
    with pytest.raises(TypeError, match="takes a Compressor instance"):
        registry.register(stc_golden.STC)


def _golden():
    for v in json.loads(stc_golden.GOLDEN.read_text()):
        u = np.frombuffer(bytes.fromhex(v["update_hex"]), v["dtype"]).copy()
        yield v["name"], u, v["density"], bytes.fromhex(v["message_hex"]), \
            np.frombuffer(bytes.fromhex(v["residual_hex"]), "f8" if v["dtype"] == "float64"
                          else "f4")


def test_stc_golden_vectors_numpy():
    vectors = list(_golden())
    assert [v[0] for v in vectors] == [c[0] for c in stc_golden.golden_cases()]
    for name, u, density, msg, res in vectors:
        got, got_res = reference.compress_np(u, None, density, mode="stc")
        assert got == msg, name
        assert got_res.tobytes() == res.tobytes(), name
        h = wire.parse_tensor_header(msg, 0)
        if name == "zeros":
            assert h.count == 0 and not h.has_signs
        else:  # the k largest, or every non-zero where there are fewer (never a zero)
            k = min(reference.keep_count(u.size, density), np.count_nonzero(u))
            assert h.count == k and h.has_signs and not h.has_values, name
            assert len(msg) <= registry.get("stc").capacity(u.size, density)


@pytest.mark.parametrize("kernels_on", [True, False])
def test_stc_torch_writes_the_golden_bytes(kernels_on):
    for name, u, density, msg, res in _golden():
        a = torch.from_numpy(u.copy())
        with kernels.disabled() if not kernels_on else contextlib.nullcontext():
            got, count = torch_codec.compress_(a, density, "stc", name)
        assert got.numpy().tobytes() == msg, name
        assert a.numpy().tobytes() == res.tobytes(), name


def test_stc_tensorflow_writes_the_golden_bytes_eager_and_in_tf_function():
    tf = pytest.importorskip("tensorflow")
    from horovod_sbc.tensorflow import backend as tfb
    for name, u, density, msg, _ in _golden():
        zero = tf.zeros(u.shape, tf.float64 if u.dtype == np.float64 else tf.float32)
        # A = dW + R with R = 0 (so -0.0 entries of dW become +0.0, in numpy too)
        res = reference.compress_np(u, np.zeros_like(u), density, mode="stc")[1]
        fn = tf.function(lambda x, r, d=density, n=name: tfb.compress(x, r, d, "stc", name=n))
        for how, f in (("eager", lambda x, r: tfb.compress(x, r, density, "stc", name=name)),
                       ("tf.function", fn)):
            got, got_res = f(tf.constant(u), zero)
            assert got.numpy().tobytes() == msg, (name, how)
            assert got_res.numpy().tobytes() == res.tobytes(), (name, how)


def test_stc_nonfinite_update_is_refused_by_every_encoder():
    u = np.ones(50, np.float32)
    u[7] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        reference.compress_np(u, None, 0.1, mode="stc")
    with pytest.raises(tcodec.NonFiniteError, match="'w' contains NaN or Inf"):
        tcodec.backend_for("cpu").encode_tensor(torch.from_numpy(u), 0.1, "stc", "w")


def test_stc_steps_decode_the_same_in_every_decoder():
    """Valid and mutated step messages of STC tensors through numpy, torch (kernels on and
    off) and TF (eager, tf.function): identical verdicts and bits. TensorFlow is installed
    here: without it this test fails (ImportError), it does not pass on torch alone."""
    tf_dec = TFDecoders()
    layout = [("w", (40, 30)), ("b", (7,))]
    seen = set()
    for seed in range(40):
        r = random.Random(seed)
        rng = np.random.default_rng(seed)
        n_ranks = r.randint(1, 3)
        steps = []
        for _ in range(n_ranks):
            parts = [reference.compress_np(rng.standard_normal(wire.layout_numel(s))
                                           .astype(np.float32), None,
                                           r.choice([0.01, 0.1, 1.0]), mode="stc")[0]
                     for _, s in layout]
            if seed % 2:  # a damaged tensor message, the step framing recomputed
                j = r.randrange(len(parts))
                parts[j] = bytes(_mutate_bytes(bytearray(parts[j]), r))
            steps.append(_step(layout, parts))
        data = b"".join(steps)
        scale = 1.0 / n_ranks
        ref = decode_numpy(layout, n_ranks, data, scale)
        seen.add(ref[0])
        got = {"torch": decode_torch(layout, n_ranks, data, scale)}
        with kernels.disabled():
            got["torch (tensor ops)"] = decode_torch(layout, n_ranks, data, scale)
        got["tf eager"] = tf_dec.run(layout, n_ranks, data, scale, False)
        got["tf.function"] = tf_dec.run(layout, n_ranks, data, scale, True)
        for who, out in got.items():
            assert out == ref, (seed, who, str(out)[:200], str(ref)[:200])
    assert {"ok", "invalid"} <= seen, seen


def test_terngrad_torch_and_tensorflow_match_the_numpy_reference_given_the_draws():
    """TernGrad's numpy reference takes the uniform draws; torch's encoder with a seeded
    generator and TF's with a stateless seed reproduce it from the draws they made."""
    rng = np.random.default_rng(3)
    u = (rng.standard_normal(3000) ** 3).astype(np.float32)
    g = torch.Generator().manual_seed(11)
    draws = torch.rand(u.size, generator=torch.Generator().manual_seed(11)).numpy()
    want, want_res = reference.compress_np(u, None, 1.0, mode="terngrad", uniform=draws)
    a = torch.from_numpy(u.copy())
    enc = tcodec.backend_for("cpu").encode_tensor(a, 1.0, "terngrad", "w", generator=g)
    enc.commit()
    msg, pos = enc.message, enc.positions
    assert msg.numpy().tobytes() == want
    assert a.numpy().tobytes() == want_res.tobytes()
    assert 0 < pos.numel() < u.size
    tf = pytest.importorskip("tensorflow")
    from horovod_sbc.tensorflow import backend as tfb
    seed = tf.constant([5, 7], tf.int64)
    tf_draws = tf.random.stateless_uniform([u.size], seed=seed, dtype=tf.float32).numpy()
    want, want_res = reference.compress_np(u, None, 1.0, mode="terngrad", uniform=tf_draws)
    for how in ("eager", "tf.function"):
        def enc(x):
            (e,) = tfb.backend_for("CPU").encode(["w"], [None], [x], density=1.0,
                                                  mode="terngrad", seeds=[seed])
            return e.message, e.new_residual
        f = tf.function(enc) if how == "tf.function" else enc
        got, got_res = f(tf.constant(u))
        assert got.numpy().tobytes() == want, how
        assert got_res.numpy().tobytes() == want_res.tobytes(), how
        zero = np.zeros(40, np.float32)  # nothing to send: the one empty message, everywhere
        empty = reference.compress_np(zero, None, 1.0, mode="terngrad", uniform=zero)[0]
        assert f(tf.constant(zero))[0].numpy().tobytes() == empty, how
        assert tcodec.backend_for("cpu").encode_tensor(torch.zeros(40), 1.0, "terngrad", "z",
                                                       generator=g).message \
            .numpy().tobytes() == empty


# ------------------------------------------------------------------------------------------------
# the backends read a compressor's declarations, never its name
# ------------------------------------------------------------------------------------------------
_BACKEND_DIRS = ("horovod_sbc/torch/backend", "horovod_sbc/tensorflow/backend")


def _name_comparisons(source: str, names) -> list:
    """(line, code) of every comparison of a value with one of ``names`` written as a string
    literal (``== "sbc"``, ``"values" != x``, ``in ("sbc", "values")``) and every dict keyed by
    one; docstrings and comments are not code and do not count."""
    import ast

    def is_name(node):
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and \
            node.value in names

    hits = []
    for node in ast.walk(ast.parse(source)):
        found = False
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found = found or any(is_name(e) for e in elts)
        elif isinstance(node, ast.Dict):
            found = any(k is not None and is_name(k) for k in node.keys)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith"):
            found = any(is_name(a) for a in node.args)
        if found:
            hits.append((node.lineno, ast.get_source_segment(source, node)))
    return hits


def test_the_name_check_sees_every_form_of_comparison():
    names = set(BUILTIN)
    code = ('a = mode == "sbc"\nb = "values" != mode\nc = mode in ("sbc", "values")\n'
            'd = mode not in ["sign"]\ne = {"terngrad": 1}[mode]\nf = mode.startswith("sbc")\n'
            'def g(mode="sbc"):\n    """mode == "sbc" in a docstring"""\n    return "sbc"\n'
            'h = "sbc" if mode is True else "values"  # mode == "values"\n')
    assert sorted(line for line, _ in _name_comparisons(code, names)) == [1, 2, 3, 4, 5, 6]


def test_no_backend_compares_a_mode_with_a_compressors_name():
    """The backends take what they need of a compressor from its declarations
    (``native_kernel``, ``message``, ``sides`` of ``registry.get(mode)``): no backend source
    compares a mode with a registered name, so a compressor can never again be special-cased
    by name below the registry."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    files = [p for d in _BACKEND_DIRS for p in sorted((root / d).rglob("*.py"))]
    assert len(files) > 10, files
    names = set(registry.names())
    assert {"sbc", "values", "stc"} <= names
    found = {str(p.relative_to(root)): hits for p in files
             if (hits := _name_comparisons(p.read_text(), names))}
    assert not found, found


def test_what_the_builtin_compressors_declare():
    m = registry.Message
    got = {n: (registry.get(n).message, registry.get(n).sides, registry.get(n).native_kernel,
               registry.get(n).fused) for n in BUILTIN}
    assert got == {"sbc": (m.BINARY, 2, True, True), "values": (m.VALUES, 1, True, True),
                   "sign": (m.SIGNS, 1, False, False), "terngrad": (m.SIGNS, 1, False, False),
                   "stc": (m.SIGNS, 1, False, True)}
    for n in BUILTIN:  # the backends encode natively exactly what has no encoder
        c = type(registry.get(n))
        own = c.encode_torch is not registry.Compressor.encode_torch
        assert own == (c.encode_tf is not registry.Compressor.encode_tf) == \
            (not c.native_kernel), n


def test_register_refuses_contradictory_declarations():
    def make(**attrs):
        return type("Bad", (registry.Compressor,), {"name": "bad-one", **attrs})()

    with pytest.raises(ValueError, match="must declare its message form"):
        registry.register(make())
    with pytest.raises(ValueError, match="binarize=False contradicts its message SIGNS"):
        registry.register(make(message=registry.Message.SIGNS))
    with pytest.raises(ValueError, match="sides must be 1 or 2"):
        registry.register(make(message=registry.Message.VALUES, sides=3))
    with pytest.raises(ValueError, match=r"own encoders implement only.*not \(SIGNS, 1\)"):
        registry.register(make(message=registry.Message.SIGNS, binarize=True,
                               native_kernel=True, fused=True))
    with pytest.raises(ValueError, match="native_kernel=True needs fused=True"):
        registry.register(make(message=registry.Message.VALUES, native_kernel=True))
    with pytest.raises(ValueError, match=r"fused codec implements only.*not \(VALUES, 2\)"):
        registry.register(make(message=registry.Message.VALUES, sides=2, native_kernel=True,
                               fused=True))
    with pytest.raises(ValueError, match=r"not \(SIGNS, 1, random\); declare fused=False"):
        registry.register(make(message=registry.Message.SIGNS, binarize=True, random=True,
                               fused=True))
    assert "bad-one" not in registry.names()


class _Spy:
    """Counts the calls of STC's own encoders (keyword arguments only) while in use."""

    def __init__(self, monkeypatch):
        self.calls = []
        cls = stc_golden.STC
        for attr in ("encode_torch", "encode_tf"):
            real = getattr(cls, attr)

            def spy(comp, a, *args, _real=real, _attr=attr, **kw):
                assert not args, f"{_attr} called with positional arguments {args}"
                assert set(kw) == {"density", "selection", "name", "generator"}, kw
                self.calls.append((_attr, kw["name"]))
                return _real(comp, a, **kw)
            monkeypatch.setattr(cls, attr, spy)


class _OwnSTC(stc_golden.STC):
    """STC's encoders under another name, declared neither native nor fused: what a user's
    new compressor is."""
    name = "stc_own"
    fused = False


@pytest.fixture
def own_stc():
    registry.register(_OwnSTC())
    yield "stc_own"
    registry._REGISTRY.pop("stc_own")


def test_a_compressor_without_native_kernel_runs_its_own_encoder_tensor_by_tensor(
        monkeypatch, own_stc):
    """A compressor neither ``native_kernel`` nor ``fused``: every torch backend (C kernels on
    and off, every kind of source) calls its ``encode_torch`` by keyword; STC, ``fused``, is
    encoded by the C kernels (its own encoder is never called) and by its own encoder with
    them off; every TF backend (kernel ops and TF ops, eager and in tf.function) calls STC's
    ``encode_tf``; all write the reference's bytes."""
    assert not registry.get("stc").native_kernel and registry.get("stc").fused
    spy = _Spy(monkeypatch)
    rng = np.random.default_rng(47)
    u = rng.standard_normal(500).astype(np.float32)
    r = rng.standard_normal(500).astype(np.float32)
    u[20:] = -r[20:]  # A is 0 beyond 20 entries: 5 zeros among the top 25, never sent
    want = reference.compress_np(u, r, 0.05, mode="stc")[0]
    want_a = reference.compress_np(u + r, None, 0.05, mode="stc")[0]
    assert want == want_a  # A = R + dW in float32 either way
    assert wire.parse_tensor_header(want, 0).count == 20
    for mode in (own_stc, "stc"):
        for kernels_on in (True, False):
            with kernels.disabled() if not kernels_on else contextlib.nullcontext():
                backend = tcodec.backend_for("cpu")
                assert isinstance(backend, tcodec.KernelBackend) == kernels_on
                sources = {
                    "in-place": torch.from_numpy(u + r),
                    "accumulate": tcodec.Accumulate(torch.from_numpy(r.copy()),
                                                    torch.from_numpy(u.copy())),
                    "difference": tcodec.Difference(torch.from_numpy(u + r), torch.zeros(500)),
                }
                for how, src in sources.items():
                    spy.calls.clear()
                    enc = backend.encode_tensor(src, 0.05, mode, how)
                    assert enc.message.numpy().tobytes() == want, (mode, kernels_on, how)
                    own = mode == own_stc or not kernels_on
                    assert spy.calls == ([("encode_torch", how)] if own else []), \
                        (mode, kernels_on, how)
    tf = pytest.importorskip("tensorflow")
    from horovod_sbc.tensorflow import backend as tfb
    backends = [tfb.backend_for("CPU"), tfb.OpsBackend()]
    assert isinstance(backends[0], tfb.KernelBackend)
    for b in backends:
        for graph in (False, True):
            def enc(x, y, b=b):
                (e,) = b.encode(["w"], [x], [y], density=0.05, mode="stc")
                return e.message
            spy.calls.clear()
            got = (tf.function(enc) if graph else enc)(tf.constant(u), tf.constant(r))
            assert got.numpy().tobytes() == want, (b, graph)
            assert spy.calls == [("encode_tf", "w")], (b, graph, spy.calls)


def test_a_fused_compressor_is_encoded_by_the_fused_codec_for_a_whole_sync(monkeypatch):
    """STC declares ``fused=True``: the tensor-op backend's ``encode_many`` (the device path)
    encodes every tensor at once without calling ``encode_torch`` (whose per-tensor host reads
    a GPU must not pay), with the reference's bytes and residuals; the C kernels' backend
    leaves it to its per-tensor path."""
    spy = _Spy(monkeypatch)
    rng = np.random.default_rng(48)
    us = [rng.standard_normal(n).astype(np.float32) for n in (500, 3, 1200)]
    rs = [rng.standard_normal(n).astype(np.float32) for n in (500, 3, 1200)]
    want = [reference.compress_np(u, r, 0.05, mode="stc") for u, r in zip(us, rs)]
    with kernels.disabled():
        backend = tcodec.backend_for("cpu")
        res = [torch.from_numpy(r.copy()) for r in rs]
        srcs = [tcodec.Accumulate(r, torch.from_numpy(u.copy())) for r, u in zip(res, us)]
        sync = backend.encode_many(srcs, 0.05, "stc", "paper", ["a", "b", "c"])
        assert sync is not None and spy.calls == []
        sync.commit()
        for i, (msg, residual) in enumerate(want):
            assert sync.encoding.message(i).numpy().tobytes() == msg, i
            assert res[i].numpy().tobytes() == residual.tobytes(), i
    assert tcodec.backend_for("cpu").encode_many(
        [tcodec.Accumulate(torch.zeros(5), torch.ones(5))], 0.05, "stc", "paper", ["a"]) is None
