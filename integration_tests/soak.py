"""Soak: many steps of a small model with a checkpoint every few steps, per
plugin, sampling after every step what a leak would grow: host RSS, open
file descriptors, threads, and the bytes on disk of the NVMe directory and of
the checkpoint directory. Growth after warm-up must stay under 1%.

    python integration_tests/soak.py                       # 1000 steps, every 50
    python integration_tests/soak.py --steps 150 --every 15 --plugins ddp,gemini-nvme

Writes ``soak-<plugin>.csv`` (and ``soak-<plugin>.png`` with matplotlib)
under ``--out`` and prints a table of growth per resource. CPU, gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import tempfile
import time

import torch

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)
CHUNKS = {"chunk_size": 6_000, "keep_gathered": False}
RESOURCES = ("rss_mb", "fds", "threads", "nvme_dir_mb", "ckpt_dir_mb")


def _plugin(name: str, world: int):
    chunks = {world: CHUNKS}
    if name == "ddp":
        return TorchDDPPlugin(), 0.0
    if name == "zero2-offload":
        return LowLevelZeroPlugin(stage=2, precision="fp32", cpu_offload=True), 0.0
    if name == "gemini-offload":
        return GeminiPlugin(precision="bf16", offload_optim_frac=0.5, chunk_config_dict=chunks), 0.0
    if name == "gemini-auto":
        return GeminiPlugin(
            precision="bf16", placement_policy="auto", gpu_capacity_bytes=10**6,
            chunk_config_dict=chunks,
        ), 0.0  # fmt: skip
    if name == "gemini-nvme":
        return GeminiPlugin(precision="bf16", offload_optim_frac=1.0, chunk_config_dict=chunks), 1.0
    raise ValueError(f"soak: unknown plugin {name!r} (choose from {', '.join(PLUGINS)})")


PLUGINS = ("ddp", "zero2-offload", "gemini-offload", "gemini-auto", "gemini-nvme")


def _dir_mb(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):  # replaced by an atomic save meanwhile
                total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total / 2**20


def _sample(nvme_dir: str, ckpt_dir: str) -> dict[str, float]:
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {
        "rss_mb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "fds": float(len(os.listdir("/proc/self/fd"))),
        "threads": float(len(os.listdir("/proc/self/task"))),
        "nvme_dir_mb": _dir_mb(nvme_dir),
        "ckpt_dir_mb": _dir_mb(ckpt_dir),
    }


def _soak(rank: int, world: int, name: str, steps: int, every: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    work = tempfile.mkdtemp(prefix=f"soak-{name}-{rank}-", dir=out)
    nvme_dir, ckpt_dir = os.path.join(work, "nvme"), os.path.join(work, "ckpt")
    os.makedirs(nvme_dir)
    os.makedirs(ckpt_dir)
    plugin, fraction = _plugin(name, world)
    model = TinyGPT(CONFIG)
    adam = HybridAdam(
        model.parameters(), lr=1e-3, nvme_offload_fraction=fraction, nvme_offload_dir=nvme_dir
    )
    booster = Booster(plugin=plugin)
    model, opt, _, _, _ = booster.boost(model, adam)
    rows = []
    for step in range(steps):
        idx, tgt = make_batch(CONFIG, 4, 16, seed=1000 * step + rank)
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        if (step + 1) % every == 0:
            booster.save_model(model, os.path.join(ckpt_dir, "model"), shard=True)
            booster.save_optimizer(opt, os.path.join(ckpt_dir, "optimizer"), shard=True)
        if rank == 0:
            rows.append({"step": step, "loss": loss.item(), **_sample(nvme_dir, ckpt_dir)})
    if rank == 0:
        with open(os.path.join(out, f"soak-{name}.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def growth(rows: list[dict[str, str]], resource: str) -> float:
    """Relative growth of ``resource`` after warm-up: the median of the last
    tenth of the steps against the median of the tenth after the first
    third (the first third is warm-up: lazily made buffers, the first
    checkpoint, auto placement's plan)."""
    values = [float(r[resource]) for r in rows]
    n = len(values)
    base = statistics.median(values[n // 3 : n // 3 + max(1, n // 10)])
    last = statistics.median(values[-max(1, n // 10) :])
    return (last - base) / base if base else (0.0 if last == base else float("inf"))


def _plot(rows: list[dict[str, str]], name: str, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(RESOURCES), figsize=(4 * len(RESOURCES), 3))
    steps = [int(r["step"]) for r in rows]
    for ax, resource in zip(axes, RESOURCES, strict=True):
        ax.plot(steps, [float(r[resource]) for r in rows])
        ax.set_title(resource)
        ax.set_xlabel("step")
    fig.suptitle(f"soak: {name}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def run(plugins, steps: int, every: int, world: int, out: str) -> dict[str, dict[str, float]]:
    """Soak every plugin; returns {plugin: {resource: growth}}."""
    os.makedirs(out, exist_ok=True)
    result = {}
    for name in plugins:
        start = time.perf_counter()
        spawn(_soak, world, args=(name, steps, every, out), backend="gloo", timeout_s=3600)
        with open(os.path.join(out, f"soak-{name}.csv")) as f:
            rows = list(csv.DictReader(f))
        result[name] = {r: growth(rows, r) for r in RESOURCES}
        plotted = _plot(rows, name, os.path.join(out, f"soak-{name}.png"))
        first, last = rows[0], rows[-1]
        print(
            f"{name}: {steps} steps, a checkpoint every {every}, {time.perf_counter() - start:.0f} s; "
            f"RSS {float(first['rss_mb']):.0f} -> {float(last['rss_mb']):.0f} MB, "
            f"loss {float(first['loss']):.3f} -> {float(last['loss']):.3f}"
            + ("" if plotted else " (no PNG: matplotlib is not installed)"),
            flush=True,
        )
    return result


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=1000, help="training steps per plugin")
    ap.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    ap.add_argument("--world", type=int, default=2, help="ranks (CPU processes, gloo)")
    ap.add_argument("--plugins", default=",".join(PLUGINS), help="comma-separated plugins")
    ap.add_argument("--out", default="soak_out", help="directory for the CSVs and PNGs")
    ap.add_argument("--limit", type=float, default=0.01, help="largest growth allowed")
    a = ap.parse_args()
    result = run([p for p in a.plugins.split(",") if p], a.steps, a.every, a.world, a.out)
    print("\n| plugin | " + " | ".join(RESOURCES) + " |")
    print("|---" * (len(RESOURCES) + 1) + "|")
    failed = []
    for name, grown in result.items():
        print(f"| {name} | " + " | ".join(f"{grown[r]:+.2%}" for r in RESOURCES) + " |")
        failed += [f"{name} {r}" for r in RESOURCES if grown[r] > a.limit]
    if failed:
        print(f"growth over {a.limit:.0%}: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
