"""Benchmark tasks where communication matters: data, model and recipe behind one call.

    from benchmarks.tasks import make_task
    task = make_task("mnist1d")                  # or "text", "digits_conv"
    model = task.build_model()                   # seed torch first: torch.manual_seed(s)
    xs, ys = task.shard(rank, size, "iid")       # this rank's training samples ("by_class" too)
    for step in range(task.recipe.steps):
        idx = batches.next()                     # e.g. task.batches(rank, seed) below
        loss = task.loss(model, xs[idx], ys[idx])
        ...
    score = task.evaluate(model)                 # test accuracy (fraction) or test perplexity

Every task is generated or read offline and deterministically: nothing is downloaded.

``mnist1d``
    Greydanus' MNIST-1D (the ``mnist1d`` package): ``mnist1d.data.make_dataset`` with its default
    arguments except ``num_samples`` and ``seed`` (never ``get_dataset``, which downloads).
    6,000 generated sequences of length 40, 10 classes: 4,000 for training and 2,000 for test.
    Model: a small 1-D CNN (3 conv layers of 32 channels, ReLU, a linear head; 8,010 parameters).
    Few training samples per rank make the exchange matter: a rank alone on its IID quarter is
    well below dense training (see docs/benchmarks.md for the measured gap).
``mnist1d_long``
    The longer setting the quality goals are stated in: the same data generator and CNN with 12,000
    generated sequences (8,000 for training, 4,000 for test), batch 32 per rank, 1,500 steps,
    SGD lr 0.05 momentum 0.9. Three times the steps of ``mnist1d``: the sparse methods' lag
    matters less, and a rank alone still ends ~8 points below dense at 4 workers.
``text``
    Character-level language model on a real corpus every CPython has: the pydoc topic texts
    ``pydoc_data.topics.topics`` (the help() pages of the language reference), joined in sorted
    key order. ``info`` records ``sys.version`` and the sha256 of the joined text (they differ
    between Python versions). Each topic's last 10 % is the test text. Samples are windows of
    ``seq_len + 1`` characters; the group of a sample (for the non-IID partition) is its topic.
    Training uses an even subset of ``train_windows`` windows (default 800 windows of 33
    characters, ~26k characters) so that a rank alone overfits its share (Adam, lr 5e-3); the
    test text is every topic's whole last 10 %. Model: embedding 32 -> one LSTM layer of 96 ->
    linear over the characters. Metric: test perplexity per character (lower is better).
``transformer``
    A small causal transformer language model (pre-norm, 2 blocks, width 64, 4 heads, learned
    positions, tied input/output embedding; ~0.1M parameters) on the same pydoc corpus and
    character ids as ``text``, windows of 64 characters, trained as today's transformer recipes
    are: AdamW (lr 3e-3, betas (0.9, 0.95), weight decay 0.1), 30 warm-up steps then cosine to 0,
    600 steps, batch 16. Each topic is a document: the ``by_class`` partition gives every
    worker its own documents (contiguous text), ``iid`` deals the windows round-robin. Metric:
    test perplexity per character.
``transformer_code``
    The second language-model task: the same model and recipe as ``transformer``, another
    corpus every CPython has: the source of its standard library's top-level modules
    (``sysconfig.get_paths()["stdlib"]/*.py`` in sorted name order, each cut to its first
    20,000 characters, until 480,000 characters; each module a document). Python code instead
    of English prose; ``info`` records the modules, ``sys.version`` and the sha256.
``digits_conv``
    scikit-learn's digits (shipped with scikit-learn) as 8x8 images and a conv + BatchNorm +
    linear net; the quick one the tests use.
``regression``
    An MLP regression on generated data: 20 standard-normal inputs, the target a fixed random
    teacher network (two tanh layers of 32, numpy seed 1234) plus 10 % noise, 4,000 samples
    for training and 2,000 for test; the student an MLP 20-128-128-1 (ReLU) trained with Adam.
    Metric: test mean squared error over the targets' variance (lower is better). The group of
    a sample (for the non-IID partition) is the decile of its target.

Partitions (:meth:`Task.shard`): ``"iid"`` deals the training samples round-robin; ``"by_class"``
(non-IID) gives rank r the samples whose group (class, or topic for ``text``) g has
``g % size == r``, so no rank sees the other ranks' groups.

Each task carries a :class:`Recipe` (optimizer settings, batch size and number of steps the
benchmarks use); override any of them with ``make_task(name, steps=..., lr=...)``.
"""
from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterator, Optional, Tuple

