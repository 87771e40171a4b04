"""Scale: the largest GPT one GPU trains under Gemini with everything on the
CPU, and what it costs in host memory per parameter, with Adam states in RAM
(--nvme-fraction 0) or on disk (--nvme-fraction 1).

One configuration per run (a model of billions of parameters is built once):

1. the disk: free space of the NVMe directory and its raw sequential write
   (O_DIRECT, then fsync) and read bandwidth (O_DIRECT, so not from the page
   cache; where the filesystem refuses O_DIRECT, buffered I/O with fsync and
   posix_fadvise(DONTNEED) before the read, and the table says so);
2. what it decided, with the arithmetic: model shape, host bytes it expects
   (2 B/param bf16 parameter shards + 4 B/param fp32 masters + 8 B/param
   Adam states unless on disk) against MemAvailable, and "states need X GB
   of disk, free Y GB"; it refuses, before building anything, what cannot fit;
3. a GPT-2-style TinyGPT of ``--params`` (or ``--layers``/``--dim``) built
   under LazyInitContext (materialized module by module straight into the
   chunks), GeminiDDP bf16 with every chunk and master on the CPU
   (``--placement cpu``: static offload_param_frac=1, offload_optim_frac=1)
   or ``auto``, the GPU capped with set_per_process_memory_fraction
   (``--gpu-cap-gib``), HybridAdam with ``nvme_offload_fraction``;
4. a few steps at a small batch, then one table row: params, tokens/s, step
   time and spread, peak host RSS (while training, and of the whole process)
   and B/param, the host-bytes breakdown by owner (GeminiOptimizer.host_bytes),
   disk bytes of the NVMe directory, and the optimizer's disk I/O rate
   against the raw one.

    python benchmarks/scale.py --params 8B --nvme-fraction 1 --nvme-dir /data
    python benchmarks/scale.py --params 5B --nvme-fraction 0
    python benchmarks/scale.py --smoke                 # CPU, tiny: checks the script
    python benchmarks/scale.py --params 8B --batch-size 8 --plain-tflops TFLOPS --machine m.json

With ``--plain-tflops`` (what plain PyTorch reaches on a model that fits,
benchmarks/gemini.py's TFLOPS column) the run's share of it is printed. With
``--machine`` (benchmarks/machine.py's profile), the step's floor: its compute
term is measured first, the same model all on the GPU without an optimizer
(bf16 parameters and gradients: 32 GB at 8B, before the cap).

The peer of this benchmark is the raw disk, and the target the bytes per
parameter (at most 14 B/param with states in RAM, 6 with them on disk);
tokens/s compares runs at fractions 0 and 1 of the same size.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import gc
import logging
import mmap
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch
from _training import PhaseSpans, fraction_arg, host_cpu, host_marks, queued_s, sync_compute

from zerostack.chunk import LazyInitContext
from zerostack.fused_adam import HybridAdam
from zerostack.gemini import HOST_OWNERS, GeminiDDP, GeminiOptimizer, rss_bytes
from zerostack.shard import MachineProfile, step_floor
from zerostack.testing import GPTConfig, TinyGPT

HYPER = dict(lr=1e-4, weight_decay=0.1)
BLOCK = 64 * 2**20  # raw I/O block


def parse_size(text: str) -> int:
    """``8B`` -> 8e9 parameters (K, M, G and B are powers of 1000)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
    t = text.strip().upper()
    return int(float(t[:-1]) * scale[t[-1]]) if t[-1] in scale else int(float(t))


def log(msg: str) -> None:
    print(f"[scale] {msg}", file=sys.stderr, flush=True)


# -- the disk ------------------------------------------------------------------------


def _fill(buf: mmap.mmap) -> None:
    step = 2**20
    pattern = os.urandom(step)  # incompressible
    for off in range(0, len(buf), step):
        buf[off : off + step] = pattern


