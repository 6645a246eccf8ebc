"""The golden vectors of the built-in STC (:mod:`horovod_sbc.compressors.stc`),
``tests/golden/stc.json``, written by ``python tests/stc_golden.py`` from the numpy reference;
``tests/test_registry.py`` holds every backend and decoder to them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from horovod_sbc import reference
from horovod_sbc.compressors.stc import STC  # noqa: F401 (the tests' handle on the class)

GOLDEN = Path(__file__).resolve().parent / "golden" / "stc.json"


def golden_cases():
    """(name, update, density) of the vectors: ties, zeros, both signs, float64, a tensor whose
    top-k is all zero (nothing sent), a sparse one with fewer non-zeros than k (only they are
    sent)."""
    rng = np.random.default_rng(1903)
    sparse = np.zeros(100, np.float32)
    sparse[[3, 17, 18, 60, 99]] = [0.5, -2.0, 0.25, -0.125, 1.0]
    return [("normal", rng.standard_normal(500).astype(np.float32), 0.02),
            ("ties", np.round(rng.standard_normal(300) * 2).astype(np.float32), 0.1),
            ("negative", -np.abs(rng.standard_normal(64)).astype(np.float32), 0.25),
            ("float64", rng.standard_normal(200), 0.05),
            ("zeros", np.zeros(40, np.float32), 0.1),
            ("dense", rng.standard_normal(33).astype(np.float32), 1.0),
            ("sparse", sparse, 0.2)]


def golden_vectors():
    out = []
    for name, u, density in golden_cases():
        msg, residual = reference.compress_np(u, None, density, mode="stc")
        out.append({"name": name, "density": density, "dtype": str(u.dtype),
                    "update_hex": u.tobytes().hex(), "message_hex": msg.hex(),
                    "residual_hex": residual.tobytes().hex()})
    return out


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(golden_vectors(), indent=1) + "\n")
    print(f"wrote {len(golden_vectors())} vectors to {GOLDEN}", file=sys.stderr)
