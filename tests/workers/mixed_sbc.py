"""A mixed job under one horovodrun: even ranks run TensorFlow, odd ranks PyTorch, and they sync
through the same SBC step messages. argv: OUT [key=value ...]; writes OUT/rank<R>.json.
With topology=reduce_scatter or server (and downlink_density=) the job runs the phase
"shared" alone instead.

Phases (every rank the same layout: tensors named "a" (300,) and "b" (10, 5)):
  good   3 syncs of deterministic per-rank updates: each rank records the sha256 of its averaged
         result per sync (TF and torch must decode to the same bits);
  nan    rank 1 (torch) has a NaN: every rank must raise, naming rank 1 and the tensor;
  skip   the same with nonfinite="skip": every rank skips (TF: code SKIP_*, torch: None).
  shared through SBC(topology=...): every rank keeps shared weights (TF: weight mode,
         sbc.synchronize; torch: SBC.exchange into the reference weights), adds its update to
         them and syncs, 3 times, recording the shared weights' sha256; then rank 1 (torch)
         has a NaN and every rank must raise naming it.
"""
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_result  # noqa: E402

import numpy as np  # noqa: E402

OUT = sys.argv[1]
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
FRAMEWORK = "tf" if RANK % 2 == 0 else "torch"
NAMES, SHAPES = ["a", "b"], [(300,), (10, 5)]
DENSITY = 0.05
KW = dict(a.split("=", 1) for a in sys.argv[2:])
TAG = "sbc_sync"  # TF's weight mode syncs under this tag; torch is given the same
TOPOLOGY = {k: (float(v) if k == "downlink_density" else v) for k, v in KW.items()
            if k in ("topology", "downlink_density")}


def update(rank, sync, nan=False):
    rng = np.random.default_rng(100 * sync + rank)
    ups = [rng.standard_normal(int(np.prod(s))).astype(np.float32).reshape(s) for s in SHAPES]
    if nan:
        ups[1][2, 3] = np.nan
    return ups


def sha(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.float32).tobytes())
    return h.hexdigest()


def run_tf():
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from horovod_sbc.tensorflow.backend import backend_for
    from horovod_sbc.tensorflow.sync import exchange
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    res = [tf.zeros(s) for s in SHAPES]
    out = {"framework": "tf", "digests": []}

    def sync(s, nan=False, skip=False):
        nonlocal res
        code, results, new_res, _ = exchange.exchange(
            backend_for("CPU"), NAMES, SHAPES, [tf.constant(u) for u in update(rank, s, nan)],
            res, density=DENSITY, mode="sbc", skip=skip, rank=rank, size=size, scale=1.0 / size,
            tag="sbc_mixed")
        if int(code) == exchange.COMMIT:
            res = new_res
        return int(code), [r.numpy() for r in results]

    for s in range(3):
        code, results = sync(s)
        out["digests"].append(sha(results))
    try:
        sync(3, nan=(rank == 1))
        out["nan"] = None
    except ValueError as e:
        out["nan"] = str(e)
    code, _ = sync(4, nan=(rank == 1), skip=True)
    out["skip"] = code != exchange.COMMIT
    return rank, out


def run_torch():
    import torch
    import horovod.torch as hvd
    import horovod_sbc.torch as sbc
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    out = {"framework": "torch", "digests": []}
    comps = {False: sbc.SBC(density=DENSITY), True: sbc.SBC(density=DENSITY, nonfinite="skip")}

    def sync(s, nan=False, skip=False):
        items = [(n, torch.from_numpy(u.reshape(-1).copy()), tuple(sh))
                 for n, u, sh in zip(NAMES, update(rank, s, nan), SHAPES)]
        got = comps[skip].exchange(items, tag="sbc_mixed")
        return None if got is None else [t.numpy() for t in got]

    for s in range(3):
        out["digests"].append(sha(sync(s)))
    try:
        sync(3, nan=(rank == 1))
        out["nan"] = None
    except ValueError as e:
        out["nan"] = str(e)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["skip"] = sync(4, nan=(rank == 1), skip=True) is None
    return rank, out


def shared_tf():
    import tensorflow as tf
    import horovod.tensorflow as hvd
    import horovod_sbc.tensorflow as hsbc
    hvd.init()
    rank = hvd.rank()
    ws = [tf.Variable(tf.zeros(s), name=n) for n, s in zip(NAMES, SHAPES)]
    sbc = hsbc.SBC(density=DENSITY, local_residual=False, **TOPOLOGY)
    sbc.build(ws)
    out = {"framework": "tf", "digests": []}
    for s in range(4):
        for w, u in zip(ws, update(rank, s, nan=s == 3 and rank == 1)):
            w.assign_add(u)
        try:
            sbc.synchronize(ws)
        except ValueError as e:
            out["nan"] = str(e)
            break
        out["digests"].append(sha([w.numpy() for w in ws]))
    out["downlink"] = sorted(sbc.server_residuals.keys())
    return rank, out


def shared_torch():
    import torch
    import horovod.torch as hvd
    import horovod_sbc.torch as sbc
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    refs = [torch.zeros(s) for s in SHAPES]
    comp = sbc.SBC(density=DENSITY, **TOPOLOGY)
    out = {"framework": "torch", "digests": []}
    for s in range(4):
        ups = update(rank, s, nan=s == 3 and rank == 1)
        items = [(n, r + torch.from_numpy(u), tuple(sh), r)
                 for n, r, u, sh in zip(NAMES, refs, ups, SHAPES)]
        try:
            comp.exchange(items, out=[r.view(-1) for r in refs], tag=TAG)
        except ValueError as e:
            out["nan"] = str(e)
            break
        out["digests"].append(sha([r.numpy() for r in refs]))
    out["downlink"] = sorted(comp.manager.server_residuals.keys())
    return rank, out


if __name__ == "__main__":
    if "topology" in KW:
        rank, result = shared_tf() if FRAMEWORK == "tf" else shared_torch()
    else:
        rank, result = run_tf() if FRAMEWORK == "tf" else run_torch()
    write_result(rank, result)
