"""SBC core: selection, binarization, residual, Golomb-Rice streams, wire format, golden vectors."""
import itertools
import json
import math
import os
import struct
import sys
import tracemalloc
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

from horovod_sbc import reference, protocol, wire, config
from horovod_sbc.torch import backend as tcodec
from horovod_sbc.torch.backend import batch

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "golden"))
import make_golden  # noqa: E402
import torch_codec  # noqa: E402

GOLDEN = json.load(open(os.path.join(HERE, "golden", "vectors.json")))
NP_DT = {"float32": np.float32, "float64": np.float64, "float16": np.float16}


# ---------------------------------------------------------------------------------------------
# An independent decoder written from the wire.py docstring alone, bit by bit (slow, obvious).
# ---------------------------------------------------------------------------------------------
class BitReader:
    def __init__(self, data):
        self.data, self.i = data, 0

    def bit(self):
        byte = self.data[self.i // 8]
        b = (byte >> (7 - self.i % 8)) & 1
        self.i += 1
        return b


def spec_decode(msg: bytes):
    assert msg[:2] == b"SB" and msg[2] == 1
    flags, b = msg[3], msg[4]
    off = 5
    fields = []
    for _ in range(3):
        n, shift = 0, 0
        while True:
            byte = msg[off]
            off += 1
            n |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        fields.append(n)
    numel, count, ulen = fields
    (value,) = struct.unpack("<f", msg[off:off + 4])
    off += 4
    unary = BitReader(msg[off:off + ulen])
    rem = BitReader(msg[off + ulen:])
    positions, prev = [], -1
    if flags & 8:  # ALL: every element, no position streams
        positions = list(range(numel))
    else:
        for _ in range(count):
            q = 0
            while unary.bit() == 0:
                q += 1
            r = 0
            for _ in range(b):
                r = (r << 1) | rem.bit()
            prev = prev + (q << b) + r + 1
            positions.append(prev)
    end = off + ulen + (count * b + 7) // 8
    vals = None
    if flags & 4:  # SIGNS: one bit per position, 1 = negative
        signs = BitReader(msg[end:])
        vals = [-value if signs.bit() else value for _ in range(count)]
        end += (count + 7) // 8
    if flags & 2:
        vals = list(struct.unpack(f"<{count}f", msg[end:end + 4 * count]))
        end += 4 * count
    sign = -1.0 if flags & 1 else 1.0
    return numel, positions, sign * value, vals, end


# ---------------------------------------------------------------------------------------------
def test_rice_parameter_matches_paper_values():
    assert wire.rice_parameter(0.01) == 6
    assert wire.rice_parameter(0.001) == 9
    assert wire.rice_parameter(1e-4) == 13
    # b* = 1 + floor(log2(ln(phi-1)/ln(1-p)))
    phi = (1 + 5 ** 0.5) / 2
    for p in (0.3, 0.05, 2e-3, 3e-5):
        assert wire.rice_parameter(p) == 1 + math.floor(math.log2(math.log(phi - 1)
                                                                  / math.log(1 - p)))


def test_keep_count():
    assert reference.keep_count(0, 0.01) == 0
    assert reference.keep_count(10, 0.001) == 1  # at least one element
    assert reference.keep_count(1000, 0.01) == 10
    assert reference.keep_count(7, 1.0) == 7
    with pytest.raises(ValueError, match="density must be in"):
        config.validate_density(0)
    with pytest.raises(ValueError, match="density must be in"):
        config.validate_density(1.5)


@pytest.mark.parametrize("case", GOLDEN, ids=[c["name"] for c in GOLDEN])
def test_golden_vectors_numpy_torch_spec(case):
    dt = NP_DT[case["dtype"]]
    u, r = make_golden.make_inputs(case["index"], case["numel"], dt, case["kind"])
    assert make_golden.digest(u) + make_golden.digest(r) == case["input_sha256"]
    want = bytes.fromhex(case["message_hex"])
    # numpy reference
    binarize, mode = make_golden.mode_args(case["binarize"])
    msg, res = reference.compress_np(u, r, case["density"], binarize, mode,
                                selection=case["selection"])
    assert msg == want
    assert make_golden.digest(res) == case["new_residual_sha256"]
    # torch codec, on the tensor's device (CPU here, CUDA when available)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.from_numpy(r.copy()).to(dev) + torch.from_numpy(u).to(dev).to(
        torch.float64 if dt == np.float64 else torch.float32)
    tmsg, _ = torch_codec.compress_(a, case["density"], mode or binarize,
                               selection=case["selection"])
    assert tmsg.cpu().numpy().tobytes() == want
    assert make_golden.digest(a.cpu().numpy()) == case["new_residual_sha256"]
    # the independent spec decoder agrees with the reference decoder
    numel, positions, value, vals, end = spec_decode(want)
    assert end == len(want) and numel == case["numel"]
    _, pos, v, _ = reference.decode_tensor_np(want, 0, numel)
    assert positions == pos.tolist()
    if vals is None:
        assert np.all(v == np.float32(value))
    else:
        assert np.array_equal(np.array(vals, np.float32), v)
    # and the torch decoder of the exchange agrees with both
    fp = wire.layout_fingerprint([("t", (numel,))])
    step = wire.step_message_bytes(want, fp, 1)
    (dense,) = torch_codec.decode(step, [("t", (numel,))], 1)
    ref = np.zeros(numel, np.float32)
    ref[pos] = v
    assert np.array_equal(dense.numpy(), ref)


