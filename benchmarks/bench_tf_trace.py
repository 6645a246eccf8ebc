"""First-step (tracing) and steady step time of TensorFlow SBC on a many-tensor model:
``python -m benchmarks.bench_tf_trace [--layers 25] [--json FILE]``.

One process (Horovod of size 1 is enough: tracing cost does not depend on the peers), a stack of
``--layers`` 32-wide Dense layers (2 tensors each, plus the head), SGD momentum 0.9, density
0.05. For each of the stock tape (``hvd.DistributedGradientTape(..., compression=SBC())``,
where Horovod calls the compressor once per gradient) and the drop-in tape, eagerly and inside
``tf.function``: the first step (traces and first execution) and the median of the next steps.
Each configuration runs in its own subprocess, so no trace is shared between them."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_CHILD = """
import json, sys, time
import numpy as np, tensorflow as tf, keras, horovod.tensorflow as hvd
import horovod_sbc.tensorflow as hsbc
hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)
layers, api, fn, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "fn", int(sys.argv[4])
keras.utils.set_random_seed(0)
inp = keras.Input((32,))
h = inp
for _ in range(layers):
    h = keras.layers.Dense(32, activation="relu")(h)
model = keras.Model(inp, keras.layers.Dense(5)(h))
opt = keras.optimizers.SGD(0.05, momentum=0.9)
sbc = hsbc.SBC(density=0.05)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

def step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    if api == "stock":
        g = hvd.DistributedGradientTape(tape, compression=sbc).gradient(
            loss, [v.value for v in model.trainable_variables])
    else:
        g = hsbc.DistributedGradientTape(tape, compression=sbc).gradient(
            loss, model.trainable_variables)
    opt.apply_gradients(zip(g, model.trainable_variables))
    if api != "stock":
        sbc.step(model.trainable_variables)  # the drop-in: the weight update's exchange

step = tf.function(step) if fn else step
rng = np.random.default_rng(0)
times = []
for s in range(steps):
    x = tf.constant(rng.standard_normal((16, 32)).astype(np.float32))
    y = tf.constant(rng.integers(0, 5, 16))
    t0 = time.perf_counter()
    step(x, y)
    times.append(time.perf_counter() - t0)
print(json.dumps({"tensors": len(model.trainable_variables), "times": times}))
"""


def run(layers: int, api: str, how: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(layers), api, how, str(steps)],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1",
                              "TF_CPP_MIN_LOG_LEVEL": "2"})
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {"api": api, "how": how, "tensors": res["tensors"], "first_s": res["times"][0],
            "steady_ms": 1000 * statistics.median(res["times"][1:])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_tf_trace")
    ap.add_argument("--layers", type=int, default=25)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    print(f"{'api':>7} {'how':>6} {'tensors':>8} {'first step s':>13} {'steady ms':>10}")
    for api in ("stock", "dropin"):
        for how in ("eager", "fn"):
            t0 = time.perf_counter()
            r = run(args.layers, api, how, args.steps)
            r["wall_s"] = time.perf_counter() - t0
            rows.append(r)
            print(f"{api:>7} {how:>6} {r['tensors']:>8} {r['first_s']:>13.1f} "
                  f"{r['steady_ms']:>10.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
