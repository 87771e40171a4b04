"""Train ColossalAI's GPT-2 models with auto-offload under a memory budget.

    bash run.sh                                       # gpt2_medium, bs 64, 16 GB, asyn
    MODEL_TYPE=gpt2_xl SOLVER_TYPE=syn bash run.sh
    python train_gpt_offload.py --solver_type plain   # the peer: fp32 + autocast, no offload
    python train_gpt_offload.py --solver_type gemini  # the peer: Gemini auto, GPU capped at the budget
    python train_gpt_offload.py --smoke               # a tiny model on the CPU (CI)

Prints the solver's time and its predicted peak and step time, then
ColossalAI's line: exec_time (mean of the fastest 5 of 10 steps, forward and
backward), param_size and the measured peak allocated/reserved memory,
and the whole step's time (forward, backward and optimizer step: the figure
to compare solvers and peers by, since Gemini overlaps its CPU step with the
next forward).
"""

from __future__ import annotations

import argparse
import copy
import logging
import time

import torch

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as error:  # ColossalAI's demo trains transformers' GPT-2
    raise SystemExit(
        "train_gpt_offload.py: needs transformers: pip install transformers"
    ) from error

from zerostack.auto_offload import (
    AMPOptimizer,
    HardwareProfile,
    memory_optimize,
    parameter_size,
    plan_offload,
)
from zerostack.fused_adam import HybridAdam

# ColossalAI's model table: (hidden size, layers, attention heads).
MODELS = {
    "gpt2_medium": (1024, 24, 16),
    "gpt2_xl": (1600, 48, 32),
    "gpt2_10b": (4096, 50, 16),
    "gpt2_14b": (4096, 70, 16),
    "gpt2_20b": (8192, 25, 16),
    "gpt2_24b": (8192, 30, 16),
    "tiny": (64, 2, 4),
}
VOCAB, DATA_VOCAB, SEQ_LEN = 50257, 1024, 8  # ColossalAI's data: ids below 1024, 8 tokens


