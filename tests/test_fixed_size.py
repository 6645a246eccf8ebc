"""Fixed-size (PADDED) step messages: the format and its verdicts in every decoder, the
capacity bound, the device CRC, and the stock hook's compress() without a host read."""
import zlib

import numpy as np
import pytest
import torch

from horovod_sbc import kernels, reference, wire
from horovod_sbc.torch import SBC
from horovod_sbc.torch.backend import fused
from test_differential import _all_verdicts
from benchmarks import bench_gpu_proxy as gp

LAYOUT = [("w", (40, 30)), ("b", (7,))]
FP = wire.layout_fingerprint(LAYOUT)


def _messages(seed: int, density: float = 0.05):
    rng = np.random.default_rng(seed)
    return [reference.compress_np(rng.standard_normal(wire.layout_numel(s)).astype(np.float32),
                                  None, density, selection="paper")[0] for _, s in LAYOUT]


def _cap(density: float = 0.05) -> int:
    return reference.step_capacity([1200, 7], density)


def test_padded_step_decodes_like_the_unpadded_one_everywhere():
    msgs = [_messages(1), _messages(2)]
    plain = b"".join(wire.step_message_bytes(b"".join(m), FP, 2) for m in msgs)
    padded = b"".join(wire.padded_step_message(b"".join(m), FP, 2, _cap()) for m in msgs)
    assert len(padded) == 2 * _cap() and padded[5] == wire.STEP_FLAG_PADDED
    want = _all_verdicts(LAYOUT, 2, plain, 0.5)["numpy"]
    assert want[0] == "ok"
    for name, v in _all_verdicts(LAYOUT, 2, padded, 0.5).items():
        assert v == want, name


def _padded_body(step: bytes, body: bytes) -> bytes:
    """``step`` with its body replaced (CRC and length recomputed, PADDED kept)."""
    head = wire.STEP_HEADER.unpack(step[:24])
    return wire.STEP_HEADER.pack(*head[:4], len(body), head[5], head[6],
                                 zlib.crc32(body) & 0xFFFFFFFF) + body


@pytest.mark.parametrize("mutation, verdict", [
    ("nonzero padding", "padding of step message from rank 0 is not zero"),
    ("truncated capacity", "truncated message"),
    ("padding without the flag", "stray bytes in step message of rank 0"),
    ("flag without padding", "padded step message from rank 0 has no padding"),
    ("error padding", "padding of step message from rank 1 is not zero"),
])
def test_mutated_padded_steps_get_one_verdict_everywhere(mutation, verdict):
    step = wire.padded_step_message(b"".join(_messages(3)), FP, 2, _cap())
    body = step[24:]
    other = wire.padded_step_message(b"".join(_messages(5)), FP, 2, _cap())
    if mutation == "nonzero padding":
        step = _padded_body(step, body[:-1] + b"\x01")
    elif mutation == "truncated capacity":
        content = len(b"".join(_messages(3)))
        step = _padded_body(step, body[:content - 3])
    elif mutation == "flag without padding":
        step = _padded_body(step, b"".join(_messages(3)))
    elif mutation == "padding without the flag":
        step = bytearray(step)
        step[5] = 0
        step = bytes(step)
    else:  # the padding of an ERROR is checked with its header: before the ERROR wins
        other = wire.error_step_message("NaN in 'w'", FP, False, 1, _cap())
        other = _padded_body(other, other[24:-1] + b"\x07")
    got = _all_verdicts(LAYOUT, 2, step + other)
    assert len(set(got.values())) == 1, got
    v = next(iter(got.values()))
    assert v[0] == "invalid" and verdict in v[1], v


def test_padded_error_reports_its_reason_and_has_the_capacity():
    err = wire.error_step_message("the update of 'w' contains NaN or Inf", FP, True, 1, _cap())
    assert len(err) == _cap() and err[5] == wire.STEP_FLAG_SKIP | wire.STEP_FLAG_PADDED
    ok = wire.padded_step_message(b"".join(_messages(4)), FP, 2, _cap())
    for v in _all_verdicts(LAYOUT, 2, ok + err).values():
        assert v == ("skip", 1, "the update of 'w' contains NaN or Inf")
    tiny = wire.error_step_message("NaN in 'ü'", FP, False, 0, 24 + 10)  # whole characters
    assert tiny[24:] == b"NaN in '" + b"\0\0"


@pytest.mark.parametrize("numel, density", [(1, 0.01), (64, 0.01), (1000, 0.05),
                                            (20000, 1e-4), (20000, 0.3), (300000, 1e-3)])