@pytest.mark.parametrize("case", [c for c in GOLDEN if c["numel"] <= 20000
                                  and not isinstance(c["binarize"], str)],
                         ids=lambda c: c["name"])
def test_golden_vectors_tensorflow(case):
    tf = pytest.importorskip("tensorflow")
    from horovod_sbc.tensorflow import backend as tfcodec
    dt = NP_DT[case["dtype"]]
    u, r = make_golden.make_inputs(case["index"], case["numel"], dt, case["kind"])
    msg, res = tfcodec.compress(tf.constant(u), tf.constant(r), case["density"], case["binarize"],
                                case["selection"])
    assert msg.numpy().tobytes() == bytes.fromhex(case["message_hex"])
    assert make_golden.digest(res.numpy()) == case["new_residual_sha256"]

    @tf.function
    def graph(u_, r_):
        return tfcodec.compress(u_, r_, case["density"], case["binarize"], case["selection"])
    gmsg, _ = graph(tf.constant(u), tf.constant(r))
    assert gmsg.numpy().tobytes() == bytes.fromhex(case["message_hex"])
    dense = tfcodec.decompress(gmsg, (case["numel"],))
    assert np.array_equal(dense.numpy(), reference.decompress_np(bytes.fromhex(case["message_hex"]),
                                                            (case["numel"],)))


# ---------------------------------------------------------------------------------------------
# property tests
# ---------------------------------------------------------------------------------------------
@st.composite
def position_sets(draw):
    numel = draw(st.integers(1, 5000) | st.sampled_from([1, 2, 8, 2 ** 20, 2 ** 40]))
    k = draw(st.integers(0, min(numel, 300)))
    if numel <= 5000:
        pos = draw(st.lists(st.integers(0, numel - 1), min_size=k, max_size=k, unique=True))
    else:
        pos = draw(st.lists(st.integers(0, numel - 1), min_size=k, max_size=k, unique=True))
    return numel, sorted(pos)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(position_sets(), st.floats(0, 2.0 ** 100, width=32), st.booleans())
