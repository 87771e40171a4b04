"""Adam states on disk: GPT-2 small (transformers' GPT2LMHeadModel) trained
for a few steps with HybridAdam at nvme_offload_fraction 0.0 and 1.0,
printing loss, step time and peak RSS of each (the two examples of ColossalAI's NVMe offload guide, run here):

* ``plain``: the model on the CPU, stepped by HybridAdam directly;
* ``gemini``: GeminiDDP with every parameter shard and optimizer chunk on the
  CPU (compute on the GPU when there is one), HybridAdam inside
  GeminiOptimizer stepping the fp32 master chunks.

Each run is its own process, so the peak RSS figures are clean. At fraction
1.0 the 8 bytes/param of Adam state live in a file (the bytes on disk are
printed), and the losses must equal those of fraction 0.0.

    python examples/nvme_offload.py                 # GPT-2 small (124M), 3 steps, both
    python examples/nvme_offload.py --smoke         # a tiny GPT-2, for CI
    python examples/nvme_offload.py --only gemini --dir /mnt/nvme --backend threads
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


def run(fraction: float, args: argparse.Namespace) -> dict:
    from _gpt2 import gpt2, next_token_loss  # here: the parent process only starts the runs

    torch.manual_seed(0)
    if args.smoke:
        model = gpt2(layers=2, dim=128, heads=4, seq_len=128, vocab=1024)
    else:
        model = gpt2(layers=12, dim=768, heads=12, seq_len=1024)  # GPT-2 small
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    nvme = dict(
        nvme_offload_fraction=fraction, nvme_offload_dir=args.dir, nvme_backend=args.backend
    )
    device = "cpu"
    if args.child_mode == "gemini":
        from zerostack.gemini import GeminiDDP, GeminiOptimizer

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        wrapped = GeminiDDP(
            model, mixed_precision=dtype, compute_device=device, offload_optim_frac=1.0,
            offload_param_frac=1.0,
        )  # fmt: skip
        opt = GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-4, **nvme), wrapped)
        inner = opt.optimizer
    else:
        wrapped, opt = model, HybridAdam(model.parameters(), lr=1e-4, **nvme)
        inner = opt
    losses, times = [], []
    # A step lasts from the end of the one before: the last CPU update runs on
    # while the next batch is made.
    start = time.perf_counter()
    for step in range(args.steps):  # random tokens, the same at both fractions
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
        opt.zero_grad()
        loss = next_token_loss(wrapped(input_ids=ids[:, :-1]).logits, ids[:, 1:])
        if args.child_mode == "gemini":
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        start += times[-1]
    if args.child_mode == "gemini":  # the last CPU update may still be running (overlap)
        wrapped.wait_updates()
    # Host bytes by owner (GeminiOptimizer.host_bytes): masters, parameter
    # shards, Adam states in RAM, staging; the plain run has no breakdown.
    host = opt.host_bytes().total / params if args.child_mode == "gemini" else None
    return dict(
        host_b_per_param=host,
        fraction=fraction,
        params=params,
        losses=losses,
        step_s=sorted(times)[len(times) // 2],
        disk_mb=inner.nvme_bytes_on_disk() / 2**20,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--steps", type=int, default=3, help="training steps per run (default %(default)s)"
    )
    ap.add_argument(
        "--batch-size", type=int, default=4, help="sequences per step (default %(default)s)"
    )
    ap.add_argument(
        "--seq-len", type=int, default=128, help="tokens per sequence (default %(default)s)"
    )
    ap.add_argument("--dir", default=None, help="offload directory (default: a temporary one)")
    ap.add_argument(
        "--backend",
        default=None,
        choices=["uring", "aio", "threads"],
        help="the disk I/O backend (default: $ZEROSTACK_NVME_BACKEND, else threads; uring and "
        "aio need tensornvme)",
    )
    ap.add_argument("--smoke", action="store_true", help="a tiny GPT-2 for 2 steps (CI)")
    ap.add_argument(
        "--only", choices=["plain", "gemini"], default=None,
        help="run one of the two examples (default: both)",
    )  # fmt: skip
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-mode", default="plain", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.seq_len, args.steps = min(args.seq_len, 64), min(args.steps, 2)
    if args.child is not None:
        print(json.dumps(run(args.child, args)))
        return 0
    for mode in [args.only] if args.only else ["plain", "gemini"]:
        if _compare(mode, args) != 0:
            return 1
    return 0


def _compare(mode: str, args: argparse.Namespace) -> int:
    results = []
    for fraction in (0.0, 1.0):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(fraction),
            "--child-mode",
            mode,
            *sys.argv[1:],
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr, file=sys.stderr)
            return out.returncode
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    what = "HybridAdam on the CPU" if mode == "plain" else "Gemini, everything on the CPU"
    print(
        f"\n{what}: {results[0]['params'] / 1e6:.1f}M params, {args.steps} steps, "
        f"batch {args.batch_size} x {args.seq_len}"
    )
    print(
        "| nvme_offload_fraction | losses | median step s | peak RSS MB | Adam states on disk MB "
        "| zerostack host B/param |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        host = "-" if r["host_b_per_param"] is None else f"{r['host_b_per_param']:.2f}"
        print(
            f"| {r['fraction']} | {losses} | {r['step_s']:.2f} | {r['peak_rss_mb']:.0f} | "
            f"{r['disk_mb']:.0f} | {host} |"
        )
    saved = results[0]["peak_rss_mb"] - results[1]["peak_rss_mb"]
    print(
        f"RSS saved: {saved:.0f} MB ({saved * 2**20 / results[0]['params']:.1f} bytes/param); "
        f"step time x{results[1]['step_s'] / results[0]['step_s']:.2f}"
    )
    if results[1]["disk_mb"] <= 0:
        print(f"nvme_offload ({mode}): nothing went to disk at fraction 1.0", file=sys.stderr)
        return 1
    if results[0]["losses"] != results[1]["losses"]:
        print(
            f"nvme_offload ({mode}): losses differ between fractions 0.0 and 1.0", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
