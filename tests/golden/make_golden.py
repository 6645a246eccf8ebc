"""Regenerate tests/golden/vectors.json and padded.json from the numpy reference (run only on a
format change).

    .venv/bin/python tests/golden/make_golden.py
"""
import hashlib
import json
import os

import numpy as np

from horovod_sbc import reference

CASES = [  # name, numel, density, binarize, dtype, kind[, selection (default "magnitude")]
    ("small", 100, 0.05, True, "float32", "normal"),
    ("ties", 64, 0.1, True, "float32", "ties"),
    ("one", 1, 0.01, True, "float32", "normal"),
    ("zeros", 50, 0.1, True, "float32", "zeros"),
    ("mid", 20000, 0.01, True, "float32", "normal"),
    ("large_sparse", 300000, 0.001, True, "float32", "normal"),
    ("large_1e4", 200000, 0.0001, True, "float32", "normal"),
    ("negative_wins", 1000, 0.02, True, "float32", "negskew"),
    ("fp64", 3000, 0.01, True, "float64", "normal"),
    ("fp16", 3000, 0.01, True, "float16", "normal"),
    ("values", 5000, 0.01, False, "float32", "normal"),
    ("dense_values", 300, 1.0, False, "float32", "normal"),
    ("sign", 1000, 1.0, "sign", "float32", "normal"),
    ("sign_fp64", 77, 1.0, "sign", "float64", "normal"),
    # the SBC paper's selection (top-k positive and top-k negative separately)
    ("paper_small", 100, 0.05, True, "float32", "normal", "paper"),
    ("paper_ties", 64, 0.1, True, "float32", "ties", "paper"),
    ("paper_one", 1, 0.01, True, "float32", "normal", "paper"),
    ("paper_zeros", 50, 0.1, True, "float32", "zeros", "paper"),
    ("paper_mid", 20000, 0.01, True, "float32", "normal", "paper"),
    ("paper_large_sparse", 300000, 0.001, True, "float32", "normal", "paper"),
    ("paper_negative_wins", 1000, 0.02, True, "float32", "negskew", "paper"),
    ("paper_few_positive", 400, 0.05, True, "float32", "fewpos", "paper"),
    ("paper_fp64", 3000, 0.01, True, "float64", "normal", "paper"),
    ("paper_fp16", 3000, 0.01, True, "float16", "normal", "paper"),
    ("paper_dense", 200, 1.0, True, "float32", "normal", "paper"),
]


def uniform(seed: int, n: int) -> np.ndarray:
    """Deterministic floats in [-1, 1) from a 64-bit LCG: no dependence on numpy's samplers."""
    x = (np.arange(n, dtype=np.uint64) + np.uint64(seed)) * np.uint64(6364136223846793005)
    x = x * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)
    x ^= x >> np.uint64(29)
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(32)
    return ((x >> np.uint64(40)).astype(np.float64) / float(1 << 23) - 1.0)


def make_inputs(i, numel, dtype, kind):
    a, b, c = uniform(3 * i + 1, numel), uniform(3 * i + 2, numel), uniform(3 * i + 3, numel)
    if kind == "ties":
        u = np.round(3 * a).astype(dtype)
    elif kind == "zeros":
        u = np.zeros(numel, dtype)
    elif kind == "fewpos":  # 3 positive entries, the rest negative: P has fewer than k
        u = (-np.abs(a) - 0.01).astype(dtype)
        u[[5, 77, 300 % numel]] = 5.0
    elif kind == "negskew":
        u = (a - 10.0 * (c > 0.9)).astype(dtype)
    else:
        # heavy-ish tails like gradients: |c|^3 as two IEEE products (|c| has 24 significant bits,
        # so |c|*|c| is exact and the cube is rounded once), the same bits on every CPU (numpy's
        # float64 power differs in the last bit between its SIMD variants)
        ac = np.abs(c)
        u = (a * ((ac * ac) * ac)).astype(dtype)
    r = (0.1 * b).astype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)
    return u, r


def mode_args(binarize):
    """CASES' 4th column: True (SBC), False (top-k values) or a mode name."""
    return (True, binarize) if isinstance(binarize, str) else (binarize, None)


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def main():
    cases = []
    for i, (name, numel, density, binarize, dtype, kind, *sel) in enumerate(CASES):
        selection = sel[0] if sel else "magnitude"
        u, r = make_inputs(i, numel, dtype, kind)
        msg, res = reference.compress_np(u, r, density, *mode_args(binarize), selection=selection)
        cases.append({"name": name, "index": i, "numel": numel, "density": density,
                      "binarize": binarize, "dtype": dtype, "kind": kind,
                      "selection": selection,
                      "input_sha256": digest(u) + digest(r),
                      "message_hex": msg.hex(), "new_residual_sha256": digest(res)})
    with open(os.path.join(os.path.dirname(__file__), "vectors.json"), "w") as f:
        json.dump(cases, f, indent=1)
    padded = padded_steps(cases)
    with open(os.path.join(os.path.dirname(__file__), "padded.json"), "w") as f:
        json.dump(padded, f, indent=1)
    print(f"wrote {len(cases)} cases and {len(padded)} padded steps")


PADDED = ["small", "zeros", "mid", "values", "sign", "paper_mid", "paper_few_positive"]


def padded_steps(cases):
    """PADDED step messages (wire.py, "Fixed-size step messages"): some cases' messages, each
    the one tensor ``"t"`` of a step padded to its capacity, and a padded ERROR step."""
    from horovod_sbc import wire
    out = []
    for c in cases:
        if c["name"] not in PADDED:
            continue
        mode = c["binarize"] if isinstance(c["binarize"], str) else \
            "sbc" if c["binarize"] else "values"
        layout = [("t", (c["numel"],))]
        cap = reference.step_capacity([c["numel"]], c["density"], mode)
        step = wire.padded_step_message(bytes.fromhex(c["message_hex"]),
                                        wire.layout_fingerprint(layout), 1, cap)
        out.append({"name": c["name"], "numel": c["numel"], "density": c["density"],
                    "mode": mode, "capacity": cap, "step_hex": step.hex()})
    layout = [("t", (100,))]
    cap = reference.step_capacity([100], 0.05, "sbc")
    err = wire.error_step_message("the update of 't' contains NaN or Inf",
                                  wire.layout_fingerprint(layout), False, 1, cap)
    out.append({"name": "error", "numel": 100, "density": 0.05, "mode": "sbc",
                "capacity": cap, "step_hex": err.hex()})
    return out


if __name__ == "__main__":
    main()