def test_position_coding_roundtrip_numpy_and_torch(ps, value, negative):
    numel, pos = ps
    pos = np.array(pos, dtype=np.int64)
    msg = reference.encode_tensor_np(pos, numel, value, negative)
    hdr, got, vals, end = reference.decode_tensor_np(msg, 0, numel)
    assert end == len(msg) and np.array_equal(got, pos)
    if pos.size:
        assert vals.tolist() == [np.float32(-value if negative else value)] * pos.size
    # torch produces the same bytes and decodes the same positions
    tmsg = tcodec.encode_positions(torch.from_numpy(pos), numel, float(np.float32(value)),
                                   negative)
    assert tmsg.numpy().tobytes() == msg
    dec = batch.decode_messages(torch.frombuffer(bytearray(msg), dtype=torch.uint8), [hdr], [1.0])
    protocol.check_stream(hdr, dec.stats[0], "t")
    assert dec.pos.tolist() == pos.tolist()
    # the chosen b is never worse than the paper's b*
    if pos.size:
        bstar = wire.rice_parameter(pos.size / numel)
        alt = reference.encode_tensor_np(pos, numel, value, negative, rice_b=bstar)
        assert len(msg) <= len(alt)


def rule(a: np.ndarray, k: int, selection: str):
    """Direct transcription of the rule (core's docstring); means by the specified tree sum."""
    if selection == "paper":
        pos = sorted(sorted((i for i in range(a.size) if a[i] > 0),
                            key=lambda i: (-float(a[i]), i))[:k])
        neg = sorted(sorted((i for i in range(a.size) if a[i] < 0),
                            key=lambda i: (float(a[i]), i))[:k])
    else:
        kept = sorted(sorted(range(a.size), key=lambda i: (-abs(float(a[i])), i))[:k])
        pos = [i for i in kept if a[i] > 0]
        neg = [i for i in kept if a[i] < 0]
    mp = float(np.float32(reference.tree_sum_np(a[pos]) / len(pos))) if pos else 0.0
    mn = float(np.float32(reference.tree_sum_np(-a[neg]) / len(neg))) if neg else 0.0
    if mp >= mn and mp > 0:
        return pos, mp
    if mn > 0:
        return neg, -mn
    return [], 0.0


def test_tree_sum_is_the_specified_pairwise_order():
    x = np.array([2.0 ** 53, 1.0, 1.0, 0.0, -2.0 ** 53], np.float64)
    # padded to 8 with zeros, then x[:4] + x[4:], [:2] + [2:], [0] + [1]:
    # [0, 1, 1, 0] -> [1, 1] -> 2, where a left-to-right sum gives 0 (2^53 + 1 rounds to 2^53)
    want = ((x[0] + x[4]) + (x[2] + 0.0)) + ((x[1] + 0.0) + (x[3] + 0.0))
    assert want == 2.0 and sum(x.tolist()) == 0.0
    assert reference.tree_sum_np(x) == want
    assert reference.tree_sum_np(np.zeros(0)) == 0.0
    assert float(tcodec.tree_sum(torch.from_numpy(x))) == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1024, 1024, width=32), min_size=1, max_size=400),
       st.floats(0.001, 1.0), st.sampled_from(["paper", "magnitude"]))
