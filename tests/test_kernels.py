"""The C kernels of the torch CPU codec (horovod_sbc.kernels) against the tensor-op path and the
numpy reference: the same bytes, positions, sums and verdicts; bounded memory; a working
fallback when they cannot be built."""
import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from horovod_sbc import reference, kernels, wire
from horovod_sbc.torch import backend as tb
from horovod_sbc.torch.backend import (Accumulate, Difference, Targets, backend_for, ckernels,
                                       frame, select)

import torch_codec

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler here")


def _inputs():
    """Updates that stress the selection: sizes around the exact/sampled switch, heavy ties,
    one-signed, sparse, subnormal and heavy-tailed values."""
    rng = np.random.default_rng(11)
    for n in (1, 3, 100, 16384, 16385, 50_000, 400_000):
        yield n, "normal", rng.standard_normal(n).astype(np.float32)
        yield n, "ties", rng.integers(-3, 4, n).astype(np.float32)
        yield n, "positive", np.abs(rng.standard_normal(n)).astype(np.float32)
        x = np.zeros(n, np.float32)
        x[rng.integers(0, n, 5)] = -2.0
        yield n, "sparse", x
        yield n, "subnormal", (rng.standard_normal(n) * 1e-40).astype(np.float32)
        yield n, "cauchy", rng.standard_cauchy(n).astype(np.float32)


@pytest.mark.parametrize("mode,selection", [("sbc", "paper"), ("sbc", "magnitude"),
                                            ("values", "paper")])
def test_kernel_encoder_matches_tensor_ops_and_numpy(mode, selection):
    for n, kind, a in _inputs():
        for density in (1e-4, 1e-3, 1e-2, 5e-2, 0.3, 1.0):
            got = torch_codec.encode(torch.from_numpy(a.copy()), density, mode,
                                      selection=selection)
            with kernels.disabled():
                want = torch_codec.encode(torch.from_numpy(a.copy()), density, mode,
                                           selection=selection)
            what = f"{mode}/{selection} n={n} {kind} p={density}"
            assert torch.equal(got[0], want[0]), what
            assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), what
            if mode == "sbc":
                ref = a.copy()
                msg, _ = reference.compress_np(ref, None, density, selection=selection)
                assert got[0].numpy().tobytes() == msg, what


@pytest.mark.parametrize("mode,selection", [("sbc", "paper"), ("sbc", "magnitude"),
                                            ("values", "paper")])
def test_difference_encoder_matches_the_materialised_update(mode, selection):
    """``Difference(w, wref)`` (the drop-in's update when its residual lives in the
    weights): the kernels select on ``w - wref`` in their pass without storing it. The message,
    positions and values equal those of the materialised float32 ``w - wref``; ``w`` and
    ``wref`` are not written; a NaN/Inf anywhere is reported with nothing changed."""
    rng = np.random.default_rng(17)
    for n, kind, a in _inputs():
        wref = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        w = wref + torch.from_numpy(a)
        w0, wref0 = w.clone(), wref.clone()
        for density in (1e-3, 1e-2, 5e-2, 1.0):
            want = torch_codec.encode(w - wref, density, mode, selection=selection)
            got = torch_codec.encode(Difference(w, wref), density, mode, selection=selection)
            what = f"{mode}/{selection} n={n} {kind} p={density}"
            for g, x in zip(got, want):
                assert torch.equal(g, x), what
            assert torch.equal(w, w0) and torch.equal(wref, wref0), what
        if n > 3:
            w[n // 2] = float("nan") if kind != "ties" else float("inf")
            with pytest.raises(tb.NonFiniteError, match="'t' contains NaN or Inf"):
                torch_codec.encode(Difference(w, wref), 0.01, mode, name="t",
                                   selection=selection)
            assert torch.equal(wref, wref0)


_SELECTION_DIGEST = textwrap.dedent("""
    import hashlib, numpy as np, torch
    from horovod_sbc.torch.backend import Accumulate, Difference, NonFiniteError, backend_for
    kb = backend_for("cpu")

    def enc(*args, **kw):
        e = kb.encode_tensor(*args, **kw)
        return e.message, e.positions, e.sent

    rng = np.random.default_rng(3)
    h = hashlib.sha256()
    for n in (1, 63, 64, 65, 4095, 4097, 16385, 200_003):
        xs = [rng.standard_normal(n), rng.integers(-2, 3, n), rng.standard_cauchy(n)]
        bad = rng.standard_normal(n)
        bad[rng.integers(0, n)] = float(rng.choice([np.nan, np.inf, -np.inf]))
        for x in xs + [bad]:
            for p in (1e-4, 1e-2, 0.05, 0.3):
                for mode, sel in (("sbc", "paper"), ("sbc", "magnitude"), ("values", "paper")):
                    try:
                        m, pos, _ = enc(torch.tensor(x, dtype=torch.float32),
                                                        p, mode, selection=sel)
                        h.update(m.numpy().tobytes() + pos.numpy().tobytes())
                    except NonFiniteError:
                        h.update(b"nonfinite")
                for sel, consume in (("paper", False), ("paper", True), ("magnitude", True)):
                    # A = R + dW formed in the pass (the AVX-512 loop stores it, and zeroes
                    # a consumed dW)
                    r = torch.tensor(x, dtype=torch.float32)
                    g = torch.tensor(rng.standard_normal(n), dtype=torch.float32)
                    try:
                        m, pos, _ = enc(
                            Accumulate(r, g, consume), 0.01, selection=sel)
                        h.update(m.numpy().tobytes() + pos.numpy().tobytes())
                    except NonFiniteError:
                        h.update(b"nonfinite")
                    h.update(r.numpy().tobytes() + g.numpy().tobytes())
                for sel in ("paper", "magnitude"):  # A = w - wref formed in the pass
                    w = torch.tensor(x, dtype=torch.float32)
                    wref = torch.tensor(rng.standard_normal(n), dtype=torch.float32)
                    w += wref
                    try:
                        m, pos, _ = enc(Difference(w, wref), 0.01,
                                                        selection=sel)
                        h.update(m.numpy().tobytes() + pos.numpy().tobytes())
                    except NonFiniteError:
                        h.update(b"nonfinite")
    from horovod_sbc import kernels
    print(kernels.lib().sbc_simd_level(), h.hexdigest())
""")


def _digests_by_simd(script: str, settings):
    """Run ``script`` (prints the SIMD level it used and a digest) once per
    ``HOROVOD_SBC_SIMD`` setting, each in a fresh process: ({setting: digest}, {setting: level})."""
    digests, levels = {}, {}
    for simd in settings:
        env = {**os.environ, "HOROVOD_SBC_SIMD": simd}
        res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=300, env=env)
        assert res.returncode == 0, res.stderr[-2000:]
        level, digest = res.stdout.split()
        digests[simd], levels[simd] = digest, int(level)
    return digests, levels


