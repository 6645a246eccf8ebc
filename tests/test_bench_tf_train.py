"""benchmarks/bench_tf_train.py without jobs: the summary, the TF − torch gap, the table, the rows
built from per-rank results, argument parsing, and the Keras translation of the torch CNN."""
import math

import pytest

from benchmarks import bench_tf_train as bt


def _row(method, seed, acc, ratio=None, identical=True):
    fw = "torch" if method.startswith("torch") else "tf"
    up = 1000.0 if ratio is None else 1000.0 / ratio
    return {"method": method, "framework": fw, "seed": seed, "accuracy": acc,
            "upstream_bits": up, "dense_bits": 1000.0, "compression_ratio": 1000.0 / up,
            "ranks_identical": identical, "step_time_s": 0.01}


def _rows():
    rows = []
    for seed, (td, ts, fd, ft, fk) in enumerate([(0.86, 0.84, 0.86, 0.85, 0.82),
                                                 (0.88, 0.85, 0.87, 0.86, 0.83),
                                                 (0.84, 0.83, 0.85, 0.84, 0.81)]):
        rows += [_row("torch_alone", seed, td - 0.1, identical=False),
                 _row("torch_stock_sbc", seed, ts, 129.0), _row("tf_stock_sbc", seed, ft, 129.0),
                 _row("torch_dense", seed, td), _row("torch_sbc", seed, ts, 591.0),
                 _row("tf_dense", seed, fd), _row("tf_tape_sbc", seed, ft, 589.0),
                 _row("keras_sbc", seed, fk, 589.0)]
    return rows


def test_summary_mean_and_population_std():
    s = bt.summarize(_rows())
    assert list(s) == list(bt.METHODS)
    assert s["torch_dense"]["accuracy"] == pytest.approx(0.86)
    # population std of 0.86, 0.88, 0.84: sqrt(8e-4 / 3)
    assert s["torch_dense"]["accuracy_std"] == pytest.approx(math.sqrt(8e-4 / 3))
    assert s["torch_sbc"]["accuracy_seeds"] == [0.84, 0.85, 0.83]
    assert s["torch_sbc"]["compression_ratio"] == pytest.approx(591.0)
    assert s["tf_tape_sbc"]["framework"] == "tf"
    assert s["keras_sbc"]["ranks_identical"] is True


def test_summary_flags_a_run_whose_ranks_differ_and_sorts_seeds():
    rows = _rows()
    rows[-1]["ranks_identical"] = False           # keras_sbc, seed 2
    rows.reverse()                                # seed order must not matter
    s = bt.summarize(rows)
    assert s["keras_sbc"]["ranks_identical"] is False
    assert s["tf_tape_sbc"]["ranks_identical"] is True
    assert s["keras_sbc"]["seeds"] == [0, 1, 2]


def test_gap_in_points_paired_and_within():
    g = bt.gaps(bt.summarize(_rows()))
    assert set(g) == {"tf_dense", "tf_tape_sbc", "keras_sbc", "tf_stock_sbc"}
    assert g["tf_stock_sbc"]["versus"] == "torch_stock_sbc"
    # tape: 0.85 mean vs torch 0.84: +1.0 point, paired differences +1, +1, +1
    assert g["tf_tape_sbc"]["versus"] == "torch_sbc"
    assert g["tf_tape_sbc"]["gap_pt"] == pytest.approx(1.0)
    assert g["tf_tape_sbc"]["paired_gap_pt"] == pytest.approx([1.0, 1.0, 1.0])
    assert g["tf_tape_sbc"]["paired_gap_std_pt"] == pytest.approx(0.0, abs=1e-9)
    assert g["tf_tape_sbc"]["within"] is True     # |gap| <= 1 point
    # keras: 0.82 vs 0.84: -2 points, not within
    assert g["keras_sbc"]["gap_pt"] == pytest.approx(-2.0)
    assert g["keras_sbc"]["within"] is False
    # dense: 0.86 vs 0.86
    assert g["tf_dense"]["gap_pt"] == pytest.approx(0.0, abs=1e-9)
    assert g["tf_dense"]["paired_gap_pt"] == pytest.approx([0.0, -1.0, 1.0])
    assert g["tf_tape_sbc"]["ratio_tf_over_torch"] == pytest.approx(589.0 / 591.0)
    assert "NOT reached" in bt.verdict(g) and "keras_sbc -2.00 pt" in bt.verdict(g)