def test_binarization_and_residual_match_the_rule(values, density, selection):
    u = np.array(values, dtype=np.float32)
    k = reference.keep_count(u.size, density)
    want_pos, want_val = rule(u, k, selection)
    msg, res = reference.compress_np(u, None, density, selection=selection)
    _, pos, vals, _ = reference.decode_tensor_np(msg, 0, u.size)
    assert pos.tolist() == want_pos
    if want_pos:
        assert float(vals[0]) == want_val
    sent = np.zeros_like(u)
    sent[pos] = vals
    unsent = np.ones(u.size, bool)
    unsent[pos] = False
    assert np.array_equal(res[unsent], u[unsent])  # exact where nothing was sent
    assert np.array_equal(res[pos], (u[pos] - vals).astype(np.float32))  # one fp32 rounding
    np.testing.assert_allclose(res + sent, u, rtol=1e-6, atol=1e-6 * max(1.0, abs(want_val)))
    # torch agrees byte for byte, and its residual too
    a = torch.from_numpy(u.copy())
    tmsg, _ = torch_codec.compress_(a, density, selection=selection)
    assert tmsg.numpy().tobytes() == msg
    assert np.array_equal(a.numpy(), res)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtypes_compute_in_fp32_and_return_input_dtype(dtype):
    from horovod_sbc.torch.sync.state import residual_dtype as _residual_dtype
    g = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype)
    rdt = _residual_dtype(dtype)
    assert rdt == (torch.float64 if dtype == torch.float64 else torch.float32)
    a = g.to(rdt).clone()
    msg, count = torch_codec.compress_(a, 0.05)
    host = msg.numpy().tobytes()
    hdr, pos, vals, _ = reference.decode_tensor_np(host, 0, 1000)
    dense = np.zeros(1000, np.float32)
    dense[pos] = vals
    out = torch.from_numpy(dense).to(dtype)
    assert out.dtype == dtype
    torch.testing.assert_close((a + torch.from_numpy(dense).to(rdt)).to(torch.float64),
                               g.to(torch.float64), rtol=1e-6, atol=1e-6)


def test_selection_is_exact_topk_with_sampling_path():
    # big enough to take the sampled-threshold path; ties included
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2_000_000, generator=g)
    a[::1000] = 7.0  # 2000 exact ties at the top
    for k in (1, 500, 2000, 2100, 20_000):
        idx = tcodec.select_topk(a.abs(), k)
        assert idx.numel() == k and bool((idx[1:] > idx[:-1]).all())
        ref = reference.select_np(a.abs().numpy(), k)
        assert np.array_equal(idx.numpy(), ref)


def test_nonfinite_update_raises_with_tensor_name():
    a = torch.ones(100)
    a[3] = float("nan")
    with pytest.raises(ValueError, match="'fc.weight' contains NaN or Inf"):
        torch_codec.compress_(a, 0.1, name="fc.weight")
    with pytest.raises(ValueError, match="NaN or Inf"):
        reference.compress_np(np.array([1.0, np.inf], np.float32), None, 0.5)


def test_large_tensor_arithmetic_does_not_overflow():
    numel = 3 * 2 ** 31 + 17  # > 2**32 elements, never allocated
    pos = np.array([0, 2 ** 31 + 5, 2 ** 32 + 1, numel - 1], dtype=np.int64)
    msg = reference.encode_tensor_np(pos, numel, 0.5)
    _, got, _, _ = reference.decode_tensor_np(msg, 0, numel)
    assert got.tolist() == pos.tolist()
    tmsg = tcodec.encode_positions(torch.from_numpy(pos), numel, 0.5)
    assert tmsg.numpy().tobytes() == msg


# ---------------------------------------------------------------------------------------------
# hostile input
# ---------------------------------------------------------------------------------------------
def _step(layout, msgs):
    body = b"".join(msgs)
    return wire.step_message_bytes(body, wire.layout_fingerprint(layout), len(msgs))


def _sample_step():
    rng = np.random.default_rng(5)
    layout = [("w", (30, 40)), ("b", (40,))]
    m1, _ = reference.compress_np(rng.standard_normal(1200).astype(np.float32), None, 0.05)
    m2, _ = reference.compress_np(rng.standard_normal(40).astype(np.float32), None, 0.1)
    return layout, _step(layout, [m1, m2])


def test_step_roundtrip_and_every_truncation_rejected():
    layout, buf = _sample_step()
    out = reference.decode_step_np(buf, layout, 1)
    assert len(out) == 1 and len(out[0]) == 2
    for cut in range(len(buf)):
        with pytest.raises(ValueError):
            reference.decode_step_np(buf[:cut], layout, 1)


def test_every_single_bit_flip_in_a_step_message_is_rejected():
    layout, buf = _sample_step()
    for i in range(len(buf) * 8):
        bad = bytearray(buf)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises(ValueError):
            reference.decode_step_np(bytes(bad), layout, 1)


