"""examples/pytorch_lm_sbc.py (the causal-LM example of the one-line change) on 2 ranks at a
tiny size: dense and SBC train to a finite test perplexity below the vocabulary size, SBC's
upstream traffic is a fraction of dense's, and a run resumed from its per-rank checkpoints
(residuals and all) ends exactly where the uninterrupted run ended."""
import math
import re

import pytest

from harness import ROOT, run_ranks

pytestmark = pytest.mark.multirank

SCRIPT = str(ROOT / "examples" / "pytorch_lm_sbc.py")
TINY = ["--warmup", "5", "--width", "32", "--layers", "1", "--seq-len", "32",
        "--batch-size", "8", "--log-every", "10"]
RESULT = re.compile(r"compression=(\w+) density=(\S+) delay=(\d+) steps=(\d+) "
                    r"test_perplexity=(\S+) upstream_ratio=x(\d+) step_ms=(\S+)")


def run_example(*args):
    _, out = run_ranks(SCRIPT, 2, [*TINY, *args], timeout=150, raw=True)
    found = RESULT.findall(out)
    assert len(found) == 1, out[-3000:]
    comp, _, _, steps, ppl, ratio, ms = found[0]
    vocab = int(re.search(r"vocab (\d+)", out).group(1))
    ppl = float(ppl)
    assert math.isfinite(ppl) and 1 < ppl < vocab, out[-3000:]
    assert float(ms) > 0
    return {"compression": comp, "steps": int(steps), "ppl": ppl, "ratio": int(ratio),
            "out": out}


def test_dense_trains_below_the_vocabulary_size():
    r = run_example("--compression", "none", "--steps", "30")
    assert r["compression"] == "none" and r["ratio"] == 1 and r["steps"] == 30


def test_sbc_compresses_and_resumes_from_its_checkpoints_exactly(tmp_path):
    """A 30-step run saves each rank's state at step 20; the same command again resumes there
    (weights, AdamW, schedule, SBC's residuals and shared weights) and ends where it ended."""
    ck = str(tmp_path / "lm.pt")
    args = ["--compression", "sbc", "--steps", "30", "--checkpoint", ck, "--save-every", "20"]
    full = run_example(*args)
    assert full["compression"] == "sbc" and full["ratio"] > 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm.pt.rank0", "lm.pt.rank1"]
    resumed = run_example(*args)
    assert "at step 20" in resumed["out"] and "step 10/30" not in resumed["out"]
    assert resumed["ppl"] == full["ppl"], (full["ppl"], resumed["ppl"])
    last = [re.search(r"step 30/30 loss \S+", r["out"]).group(0) for r in (full, resumed)]
    assert last[0] == last[1]
    # the traffic counters come back with the rest
    assert resumed["ratio"] == full["ratio"]  # the resumed step's traffic counted once
