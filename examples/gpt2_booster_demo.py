"""GPT-2 through the Booster: ColossalAI's train_gpt_demo, one process per GPU.

    torchrun --nproc-per-node 8 examples/gpt2_booster_demo.py --model gpt2_xl
    torchrun --nproc-per-node 2 examples/gpt2_booster_demo.py --plugin zero2
    python examples/gpt2_booster_demo.py --smoke                  # a tiny GPT-2 on the CPU (CI)
    python examples/gpt2_booster_demo.py     # without a GPU: a small GPT-2 (11M) on the CPU
    python examples/gpt2_booster_demo.py --smoke --plugin gemini_auto --lazy

A Hugging Face GPT2LMHeadModel built from a config, activation
checkpointing on, HybridAdam, and the plugin: GeminiPlugin(max_norm=1.0,
initial_scale=2**5) as in ColossalAI, "gemini_auto" with auto placement,
"zero1"/"zero2" (LowLevelZeroPlugin) or "ddp" (TorchDDPPlugin with
Booster(mixed_precision=...)). Every step prints the loss, the step time,
TFLOPS per process (8 x parameters x tokens: forward, backward and the
recomputed forward) and the peak memory (GPU, or the process's RSS on a CPU).
The data is random tokens.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
from _gpt2 import gpt2
from torch import nn

from zerostack.booster import (
    Booster,
    GeminiPlugin,
    LazyInitContext,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    launch_from_torch,
)
from zerostack.fused_adam import HybridAdam

# (hidden size, layers, heads), ColossalAI's model table.
MODELS = {
    "gpt2_medium": (1024, 24, 16),
    "gpt2_large": (1280, 36, 20),
    "gpt2_xl": (1600, 48, 32),
    "gpt2_4b": (2304, 64, 16),
    "gpt2_10b": (4096, 50, 16),
    "small": (384, 6, 6),  # the CPU default
    "smoke": (64, 2, 4),
}
VOCAB = 50257


class GPTLMLoss(nn.Module):
    """Next-token cross-entropy on the logits (ColossalAI's criterion)."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shift_logits = logits[..., :-1, :].contiguous().float()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss_fn(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def make_plugin(name: str, precision: str, smoke: bool):
    small = dict(min_chunk_size_m=0.05, hidden_dim=64) if smoke else {}
    if name == "gemini":
        return GeminiPlugin(precision=precision, max_norm=1.0, initial_scale=2**5, **small)
    if name == "gemini_auto":
        cap = {} if torch.cuda.is_available() else {"gpu_capacity_bytes": 1 << 30}
        return GeminiPlugin(
            placement_policy="auto", precision=precision, max_norm=1.0, initial_scale=2**5,
            **cap, **small,
        )  # fmt: skip
    if name in ("zero1", "zero2"):
        return LowLevelZeroPlugin(
            stage=int(name[-1]), precision=precision, max_norm=1.0, initial_scale=2**5
        )
    return TorchDDPPlugin()


def peak_memory() -> str:
    if torch.cuda.is_available():
        return f"peak GPU {torch.cuda.max_memory_allocated() / 2**20:,.0f} MiB"
    return f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MiB"


def single_process_env() -> None:
    """Without torchrun: the environment of a one-process torchrun."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.update(env, MASTER_PORT=str(port))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--plugin", choices=["ddp", "zero1", "zero2", "gemini", "gemini_auto"], default="gemini",
        help="ddp: TorchDDPPlugin; zero1/zero2: LowLevelZeroPlugin; gemini: GeminiPlugin "
        "(static placement); gemini_auto: GeminiPlugin with auto placement (default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--model", choices=sorted(MODELS), default=None,
        help="GPT-2 size from ColossalAI's table; default: gpt2_medium on CUDA, small on a CPU",
    )  # fmt: skip
    ap.add_argument(
        "--precision", choices=["fp16", "bf16"], default=None,
        help="mixed precision of the plugin (default: fp16 on CUDA as in ColossalAI and with "
        "--smoke, bf16 otherwise on a CPU)",
    )  # fmt: skip
    ap.add_argument(
        "--batch-size", type=int, default=None,
        help="sequences per step and rank (default: 8; 4 for small)",
    )  # fmt: skip
    ap.add_argument(
        "--seq-len", type=int, default=None,
        help="tokens per sequence (default: 1024; 128 for small)",
    )  # fmt: skip
    ap.add_argument("--steps", type=int, default=10, help="training steps (default %(default)s)")
    ap.add_argument("--lazy", action="store_true", help="build under LazyInitContext")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 3 steps, CPU is fine")
    a = ap.parse_args()
    if a.smoke:
        a.model, a.batch_size, a.seq_len, a.steps = "smoke", 2, 64, 3
        torch.set_num_threads(1)
    elif a.model is None:
        a.model = "gpt2_medium" if torch.cuda.is_available() else "small"
        if a.model == "small" and os.environ.get("RANK", "0") == "0":
            print(
                "gpt2_booster_demo: no CUDA device, so a small GPT-2 (6 layers x 384, 256-token "
                "vocabulary, bf16, batch 4 x 128) trains on the CPU instead of gpt2_medium "
                "(355M); --model gpt2_medium forces that, --smoke runs a tiny one",
                file=sys.stderr,
            )
    small = a.model == "small"
    a.seq_len = a.seq_len or (128 if small else 1024)
    a.batch_size = a.batch_size or (4 if small else 8)
    a.precision = a.precision or ("fp16" if torch.cuda.is_available() or a.smoke else "bf16")
    if "RANK" not in os.environ:  # plain `python`: one process
        single_process_env()
    vocab = 256 if a.model in ("smoke", "small") else VOCAB
    hidden, layers, heads = MODELS[a.model]
    shape = dict(layers=layers, dim=hidden, heads=heads, seq_len=a.seq_len, vocab=vocab)
    launch_from_torch(seed=42)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    )

    plugin = make_plugin(a.plugin, a.precision, a.smoke)
    booster = Booster(plugin=plugin, mixed_precision=a.precision if a.plugin == "ddp" else None)
    if a.lazy:
        # As ColossalAI's demo: nothing allocated; boost materializes it
        # (GeminiPlugin: into chunks), the init running on `device`.
        with LazyInitContext(default_device=device):
            model = gpt2(**shape, checkpointing=True)
    else:
        model = gpt2(**shape, checkpointing=True)
    numel = sum(p.numel() for p in model.parameters())
    if a.lazy:
        # HybridAdam refuses meta parameters: boost the model first, then
        # build the optimizer on its (now real) parameters and boost again.
        model, *_ = booster.boost(model)
    optimizer = HybridAdam(model.parameters(), lr=1e-3)
    model, optimizer, criterion, *_ = booster.boost(model, optimizer, GPTLMLoss())
    if rank == 0:
        print(
            f"{a.model}: {numel / 1e6:.1f}M parameters, plugin {a.plugin}, {a.precision}, "
            f"{world} process(es) on {device}, batch {a.batch_size} x {a.seq_len}",
            flush=True,
        )

    gen = torch.Generator().manual_seed(1 + rank)
    losses = []
    # A step lasts from the end of the one before: an offloaded step() returns
    # with updates still running, so a synchronize before the next step,
    # outside its time, would leave their tail out.
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for step in range(1, a.steps + 1):
        if a.smoke:  # one batch over and over: a few steps must lower its loss
            gen.manual_seed(1 + rank)
        ids = torch.randint(0, vocab, (a.batch_size, a.seq_len), generator=gen).to(device)
        outputs = model(input_ids=ids)
        loss = criterion(outputs.logits, ids)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step_time = time.perf_counter() - start
        start += step_time
        losses.append(loss.item())
        tflops = 8 * numel * a.batch_size * a.seq_len / step_time / 1e12
        if rank == 0:
            print(
                f"[{step}/{a.steps}] loss {losses[-1]:.3f}, step {step_time:.3f}s, "
                f"TFLOPS {tflops:.3f}, {peak_memory()}",
                flush=True,
            )
    dist.destroy_process_group()
    if not all(map(lambda x: x == x, losses)) or not losses[-1] < losses[0]:
        print(f"gpt2_booster_demo: the loss did not go down ({losses})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
