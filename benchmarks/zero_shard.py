"""ZeroOptimizer at world size 1 on one GPU, against plain PyTorch and FSDP2
with CPU offload, in one run.

GPT-2 1.5B from config, bf16, activation checkpointing on every block, batch
8 x 1024 tokens. Configurations:

* plain PyTorch: fp32 params, bf16 autocast, torch.optim.AdamW(fused=True)
  (the reference for "no offload");
* ZeRO-2: bf16 params, fp32 masters, ZeroOptimizer(AdamW), states on the GPU;
* ZeRO-2 + cpu_offload: masters and states on the CPU, stepped by CPUAdam;
* FSDP2 + CPUOffloadPolicy: fully_shard per block, bf16 MixedPrecisionPolicy,
  torch AdamW on the CPU (the peer for "offload").

For each: tokens/s, peak GPU memory, and the step split into forward+backward
and optimizer step (synchronised between them). Median of --steps after
--warmup.

    torchrun --nproc-per-node 1 benchmarks/zero_shard.py     # or plain python
    python benchmarks/zero_shard.py --layers 4 --steps 3     # quick
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT


def build(config: GPTConfig, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TinyGPT(config).to(dtype)
    for block in model.blocks:
        forward = block.forward
        block.forward = lambda x, forward=forward: checkpoint(forward, x, use_reentrant=False)
    return model


def torch_step(opt):
    """The step function of a plain torch optimizer for ``run``."""

    def step(loss, backward_only):
        if backward_only:
            loss.backward()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def run(name, model, step_fn, batch, steps, warmup, autocast):
    idx, tgt = batch
    fb, opt = [], []
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(idx, tgt)
        step_fn(loss, backward_only=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        step_fn(loss, backward_only=False)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= warmup:
            fb.append(t1 - t0)
            opt.append(t2 - t1)
    total = [a + b for a, b in zip(fb, opt, strict=True)]
    return dict(
        name=name,
        tokens_s=idx.numel() / statistics.median(total),
        step_s=statistics.median(total),
        fwd_bwd_s=statistics.median(fb),
        opt_s=statistics.median(opt),
        peak_gb=torch.cuda.max_memory_allocated() / 1e9,
        loss=loss.item(),
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", default="plain,zero2,zero2_offload,fsdp2_offload")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("zero_shard: needs a CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    torch.cuda.set_device(0)
    config = GPTConfig.gpt2_xl(num_layers=a.layers, max_seq_len=a.seq_len, tie_embeddings=True)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (a.batch_size, a.seq_len), generator=gen).cuda()
    batch = (idx, torch.roll(idx, -1, dims=1))
    hyper = dict(lr=1e-4, weight_decay=0.1)
    results = []
    wanted = a.only.split(",")

    def measure(name, fn):
        if name not in wanted:
            return
        print(f"[zero-bench] {name} ...", file=sys.stderr, flush=True)
        try:
            results.append(fn())
        except torch.OutOfMemoryError as exc:
            results.append(dict(name=name, error=f"OOM: {str(exc).splitlines()[0][:80]}"))
        gc.collect()
        torch.cuda.empty_cache()

    def plain():
        model = build(config, torch.float32)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
        return run(
            "plain PyTorch (fp32 params, bf16 autocast, fused AdamW)",
            model,
            torch_step(opt),
            batch,
            a.steps,
            a.warmup,
            True,
        )

    def zero(offload):
        model = build(config, torch.bfloat16)
        zopt = ZeroOptimizer(
            torch.optim.AdamW(model.parameters(), fused=not offload, **hyper),
            stage=2,
            cpu_offload=offload,
        )

        def step(loss, backward_only):
            if backward_only:
                zopt.backward(loss)
            else:
                zopt.step()

        label = (
            "ZeRO-2 + cpu_offload (CPUAdam)" if offload else "ZeRO-2 (bf16 params, fp32 masters)"
        )
        return run(label, model, step, batch, a.steps, a.warmup, False)

    def fsdp2_offload():
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        model = build(config, torch.float32)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp, offload_policy=CPUOffloadPolicy())
        fully_shard(model, mp_policy=mp, offload_policy=CPUOffloadPolicy())
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
        return run(
            "FSDP2 + CPUOffloadPolicy (torch fused AdamW on CPU)",
            model,
            torch_step(opt),
            batch,
            a.steps,
            a.warmup,
            False,
        )

    measure("plain", plain)
    measure("zero2", lambda: zero(False))
    measure("zero2_offload", lambda: zero(True))
    measure("fsdp2_offload", fsdp2_offload)

    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print("\n## ZeRO-2 on one GPU\n")
    print(f"- date: {date}; command: `python {' '.join(sys.argv)}`")
    print(
        f"- GPU {torch.cuda.get_device_name()}, {os.cpu_count()} host cores, torch {torch.__version__}"
    )
    print(f"- GPT-2 XL shape, {a.layers} layers, batch {a.batch_size} x {a.seq_len}, bf16, activation checkpointing; "
          f"median of {a.steps} steps after {a.warmup}\n")  # fmt: skip
    by = {r["name"]: r for r in results}
    plain_r = next((r for r in results if r["name"].startswith("plain") and "error" not in r), None)
    fsdp_r = next((r for r in results if r["name"].startswith("FSDP2") and "error" not in r), None)
    print(
        "| configuration | tokens/s | vs plain | vs FSDP2 offload | step s | fwd+bwd s | optimizer s | peak GPU GB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in by.values():
        if "error" in r:
            print(f"| {r['name']} | {r['error']} | | | | | | |")
            continue
        vp = f"{r['tokens_s'] / plain_r['tokens_s']:.2f}x" if plain_r else "n/a"
        vf = f"{r['tokens_s'] / fsdp_r['tokens_s']:.2f}x" if fsdp_r else "n/a"
        print(f"| {r['name']} | {r['tokens_s']:,.0f} | {vp} | {vf} | {r['step_s']:.3f} | {r['fwd_bwd_s']:.3f} | "
              f"{r['opt_s']:.3f} | {r['peak_gb']:.1f} |")  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
