"""Weak scaling over the GPUs of one host, under torchrun (NCCL): tokens/s per
GPU for ZeRO-2, Gemini ZeRO-3 on the GPU, Gemini with the optimizer on the
CPU, and FSDP2 with and without CPU offload, batch 8 x 1024 per GPU, bf16,
activation checkpointing. Run it at 1, 2, 4, 8 GPUs and compare the per-GPU
figures with the one-GPU run.

    torchrun --nproc-per-node 1 benchmarks/scaling.py
    torchrun --nproc-per-node 4 benchmarks/scaling.py
    torchrun --nproc-per-node 8 benchmarks/scaling.py --layers 32 --dim 4096 --heads 32   # 7B class

Not yet run on several GPUs (2026-11-30: the device time ran out before it).
"""

from __future__ import annotations

import sys

import _training as T
import torch
import torch.distributed as dist
from gemini import gemini
from zero_shard import zero


def fsdp2(config, batch, steps, warmup) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = T.build(config, torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **T.HYPER)
    label = "FSDP2 (bf16 compute, fp32 reduce, fused AdamW)"
    return T.run(label, model, T.torch_step(opt), batch, steps, warmup, False)


def main() -> int:
    ready = T.setup(__doc__, "zero2,gemini_gpu,gemini_offload,fsdp2,fsdp2_offload")
    if ready is None:
        return 2
    a, args = ready
    world = dist.get_world_size()
    results: list[dict] = []
    wanted = a.only.split(",")
    T.measure(results, wanted, "zero2", lambda: zero(*args, offload=False))
    T.measure(results, wanted, "gemini_gpu", lambda: gemini(*args, "Gemini ZeRO-3, all on the GPU"))
    T.measure(
        results,
        wanted,
        "gemini_offload",
        lambda: gemini(*args, "Gemini ZeRO-3, optimizer on the CPU", offload_optim_frac=1.0),
    )
    T.measure(results, wanted, "fsdp2", lambda: fsdp2(*args))
    T.measure(results, wanted, "fsdp2_offload", lambda: T.fsdp2_offload(*args))
    if dist.get_rank() == 0:
        T.print_table(f"Weak scaling, {world} GPU(s), tokens/s per GPU", results, T.describe(a))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
