"""benchmarks/tasks.py: offline, deterministic data; partitions; models and metrics."""
import hashlib
import os

import pytest
import torch

from benchmarks.tasks import PARTITIONS, make_task, stdlib_corpus


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("name", ["digits_conv", "text", "transformer", "mnist1d"])
def test_task_is_deterministic_partitions_cover_and_model_runs(name):
    if name == "mnist1d":
        pytest.importorskip("mnist1d")
    a = make_task(name, seed=0)
    b = make_task(name, seed=0, steps=7)  # recipe override; same data
    assert b.recipe.steps == 7 and a.recipe.steps != 7
    assert _digest(a.x_train) == _digest(b.x_train) and _digest(a.y_test) == _digest(b.y_test)
    n = len(a.x_train)
    for part in PARTITIONS:
        for size in (2, 4):
            shards = [a.shard(r, size, part) for r in range(size)]
            assert sum(len(x) for x, _ in shards) == n
            if part == "by_class":  # no group is seen by two ranks
                seen = [set(a.groups[a.groups % size == r].tolist()) for r in range(size)]
                assert all(not (seen[i] & seen[j]) for i in range(size) for j in range(i))
    torch.manual_seed(0)
    model = a.build_model()
    x, y = a.shard(0, 2, "iid")
    idx = next(a.batches(len(x), 8, seed=0))
    loss = a.loss(model, x[idx], y[idx])
    assert torch.isfinite(loss) and loss.item() > 0
    score = a.evaluate(model)
    if a.metric == "accuracy":
        assert 0.0 <= score <= 1.0
    else:  # an untrained model: perplexity near the vocabulary size
        assert 1.0 < score < 2 * a.info["vocab"]


def test_mnist1d_seed_changes_data_and_restores_numpy_state():
    pytest.importorskip("mnist1d")
    import numpy as np
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    a, c = make_task("mnist1d", seed=0), make_task("mnist1d", seed=1)
    assert _digest(a.x_train) != _digest(c.x_train)
    assert (np.random.get_state()[1] == before).all()
    assert a.info["sha256"] and a.info["train"] == len(a.x_train)


def test_text_records_its_corpus():
    import sys
    t = make_task("text")
    assert t.info["python"] == sys.version and len(t.info["sha256"]) == 64
    assert t.metric == "perplexity" and not t.higher_is_better
    assert int(t.groups.max()) + 1 <= t.info["topics"]


def test_the_second_lm_task_is_the_transformer_on_the_standard_librarys_source():
    """transformer_code: the transformer's model and recipe on another corpus, modules of the
    standard library as documents (each module's windows one group, its last 10 % the test
    text), the same on every call (its sha256 and module list recorded)."""
    import sys
    import sysconfig
    t, lm = make_task("transformer_code"), make_task("transformer")
    assert t.name == "transformer_code" and t.recipe == lm.recipe
    assert t.info["sha256"] != lm.info["sha256"] and t.info["python"] == sys.version
    mods = t.info["modules"]
    assert mods == sorted(mods) and len(mods) == t.info["topics"] == int(t.groups.max()) + 1
    docs, info = stdlib_corpus()
    assert info["sha256"] == t.info["sha256"] and list(docs) == mods  # deterministic
    with open(os.path.join(sysconfig.get_paths()["stdlib"], mods[-1] + ".py"),
              encoding="utf-8", errors="replace") as f:
        assert docs[mods[-1]] == f.read(20_000)  # each document: its module's first characters
    assert 480_000 <= t.info["chars"] <= 480_000 + 20_000 + len(mods)
    assert all(int((t.groups == g).sum()) > 0 for g in range(len(mods)))
    model = t.build_model()
    assert model.embed.weight.shape[0] == t.info["vocab"]


def test_transformer_is_causal_and_its_recipe_warms_up_then_decays():
    t = make_task("transformer")
    assert t.recipe.optimizer == "adamw" and t.recipe.betas == (0.9, 0.95)
    r, steps = t.recipe, t.recipe.steps
    f = [r.lr_factor(s, steps) for s in range(steps)]
    assert f[0] == pytest.approx(1 / r.warmup) and f[r.warmup - 1] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[r.warmup:], f[r.warmup + 1:]))  # cosine: decreasing
    assert f[-1] < 1e-4
    torch.manual_seed(0)
    model = t.build_model().eval()
    x = t.x_train[:2].clone()
    with torch.no_grad():
        before = model(x)
        x[:, 40:] = (x[:, 40:] + 1) % t.info["vocab"]  # change only the later characters
        after = model(x)
    # the prediction at position i sees characters 0..i only
    assert torch.equal(before[:, :40], after[:, :40])
    assert not torch.allclose(before[:, 40:], after[:, 40:])


def test_unknown_task_and_partition_are_rejected():
    with pytest.raises(ValueError, match="unknown task"):
        make_task("imagenet")
    with pytest.raises(ValueError, match="partition"):
        make_task("digits_conv").shard(0, 2, "random")
