"""The fused multi-tensor encoder (horovod_sbc/torch/backend/fused.py): the same bytes and the same
residual as the per-tensor encoder and the numpy reference, on many layouts at once."""
import contextlib
import os
import sys

import numpy as np
import pytest
import torch

from horovod_sbc import reference, kernels
from horovod_sbc.torch.backend import NonFiniteError, OpsBackend, backend_for, fused

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "golden"))
import make_golden  # noqa: E402
import json  # noqa: E402

GOLDEN = json.load(open(os.path.join(HERE, "golden", "vectors.json")))


def _tensor(rng, kind: str, n: int) -> torch.Tensor:
    if kind == "normal":
        x = rng.standard_normal(n)
    elif kind == "ties":  # few distinct values: ties at the k-th value everywhere
        x = np.round(rng.uniform(-2, 2, n))
    elif kind == "zeros":
        x = np.zeros(n)
    elif kind == "negative":  # the negative side wins
        x = -np.abs(rng.standard_normal(n)) * 3 + rng.uniform(0, 0.5, n)
    elif kind == "fewpos":  # fewer positive entries than k
        x = -np.abs(rng.standard_normal(n)) - 0.01
        x[rng.integers(0, n, min(n, 2))] = 4.0
    elif kind == "tiny":  # subnormals and exact opposites
        x = rng.choice([1e-40, -1e-40, 3e-39, -3e-39, 0.0], n)
    else:  # "heavy": a wide dynamic range
        x = rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n))
    return torch.from_numpy(x.astype(np.float32))


KINDS = ("normal", "ties", "zeros", "negative", "fewpos", "tiny", "heavy")
SIZES = (0, 1, 1, 2, 3, 7, 64, 100, 1000, 5000, 20000, 70000)


def _random_layout(rng, n_tensors: int):
    sizes = [int(rng.choice(SIZES)) for _ in range(n_tensors)]
    return [_tensor(rng, str(rng.choice(KINDS)), n) for n in sizes]


def _check_against_per_tensor(xs, density, paths=("tensor-op", "kernels"), mode="sbc"):
    """Fused encode + commit vs the per-tensor encode + commit: bytes, positions
    sent and the residual afterwards, bit for bit."""
    numels = [x.numel() for x in xs]
    flat = torch.cat(xs) if xs else torch.zeros(0)
    enc = fused.encode_fused(flat, numels, density, mode=mode)
    enc.commit()
    after = torch.split(flat, numels)
    for path in paths:
        ctx = kernels.disabled() if path == "tensor-op" else contextlib.nullcontext()
        with ctx:
            for i, x in enumerate(xs):
                ref = x.clone()
                e = backend_for("cpu").encode_tensor(ref, density, mode)
                e.commit()
                msg, pos = e.message, e.positions
                got = enc.message(i)
                assert got.numpy().tobytes() == msg.numpy().tobytes(), (path, density, i, numels[i])
                assert torch.equal(after[i].view(torch.int32), ref.view(torch.int32)), (path, i)
                assert enc.counts[i] == pos.numel()
    assert enc.body.numel() == sum(hi - lo for lo, hi in enc.bounds)


def test_many_random_layouts_match_the_per_tensor_encoder():
    rng = np.random.default_rng(1)
    for trial in range(40):
        xs = _random_layout(rng, int(rng.integers(1, 12)))
        density = float(rng.choice([1e-4, 1e-3, 1e-2, 5e-2, 0.3, 1.0]))
        _check_against_per_tensor(xs, density, ("tensor-op",) if trial % 2 else
                                  ("tensor-op", "kernels"))


def _random_trials(seed: int, mode: str, trials: int = 25):
    """``trials`` random layouts at random densities, fused against per tensor (the kernels'
    encoder too on every other trial)."""
    rng = np.random.default_rng(seed)
    for trial in range(trials):
        xs = _random_layout(rng, int(rng.integers(1, 10)))
        density = float(rng.choice([1e-3, 1e-2, 5e-2, 0.5, 1.0]))
        _check_against_per_tensor(xs, density, ("tensor-op",) if trial % 2 else
                                  ("tensor-op", "kernels"), mode=mode)


def test_values_mode_matches_the_per_tensor_encoder():
    _random_trials(4, "values")
    for xs in ([torch.zeros(0)], [torch.zeros(1), torch.zeros(5), torch.ones(3)],
               [torch.full((40,), -1.5), torch.tensor([0.0, -0.0, 2.0])]):
        for density in (0.01, 0.3, 1.0):  # zeros are kept when k exceeds the non-zeros
            _check_against_per_tensor(xs, density, mode="values")


