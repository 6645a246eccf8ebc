"""TensorFlow vs PyTorch drop-in on mnist1d (issue 27: "TF drop-in and Keras callback: the same
defaults, within 1 point of torch on mnist1d") and on the transformer task (issue 49: "TensorFlow
at parity": within 3 % of torch's test perplexity).

    python -m benchmarks.bench_tf_train --workers 4 --seeds 0,1,2 \\
        --json benchmarks/results/tf_vs_torch.json
    python -m benchmarks.bench_tf_train --task transformer --partition by_class --delay 1 \\
        --workers 4 --seeds 0,1,2 --json benchmarks/results/tf_vs_torch_transformer.json
    (also: python -m benchmarks.bench tf-train ...)

``--task transformer`` runs the same methods on :mod:`benchmarks.tasks`' ``transformer`` (the
causal character model ``char_transformer`` on the pydoc corpus, windows of 64) with its recipe
in both frameworks: AdamW lr 3e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, 30 linear
warm-up steps then cosine to 0 at the last step (``Recipe.lr_factor``: torch's ``LambdaLR`` in
the torch worker, a Keras ``LearningRateSchedule`` evaluated at the optimizer's step in the TF
worker, :func:`recipe_schedule`), batch 16, 600 steps unless ``--steps`` (the cosine then ends
at ``--steps`` in both). The TF model (:func:`keras_transformer_from_torch`) is a Keras 3 model
with explicit matmuls holding the torch module's weights in their torch layouts (packed q/k/v
``in_proj``, ``out_proj``, LayerNorm eps 1e-5, exact GELU, causal mask, output tied to the
token embedding, whose lookup is a one-hot matmul so that its gradient is dense on every path,
as torch's). Loss: the mean cross-entropy per character of the batch (``Task.loss``); metric:
test perplexity (exp of the mean cross-entropy per character over every test window,
``Task.evaluate``), lower is better: the TF − torch gap is relative, ``100 (TF / torch − 1)``
%, and "at parity" is ``|gap| <= 3 %``. ``--optimizer`` is AdamW there (the recipe's; the
mnist1d text below applies to mnist1d).

Up to eight methods, each a real ``mpirun -np W`` job per seed and framework, on the ``mnist1d``
task of :mod:`benchmarks.tasks` (``make_dataset``, generated locally; IID shards, or with
``--partition by_class`` each rank its own classes; the task's recipe: SGD lr 0.05 momentum 0.9,
batch 64 per rank, 500 steps unless ``--steps``):

``torch_dense``  stock ``hvd.DistributedOptimizer`` (dense allreduce of gradients);
``torch_sbc``    the torch drop-in ``horovod_sbc.torch.DistributedOptimizer(opt, named_parameters=
                 ..., compression=SBC(density, delay))``, then ``finish()``;
``tf_dense``     ``tf.GradientTape`` in a ``tf.function`` through ``hvd.DistributedGradientTape``;
``tf_tape_sbc``  the TF drop-in ``horovod_sbc.tensorflow.DistributedGradientTape(tape,
                 compression=SBC(density, delay))``, ``sbc.step(variables)`` after every optimizer
                 step, ``sbc.finish(variables)`` at the end;
``keras_sbc``    ``model.fit(..., callbacks=[SBCCallback(SBC(density, delay))])`` (the callback
                 broadcasts at the start and calls ``finish()`` at the end itself);
``torch_alone``  no communication: each rank trains on its shard alone (the floor a compressed
                 run must beat);
``torch_stock_sbc`` / ``tf_stock_sbc``  the one-line changes to stock Horovod:
                 ``hvd.DistributedOptimizer(opt, named_parameters=..., compression=SBC(density,
                 delay))`` and ``hvd.DistributedGradientTape(tape, compression=SBC(density, delay,
                 optimizer=opt), groups=1)``, the initial weights broadcast before the first step.
                 What they exchange is :func:`horovod_sbc.policy.choose`'s: SGD at delay 1 the
                 gradients (SGD's momentum folded; no ``finish()``), AdamW or any delay > 1 the
                 weight changes as the drop-ins do (Adam's second moment frozen by SBC's
                 default ``freeze_variance_after="auto"``), then ``finish()`` as the drop-in rows.
                 In the default list at ``--delay 1`` and with ``--optimizer adamw``; with SGD at
                 a delay > 1 ask for them with ``--methods``.

The torch side is :func:`benchmarks.bench_train.run_task_jobs` (the ``task-worker`` of the
``tasks`` sweep, unchanged). The TF side (:func:`tf_worker_main`) builds the *same* model: the
task's 1-D CNN is built in torch with ``torch.manual_seed(seed)`` exactly as the torch worker does,
translated layer by layer to Keras 3 (``Conv1d(padding=p)`` -> ``ZeroPadding1D(p)`` + ``Conv1D``
valid; a ``Permute`` before ``Flatten`` keeps torch's channel-major order) and its initial weights
copied; the initial logits of both are compared (``init_max_abs_diff``). Each rank trains on the
same shard with the same batch sequence as the torch worker (``task.batches`` with seed
``seed * 1000 + rank``); ``model.fit`` gets those batches in that order (``shuffle=False``).
Keras' SGD with momentum is the same update as torch's for a constant learning rate. So per seed
the two frameworks start equal and see the same data; only the framework and its SBC differ.

``--optimizer adamw`` trains every method with AdamW instead (lr ``--lr``, default 1e-3,
betas (0.9, 0.999), eps 1e-8, decoupled weight decay 0.01: torch's ``AdamW`` and Keras'
``AdamW(epsilon=1e-8)``), the stock methods included. Without ``--freeze`` every row is what a
user gets: the dense and no-communication rows plain AdamW, the SBC rows SBC's defaults, which
freeze Adam's second moment automatically (``freeze_variance_after="auto"``: after
:func:`horovod_sbc.policy.auto_freeze_step`, 100 steps at beta2 0.999 and a constant learning
rate). With AdamW the TF drop-in tape gets ``SBC(..., optimizer=opt)`` (the documented way to
freeze an optimizer whose step a ``tf.function`` traces), the Keras callback freezes the model's
optimizer itself. ``--freeze K`` instead freezes Adam's second moment after K steps in every
method of both frameworks, dense included (a different comparison from the defaults): the torch
SBC rows' ``SBC(freeze_variance_after=K)``,
``horovod_sbc.tensorflow.adam.freeze_variance_after(opt, K)`` for every TF row, and the same
frozen optimizer for the torch dense and no-communication rows.

SBC settings: density 0.01, delay 4 (``bench_train.HEADLINE`` and the ``sbc p=0.01 n=4`` row of
the mnist1d task sweep; ``--delay 1`` for the other default), every other knob at each
framework's default (both: selection "paper", ``local_residual=None``, which is the residual in
the weights at delay 4 and, for SGD at delay 1, beside the shared weights with the momentum
folded; plain outer step, ``nonfinite="raise"``, no fixed size). The TF drop-in tape passes its
optimizer to ``sbc.step``, the Keras callback passes the model's. Every SBC row's accuracy,
stock rows in weight mode included, is that of the model after ``finish()``; ``score_shared`` in
the JSON is the shared weights' before it.

Reported per method: test accuracy (fraction) of the final model (after ``finish()`` for SBC)
mean ± std over seeds (population std, as the other tables), the upstream compression ratio
``dense_bits / upstream_bits`` from ``stats()`` (the exchange only; ``finish()``'s dense
allreduce is recorded apart as ``ratio_with_finish``), whether all ranks end bit-identical
(a sha256 of the weights per rank; for SBC also of the shared reference weights), and per TF
method the gap TF − torch in accuracy points (the mean over seeds; also the per-seed paired
difference). "Within 1 point" is ``|gap| <= 1``.

Writes ``--json FILE`` (every run and the summary), ``FILE.md`` (the table) and, while running,
``FILE.partial`` (finished jobs; ``--resume`` reuses them).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import sys
import time
from typing import Dict, List, Optional, Sequence

from .bench import _write_json
from .bench_train import (ENV_NAMES, PROGRESS_TAG, RESULT_TAG, JobError, Progress, _s,
                          job_env, launcher_prefix, python_exe, run_job, run_task_jobs)

TASK = "mnist1d"
DENSITY, DELAY = 0.01, 4                 # bench_train.HEADLINE; the mnist1d sweep's p=0.01 n=4
TORCH_METHODS = ("torch_dense", "torch_alone", "torch_sbc", "torch_stock_sbc")
TF_METHODS = ("tf_dense", "tf_tape_sbc", "keras_sbc", "tf_stock_sbc")
METHODS = TORCH_METHODS + TF_METHODS
#: the one-line changes to stock Horovod (in the default list at delay 1 and with AdamW)
STOCK_METHODS = ("torch_stock_sbc", "tf_stock_sbc")
#: the torch counterpart each TF method is compared with
COUNTERPART = {"tf_dense": "torch_dense", "tf_tape_sbc": "torch_sbc", "keras_sbc": "torch_sbc",
               "tf_stock_sbc": "torch_stock_sbc"}
DESCRIPTION = {
    "torch_dense": "torch, stock hvd.DistributedOptimizer (dense allreduce)",
    "torch_alone": "torch, no communication (each rank alone)",
    "torch_sbc": "torch drop-in DistributedOptimizer + SBC",
    "torch_stock_sbc": "torch stock hvd.DistributedOptimizer(compression=SBC)",
    "tf_dense": "TF, hvd.DistributedGradientTape (dense allreduce)",
    "tf_tape_sbc": "TF drop-in DistributedGradientTape + SBC",
    "keras_sbc": "Keras model.fit + SBCCallback",
    "tf_stock_sbc": "TF stock hvd.DistributedGradientTape(compression=SBC(optimizer=opt))",
}
WITHIN_PT = 1.0
#: perplexity (lower is better): "at parity" is |TF / torch − 1| <= 3 %
WITHIN_PCT = 3.0
ADAMW_LR, ADAMW_WEIGHT_DECAY, ADAMW_EPS = 1e-3, 0.01, 1e-8
RECIPE_STEPS = 500   # benchmarks.tasks: the mnist1d recipe's steps (tests check they agree)
#: the tasks this benchmark runs (benchmarks.tasks names)
TASKS = ("mnist1d", "transformer")
#: per task: the recipe's metric, batch, steps and (transformer) its AdamW, which --optimizer
#: adamw uses there (tests check they are benchmarks.tasks')
TASK_RECIPES = {
    "mnist1d": {"metric": "accuracy", "batch_size": 64, "steps": RECIPE_STEPS},
    "transformer": {"metric": "perplexity", "batch_size": 16, "steps": 600, "lr": 3e-3,
                    "betas": (0.9, 0.95), "weight_decay": 0.1, "warmup": 30,
                    "schedule": "cosine"},
}


# ------------------------------------------------------------------------------------------------
# the TF worker (every rank)
# ------------------------------------------------------------------------------------------------
def keras_from_torch(tmodel, length: int):
    """A Keras 3 ``Sequential`` computing what the torch ``nn.Sequential`` ``tmodel`` computes
    (Unflatten, Conv1d, ReLU, Flatten, Linear), with ``tmodel``'s current weights."""
    import keras
    import torch.nn as nn
    layers, copies = [keras.Input((length,))], []
    channels_last = False
    for m in tmodel:
        if isinstance(m, nn.Unflatten):
            layers.append(keras.layers.Reshape((length, 1)))
            channels_last = True
        elif isinstance(m, nn.Conv1d):
            pad = m.padding[0]
            if pad:
                layers.append(keras.layers.ZeroPadding1D(pad))
            conv = keras.layers.Conv1D(m.out_channels, m.kernel_size[0], strides=m.stride[0],
                                       padding="valid")
            layers.append(conv)
            copies.append((conv, [m.weight.detach().numpy().transpose(2, 1, 0),
                                  m.bias.detach().numpy()]))
        elif isinstance(m, nn.ReLU):
            layers.append(keras.layers.ReLU())
        elif isinstance(m, nn.Flatten):
            if channels_last:  # torch flattens (N, C, L) channel-major
                layers.append(keras.layers.Permute((2, 1)))
            layers.append(keras.layers.Flatten())
        elif isinstance(m, nn.Linear):
            dense = keras.layers.Dense(m.out_features)
            layers.append(dense)
            copies.append((dense, [m.weight.detach().numpy().T, m.bias.detach().numpy()]))
        else:
            raise ValueError(f"no Keras translation for {type(m).__name__}")
    model = keras.Sequential(layers)
    for layer, weights in copies:
        layer.set_weights(weights)
    return model