def test_gap_is_symmetric_and_verdict_reached():
    rows = [r for r in _rows() if r["method"] != "keras_sbc"]
    for r in rows:  # TF 1.5 points above torch: also outside "within 1 point"
        if r["method"] == "tf_tape_sbc":
            r["accuracy"] += 0.005
    g = bt.gaps(bt.summarize(rows))
    assert g["tf_tape_sbc"]["gap_pt"] == pytest.approx(1.5)
    assert g["tf_tape_sbc"]["within"] is False
    for r in rows:
        if r["method"] == "tf_tape_sbc":
            r["accuracy"] -= 0.02                 # now 0.5 below
    g = bt.gaps(bt.summarize(rows))
    assert g["tf_tape_sbc"]["gap_pt"] == pytest.approx(-0.5)
    assert "keras_sbc" not in g
    assert bt.verdict(g).startswith("reached")
    assert bt.verdict({}) == "not measured"


def test_markdown_table_numbers():
    s = bt.summarize(_rows())
    md = bt.markdown_table(s, bt.gaps(s))
    lines = md.splitlines()
    assert len(lines) == 2 + len(bt.METHODS)
    tape = next(x for x in lines if x.startswith("| tf_tape_sbc"))
    assert "85.00 ± 0.82 %" in tape               # std of 0.85, 0.86, 0.84
    assert "85.0, 86.0, 84.0" in tape
    assert "| 589 |" in tape
    assert "+1.00 (vs torch_sbc; paired +1.00 ± 0.00)" in tape
    keras = next(x for x in lines if x.startswith("| keras_sbc"))
    assert "-2.00 (vs torch_sbc" in keras
    torch_dense = next(x for x in lines if x.startswith("| torch_dense"))
    assert "| 1.00 |" in torch_dense and "| - |" in torch_dense


def _rank(acc, digest, ref=None, up=600, method="tf_tape_sbc"):
    r = {"method": method, "seed": 1, "accuracy": acc, "score_shared": 0.8, "digest": digest,
         "init_max_abs_diff": 1e-7, "params": 10, "steps": 8, "step_time_s": 0.01,
         "train_s": 1.0, "stats": {"upstream_bits": up, "downstream_bits": 3 * up,
                                   "dense_bits": 32 * 10 * 8, "syncs": 2, "steps": 8,
                                   "positions_sent": 4, "elements_synced": 40,
                                   "finish_bits": 320}}
    if ref is not None:
        r["reference_digest"] = ref
    return r


def test_tf_row_from_ranks():
    row = bt.tf_row([_rank(0.9, "a", "a", 600), _rank(0.9, "a", "a", 680)], {"sha256": "x"})
    assert row["ranks_identical"] and row["reference_identical"]
    assert row["reference_equals_weights"]
    assert row["upstream_bits"] == 640                  # mean over ranks
    assert row["compression_ratio"] == pytest.approx(2560 / 640)
    assert row["ratio_with_finish"] == pytest.approx(2560 / (640 + 320))
    assert row["workers"] == 2 and row["data_sha256"] == "x"
    bad = bt.tf_row([_rank(0.9, "a", "r"), _rank(0.8, "b", "s")])
    assert not bad["ranks_identical"] and not bad["reference_identical"]
    assert not bad["reference_equals_weights"]
    assert bad["accuracy"] == 0.9 and bad["accuracy_all_ranks"] == [0.9, 0.8]


def test_torch_rows_split_seeds():
    run = {"method": "sbc", "seeds": [0, 1], "score_seeds": [0.8, 0.82],
           "score_shared_seeds": [0.79, 0.81], "upstream_bits": 100.0, "downstream_bits": 300.0,
           "dense_bits": 59100.0, "syncs": 125.0, "finish_bits": 256320.0,
           "ranks_identical": True, "params": 8010, "steps": 500, "workers": 4,
           "step_time_s": 0.04, "wall_s": 30.0, "task_info": {"sha256": "d"}}
    rows = bt.torch_rows([run, dict(run, method="none", seeds=[0], score_seeds=[0.85]),
                          dict(run, method="local", seeds=[0], score_seeds=[0.7]),
                          dict(run, api="stock", seeds=[0], score_seeds=[0.83])])
    assert [(r["method"], r["seed"], r["accuracy"]) for r in rows] == [
        ("torch_sbc", 0, 0.8), ("torch_sbc", 1, 0.82), ("torch_dense", 0, 0.85),
        ("torch_alone", 0, 0.7), ("torch_stock_sbc", 0, 0.83)]
    assert rows[1]["score_shared"] == 0.81
    assert rows[0]["compression_ratio"] == pytest.approx(591.0)