def test_stc_mode_matches_the_per_tensor_encoder_and_its_golden_vectors():
    """STC (the built-in ternary compressor, ``fused``): the fused codec writes the bytes and
    leaves the residual of STC's own per-tensor encoder (both torch backends), zeros never
    sent, and the golden vectors in one call."""
    _random_trials(5, "stc")
    sparse = torch.zeros(300)
    sparse[[3, 17, 18, 160, 299]] = torch.tensor([0.5, -2.0, 0.25, -0.125, 1.0])
    for xs in ([torch.zeros(0)], [torch.zeros(1), torch.zeros(5), torch.ones(3)],
               [torch.full((40,), -1.5), torch.tensor([0.0, -0.0, 2.0])],
               [sparse, torch.zeros(7), sparse.flip(0)]):
        for density in (0.01, 0.1, 0.3, 1.0):  # k beyond the non-zeros: only they are sent
            _check_against_per_tensor(xs, density, mode="stc")
    import stc_golden
    for density in sorted({d for _, _, d in stc_golden.golden_cases()}):
        cases = [(n, u) for n, u, d in stc_golden.golden_cases()
                 if d == density and u.dtype == np.float32]
        if not cases:
            continue
        want = {v["name"]: v for v in json.load(open(stc_golden.GOLDEN))}
        flat = torch.cat([torch.from_numpy(u) for _, u in cases])
        enc = fused.encode_fused(flat, [u.size for _, u in cases], density, mode="stc")
        enc.commit()
        for i, ((name, u), after) in enumerate(zip(cases, torch.split(flat, [u.size for _, u
                                                                             in cases]))):
            assert enc.message(i).numpy().tobytes().hex() == want[name]["message_hex"], name
            assert after.numpy().tobytes().hex() == want[name]["residual_hex"], name


def test_edge_layouts():
    rng = np.random.default_rng(2)
    cases = [
        [torch.zeros(0)],                                   # only an empty tensor
        [torch.zeros(1), torch.zeros(0), torch.ones(1)],    # 1-element and empty
        [torch.full((50,), 2.0), torch.full((50,), -2.0)],  # all tied
        [torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0])],  # + wins ties of the means
        [_tensor(rng, "negative", 3000), _tensor(rng, "fewpos", 400)],
        [torch.zeros(100), _tensor(rng, "normal", 100)],
    ]
    for xs in cases:
        for density in (0.01, 0.1, 1.0):  # 1.0: k = numel
            _check_against_per_tensor(xs, density)


def test_means_are_the_fixed_order_tree_sums():
    # four positives whose float64 sum, divided by 4 and rounded to float32, depends on the
    # order of the additions: the pairwise tree gives 3.248233e+14, left to right 3.2482328e+14
    v = [float.fromhex(h) for h in ("0x1.d1a37p+48", "0x1.722afp-4", "0x1.f15982p-5",
                                     "0x1.6607eap+49")]
    x = torch.tensor(v, dtype=torch.float32)
    seq = 0.0
    for t in x.double().tolist():
        seq += t
    assert np.float32(reference.tree_sum_np(x.numpy()) / 4) != np.float32(seq / 4)
    enc = fused.encode_fused(x.clone(), [4], 1.0)
    assert enc.means == [float(np.float32(reference.tree_sum_np(x.numpy()) / 4))]
    _check_against_per_tensor([x, torch.randn(5)], 1.0)


def test_numpy_reference_agrees():
    rng = np.random.default_rng(3)
    xs = _random_layout(rng, 10)
    flat = torch.cat(xs)
    enc = fused.encode_fused(flat.clone(), [x.numel() for x in xs], 0.02)
    top = fused.encode_fused(flat.clone(), [x.numel() for x in xs], 0.02, mode="values")
    for i, x in enumerate(xs):
        msg, _ = reference.compress_np(x.numpy(), None, 0.02, selection="paper")
        assert enc.message(i).numpy().tobytes() == msg, i
        msg, _ = reference.compress_np(x.numpy(), None, 0.02, binarize=False)
        assert top.message(i).numpy().tobytes() == msg, i


def test_golden_vectors_in_one_fused_call():
    sbc = [c for c in GOLDEN if c["selection"] == "paper" and c["binarize"] is True
           and c["dtype"] in ("float32", "float16")]
    values = [c for c in GOLDEN if c["binarize"] is False and c["dtype"] == "float32"]
    assert len(sbc) >= 8 and len(values) >= 2
    for mode, cases in (("sbc", sbc), ("values", values)):
        _golden_in_one_call(cases, mode)


