"""TensorFlow codec speed: kernel ops, stock TF ops, the numpy reference, as multiples of ``tf.add``.

    python -m benchmarks.bench_tf_codec [--n 25000000] [--densities 1e-4,1e-3,1e-2,5e-2]
                                        [--repeats 3] [--json out.json] [--no-numpy]
                                        [--no-stock]
    python -m benchmarks.bench_tf_codec --decoders sbc,values,sign [--n 4000000] [--json ...]

Single-threaded (intra- and inter-op parallelism 1), on one fp32 tensor of ``n`` elements:

* ``add``       ``tf.add`` of two such tensors (the baseline; no ``.numpy()`` conversion);
* ``compress``  ``backend.compress(update, residual, density)`` inside a ``tf.function``: the
                residual-corrected update ``A = R + dW``, selection (paper rule), binarization,
                the Golomb-Rice message and the new residual ``A - sent`` — what one tensor costs
                in a sync (same work as the torch codec's ``compress_step`` in ``bench codec``);
* ``decode``    8 ranks' step messages (one 25M tensor each) decoded and averaged into a dense
                result inside a ``tf.function`` (``backend.decode_gathered``);
* ``native_*``  the backend the CPU gets by default: the kernel backend (SBC's C kernels as
                TensorFlow custom ops, :mod:`horovod_sbc.tensorflow.backend.native`) when they
                are available; the ``path`` field says which;
* ``stock_*``   the same two with the kernel ops disabled (``horovod_sbc.kernels.disabled()``:
                the TF-ops backend, the one GPU tensors get), unless ``--no-stock``;
* the same two for the numpy reference (:mod:`horovod_sbc.reference`) in ``tf.numpy_function``.

Times are the minimum over ``repeats`` runs after a warm-up (the shared CI machine is noisy; the
minimum is the least disturbed run); ``add`` is timed in the same process, interleaved.
Targets: native compress <= 5x add, decode <= 3x add.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Dict, Sequence

import numpy as np

TARGET_COMPRESS, TARGET_DECODE = 5.0, 3.0


def _min_time(fn: Callable[[], object], repeats: int, sync: Callable[[object], None]) -> float:
    sync(fn())  # warm-up (traces tf.functions)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def run(n: int = 25_000_000, densities: Sequence[float] = (1e-4, 1e-3, 1e-2, 5e-2),
        repeats: int = 3, n_ranks: int = 8, numpy_ref: bool = True,
        stock: bool = True) -> Dict[str, object]:
    """Measure; returns ``{"n", "add_s", "rows": [{density, native_*, numpy_*, ...}]}``."""
    import tensorflow as tf
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # already initialised by the caller: keep its setting
        pass
    from horovod_sbc import kernels, wire, reference
    from horovod_sbc.tensorflow import backend
    path = "kernel ops" if kernels.tf_ops() is not None else "stock TF ops"

    def sync(out):
        # reading one element forces completion (asynchronous kernels on a device)
        for t in tf.nest.flatten(out):
            if isinstance(t, tf.Tensor) and t.shape.num_elements():
                tf.reshape(t, [-1])[:1].numpy()

    a = tf.random.normal([n], seed=1)
    b = tf.random.normal([n], seed=2)
    add = tf.function(lambda x, y: tf.add(x, y))
    rng = np.random.default_rng(0)
    grad = tf.constant(rng.standard_normal(n, dtype=np.float32))
    resid = tf.constant((0.1 * rng.standard_normal(n)).astype(np.float32))
    layout = [("w", (n,))]
    fp = wire.layout_fingerprint(layout)
    rows = []
    add_times = []
    for d in densities:
        row: Dict[str, object] = {"density": d}
        comp = tf.function(lambda u, r, d=d: backend.compress(u, r, d))
        t_add = _min_time(lambda: add(a, b), repeats, sync)
        t_comp = _min_time(lambda: comp(grad, resid), repeats, sync)
        msgs = []
        for r in range(n_ranks):
            g = np.random.default_rng(100 + r).standard_normal(n, dtype=np.float32)
            m, _ = comp(tf.constant(g), tf.zeros([n]))
            msgs.append(wire.step_message_bytes(m.numpy().tobytes(), fp, 1))
        gathered = tf.constant(np.frombuffer(b"".join(msgs), np.uint8))
        dec = tf.function(lambda g: backend.decode_gathered(g, layout, n_ranks,
                                                            1.0 / n_ranks)[0])
        t_dec = _min_time(lambda: dec(gathered), repeats, sync)
        t_add = min(t_add, _min_time(lambda: add(a, b), repeats, sync))
        add_times.append(t_add)
        row.update(add_s=t_add, native_compress_s=t_comp, native_decode_s=t_dec,
                   native_compress_over_add=t_comp / t_add, native_decode_over_add=t_dec / t_add,
                   message_bytes=len(msgs[0]))
        if stock:
            with kernels.disabled():  # traced and run without the kernel ops
                scomp = tf.function(lambda u, r, d=d: backend.compress(u, r, d))
                sdec = tf.function(lambda g: backend.decode_gathered(g, layout, n_ranks,
                                                                     1.0 / n_ranks)[0])
                t_sc = _min_time(lambda: scomp(grad, resid), repeats, sync)
                t_sd = _min_time(lambda: sdec(gathered), repeats, sync)
                # the same bytes and the same decoded average as the default path
                same = (scomp(grad, resid)[0].numpy().tobytes()
                        == comp(grad, resid)[0].numpy().tobytes()
                        and sdec(gathered).numpy().tobytes() == dec(gathered).numpy().tobytes())
            row.update(stock_compress_s=t_sc, stock_decode_s=t_sd,
                       stock_compress_over_add=t_sc / t_add, stock_decode_over_add=t_sd / t_add,
                       stock_identical=same)
        if numpy_ref:
            def ncomp_host(u, r, d=d):
                m, res = reference.compress_np(u, r, d)
                return np.frombuffer(m, np.uint8).copy(), res.astype(np.float32)

            bcomp = tf.function(lambda u, r: tf.numpy_function(ncomp_host, [u, r],
                                                               [tf.uint8, tf.float32]))
            t_bc = _min_time(lambda: bcomp(grad, resid), max(1, repeats // 3), sync)
            host = b"".join(msgs)

            def bdec():
                out = np.zeros(n, np.float32)
                reference.accumulate_np(reference.decode_step_np(host, layout, n_ranks), [out],
                                   1.0 / n_ranks)
                return tf.constant(out)

            bdec_fn = tf.function(lambda: tf.numpy_function(bdec, [], tf.float32))
            t_bd = _min_time(bdec_fn, max(1, repeats // 3), sync)
            row.update(numpy_compress_s=t_bc, numpy_decode_s=t_bd,
                       numpy_compress_over_add=t_bc / t_add, numpy_decode_over_add=t_bd / t_add)
        rows.append(row)
    return {"n": n, "threads": 1, "add_s": min(add_times), "rows": rows, "path": path,
            "targets": {"compress_over_add": TARGET_COMPRESS, "decode_over_add": TARGET_DECODE}}


def run_decoders(n: int = 4_000_000, densities: Sequence[float] = (1e-3, 1e-2, 5e-2),
                 modes: Sequence[str] = ("sbc", "values", "sign"), repeats: int = 3,
                 n_ranks: int = 8) -> Dict[str, object]:
    """Decode time of each backend on steps of each compressor's messages (``n`` fp32 elements
    per rank, ``n_ranks`` ranks, one thread): ``{"n", "rows": [{mode, density, add_s,
    kernel_decode_over_add, ops_decode_over_add, ops_streams_over_add, identical}]}``. The
    streams are the TF-ops stream decoder alone (``backend.streams.decode``). signSGD sends every
    element whatever the density: it is measured at the first density only."""
    import tensorflow as tf
    try:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        pass
    from horovod_sbc import kernels, wire
    from horovod_sbc.tensorflow import backend
    from horovod_sbc.tensorflow.backend import host, streams

    def sync(out):
        for t in tf.nest.flatten(out):
            if isinstance(t, tf.Tensor) and t.shape.num_elements():
                tf.reshape(t, [-1])[:1].numpy()

    a, b = tf.random.normal([n], seed=1), tf.random.normal([n], seed=2)
    add = tf.function(lambda x, y: tf.add(x, y))
    layout = [("w", (n,))]
    fp = wire.layout_fingerprint(layout)
    ops, kern = backend.OpsBackend(), backend.backend_for("CPU")
    rows = []
    for mode in modes:
        for d in densities[:1] if mode == "sign" else densities:
            msgs = []
            for r in range(n_ranks):
                g = np.random.default_rng(100 + r).standard_normal(n, dtype=np.float32)
                m, _ = backend.compress(tf.constant(g), tf.zeros([n]), d, mode)
                msgs.append(wire.step_message_bytes(m.numpy().tobytes(), fp, 1))
            gathered = tf.constant(np.frombuffer(b"".join(msgs), np.uint8))
            _, table = host.parse_host(gathered.numpy(), layout, n_ranks, False, False, True)
            table = tf.constant(table)
            fns = {name: tf.function(lambda g, be=be: be.decode(g, layout, n_ranks,
                                                                  scale=1.0 / n_ranks)[1][0])
                   for name, be in (("kernel", kern), ("ops", ops))}
            t = {name: _min_time(lambda f=f: f(gathered), repeats, sync)
                 for name, f in fns.items()}
            t["streams"] = _min_time(lambda: streams.decode(gathered, table, tf.zeros(
                [1], tf.int64)), repeats, sync)
            t_add = _min_time(lambda: add(a, b), repeats, sync)
            rows.append({"mode": mode, "density": d, "add_s": t_add,
                         "kernel_backend": type(kern).__name__,
                         "kernel_decode_over_add": t["kernel"] / t_add,
                         "ops_decode_over_add": t["ops"] / t_add,
                         "ops_streams_over_add": t["streams"] / t_add,
                         "identical": fns["kernel"](gathered).numpy().tobytes()
                         == fns["ops"](gathered).numpy().tobytes()})
    return {"n": n, "n_ranks": n_ranks, "threads": 1, "rows": rows,
            "kernels": kernels.tf_ops() is not None}


def print_decoders(res: Dict[str, object]) -> None:
    print(f"TF decoders, {res['n_ranks']} ranks x {res['n']:,} fp32 elements, 1 thread; "
          "decode time / tf.add")
    print(f"{'mode':>7} {'density':>8} {'kernel backend':>15} {'TF-ops backend':>15} "
          f"{'TF-op streams':>14}")
    for r in res["rows"]:
        same = "" if r["identical"] else "  (DIFFERENT results!)"
        print(f"{r['mode']:>7} {r['density']:>8g} {r['kernel_decode_over_add']:>14.2f}x "
              f"{r['ops_decode_over_add']:>14.2f}x {r['ops_streams_over_add']:>13.2f}x{same}")


def print_table(res: Dict[str, object]) -> None:
    print(f"TensorFlow codec, {res['n']:,} fp32 elements, 1 thread; time / tf.add "
          f"(add {1000 * res['add_s']:.1f} ms); decode = 8 ranks' messages averaged; "
          f"native = {res.get('path', '?')}")
    print(f"{'density':>8} {'native comp':>12} {'native dec':>11} {'stock comp':>11} "
          f"{'stock dec':>10} {'numpy comp':>12} {'numpy dec':>11} {'msg bytes':>10}")
    for r in res["rows"]:
        def f(key):
            return f"{r[key]:.2f}x" if key in r else "-"
        same = "" if "stock_identical" not in r else \
            ("  (same bytes)" if r["stock_identical"] else "  (DIFFERENT bytes!)")
        print(f"{r['density']:>8g} {f('native_compress_over_add'):>12} "
              f"{f('native_decode_over_add'):>11} {f('stock_compress_over_add'):>11} "
              f"{f('stock_decode_over_add'):>10} {f('numpy_compress_over_add'):>12} "
              f"{f('numpy_decode_over_add'):>11} {r['message_bytes']:>10,}{same}")
    print(f"targets: native compress <= {TARGET_COMPRESS:g}x, decode <= {TARGET_DECODE:g}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=None,
                   help="elements per tensor (default 25M; 4M with --decoders)")
    p.add_argument("--densities", default=None,
                   help="comma-separated (default 1e-4,1e-3,1e-2,5e-2; 1e-3,1e-2,5e-2 with "
                        "--decoders)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--no-numpy", action="store_true", help="skip the numpy reference (slow)")
    p.add_argument("--no-stock", action="store_true",
                   help="skip the stock-TF-op path (kernel ops disabled)")
    p.add_argument("--decoders", default=None, metavar="MODES",
                   help="instead: each backend's decode of steps of these compressors' "
                        "messages (e.g. sbc,values,sign)")
    args = p.parse_args(argv)
    if args.decoders:
        dens = args.densities or "1e-3,1e-2,5e-2"
        res = run_decoders(args.n or 4_000_000, [float(x) for x in dens.split(",")],
                           args.decoders.split(","), args.repeats)
        print_decoders(res)
    else:
        dens = args.densities or "1e-4,1e-3,1e-2,5e-2"
        res = run(args.n or 25_000_000, [float(x) for x in dens.split(",")], args.repeats,
                  numpy_ref=not args.no_numpy, stock=not args.no_stock)
        print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