def test_parse_args_and_jobs():
    a = bt.parse_args(["--workers", "4", "--seeds", "0,1,2", "--json", "x.json"])
    assert (a.workers, a.seeds, a.density, a.delay, a.json) == (4, [0, 1, 2], 0.01, 4, "x.json")
    # SGD at delay 4: every method but the stock ones (asked for by --methods)
    assert a.methods == [m for m in bt.METHODS if m not in bt.STOCK_METHODS]
    assert "torch_alone" in a.methods and bt._steps(a) == 500
    assert bt.parse_args(["--delay", "1"]).methods == list(bt.METHODS)
    # the stock paths exchange weight changes at a delay > 1: the stock rows take it
    d4 = bt.parse_args(["--delay", "4", "--methods", "tf_stock_sbc,torch_stock_sbc"])
    assert d4.methods == ["tf_stock_sbc", "torch_stock_sbc"]
    assert [(s["api"], s["delay"]) for s in bt.torch_specs(["torch_stock_sbc"], d4)] == \
        [("stock", 4)]
    js = bt.jobs(a)
    assert [(j["framework"], j["seed"]) for j in js] == [
        ("torch", 0), ("tf", 0), ("torch", 1), ("tf", 1), ("torch", 2), ("tf", 2)]
    assert js[1]["methods"] == ["tf_dense", "tf_tape_sbc", "keras_sbc"]
    assert len({j["key"] for j in js}) == 6
    b = bt.parse_args(["--seeds", "3", "--steps", "200", "--methods", "keras_sbc,torch_sbc"])
    assert bt._steps(b) == 200
    assert [(j["framework"], j["methods"]) for j in bt.jobs(b)] == [
        ("torch", ["torch_sbc"]), ("tf", ["keras_sbc"])]
    for bad in (["--methods", "tf_sbc"], ["--seeds", ""], ["--density", "0"]):
        with pytest.raises(SystemExit):
            bt.parse_args(bad)


def test_recipe_steps_are_the_mnist1d_tasks():
    pytest.importorskip("mnist1d")
    from benchmarks.tasks import make_task
    task = make_task("mnist1d", 0, num_samples=120)
    assert task.recipe.steps == bt.RECIPE_STEPS
    assert (task.recipe.lr, task.recipe.momentum, task.recipe.batch_size) == (0.05, 0.9, 64)


def test_keras_translation_computes_the_torch_cnn():
    pytest.importorskip("keras")
    torch = pytest.importorskip("torch")
    from benchmarks.tasks import mnist1d_cnn
    torch.manual_seed(3)
    tm = mnist1d_cnn(8, 40)
    km = bt.keras_from_torch(tm, 40)
    assert sum(int(v.numpy().size) for v in km.trainable_variables) == \
        sum(p.numel() for p in tm.parameters())
    x = torch.randn(16, 40)
    with torch.no_grad():
        want = tm(x).numpy()
    got = km(x.numpy(), training=False).numpy()
    assert abs(got - want).max() < 1e-4


def test_table_marks_the_tapes_gradient_mode():
    rows = _rows()
    for r in rows:
        if r["method"] == "tf_tape_sbc":
            r["sbc_mode"] = "gradients"           # the tape at delay 1
        elif r["method"] == "keras_sbc":
            r["sbc_mode"] = "weights"
    s = bt.summarize(rows)
    assert s["tf_tape_sbc"]["sbc_mode"] == "gradients"
    md = bt.markdown_table(s, bt.gaps(s))
    tape = next(x for x in md.splitlines() if x.startswith("| tf_tape_sbc"))
    keras = next(x for x in md.splitlines() if x.startswith("| keras_sbc"))
    assert "(gradient mode)" in tape and "(gradient mode)" not in keras