import numpy as np

PARTITIONS = ("iid", "by_class")
TASKS = ("mnist1d", "mnist1d_long", "text", "transformer", "transformer_code", "digits_conv",
         "regression")


@dataclass(frozen=True)
class Recipe:
    """What the benchmarks train with (all workers, every method)."""
    lr: float            # learning rate of SGD (momentum) or Adam
    momentum: float      # SGD momentum (0: plain SGD)
    batch_size: int      # per rank
    steps: int           # optimizer steps per run (every method, every rank: equal work)
    optimizer: str = "sgd"   # "sgd", "adam" or "adamw"
    betas: Tuple[float, float] = (0.9, 0.999)  # Adam/AdamW
    weight_decay: float = 0.0
    warmup: int = 0      # linear warm-up steps of the learning rate, then ...
    schedule: str = "constant"  # ... "constant" or "cosine" (to 0 at the last step)

    def lr_factor(self, step: int, steps: int) -> float:
        """The learning rate multiplier at ``step`` (0-based) of ``steps``."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.schedule == "cosine":
            t = (step - self.warmup) / max(1, steps - self.warmup)
            return 0.5 * (1.0 + math.cos(math.pi * t))
        return 1.0


@dataclass
class Task:
    """A benchmark task: tensors, a model factory, a loss and a test metric.

    ``x_train``/``y_train``/``x_test``/``y_test`` are torch tensors; ``groups`` gives, per
    training sample, the group the non-IID partition splits by. ``metric`` is ``"accuracy"``
    (fraction, higher is better) or ``"perplexity"`` (lower is better).
    """
    name: str
    x_train: object
    y_train: object
    x_test: object
    y_test: object
    groups: object
    build_model: Callable[[], object]
    recipe: Recipe
    metric: str
    info: Dict[str, object] = field(default_factory=dict)

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"

    def loss(self, model, x, y):
        """Mean cross-entropy of a batch (per character for ``text``); the mean squared error
        for ``regression`` (metric ``"mse"``)."""
        import torch.nn.functional as F
        out = model(x)
        if self.metric == "mse":
            return F.mse_loss(out.reshape(-1), y.reshape(-1))
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def evaluate(self, model, batch: int = 500) -> float:
        """Test accuracy (fraction), test perplexity or test mean squared error over the
        targets' variance (``"mse"``), model in eval mode (restored after)."""
        import torch
        import torch.nn.functional as F
        was = model.training
        model.eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(self.x_test), batch):
                x, y = self.x_test[i:i + batch], self.y_test[i:i + batch]
                out = model(x)
                if self.metric == "mse":
                    total += float(F.mse_loss(out.reshape(-1), y.reshape(-1), reduction="sum"))
                    n += y.numel()
                elif self.metric == "accuracy":
                    total += float((out.argmax(-1) == y).sum())
                    n += len(y)
                else:
                    total += float(F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1),
                                                   reduction="sum"))
                    n += y.numel()
        model.train(was)
        if self.metric == "mse":
            return total / n / float(self.info.get("target_var", 1.0))
        return total / n if self.metric == "accuracy" else math.exp(total / n)

    def shard(self, rank: int, size: int, partition: str = "iid") -> Tuple[object, object]:
        """This rank's training samples (see the module docstring for the partitions)."""
        if partition == "iid":
            return self.x_train[rank::size], self.y_train[rank::size]
        if partition == "by_class":
            m = self.groups % size == rank
            if not bool(m.any()):
                raise ValueError(f"task {self.name!r}: rank {rank} of {size} gets no samples "
                                 "under the by_class partition")
            return self.x_train[m], self.y_train[m]
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")

    def batches(self, n_samples: int, batch_size: int, seed: int) -> Iterator[object]:
        """Endless index batches over ``n_samples`` (a fresh permutation every epoch)."""
        import torch
        g = torch.Generator().manual_seed(seed)
        while True:
            perm = torch.randperm(n_samples, generator=g)
            for i in range(0, n_samples - batch_size + 1, batch_size):
                yield perm[i:i + batch_size]
            if n_samples < batch_size:
                yield perm


