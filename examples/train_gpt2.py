"""Train a small GPT-2 with HybridAdam: the repository's main job.

The data is this repository's own text (every .md and .py file, as bytes), so
the run needs no download. The model is transformers' GPT2LMHeadModel: on
a CUDA machine of GPT-2 small's shape (12 layers, 768 wide, byte vocabulary)
in bf16 autocast with the parameters on the GPU; on a CPU-only machine a
narrower GPT-2 (6 layers, 384 wide) with the CPU kernel. Either way HybridAdam steps each parameter on the kernel of
its device.

    python examples/train_gpt2.py                 # the full run
    python examples/train_gpt2.py --smoke         # a few steps of a tiny model (CI)
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

import torch
from _gpt2 import gpt2, next_token_loss
from tqdm import tqdm

from zerostack.fused_adam import HybridAdam, backend_info

ROOT = Path(__file__).resolve().parent.parent


def load_corpus() -> torch.Tensor:
    files = sorted(p for ext in ("*.md", "*.py") for p in ROOT.rglob(ext) if ".nox" not in p.parts)
    data = b"\n".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(corpus: torch.Tensor, batch: int, seq: int, seed: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, corpus.numel() - seq - 1, (batch,), generator=gen)
        window = torch.stack([corpus[s : s + seq + 1] for s in starts.tolist()])
        yield window[:, :-1].to(device), window[:, 1:].to(device)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model trains (default auto: CUDA when present)",
    )
    parser.add_argument("--steps", type=int, default=None, help="default: 300 on CUDA, 200 on CPU")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per step (default: 32 on CUDA, 8 on CPU)",
    )
    parser.add_argument(
        "--seq-len", type=int, default=256, help="bytes per sequence (default %(default)s)"
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=6e-4,
        help="peak learning rate, cosine schedule (default %(default)s)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps (CI)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        print("train_gpt2: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda" if use_cuda else "cpu")
    if args.smoke:
        shape = dict(layers=2, dim=64, heads=4)
        steps, batch, seq = args.steps or 30, args.batch_size or 8, 64
    elif use_cuda:
        shape = dict(layers=12, dim=768, heads=12)  # GPT-2 small's shape
        steps, batch, seq = args.steps or 300, args.batch_size or 32, args.seq_len
    else:
        shape = dict(layers=6, dim=384, heads=6)
        steps, batch, seq = args.steps or 200, args.batch_size or 8, args.seq_len

    torch.manual_seed(0)
    model = gpt2(**shape, seq_len=seq, vocab=256).to(device)  # one token per byte
    opt = HybridAdam(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)),
    )
    corpus = load_corpus()
    print(
        f"model: GPT-2, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params "
        f"({shape['layers']} layers, dim {shape['dim']}) "
        f"on {device}; corpus {corpus.numel() / 1e6:.2f}M bytes; batch {batch} x {seq}; "
        f"optimizer HybridAdam {backend_info()}"
    )

    data = batches(corpus, batch, seq, seed=1, device=device)
    losses = []
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="train", unit="step", disable=None)
    for step in bar:
        x, y = next(data)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_cuda):
            loss = next_token_loss(model(input_ids=x).logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        tokens_per_s = (step + 1) * batch * seq / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_s:,.0f}")
    elapsed = time.perf_counter() - start

    k = max(1, min(5, steps // 2))
    head, tail = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(
        f"done: {steps} steps in {elapsed:.1f}s ({steps * batch * seq / elapsed:,.0f} tokens/s); "
        f"loss {head:.3f} (first {k} steps) -> {tail:.3f} (last {k})"
    )
    if steps >= 4 and not tail < head:
        print("train_gpt2: the loss did not go down", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
