"""Gemini (ZeRO-3 over chunks) on one GPU, against plain PyTorch and FSDP2
with CPU offload, in one run. Not yet run on a GPU (written at the end of the
session that built gemini-placement; the next device session runs it).

GPT-2 1.5B from config, bf16, activation checkpointing, batch 8 x 1024.
Configurations:

* plain PyTorch (autocast + fused AdamW) with the whole GPU: the ceiling;
* FSDP2 + CPUOffloadPolicy: the peer;
* Gemini static, everything on the GPU;
* Gemini static with GPU memory capped (``--cap-gib``, default 24, through
  torch.cuda.set_per_process_memory_fraction) and optimizer states on the
  CPU (offload_optim_frac=1.0). Run last: the cap stays for the process.

    python benchmarks/gemini.py
    python benchmarks/gemini.py --layers 4 --steps 3     # quick
"""

from __future__ import annotations

import argparse
import sys

import _training as T
import torch
import torch.distributed as dist

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import GPTConfig, TinyGPT


def gemini(config, batch, steps, warmup, offload_optim_frac: float, label: str) -> dict:
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = T.checkpoint_blocks(TinyGPT(config))
    model = GeminiDDP(
        base,
        mixed_precision=torch.bfloat16,
        offload_optim_frac=offload_optim_frac,
        hidden_dim=config.dim,
    )
    opt = GeminiOptimizer(HybridAdam(list(base.parameters()), **T.HYPER), model)

    def step(loss, backward_only):
        if backward_only:
            opt.backward(loss)
        else:
            opt.step()

    return T.run(label, model, step, batch, steps, warmup, False)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--only", default="plain,fsdp2_offload,gemini_gpu,gemini_capped")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemini: needs a CUDA device", file=sys.stderr)
        return 2
    T.init_single_process()
    config = GPTConfig.gpt2_xl(num_layers=a.layers, max_seq_len=a.seq_len, tie_embeddings=True)
    idx = torch.randint(
        0, config.vocab_size, (a.batch_size, a.seq_len), generator=torch.Generator().manual_seed(0)
    )
    batch = (idx.cuda(), torch.roll(idx, -1, dims=1).cuda())
    args = (config, batch, a.steps, a.warmup)
    results: list[dict] = []
    wanted = a.only.split(",")
    T.measure(results, wanted, "plain", lambda: T.plain(*args))
    T.measure(results, wanted, "fsdp2_offload", lambda: T.fsdp2_offload(*args))
    T.measure(
        results, wanted, "gemini_gpu", lambda: gemini(*args, 0.0, "Gemini static, all on the GPU")
    )
    if "gemini_capped" in wanted:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 2**30 / total))
        label = f"Gemini static, GPU capped at {a.cap_gib:g} GiB, optimizer on the CPU"
        T.measure(results, wanted, "gemini_capped", lambda: gemini(*args, 1.0, label))
    T.print_table(
        "Gemini on one GPU",
        results,
        f"GPT-2 XL shape, {a.layers} layers, batch {a.batch_size} x {a.seq_len}, bf16, activation "
        f"checkpointing; median of {a.steps} steps after {a.warmup}",
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