def keras_transformer_from_torch(tmodel):
    """A Keras 3 model computing what :func:`benchmarks.tasks.char_transformer`'s torch module
    ``tmodel`` computes, with ``tmodel``'s current weights (same layouts, copied as they are).

    Token embedding + learned positions; per block (pre-norm ``nn.TransformerEncoderLayer``):
    ``h += out_proj(attention(norm1(h)))`` with the packed q/k/v ``in_proj``, 1/sqrt(head dim)
    scaling and the causal mask, then ``h += linear2(gelu(linear1(norm2(h))))`` (exact GELU);
    final LayerNorm (eps 1e-5 everywhere) and the output tied to the token embedding. The lookup
    is a one-hot matmul: the embedding's gradient is dense, as torch's (``sparse=False``), on
    every path (Horovod's tapes, SBC's, ``fit``), and the values are exact."""
    import numpy as np
    import torch.nn as nn
    vocab, width = (int(d) for d in tmodel.embed.weight.shape)
    seq_len = int(tmodel.pos.shape[0])
    blocks = list(tmodel.blocks.layers)
    heads = blocks[0].self_attn.num_heads
    for b in blocks:
        if not (b.norm_first and b.activation_relu_or_gelu == 2 and b.norm1.eps == 1e-5):
            raise ValueError("expected pre-norm GELU blocks with LayerNorm eps 1e-5")
    if tmodel.blocks.norm is not None or not isinstance(tmodel.norm, nn.LayerNorm):
        raise ValueError("expected the encoder without its own norm and a final LayerNorm")
    model = _keras_transformer_class()(vocab, seq_len, width, heads, len(blocks))
    t = {k: v.detach().numpy() for k, v in tmodel.named_parameters()}
    values = {"embed": t["embed.weight"], "pos": t["pos"],
              "norm_g": t["norm.weight"], "norm_b": t["norm.bias"]}
    for i in range(len(blocks)):
        p = f"blocks.layers.{i}."
        values.update({
            f"b{i}_norm1_g": t[p + "norm1.weight"], f"b{i}_norm1_b": t[p + "norm1.bias"],
            f"b{i}_in_proj_w": t[p + "self_attn.in_proj_weight"],
            f"b{i}_in_proj_b": t[p + "self_attn.in_proj_bias"],
            f"b{i}_out_proj_w": t[p + "self_attn.out_proj.weight"],
            f"b{i}_out_proj_b": t[p + "self_attn.out_proj.bias"],
            f"b{i}_norm2_g": t[p + "norm2.weight"], f"b{i}_norm2_b": t[p + "norm2.bias"],
            f"b{i}_lin1_w": t[p + "linear1.weight"], f"b{i}_lin1_b": t[p + "linear1.bias"],
            f"b{i}_lin2_w": t[p + "linear2.weight"], f"b{i}_lin2_b": t[p + "linear2.bias"]})
    if len(values) != len(t) or len(model.trainable_variables) != len(t):
        raise ValueError("the Keras port does not hold exactly the torch parameters")
    for name, v in model.w.items():
        v.assign(np.asarray(values[name], dtype=np.float32))
    return model