def _golden_in_one_call(cases, mode):
    for density in sorted({c["density"] for c in cases}):
        group = [c for c in cases if c["density"] == density]
        xs = []
        for c in group:
            dt = np.float16 if c["dtype"] == "float16" else np.float32
            u, r = make_golden.make_inputs(c["index"], c["numel"], dt, c["kind"])
            xs.append(torch.from_numpy(r.astype(np.float32)) + torch.from_numpy(u).float())
        flat = torch.cat(xs)
        enc = fused.encode_fused(flat, [x.numel() for x in xs], density, mode=mode)
        enc.commit()
        for i, (c, after) in enumerate(zip(group, torch.split(flat, [x.numel() for x in xs]))):
            assert enc.message(i).numpy().tobytes() == bytes.fromhex(c["message_hex"]), c["name"]
            assert make_golden.digest(after.numpy()) == c["new_residual_sha256"], c["name"]


def test_nonfinite_names_the_tensor_and_changes_nothing():
    xs = [torch.randn(100), torch.randn(50), torch.randn(30)]
    xs[1][7] = float("nan")
    flat = torch.cat(xs)
    before = flat.clone()
    try:
        fused.encode_fused(flat, [100, 50, 30], 0.1, names=["a", "b", "c"])
    except NonFiniteError as e:
        assert "'b'" in str(e) and "NaN or Inf" in str(e)
    else:
        raise AssertionError("no NonFiniteError")
    assert torch.equal(flat.view(torch.int32), before.view(torch.int32))
    xs[1][7] = float("-inf")
    try:
        fused.encode_fused(torch.cat(xs), [100, 50, 30], 0.1)
    except NonFiniteError as e:
        assert "tensor 1" in str(e)
    else:
        raise AssertionError("no NonFiniteError for -inf")


def test_rejects_what_it_cannot_encode():
    for bad, numels in ((torch.zeros(10, dtype=torch.float64), [10]), (torch.zeros(10), [9])):
        try:
            fused.encode_fused(bad, numels, 0.1)
        except ValueError as e:
            assert "encode_fused" in str(e)
        else:
            raise AssertionError("accepted")


# -- the drop-in optimizer's sync on the device path ----------------------------------------------
class _Replay:
    """A transport for one process: this rank's step message first, then this rank's earlier
    step messages standing in for the other ranks (valid, and different from each other)."""

    def __init__(self, size: int):
        self.size, self.history = size, []

    def world(self):
        return self.size, 0

    def allgather(self, step, tag):
        self.history.append(step.clone())
        others = [self.history[max(0, len(self.history) - 1 - j)] for j in range(1, self.size)]
        return torch.cat([step] + others)


def _dropin_run(shapes, density, ranks, steps, device_path: bool, local_residual=None):
    from horovod_sbc.torch import SBC, DistributedOptimizer
    g = torch.Generator().manual_seed(5)
    named = [(f"p{i}", torch.nn.Parameter(torch.randn(s, generator=g)))
             for i, s in enumerate(shapes)]
    comp = SBC(density=density, local_residual=local_residual)
    comp.transport = _Replay(ranks)
    opt = DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1),
                               named_parameters=named, compression=comp)
    trace = []
    with kernels.disabled() if device_path else contextlib.nullcontext():
        for s in range(steps):
            for _, p in named:
                p.grad = torch.randn(p.shape, generator=g) * (1 + s)
                if p.numel() > 3:
                    p.grad.view(-1)[:3] = torch.tensor([2.0, 2.0, -2.0])  # ties
            opt.step()
            trace.append([p.detach().clone() for _, p in named] +
                         [comp.manager.reference[n].clone() for n, _ in named])
    return trace, comp


def test_dropin_sync_on_the_device_path_matches_the_kernels():
    shapes = [(30, 20), (20,), (), (0,), (1,), (5, 5, 3), (4000,), (7,)]
    calls = []
    orig = OpsBackend.encode_many
    OpsBackend.encode_many = lambda *a: calls.append(1) or orig(*a)
    try:
        for density, ranks, local in ((0.05, 3, None), (0.3, 2, None), (1.0, 2, None),
                                      (0.05, 3, True), (0.3, 2, True)):
            # SGD at delay 1 keeps the residual beside the weights by default; True: in them
            dev, comp_d = _dropin_run(shapes, density, ranks, 4, True, local)
            ref, comp_r = _dropin_run(shapes, density, ranks, 4, False, local)
            steps_d = comp_d.transport.history
            assert [s.numpy().tobytes() for s in steps_d] == \
                [s.numpy().tobytes() for s in comp_r.transport.history]
            for a, b in zip(dev, ref):
                for x, y in zip(a, b):
                    assert torch.equal(x.view(torch.int32), y.view(torch.int32))
            assert comp_d.stats() == comp_r.stats()
    finally:
        OpsBackend.encode_many = orig
    assert len(calls) == 20  # every sync of the device runs took the fused path


