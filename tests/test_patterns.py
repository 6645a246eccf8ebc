"""Horovod's own training patterns through the one-line change, on a real 2-rank job (issue
61, item 4): gradient clipping with ``synchronize()`` / ``skip_synchronize()``, AMP's
GradScaler with ``unscale_`` before clipping, a learning-rate scheduler, and what a user sees
on every rank for what SBC cannot compress (a sparse gradient, a process set, a NaN)."""
import numpy as np
import pytest

from harness import SharedJob

pytestmark = pytest.mark.multirank

OPTS = ("sgd", "adamw")
JOB = SharedJob("torch_patterns.py", 2, {
    **{(m, o): [m, f"opt={o}"] for m in ("clip", "amp", "schedule") for o in OPTS},
    "errors": ["errors"]}, timeout=600, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})


def _same_weights(results):
    assert results[0]["digest"] == results[1]["digest"], "ranks ended with different weights"


@pytest.mark.parametrize("opt", OPTS)
def test_clipping_after_synchronize_applies_and_ranks_end_identical(opt):
    results = JOB[("clip", opt)]
    _same_weights(results)
    for r in results:
        assert max(r["norms"]) <= 0.1 * (1 + 1e-5), r["norms"]   # clip_grad_norm_ took effect
        assert not [w for w in r["warnings"] if "skip_synchronize" in w], r["warnings"]
        assert np.mean(r["losses"][-10:]) < np.mean(r["losses"][:10]), r["losses"]
        assert r["stats"]["steps"] == 60


@pytest.mark.parametrize("opt", OPTS)
def test_gradscaler_unscale_then_clip(opt):
    a, b = JOB[("amp", opt)]
    _same_weights([a, b])
    assert b["skipped"][3] and not a["skipped"][3]  # only rank 1 overflowed, and its scaler saw it
    for r in (a, b):
        assert all(n <= 1.0 + 1e-5 for i, n in enumerate(r["norms"]) if not r["skipped"][i])
        assert r["stats"]["steps"] == 30
        assert np.mean(r["losses"][-8:]) < np.mean(r["losses"][:8]), r["losses"]


@pytest.mark.parametrize("opt", OPTS)
def test_a_scheduler_drives_the_wrapped_optimizer(opt):
    results = JOB[("schedule", opt)]
    _same_weights(results)
    base = results[0]["lrs"][0]
    for r in results:
        assert r["lrs"] == pytest.approx([base * 0.5 ** (s // 5) for s in range(20)])


def test_what_sbc_cannot_compress_is_a_clear_error_on_every_rank():
    for r in JOB["errors"]:
        assert "is sparse" in r["sparse"] and "sparse_as_dense=True" in r["sparse"], r
        assert "'weight'" in r["sparse"], r
        assert "process_set" in r["process_set"] and "global set" in r["process_set"], r
        assert "rank 1 could not encode" in r["nan"] and "contains NaN or Inf" in r["nan"], r
        assert "nonfinite='skip'" in r["nan"], r
