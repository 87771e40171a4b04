"""GPT-2 trained with Gemini (ZeRO-3 over chunks), one process per GPU.

    torchrun --nproc-per-node 8 examples/gpt2_gemini.py                    # GPT-2 medium, bf16
    torchrun --nproc-per-node 1 examples/gpt2_gemini.py --placement auto
    python examples/gpt2_gemini.py --smoke                                 # a tiny GPT-2 on the CPU (CI)
    python examples/gpt2_gemini.py         # without a GPU: a small GPT-2 (11M params) on the CPU

The model, a transformers GPT2LMHeadModel, is built under LazyInitContext
(nothing allocated) and materialized module by module into bf16 chunks, with
the values an eager build would have; each rank keeps 1/N of
every chunk and of the fp32 master chunks, whose optimizer states live on
the CPU (`--offload-optim 1.0`), the GPU, or where auto placement puts them. Every block is activation
checkpointed (transformers' gradient checkpointing); a chunk gathered for a
block serves its recomputation too.
The data is random tokens: the point is the memory and the speed, and the
loss falls towards the uniform-token entropy.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from _gpt2 import gpt2, next_token_loss
from tqdm import tqdm

from zerostack.chunk import LazyInitContext
from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=20, help="training steps (default %(default)s)")
    ap.add_argument(
        "--model", choices=["gpt2_medium", "small"], default=None,
        help="GPT-2 medium (355M params, bf16) or small (6 layers x 384, byte vocabulary, 11M "
        "params, fp32); "
        "default: gpt2_medium on CUDA, small on a CPU",
    )  # fmt: skip
    ap.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="sequences per step and rank (default %(default)s)",
    )
    ap.add_argument(
        "--seq-len", type=int, default=None,
        help="tokens per sequence (default: 1024 for gpt2_medium, 256 for small)",
    )  # fmt: skip
    ap.add_argument(
        "--offload-optim", type=float, default=1.0,
        help="static placement: offload_optim_frac, the share of optimizer state on the CPU "
        "(default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--placement", choices=["static", "auto"], default="static",
        help="Gemini placement policy (default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--smoke", action="store_true", help="a tiny GPT for at most 6 steps on the CPU (CI)"
    )
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if "RANK" in os.environ:
        use_cuda = torch.cuda.is_available() and not a.smoke
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    if a.model is None and not a.smoke:
        a.model = "gpt2_medium" if device == "cuda" else "small"
        if device == "cpu" and rank == 0:
            print(
                "gpt2_gemini: no CUDA device, so a small GPT-2 (6 layers x 384, 11M params, fp32) "
                "trains on the CPU instead of GPT-2 medium (355M); --model gpt2_medium forces "
                "that, --smoke runs a tiny one",
                file=sys.stderr,
            )
    if a.smoke:
        a.steps, a.batch_size, a.seq_len = min(a.steps, 6), 4, 64
        shape = dict(layers=2, dim=64, heads=4, vocab=256)
        chunks = {
            max(1, dist.get_world_size() if dist.is_initialized() else 1): {"chunk_size": 65536}
        }
        dtype = torch.float32
    elif a.model == "small":
        a.seq_len = a.seq_len or 256
        shape = dict(layers=6, dim=384, heads=6, vocab=256)
        chunks, dtype = None, torch.float32 if device == "cpu" else torch.bfloat16
    else:
        a.seq_len = a.seq_len or 1024
        shape = dict(layers=24, dim=1024, heads=16)  # GPT-2 medium, GPT-2's vocabulary
        chunks, dtype = None, torch.bfloat16
    torch.manual_seed(0)
    with LazyInitContext():  # nothing allocated: GeminiDDP materializes it into the chunks
        model = gpt2(**shape, seq_len=a.seq_len, checkpointing=True)
    vocab = model.config.vocab_size
    placement = (
        dict(placement_policy="auto")
        if a.placement == "auto"
        else dict(offload_optim_frac=a.offload_optim)
    )
    if a.placement == "auto" and device == "cpu":
        placement["gpu_capacity_bytes"] = 1 << 20  # bookkeeping only on a CPU
    model = GeminiDDP(
        model,
        mixed_precision=dtype,
        chunk_config_dict=chunks,
        compute_device=device,
        min_chunk_size_m=32 if a.model == "gpt2_medium" else 0.5,
        **placement,
    )
    opt = GeminiOptimizer(
        HybridAdam(list(model.module.parameters()), lr=3e-4, weight_decay=0.1), model, max_norm=1.0
    )
    gen = torch.Generator().manual_seed(1 + rank)
    losses, start = [], time.perf_counter()
    bar = tqdm(range(a.steps), desc="gemini", disable=rank != 0 or None)
    for step in bar:
        if a.smoke:  # one batch over and over: a few steps must lower its loss
            gen.manual_seed(1 + rank)
        idx = torch.randint(0, vocab, (a.batch_size, a.seq_len + 1), generator=gen)
        loss = next_token_loss(model(input_ids=idx[:, :-1]).logits, idx[:, 1:])
        opt.backward(loss.float())
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if rank == 0:
            bar.write(f"step {step}: loss {losses[-1]:.4f}")
    elapsed = time.perf_counter() - start
    if rank == 0:
        tokens = (
            a.steps
            * a.batch_size
            * a.seq_len
            * (dist.get_world_size() if dist.is_initialized() else 1)
        )
        peak = (
            f", peak GPU {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
            if device == "cuda"
            else ""
        )
        print(
            f"done: {a.steps} steps, {tokens / elapsed:,.0f} tokens/s{peak}; loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        )
    if dist.is_initialized():
        dist.destroy_process_group()
    if not losses[-1] < losses[0]:
        print("gpt2_gemini: the loss did not go down", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
