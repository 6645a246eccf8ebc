"""Offline data for the examples, tests and benchmarks (nothing is downloaded at run time)."""
from __future__ import annotations

from typing import Tuple

import numpy as np


def digits_split(seed: int = 0) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits (1797 8x8 images, shipped inside scikit-learn), standardised per
    pixel and split 80/20 with a fixed permutation: ``(x_train, y_train, x_test, y_test)`` as
    float32 / int64 numpy arrays."""
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    idx = np.random.default_rng(seed).permutation(len(x))
    x = (x / 16.0).astype(np.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    n_test = len(x) // 5
    te, tr = idx[:n_test], idx[n_test:]
    return x[tr], y[tr].astype(np.int64), x[te], y[te].astype(np.int64)