def test_adamw_with_the_freeze_reaches_every_method_of_both_frameworks():
    a = bt.parse_args(["--optimizer", "adamw", "--freeze", "100", "--delay", "1"])
    assert a.methods == list(bt.METHODS)  # the stock ones exchange weight changes with Adam
    spec = bt.optimizer_spec(a)
    assert spec == {"optimizer": "adamw", "lr": bt.ADAMW_LR,
                    "weight_decay": bt.ADAMW_WEIGHT_DECAY, "freeze_variance_after": 100}
    specs = bt.torch_specs(["torch_dense", "torch_alone", "torch_sbc", "torch_stock_sbc"], a)
    assert [s["method"] for s in specs] == ["none", "local", "sbc", "sbc"]
    assert all({k: s[k] for k in spec} == spec for s in specs)
    # an SGD run and an AdamW run of the same seed are different jobs for --resume
    sgd = bt.parse_args(["--delay", "1", "--methods", ",".join(a.methods)])
    assert not bt.optimizer_spec(sgd) and "optimizer" not in bt.torch_specs(["torch_sbc"], sgd)[0]
    assert not {j["key"] for j in bt.jobs(a)} & {j["key"] for j in bt.jobs(sgd)}
    assert bt.optimizer_spec(bt.parse_args(["--optimizer", "adamw", "--lr", "0.003"]))["lr"] \
        == 0.003
    for bad in (["--freeze", "100"], ["--lr", "0.1"], ["--optimizer", "adamw", "--freeze", "0"]):
        with pytest.raises(SystemExit):
            bt.parse_args(bad)
    # AdamW without --freeze at the default delay: every method, stock ones at that delay, and
    # no freeze in any spec (SBC's automatic one in the SBC rows, plain AdamW in the dense ones)
    auto = bt.parse_args(["--optimizer", "adamw"])
    assert auto.methods == list(bt.METHODS)
    assert "freeze_variance_after" not in bt.optimizer_spec(auto)
    stock = bt.torch_specs(["torch_stock_sbc"], auto)[0]
    assert (stock["api"], stock["delay"], stock["optimizer"]) == ("stock", bt.DELAY, "adamw")
    assert "freeze_variance_after" not in stock


def test_the_keras_optimizer_of_a_spec():
    keras = pytest.importorskip("keras")
    from benchmarks.tasks import make_task
    recipe = make_task("mnist1d").recipe
    sgd = bt._keras_optimizer({}, recipe)
    assert isinstance(sgd, keras.optimizers.SGD) and sgd.momentum == recipe.momentum
    a = bt.parse_args(["--optimizer", "adamw", "--freeze", "100"])
    opt = bt._keras_optimizer(bt.optimizer_spec(a), recipe)
    assert isinstance(opt, keras.optimizers.AdamW) and opt._sbc_freeze_after == 100
    assert (opt.weight_decay, opt.epsilon, opt.beta_2) == (0.01, 1e-8, recipe.betas[1])
    assert not hasattr(bt._keras_optimizer(bt.optimizer_spec(
        bt.parse_args(["--optimizer", "adamw"])), recipe), "_sbc_freeze_after")


