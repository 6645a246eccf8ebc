"""A small character-level causal transformer trained with Horovod, dense or with SBC. The
text is CPython's own pydoc topic texts (``from pydoc_data.topics import topics``: part of
the standard library, nothing is downloaded); the last 10 % of every topic is the test set.

    horovodrun -np 2 python examples/pytorch_lm_sbc.py --compression sbc --density 0.01
    horovodrun -np 2 python examples/pytorch_lm_sbc.py --compression none

The script is a plain Horovod script (AdamW, linear warm-up + cosine, rank 0's state
broadcast); SBC is the one-line change ``compression=SBC(density)`` to stock
``hvd.DistributedOptimizer``. With AdamW the stock hook exchanges weight changes and keeps
each rank's unsent update in its weights: ``optimizer.finish()`` at the end gives every rank
the same weights. Runs on CPUs as is and on GPUs unchanged (one GPU per rank, bf16 autocast).
``--split docs`` gives each rank its own topics instead of an even share of all windows.
``--checkpoint PATH`` saves one file per rank (``PATH.rank<R>``) every ``--save-every`` steps
and resumes from them when they exist; ``--delay`` > 1 (local steps between syncs) needs SBC.
Rank 0 prints ``compression=... test_perplexity=... upstream_ratio=x... step_ms=...``.
"""
import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import horovod.torch as hvd

from horovod_sbc.torch import SBC


def load_corpus(seq_len: int, min_count: int = 20, test_frac: float = 0.1):
    """The pydoc topics as windows of ``seq_len + 1`` character ids: ``(train, topic of each
    train window, test, vocab)``. Characters seen fewer than ``min_count`` times share id 0;
    train windows come from the first 90 % of each topic, test windows from the rest."""
    from pydoc_data.topics import topics
    bodies = [topics[k] for k in sorted(topics)]
    counts = {}
    for body in bodies:
        for ch in body:
            counts[ch] = counts.get(ch, 0) + 1
    index = {c: i + 1 for i, c in enumerate(sorted(c for c, n in counts.items()
                                                     if n >= min_count))}
    win = seq_len + 1
    train, groups, test = [], [], []
    for topic, body in enumerate(bodies):
        ids = np.array([index.get(c, 0) for c in body], dtype=np.int64)
        cut = int(len(ids) * (1 - test_frac))
        for part, out in ((ids[:cut], train), (ids[cut:], test)):
            n = len(part) // win
            if n:
                out.append(part[:n * win].reshape(n, win))
                if out is train:
                    groups.append(np.full(n, topic))
    return (torch.from_numpy(np.concatenate(train)), np.concatenate(groups),
            torch.from_numpy(np.concatenate(test)), len(index) + 1)


class CharTransformer(nn.Module):
    """GPT-style: token + learned position embeddings, pre-norm blocks with a causal mask
    (GELU, 4x MLP), a final norm, the output projection tied to the token embedding."""

    def __init__(self, vocab: int, seq_len: int, width: int, layers: int, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq_len, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len),
                             persistent=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x):
        n = x.shape[1]
        h = self.blocks(self.embed(x) + self.pos[:n], mask=self.mask[:n, :n], is_causal=True)
        return self.norm(h) @ self.embed.weight.t()


def lm_loss(model, windows, device, reduction="mean"):
    x, y = windows[:, :-1].to(device), windows[:, 1:].to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                           reduction=reduction)