@pytest.mark.parametrize("mutate,reason", [
    (lambda m: m[:2] + b"\x02" + m[3:], "unsupported wire format version 2"),
    (lambda m: b"XB" + m[2:], "bad tensor magic"),
    (lambda m: m[:3] + b"\x80" + m[4:], "reserved flag bits"),
    (lambda m: m[:4] + b"\x3f" + m[5:], "Rice parameter 63"),
])
def test_tensor_header_corruptions(mutate, reason):
    msg, _ = reference.compress_np(np.linspace(-1, 1, 500).astype(np.float32), None, 0.02)
    with pytest.raises(ValueError, match=reason):
        reference.decode_tensor_np(mutate(msg), 0, 500)


def test_positions_out_of_range_and_wrong_numel():
    msg = reference.encode_tensor_np(np.array([3, 99]), 100, 1.0)
    with pytest.raises(ValueError, match="declares 100 elements, expected 50"):
        reference.decode_tensor_np(msg, 0, 50)
    # same streams, smaller declared numel: position 99 is out of range
    forged = wire.tensor_header(90, 2, msg[4], 1, 1.0, False) + msg[-(len(msg) - 13):]
    forged = reference.encode_tensor_np(np.array([3, 99]), 100, 1.0)
    body = forged[5 + 1:]  # after numel varint (100 < 128: one byte)
    forged = forged[:5] + wire.uvarint(90) + body
    with pytest.raises(ValueError, match="out of range for 90 elements"):
        reference.decode_tensor_np(forged, 0, 90)