_KERAS_TRANSFORMER = None


def _keras_transformer_class():
    """The Keras 3 class of :func:`keras_transformer_from_torch` (built on first use: the
    orchestrator does not import TensorFlow)."""
    global _KERAS_TRANSFORMER
    if _KERAS_TRANSFORMER is not None:
        return _KERAS_TRANSFORMER
    import math
    import numpy as np
    import keras
    import tensorflow as tf

    def layer_norm(x, g, b):
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-5) * g + b

    def linear(x, w, b=None):  # torch's nn.Linear: x @ W.T + b over the last axis
        y = tf.tensordot(x, w, axes=[[x.shape.rank - 1], [1]])
        return y if b is None else y + b

    class KerasCharTransformer(keras.Model):
        def __init__(self, vocab, seq_len, width, heads, layers, **kw):
            super().__init__(name="char_transformer", **kw)
            self.vocab, self.seq_len, self.width = vocab, seq_len, width
            self.heads, self.n_layers = heads, layers
            shapes = {"embed": (vocab, width), "pos": (seq_len, width)}
            for i in range(layers):
                shapes.update({
                    f"b{i}_norm1_g": (width,), f"b{i}_norm1_b": (width,),
                    f"b{i}_in_proj_w": (3 * width, width), f"b{i}_in_proj_b": (3 * width,),
                    f"b{i}_out_proj_w": (width, width), f"b{i}_out_proj_b": (width,),
                    f"b{i}_norm2_g": (width,), f"b{i}_norm2_b": (width,),
                    f"b{i}_lin1_w": (4 * width, width), f"b{i}_lin1_b": (4 * width,),
                    f"b{i}_lin2_w": (width, 4 * width), f"b{i}_lin2_b": (width,)})
            shapes.update({"norm_g": (width,), "norm_b": (width,)})
            ws = {}
            for name, shape in shapes.items():
                ws[name] = self.add_weight(shape=shape, name=name, initializer="zeros")
            self._ws = ws  # keras tracks the variables through add_weight already
            # torch's generate_square_subsequent_mask: -inf above the diagonal
            self._mask = np.triu(np.full((seq_len, seq_len), -np.inf, np.float32), 1)
            self.built = True

        @property
        def w(self):
            return self._ws

        def call(self, x, training=False):
            w = self._ws
            n = x.shape[1]
            hd = self.width // self.heads
            h = tf.tensordot(tf.one_hot(tf.cast(x, tf.int32), self.vocab, dtype=tf.float32),
                             w["embed"], axes=[[2], [0]]) + w["pos"][:n]
            mask = tf.constant(self._mask[:n, :n])
            for i in range(self.n_layers):
                a = layer_norm(h, w[f"b{i}_norm1_g"], w[f"b{i}_norm1_b"])
                qkv = linear(a, w[f"b{i}_in_proj_w"], w[f"b{i}_in_proj_b"])
                qkv = tf.reshape(qkv, [-1, n, 3, self.heads, hd])
                q, k, v = (tf.transpose(qkv[:, :, j], [0, 2, 1, 3]) for j in range(3))
                s = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(hd)) + mask
                o = tf.matmul(tf.nn.softmax(s, axis=-1), v)
                o = tf.reshape(tf.transpose(o, [0, 2, 1, 3]), [-1, n, self.width])
                h = h + linear(o, w[f"b{i}_out_proj_w"], w[f"b{i}_out_proj_b"])
                m = layer_norm(h, w[f"b{i}_norm2_g"], w[f"b{i}_norm2_b"])
                m = tf.nn.gelu(linear(m, w[f"b{i}_lin1_w"], w[f"b{i}_lin1_b"]),
                               approximate=False)
                h = h + linear(m, w[f"b{i}_lin2_w"], w[f"b{i}_lin2_b"])
            return linear(layer_norm(h, w["norm_g"], w["norm_b"]), w["embed"])

    _KERAS_TRANSFORMER = KerasCharTransformer
    return KerasCharTransformer


_RECIPE_SCHEDULE = None


