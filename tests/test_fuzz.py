"""Fuzzing the decoders: random corruption of valid step messages must only ever raise
ValueError (never another exception, a crash, or an allocation out of proportion to the input).

Two kinds of cases:
* raw: bytes flipped, cut, inserted or overwritten anywhere (mostly caught by the checksum);
* framed: the tensor messages are corrupted and the step header's length and CRC recomputed, so
  the corruption reaches the tensor-header and Golomb-Rice stream validation.

``FUZZ_CASES`` sets the number of cases (default 20000; ``make fuzz`` runs 10^6). That every
decoder (numpy, torch, TensorFlow) reaches the same verdict on such input is
``tests/test_differential.py``'s job; this file bounds the reference decoder's memory.
"""
import os
import random
import struct
import tracemalloc

import numpy as np

from horovod_sbc import reference, wire

CASES = int(os.environ.get("FUZZ_CASES", "20000"))


def _corpus():
    rng = np.random.default_rng(11)
    layout = [("w", (64, 32)), ("b", (7,)), ("v", (300,)), ("s", ())]
    msgs = [reference.compress_np(rng.standard_normal(2048).astype(np.float32), None, 0.02)[0],
            reference.compress_np(rng.standard_normal(7).astype(np.float32), None, 0.5)[0],
            reference.compress_np(rng.standard_normal(300).astype(np.float32), None, 0.05,
                             binarize=False)[0],
            reference.compress_np(np.array([0.25], np.float32), None, 1.0)[0]]
    return layout, msgs


def _mutate(data: bytearray, r: random.Random) -> bytearray:
    kind = r.randrange(6)
    if kind == 0 and data:  # flip 1-4 bits
        for _ in range(r.randint(1, 4)):
            i = r.randrange(len(data) * 8)
            data[i // 8] ^= 1 << (i % 8)
    elif kind == 1:  # truncate
        del data[r.randrange(len(data) + 1):]
    elif kind == 2:  # insert random bytes
        i = r.randrange(len(data) + 1)
        data[i:i] = bytes(r.randrange(256) for _ in range(r.randint(1, 8)))
    elif kind == 3 and data:  # overwrite a run with an extreme byte
        i = r.randrange(len(data))
        data[i:i + r.randint(1, 6)] = bytes([r.choice((0, 0x7F, 0x80, 0xFF))]) * r.randint(1, 6)
    elif kind == 4 and len(data) > 6:  # hostile varints: huge counts / lengths
        i = r.randrange(5, len(data) - 1)
        data[i:i + 1] = b"\xff\xff\xff\xff\xff\xff\xff\x3f"
    elif data:  # set a random byte
        data[r.randrange(len(data))] = r.randrange(256)
    return data


def _frame(layout, body: bytes) -> bytes:
    return wire.step_message_bytes(body, wire.layout_fingerprint(layout), len(layout))


def _run(n_cases: int, decode, seed: int):
    layout, msgs = _corpus()
    valid = _frame(layout, b"".join(msgs))
    r = random.Random(seed)
    outcomes = {"rejected": 0, "accepted": 0}
    max_len = 0
    tracemalloc.start()
    for case in range(n_cases):
        if case % 2:
            data = bytes(_mutate(bytearray(valid), r))
        else:  # corrupt one tensor message, keep the framing valid
            parts = list(msgs)
            j = r.randrange(len(parts))
            parts[j] = bytes(_mutate(bytearray(parts[j]), r))
            data = _frame(layout, b"".join(parts))
        max_len = max(max_len, len(data))
        try:
            decode(data, layout)
            outcomes["accepted"] += 1
        except ValueError:
            outcomes["rejected"] += 1
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return outcomes, peak, max_len


def test_fuzz_numpy_decoder_only_raises_valueerror_with_bounded_memory():
    outcomes, peak, max_len = _run(CASES, lambda d, lay: reference.decode_step_np(d, lay, 1), 1)
    assert outcomes["rejected"] > 0.9 * CASES, outcomes
    # everything a decoder allocates is proportional to the message (a few bytes per bit)
    assert peak < 200 * max_len + (1 << 20), (peak, max_len)


def test_fuzz_accepted_messages_decode_in_range():
    """Whatever a mutation leaves decodable must still be inside the tensor (never an index
    error later when it is scattered)."""
    layout, msgs = _corpus()
    r = random.Random(3)
    for _ in range(3000):
        parts = list(msgs)
        j = r.randrange(len(parts))
        parts[j] = bytes(_mutate(bytearray(parts[j]), r))
        try:
            per = reference.decode_step_np(_frame(layout, b"".join(parts)), layout, 1)[0]
        except ValueError:
            continue
        for (name, shape), (pos, vals) in zip(layout, per):
            n = wire.layout_numel(shape)
            assert pos.size == 0 or (pos.min() >= 0 and pos.max() < n)
            assert np.all(np.diff(pos) > 0) and np.all(np.isfinite(vals))
