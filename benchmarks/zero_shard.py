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
import sys

import _training as T
import torch
import torch.distributed as dist

from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig


def zero(config, batch, steps, warmup, offload: bool) -> dict:
    model = T.build(config, torch.bfloat16)
    zopt = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), fused=not offload, **T.HYPER),
        stage=2,
        cpu_offload=offload,
    )

    def step(loss, backward_only):
        if backward_only:
            zopt.backward(loss)
        else:
            zopt.step()

    label = "ZeRO-2 + cpu_offload (CPUAdam)" if offload else "ZeRO-2 (bf16 params, fp32 masters)"
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
    ap.add_argument("--only", default="plain,zero2,zero2_offload,fsdp2_offload")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("zero_shard: needs a CUDA device", file=sys.stderr)
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
    T.measure(results, wanted, "zero2", lambda: zero(*args, offload=False))
    T.measure(results, wanted, "zero2_offload", lambda: zero(*args, offload=True))
    T.measure(results, wanted, "fsdp2_offload", lambda: T.fsdp2_offload(*args))
    T.print_table(
        "ZeRO-2 on one GPU",
        results,
        f"GPT-2 XL shape, {a.layers} layers, batch {a.batch_size} x {a.seq_len}, bf16, activation "
        f"checkpointing; median of {a.steps} steps after {a.warmup}",
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