def recipe_schedule(lr: float, warmup: int, schedule: str, steps: int):
    """A Keras ``LearningRateSchedule`` equal to ``lr * Recipe.lr_factor(step, steps)`` at the
    optimizer's step ``step`` (0-based, as torch's ``LambdaLR`` of the torch worker): ``warmup``
    linear warm-up steps, then ``"cosine"`` to 0 at ``steps`` or ``"constant"``."""
    global _RECIPE_SCHEDULE
    if _RECIPE_SCHEDULE is None:
        import math
        import keras
        import tensorflow as tf

        class RecipeSchedule(keras.optimizers.schedules.LearningRateSchedule):
            def __init__(self, lr, warmup, schedule, steps):
                if schedule not in ("constant", "cosine"):
                    raise ValueError(f"unknown schedule {schedule!r}")
                self.lr, self.warmup, self.schedule, self.steps = (float(lr), int(warmup),
                                                                    schedule, int(steps))

            def __call__(self, step):
                s = tf.cast(step, tf.float32)
                if self.schedule == "cosine":
                    t = (s - self.warmup) / float(max(1, self.steps - self.warmup))
                    rest = 0.5 * (1.0 + tf.cos(math.pi * t))
                else:
                    rest = tf.ones_like(s)
                if self.warmup:
                    rest = tf.where(s < self.warmup, (s + 1.0) / self.warmup, rest)
                return self.lr * rest

            def get_config(self):
                return {"lr": self.lr, "warmup": self.warmup, "schedule": self.schedule,
                        "steps": self.steps}

        _RECIPE_SCHEDULE = RecipeSchedule
    return _RECIPE_SCHEDULE(lr, warmup, schedule, steps)


def weights_digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()


def _tf_evaluate(model, x, y, batch: int = 500, metric: str = "accuracy") -> float:
    """Test accuracy (fraction), or test perplexity: exp of the mean cross-entropy per
    character over every test window (as ``Task.evaluate``)."""
    import math
    import numpy as np
    import tensorflow as tf
    if metric == "perplexity":
        total, n = 0.0, 0
        for i in range(0, len(x), batch):
            logits = model(x[i:i + batch], training=False)
            ce = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tf.constant(y[i:i + batch]), logits=logits).numpy()
            total += float(ce.astype(np.float64).sum())
            n += ce.size
        return math.exp(total / n)
    correct = 0
    for i in range(0, len(x), batch):
        logits = model(x[i:i + batch], training=False).numpy()
        correct += int((logits.argmax(-1) == y[i:i + batch]).sum())
    return correct / len(x)