def batch_indices(step: int, n: int, batch_size: int, seed: int):
    """This step's window indices: a fresh permutation of this rank's ``n`` windows every
    epoch, a function of the step alone (a resumed run draws what the full run drew)."""
    per_epoch = max(1, n // batch_size)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return perm[i * batch_size:(i + 1) * batch_size]


@torch.no_grad()
def test_perplexity(model, test, device, chunk=256):
    """Perplexity over the whole test set, each rank scoring its share (every rank must hold
    the same weights)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    mine = test[hvd.rank()::hvd.size()]
    for i in range(0, len(mine), chunk):
        w = mine[i:i + chunk]
        total[0] += float(lm_loss(model, w, device, reduction="sum"))
        total[1] += w[:, 1:].numel()
    model.train()
    total = hvd.allreduce(total, op=hvd.Sum, name="test_loss")
    return math.exp(float(total[0] / total[1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compression", choices=["sbc", "none"], default="sbc")
    ap.add_argument("--density", type=float, default=0.01, help="SBC's p")
    ap.add_argument("--delay", type=int, default=1, help="SBC's communication delay n")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch-size", type=int, default=16, help="windows per rank and step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--split", choices=["iid", "docs"], default="iid",
                    help="iid: windows dealt round-robin; docs: each rank its own topics")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", help="per-rank checkpoint files PATH.rank<R>")
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args(argv)
    if args.delay > 1 and args.compression != "sbc":
        ap.error("--delay > 1 needs --compression sbc")

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if torch.cuda.is_available():
        device = torch.device("cuda", hvd.local_rank())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # one core per rank

    train, groups, test, vocab = load_corpus(args.seq_len)
    if args.split == "iid":
        mine = train[rank::size]
    else:
        mine = train[torch.from_numpy(groups % size == rank)]
    torch.manual_seed(args.seed)
    model = CharTransformer(vocab, args.seq_len, args.width, args.layers).to(device)
    if rank == 0:
        print(f"{sum(p.numel() for p in model.parameters())} parameters, vocab {vocab}, "
              f"{len(train)} train / {len(test)} test windows of {args.seq_len} + 1 characters, "
              f"{size} ranks on {device.type}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    # the one-line change: compression=SBC(...) instead of Horovod's dense allreduce
    compression = SBC(args.density, delay=args.delay) if args.compression == "sbc" \
        else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    def lr_factor(step):  # linear warm-up, then cosine to 0
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    path = f"{args.checkpoint}.rank{rank}" if args.checkpoint else None
    start = 0
    found = hvd.allgather_object(bool(path and os.path.exists(path)))
    if any(found) and not all(found):
        raise SystemExit(f"rank {rank}: checkpoint files of ranks {found} exist: all or none")
    if all(found):
        ck = torch.load(path, map_location=device, weights_only=False)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        if args.compression == "sbc":  # the residuals and shared weights, at the first step
            compression.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start = ck["step"]
        if start >= args.steps:
            if rank == 0:
                print(f"{path} is at step {start}: nothing left to train, raise --steps",
                      file=sys.stderr)
            sys.exit(2)
        if rank == 0:
            print(f"resumed from {args.checkpoint}.rank* at step {start}", flush=True)
    else:  # every rank starts from rank 0's weights and optimizer state
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    times = []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        idx = batch_indices(step, len(mine), args.batch_size, args.seed * 1000 + rank)
        optimizer.zero_grad()
        loss = lm_loss(model, mine[idx], device)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            print(f"step {step + 1}/{args.steps} loss {loss.item():.3f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
        if path and (step + 1) % args.save_every == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "step": step + 1}, path)

    if hasattr(optimizer, "finish"):  # SBC: every rank gets the same weights
        optimizer.finish()
    ppl = test_perplexity(model, test, device)
    if args.compression == "sbc":
        stats = hvd.allgather_object(compression.stats())
        ratio = sum(s["dense_bits"] for s in stats) / max(1, sum(s["upstream_bits"]
                                                                 for s in stats))
    else:
        ratio = 1.0
    step_ms = 1000 * float(np.mean(times[5:] if len(times) > 10 else times))
    if rank == 0:
        density = args.density if args.compression == "sbc" else 1
        print(f"compression={args.compression} density={density:g} delay={args.delay} "
              f"steps={args.steps} test_perplexity={ppl:.2f} upstream_ratio=x{ratio:.0f} "
              f"step_ms={step_ms:.1f}", flush=True)


if __name__ == "__main__":
    main()