def test_candidate_pass_variants_select_the_same():
    """The selection has three variants: AVX-512 (the candidate pass's compares and packed
    pushes in one loop; the kept candidates packed 16 at a time), SSE2 masks and portable C
    masks (``HOROVOD_SBC_SIMD=c`` / ``sse2``; the best the CPU has by default). Each must
    select exactly the same elements: messages, positions and NaN/Inf verdicts, across block
    and chunk boundaries, with ties at the cut (integer inputs). Every variant this CPU has runs (the level
    each subprocess used is checked, so the fast one cannot silently fall back)."""
    digests, levels = _digests_by_simd(_SELECTION_DIGEST, ("c", "sse2", "default"))
    best = kernels.lib().sbc_simd_level()
    assert levels == {"c": 0, "sse2": min(1, best), "default": best}
    assert len(set(digests.values())) == 1 and len(digests["c"]) == 64, (digests, levels)


_DECODE_DIGEST = textwrap.dedent("""
    # Rice streams built here (every b the fast decoder takes, 0..32; counts around its
    # 16-wide groups and 2,048-entry chunks; long unary runs), valid and with flipped bits,
    # decoded in one sbc_decode_batch call: prints the level used and a digest of every
    # message's statistics and positions; valid messages are checked against numpy here.
    import ctypes, hashlib, numpy as np
    from horovod_sbc import kernels
    lib = kernels.lib()
    rng = np.random.default_rng(11)

    def bits_of(vals, width):  # MSB first
        if width == 0 or not len(vals):
            return np.zeros(0, np.uint8)
        sh = np.arange(width - 1, -1, -1, dtype=np.uint64)
        return ((vals.astype(np.uint64)[:, None] >> sh) & 1).astype(np.uint8).ravel()

    msgs, want = [], []
    for b in range(33):
        for count in (1, 15, 16, 17, 31, 100, 2047, 2048, 2049, 2065, 6000):
            if count * (2 ** b) > 2 ** 33:
                continue
            q = rng.geometric(0.6, count).astype(np.int64) - 1
            if count > 50:
                q[rng.integers(0, count, 3)] = rng.integers(100, 20000, 3)  # long zero runs
            r = rng.integers(0, 2 ** b, count, dtype=np.uint64) if b else np.zeros(count, np.uint64)
            ones = np.cumsum(q + 1) - 1
            ubits = np.zeros(int(ones[-1]) + 1, np.uint8)
            ubits[ones] = 1
            u = np.packbits(ubits)
            rem = np.packbits(bits_of(r, b))
            pos = np.cumsum((q.astype(np.uint64) << np.uint64(b)) + r + np.uint64(1)) - np.uint64(1)
            last = int(pos[-1])
            for numel in (last + 1 + int(rng.integers(0, 1000)), max(1, last // 2)):
                numel = min(numel, 2 ** 32)
                msgs.append((u, rem, count, b, numel))
                want.append((q, r, pos, numel))
                for _ in range(2):  # mutated: a flipped unary or remainder bit
                    u2, rem2 = u.copy(), rem.copy()
                    if rem2.size and rng.random() < 0.5:
                        rem2[rng.integers(0, rem2.size)] ^= np.uint8(1 << int(rng.integers(0, 8)))
                    else:
                        u2[rng.integers(0, u2.size)] ^= np.uint8(1 << int(rng.integers(0, 8)))
                    msgs.append((u2, rem2, count, b, numel))
                    want.append(None)
    parts, cols, at = [], [[] for _ in range(7)], 0
    for u, rem, count, b, numel in msgs:
        for col, v in zip(cols, (at, u.size, at + u.size, rem.size, count, b, numel)):
            col.append(v)
        parts += [u, rem]
        at += u.size + rem.size
    buf = np.concatenate(parts).astype(np.uint8)
    arrs = [np.array(c, dtype=np.int64) for c in cols]
    st = np.zeros(6 * len(msgs), dtype=np.int64)
    rc = lib.sbc_decode_batch(buf.ctypes.data, buf.size, len(msgs),
                              *[a.ctypes.data for a in arrs], st.ctypes.data)
    assert rc == 0, rc
    st = st.reshape(-1, 6)
    h = hashlib.sha256(st.tobytes())
    off, checked = 0, 0
    for j, (m, w) in enumerate(zip(msgs, want)):
        count = m[2]
        out = np.zeros(count, dtype=np.int64)
        if st[j, 0] == count and st[j, 5] >= 0:
            assert lib.sbc_positions(off, count, out.ctypes.data) == 0
            h.update(out.tobytes())
        if w is not None:
            q, r, pos, numel = w
            assert st[j, 0] == count and st[j, 2] == q.max() and st[j, 3] == r.max(), (j, m[3])
            assert st[j, 4] == 0
            if (int(q.max()) << m[3]) + int(r.max()) < numel:
                assert st[j, 5] == int(pos[-1]), (j, m[3], count)  # the protocol's pos_max
            if int(pos[-1]) < numel:
                assert np.array_equal(out, pos.astype(np.int64)), (j, m[3], count)
                checked += 1
        off += count
    assert checked > 200, checked
    print(lib.sbc_simd_level(), h.hexdigest())
""")


