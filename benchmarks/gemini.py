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

import sys

import _training as T
import torch
import torch.distributed as dist

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import TinyGPT


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
    ready = T.setup(
        __doc__,
        "plain,fsdp2_offload,gemini_gpu,gemini_capped",
        lambda ap: ap.add_argument("--cap-gib", type=float, default=24.0),
    )
    if ready is None:
        return 2
    a, args = ready
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
        T.describe(a),
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