class GPTLMModel(torch.nn.Module):
    """transformers' GPT-2 returning only the logits (ColossalAI's
    model_zoo.GPTLMModel)."""

    def __init__(self, hidden: int, layers: int, heads: int, vocab: int = VOCAB) -> None:
        super().__init__()
        cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=1024,
                         vocab_size=vocab)  # fmt: skip
        self.model = GPT2LMHeadModel(cfg)

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """ColossalAI's GPTLMLoss: next-token cross entropy."""
    shift = logits[..., :-1, :].contiguous().float()
    return torch.nn.functional.cross_entropy(
        shift.view(-1, shift.size(-1)), labels[..., 1:].reshape(-1)
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model_type", default="gpt2_medium", choices=sorted(MODELS))
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--solver_type", default="asyn", choices=["asyn", "syn", "plain", "gemini"],
                   help="a solver, or a peer: plain (no offload) or gemini (auto placement "
                   "with the GPU capped at the budget)")  # fmt: skip
    p.add_argument("--memory_budget", type=float, default=16, help="GB (2**30 bytes)")
    p.add_argument("--precision", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny model, 3 steps, on the CPU")
    args = p.parse_args()
    if args.smoke:
        args.model_type, args.batch_size, args.steps = "tiny", 4, 3
        args.memory_budget = 0  # the least that works is searched below
    return args


def build(args, device):
    vocab = DATA_VOCAB if args.smoke else VOCAB
    model = GPTLMModel(*MODELS[args.model_type], vocab=vocab)
    ids = torch.randint(0, DATA_VOCAB, (args.batch_size, SEQ_LEN))
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    param_mb = parameter_size(model) / 1024**2 / 2  # fp32 now, half once optimized
    print(f"init_param_size={param_mb:.3f} MB | model_type={args.model_type}")
    return model, batch, param_mb


def offloaded(args, model, batch, device):
    """memory_optimize + AMPOptimizer; prints the solver's time and prediction.
    Returns the forward+backward and the step closures."""
    profile = HardwareProfile.measure(device)  # the CPU's too (--smoke), once per process
    budget = args.memory_budget * 1024**3
    if args.smoke:  # a budget halfway between the least plan and no offload
        _, rm, _ = plan_offload(copy.deepcopy(model), batch, -1, args.solver_type,
                                precision=args.precision, profile=profile)  # fmt: skip
        least, free = rm.solver.least_memory_plan().peak_mem, rm.solver.best_ts.peak_mem
        budget = (least + free) / 2 / 0.95
    start = time.perf_counter()
    om = memory_optimize(model, batch, budget, args.solver_type, precision=args.precision,
                         profile=profile, device=device)  # fmt: skip
    solver_s = time.perf_counter() - start
    ts = om.region_manager.solver.best_ts
    print(f"solver_time={solver_s:.3f} s | predicted_peak={ts.peak_mem / 1024**2:.3f} MB | "
          f"predicted_step_time={ts.step_time:.4f} s | {om.region_manager.solver.describe()}")  # fmt: skip
    optim = AMPOptimizer(HybridAdam(om.master_parameters(), lr=1e-3), om)
    labels = batch["input_ids"].to(device)

    def fwd_bwd():
        optim.backward(lm_loss(om(**batch), labels))

    def step():
        optim.step()
        optim.zero_grad()

    return fwd_bwd, step


def plain(args, model, batch, device):
    """The peer: fp32 parameters on the device, autocast, fused AdamW."""
    model = model.to(device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.precision]
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    batch = {k: v.to(device) for k, v in batch.items()}

    def fwd_bwd():
        with torch.autocast(device.type, dtype=dtype):
            loss = lm_loss(model(**batch), batch["input_ids"])
        scaler.scale(loss).backward()

    def step():
        scaler.step(optim)
        scaler.update()
        optim.zero_grad(set_to_none=True)

    return fwd_bwd, step


def gemini(args, model, batch, device):
    """The peer: Gemini auto placement (ZeRO-3 over chunks, one rank) with the
    GPU capped at the memory budget, HybridAdam, the same model and batch."""
    import os
    import socket

    import torch.distributed as dist

    from zerostack.gemini import GeminiDDP, GeminiOptimizer

    if "MASTER_PORT" not in os.environ:  # a free port: two of these may run side by side
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    cap = int(args.memory_budget * 1024**3)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.precision]
    hidden = MODELS[args.model_type][0]
    gm = GeminiDDP(model, mixed_precision=dtype, placement_policy="auto",
                   gpu_capacity_bytes=cap, hidden_dim=hidden)  # fmt: skip
    optim = GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-3), gm)
    batch = {k: v.to(device) for k, v in batch.items()}

    def fwd_bwd():
        optim.backward(lm_loss(gm(**batch), batch["input_ids"]))

    def step():
        optim.step()
        optim.zero_grad()

    return fwd_bwd, step


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_gpt_offload.py: needs a CUDA device (or --smoke for the CPU)")
    model, batch, param_mb = build(args, device)
    run = {"plain": plain, "gemini": gemini}.get(args.solver_type, offloaded)
    if args.solver_type == "gemini" and device.type != "cuda":
        raise SystemExit("train_gpt_offload.py: --solver_type gemini needs a CUDA device")
    fwd_bwd, step = run(args, model, batch, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, whole = [], []
    end = time.perf_counter()
    for _ in range(args.steps):  # ColossalAI times forward + backward; the step follows
        times.append(timed(fwd_bwd, device))
        timed(step, device)
        # A whole step lasts from the end of the one before: Gemini's step()
        # returns with updates still running, which the synchronize before
        # the next forward and backward waits for.
        whole.append(time.perf_counter() - end)
        end += whole[-1]
    exec_time = sum(sorted(times)[:5]) / min(5, len(times))
    step_time = sum(sorted(whole)[:5]) / min(5, len(whole))
    alc = torch.cuda.max_memory_allocated() / 1024**2 if device.type == "cuda" else 0.0
    res = torch.cuda.max_memory_reserved() / 1024**2 if device.type == "cuda" else 0.0
    tokens = args.batch_size * SEQ_LEN
    print(f"solver_type: {args.solver_type} | model_type: {args.model_type} | "
          f"tokens/s={tokens / exec_time:.1f} | whole_step_time={step_time:.4f} s | "
          f"whole_step_tokens/s={tokens / step_time:.1f}")  # fmt: skip
    print(f"| exec_time={exec_time:.3f} s | param_size={param_mb:.3f} MB "
          f"| runtime_peak_mem_alc={alc:.3f} MB | runtime_peak_mem_res={res:.3f} MB |")  # fmt: skip
    print(f"step_times={[round(t, 4) for t in times]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