# ------------------------------------------------------------------------------------------------
# mnist1d
# ------------------------------------------------------------------------------------------------
def mnist1d_arrays(num_samples: int = 6000, train_split: float = 2 / 3, seed: int = 0):
    """``(x_train, y_train, x_test, y_test)`` numpy arrays from mnist1d's generator (offline).

    numpy's global random state, which ``make_dataset`` reseeds, is restored afterwards."""
    try:
        import mnist1d.data as md
    except ImportError as e:
        raise ImportError("the mnist1d task needs the mnist1d package (pip install mnist1d); "
                          "it generates the data locally, nothing is downloaded") from e
    args = md.get_dataset_args()
    args.num_samples, args.train_split, args.seed = int(num_samples), float(train_split), int(seed)
    state = np.random.get_state()
    try:
        d = md.make_dataset(args)
    finally:
        np.random.set_state(state)
    return (d["x"].astype(np.float32), d["y"].astype(np.int64),
            d["x_test"].astype(np.float32), d["y_test"].astype(np.int64))


def mnist1d_cnn(width: int = 32, length: int = 40, classes: int = 10):
    import torch.nn as nn
    out_len = length
    for _ in range(3):
        out_len = (out_len + 1) // 2
    return nn.Sequential(
        nn.Unflatten(1, (1, length)),
        nn.Conv1d(1, width, 5, stride=2, padding=2), nn.ReLU(),
        nn.Conv1d(width, width, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(width, width, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(width * out_len, classes))


def _mnist1d(seed: int, num_samples: int = 6000, width: int = 32, **_) -> Task:
    import torch
    xtr, ytr, xte, yte = mnist1d_arrays(num_samples, 2 / 3, seed)
    t = [torch.from_numpy(a) for a in (xtr, ytr, xte, yte)]
    import mnist1d
    info = {"source": "mnist1d.data.make_dataset (generated locally, no download)",
            "mnist1d_version": getattr(mnist1d, "__version__", "unknown"),
            "num_samples": num_samples, "train": len(xtr), "test": len(xte), "data_seed": seed,
            "sha256": hashlib.sha256(xtr.tobytes() + xte.tobytes()).hexdigest()}
    return Task("mnist1d", t[0], t[1], t[2], t[3], t[1].clone(),
                lambda: mnist1d_cnn(width, xtr.shape[1]),
                Recipe(lr=0.05, momentum=0.9, batch_size=64, steps=500), "accuracy", info)


# ------------------------------------------------------------------------------------------------
# text (character-level language model on pydoc's topic texts)
# ------------------------------------------------------------------------------------------------
def pydoc_corpus() -> Tuple[Dict[str, str], Dict[str, object]]:
    """The pydoc topic texts (ships with CPython) and their provenance."""
    from pydoc_data.topics import topics
    keys = sorted(topics)
    joined = "\n".join(topics[k] for k in keys)
    info = {"source": "pydoc_data.topics.topics (part of CPython's standard library)",
            "python": sys.version, "topics": len(keys), "chars": len(joined),
            "sha256": hashlib.sha256(joined.encode("utf-8")).hexdigest()}
    return {k: topics[k] for k in keys}, info


def char_lstm(vocab: int, embed: int = 32, hidden: int = 128):
    import torch.nn as nn

    class _CharLSTM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, embed)
            self.lstm = nn.LSTM(embed, hidden, batch_first=True)
            self.head = nn.Linear(hidden, vocab)

        def forward(self, x):
            h, _ = self.lstm(self.embed(x))
            return self.head(h)
    return _CharLSTM()


def stdlib_corpus(per_module: int = 20_000, total: int = 480_000
                  ) -> Tuple[Dict[str, str], Dict[str, object]]:
    """The source of CPython's top-level standard-library modules (see ``transformer_code``)
    and its provenance."""
    import glob
    import os
    import sysconfig
    docs: Dict[str, str] = {}
    size = 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            body = f.read(per_module)
        docs[os.path.basename(path)[:-3]] = body
        size += len(body)
        if size >= total:
            break
    joined = "\n".join(docs.values())
    info = {"source": "the sources of CPython's top-level standard-library modules "
                      f"(first {per_module:,} characters each)",
            "python": sys.version, "topics": len(docs), "modules": list(docs),
            "chars": len(joined), "sha256": hashlib.sha256(joined.encode()).hexdigest()}
    return docs, info


def _text(seed: int, seq_len: int = 32, test_frac: float = 0.1, hidden: int = 96,
          min_count: int = 20, train_windows: int = 800, corpus=None, **_) -> Task:
    import torch
    topics, info = (corpus or pydoc_corpus)()
    text = "".join(topics.values())
    counts: Dict[str, int] = {}
    for ch in text:
        counts[ch] = counts.get(ch, 0) + 1
    chars = sorted(c for c, n in counts.items() if n >= min_count)  # rare ones share one id
    index = {c: i + 1 for i, c in enumerate(chars)}                 # 0: any rare character
    vocab = len(chars) + 1
    win = seq_len + 1
    tr, te, groups = [], [], []
    for gid, body in enumerate(topics.values()):
        ids = np.fromiter((index.get(c, 0) for c in body), dtype=np.int64, count=len(body))
        cut = int(len(ids) * (1 - test_frac))
        for part, out in ((ids[:cut], tr), (ids[cut:], te)):
            n = len(part) // win
            if n:
                out.append(part[:n * win].reshape(n, win))
                if out is tr:
                    groups.append(np.full(n, gid, dtype=np.int64))
    tr_a, te_a, gr_a = np.concatenate(tr), np.concatenate(te), np.concatenate(groups)
    if train_windows and train_windows < len(tr_a):  # an even subset over the whole corpus
        keep = np.linspace(0, len(tr_a) - 1, train_windows).round().astype(np.int64)
        tr_a, gr_a = tr_a[keep], gr_a[keep]
    t_tr, t_te = torch.from_numpy(tr_a), torch.from_numpy(te_a)
    info.update(vocab=vocab, seq_len=seq_len, train_windows=len(tr_a), test_windows=len(te_a),
                test_split=f"last {test_frac:.0%} of every topic")
    return Task("text", t_tr[:, :-1].contiguous(), t_tr[:, 1:].contiguous(),
                t_te[:, :-1].contiguous(), t_te[:, 1:].contiguous(),
                torch.from_numpy(gr_a), lambda: char_lstm(vocab, hidden=hidden),
                Recipe(lr=5e-3, momentum=0.0, batch_size=16, steps=400, optimizer="adam"),
                "perplexity", info)


def char_transformer(vocab: int, seq_len: int, width: int = 64, heads: int = 4,
                     layers: int = 2):
    """A GPT-style causal character model: token + learned position embeddings, pre-norm
    blocks (``nn.TransformerEncoderLayer`` with a causal mask, GELU, 4x MLP), final norm, and
    the output projection tied to the token embedding."""
    import torch
    import torch.nn as nn

    class _CharTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.pos = nn.Parameter(torch.zeros(seq_len, width))
            block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                               activation="gelu", batch_first=True,
                                               norm_first=True)
            self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(
                seq_len), persistent=False)
            nn.init.normal_(self.embed.weight, std=0.02)
            nn.init.normal_(self.pos, std=0.02)

        def forward(self, x):
            n = x.shape[1]
            h = self.embed(x) + self.pos[:n]
            h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
            return self.norm(h) @ self.embed.weight.t()
    return _CharTransformer()


