"""Adam states on disk: GPT-2 small trained on the CPU for a few steps with
HybridAdam at nvme_offload_fraction 0.0 and 1.0, printing loss, time and
peak RSS of each (ColossalAI's NVMe offload guide, run here).

Each fraction runs in its own process, so the peak RSS figures are clean.
At fraction 1.0 the 8 bytes/param of Adam state live in a file, and the
losses must equal those of fraction 0.0.

    python examples/nvme_offload.py                 # GPT-2 small (124M), 3 steps
    python examples/nvme_offload.py --smoke         # a tiny GPT, for CI
    python examples/nvme_offload.py --dir /mnt/nvme --backend threads
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, make_batch, num_parameters


def run(fraction: float, args: argparse.Namespace) -> dict:
    if args.smoke:
        config = GPTConfig(num_layers=2, dim=128, num_heads=4, vocab_size=1024, max_seq_len=128)
    else:
        config = GPTConfig.gpt2_small(tie_embeddings=True)
    torch.manual_seed(0)
    model = TinyGPT(config)
    opt = HybridAdam(
        model.parameters(),
        lr=1e-4,
        nvme_offload_fraction=fraction,
        nvme_offload_dir=args.dir,
        nvme_backend=args.backend,
    )
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        idx, tgt = make_batch(config, args.batch_size, args.seq_len, seed=step)
        opt.zero_grad()
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(
        fraction=fraction,
        params=num_parameters(model),
        losses=losses,
        seconds=time.perf_counter() - start,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dir", default=None, help="offload directory (default: a temporary one)")
    ap.add_argument("--backend", default=None, choices=["uring", "aio", "threads"])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.seq_len = min(args.seq_len, 64)
    if args.child is not None:
        print(json.dumps(run(args.child, args)))
        return 0

    results = []
    for fraction in (0.0, 1.0):
        cmd = [sys.executable, __file__, "--child", str(fraction), *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"model: {results[0]['params'] / 1e6:.1f}M params, {args.steps} steps, batch {args.batch_size} x {args.seq_len}"
    )
    print("| nvme_offload_fraction | losses | time s | peak RSS MB |")
    print("|---|---|---|---|")
    for r in results:
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        print(f"| {r['fraction']} | {losses} | {r['seconds']:.1f} | {r['peak_rss_mb']:.0f} |")
    saved = results[0]["peak_rss_mb"] - results[1]["peak_rss_mb"]
    print(
        f"RSS saved: {saved:.0f} MB ({saved * 2**20 / results[0]['params']:.1f} bytes/param); "
        f"time x{results[1]['seconds'] / results[0]['seconds']:.2f}"
    )
    if results[0]["losses"] != results[1]["losses"]:
        print("nvme_offload: losses differ between fractions 0.0 and 1.0", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
