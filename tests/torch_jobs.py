"""The multi-rank jobs of tests/workers/torch_sbc.py that tests/test_torch.py,
tests/test_reliability.py and tests/test_server.py read: one job per world size and controller
(and one for the checkpoint loads, in fresh processes after the saves), each running every
scenario those tests need. The 3-rank jobs run with the C kernels off (``KERNELS_OFF``), so the
stock hook, the drop-in and the server topology also take the tensor-op backend that CUDA
tensors take, with every assertion of the kernel runs. A job's start-up (Horovod, torch, the ranks) costs more than most
scenarios, so each test asserts on its scenario's results instead of starting a job of its own.
"""
import tempfile

from harness import SharedJob

STEPS = 12  # training steps of the "train" scenarios of tests/test_torch.py
TRAIN = [("stock", 2, 1, "mpi"), ("stock", 3, 1, "mpi"), ("dropin", 2, 1, "mpi"),
         ("dropin", 3, 3, "mpi"), ("stock", 2, 1, "gloo"), ("dropin", 3, 3, "gloo")]
CKPT = [("sbc", 0), ("terngrad", 0), ("sbc", 1)]          # tests/test_torch.py
SERVER_CKPT = [0, 1]                                       # local_residual, tests/test_server.py
SERVER_TRAIN = [(2, "0.1", 2), (3, "0.1", 1), (3, "none", 1)]
SERVER_STEPS = 8
CKPT_DIR = {c: tempfile.mkdtemp(prefix="sbc-ckpt-") for c in
            CKPT + [("server", lr) for lr in SERVER_CKPT] + [("world",)]}


def ckpt_args(c):
    if c[0] == "server":
        return [f"ckpt={CKPT_DIR[c]}", "topology=server", f"local_residual={c[1]}"]
    return [f"ckpt={CKPT_DIR[c]}", f"method={c[0]}", f"local_residual={c[1]}"]


def _scenarios():
    w = {(2, "mpi"): {}, (3, "mpi"): {}, (2, "gloo"): {}, (3, "gloo"): {}}
    for api, np_, delay, ctl in TRAIN:
        w[(np_, ctl)][("train", api, delay)] = ["train", f"api={api}", f"delay={delay}",
                                                f"steps={STEPS}", "density=0.05"]
    two = w[(2, "mpi")]
    two.update({("dense_equiv", api): ["dense_equiv", f"api={api}"]
                for api in ("stock", "dropin")})
    two.update({("errors", lr): ["errors", f"local_residual={lr}"] for lr in (0, 1)})
    two[("baselines",)] = ["baselines"]
    two.update({("many", api): ["many", f"api={api}"] for api in ("stock", "dropin")})
    # STC (built-in, its own per-tensor encoders on the C kernels), both torch paths
    two.update({("train", api, 1, "stc"): ["train", f"api={api}", "delay=1", f"steps={STEPS}",
                                           "density=0.05", "mode=stc"]
                for api in ("stock", "dropin")})
    two.update({("save", *c): ["save", *ckpt_args(c)] for c in CKPT})
    # tests/test_reliability.py
    two.update({("odd", lr): ["odd", f"local_residual={lr}"] for lr in (0, 1)})
    two.update({("mismatch", k): ["mismatch", f"kind={k}"] for k in ("shape", "set", "order")})
    two[("save", "world")] = ["save", f"ckpt={CKPT_DIR[('world',)]}", "first=4"]
    # tests/test_server.py
    for np_, down, delay in SERVER_TRAIN:
        w[(np_, "mpi")][("server", np_, down, delay)] = [
            "train", "topology=server", f"downlink={down}", f"delay={delay}",
            f"steps={SERVER_STEPS}"]
    two.update({("save", "server", lr): ["save", *ckpt_args(("server", lr))]
                for lr in SERVER_CKPT})
    return w


#: jobs that run with the C kernels off: the tensor-op backend CUDA tensors take, end to end
KERNELS_OFF = {(3, "mpi"), (3, "gloo")}


def _jobs():
    w = _scenarios()
    jobs = {k: SharedJob("torch_sbc.py", k[0], sc, controller=k[1], timeout=1200,
                         env={"HOROVOD_SBC_KERNELS": "0"} if k in KERNELS_OFF else None)
            for k, sc in w.items()}
    world = f"ckpt={CKPT_DIR[('world',)]}"
    loads = {c: ["load", *ckpt_args(c)] for c in CKPT}
    loads.update({("server", lr): ["load", *ckpt_args(("server", lr))] for lr in SERVER_CKPT})
    loads.update({("world_size", 1): ["world_size", world, "src_rank=1"],
                  ("redensity",): ["redensity", world, "density=0.2"]})
    saved = jobs[(2, "mpi")]
    jobs["load"] = SharedJob("torch_sbc.py", 2, loads, after=[saved], timeout=600)
    jobs["load3"] = SharedJob("torch_sbc.py", 3, {("world_size", 0): [
        "world_size", world, "src_rank=0"]}, after=[saved], timeout=300)
    return jobs


JOBS = _jobs()