def _transformer(seed: int, seq_len: int = 64, width: int = 64, layers: int = 2,
                 train_windows: int = 0, corpus=None, name: str = "transformer", **_) -> Task:
    t = _text(seed, seq_len=seq_len, train_windows=train_windows, corpus=corpus)
    vocab = t.info["vocab"]
    return replace(t, name=name,
                   build_model=lambda: char_transformer(vocab, seq_len, width, layers=layers),
                   recipe=Recipe(lr=3e-3, momentum=0.0, batch_size=16, steps=600,
                                 optimizer="adamw", betas=(0.9, 0.95), weight_decay=0.1,
                                 warmup=30, schedule="cosine"))


# ------------------------------------------------------------------------------------------------
# digits as images (tests)
# ------------------------------------------------------------------------------------------------
def digits_cnn(width: int = 16):
    import torch.nn as nn
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * width * 16, 10))


def _digits_conv(seed: int, width: int = 16, **_) -> Task:
    import torch
    from examples.common import digits_split
    t = [torch.from_numpy(a) for a in digits_split(seed)]
    info = {"source": "sklearn.datasets.load_digits (shipped with scikit-learn)"}
    return Task("digits_conv", t[0], t[1], t[2], t[3], t[1].clone(), lambda: digits_cnn(width),
                Recipe(lr=0.1, momentum=0.9, batch_size=32, steps=240), "accuracy", info)


