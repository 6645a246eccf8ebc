"""Synthetic ImageNet-shaped training throughput, dense or with SBC, in the spirit of Horovod's
``examples/pytorch/pytorch_synthetic_benchmark.py``: img/sec per rank and in total.

    horovodrun -np 2 python examples/pytorch_synthetic_benchmark.py --compression sbc --density 0.01
    horovodrun -np 2 python examples/pytorch_synthetic_benchmark.py --compression sbc --delay 4
    horovodrun -np 2 python examples/pytorch_synthetic_benchmark.py --model small --image-size 32

``--compression none|fp16``: stock ``hvd.DistributedOptimizer`` (fp16: ``hvd.Compression.fp16``);
``sbc`` at ``--delay 1``: the one-line change, ``hvd.DistributedOptimizer(...,
compression=horovod_sbc.torch.SBC(density))``; ``sbc`` at ``--delay`` > 1: the drop-in
``horovod_sbc.torch.DistributedOptimizer(..., compression=SBC(density, delay=n))``.
``--model``: torchvision's ``resnet50`` (the default when torchvision imports) or any of its
model names, or ``small`` (a small conv net; the default without torchvision).

Without Horovod (a GPU machine with only torch) it runs one process: ``none``/``fp16`` train
locally, ``sbc`` runs the drop-in (any delay) over a loopback exchange of ``--loopback-ranks``
copies of this rank's message, so the encode and the decode of that many messages are timed.
"""
import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F

try:
    import horovod.torch as hvd
except ImportError:  # one process, see the module docstring
    hvd = None

import horovod_sbc.torch as sbc


class SmallNet(torch.nn.Module):
    """Three conv layers and a linear classifier (ImageNet-shaped input of any size)."""

    def __init__(self, num_classes: int = 1000, width: int = 32):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 3, stride=2, padding=1), torch.nn.BatchNorm2d(width),
            torch.nn.ReLU(inplace=True),
            torch.nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            torch.nn.BatchNorm2d(2 * width), torch.nn.ReLU(inplace=True),
            torch.nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1),
            torch.nn.BatchNorm2d(4 * width), torch.nn.ReLU(inplace=True),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.fc = torch.nn.Linear(4 * width, num_classes)

    def forward(self, x):
        return self.fc(self.features(x))


class Loopback:
    """SBC's transport without Horovod: this process is rank 0 of ``size``, every rank's step
    message a copy of its own."""

    def __init__(self, size: int):
        self.size = size

    def world(self):
        return self.size, 0

    def allgather(self, step, tag):
        return step.repeat(self.size)


def make_model(name: str, num_classes: int) -> torch.nn.Module:
    if name == "small":
        return SmallNet(num_classes)
    try:
        from torchvision import models
    except ImportError:
        raise SystemExit(f"--model {name} needs torchvision; use --model small") from None
    return getattr(models, name)(num_classes=num_classes)


def default_model() -> str:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return "small"
    return "resnet50"


def make_optimizer(args, model, base):
    """The optimizer of ``--compression`` (see the module docstring), and SBC's compressor
    (None for none/fp16)."""
    named = list(model.named_parameters())
    if hvd is None:
        if args.compression != "sbc":
            return base, None
        comp = sbc.SBC(density=args.density, delay=args.delay)
        comp.transport = Loopback(args.loopback_ranks)
        return sbc.DistributedOptimizer(base, named, compression=comp), comp
    if args.compression == "sbc" and args.delay > 1:
        comp = sbc.SBC(density=args.density, delay=args.delay)
        opt = sbc.DistributedOptimizer(base, named, compression=comp)
        sbc.broadcast_state(model, opt, root_rank=0)
        return opt, comp
    comp = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}.get(
        args.compression) or sbc.SBC(density=args.density)
    opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=comp)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return opt, comp if args.compression == "sbc" else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="torchvision model name or 'small' (default: resnet50 if torchvision "
                         "imports, else small)")
    ap.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--compression", choices=["none", "fp16", "sbc"], default="none")
    ap.add_argument("--density", type=float, default=0.01, help="SBC's p")
    ap.add_argument("--delay", type=int, default=1, help="SBC's communication delay n")
    ap.add_argument("--num-warmup-batches", type=int, default=10)
    ap.add_argument("--num-batches-per-iter", type=int, default=10)
    ap.add_argument("--num-iters", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--no-cuda", action="store_true", help="train on the CPU")
    ap.add_argument("--amp", action="store_true", help="bfloat16 autocast (CUDA)")
    ap.add_argument("--loopback-ranks", type=int, default=8,
                    help="without Horovod: the ranks SBC's loopback exchange pretends")
    args = ap.parse_args(argv)
    args.model = args.model or default_model()
    if args.delay > 1 and args.compression != "sbc":
        ap.error("--delay > 1 needs --compression sbc")
    cuda = not args.no_cuda and torch.cuda.is_available()
    rank, size = 0, 1
    if hvd is not None:
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    if cuda:
        torch.cuda.set_device(hvd.local_rank() if hvd is not None else 0)
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_num_threads(1)
    device = torch.device("cuda" if cuda else "cpu")

    def log(s):
        if rank == 0:
            print(s, flush=True)

    torch.manual_seed(0)
    model = make_model(args.model, args.num_classes).to(device)
    base = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
    opt, comp = make_optimizer(args, model, base)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)
    amp = args.amp and cuda

    def benchmark_step():
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(data), target)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    dev = "GPU" if cuda else "CPU"
    how = {"none": "dense allreduce", "fp16": "fp16 allreduce"}.get(args.compression) or (
        f"SBC p={args.density:g} delay={args.delay} "
        f"({'stock hook' if hvd is not None and args.delay == 1 else 'drop-in'})")
    log(f"Model: {args.model}, batch size {args.batch_size}, image {args.image_size}px, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, {how}")
    log(f"Number of {dev}s: {size}" + ("" if hvd is not None else
                                       f" (no Horovod: one process; SBC's exchange over a "
                                       f"loopback of {args.loopback_ranks} ranks)"))
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{i}: {img_sec:.1f} img/sec per {dev}")
        img_secs.append(img_sec)
    mean, conf = float(np.mean(img_secs)), float(1.96 * np.std(img_secs))
    log(f"Img/sec per {dev}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} {dev}(s): {size * mean:.1f} +-{size * conf:.1f}")
    if args.compression == "sbc" and rank == 0:
        st = (opt if hasattr(opt, "finish") else comp).stats()
        if st.get("upstream_bits"):
            log(f"SBC upstream compression ratio: "
                f"{st['dense_bits'] / max(1, st['upstream_bits']):.0f}x")
    return img_secs


if __name__ == "__main__":
    main()