def test_encoded_messages_never_exceed_the_capacity(numel, density):
    rng = np.random.default_rng(numel)
    cap = reference.tensor_capacity(numel, density, "sbc")
    worst = 0
    for kind in range(4):
        a = rng.standard_normal(numel).astype(np.float32)
        if kind == 1:  # positions packed at the end: the longest gaps the bound allows
            a[:] = 0
            a[-reference.keep_count(numel, density):] = 1
        if kind == 2:
            a = (a ** 3).astype(np.float32)
        if kind == 3:  # few positives
            a = -np.abs(a)
            a[:2] = 5
        msg = reference.compress_np(a, None, density, selection="paper")[0]
        worst = max(worst, len(msg))
    assert worst <= cap
    # the bound is close: at most a few bytes plus 1 bit per position above what was seen
    assert cap - worst <= 16 + reference.keep_count(numel, density) // 8 + numel // 4096


def test_capacity_per_mode():
    assert reference.tensor_capacity(1000, 1.0, "sign") == 5 + 2 + 2 + 1 + 4 + 125
    assert reference.tensor_capacity(300, 1.0, "values") == 5 + 2 + 2 + 1 + 4 + 1200
    assert reference.tensor_capacity(0, 0.01, "sbc") == 12
    assert reference.step_capacity([1200, 7], 0.05) == 24 + 1 + sum(
        reference.tensor_capacity(n, 0.05) for n in (1200, 7))


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1025, 70000])
def test_crc32_device_is_zlibs(n):
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert int(fused.crc32_device(x)) == zlib.crc32(x.numpy().tobytes())


@pytest.mark.parametrize("lens", [[0], [1025], [0, 0, 3], [3000, 1, 2048, 0, 70], [7] * 9])
def test_crc32_segments_is_zlibs_per_slice(lens):
    x = torch.randint(0, 256, (sum(lens),), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(len(lens)))
    ends = np.cumsum([0] + lens)
    want = [zlib.crc32(x[a:b].numpy().tobytes()) for a, b in zip(ends[:-1], ends[1:])]
    assert fused.crc32_segments(x, lens).tolist() == want


def test_stock_compress_reads_nothing_and_matches_the_variable_path():
    shapes = [("w", (30, 40)), ("b", (7,)), ("c", (3, 3, 4, 4))]
    named = {}
    for fixed in (False, True):
        params = [(n, torch.nn.Parameter(torch.zeros(s))) for n, s in shapes]
        comp = SBC(density=0.05, named_parameters=params, fixed_size=fixed)
        comp.transport = gp.FakeHorovodTransport(2, gp._active)
        g = torch.Generator().manual_seed(0)
        reads = []
        with kernels.disabled():
            for step in range(3):
                for _, p in params:
                    p.grad = torch.randn(p.shape, generator=g)
                with gp.counting() as c:
                    ctxs = [comp.compress(p.grad) for _, p in params]
                reads.append(c.snapshot()["reads"])
                with gp.counting() as c:
                    outs = [comp.decompress(d, x) for d, x in ctxs]
                reads.append(c.snapshot()["reads"])
        named[fixed] = ([o.clone() for o in outs],
                        [comp.state.residual(n, p.grad).clone() for n, p in params],
                        comp.stats(), reads)
    outs, res, st, reads = named[True]
    assert reads[0::2] == [0, 0, 0]          # compress(): no host read at all
    assert max(reads[1::2]) <= 4             # decompress() of the whole step
    for a, b in zip(outs + res, named[False][0] + named[False][1]):
        assert torch.equal(a, b)
    var = named[False][2]
    # one PADDED step of every gradient per optimizer step
    cap = reference.step_capacity([wire.layout_numel(s) for _, s in sorted(shapes)], 0.05)
    sent = st["upstream_bits"] - 3 * 16 * len(shapes)  # minus the float16 placeholders
    assert sent == 3 * 8 * cap
    assert st["padding_bits"] == sent - (var["upstream_bits"] - 3 * 16 * len(shapes))
    assert st["positions_sent"] == var["positions_sent"] > 0 and var["padding_bits"] == 0


def test_fixed_size_is_validated():
    with pytest.raises(ValueError, match="fixed_size must be True, False or None, got 1"):
        SBC(fixed_size=1)
    with pytest.raises(ValueError, match="topology='allgather'"):
        SBC(fixed_size=True, topology="server")
    SBC(fixed_size=None, topology="server")  # the default: variable over Horovod


def test_the_default_pads_only_where_the_collective_needs_equal_sizes():
    from horovod_sbc.config import SBCConfig
    from horovod_sbc.torch.backend import frame
    layout = [("a", (1000,)), ("b", (30, 7))]
    cap = frame.step_capacity(layout, SBCConfig(fixed_size=True))
    assert cap == reference.step_capacity([1000, 210], 0.01, "sbc")
    assert frame.step_capacity(layout, SBCConfig()) is None  # Horovod's allgather
    assert frame.step_capacity(layout, SBCConfig(), equal_sizes=True) == cap  # torch.distributed
    assert frame.step_capacity(layout, SBCConfig(fixed_size=False), equal_sizes=True) is None
    assert SBC().fixed_size is None and not SBCConfig().padded()
    assert SBCConfig().padded(True) and not SBCConfig(fixed_size=False).padded(True)