def raw_disk(directory: str, total_bytes: int) -> dict:
    """Sequential write (then fsync) and read of ``total_bytes`` in 64 MiB
    blocks, with O_DIRECT where the filesystem takes it (no page cache
    either way); else buffered, and the page cache is asked to drop the
    file (posix_fadvise DONTNEED after fsync) before reading it."""
    n = max(1, total_bytes // BLOCK)
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    _fill(buf)
    fd_dir = tempfile.mkdtemp(prefix="zs-scale-raw-", dir=directory)
    path = os.path.join(fd_dir, "raw.bin")
    method = "O_DIRECT"
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            os.write(fd, buf)  # probe: tmpfs and some filesystems refuse O_DIRECT here
            os.lseek(fd, 0, os.SEEK_SET)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            method = "buffered + fsync + fadvise(DONTNEED)"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        if method != "O_DIRECT":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        flags = os.O_RDONLY | (os.O_DIRECT if method == "O_DIRECT" else 0)
        fd = os.open(path, flags)
        t0 = time.perf_counter()
        for _ in range(n):
            if os.readv(fd, [buf]) <= 0:
                break
        read_s = time.perf_counter() - t0
        os.close(fd)
    finally:
        buf.close()
        shutil.rmtree(fd_dir, ignore_errors=True)
    nbytes = n * BLOCK
    return dict(
        bytes=nbytes, method=method, write_gbps=nbytes / write_s / 1e9,
        read_gbps=nbytes / read_s / 1e9,
    )  # fmt: skip


def dir_disk_bytes(directory: str) -> int:
    """Bytes allocated on disk under ``directory`` (st_blocks, so reserved
    space counts too)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakRss:
    """Samples VmRSS every 20 ms on a thread: the peak over a window."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


# -- the model -----------------------------------------------------------------------


def gpt_shape(a) -> GPTConfig:
    """``--layers``/``--dim`` as given, else a shape of about ``--params``:
    dim 4096 from 3B on (2048 from 500M, else 1024), heads of 128, layers
    filling the rest (12 dim^2 per block, a tied vocabulary of 50257)."""
    if a.smoke:
        return GPTConfig(vocab_size=256, max_seq_len=a.seq_len, num_layers=2, dim=64, num_heads=4)
    vocab = 50257
    if a.dim and a.layers:
        dim, layers = a.dim, a.layers
    else:
        target = parse_size(a.params)
        dim = a.dim or (4096 if target >= 3e9 else 2048 if target >= 5e8 else 1024)
        layers = max(1, round((target - vocab * dim) / (12 * dim * dim)))
    return GPTConfig(
        vocab_size=vocab, max_seq_len=a.seq_len, num_layers=layers, dim=dim,
        num_heads=max(1, dim // 128), tie_embeddings=True,
    )  # fmt: skip


def count_params(config: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TinyGPT(config).parameters())


def checkpoint_blocks(model: TinyGPT) -> None:
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        forward = block.forward
        block.forward = lambda x, forward=forward: checkpoint(forward, x, use_reentrant=False)


# -- the run -------------------------------------------------------------------------


def plan(a, n: int, device: torch.device, directory: str, disk: dict | None) -> list[str]:
    """What will run, with the arithmetic; raises SystemExit when it cannot fit."""
    gb = 1e9
    where = (
        "every bf16 chunk and fp32 master on the CPU (static offload_param_frac=1, "
        "offload_optim_frac=1)"
        if a.placement == "cpu"
        else f"Gemini auto placement, gpu_capacity_bytes {a.gpu_cap_gib:g} GiB"
    )
    lines = [
        f"decided: {n / gb:.2f}B params on {device}, {where}; HybridAdam "
        f"nvme_offload_fraction={a.nvme_fraction:g}"
        + (f" in {directory}" if a.nvme_fraction else "")
        + f"; batch {a.batch_size} x {a.seq_len}, {a.warmup} warm-up, 1 untimed, {a.steps} timed steps"
    ]
    states_ram = 8 * n * (1 - a.nvme_fraction)
    states_disk = 8 * n * a.nvme_fraction
    expect = 2 * n + 4 * n + states_ram
    avail = mem_available()
    lines.append(
        f"host: expects (2 B/param bf16 shards + 4 B/param fp32 masters + "
        f"{8 * (1 - a.nvme_fraction):g} B/param Adam states in RAM) x {n / gb:.2f}B = "
        f"{expect / gb:.1f} GB, plus staging and the process; MemAvailable {avail / gb:.1f} GB"
    )
    # 5% for chunk padding (chunks hold a little more than the parameters).
    if avail and 1.05 * expect > 0.97 * avail and not a.force:
        raise SystemExit(
            f"scale: refusing: the model needs about {expect / gb:.1f} GB of host memory and "
            f"{avail / gb:.1f} GB is available; pass "
            + ("--nvme-fraction 1, " if a.nvme_fraction < 1 else "")
            + "a smaller --params, or --force"
        )
    free = shutil.disk_usage(directory).free
    lines.append(
        f"disk: states need 8 B/param x {a.nvme_fraction:g} x {n / gb:.2f}B = "
        f"{states_disk / gb:.1f} GB of disk, free {free / gb:.1f} GB in {directory}"
    )
    if 1.05 * states_disk > 0.98 * free:
        raise SystemExit(
            f"scale: refusing: Adam states need {states_disk / gb:.1f} GB on disk and "
            f"{directory} has {free / gb:.1f} GB free; pass --nvme-dir on a larger disk, "
            "a smaller --params, or --nvme-fraction 0"
        )
    if disk is not None and states_disk:
        rw = 2 / (1 / disk["write_gbps"] + 1 / disk["read_gbps"])
        per_step = 2 * states_disk  # read and written once per step
        lines.append(
            f"disk traffic: 16 B/param x {n * a.nvme_fraction / gb:.2f}B = {per_step / gb:.1f} GB "
            f"per step; at the raw {rw:.2f} GB/s the optimizer step takes >= "
            f"{per_step / gb / rw:.1f} s"
        )
    if device.type == "cuda":
        lines.append(f"GPU: capped at {a.gpu_cap_gib:g} GiB of {_gpu_total() / 2**30:.0f} GiB")
    return lines


def _gpu_total() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def cut_steps(a, n: int, disk: dict | None) -> None:
    """Fewer timed steps when the disk alone would take past --time-budget-s."""
    if not disk or not a.nvme_fraction:
        return
    rw = 2 / (1 / disk["write_gbps"] + 1 / disk["read_gbps"]) * 1e9
    per_step = 16 * n * a.nvme_fraction / rw
    fit = int(a.time_budget_s * 0.6 / max(per_step, 1e-9)) - a.warmup - 1
    if fit < a.steps:
        steps = max(1, fit)
        log(
            f"disk-bound step ~{per_step:.0f} s: {steps} timed step(s) instead of {a.steps} "
            f"(--time-budget-s {a.time_budget_s:g})"
        )
        a.steps = steps


def build(a, config: GPTConfig, device: torch.device, directory: str):
    torch.manual_seed(0)
    with LazyInitContext():
        model = TinyGPT(config)
    if not all(p.is_meta for p in model.parameters()):
        raise AssertionError("scale: the model was not built on meta")
    checkpoint_blocks(model)
    kwargs: dict = dict(
        mixed_precision=torch.bfloat16, compute_device=device, hidden_dim=config.dim
    )
    if a.smoke:  # sharded chunks, as a large model gets (the search keeps a tiny one whole)
        del kwargs["hidden_dim"]
        kwargs["chunk_config_dict"] = {1: {"chunk_size": 20_000, "keep_gathered": False}}
    if a.placement == "auto":
        kwargs.update(placement_policy="auto", gpu_capacity_bytes=int(a.gpu_cap_gib * 2**30))
    else:
        kwargs.update(offload_optim_frac=1.0, offload_param_frac=1.0)
    if a.pin_memory:
        kwargs["pin_memory"] = True
    if a.max_prefetch:
        kwargs["max_prefetch"] = a.max_prefetch
    t0 = time.perf_counter()
    ddp = GeminiDDP(model, **kwargs)
    adam = HybridAdam(
        list(model.parameters()), nvme_offload_fraction=a.nvme_fraction,
        nvme_offload_dir=directory if a.nvme_fraction else None, **HYPER,
    )  # fmt: skip
    opt = GeminiOptimizer(adam, ddp, gpu_update_fraction=a.gpu_update_fraction)
    return ddp, adam, opt, time.perf_counter() - t0


def batch_of(a, config, device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (a.batch_size, a.seq_len), generator=gen)
    return idx.to(device), torch.roll(idx, -1, dims=1).to(device)


def sync_of(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


def compute_pass(a, config, device) -> dict:
    """The floor's compute term: forward, and forward plus backward, of the
    same model all on the compute device (bf16 parameters, the same
    checkpointing and batch, no optimizer), 1 warm-up and 2 timed passes:
    medians, and the spread of forward plus backward. Run before the GPU
    cap, which an 8B model's parameters and gradients (32 GB) do not fit;
    its memory is given back before the Gemini run and the peak statistics
    reset."""
    sync = sync_of(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = TinyGPT(config).to(torch.bfloat16)
    checkpoint_blocks(model)
    idx, tgt = batch_of(a, config, device)
    fwd, both = [], []
    for i in range(3):
        sync()
        t0 = time.perf_counter()
        loss = model(idx, tgt)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        if i:
            fwd.append(t1 - t0)
            both.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    del model, loss
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return dict(
        forward_s=statistics.median(fwd),
        backward_s=statistics.median(both) - statistics.median(fwd),
        spread=max(both) / min(both),
    )


def train(a, config, ddp, opt, device) -> dict:
    idx, tgt = batch_of(a, config, device)
    sync = sync_of(device)
    boundary = sync_compute if device.type == "cuda" else sync

    times, losses = [], []
    cpu_step0 = wait0 = nvme0 = 0.0
    peak = None
    end: float | None = None  # when the step before ended
    cuda = device.type == "cuda"
    spans = PhaseSpans()  # See [Note: phases on the device's timeline] in _training.py

    def step(timed: bool = False) -> float:
        if timed:
            spans.begin()
        loss = ddp(idx, tgt)
        if timed:
            spans.after()
        opt.backward(loss)
        if timed:
            spans.after()
        opt.step()
        if timed:
            spans.after()
        return float(loss.detach())

    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            ddp.wait_updates()
            log("host bytes after the warm-up:\n" + opt.host_bytes().table())
            peak = PeakRss()
            cpu_step0, wait0, nvme0 = opt.cpu_step_s, ddp.update_wait_s, opt.nvme_wait_s
            # One more step, untimed: its forward finds no CPU update pending
            # (all were waited for above), so timed, it would be the fastest
            # step and the spread would show the wait, not the steady state.
            # It ends as a timed step does, at its compute stream's end: a
            # device-wide synchronize there waited, outside every timed step,
            # for the device lane's work queued by then, and the first timed
            # step was short (the 8.06B split: 2.71 s against 3.38-3.40 s,
            # docs/benchmarks.md, "twenty-fifth session").
            sync()
            t0 = time.perf_counter()
            loss = step()
            boundary()
            end = time.perf_counter()
            log(f"untimed step: {end - t0:.2f} s, loss {loss:.3f}")
        if end is None:
            sync()
            end = time.perf_counter()
        cpu_at_end, queued0 = host_cpu(), queued_s()
        # A step lasts from the end of the one before, with no synchronize
        # between them: one would wait, outside the step, for the device
        # lane's copies and kernels that the CPU-step worker queues after
        # step() returns; and it ends at its compute stream's end, so that
        # lane work lands whole in the next step ([Note: a step lasts from
        # the end of the one before] in benchmarks/_training.py).
        losses.append(step(timed=cuda))
        boundary()
        dt = time.perf_counter() - end
        end += dt
        marks = host_marks(cpu_at_end, host_cpu(), dt)  # See host_marks in _training.py
        waited = queued_s() - queued0  # the training thread's over the whole step: See queued_s
        marks += f"[queued {waited * 1e3:.0f} ms]" if waited >= 1e-3 else ""
        phases = spans.line() if cuda else ""
        log(f"step {i + 1}/{a.warmup + a.steps}: {dt:.2f} s{phases}, loss {losses[-1]:.3f}{marks}")
        if i >= a.warmup:
            times.append(dt)
    ddp.wait_updates()
    # The counters hold the updates of the untimed step and of every timed
    # one; the forward waits of the timed ones only (the untimed waited none).
    stats = dict(
        cpu_step_s=(opt.cpu_step_s - cpu_step0) / (len(times) + 1),
        wait_s=(ddp.update_wait_s - wait0) / len(times),
        nvme_wait_s=(opt.nvme_wait_s - nvme0) / (len(times) + 1),
        peak_rss=peak.stop(),
    )
    if a.profile:
        profile_steps(step, sync)
    return dict(
        stats,
        step_s=statistics.median(times),
        spread=max(times) / min(times),
        tokens_s=a.batch_size * a.seq_len / statistics.median(times),
        loss=losses[-1],
        peak_gpu=torch.cuda.max_memory_allocated() if device.type == "cuda" else 0,
    )


def profile_steps(step, sync) -> None:
    """Two more steps under torch.profiler: where the device's time went
    (kernels, copies each way, idle) and the operators by device time."""
    from _training import copy_streams, device_time
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(2):
            step()
        sync()
    log(f"profile: 2 steps in {time.perf_counter() - t0:.2f} s (profiler on); "
        f"{device_time(prof.events())}")  # fmt: skip
    for line in copy_streams(prof.events()):
        log(f"profile: {line}")
    table = prof.key_averages().table
    if torch.cuda.is_available():
        log("profile by device time:\n" + table(sort_by="self_device_time_total", row_limit=20))
    # The host side: the zerostack:: phases (their totals include the waits
    # inside them) and the operators that held the threads longest.
    log("profile by host time:\n" + table(sort_by="cpu_time_total", row_limit=25))
    trace = os.environ.get("ZEROSTACK_BENCH_TRACE")
    if trace:  # a Chrome trace of the two steps (chrome://tracing, ui.perfetto.dev)
        prof.export_chrome_trace(trace)
        log(f"profile: trace in {trace}")


def throughput_and_floor(
    a, config: GPTConfig, n: int, r: dict, ddp, disk_bytes: int, compute: dict | None
) -> list[str]:
    """TFLOPS by the training benchmarks' formula (model FLOPs 6N + 12 L d s
    per token, recomputation not counted), its share of ``--plain-tflops``,
    and with ``--machine`` the step's floor: forward and backward as
    ``compute_pass`` measured them, the updates as [Note: step-time floor]
    in zero-shard says."""
    per_token = 6 * n + 12 * config.num_layers * config.dim * a.seq_len
    tflops = r["tokens_s"] * per_token / 1e12
    lines = [f"- {tflops:.2f} TFLOPS (6N + 12 L d s per token)"]
    if a.plain_tflops is None:
        lines.append("- no --plain-tflops: no share of plain PyTorch's TFLOPS")
    else:
        lines[0] += f": {tflops / a.plain_tflops:.1%} of plain PyTorch's {a.plain_tflops:g}"
    if a.machine is None or compute is None:
        return lines + ["- no --machine PROFILE.json: no floor"]
    try:
        est = step_floor(
            MachineProfile.load(a.machine), forward_s=compute["forward_s"],
            backward_s=compute["backward_s"], disk_read_bytes=disk_bytes,
            disk_write_bytes=disk_bytes, **ddp.step_amounts(),
        )  # fmt: skip
    except ValueError as exc:
        return lines + [f"- no floor: {exc}"]
    best = est.best
    share = (
        f", {best.gpu_fraction:.2f} of the host-held updates on the GPU"
        if best.gpu_fraction
        else ""
    )
    lines.append(
        f"- floor {est.floor_s:.3f} s (bound: {best.bound}{share}; CPU-only "
        f"floor {est.cpu_only.step_s:.3f} s); achieved / floor {r['step_s'] / est.floor_s:.2f}x"
    )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--params", default="8B", help="model size, e.g. 1B, 8B (default %(default)s)")
    ap.add_argument("--layers", type=int, default=0, help="blocks (with --dim: overrides --params)")
    ap.add_argument("--dim", type=int, default=0, help="hidden size (default: from --params)")
    ap.add_argument(
        "--seq-len", type=int, default=1024, help="tokens per sequence (default %(default)s)"
    )
    ap.add_argument(
        "--batch-size", type=int, default=1, help="sequences per step (default %(default)s)"
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps (default %(default)s)")
    ap.add_argument(
        "--warmup", type=int, default=1, help="untimed steps first (default %(default)s)"
    )
    ap.add_argument("--placement", choices=["cpu", "auto"], default="cpu",
                    help="cpu: every chunk and master on the CPU (static); auto: Gemini auto "
                    "under the cap (default %(default)s)")  # fmt: skip
    ap.add_argument(
        "--pin-memory", action="store_true",
        help="GeminiDDP(pin_memory=True): host chunks page-locked (at their exact size), so they "
        "cross PCIe at the pinned copy's rate; auto placement pins them anyway",
    )  # fmt: skip
    ap.add_argument(
        "--max-prefetch", type=int, default=0,
        help="GeminiDDP(max_prefetch=N): chunks gathered ahead of use (default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--gpu-update-fraction", type=fraction_arg, default=0.0,
        help="GeminiOptimizer(gpu_update_fraction=F): about this share of the CPU-held "
        "optimizer chunks stepped by the GPU's Adam, or auto (under --placement cpu every "
        "parameter shard lives on the host, and auto gives 0) (default %(default)s)",
    )  # fmt: skip
    ap.add_argument(
        "--profile", action="store_true",
        help="two more steps under torch.profiler: the device's kernels, copies and idle time",
    )  # fmt: skip
    ap.add_argument(
        "--gpu-cap-gib", type=float, default=24.0, help="GPU memory cap, GiB (default %(default)s)"
    )
    ap.add_argument("--nvme-fraction", type=float, default=0.0,
                    help="HybridAdam nvme_offload_fraction, 0 or 1 (default %(default)s)")  # fmt: skip
    ap.add_argument(
        "--nvme-dir",
        default=None,
        help="directory for the states and the raw test (default: the temp dir)",
    )
    ap.add_argument(
        "--raw-gb",
        type=float,
        default=4.0,
        help="GB of the raw disk test (default %(default)s; 0 skips it)",
    )
    ap.add_argument("--time-budget-s", type=float, default=400.0,
                    help="fewer timed steps when the disk-bound step would run past this (default %(default)s)")  # fmt: skip
    ap.add_argument(
        "--force", action="store_true", help="run even when host memory looks too small"
    )
    ap.add_argument(
        "--cpu", action="store_true", help="compute on the CPU even when CUDA is present"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model on the CPU, 0.02 GB raw test: checks the script",
    )
    ap.add_argument(
        "--plain-tflops", type=float, default=None,
        help="the TFLOPS plain PyTorch reaches on a model that fits the GPU (the TFLOPS column of "
        "benchmarks/gemini.py --only plain): the table gives this run's share of it",
    )  # fmt: skip
    ap.add_argument(
        "--machine", default=None, metavar="PROFILE.json",
        help="a MachineProfile written by benchmarks/machine.py: the floor of this step "
        "(zerostack.shard.step_floor, its forward and backward measured first with the model all "
        "on the GPU) and achieved / floor",
    )  # fmt: skip
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="[%(name)s] %(message)s")
    if a.smoke:
        a.seq_len, a.batch_size, a.raw_gb, a.cpu = 32, 2, 0.02, True
        a.steps, a.warmup = min(a.steps, 2), 1
    if not 0.0 <= a.nvme_fraction <= 1.0:
        ap.error(f"--nvme-fraction must be in [0, 1] (got {a.nvme_fraction})")
    if torch.cuda.is_available() and not a.cpu:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if device.type == "cpu" and not a.smoke:
        log("no CUDA device (or --cpu): computing on the CPU")
    directory = a.nvme_dir or tempfile.gettempdir()
    os.makedirs(directory, exist_ok=True)
    config = gpt_shape(a)
    n = count_params(config)
    log(f"model: TinyGPT {config.num_layers} layers, dim {config.dim}, {config.num_heads} heads, "
        f"vocab {config.vocab_size}, tied: {n / 1e9:.3f}B parameters")  # fmt: skip

    disk = None
    if a.raw_gb > 0:
        free = shutil.disk_usage(directory).free
        raw_bytes = int(min(a.raw_gb * 1e9, 0.5 * free))
        log(f"raw disk test: {raw_bytes / 1e9:.2f} GB in {directory} ...")
        try:
            disk = raw_disk(directory, raw_bytes)
        except OSError as exc:  # the run goes on without the raw figures
            log(f"raw disk test failed ({exc}); no raw bandwidth in the table")
    if disk is not None:
        log(f"raw disk: write {disk['write_gbps']:.2f} GB/s, read {disk['read_gbps']:.2f} GB/s "
            f"({disk['method']})")  # fmt: skip
    for line in plan(a, n, device, directory, disk):
        log(line)
    cut_steps(a, n, disk)
    compute = None
    if a.machine is not None:  # See [Note: step-time floor] in zero-shard
        compute = compute_pass(a, config, device)
        log(f"the model all on {device.type}, no optimizer: forward {compute['forward_s']:.3f} s, "
            f"backward {compute['backward_s']:.3f} s, spread {compute['spread']:.2f} (the floor's "
            "compute term)")  # fmt: skip
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.gpu_cap_gib * 2**30 / _gpu_total()))

    ddp, adam, opt, build_s = build(a, config, device, directory)
    gc.collect()
    rss_built = rss_bytes()
    # A parameter larger than the chunk size (the embedding) has a chunk of its own size.
    sizes = Counter(c.chunk_size for c in ddp.grad_chunks).most_common()
    log(f"built in {build_s:.1f} s; RSS {rss_built / 1e9:.1f} GB "
        f"({rss_built / n:.2f} B/param); {len(ddp.grad_chunks)} chunks "
        f"({', '.join(f'{k} of {size / 1e6:.1f}M elements' for size, k in sizes)}), "
        f"{len(ddp.offloaded_masters)} masters on the CPU")  # fmt: skip
    r = train(a, config, ddp, opt, device)
    if opt.device_lane_chunks:
        log(f"device lane: {len(opt.device_lane_chunks)} of {len(ddp.offloaded_masters)} CPU-held "
            f"chunks stepped by the GPU's Adam ({opt.device_lane_updates} updates), staging "
            f"{opt.device_lane_staging_bytes / 2**20:.0f} MiB")  # fmt: skip
    hb = opt.host_bytes()
    nvme_dir = getattr(getattr(adam, "_nvme", None), "swapper", None)
    nvme_path = nvme_dir.workdir if nvme_dir is not None else None
    on_disk = adam.nvme_bytes_on_disk()
    disk_alloc = dir_disk_bytes(nvme_path) if nvme_path else 0
    proc_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "none (CPU compute)"
    print("\n## Gemini at scale: host bytes per parameter\n")
    print(f"- date: {date}; command: `python {' '.join(sys.argv)}`")
    print(f"- GPU {gpu}, capped at {a.gpu_cap_gib:g} GiB; {os.cpu_count()} host cores "
          f"({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"- TinyGPT {config.num_layers} x {config.dim}, {n / 1e9:.3f}B params, bf16, activation "
          f"checkpointing, batch {a.batch_size} x {a.seq_len}, placement {a.placement}"
          f"{', pin_memory' if a.pin_memory else ''}"
          f"{f', max_prefetch={a.max_prefetch}' if a.max_prefetch else ''}"
          f"{f', gpu_update_fraction={opt.gpu_update_fraction:.3g}' if a.gpu_update_fraction else ''}"
          f"{' (auto)' if a.gpu_update_fraction == 'auto' else ''}, "
          f"HybridAdam nvme_offload_fraction={a.nvme_fraction:g}; median of {a.steps} step(s) "
          f"after {a.warmup} and 1 untimed after the updates were waited for; built in {build_s:.0f} s")  # fmt: skip
    if disk is not None:
        print(f"- raw disk ({directory}): {disk['bytes'] / 1e9:.2f} GB, {disk['method']}: write+fsync "
              f"{disk['write_gbps']:.2f} GB/s, read {disk['read_gbps']:.2f} GB/s")  # fmt: skip
    print()
    io = ""
    if on_disk and r["cpu_step_s"] > 0:
        traffic = 2 * on_disk  # read and written once per step
        rate = traffic / r["cpu_step_s"] / 1e9
        io = f"{rate:.2f}"
        if disk is not None:
            rw = 2 / (1 / disk["write_gbps"] + 1 / disk["read_gbps"])
            io += f" ({100 * rate / rw:.0f}% of raw {rw:.2f})"
    print("| params | nvme frac | tokens/s | step s | spread | peak RSS train GB | B/param | "
          "peak RSS process GB | B/param | host owners GB | unaccounted GB | disk GB (states/"
          "allocated) | CPU step s | fwd wait s | disk wait s | optimizer I/O GB/s | peak GPU GB |")  # fmt: skip
    print("|" + "---|" * 17)
    print(f"| {n / 1e9:.2f}B | {a.nvme_fraction:g} | {r['tokens_s']:,.0f} | {r['step_s']:.2f} | "
          f"{r['spread']:.2f} | {r['peak_rss'] / 1e9:.1f} | {r['peak_rss'] / n:.2f} | "
          f"{proc_peak / 1e9:.1f} | {proc_peak / n:.2f} | {hb.total / 1e9:.1f} | "
          f"{hb.unaccounted / 1e9:.1f} | {on_disk / 1e9:.1f}/{disk_alloc / 1e9:.1f} | "
          f"{r['cpu_step_s']:.2f} | {r['wait_s']:.2f} | {r['nvme_wait_s']:.2f} | {io or '-'} | "
          f"{r['peak_gpu'] / 1e9:.1f} |")  # fmt: skip
    print("\nhost bytes by owner after the last step (GeminiOptimizer.host_bytes):\n")
    print("```")
    print(hb.table())
    print("```")
    print("\nB/param by owner: " + ", ".join(
        f"{k} {hb.per_param(hb.owners[k]):.2f}" for k in HOST_OWNERS if hb.owners[k]
    ))  # fmt: skip
    print(f"final loss {r['loss']:.4f}")
    print("\n".join(throughput_and_floor(a, config, n, r, ddp, on_disk, compute)))
    opt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