# ------------------------------------------------------------------------------------------------
# regression (generated: a random teacher network)
# ------------------------------------------------------------------------------------------------
def regression_arrays(n_train: int = 4000, n_test: int = 2000, dim: int = 20,
                      teacher_width: int = 32, noise: float = 0.1, seed: int = 0):
    """``(x_train, y_train, x_test, y_test)``: standard-normal inputs, the target a fixed random
    teacher (two tanh layers, numpy seed 1234, the same for every data seed) plus Gaussian
    noise of ``noise`` times the clean target's standard deviation; ``seed`` draws the inputs
    and the noise."""
    t = np.random.default_rng(1234)
    w1 = t.standard_normal((dim, teacher_width)) / np.sqrt(dim)
    w2 = t.standard_normal((teacher_width, teacher_width)) / np.sqrt(teacher_width)
    w3 = t.standard_normal(teacher_width) / np.sqrt(teacher_width)
    g = np.random.default_rng(seed)
    x = g.standard_normal((n_train + n_test, dim))
    clean = np.tanh(np.tanh(x @ w1 * 2.0) @ w2 * 2.0) @ w3
    y = clean + noise * clean.std() * g.standard_normal(len(x))
    x, y = x.astype(np.float32), y.astype(np.float32)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def regression_mlp(dim: int = 20, width: int = 128):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(dim, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 1))


def _regression(seed: int, n_train: int = 4000, width: int = 128, **_) -> Task:
    import torch
    xtr, ytr, xte, yte = regression_arrays(n_train=n_train, seed=seed)
    deciles = np.searchsorted(np.quantile(ytr, np.linspace(0.1, 0.9, 9)), ytr)
    info = {"source": "generated: a fixed random tanh teacher network plus 10 % noise "
                      "(benchmarks.tasks.regression_arrays)", "train": len(xtr),
            "test": len(xte), "data_seed": seed, "target_var": float(yte.var()),
            "sha256": hashlib.sha256(xtr.tobytes() + ytr.tobytes()).hexdigest()}
    t = [torch.from_numpy(a) for a in (xtr, ytr, xte, yte)]
    return Task("regression", t[0], t[1], t[2], t[3], torch.from_numpy(deciles),
                lambda: regression_mlp(xtr.shape[1], width),
                Recipe(lr=1e-3, momentum=0.0, batch_size=32, steps=1000, optimizer="adam"),
                "mse", info)


def _mnist1d_long(seed: int, num_samples: int = 12000, width: int = 32, **_) -> Task:
    t = _mnist1d(seed, num_samples, width)
    return replace(t, name="mnist1d_long",
                   recipe=Recipe(lr=0.05, momentum=0.9, batch_size=32, steps=1500))


def _transformer_code(seed: int, **kw) -> Task:
    return _transformer(seed, corpus=stdlib_corpus, name="transformer_code", **kw)


_BUILDERS = {"mnist1d": _mnist1d, "mnist1d_long": _mnist1d_long, "text": _text,
             "transformer": _transformer, "transformer_code": _transformer_code,
             "digits_conv": _digits_conv, "regression": _regression}
_CACHE: Dict[tuple, Task] = {}


def make_task(name: str, seed: int = 0, **overrides) -> Task:
    """The task ``name`` (one of :data:`TASKS`) with data seed ``seed``.

    ``overrides``: data/model size knobs of the task (``num_samples``/``width`` for mnist1d,
    ``seq_len``/``hidden`` for text, ``seq_len``/``width``/``layers``/``train_windows`` for
    transformer, ``width`` for digits_conv) and :class:`Recipe` fields (``lr``, ``momentum``,
    ``batch_size``, ``steps``, ``optimizer``, ``betas``, ``weight_decay``, ``warmup``,
    ``schedule``). Results are cached per process (the data is built once)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown task {name!r}; one of {TASKS}")
    recipe_keys = {k: overrides.pop(k) for k in list(overrides) if k in Recipe.__annotations__}
    key = (name, seed, tuple(sorted(overrides.items())))
    task = _CACHE.get(key)
    if task is None:
        task = _CACHE[key] = _BUILDERS[name](seed, **overrides)
    if recipe_keys:
        task = replace(task, recipe=replace(task.recipe, **recipe_keys))
    return task
