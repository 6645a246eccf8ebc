"""Helpers for worker scripts: each worker gets its output directory as argv[1]."""
import hashlib
import json
import os
import sys
import time


def write_result(rank, result):
    out = sys.argv[1]
    tmp = os.path.join(out, f".rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out, f"rank{rank}.json"))


def end_job(rank, result, framework):
    """Write ``result`` once every rank of the job got here (a uint8 allgather through
    ``framework``'s Horovod, "torch" or "tensorflow", named as torch names it, so that the ranks
    of a mixed job meet in it). No rank
    leaves while another is still in the job's last collective: seen under load, the server
    topology's root stayed in its last MPI Bcast after the receivers had exited, and a node
    that finished first shut Horovod down under the other's last in-node collective."""
    if framework == "torch":
        import torch
        import horovod.torch as hvd
        hvd.allgather(torch.zeros(1, dtype=torch.uint8), name="test.end")
    else:
        import tensorflow as tf
        from horovod_sbc.tensorflow.sync.exchange import allgather
        allgather(tf.zeros([1], tf.uint8), "test.end")
    write_result(rank, result)


def catch(fn):
    """What a user sees when ``fn()`` fails (``"Type: message"``), or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - we record what users see
        return f"{type(e).__name__}: {e}"
    return None


def scenarios(argv, run):
    """The scenarios of this job: ``argv[2:]`` is one ``MODE key=value ...``, or
    ``--scenarios JSON`` with a list of them (tests/harness.py ``run_scenarios``). ``run(mode,
    kw)`` runs one; returns what the job writes: that one result, or ``{"scenarios": [...]}``."""
    if argv[2] != "--scenarios":
        return run(argv[2], dict(a.split("=", 1) for a in argv[3:]))
    out = []
    for s in json.loads(argv[3]):
        t0 = time.perf_counter()
        out.append(run(s[0], dict(a.split("=", 1) for a in s[1:])))
        print(f"[scenario] {s[0]}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return {"scenarios": out}


def tensor_digest(tensors) -> str:
    """sha256 of the bytes of ``tensors`` (torch), in order: equal digests, equal tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).numpy().tobytes())
    return h.hexdigest()


def toy_mlp(width: int):
    """The workers' small classifier (torch): 20 inputs, ``width`` hidden units, 5 classes."""
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 5))


def toy_batch(step: int, rank: int, n: int):
    """A batch of ``toy_mlp``'s task for ``rank`` at ``step`` (the label: the largest of the
    first five inputs); every rank draws its own."""
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 20, generator=g)
    return x, x[:, :5].argmax(1)
