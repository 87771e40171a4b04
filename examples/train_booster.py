"""The repository's main job: a small GPT-2 (transformers' GPT2LMHeadModel,
4 layers x 192, one token per byte) trained through the Booster with
GeminiPlugin (ZeRO-3 over chunks) and HybridAdam, about a minute on a
2-core CPU machine.

The data is this repository's own text (every .md and .py file, as bytes)
cut into windows, so the run needs no download; the dataloader comes from
``plugin.prepare_dataloader`` (shuffled, resumable). Progress is printed as
plain lines (they read the same in a log as on a terminal). At the end the
run directory it prints holds:

- ``summary.json`` and the closing summary: tokens/s, peak memory per
  device, where the chunks were placed and the chunk size chosen, and on a
  GPU with ``--machine PROFILE.json`` (from benchmarks/machine.py) the
  step's floor and achieved / floor;
- ``chunks.txt``: every chunk, where it lives, its bytes on each tier;
- ``memory_timeline.txt`` (and ``memory_timeline.png`` with matplotlib,
  ``pip install 'zerostack-gemini[plot]'``): the bytes on GPU, pinned host,
  pageable host and disk at every module of one training step;
- ``state/``: ``booster.save_state`` of the last step (model, optimizer,
  scheduler, RNG, dataloader position); ``--resume DIR`` goes on from one.

    python examples/train_booster.py                  # the main job (nox -s train)
    python examples/train_booster.py --smoke          # a few steps of a tiny model (CI)
    torchrun --nproc-per-node 2 examples/train_booster.py   # two ranks
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from _gpt2 import gpt2, next_token_loss
from torch.utils.data import Dataset

from zerostack.booster import Booster, GeminiPlugin, launch_from_torch
from zerostack.fused_adam import HybridAdam
from zerostack.shard import MachineProfile, step_floor

ROOT = Path(__file__).resolve().parent.parent


class Windows(Dataset):
    """Non-overlapping ``seq + 1``-byte windows of the corpus: (input, target)."""

    def __init__(self, corpus: torch.Tensor, seq: int) -> None:
        self.corpus, self.seq = corpus, seq

    def __len__(self) -> int:
        return (self.corpus.numel() - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.corpus[i * self.seq : (i + 1) * self.seq + 1]
        return w[:-1], w[1:]


def load_corpus() -> torch.Tensor:
    skip = {".nox", "runs", ".git"}
    files = sorted(
        p for ext in ("*.md", "*.py") for p in ROOT.rglob(ext) if not skip & set(p.parts)
    )
    data = b"\n".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps (default 100; 8 with --smoke)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine decay)")
    parser.add_argument("--nvme-fraction", type=float, default=0.5,
                        help="share of the CPU-held Adam states HybridAdam keeps on disk (in the "
                             "run dir); > 0 places every optimizer chunk on the CPU unless "
                             "--offload-optim-frac says otherwise")  # fmt: skip
    parser.add_argument("--offload-optim-frac", type=float, default=None,
                        help="GeminiPlugin's share of optimizer chunks on the CPU (default 1.0 "
                             "with --nvme-fraction > 0, else 0.5)")  # fmt: skip
    parser.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    parser.add_argument("--run-dir", default=None, help="default: runs/<date-time> in the repo")
    parser.add_argument("--resume", default=None, help="a state/ dir a previous run wrote")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps (CI)")
    parser.add_argument("--machine", default=None, metavar="PROFILE.json",
                        help="a MachineProfile written by benchmarks/machine.py: on a GPU, the "
                             "summary gives the step's floor and achieved / floor")  # fmt: skip
    return parser.parse_args()


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def offload_optim_frac(nvme_fraction: float, asked: float | None) -> tuple[float, str]:
    """GeminiPlugin's offload_optim_frac for this run, and why.

    HybridAdam's nvme_offload_fraction is a share of the optimizer states
    held on the CPU (states of chunks on the GPU stay there), as in
    ColossalAI, whose NVMe guide places the optimizer states on the CPU for
    it. So a run that asks for states on disk places every optimizer chunk
    on the CPU, unless --offload-optim-frac is given.
    """
    if asked is not None:
        return asked, "--offload-optim-frac"
    if nvme_fraction > 0:
        return 1.0, (
            f"--nvme-fraction {nvme_fraction} puts that share of the CPU-held optimizer states "
            "on disk: every optimizer chunk on the CPU, as ColossalAI's NVMe guide places them"
        )
    return 0.5, "half of the optimizer chunks step on the CPU (no --nvme-fraction)"


def build(args: argparse.Namespace, device: torch.device, run_dir: Path, rank: int = 0):
    """The model, optimizer, scheduler and dataloader, boosted."""
    shape = dict(layers=2, dim=64, heads=4, seq_len=64) if args.smoke else dict(
        layers=4, dim=192, heads=6, seq_len=args.seq_len
    )  # fmt: skip
    seq = min(args.seq_len, shape["seq_len"])
    if args.smoke:
        # Four chunks (the search would take one), so that a share of them goes to disk.
        chunks = dict(chunk_config_dict={n: {"chunk_size": 36_000} for n in (1, 2, 4, 8)})
    else:
        chunks = dict(hidden_dim=shape["dim"], min_chunk_size_m=0.25, search_range_m=1)
    cuda = device.type == "cuda"
    optim_frac, why = offload_optim_frac(args.nvme_fraction, args.offload_optim_frac)
    log(rank, f"placement: offload_optim_frac={optim_frac} ({why})")
    plugin = GeminiPlugin(
        precision="bf16" if cuda else "fp32", max_norm=1.0, offload_optim_frac=optim_frac,
        **chunks,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    torch.manual_seed(0)
    model = gpt2(**shape, vocab=256)  # one token per byte
    n_params = sum(p.numel() for p in model.parameters())  # before boost: then they live in chunks
    nvme = dict(nvme_offload_fraction=args.nvme_fraction, nvme_offload_dir=str(run_dir / "nvme"))
    optimizer = HybridAdam(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
        **(nvme if args.nvme_fraction > 0 else {}),
    )  # fmt: skip
    steps = args.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )  # fmt: skip
    loader = plugin.prepare_dataloader(
        Windows(load_corpus(), seq), batch_size=args.batch_size, shuffle=True, drop_last=True
    )
    model, optimizer, _, loader, scheduler = booster.boost(
        model, optimizer, None, loader, scheduler
    )
    return booster, model, optimizer, scheduler, loader, (shape, seq, n_params)


def batches(loader, device: torch.device):
    """Endless (input, target) batches, epoch after epoch, from where the
    sampler stands (a resumed run starts mid-epoch)."""
    epoch = loader.sampler.epoch
    while True:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            yield x.to(device), y.to(device)
        epoch += 1


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak MB per device of this process: host RSS, and each CUDA device's
    allocator peak."""
    peak = {"cpu (peak RSS)": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        for i in range(torch.cuda.device_count()):
            peak[f"cuda:{i}"] = torch.cuda.max_memory_allocated(i) / 2**20
    return peak


def compute_times(shape: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Median forward and backward seconds of the same model all on the GPU
    as GeminiPlugin(precision="bf16") computes it (bf16 parameters, no
    optimizer): the compute terms of the step's floor. (Plain PyTorch's fp32
    parameters under bf16 autocast are slower: no lower bound.)"""
    model = gpt2(**shape, vocab=256).to(x.device, torch.bfloat16)
    fwd, bwd = [], []
    for i in range(7):  # 2 warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = next_token_loss(model(input_ids=x).logits, y)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        if i >= 2:
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t1)
    return statistics.median(fwd), statistics.median(bwd)


def step_floor_of(args, shape: dict, batch, ddp, nvme_bytes: int, step_s: float) -> dict:
    """The step's floor ([Note: step-time floor] in zerostack.shard) from
    ``--machine``'s profile, or why there is none."""
    if args.machine is None:
        return {"why_not": "give --machine PROFILE.json (benchmarks/machine.py) for it"}
    if batch[0].device.type != "cuda":
        return {
            "why_not": "the floor models offloaded steps on a GPU; this run computes on the CPU"
        }
    forward_s, backward_s = compute_times(shape, *batch)
    try:
        est = step_floor(
            MachineProfile.load(args.machine), forward_s=forward_s, backward_s=backward_s,
            disk_read_bytes=nvme_bytes, disk_write_bytes=nvme_bytes, **ddp.step_amounts(),
        )  # fmt: skip
    except ValueError as error:
        return {"why_not": str(error)}
    return {"floor_s": est.floor_s, "step_s": step_s, "achieved_over_floor": step_s / est.floor_s,
            "compute_forward_s": forward_s, "compute_backward_s": backward_s}  # fmt: skip


def train(args, rank, world, device, run_dir) -> dict:
    booster, model, optimizer, scheduler, loader, (shape, seq, n_params) = build(
        args, device, run_dir, rank
    )
    start_step = 0
    if args.resume:
        booster.load_state(args.resume, model, optimizer, scheduler, loader)
        start_step = scheduler.last_epoch
        log(rank, f"resumed from {args.resume} at step {start_step}")
    ddp, inner = model.module, optimizer.optim  # GeminiDDP, GeminiOptimizer
    log(rank, f"model: GPT-2, {n_params / 1e6:.2f}M params ({shape['layers']} "
              f"layers, dim {shape['dim']}); {len(loader.dataset)} windows of {seq} bytes; "
              f"batch {args.batch_size} x {world} ranks; {args.steps} steps on {device}")  # fmt: skip
    data = batches(loader, device)
    losses, timeline = [], None
    tokens = args.batch_size * seq * world
    t0 = time.perf_counter()
    for step in range(start_step, args.steps):
        x, y = next(data)
        if step == start_step + 2 and timeline is None:  # after the warm-up steps
            with ddp.memory_timeline(inner) as timeline:
                loss = next_token_loss(model(input_ids=x).logits, y)
                booster.backward(loss, optimizer)
                timeline.sample("before step")
                optimizer.step()
                ddp.wait_updates()
                timeline.sample("after step")
        else:
            loss = next_token_loss(model(input_ids=x).logits, y)
            booster.backward(loss, optimizer)
            optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
        done = step + 1 - start_step
        if done % args.log_every == 0 or step + 1 == args.steps:
            rate = done * tokens / (time.perf_counter() - t0)
            log(rank, f"step {step + 1:>4}/{args.steps}  loss {losses[-1]:.3f}  "
                      f"lr {scheduler.get_last_lr()[0]:.2e}  {rate:,.0f} tokens/s")  # fmt: skip
    elapsed = time.perf_counter() - t0
    booster.save_state(run_dir / "state", model, optimizer, scheduler, loader)
    nvme_bytes = getattr(inner.optimizer, "nvme_bytes_on_disk", lambda: 0)()
    step_s = elapsed / (args.steps - start_step)  # data loading and logging included
    return {
        "steps": args.steps - start_step,
        "seconds": elapsed,
        "tokens_per_s": (args.steps - start_step) * tokens / elapsed,
        "loss_first": losses[0],
        "loss_last": sum(losses[-5:]) / len(losses[-5:]),
        "ddp": ddp,
        "timeline": timeline,
        "nvme_bytes": nvme_bytes,
        "floor": step_floor_of(args, shape, (x, y), ddp, nvme_bytes, step_s),
    }


def report(rank: int, result: dict, device: torch.device, run_dir: Path) -> None:
    """Write the run directory's files (rank 0) and print the summary."""
    ddp, timeline = result.pop("ddp"), result.pop("timeline")
    rows = ddp.chunk_placement()
    placement = {}
    for r in rows:
        entry = placement.setdefault(f"{r.kind} on {r.home}", {"chunks": 0, "bytes": 0})
        entry["chunks"] += 1
        entry["bytes"] += sum(r.usage.values())
    summary = {**result, "peak_memory_mb": peak_memory(device), "placement": placement,
               "chunk_size": sorted({r.chunk_size for r in rows})}  # fmt: skip
    if rank != 0:
        return
    (run_dir / "chunks.txt").write_text(ddp.chunk_placement(table=True) + "\n")
    files = ["chunks.txt"]
    if timeline is not None:
        (run_dir / "memory_timeline.txt").write_text(timeline.table() + "\n")
        files.append("memory_timeline.txt")
        try:
            timeline.save_png(run_dir / "memory_timeline.png")
            files.append("memory_timeline.png")
        except ImportError as error:
            print(f"no memory_timeline.png: {error}", flush=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n== summary ==", flush=True)
    print(f"{result['steps']} steps in {result['seconds']:.1f}s: {result['tokens_per_s']:,.0f} "
          f"tokens/s; loss {result['loss_first']:.3f} -> {result['loss_last']:.3f}")  # fmt: skip
    for dev, mb in summary["peak_memory_mb"].items():
        print(f"peak memory {dev}: {mb:,.1f} MB")
    print(f"chunks (chunk size {', '.join(map(str, summary['chunk_size']))} elements):")
    for where, e in placement.items():
        print(f"  {where:<20} {e['chunks']:>3} chunks {e['bytes'] / 2**20:8.2f} MB")
    print(f"  optimizer states on disk {result['nvme_bytes'] / 2**20:8.2f} MB")
    floor = result["floor"]
    if "why_not" in floor:
        print(f"step floor: not computed ({floor['why_not']})")
    else:
        print(f"step floor {floor['floor_s']:.4f} s; mean step {floor['step_s']:.4f} s, "
              f"achieved / floor {floor['achieved_over_floor']:.2f}x")  # fmt: skip
    print(f"run directory: {run_dir} ({', '.join(files)}, summary.json, state/)", flush=True)


def main() -> int:
    args = parse_args()
    if args.steps is None:
        args.steps = 8 if args.smoke else 100
    if args.steps < 3 or args.log_every < 1:
        print("train_booster: --steps must be >= 3 and --log-every >= 1", file=sys.stderr)
        return 2
    torchrun = "RANK" in os.environ
    if torchrun:
        launch_from_torch(seed=0)
    rank = torch.distributed.get_rank() if torchrun else 0
    world = torch.distributed.get_world_size() if torchrun else 1
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if not torchrun and device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    run_dir = Path(args.run_dir or ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    log(rank, f"train_booster: run directory {run_dir}")
    result = train(args, rank, world, device, run_dir)
    report(rank, result, device, run_dir)
    if args.steps >= 20 and not result["loss_last"] < result["loss_first"]:
        print("train_booster: the loss did not go down", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