def test_dropin_device_path_nonfinite_names_the_parameter():
    from horovod_sbc.torch import SBC, DistributedOptimizer
    named = [("a", torch.nn.Parameter(torch.randn(10))), ("b", torch.nn.Parameter(torch.randn(8)))]
    comp = SBC(density=0.1)
    comp.transport = _Replay(2)
    opt = DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1),
                               named_parameters=named, compression=comp)
    with kernels.disabled():
        for _, p in named:
            p.grad = torch.ones_like(p)
        named[1][1].grad[3] = float("inf")
        try:
            opt.step()
        except ValueError as e:
            assert "'b'" in str(e) and "NaN or Inf" in str(e), str(e)
        else:
            raise AssertionError("no error")


@pytest.mark.multirank
def test_dropin_job_with_the_kernels_off_gives_the_kernels_bytes():
    """A real 2-rank drop-in job on the device path (kernels off, as on CUDA): every rank's
    weights after every sync are those of the same job with the kernels on."""
    from harness import run_ranks
    pytest.importorskip("horovod.torch")
    args = ["train", "api=dropin", "delay=2", "steps=8", "density=0.05"]
    on, _ = run_ranks("torch_sbc.py", 2, args, timeout=180)
    off, _ = run_ranks("torch_sbc.py", 2, args, timeout=180, env={"HOROVOD_SBC_KERNELS": "0"})
    assert [r["digests"] for r in off] == [r["digests"] for r in on]
    assert [r["stats"] for r in off] == [r["stats"] for r in on]


def _exchange_run(shapes, density, ranks, steps, device_path: bool, nan_step=None):
    """``SBC.exchange`` of plain updates added to residuals (what the DDP hook hands it)."""
    import warnings
    from horovod_sbc.torch import SBC
    from horovod_sbc.torch.sync import Update
    g = torch.Generator().manual_seed(9)
    comp = SBC(density=density, nonfinite="skip")
    comp.transport = _Replay(ranks)
    trace = []
    with kernels.disabled() if device_path else contextlib.nullcontext():
        for s in range(steps):
            vals = [torch.randn(sh, generator=g) for sh in shapes]
            if s == nan_step:
                vals[-1].view(-1)[0] = float("nan")
            outs = [torch.zeros(v.numel()) for v in vals]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = comp.exchange([Update(f"t{i}", v, tuple(v.shape))
                                     for i, v in enumerate(vals)], out=outs)
            trace.append((res is None, [o.clone() for o in outs],
                          [comp.manager.residuals[f"t{i}"].clone() for i in range(len(vals))]))
    return trace, comp


def test_residual_sync_on_the_device_path_matches_the_kernels():
    shapes = [(40, 10), (0,), (), (3,), (2000,), (9, 9)]
    calls = []
    orig = OpsBackend.encode_many
    OpsBackend.encode_many = lambda *a: calls.append(1) or orig(*a)
    try:
        for density, ranks, nan_step in ((0.02, 3, None), (0.2, 2, 2), (1.0, 4, None)):
            dev, comp_d = _exchange_run(shapes, density, ranks, 4, True, nan_step)
            ref, comp_r = _exchange_run(shapes, density, ranks, 4, False, nan_step)
            assert [s.numpy().tobytes() for s in comp_d.transport.history] == \
                [s.numpy().tobytes() for s in comp_r.transport.history]
            for (skip_d, out_d, res_d), (skip_r, out_r, res_r) in zip(dev, ref):
                assert skip_d == skip_r
                for x, y in zip(out_d + res_d, out_r + res_r):
                    assert torch.equal(x.view(torch.int32), y.view(torch.int32))
            assert comp_d.stats() == comp_r.stats()
            # skipped: the NaN's sync (and later ones that replay its SKIP as another rank's)
            assert [skip for skip, _, _ in dev][:nan_step or 4] == [False] * (nan_step or 4)
            assert nan_step is None or dev[nan_step][0]
    finally:
        OpsBackend.encode_many = orig
    assert len(calls) == 12