def test_huge_declared_counts_fail_fast_with_bounded_memory():
    head = (wire.TENSOR_MAGIC + bytes((1, 0, 9)) + wire.uvarint(2 ** 61) + wire.uvarint(2 ** 60)
            + wire.uvarint(2 ** 58) + struct.pack("<f", 1.0))
    tracemalloc.start()
    with pytest.raises(ValueError, match="truncated message"):
        reference.decode_tensor_np(head + b"\x01" * 64, 0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20
    # a declared count larger than the unary stream can hold
    head2 = (wire.TENSOR_MAGIC + bytes((1, 0, 0)) + wire.uvarint(1000) + wire.uvarint(900)
             + wire.uvarint(2) + struct.pack("<f", 1.0)) + b"\xff\xff"
    with pytest.raises(ValueError, match="too short for 900 positions"):
        reference.decode_tensor_np(head2, 0)


def test_non_canonical_varint_and_bad_value_rejected():
    with pytest.raises(ValueError, match="non-canonical"):
        wire.read_uvarint(b"\x81\x00", 0, "x")
    msg = reference.encode_tensor_np(np.array([1]), 10, 1.0)
    nan = msg[:-5] + struct.pack("<f", float("nan")) + msg[-1:]
    with pytest.raises(ValueError, match="not a finite number"):
        reference.decode_tensor_np(nan, 0, 10)


def _uvarint_spec(buf, off, what):
    """The uvarint rule written plainly (byte by byte, as the wire docstring states it)."""
    n = 0
    for i in range(9):
        if off + i >= len(buf):
            raise ValueError(f"truncated message: {what} varint runs past the end")
        byte = buf[off + i]
        n |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if i > 0 and byte == 0:
                raise ValueError(f"corrupt message: non-canonical varint for {what}")
            if n >= wire.MAX_NUMEL:
                raise ValueError(f"corrupt message: {what} = {n} is out of range (>= 2**62)")
            return n, off + i + 1
    raise ValueError(f"corrupt message: {what} varint longer than 9 bytes")


def test_header_field_varints_agree_with_the_plain_rule():
    """read_uvarint (the header parser names its fields lazily: (name, field)) returns what the
    plain rule returns and raises its exact error otherwise: every 1-byte string, 2-byte strings
    around the continuation bit, random longer ones, the 2**62 edge, at two offsets."""
    rng = np.random.default_rng(7)
    cases = [bytes(t) for t in itertools.product(range(256), repeat=1)]
    cases += [bytes(rng.integers(0, 256, size=int(rng.integers(1, 12)), dtype=np.uint8))
              for _ in range(20000)]
    cases += [bytes((b0, b1)) for b0 in range(0x7E, 0x100, 3) for b1 in range(256)]
    cases += [b"\xff" * 8 + bytes((v,)) for v in (0, 1, 0x3F, 0x40, 0x7F, 0x80)]  # the 2**62 edge
    for raw in cases:
        for off in (0, 1):
            buf = memoryview(b"\x05" * off + raw)
            try:
                want = _uvarint_spec(buf, off, "t numel")
            except ValueError as e:
                for what in ("t numel", ("t", "numel")):
                    with pytest.raises(ValueError) as got:
                        wire.read_uvarint(buf, off, what)
                    assert str(got.value) == str(e), raw
            else:
                assert wire.read_uvarint(buf, off, ("t", "numel")) == want, raw
                assert wire.read_uvarint(buf, off, "t numel") == want, raw


def test_layout_mismatch_and_peer_error_messages():
    layout, buf = _sample_step()
    with pytest.raises(ValueError, match="different tensor layout"):
        reference.decode_step_np(buf, [("w", (40, 30)), ("b", (40,))], 1)
    err = wire.error_step_message("the update of 'w' contains NaN or Inf",
                                  wire.layout_fingerprint(layout), origin=1)
    with pytest.raises(wire.PeerError, match="rank 1 could not encode.*'w' contains NaN"):
        reference.decode_step_np(buf + err, layout, 2)


def test_torch_exchange_decoder_matches_numpy_on_gathered_buffers():
    layout, buf = _sample_step()
    layout2 = layout
    rng = np.random.default_rng(9)
    m1, _ = reference.compress_np(rng.standard_normal(1200).astype(np.float32), None, 0.01)
    m2, _ = reference.compress_np(rng.standard_normal(40).astype(np.float32), None, 1.0, False)
    buf2 = _step(layout2, [m1, m2])
    gathered = buf + buf2
    ref = reference.decode_step_np(gathered, layout, 2)
    sums = torch_codec.decode(gathered, layout, 2)
    for i, (_, shape) in enumerate(layout):
        want = np.zeros(wire.layout_numel(shape), np.float32)
        for r in range(2):
            pos, vals = ref[r][i]
            want[pos] += vals
        assert np.array_equal(sums[i].numpy(), want)
    with pytest.raises(ValueError, match="trailing bytes"):
        torch_codec.decode(gathered + b"\0", layout, 2)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3000), st.floats(0, 2.0 ** 60, width=32), st.data())
def test_ternary_and_all_position_messages_roundtrip(numel, value, data):
    rng = np.random.default_rng(numel)
    signs_all = rng.random(numel) < 0.5
    if numel:
        msg = reference.encode_tensor_np(None, numel, value, signs=signs_all, all_positions=True)
        hdr, pos, vals, end = reference.decode_tensor_np(msg, 0, numel)
        assert end == len(msg) and pos.tolist() == list(range(numel))
        assert np.array_equal(vals < 0, signs_all & (np.float32(value) != 0))
        assert len(msg) <= 16 + (numel + 7) // 8  # one bit per element
        tm = tcodec.encode_positions(torch.zeros(0, dtype=torch.int64), numel, float(
            np.float32(value)), signs=torch.from_numpy(signs_all), all_positions=True)
        assert tm.numpy().tobytes() == msg
    k = data.draw(st.integers(0, numel))
    pos = np.sort(rng.choice(numel, size=k, replace=False)).astype(np.int64)
    sg = rng.random(k) < 0.5
    msg = reference.encode_tensor_np(pos, numel, value, signs=sg)
    hdr, got, vals, end = reference.decode_tensor_np(msg, 0, numel)
    assert end == len(msg) and np.array_equal(got, pos)
    assert np.array_equal(vals, np.where(sg, -np.float32(value), np.float32(value)))
    tm = tcodec.encode_positions(torch.from_numpy(pos), numel, float(np.float32(value)),
                                 signs=torch.from_numpy(sg))
    assert tm.numpy().tobytes() == msg