def test_decoder_variants_agree():
    """The Rice decoder's second pass takes 16 positions at a time with AVX-512 (F, BW, VBMI)
    where the CPU has them, else one at a time: on streams of every Rice parameter the fast
    decoder takes, with counts around its group and chunk sizes, valid and with flipped bits,
    both give the same statistics (the protocol's verdict) and positions, and valid streams
    decode to what numpy computes."""
    digests, levels = _digests_by_simd(_DECODE_DIGEST, ("sse2", "default"))
    assert levels == {"sse2": min(1, kernels.lib().sbc_simd_level()),
                      "default": kernels.lib().sbc_simd_level()}
    assert digests["sse2"] == digests["default"], (digests, levels)


def test_close_means_choose_the_reference_side():
    """The paper rule writes only the winning side when the two means are far apart and both
    sides when they are close: around that boundary (means equal, one float32 ulp apart, ...,
    1e-5 apart, either side ahead) the message is the reference's, and both branches run."""
    rng = np.random.default_rng(5)
    branches = set()
    for n in (1000, 120_000):
        base = np.abs(rng.standard_normal(n // 2)).astype(np.float32) + 0.5
        for eps in (0.0, 2.0 ** -24, -2.0 ** -24, 1e-7, -1e-7, 5e-7, 1e-6, -1e-6, 3e-6, 1e-5,
                    -1e-5):
            a = np.concatenate([base, -(base * np.float32(1 + eps))]).astype(np.float32)
            a = a[rng.permutation(n)]
            for density in (0.01, 0.3):
                k = reference.keep_count(n, density)
                sel = ckernels._select_c(kernels.lib(), torch.from_numpy(a.copy()), k, 0, "t",
                                      dst=torch.empty(k, dtype=torch.int64))
                branches.add(sel.in_dst is not None)
                got, _, _ = torch_codec.encode(torch.from_numpy(a.copy()), density, "sbc")
                want, _ = reference.compress_np(a.copy(), None, density)
                assert got.numpy().tobytes() == want, (n, eps, density)
    assert branches == {True, False}


def test_float32_rounding_of_host_means_matches_torch():
    rng = np.random.default_rng(6)
    xs = [1e39, -1e39, 3.4028235677973366e38, 3.4028235e38, 1e-45, 7e-46, -7e-46, 0.0, -0.0]
    xs += list(np.exp(rng.uniform(-110, 88, 20_000)) * rng.choice([-1, 1], 20_000))
    for x in xs:
        want = float(torch.tensor(float(x), dtype=torch.float64).to(torch.float32))
        assert np.float64(select.f32(float(x))).tobytes() == np.float64(want).tobytes(), x


def test_accumulate_forms_r_plus_dw_and_puts_it_back_when_rejected():
    rng = np.random.default_rng(2)
    r = rng.standard_normal(100_000).astype(np.float32)
    g = rng.standard_normal(100_000).astype(np.float32)
    a = torch.from_numpy(r.copy())
    msg, pos, sent = torch_codec.encode(Accumulate(a, torch.from_numpy(g)), 0.01, "sbc", "w")
    assert np.array_equal(a.numpy(), r + g)
    want = torch_codec.encode(torch.from_numpy(r + g), 0.01, "sbc", "w")
    assert torch.equal(msg, want[0]) and torch.equal(pos, want[1])
    g[77_000] = np.nan
    a = torch.from_numpy(r.copy())
    with pytest.raises(tb.NonFiniteError, match="'w' contains NaN or Inf"):
        torch_codec.encode(Accumulate(a, torch.from_numpy(g)), 0.01, "sbc", "w")
    # put back: (R + g) - g, the entries made non-finite by g restarted at 0
    want = np.nan_to_num((r + g) - g, nan=0.0, posinf=0.0, neginf=0.0)
    assert np.array_equal(a.numpy(), want)


@pytest.mark.parametrize("mode", ["sbc", "values", "sign"])
@pytest.mark.parametrize("use_kernels", [True, False])
def test_consumed_addend_is_added_then_zeroed_even_when_rejected(mode, use_kernels):
    """``Accumulate(r, g, consume=True)``: the encode adds g (as a plain addend would: the same
    message, the same ``R + g``) and leaves g all zeros, also when it raises for a NaN (the
    residual then keeps ``R + g``, its non-finite entries at 0: g is not at hand to take back);
    on the kernel path in its pass, else by a zero_() after the add."""
    rng = np.random.default_rng(5)
    n = 70_001  # whole AVX-512 blocks, then a partial one
    r = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    with kernels.disabled() if not use_kernels else contextlib.nullcontext():
        want = torch_codec.encode(
            Accumulate(torch.from_numpy(r.copy()), torch.from_numpy(g.copy())), 0.01, mode, "w")
        a, gt = torch.from_numpy(r.copy()), torch.from_numpy(g.copy())
        got = torch_codec.encode(Accumulate(a, gt, True), 0.01, mode, "w")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert np.array_equal(a.numpy(), r + g)
        assert not gt.any() and not torch.signbit(gt).any()  # +0.0 everywhere
        g[50_000] = np.nan
        a, gt = torch.from_numpy(r.copy()), torch.from_numpy(g.copy())
        with pytest.raises(tb.NonFiniteError, match="'w' contains NaN or Inf"):
            torch_codec.encode(Accumulate(a, gt, True), 0.01, mode, "w")
        assert np.array_equal(a.numpy(), np.nan_to_num(r + g, nan=0.0, posinf=0.0, neginf=0.0))
        assert not gt.any()


def _batch_sources(rng, kind: str, xs):
    """Fresh sources of ``kind`` over the updates ``xs`` (numpy), the same every call with
    the same ``rng`` state."""
    rs = [rng.standard_normal(x.size).astype(np.float32) for x in xs]
    t = lambda v: torch.from_numpy(v.copy())  # noqa: E731
    if kind == "plain":
        return [t(x) for x in xs]
    if kind == "difference":
        return [Difference(t(x + r), t(r)) for x, r in zip(xs, rs)]
    return [Accumulate(t(r), t(x), kind == "consume") for x, r in zip(xs, rs)]


def _state(src):
    if isinstance(src, torch.Tensor):
        return [src]
    if isinstance(src, Accumulate):
        return [src.residual, src.addend]
    return [src.weights, src.reference]


@pytest.mark.parametrize("kind", ["plain", "accumulate", "consume", "difference"])
def test_a_whole_sync_in_one_call_is_the_per_tensor_encoder(kind):
    """``KernelBackend.encode_many`` (SBC, one kernel call for every tensor) writes the bytes
    of ``encode_tensor`` tensor by tensor and, once committed, leaves every residual, addend
    and weight bit for bit as the per-tensor encodings and commits do: both selections, every
    density, layouts of empty, one-element, tied, one-signed, sparse, subnormal and
    heavy-tailed tensors beside large ones (the sampled selection), sizes straddling the
    exact/sampled switch."""
    backend = backend_for("cpu")
    assert isinstance(backend, ckernels.KernelBackend)
    inputs = [a for _, _, a in _inputs()]
    rng = np.random.default_rng(21)
    for trial in range(24):
        picks = rng.choice(len(inputs), int(rng.integers(1, 9)))
        xs = [inputs[i] for i in picks] + ([np.zeros(0, np.float32)] if trial % 5 == 0 else [])
        density = float(rng.choice([1e-4, 1e-2, 5e-2, 0.3, 1.0]))
        selection = "paper" if trial % 3 else "magnitude"
        names = [f"t{i}" for i in range(len(xs))]
        seed = int(rng.integers(1 << 30))
        many = _batch_sources(np.random.default_rng(seed), kind, xs)
        one = _batch_sources(np.random.default_rng(seed), kind, xs)
        sync = backend.encode_many(many, density, "sbc", selection, names)
        assert isinstance(sync, ckernels.KernelSync)
        encs = [backend.encode_tensor(s, density, "sbc", n, selection)
                for s, n in zip(one, names)]
        what = f"trial {trial}: {kind} {selection} p={density}"
        assert [sync.message(i).numpy().tobytes() for i in range(len(xs))] == \
            [e.message.numpy().tobytes() for e in encs], what
        assert sync.positions.numel() == sum(e.positions.numel() for e in encs), what
        sync.commit()
        for e in encs:
            e.commit()
        for a, b in zip(many, one):
            for x, y in zip(_state(a), _state(b)):
                assert torch.equal(x.view(torch.int32), y.view(torch.int32)), what
        framed = sync.frame(1234)
        assert framed.numpy().tobytes() == frame.frame([e.message for e in encs], 1234,
                                                       framed.device).numpy().tobytes()


def test_a_whole_sync_in_one_call_declines_what_it_does_not_encode():
    """Other compressors, sources the kernels do not form in their pass (another dtype, a
    2-D addend), or the kernels off: None, and the caller encodes tensor by tensor."""
    backend = backend_for("cpu")
    ok = [Accumulate(torch.zeros(10), torch.ones(10))]
    assert backend.encode_many(ok, 0.1, "sbc", "paper", ["a"]) is not None
    assert backend.encode_many(ok, 0.1, "values", "paper", ["a"]) is None
    assert backend.encode_many(ok, 0.1, "stc", "paper", ["a"]) is None
    assert backend.encode_many(ok + [Accumulate(torch.zeros(4, dtype=torch.float64),
                                                torch.ones(4, dtype=torch.float64))],
                               0.1, "sbc", "paper", ["a", "b"]) is None
    assert backend.encode_many(ok + [Accumulate(torch.zeros(6), torch.ones(2, 3))],
                               0.1, "sbc", "paper", ["a", "b"]) is None
    with kernels.disabled():
        assert ckernels.KernelBackend().encode_many(ok, 0.1, "sbc", "paper", ["a"]) is None
    with pytest.raises(ValueError, match="selection must be 'paper' or 'magnitude'"):
        backend.encode_many(ok, 0.1, "sbc", "top", ["a"])


@pytest.mark.parametrize("consume", [False, True])
def test_a_whole_sync_in_one_call_names_the_tensor_that_is_not_finite(consume):
    """A NaN in the third tensor: ``NonFiniteError`` names it; the two before it are formed and
    handed back encoded (``encoded``: what the per-tensor path has by then), the third is put
    back as ``encode_tensor`` puts it back, the rest untouched: every tensor bit for bit as
    after the per-tensor path's same failure."""
    backend = backend_for("cpu")
    rng = np.random.default_rng(8)
    gs = [rng.standard_normal(n).astype(np.float32) for n in (3000, 20, 70_001, 500)]
    rs = [rng.standard_normal(g.size).astype(np.float32) for g in gs]
    gs[2][12_345] = np.nan
    names = ["a", "b", "c", "d"]

    def sources():
        return [Accumulate(torch.from_numpy(r.copy()), torch.from_numpy(g.copy()), consume)
                for r, g in zip(rs, gs)]
    many, one = sources(), sources()
    with pytest.raises(tb.NonFiniteError, match="the update of 'c' contains NaN or Inf") as e:
        backend.encode_many(many, 0.01, "sbc", "paper", names)
    done = []
    with pytest.raises(tb.NonFiniteError, match="the update of 'c' contains NaN or Inf"):
        for s, n in zip(one, names):
            done.append(backend.encode_tensor(s, 0.01, "sbc", n))
    assert [x.message.numpy().tobytes() for x in e.value.encoded] == \
        [x.message.numpy().tobytes() for x in done]
    for a, b in zip(many, one):
        for x, y in zip(_state(a), _state(b)):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    for x, y in zip(e.value.encoded, done):  # the encodings commit like the per-tensor ones
        x.commit()
        y.commit()
    for a, b in zip(many[:2], one[:2]):
        assert torch.equal(a.residual, b.residual)


def test_commit_subtracts_exactly_what_was_sent():
    rng = np.random.default_rng(4)
    a0 = rng.standard_normal(200_000).astype(np.float32)
    a = torch.from_numpy(a0.copy())
    msg, pos, sent = torch_codec.encode(a, 0.05, "sbc")
    backend_for(a.device).subtract_sent(a, pos, sent)
    want = torch.from_numpy(a0.copy())
    want.index_add_(0, pos, sent.contiguous(), alpha=-1)
    assert torch.equal(a, want)


def _big_step(seed, n_ranks, layout, density):
    """Every rank's step message for ``layout``: overlapping positions across ranks."""
    fp = wire.layout_fingerprint(layout)
    steps = []
    for r in range(n_ranks):
        g = torch.Generator().manual_seed(seed + r)
        msgs = [torch_codec.compress_(torch.randn(int(np.prod(s)), generator=g), density, "sbc", n)[0]
                for n, s in layout]
        steps.append(frame.frame(msgs, fp, torch.device("cpu")))
    return torch.cat(steps)


def test_large_multirank_decode_matches_numpy_across_chunks():
    """Tensors far larger than the scatter's chunk, 5 ranks, densities where ranks' positions
    collide: the kernels add each element's ranks in rank order, as the reference does."""
    layout = [("a", (300_000,)), ("b", (7,)), ("c", (90_001,))]
    for density in (0.01, 0.2):
        buf = _big_step(10, 5, layout, density)
        got = torch_codec.decode(buf, layout, 5, 1 / 5)
        with kernels.disabled():
            ops = torch_codec.decode(buf, layout, 5, 1 / 5)
        per = reference.decode_step_np(buf.numpy().tobytes(), layout, 5)
        ref = [np.zeros(int(np.prod(s)), np.float32) for _, s in layout]
        reference.accumulate_np(per, ref, 1 / 5)
        for t, o, r in zip(got, ops, ref):
            assert t.numpy().tobytes() == r.tobytes() == o.numpy().tobytes()


_MANY_TENSORS = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    import torch
    from horovod_sbc.torch import backend as tb
    from horovod_sbc.torch.backend import Targets
    from test_kernels import _big_step
    layout = [(f"t{{i}}", (1000,)) for i in range(300)]
    buf = _big_step(0, 3, layout, 0.05)

    def run(backend):
        g = torch.Generator().manual_seed(9)
        w = [torch.randn(1000, generator=g) for _ in layout]
        ref = [torch.randn(1000, generator=g) for _ in layout]
        m = [torch.randn(1000, generator=g) for _ in layout]
        s = [torch.empty(1000) for _ in layout]
        backend.decode(buf, layout, 3, Targets.add(ref, w), 1 / 3)  # weights beside W_ref
        backend.decode(buf, layout, 3, Targets.replace(s, masks=m), 1 / 3)  # momentum masks
        return [x.numpy().tobytes() for x in w + ref + m + s]
    got = run(tb.KernelBackend())
    want = run(tb.OpsBackend())
    assert got == want, [i for i, (a, b) in enumerate(zip(got, want)) if a != b][:5]
    print("ok")
""")


def test_a_decode_into_hundreds_of_tensors_keeps_the_heap_intact():
    """300 tensors (the drop-in's ResNet-50 sync has 161): the scatter kernel's per-tensor
    address arrays of second outputs and momentum masks (8 bytes a tensor, past numpy's
    small-buffer cache from 128 tensors on) must live through the kernel call. A freed one was
    read as heap pointers and written through: a crash ("corrupted double-linked list") or
    silently wrong sums. Run in a fresh process, so that a crash fails this test alone; the
    sums are compared with the tensor-op backend's, byte for byte."""
    res = subprocess.run([sys.executable, "-c", _MANY_TENSORS], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.split()[-1:] == ["ok"], \
        (res.returncode, res.stderr[-2000:])


def test_zero_out_replaces_and_accumulate_adds():
    layout = [("a", (100_000,)), ("b", (5,))]
    buf = _big_step(3, 3, layout, 0.02)
    avg = torch_codec.decode(buf, layout, 3, 1 / 3)
    base = [torch.full((100_000,), 2.0), torch.full((5,), 2.0)]
    acc = torch_codec.decode_into(buf, layout, 3, Targets.add([t.clone() for t in base]), 1 / 3)
    over = torch_codec.decode_into(buf, layout, 3, Targets.replace([t.clone() for t in base]),
                                   1 / 3)
    for a, b, c, o in zip(avg, base, acc, over):
        assert torch.equal(o, a)
        assert torch.equal(c, b + a)  # 2.0 + x is what the reference adds too (one add)
    # float64 outputs (the fused sync's accumulator for float64 models) take the op path
    out64 = torch_codec.decode(buf, layout, 3, 1 / 3, torch.float64)
    with kernels.disabled():
        want64 = torch_codec.decode(buf, layout, 3, 1 / 3, torch.float64)
    assert all(torch.equal(x, y) for x, y in zip(out64, want64))


def test_rejected_step_leaves_outputs_untouched():
    """Rank 1's unary stream loses a one bit (framing and CRC intact): the protocol rejects the
    step from the kernel's statistics, and the output keeps its contents."""
    layout = [("a", (50_000,))]
    fp = wire.layout_fingerprint(layout)
    steps = []
    for r in range(2):
        g = torch.Generator().manual_seed(r)
        msg = torch_codec.compress_(torch.randn(50_000, generator=g), 0.01, "sbc", "a")[0]
        if r == 1:
            raw = bytearray(msg.numpy().tobytes())
            hdr = wire.parse_tensor_header(bytes(raw), 0, 50_000)
            at = next(i for i in range(*hdr.unary) if raw[i])
            raw[at] &= raw[at] - 1  # clear its lowest set bit
            msg = torch.frombuffer(raw, dtype=torch.uint8)
        steps.append(frame.frame([msg], fp, torch.device("cpu")))
    out = torch.full((50_000,), 7.0)
    with pytest.raises(ValueError, match="unary stream holds"):
        torch_codec.decode_into(torch.cat(steps), layout, 2, Targets.replace([out]), 0.5)
    assert torch.equal(out, torch.full((50_000,), 7.0))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
def test_torch_decoder_memory_is_bounded_by_the_message_size():
    """A valid ~1.5 MiB message (2M positions at density 0.05), decoded into a preallocated
    output: the decoder's peak extra memory is <= 40 bytes per message byte (its position
    scratch is 4 bytes per position; the message's own host copy is one byte per byte)."""
    from harness import decoder_peak_memory
    got = decoder_peak_memory("""
        import torch
        from horovod_sbc import kernels
        from horovod_sbc.torch.backend import Targets, backend_for
        torch.set_num_threads(1)
        assert kernels.lib() is not None

        def make(buf, layout, numel):
            gathered = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
            out = torch.zeros(numel)
            return lambda: backend_for("cpu").decode(gathered, layout, 1, Targets.replace([out]),
                                                     1.0)[0].numpy()
    """)
    assert got["ok"]
    assert got["bytes"] > 1 << 20
    assert got["extra"] <= 40 * got["bytes"], got["extra"] / got["bytes"]


def test_without_a_compiler_the_tensor_op_codec_runs(tmp_path):
    code = textwrap.dedent("""
        import warnings, torch
        from horovod_sbc import kernels
        from horovod_sbc.torch.backend import backend_for
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            pos = backend_for("cpu").encode_tensor(torch.arange(-5.0, 50000.0), 0.01).positions
        assert kernels.lib() is None
        assert any("C kernels unavailable" in str(x.message) for x in w), [str(x.message) for x in w]
        print(pos.numel())
    """)
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"),
           "HOROVOD_SBC_KERNELS_DIR": str(tmp_path / "cache")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "500"


def test_kernels_can_be_switched_off_by_environment():
    code = "from horovod_sbc import kernels; print(kernels.lib() is None)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "HOROVOD_SBC_KERNELS": "0"})
    assert res.stdout.strip() == "True", res.stderr


def test_build_ahead_of_time_command():
    """``python -m horovod_sbc.kernels`` (what scripts/install.sh runs, into this cache: it
    built both libraries from their sources on this machine) prints the library's path, and,
    when TensorFlow is importable, the TensorFlow op library's, both present; run again it
    rebuilds nothing that is there (each build writes its file afresh, so the modification
    times show it)."""
    import importlib.util
    cache = kernels.cache_dir()
    before = {p: p.stat().st_mtime_ns for p in cache.glob("*") if p.is_file()}
    res = subprocess.run([sys.executable, "-m", "horovod_sbc.kernels"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    paths = res.stdout.split()
    want = ["sbc_kernels-"] + (["sbc_tf_ops-"] if importlib.util.find_spec("tensorflow") else [])
    assert len(paths) == len(want), paths
    for path, stem in zip(paths, want):
        assert path.startswith(str(cache / stem)) and os.path.exists(path), path
        p = Path(path)
        if p in before:
            assert p.stat().st_mtime_ns == before[p], f"{path} was rebuilt"


def test_momentum_masking_at_decoded_positions_matches_masked_fill():
    """The stock hook's momentum masking: the decoder zeroes the buffer wherever the decoded
    average is non-zero. The kernel visits only the decoded positions; it must agree with a
    dense masked_fill, also where two ranks' values cancel to exactly 0 (not masked) and with
    one tensor taking the tensor-op path (values mode) beside kernel-path ones, and one of
    several of the scatter's 16,384-element chunks (masked chunk by chunk)."""
    rng = np.random.default_rng(4)
    layout = [("a", (5000,)), ("b", (300,)), ("c", (2000,)), ("d", (40_003,))]
    fp = wire.layout_fingerprint(layout)
    steps = []
    for rank in range(3):
        msgs = []
        for name, (n,) in layout:
            x = rng.standard_normal(n).astype(np.float32)
            if rank < 2 and name == "a":  # ranks 0 and 1: opposite values, same positions
                x = np.zeros(n, np.float32)
                x[::50] = 1.0 if rank == 0 else -1.0
            mode = "values" if name == "b" else "sbc"
            m, _ = torch_codec.compress_(torch.from_numpy(x), 0.02, mode, name)
            msgs.append(m)
        steps.append(frame.frame(msgs, fp, torch.device("cpu")))
    gathered = torch.cat(steps)
    got = []
    for use_kernels in (True, False):
        outs = [torch.full((n,), 7.0) for _, (n,) in layout]
        bufs = [torch.arange(float(n)) + 1 for _, (n,) in layout]
        if use_kernels:
            torch_codec.decode_into(gathered, layout, 3, Targets.replace(outs, masks=bufs), 1 / 3)
        else:
            with kernels.disabled():
                torch_codec.decode_into(gathered, layout, 3, Targets.replace(outs, masks=bufs),
                                        1 / 3)
        for o, bf in zip(outs, bufs):
            want = (torch.arange(float(o.numel())) + 1).masked_fill(o != 0, 0)
            assert torch.equal(bf, want)
        got.append(bufs)
    assert all(torch.equal(x, y) for x, y in zip(*got))
    assert (got[0][0] == 0).any() and (got[0][0] != 0).any()
    # outputs the caller zeroed already (the stock hook's consumed gradient): nothing zeroes
    # them again, and the sums and masks are the same
    for use_kernels in (True, False):
        outs = [torch.zeros(n) for _, (n,) in layout]
        bufs = [torch.arange(float(n)) + 1 for _, (n,) in layout]
        with kernels.disabled() if not use_kernels else contextlib.nullcontext():
            torch_codec.decode_into(gathered, layout, 3,
                                    Targets.replace(outs, zeroed=True, masks=bufs), 1 / 3)
        assert all(torch.equal(x, y) for x, y in zip(bufs, got[0]))
        want = torch_codec.decode(gathered, layout, 3, 1 / 3)
        assert all(torch.equal(x, y) for x, y in zip(outs, want))


class _TwoRanks:
    """Rank 0 of a 2-rank job without Horovod: the other rank's step message is fixed."""

    def __init__(self, other):
        self.other = other

    def world(self):
        return 2, 0

    def allgather(self, t, name):
        return torch.cat([t, self.other])


def _in_weights_sync(seed=0, nan_in=None):
    """One sync of three tensors whose residual lives in the weights (``Update.in_weights``),
    rank 0 of two; returns (weights, references, result, rank 1's step message, inputs)."""
    from horovod_sbc.torch import SBC
    from horovod_sbc.torch.sync import Update, synchronize
    g = torch.Generator().manual_seed(seed)
    names, sizes = ["a", "b", "c"], [100_000, 4097, 33]
    layout = [(n, (k,)) for n, k in zip(names, sizes)]
    other = frame.frame([torch_codec.encode(torch.randn(k, generator=g), 0.01)[0]
                         for k in sizes], wire.layout_fingerprint(layout), torch.device("cpu"))
    refs = {n: torch.randn(k, generator=g) for n, k in zip(names, sizes)}
    ws = {n: refs[n] + 0.01 * torch.randn(k, generator=g) for n, k in zip(names, sizes)}
    if nan_in is not None:
        ws[nan_in][7] = float("nan")
    inputs = ({n: w.clone() for n, w in ws.items()}, {n: r.clone() for n, r in refs.items()})
    comp = SBC(density=0.01, nonfinite="skip")
    comp.transport = _TwoRanks(other)
    out = synchronize(comp.state, [Update(n, ws[n], (k,), base=refs[n], in_weights=True)
                             for n, k in zip(names, sizes)], out=[refs[n] for n in names])
    return ws, refs, out, other, inputs, layout


def test_residual_in_the_weights_sync():
    """``Update.in_weights`` (the drop-in's default): the update is ``W - W_ref``, sent as the
    message of that materialised difference; afterwards ``W_ref`` holds ``W_ref + avg`` and ``W``
    holds ``W + avg - sent`` (the decoded average added in rank order to both, then SBC's one
    value subtracted from ``W`` where sent): the kernels' path and the tensor-op path give the
    same bits."""
    ws, refs, out, other, (w0, r0), layout = _in_weights_sync()
    assert out is not None
    mine = []
    want_w, want_r = {}, {}
    for n, _ in layout:
        msg, pos, sent = torch_codec.encode(w0[n] - r0[n], 0.01)
        mine.append(msg)
        want_w[n], want_r[n] = w0[n].clone(), r0[n].clone()
    fp = wire.layout_fingerprint(layout)
    gathered = torch.cat([frame.frame(mine, fp, torch.device("cpu")), other])
    names = [n for n, _ in layout]
    torch_codec.decode_into(gathered, layout, 2, Targets.add([want_r[n] for n in names]), 0.5)
    torch_codec.decode_into(gathered, layout, 2, Targets.add([want_w[n] for n in names]), 0.5)
    for n in names:
        _, pos, sent = torch_codec.encode(w0[n] - r0[n], 0.01)
        want_w[n].index_add_(0, pos, sent, alpha=-1)
        assert torch.equal(refs[n], want_r[n]), n
        assert torch.equal(ws[n], want_w[n]), n
        assert not torch.equal(refs[n], r0[n]) and not torch.equal(ws[n], w0[n]), n
    with kernels.disabled():
        ws2, refs2, _, _, _, _ = _in_weights_sync()
    for n in names:
        assert torch.equal(ws2[n], ws[n]) and torch.equal(refs2[n], refs[n]), n


def test_residual_in_the_weights_failed_sync_changes_nothing_but_nan():
    """A NaN in one tensor's weights (not the first), ``nonfinite="skip"``: the sync is skipped,
    no reference moves, the other tensors' weights are untouched and the failing tensor's
    non-finite entries restart from the shared weights (its finite ones stay)."""
    with pytest.warns(UserWarning, match="'b' contains NaN or Inf"):
        ws, refs, out, _, (w0, r0), layout = _in_weights_sync(nan_in="b")
    assert out is None
    for n, _ in layout:
        assert torch.equal(refs[n], r0[n]), n
        if n != "b":
            assert torch.equal(ws[n], w0[n]), n
    fixed = w0["b"].clone()
    fixed[7] = r0["b"][7]
    assert torch.equal(ws["b"], fixed)


def test_residual_in_the_weights_fully_sent_lands_on_the_shared_weights():
    """Density 1 without binarization (FedAvg's exchange) with the residual in the weights:
    every position's whole update is sent, so after the sync every rank's weights equal the
    new shared weights exactly (ranks identical), not ``W + avg - sent`` rounded otherwise;
    top-k values at a lower density: ``W = W_ref + (A - sent)`` at the sent positions (0 added
    there), ``W + avg`` elsewhere."""
    from horovod_sbc.torch import SBC
    from horovod_sbc.torch.sync import Update, synchronize
    g = torch.Generator().manual_seed(3)
    n = 5000
    for size in (n, 1):  # one element: its sent value is not a stride-0 view either
        layout = [("w", (size,))]
        other = frame.frame(
            [torch_codec.encode(torch.randn(size, generator=g), 1.0, "values")[0]],
            wire.layout_fingerprint(layout), torch.device("cpu"))
        ref = torch.randn(size, generator=g) * 3
        w = ref + torch.randn(size, generator=g)  # large moves: W - W_ref often not exact
        comp = SBC(density=1.0, mode="values")
        comp.transport = _TwoRanks(other)
        assert synchronize(comp.state, [Update("w", w, (size,), base=ref, in_weights=True)],
                           out=[ref])
        assert torch.equal(w, ref), size
    layout = [("w", (n,))]
    ref0 = torch.randn(n, generator=g) * 3
    w0, ref = ref0 + torch.randn(n, generator=g), ref0.clone()
    w = w0.clone()
    comp = SBC(density=0.1, mode="values")
    comp.transport = _TwoRanks(frame.frame(
        [torch_codec.encode(torch.randn(n, generator=g), 0.1, "values")[0]],
        wire.layout_fingerprint(layout), torch.device("cpu")))
    _, pos, _ = torch_codec.encode(w0 - ref0, 0.1, "values")
    assert synchronize(comp.state, [Update("w", w, (n,), base=ref, in_weights=True)], out=[ref])
    want = w0 + (ref - ref0)  # moved with W_ref where this rank did not send
    want[pos] = ref[pos]  # sent whole: on W_ref
    assert torch.equal(w[pos], ref[pos]) and not torch.equal(w, ref)
    other = torch.ones(n, dtype=torch.bool)
    other[pos] = False
    assert torch.allclose(w[other], want[other], atol=1e-6)


def test_nonfinite_weights_are_reported_before_any_residual_changes():
    """A NaN in one tensor's weights (not the first): the sync reports it naming that tensor
    and leaves every residual exactly as it was (the fused update could not be undone)."""
    from horovod_sbc.torch import SBC
    from horovod_sbc.torch.sync import Update, synchronize
    class OneRank:  # the collective of a 1-rank job, without Horovod
        def world(self):
            return 1, 0

        def allgather(self, t, name):
            return t.clone()

    comp = SBC(density=0.1, nonfinite="skip")
    comp.transport = OneRank()
    names = ["a", "b"]
    ws = {n: torch.randn(1000) for n in names}
    refs = {n: ws[n] + 0.01 for n in names}
    for n in names:
        comp.residual(n, ws[n]).copy_(torch.randn(1000) * 1e-3)
    before = {n: comp.manager.residuals[n].clone() for n in names}
    ws["b"][17] = float("nan")
    items = [Update(n, ws[n], (1000,), base=refs[n], base_offset=comp.manager.residuals[n])
             for n in names]
    with pytest.warns(UserWarning, match="'b' contains NaN or Inf"):
        assert synchronize(comp.state, items) is None
    for n in names:
        assert torch.equal(comp.manager.residuals[n], before[n]), n


def _stock_hook_step(monkeypatch, g, other, nonfinite="raise", contiguous=True):
    """One compress()/decompress() of the stock hook as rank 0 of 2 (no Horovod: rank 1's step
    message is ``other``); returns (the hook, the residual before, the context, the gradient's
    output)."""
    from horovod_sbc.torch import SBC
    p = torch.nn.Parameter(torch.zeros(g.shape))
    p.grad = g if contiguous else g.t().contiguous().t()  # the same values, transposed strides
    comp = SBC(density=0.01, nonfinite=nonfinite, named_parameters=[("w", p)])
    comp.transport = _TwoRanks(other)
    res = comp.residual("w", p.grad)
    res.copy_(torch.linspace(-0.5, 0.5, res.numel()))
    before = res.clone()
    dummy, ctx = comp.compress(p.grad)
    assert torch.equal(res, before)  # compress() only records the gradient
    out = comp.decompress(dummy, ctx)
    if contiguous:  # used up by the encode's pass, then the average decoded into its buffer
        assert out.data_ptr() == p.grad.data_ptr()
    return comp, before, ctx, out


@pytest.mark.parametrize("contiguous", [True, False])
def test_stock_hook_decodes_the_average_into_the_consumed_gradient(monkeypatch, contiguous):
    """The stock hook's step exchange adds the gradient to the residual in the selection's
    pass, which zeroes a contiguous gradient, then scatters the 2-rank average into that buffer
    without zeroing it again. Output, residual and statistics are those of the plain encode +
    decode."""
    torch.manual_seed(1)
    g = torch.randn(300, 401)
    other = frame.frame([torch_codec.encode(torch.randn(g.numel()), 0.01)[0]],
                        wire.layout_fingerprint([("w", tuple(g.shape))]), torch.device("cpu"))
    gv = g.clone()
    comp, before, ctx, out = _stock_hook_step(monkeypatch, g, other, contiguous=contiguous)
    a = before + gv.reshape(-1)
    msg, pos, sent = torch_codec.encode(a.clone(), 0.01, name="w")
    want = torch_codec.decode(torch.cat([frame.frame(
        [msg], wire.layout_fingerprint([("w", tuple(g.shape))]), torch.device("cpu")), other]),
        [("w", tuple(g.shape))], 2, 0.5)[0]
    assert out.shape == g.shape and torch.equal(out.reshape(-1), want)
    a[pos] -= sent
    assert torch.equal(comp.residual("w", g), a)


def test_stock_hook_failing_rank_keeps_the_finite_rest(monkeypatch):
    """A NaN in rank 0's gradient (nonfinite="skip"): the step is skipped (zero gradient, a
    warning) and the failing rank's residual keeps R + g where finite, 0 where not (nothing
    was sent, and the used-up gradient is not at hand to take back), as the drop-in's
    residual in the weights does."""
    g = torch.randn(200, 300)
    g[3, 7] = float("nan")
    g[150, 2] = float("inf")
    other = frame.frame([torch_codec.encode(torch.randn(g.numel()), 0.01)[0]],
                        wire.layout_fingerprint([("w", tuple(g.shape))]), torch.device("cpu"))
    gv = g.clone().reshape(-1)
    with pytest.warns(UserWarning, match="skipping this step for 'w'.*NaN or Inf"):
        comp, before, ctx, out = _stock_hook_step(monkeypatch, g, other, nonfinite="skip")
    assert not out.any()
    want = torch.nan_to_num(before + gv, nan=0.0, posinf=0.0, neginf=0.0)
    assert torch.equal(comp.residual("w", g), want)
    assert comp.residual("w", g)[3 * 300 + 7] == 0 and comp.residual("w", g)[150 * 300 + 2] == 0
