"""What the examples share: offline data (nothing is downloaded at run time) and the results
table they print on rank 0 (and their ``--json`` file). The benchmarks import it too
(``from examples.common import ...`` from the repository root)."""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

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


def print_runs(results: List[Dict], json_path: Optional[str] = None) -> None:
    """One line per run: method, api, density, delay, accuracy, compression ratio, mean step
    time and whether all ranks ended bit-identical; the SBC ÷ dense step time for a pair."""
    w = max([9] + [len(r["api"]) + 2 for r in results])
    print(f"\n{'method':<7}{'api':<{w}}{'density':>8}{'delay':>6}{'accuracy':>10}"
          f"{'ratio':>10}{'step ms':>9}  ranks identical")
    for r in results:
        print(f"{r['method']:<7}{r['api']:<{w}}{r['density']:>8g}{r['delay']:>6}"
              f"{100 * r['final_accuracy']:>9.2f}%{r['compression_ratio']:>9.0f}x"
              f"{1000 * r['step_time_s']:>9.2f}  {r['ranks_identical']}")
    if len(results) == 2:
        print(f"SBC step time / dense step time: "
              f"{results[1]['step_time_s'] / results[0]['step_time_s']:.2f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"runs": results}, f, indent=1)


def stock_horovod_optimizer(optimizer, model, compression=None):
    """Stock Horovod set up as its documentation does: ``hvd.DistributedOptimizer`` over the
    model's named parameters (with ``compression``, e.g. ``horovod_sbc.torch.SBC(...)`` for the
    one-line change, or ``hvd.Compression.none``), then rank 0's parameters and optimizer state
    broadcast to every rank. Shared by the benchmarks and the test workers."""
    import horovod.torch as hvd
    opt = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                   compression=compression or hvd.Compression.none)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return opt