def _tf_train_once(method: str, task, cfg: dict, seed: int) -> dict:
    import numpy as np
    import tensorflow as tf
    import torch
    import keras
    import horovod.tensorflow as hvd
    import horovod_sbc.tensorflow as hsbc
    from horovod_sbc.tensorflow.owner import variable_name

    rank, size = hvd.rank(), hvd.size()
    recipe = task.recipe
    steps, bs = cfg["steps"], recipe.batch_size
    keras.backend.clear_session()
    torch.manual_seed(seed)                      # as benchmarks.bench_train._task_train_once
    tmodel = task.build_model()
    xte, yte = task.x_test.numpy(), task.y_test.numpy()
    metric = task.metric
    if task.name == "transformer":
        model = keras_transformer_from_torch(tmodel)
        n_cmp = 64
    else:
        model = keras_from_torch(tmodel, task.x_train.shape[1])
        n_cmp = 256
    with torch.no_grad():
        t_logits = tmodel(task.x_test[:n_cmp]).numpy()
    init_diff = float(np.abs(model(xte[:n_cmp], training=False).numpy() - t_logits).max())
    del tmodel
    variables = model.trainable_variables
    numel = int(sum(int(np.prod(v.shape)) for v in variables))
    # the torch worker's shard and batch sequence
    xs_t, ys_t = task.shard(rank, size, cfg.get("partition", "iid"))
    xs, ys = xs_t.numpy(), ys_t.numpy()
    batches = task.batches(len(xs), bs, seed * 1000 + rank)
    idx = [next(batches).numpy() for _ in range(steps)]
    opt = _keras_optimizer(cfg.get("optimizer") or {}, recipe, steps)
    sbc = None
    times: List[float] = []
    t_start = time.perf_counter()
    if method == "keras_sbc":
        sbc = hsbc.SBC(density=cfg["density"], delay=cfg["delay"])
        cb = hsbc.SBCCallback(sbc)

        class Timer(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self.t0 = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                times.append(time.perf_counter() - self.t0)

        model.compile(optimizer=opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        order = np.concatenate(idx)
        model.fit(xs[order], ys[order], batch_size=bs, epochs=1, shuffle=False, verbose=0,
                  callbacks=[cb, Timer()])      # the timer after the SBC callback: sync counted
    else:
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        adam = (cfg.get("optimizer") or {}).get("optimizer", "sgd") != "sgd"
        if method == "tf_tape_sbc":
            # with AdamW the optimizer given: SBC freezes its variance before the step is traced
            sbc = hsbc.SBC(density=cfg["density"], delay=cfg["delay"],
                           **({"optimizer": opt} if adam else {}))
        elif method == "tf_stock_sbc":
            sbc = hsbc.SBC(density=cfg["density"], delay=cfg["delay"], optimizer=opt)
            opt.build(variables)  # its momentum exists before the traced step folds it
        # before the first step: the stock tape's weight exchange checks that ranks start equal
        hsbc.broadcast_variables(model.variables, root_rank=0)

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if sbc is None:
                grads = hvd.DistributedGradientTape(tape).gradient(
                    loss, [v.value for v in variables])
            elif method == "tf_stock_sbc":  # Keras 3 variables: upstream #4290's workaround
                grads = hvd.DistributedGradientTape(tape, compression=sbc, groups=1).gradient(
                    loss, [v.value for v in variables])
            else:
                grads = hsbc.DistributedGradientTape(tape, compression=sbc).gradient(
                    loss, variables)
            opt.apply_gradients(zip(grads, variables))
            if method == "tf_tape_sbc":
                sbc.step(variables, opt)
            return loss

        for b in idx:
            t0 = time.perf_counter()
            train_step(tf.constant(xs[b]), tf.constant(ys[b]))
            times.append(time.perf_counter() - t0)
    score_shared = None
    # weight mode (the tape, the callback, and the stock tape with AdamW or at a delay > 1)
    # keeps shared reference weights and ends with finish(); results saved before the tape
    # became weight mode at delay 1 show "gradients"
    weight_mode = sbc is not None and len(sbc.reference) > 0
    if method in ("tf_tape_sbc", "tf_stock_sbc") and weight_mode:
        if int(sbc.local_steps.numpy()):      # a partial window: synchronize it (counted)
            sbc.synchronize(variables)
        own = [v.numpy() for v in variables]  # the shared weights W_ref, before finish()
        for v in variables:
            v.assign(sbc.reference[variable_name(v)].read_value())
        score_shared = _tf_evaluate(model, xte, yte, metric=metric)
        for v, a in zip(variables, own):
            v.assign(a)
        sbc.finish(variables)
    train_s = time.perf_counter() - t_start
    score = _tf_evaluate(model, xte, yte, metric=metric)
    out = {"method": method, "seed": seed, metric: score, "score_shared": score_shared,
           "digest": weights_digest([v.numpy() for v in variables]),
           "init_max_abs_diff": init_diff, "params": numel, "steps": steps,
           "step_time_s": float(np.mean(times[min(5, len(times) - 1):])), "train_s": train_s}
    if sbc is None:
        out["stats"] = {"upstream_bits": 32 * numel * steps, "downstream_bits": 32 * numel * steps,
                        "dense_bits": 32 * numel * steps, "syncs": steps, "steps": steps}
    else:
        out["stats"] = sbc.stats()
        out["sbc_mode"] = "weights" if weight_mode else "gradients"
        if weight_mode:
            out["reference_digest"] = weights_digest(  # in the weights' order: comparable
                [sbc.reference[variable_name(v)].numpy() for v in variables])
            # finish() averages the residuals (one dense allreduce) only where they live in
            # the weights
            out["stats"]["finish_bits"] = 32 * numel if sbc.local_residual else 0
    return out


def _keras_optimizer(spec: dict, recipe, steps: Optional[int] = None):
    """The Keras optimizer of :func:`optimizer_spec`'s ``spec`` (empty: the recipe's SGD).
    A recipe with a warm-up or a decay (the transformer's) gets it as a
    :func:`recipe_schedule` over ``steps``: the learning rate torch's ``LambdaLR`` gives."""
    import keras
    from horovod_sbc.tensorflow.adam import freeze_variance_after
    if spec.get("optimizer", "sgd") == "sgd":
        return keras.optimizers.SGD(recipe.lr, momentum=recipe.momentum)
    b1, b2 = recipe.betas
    lr = spec["lr"]
    if recipe.warmup or recipe.schedule != "constant":
        lr = recipe_schedule(lr, recipe.warmup, recipe.schedule, steps or recipe.steps)
    opt = keras.optimizers.AdamW(learning_rate=lr, weight_decay=spec["weight_decay"],
                                 beta_1=b1, beta_2=b2, epsilon=ADAMW_EPS)
    if spec.get("freeze_variance_after"):
        # every row's optimizer, dense ones too (SBC's knob would freeze the SBC rows only)
        freeze_variance_after(opt, spec["freeze_variance_after"])
    return opt


def tf_worker_main(argv: Sequence[str]) -> int:
    """One job: every method of ``cfg["methods"]`` for every seed of ``cfg["seeds"]``; rank 0
    prints one ``@@result`` per (method, seed) with every rank's accuracy, digests and stats."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import torch
    import horovod.tensorflow as hvd
    from .tasks import make_task

    cfg = json.loads(argv[0])
    hvd.init()
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    torch.set_num_threads(1)
    rank = hvd.rank()
    task = make_task(cfg.get("task", TASK), cfg.get("data_seed", 0), **cfg.get("task_kw", {}))
    todo = [(m, s) for s in cfg["seeds"] for m in cfg["methods"]]
    for i, (method, seed) in enumerate(todo):
        r = _tf_train_once(method, task, cfg, seed)
        everyone = hvd.allgather_object(r)
        if rank != 0:
            continue
        print(PROGRESS_TAG + json.dumps({"frac": (i + 1) / len(todo),
                                         "info": f"{method} seed {seed}"}), flush=True)
        print(RESULT_TAG + json.dumps(tf_row(everyone, task.info)), flush=True)
    return 0


def tf_row(everyone: List[dict], task_info: Optional[dict] = None) -> dict:
    """One run's row from every rank's result (rank order)."""
    r0 = everyone[0]
    n = len(everyone)
    metric = "perplexity" if "perplexity" in r0 else "accuracy"

    def mean_over(key):
        return sum(e["stats"].get(key, 0) for e in everyone) / n
    digests = [e["digest"] for e in everyone]
    row = {"method": r0["method"], "framework": "tf", "seed": r0["seed"],
           metric: r0[metric], metric + "_all_ranks": [e[metric] for e in everyone],
           "score_shared": r0.get("score_shared"),
           "upstream_bits": mean_over("upstream_bits"),
           "downstream_bits": mean_over("downstream_bits"),
           "dense_bits": mean_over("dense_bits"), "syncs": mean_over("syncs"),
           "positions_sent": mean_over("positions_sent"),
           "elements_synced": mean_over("elements_synced"),
           "finish_bits": mean_over("finish_bits"),
           "digests": digests, "ranks_identical": len(set(digests)) == 1,
           "init_max_abs_diff": max(e["init_max_abs_diff"] for e in everyone),
           "params": r0["params"], "steps": r0["steps"], "workers": n,
           "step_time_s": sum(e["step_time_s"] for e in everyone) / n,
           "train_s": max(e["train_s"] for e in everyone)}
    if "sbc_mode" in r0:
        row["sbc_mode"] = r0["sbc_mode"]
    if "reference_digest" in r0:
        refs = [e["reference_digest"] for e in everyone]
        row["reference_digests"] = refs
        row["reference_identical"] = len(set(refs)) == 1
        row["reference_equals_weights"] = refs[0] == digests[0]
    if task_info:
        row["data_sha256"] = task_info.get("sha256")
    _ratios(row)
    return row


def _ratios(row: dict) -> None:
    up = row.get("upstream_bits") or 0
    row["compression_ratio"] = row["dense_bits"] / up if up > 0 else None
    fb = row.get("finish_bits") or 0
    row["ratio_with_finish"] = row["dense_bits"] / (up + fb) if up > 0 and fb else None


def torch_rows(task_runs: List[dict]) -> List[dict]:
    """Rows (one per seed) from :func:`benchmarks.bench_train.run_task_jobs` results."""
    rows = []
    for r in task_runs:
        method = {"none": "torch_dense", "local": "torch_alone"}.get(
            r["method"], "torch_stock_sbc" if r.get("api") == "stock" else "torch_sbc")
        for i, seed in enumerate(r["seeds"]):
            row = {"method": method, "framework": "torch", "seed": seed,
                   r.get("metric", "accuracy"): r["score_seeds"][i],
                   "score_shared": (r["score_shared_seeds"][i] if "score_shared_seeds" in r
                                    else None),
                   "upstream_bits": r["upstream_bits"], "downstream_bits": r["downstream_bits"],
                   "dense_bits": r["dense_bits"], "syncs": r["syncs"],
                   "positions_sent": r.get("positions_sent"),
                   "elements_synced": r.get("elements_synced"),
                   "finish_bits": r.get("finish_bits", 0),
                   "ranks_identical": r["ranks_identical"], "params": r["params"],
                   "steps": r["steps"], "workers": r["workers"],
                   "step_time_s": r["step_time_s"], "train_s": r.get("wall_s"),
                   "data_sha256": (r.get("task_info") or {}).get("sha256"),
                   "command": r.get("command")}
            _ratios(row)
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------
# summary, gap, tables
# ------------------------------------------------------------------------------------------------
def _mean_std(xs: Sequence[float]):
    n = len(xs)
    m = sum(xs) / n
    return m, (sum((x - m) ** 2 for x in xs) / n) ** 0.5


def row_metric(rows: Sequence[dict]) -> str:
    """``"perplexity"`` (the transformer) if the rows carry it, else ``"accuracy"``."""
    return "perplexity" if any("perplexity" in r for r in rows) else "accuracy"


def summarize(rows: List[dict]) -> Dict[str, dict]:
    """Per method: the metric's (accuracy or perplexity) mean ± std over seeds (population std),
    the seeds' values, the upstream ratio (mean over seeds) and whether every run ended with
    identical ranks."""
    out: Dict[str, dict] = {}
    metric = row_metric(rows)
    for method in METHODS:
        rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["seed"])
        if not rs:
            continue
        accs = [r[metric] for r in rs]
        m, s = _mean_std(accs)
        ratios = [r["compression_ratio"] for r in rs if r.get("compression_ratio")]
        shared = [r["score_shared"] for r in rs if r.get("score_shared") is not None]
        out[method] = {
            "framework": rs[0]["framework"], "seeds": [r["seed"] for r in rs],
            "metric": metric, metric: m, metric + "_std": s, metric + "_seeds": accs,
            "compression_ratio": sum(ratios) / len(ratios) if ratios else None,
            "ranks_identical": all(r.get("ranks_identical") for r in rs),
            "step_time_s": sum(r["step_time_s"] for r in rs) / len(rs)}
        if len(shared) == len(rs):
            out[method]["score_shared"] = _mean_std(shared)[0]
        modes = {r["sbc_mode"] for r in rs if r.get("sbc_mode")}
        if modes:
            out[method]["sbc_mode"] = "/".join(sorted(modes))
        if any("reference_identical" in r for r in rs):
            out[method]["reference_identical"] = all(r.get("reference_identical") for r in rs)
    return out


def gaps(summary: Dict[str, dict], within_pt: float = WITHIN_PT,
         within_pct: float = WITHIN_PCT) -> Dict[str, dict]:
    """Per TF method: TF − torch accuracy in points (difference of the means over seeds), the
    per-seed paired differences (same seed = same initial weights and batches), and whether
    ``|gap| <= within_pt``. Perplexity (lower is better) instead: the relative gap
    ``100 (TF / torch − 1)`` in % of torch's mean, the per-seed relative differences, and
    whether ``|gap| <= within_pct``."""
    out = {}
    for tf_m, torch_m in COUNTERPART.items():
        a, b = summary.get(tf_m), summary.get(torch_m)
        if not a or not b:
            continue
        if a.get("metric") == "perplexity" or b.get("metric") == "perplexity":
            gap = 100.0 * (a["perplexity"] / b["perplexity"] - 1.0)
            by_seed = dict(zip(b["seeds"], b["perplexity_seeds"]))
            paired = [100.0 * (v / by_seed[s] - 1.0)
                      for s, v in zip(a["seeds"], a["perplexity_seeds"]) if s in by_seed]
            pm, ps = _mean_std(paired) if paired else (None, None)
            ra, rb = a.get("compression_ratio"), b.get("compression_ratio")
            out[tf_m] = {"versus": torch_m, "metric": "perplexity", "gap_pct": gap,
                         "paired_gap_pct": paired, "paired_gap_mean_pct": pm,
                         "paired_gap_std_pct": ps,
                         "within": abs(gap) <= within_pct + 1e-9, "within_pct": within_pct,
                         "ratio_tf_over_torch": ra / rb if ra and rb else None}
            continue
        gap = 100.0 * (a["accuracy"] - b["accuracy"])
        by_seed = dict(zip(b["seeds"], b["accuracy_seeds"]))
        paired = [100.0 * (acc - by_seed[s]) for s, acc in zip(a["seeds"], a["accuracy_seeds"])
                  if s in by_seed]
        pm, ps = _mean_std(paired) if paired else (None, None)
        ra, rb = a.get("compression_ratio"), b.get("compression_ratio")
        out[tf_m] = {"versus": torch_m, "gap_pt": gap, "paired_gap_pt": paired,
                     "paired_gap_mean_pt": pm, "paired_gap_std_pt": ps,
                     # accuracies are counts / test size: a gap of exactly 1 point must not
                     # fail by float rounding
                     "within": abs(gap) <= within_pt + 1e-9, "within_pt": within_pt,
                     "ratio_tf_over_torch": ra / rb if ra and rb else None}
    return out


def verdict(g: Dict[str, dict]) -> str:
    sbc = {m: v for m, v in g.items() if m != "tf_dense"}
    if not sbc:
        return "not measured"
    ok = all(v["within"] for v in sbc.values())
    if any("gap_pct" in v for v in sbc.values()):
        parts = [f"{m} {v['gap_pct']:+.2f} %" for m, v in sbc.items()]
        lim = max(v.get("within_pct", WITHIN_PCT) for v in sbc.values())
        return (("reached" if ok else "NOT reached") + ": TF − torch test perplexity at the same "
                "SBC setting, relative to torch: " + ", ".join(parts)
                + f" (within {lim:g} %: |TF / torch − 1| <= {lim:g} % required)")
    parts = [f"{m} {v['gap_pt']:+.2f} pt" for m, v in sbc.items()]
    return (("reached" if ok else "NOT reached") + ": TF − torch at the same SBC setting: "
            + ", ".join(parts) + f" (|gap| <= {WITHIN_PT:g} point required)")


def _ratio_str(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 10 else f"{v:.2f}"


def markdown_table(summary: Dict[str, dict], g: Dict[str, dict]) -> str:
    ppl = any(s.get("metric") == "perplexity" for s in summary.values())
    lines = ["| method | " + ("test perplexity" if ppl else "test accuracy")
             + " (mean ± std) | per seed | upstream ratio | "
             + ("TF / torch − 1 (%)" if ppl else "TF − torch (pt)") + " | ranks identical |",
             "|---|---:|---:|---:|---:|:---:|"]
    for method in METHODS:
        s = summary.get(method)
        if not s:
            continue
        gap = g.get(method)
        if ppl:
            acc = f"{s['perplexity']:.3f} ± {s['perplexity_std']:.3f}"
            seeds = ", ".join(f"{a:.3f}" for a in s["perplexity_seeds"])
            gap_s = "-" if gap is None else (
                f"{gap['gap_pct']:+.2f} % (vs {gap['versus']}; paired "
                f"{gap['paired_gap_mean_pct']:+.2f} ± {gap['paired_gap_std_pct']:.2f} %)")
        else:
            acc = f"{100 * s['accuracy']:.2f} ± {100 * s['accuracy_std']:.2f} %"
            seeds = ", ".join(f"{100 * a:.1f}" for a in s["accuracy_seeds"])
            gap_s = "-" if gap is None else (
                f"{gap['gap_pt']:+.2f} (vs {gap['versus']}; paired "
                f"{gap['paired_gap_mean_pt']:+.2f} ± {gap['paired_gap_std_pt']:.2f})")
        same = "yes" if s["ranks_identical"] else "no"
        desc = DESCRIPTION[method] + (" (gradient mode)" if s.get("sbc_mode") == "gradients"
                                      else "")
        lines.append(f"| {method}: {desc} | {acc} | {seeds} | "
                     f"{_ratio_str(s['compression_ratio'])} | {gap_s} | {same} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# orchestration
# ------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_tf_train",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=TASKS, default=TASK,
                    help="mnist1d (default; the recipe's SGD unless --optimizer adamw) or "
                    "transformer (its recipe: AdamW lr 3e-3, betas (0.9, 0.95), weight decay "
                    "0.1, 30 warm-up steps then cosine, batch 16, 600 steps; test perplexity)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",") if x != ""],
                    default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default: the task "
                                              "recipe's: mnist1d 500, transformer 600)")
    ap.add_argument("--density", type=float, default=DENSITY)
    ap.add_argument("--delay", type=int, default=DELAY)
    ap.add_argument("--partition", choices=("iid", "by_class"), default="iid",
                    help="the shards: IID (default) or label-skewed, each rank its own classes")
    ap.add_argument("--methods", type=lambda v: [m for m in v.split(",") if m],
                    help="comma-separated subset of " + ",".join(METHODS) + " (default: all; "
                    "the stock ones at --delay 1 or with --optimizer adamw)")
    ap.add_argument("--optimizer", choices=("sgd", "adamw"),
                    help="sgd: the recipe's SGD momentum (mnist1d's default); adamw: AdamW in "
                    "every method, the stock ones included (SBC rows: SBC's defaults, Adam's "
                    "variance frozen automatically; dense rows: plain AdamW); the transformer's "
                    "recipe is AdamW (its default, and the only choice there)")
    ap.add_argument("--lr", type=float, help=f"AdamW's learning rate (default: mnist1d "
                    f"{ADAMW_LR}, transformer its recipe's 3e-3)")
    ap.add_argument("--freeze", type=int, help="AdamW only: freeze Adam's second moment after "
                                               "this many steps in every method, dense included "
                                               "(default: SBC's automatic freeze in the SBC rows "
                                               "only)")
    ap.add_argument("--json", help="write the results here (and FILE.md, FILE.partial)")
    ap.add_argument("--resume", action="store_true", help="reuse the jobs saved in JSON.partial")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per job")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.optimizer is None:
        args.optimizer = "adamw" if args.task == "transformer" else "sgd"
    if args.task == "transformer" and args.optimizer != "adamw":
        ap.error("the transformer's recipe is AdamW: --optimizer adamw")
    if args.optimizer == "sgd" and (args.lr is not None or args.freeze is not None):
        ap.error("--lr and --freeze go with --optimizer adamw (SGD keeps the recipe's)")
    if args.freeze is not None and args.freeze < 1:
        ap.error("--freeze needs a number of steps >= 1")
    stock_default = args.delay == 1 or args.optimizer != "sgd"
    if args.methods is None:
        args.methods = [m for m in METHODS if stock_default or m not in STOCK_METHODS]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        ap.error(f"unknown method(s) {','.join(bad)}; choose from {','.join(METHODS)}")
    if not args.seeds:
        ap.error("--seeds needs at least one seed")
    if args.workers < 1 or args.delay < 1 or not 0 < args.density <= 1:
        ap.error("--workers and --delay must be >= 1, --density in (0, 1]")
    return args


def _task(args) -> str:
    return getattr(args, "task", None) or TASK


def _steps(args) -> int:
    return args.steps or TASK_RECIPES[_task(args)]["steps"]


def optimizer_spec(args) -> dict:
    """The optimizer keys every method's spec gets (``benchmarks.bench_train`` spec keys; the
    TF worker reads the same): empty for the recipe's SGD. AdamW on mnist1d: lr 1e-3, weight
    decay 0.01; on the transformer its recipe's lr 3e-3 and weight decay 0.1 (betas and the
    warm-up + cosine schedule come from the recipe in both workers)."""
    if args.optimizer == "sgd":
        return {}
    r = TASK_RECIPES[_task(args)]
    spec = {"optimizer": "adamw",
            "lr": r.get("lr", ADAMW_LR) if args.lr is None else args.lr,
            "weight_decay": r.get("weight_decay", ADAMW_WEIGHT_DECAY)}
    if args.freeze:
        spec["freeze_variance_after"] = args.freeze
    return spec


def jobs(args) -> List[dict]:
    """One job per (framework, seed): ``{"framework", "seed", "methods", "key"}``."""
    steps, extra = _steps(args), optimizer_spec(args)
    out = []
    for seed in args.seeds:
        for fw, ms in (("torch", TORCH_METHODS), ("tf", TF_METHODS)):
            mine = [m for m in ms if m in args.methods]
            if mine:
                key = json.dumps(([_task(args)] if _task(args) != TASK else [])
                                 + [fw, seed, mine, steps, args.density, args.delay, args.workers]
                                 + ([args.partition] if args.partition != "iid" else [])
                                 + ([extra] if extra else []))
                out.append({"framework": fw, "seed": seed, "methods": mine, "key": key})
    return out


def torch_specs(methods: Sequence[str], args) -> List[dict]:
    """The ``benchmarks.bench_train`` spec of each torch method."""
    steps, extra = _steps(args), optimizer_spec(args)
    return [dict({"torch_dense": _s("none", steps=steps), "torch_alone": _s("local", steps=steps),
                  "torch_stock_sbc": _s("sbc", args.density, args.delay, api="stock",
                                        steps=steps)}.get(
                      m, _s("sbc", args.density, args.delay, steps=steps)), **extra)
            for m in methods]


def run_job_rows(job: dict, args, prog: Progress) -> List[dict]:
    steps = _steps(args)
    if job["framework"] == "torch":
        specs = torch_specs(job["methods"], args)
        res = run_task_jobs(_task(args), [{"workers": args.workers, "partition": args.partition,
                                    "seeds": [job["seed"]], "runs": specs}], [job["seed"]],
                            timeout=args.timeout, progress=False)
        if res["skipped"]:
            raise JobError(res["skipped"][0]["reason"])
        return torch_rows(res["runs"])
    cfg = {"task": _task(args), "seeds": [job["seed"]], "methods": job["methods"],
           "steps": steps,
           "density": args.density, "delay": args.delay, "data_seed": 0,
           "partition": args.partition, "optimizer": optimizer_spec(args)}
    cmd = launcher_prefix(args.workers, "mpirun", ENV_NAMES) + [
        python_exe(), "-m", "benchmarks.bench_tf_train", "tf-worker", json.dumps(cfg)]
    rows = run_job(cmd, job_env(), args.timeout, prog.update)
    for r in rows:
        r["command"] = shlex.join(cmd[:-1]) + " CONFIG_JSON"
    return rows


def report(rows: List[dict], args, wall_s: float, command: str) -> dict:
    summ = summarize(rows)
    g = gaps(summ)
    tf_rows = [r for r in rows if r["framework"] == "tf"]
    task = _task(args)
    rec = TASK_RECIPES[task]
    opt = optimizer_spec(args) or {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
    if task == "transformer":
        opt = dict(opt, betas=list(rec["betas"]), epsilon=ADAMW_EPS,
                   schedule=f"{rec['warmup']} linear warm-up steps, then {rec['schedule']} to 0 "
                            "at the last step (Recipe.lr_factor; torch LambdaLR, Keras "
                            "LearningRateSchedule)")
    ppl = rec["metric"] == "perplexity"
    return {
        "command": command, "machine": {"python": platform.python_version(),
                                        "cores": os.cpu_count()},
        "config": {"task": task, "metric": rec["metric"], "partition": args.partition,
                   "workers": args.workers,
                   "seeds": args.seeds, "steps": _steps(args), "density": args.density,
                   "delay": args.delay, "batch_size": rec["batch_size"],
                   "optimizer": opt,
                   "sbc_other_knobs": "each framework's defaults (selection 'paper', "
                                      "local_residual=None, plain outer step)",
                   **({"adam_variance_freeze": (
                       f"after {args.freeze} steps in every row, dense included" if args.freeze
                       else "SBC rows: SBC's default freeze_variance_after='auto'; dense and "
                            "no-communication rows: plain AdamW")}
                      if args.optimizer != "sgd" else {})},
        "rows": rows, "summary": summ, "gaps": g, "verdict": verdict(g),
        "tf_ranks_identical": all(r.get("ranks_identical") for r in tf_rows) if tf_rows
        else None,
        "tf_reference_identical": all(r.get("reference_identical", True) for r in tf_rows)
        if tf_rows else None,
        "init_max_abs_diff": max((r["init_max_abs_diff"] for r in tf_rows), default=None),
        "same_data": len({r.get("data_sha256") for r in rows}) == 1,
        "wall_s": wall_s,
        "notes": ([
            "perplexity: exp of the mean cross-entropy per character over every test window "
            "(Task.evaluate), of rank 0's final model (after finish() for SBC; all ranks are "
            "checked to hold identical weights; torch_alone: the mean over ranks), mean ± "
            "population std over seeds",
            "upstream ratio: dense_bits / upstream_bits of stats(), the exchange only; "
            "finish()'s one dense allreduce is in ratio_with_finish",
            "TF / torch − 1: the TF mean perplexity relative to torch's, in %; 'paired': the "
            "mean ± std of the per-seed relative differences (same seed: same initial weights, "
            f"shards and batches); within {WITHIN_PCT:g} % is |TF / torch − 1| <= {WITHIN_PCT:g} %",
            "TF model: the torch char_transformer ported to a Keras 3 model (explicit matmuls, "
            "the same weight layouts) with the torch initial weights copied "
            "(init_max_abs_diff: the largest difference of the initial logits)"] if ppl else [
            "accuracy: test accuracy of rank 0's final model (after finish() for SBC; all "
            "ranks are checked to hold identical weights), mean ± population std over seeds",
            "upstream ratio: dense_bits / upstream_bits of stats(), the exchange only; "
            "finish()'s one dense allreduce is in ratio_with_finish",
            "TF − torch: difference of the means over seeds; 'paired': the mean ± std of the "
            "per-seed differences (same seed: same initial weights, shards and batches)",
            "TF model: the torch CNN translated to Keras with the torch initial weights copied "
            "(init_max_abs_diff: the largest difference of the initial logits)"])}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = "python -m benchmarks.bench_tf_train " + " ".join(argv)
    partial = args.json + ".partial" if args.json else None
    done: Dict[str, List[dict]] = {}
    if partial and args.resume and os.path.exists(partial):
        with open(partial) as f:
            done = json.load(f)
    todo = jobs(args)
    prog = Progress(len(todo), f"TF vs torch on {_task(args)}, {args.workers} workers, seeds "
                               f"{args.seeds}", not args.no_progress)
    t0 = time.perf_counter()
    rows: List[dict] = []
    failed = []
    for job in todo:
        if job["key"] in done:
            rows += done[job["key"]]
            continue
        prog.start(f"{job['framework']} seed {job['seed']}")
        try:
            out = run_job_rows(job, args, prog)
        except JobError as e:
            prog.end("FAILED")
            failed.append({"job": job["key"], "reason": str(e)[-3000:]})
            print(str(e)[-3000:], file=sys.stderr)
            continue
        rows += out
        done[job["key"]] = out
        if partial:
            _write_json(partial, done)
        prog.end(", ".join(f"{r['method']} ppl {r['perplexity']:.3f}" if "perplexity" in r
                           else f"{r['method']} {100 * r['accuracy']:.1f}%" for r in out))
    res = report(rows, args, time.perf_counter() - t0, command)
    res["failed"] = failed
    table = markdown_table(res["summary"], res["gaps"])
    print("\n" + table + "\n\n" + res["verdict"])
    print(f"TF ranks identical: {res['tf_ranks_identical']}, TF shared weights identical: "
          f"{res['tf_reference_identical']}, init max |logit diff| {res['init_max_abs_diff']}")
    if args.json:
        _write_json(args.json, res)
        md = os.path.splitext(args.json)[0] + ".md"
        with open(md, "w") as f:
            f.write(f"<!-- generated by: {command} -->\n\n{table}\n\n{res['verdict']}\n")
        print(f"wrote {md}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "tf-worker":
        sys.exit(tf_worker_main(sys.argv[2:]))
    sys.exit(main())