def test_all_flag_requires_a_payload_and_matching_count():
    msg = reference.encode_tensor_np(None, 10, 1.0, signs=np.zeros(10, bool), all_positions=True)
    bad = bytearray(msg)
    bad[3] = wire.FLAG_ALL  # ALL without SIGNS/VALUES would describe numel entries in 0 bits
    with pytest.raises(ValueError, match="ALL without SIGNS or VALUES"):
        reference.decode_tensor_np(bytes(bad), 0, 10)
    bad = bytearray(msg)
    bad[6] = 9  # count != numel
    with pytest.raises(ValueError, match="has ALL but 9 positions for 10 elements"):
        reference.decode_tensor_np(bytes(bad), 0, 10)


def test_numpy_decoder_memory_is_bounded_by_the_message_size():
    """A valid ~2 MiB message at the default density: numpy's decoder peaks at <= 40 bytes per
    message byte (it used to unpack remainders through int64 bits: ~390)."""
    rng = np.random.default_rng(5)
    pos = np.cumsum(rng.geometric(0.01, size=2_000_000)) - 1
    numel = int(pos[-1]) + 1
    layout = [("w", (numel,))]
    buf = wire.step_message_bytes(reference.encode_tensor_np(pos, numel, 0.5),
                                  wire.layout_fingerprint(layout), 1)
    assert len(buf) > 1 << 20
    tracemalloc.start()
    try:
        got = reference.decode_step_np(buf, layout, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(got[0][0][0], pos)
    assert peak <= 40 * len(buf), peak / len(buf)


def test_batched_torch_decoder_reaches_the_numpy_verdict_on_valid_and_corrupt_steps():
    """The batched decoder (all binary messages of all ranks at once) against the numpy
    reference: same sums on valid steps, the same error message on corrupt ones (bit flips in
    the streams, CRC fixed so that the stream checks are what decides)."""
    import random
    rnd = random.Random(3)
    layout = [("a", (3000,)), ("b", (50,)), ("c", (20000,)), ("d", (7,))]
    fp = wire.layout_fingerprint(layout)

    def step(seed, density):
        r = np.random.default_rng(seed)
        msgs = [reference.compress_np(r.standard_normal(wire.layout_numel(s)).astype(np.float32),
                                 None, density)[0] for _, s in layout]
        return bytearray(wire.step_message_bytes(b"".join(msgs), fp, len(msgs)))

    n_corrupt = 0
    for it in range(120):
        n = rnd.choice([1, 2, 3])
        density = rnd.choice([0.001, 0.01, 0.1, 0.5])
        parts = [step(1000 * it + j, density) for j in range(n)]
        if it % 3:
            p = parts[rnd.randrange(n)]
            for _ in range(rnd.choice([1, 2, 4])):
                i = rnd.randrange(24, len(p))
                p[i] ^= 1 << rnd.randrange(8)
            struct.pack_into("<I", p, 20, zlib.crc32(bytes(p[24:])) & 0xFFFFFFFF)
        buf = b"".join(bytes(p) for p in parts)
        try:
            ref = reference.decode_step_np(buf, layout, n)
        except ValueError as e:
            n_corrupt += 1
            with pytest.raises(ValueError) as got:
                torch_codec.decode(buf, layout, n)
            assert str(got.value) == str(e)
            continue
        sums = torch_codec.decode(buf, layout, n)
        for i, (_, shape) in enumerate(layout):
            want = np.zeros(wire.layout_numel(shape), np.float32)
            for r in range(n):
                pos, vals = ref[r][i]
                want[pos] += vals
            assert np.array_equal(sums[i].numpy(), want)
    assert n_corrupt > 20