def test_golden_padded_steps_are_the_references_and_decode_everywhere():
    import json
    import os
    import sys
    here = os.path.join(os.path.dirname(__file__), "golden")
    sys.path.insert(0, here)
    import make_golden
    vectors = json.load(open(os.path.join(here, "vectors.json")))
    golden = json.load(open(os.path.join(here, "padded.json")))
    assert make_golden.padded_steps(vectors) == golden
    for g in golden:
        layout = [("t", (g["numel"],))]
        step = bytes.fromhex(g["step_hex"])
        assert len(step) == g["capacity"] and step[5] & wire.STEP_FLAG_PADDED
        verdicts = _all_verdicts(layout, 1, step)
        assert len(set(verdicts.values())) == 1, (g["name"], verdicts)
        v = verdicts["numpy"]
        if g["name"] == "error":  # the reason cut to the capacity
            reason = "the update of 't' contains NaN or Inf"[:g["capacity"] - 25]
            assert v == ("error", 1, reason) and len(reason) < 38
            continue
        case = next(c for c in vectors if c["name"] == g["name"])
        plain = wire.step_message_bytes(bytes.fromhex(case["message_hex"]),
                                        wire.layout_fingerprint(layout), 1)
        assert v == _all_verdicts(layout, 1, plain)["numpy"] and v[0] == "ok", g["name"]


@pytest.mark.multirank
def test_two_ranks_stock_and_dropin_fixed_size_kernels_on_and_off():
    from harness import run_ranks
    results, _ = run_ranks("torch_fixed.py", 2, timeout=240)
    n_params = 4  # two Linear layers
    for key in results[0]:
        api, kern, fixed = key.split("/")
        runs = [r[key] for r in results]
        assert runs[0]["digests"] == runs[1]["digests"], key  # identical parameters
        assert len(set(runs[0]["digests"])) == 4, key  # which do move
        var = results[0][f"{api}/{kern}/0"]
        if fixed == "1":  # the same training as variable-size messages, bit for bit
            assert runs[0]["digests"] == var["digests"], key
        for r in runs:
            st = r["stats"]
            dummy = 16 * n_params * 4 if api == "stock" else 0
            assert st["upstream_bits"] == 8 * r["sent"] + dummy, key
            if fixed == "1":
                assert all(len(s) == 1 for s in r["sizes"].values()), (key, r["sizes"])
                assert st["padding_bits"] > 0, key
            else:
                assert st["padding_bits"] == 0, key
    # the padding is exactly the difference to the variable-size run, on each rank
    for r in results:
        for api in ("stock", "dropin"):
            for kern in ("on", "off"):
                a, b = r[f"{api}/{kern}/1"], r[f"{api}/{kern}/0"]
                assert a["stats"]["padding_bits"] == 8 * (a["sent"] - b["sent"]), (api, kern)
                assert a["stats"]["positions_sent"] == b["stats"]["positions_sent"]


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_stock_nonfinite_fails_or_skips_the_whole_step(nonfinite):
    """A NaN in one gradient ('b'): the step's one message is this rank's padded ERROR/SKIP
    naming it; raised, every decompress() of the step reports it; skipped, every gradient of
    the step comes back zero and stays in its residual ('b''s NaN restarted at 0)."""
    params = [("w", torch.nn.Parameter(torch.zeros(50))), ("b", torch.nn.Parameter(torch.zeros(3)))]
    comp = SBC(density=0.1, named_parameters=params, fixed_size=True, nonfinite=nonfinite)
    comp.transport = gp.FakeHorovodTransport(2, gp._active)
    grads = [torch.arange(50.0) - 20, torch.tensor([1.0, float("nan"), -2.0])]
    want_w = grads[0].clone()
    for (_, p), g in zip(params, grads):
        p.grad = g
    with kernels.disabled():
        with gp.counting() as c:
            ctxs = [comp.compress(g) for g in grads]
        assert c.snapshot()["reads"] == 0
        # what Horovod allreduces instead of each gradient: one float16 (16 bits counted)
        assert [(d.dtype, d.numel()) for d, _ in ctxs] == [(torch.float16, 1)] * 2
        if nonfinite == "raise":
            for ctx in ctxs:
                # (the reason is cut to what the padded step holds)
                with pytest.raises(ValueError, match=r"rank 0 could not encode this sync: the "
                                                     r"update of 'b' contains"):
                    comp.decompress(*ctx)
        else:
            with pytest.warns(UserWarning, match="skipping this step for 'b', 'w'"):
                outs = [comp.decompress(*ctx) for ctx in ctxs]
            assert outs[0].tolist() == [0.0] * 50 and outs[1].tolist() == [0.0, 0.0, 0.0]
            # R + g kept (the NaN restarted at 0), nothing committed
            assert comp.state.residual("b", grads[1]).tolist() == [1.0, 0.0, -2.0]
            assert torch.equal(comp.state.residual("w", grads[0]), want_w)
    cap = reference.step_capacity([3, 50], 0.1)
    assert comp.stats()["upstream_bits"] == 8 * cap + 2 * 16  # and two float16 placeholders