# -- the transformer task (issue 49) --------------------------------------------------------------
def test_transformer_recipe_is_the_tasks():
    from benchmarks.tasks import make_task
    task = make_task("transformer", 0, seq_len=8, width=16, layers=1, train_windows=64)
    r, want = task.recipe, bt.TASK_RECIPES["transformer"]
    assert task.metric == want["metric"] == "perplexity"
    assert (r.lr, r.betas, r.weight_decay, r.warmup, r.schedule, r.batch_size, r.steps) == (
        want["lr"], want["betas"], want["weight_decay"], want["warmup"], want["schedule"],
        want["batch_size"], want["steps"])
    # --optimizer adamw on the transformer: the recipe's lr and weight decay, not mnist1d's
    a = bt.parse_args(["--task", "transformer", "--delay", "1"])
    assert a.optimizer == "adamw" and bt._steps(a) == 600
    assert bt.optimizer_spec(a) == {"optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.1}
    assert bt.optimizer_spec(bt.parse_args(["--task", "transformer", "--optimizer", "adamw"])) \
        == bt.optimizer_spec(a)
    assert bt.torch_specs(["torch_sbc"], a)[0]["lr"] == 3e-3
    # mnist1d unchanged: SGD by default, AdamW lr 1e-3 / weight decay 0.01
    m = bt.parse_args([])
    assert (m.task, m.optimizer, bt._steps(m)) == ("mnist1d", "sgd", 500)
    assert bt.optimizer_spec(bt.parse_args(["--optimizer", "adamw"]))["lr"] == bt.ADAMW_LR
    # a transformer job is never a mnist1d job for --resume
    mk = {j["key"] for j in bt.jobs(bt.parse_args(["--optimizer", "adamw", "--delay", "1",
                                                   "--seeds", "0"]))}
    tk = {j["key"] for j in bt.jobs(bt.parse_args(["--task", "transformer", "--delay", "1",
                                                   "--seeds", "0"]))}
    assert len(tk) == 2 and not mk & tk
    with pytest.raises(SystemExit):
        bt.parse_args(["--task", "transformer", "--optimizer", "sgd"])


def test_keras_transformer_port_computes_the_torch_model():
    pytest.importorskip("keras")
    torch = pytest.importorskip("torch")
    import numpy as np
    import tensorflow as tf
    from benchmarks.tasks import char_transformer
    torch.manual_seed(5)
    tm = char_transformer(11, 8, width=16, heads=4, layers=1)
    km = bt.keras_transformer_from_torch(tm)
    assert sum(int(v.numpy().size) for v in km.trainable_variables) == \
        sum(p.numel() for p in tm.parameters())
    # larger weights than the init's std 0.02: every part of the model shows in the logits
    with torch.no_grad():
        for p in tm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    km = bt.keras_transformer_from_torch(tm)
    x = torch.randint(0, 11, (6, 8))
    with torch.no_grad():
        want = tm(x).numpy()
    got = km(x.numpy(), training=False).numpy()
    assert got.shape == want.shape == (6, 8, 11)
    assert np.abs(got - want).max() < 1e-5
    # causal: changing the last token changes no earlier position's logits
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 11
    got2 = km(x2.numpy(), training=False).numpy()
    assert np.abs(got2[:, :-1] - got[:, :-1]).max() < 1e-6
    assert np.abs(got2[:, -1] - got[:, -1]).max() > 1e-3
    # the tied embedding's gradient: dense (as torch's) and equal to torch's
    y = torch.randint(0, 11, (6, 8))
    tm.zero_grad()
    torch.nn.functional.cross_entropy(tm(x).reshape(-1, 11), y.reshape(-1)).backward()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y.numpy(), logits=km(x.numpy())))
    grads = dict(zip(km.w, tape.gradient(loss, list(km.w.values()))))
    assert isinstance(grads["embed"], tf.Tensor)  # not IndexedSlices
    assert np.abs(grads["embed"].numpy() - tm.embed.weight.grad.numpy()).max() < 1e-5
    assert np.abs(grads["b0_in_proj_w"].numpy()
                  - tm.blocks.layers[0].self_attn.in_proj_weight.grad.numpy()).max() < 1e-5


def test_keras_schedule_is_the_recipes_lr_factor():
    keras = pytest.importorskip("keras")
    from benchmarks.tasks import make_task
    recipe = make_task("transformer", 0, seq_len=8, width=16, layers=1, train_windows=64).recipe
    spec = bt.optimizer_spec(bt.parse_args(["--task", "transformer"]))
    opt = bt._keras_optimizer(spec, recipe, 600)
    assert isinstance(opt, keras.optimizers.AdamW)
    assert (opt.beta_1, opt.beta_2, opt.epsilon, opt.weight_decay) == (0.9, 0.95, 1e-8, 0.1)
    sched = opt._learning_rate
    for step in (0, 1, 15, 29, 30, 31, 100, 314, 599):
        want = 3e-3 * recipe.lr_factor(step, 600)
        assert float(sched(step)) == pytest.approx(want, rel=1e-5, abs=1e-10), step
    # over 40 steps (a short run) the cosine ends at the 40th, as the torch worker's LambdaLR
    short = bt._keras_optimizer(spec, recipe, 40)._learning_rate
    assert float(short(35)) == pytest.approx(3e-3 * recipe.lr_factor(35, 40), rel=1e-5)
    assert float(short(35)) != pytest.approx(float(sched(35)), rel=1e-3)
    # the optimizer applies it per step: the learning rate it uses at its step 10
    opt.iterations.assign(10)
    assert float(opt.learning_rate) == pytest.approx(3e-3 * 11 / 30, rel=1e-6)
    # mnist1d's constant recipe keeps a constant learning rate
    mn = bt._keras_optimizer(bt.optimizer_spec(bt.parse_args(["--optimizer", "adamw"])),
                             make_task("transformer", 0, seq_len=8, width=16, layers=1,
                                       train_windows=64, warmup=0, schedule="constant").recipe)
    assert not isinstance(mn._learning_rate, keras.optimizers.schedules.LearningRateSchedule)


