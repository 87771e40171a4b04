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

import sys

import _training as T
import torch
import torch.distributed as dist

from zerostack.shard import ZeroOptimizer


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
    ready = T.setup(__doc__, "plain,zero2,zero2_offload,fsdp2_offload")
    if ready is None:
        return 2
    a, args = ready
    results: list[dict] = []
    wanted = a.only.split(",")
    for run in range(a.repeat):
        T.measure(results, wanted, "plain", lambda: T.plain(*args), run)
        T.measure(results, wanted, "zero2", lambda: zero(*args, offload=False), run)
        T.measure(results, wanted, "zero2_offload", lambda: zero(*args, offload=True), run)
        T.measure(results, wanted, "fsdp2_offload", lambda: T.fsdp2_offload(*args), run)
    T.print_table(
        "ZeRO-2 on one GPU",
        results,
        T.describe(a),
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