def _ppl_rows(torch_ppl, tf_ppl):
    rows = []
    for seed, (a, b) in enumerate(zip(torch_ppl, tf_ppl)):
        for m, v in (("torch_sbc", a), ("tf_tape_sbc", b), ("keras_sbc", b),
                     ("torch_dense", a), ("tf_dense", 1.5 * b)):
            r = _row(m, seed, None)
            del r["accuracy"]
            r["perplexity"] = v
            rows.append(r)
    return rows


def test_perplexity_gap_is_relative_and_lower_is_better():
    # torch 7.0, TF 7.14: +2 % (within 3 %), a 0.14 difference in "points" would say nothing
    s = bt.summarize(_ppl_rows([6.9, 7.0, 7.1], [6.9 * 1.02, 7.0 * 1.02, 7.1 * 1.02]))
    assert s["torch_sbc"]["metric"] == "perplexity" and "accuracy" not in s["torch_sbc"]
    assert s["torch_sbc"]["perplexity"] == pytest.approx(7.0)
    g = bt.gaps(s)
    assert "gap_pt" not in g["tf_tape_sbc"]
    assert g["tf_tape_sbc"]["gap_pct"] == pytest.approx(2.0)
    assert g["tf_tape_sbc"]["paired_gap_pct"] == pytest.approx([2.0, 2.0, 2.0])
    assert g["tf_tape_sbc"]["within"] is True
    assert g["tf_dense"]["gap_pct"] == pytest.approx(53.0) and not g["tf_dense"]["within"]
    v = bt.verdict(g)  # tf_dense is not part of the verdict
    assert v.startswith("reached") and "+2.00 %" in v and "within 3 %" in v
    # 4 % worse (higher perplexity): not within; 4 % better (lower): not within either
    for f in (1.04, 0.96):
        g = bt.gaps(bt.summarize(_ppl_rows([7.0] * 3, [7.0 * f] * 3)))
        assert g["keras_sbc"]["gap_pct"] == pytest.approx(100 * (f - 1))
        assert g["keras_sbc"]["within"] is False
        assert bt.verdict(g).startswith("NOT reached")
    # the relative gap, not a difference: perplexity 20 vs 20.5 is +2.5 %, within
    g = bt.gaps(bt.summarize(_ppl_rows([20.0] * 3, [20.5] * 3)))
    assert g["tf_tape_sbc"]["gap_pct"] == pytest.approx(2.5) and g["tf_tape_sbc"]["within"]
    md = bt.markdown_table(bt.summarize(_ppl_rows([7.0] * 3, [7.14] * 3)), g)
    assert "test perplexity" in md and "TF / torch − 1 (%)" in md
    tape = next(x for x in md.splitlines() if x.startswith("| tf_tape_sbc"))
    assert "7.140 ± 0.000" in tape and "+2.50 % (vs torch_sbc" in tape


def test_tf_and_torch_rows_carry_perplexity():
    ranks = [_rank(0.0, "a", "a"), _rank(0.0, "a", "a")]
    for r in ranks:
        del r["accuracy"]
        r["perplexity"] = 7.25
    row = bt.tf_row(ranks)
    assert row["perplexity"] == 7.25 and "accuracy" not in row
    assert row["perplexity_all_ranks"] == [7.25, 7.25]
    run = {"method": "none", "metric": "perplexity", "seeds": [0], "score_seeds": [7.1],
           "upstream_bits": 1.0, "downstream_bits": 1.0, "dense_bits": 1.0, "syncs": 1.0,
           "ranks_identical": True, "params": 1, "steps": 1, "workers": 4, "step_time_s": 0.1}
    (t,) = bt.torch_rows([run])
    assert t["perplexity"] == 7.1 and "accuracy" not in t
