"""What the training benchmarks share: the GPT-2 XL-shaped model with
activation checkpointing, the timed loop, the plain-PyTorch and FSDP2 peers,
and the result table. Imported by zero_shard.py and gemini.py."""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import re
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from zerostack.shard import MachineProfile, step_floor
from zerostack.testing import GPTConfig, TinyGPT

HYPER = dict(lr=1e-4, weight_decay=0.1)
FLOPS_PER_TOKEN = [0.0]  # set by setup: 6N + 12 L d s (model FLOPs, recomputation not counted)
MACHINE: list[MachineProfile | None] = [None]  # set by setup from --machine


def fraction_arg(text: str) -> float | str:
    """``--gpu-update-fraction``: a number in [0, 1], or "auto"."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number in [0, 1] or 'auto' (got {text!r})") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a number in [0, 1] or 'auto' (got {text!r})")
    return value


def fraction_label(asked: float | str | None, chosen: float) -> str:
    """How a row names its gpu_update_fraction: the share, and "auto" when chosen so
    (asked None: the optimizer's default, "auto" for these rows)."""
    how = " (auto)" if asked == "auto" else " (default: auto)" if asked is None else ""
    return f"gpu_update_fraction={chosen:.3g}{how}"


def _rss_gb() -> float:
    """Resident memory of this process now (VmRSS), GB."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb * 1024 / 1e9


def setup(doc: str, only: str, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    """The benchmarks' common arguments, a one-rank NCCL group and the batch.

    Returns ``(args, (config, batch, steps, warmup))``, or None
    without a CUDA device (after saying so).
    """
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=48,
        help="gpt2 model: transformer blocks (default %(default)s, GPT-2 XL)",
    )
    ap.add_argument(
        "--dim", type=int, default=1600, help="gpt2 model: hidden size (default %(default)s)"
    )
    ap.add_argument(
        "--heads", type=int, default=25, help="gpt2 model: attention heads (default %(default)s)"
    )
    ap.add_argument(
        "--batch-size", type=int, default=8, help="sequences per step (default %(default)s)"
    )
    ap.add_argument(
        "--seq-len", type=int, default=1024, help="tokens per sequence (default %(default)s)"
    )
    ap.add_argument(
        "--steps", type=int, default=5, help="timed steps per configuration (default %(default)s)"
    )
    ap.add_argument(
        "--warmup", type=int, default=2, help="untimed steps first (default %(default)s)"
    )
    ap.add_argument(
        "--only",
        default=only,
        help="comma-separated configurations to run (default: all, %(default)s)",
    )
    ap.add_argument(
        "--model", choices=["gpt2", "llama"], default="gpt2",
        help="gpt2: TinyGPT of GPT-2 XL shape (--layers/--dim/--heads); llama: a transformers "
        "LLaMA of TinyLlama-1.1B shape (22 layers, hidden 2048, GQA 32/4 heads)",
    )  # fmt: skip
    ap.add_argument(
        "--repeat", type=int, default=1,
        help="run the whole set of configurations this many times in one process, interleaved",
    )  # fmt: skip
    ap.add_argument(
        "--switch-interval", type=float, default=None, metavar="SECONDS",
        help="sys.setswitchinterval: how long a thread may hold the GIL while another waits "
        "for it (Python's default 0.005); the CPU step's worker takes it between kernel calls",
    )  # fmt: skip
    ap.add_argument(
        "--machine", default=None, metavar="PROFILE.json",
        help="a MachineProfile written by benchmarks/machine.py: each offloaded row also prints "
        "its floor (zerostack.shard.step_floor) and achieved / floor",
    )  # fmt: skip
    if extra is not None:
        extra(ap)
    a = ap.parse_args()
    if a.machine is not None:
        MACHINE[0] = MachineProfile.load(a.machine)
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    print(f"[bench] GIL switch interval {sys.getswitchinterval()} s", file=sys.stderr, flush=True)
    KERNEL_CLOCK.install()
    if not torch.cuda.is_available():
        print(f"{os.path.basename(sys.argv[0])}: needs a CUDA device", file=sys.stderr)
        return None
    init_single_process()
    if a.model == "llama":
        config = llama_config(a.seq_len)
        with torch.device("meta"):
            n = sum(p.numel() for p in _llama(config).parameters())
        layers, dim = config.num_hidden_layers, config.hidden_size
    else:
        config = GPTConfig.gpt2_xl(
            num_layers=a.layers,
            dim=a.dim,
            num_heads=a.heads,
            max_seq_len=a.seq_len,
            tie_embeddings=True,
        )
        with torch.device("meta"):
            n = sum(p.numel() for p in TinyGPT(config).parameters())
        layers, dim = config.num_layers, config.dim
    FLOPS_PER_TOKEN[0] = 6 * n + 12 * layers * dim * a.seq_len
    print(f"[bench] model: {n / 1e9:.2f}B parameters", file=sys.stderr, flush=True)
    # Per rank: batch_size sequences of its own (rank 0's are the one-GPU batch).
    gen = torch.Generator().manual_seed(dist.get_rank())
    idx = torch.randint(0, config.vocab_size, (a.batch_size, a.seq_len), generator=gen)
    batch = (idx.cuda(), torch.roll(idx, -1, dims=1).cuda())
    return a, (config, batch, a.steps, a.warmup)


def describe(a) -> str:
    shape = (
        "transformers LLaMA of TinyLlama-1.1B shape (22 layers, hidden 2048, GQA 32/4 heads)"
        if a.model == "llama"
        else f"GPT-2 XL shape, {a.layers} layers, dim {a.dim}"
    )
    return (
        f"{shape}, batch {a.batch_size} x {a.seq_len}, bf16, activation checkpointing; median of "
        f"{a.steps} steps after {a.warmup}; spread = max/min step time over the timed steps; "
        "CPU step s and CPU-update wait s: means over the timed steps (the first step, which "
        f"creates the Adam states, is not in them); {a.repeat} run(s) in one process, interleaved"
    )


def llama_config(seq_len: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=max(2048, seq_len),
        tie_word_embeddings=False,
    )  # fmt: skip


class CausalLM(torch.nn.Module):
    """A transformers causal LM as ``model(idx, tgt) -> loss`` (what ``run`` calls)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        logits = self.hf(input_ids=idx).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())


def _llama(config) -> torch.nn.Module:
    import transformers

    hf = transformers.LlamaForCausalLM(config)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return CausalLM(hf)


def build_model(config, dtype: torch.dtype | None, device: str = "cuda") -> torch.nn.Module:
    """The benchmark's model with activation checkpointing: TinyGPT or LLaMA by ``config``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = _llama(config) if not isinstance(config, GPTConfig) else TinyGPT(config)
    if dtype is not None:
        model = model.to(dtype)
    return checkpoint_blocks(model) if isinstance(model, TinyGPT) else model


def init_single_process() -> None:
    """The NCCL group of torchrun's environment, or a one-rank one without it."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))


def checkpoint_blocks(model: TinyGPT) -> TinyGPT:
    for block in model.blocks:
        forward = block.forward
        block.forward = lambda x, forward=forward: checkpoint(forward, x, use_reentrant=False)
    return model


def build(config, dtype: torch.dtype, device: str = "cuda") -> torch.nn.Module:
    return build_model(config, dtype, device)


def torch_step(opt: torch.optim.Optimizer) -> Callable:
    """The step function of a plain torch optimizer for ``run``."""

    def step(loss, backward_only):
        if backward_only:
            loss.backward()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


class Offload(NamedTuple):
    """What ``run`` reads of an offloaded row's CPU step: ``pipeline`` (its
    CPU-step pipeline: ``update_s``, seconds of updates, and ``wait_s``,
    seconds the owner waited for them), ``settle`` (waits for the updates in
    flight) and ``disk_wait_s`` (seconds the updates waited for the disk)."""

    pipeline: Any
    settle: Callable[[], None]
    disk_wait_s: Callable[[], float] = lambda: 0.0


def _offload_counters(
    offload: Offload,
) -> tuple[float, float, float, tuple[float, int, int, float]]:
    p = offload.pipeline
    return p.update_s, p.wait_s, offload.disk_wait_s(), KERNEL_CLOCK.read()


def sync_compute() -> None:
    """Wait for the current CUDA stream (the compute stream) only."""
    torch.cuda.current_stream().synchronize()


def run(
    name, model, step_fn, batch, steps, warmup, autocast, offload: Offload | None = None
) -> dict:
    """Median step time, its forward, backward and optimizer step
    (synchronised between them), and the spread (max/min) of the step time.

    [Note: a step lasts from the end of the one before] A step's time is the
    wall time from the end of the step before (its last synchronize) to its
    own end, not the sum of its three phases. An offloaded ``step()`` returns
    once its updates are queued, and a worker thread goes on queueing the
    device lane's copies and kernels (see [Note: Adam where the bandwidth
    is] in zerostack.shard) after it: up to 2026-12-04 a synchronize before
    each forward, outside every phase, waited for that work and left it out
    of the step, so rows with a device lane were timed short (below their
    floor in some runs: 0.79x on one H200). There is no synchronize before
    the forward now, and nothing between two steps is left out: the
    allocator's counters read between the phases count too. The synchronize
    after ``step()`` waits for the compute stream only: the device lane's
    work, queued on the lane's own streams by its worker while ``step()``
    returns, lands in the next forward, which waits for it (its events) and
    synchronizes the device at its end, so each step holds one step's lane
    work. A device-wide synchronize there took a share of that work that
    depended on how far the worker had got (ZeRO-2 ``cpu_offload`` on an
    H200: ``step()`` 0.006-0.076 s, and the next forward shorter by as
    much), which moved time between two steps and made the spread 1.2-1.34
    around a steady median.

    With ``offload``, also the timed steps' means of its CPU step
    (``cpu_step_s``), of the owner's waits for it (``wait_s``: the
    forward's, and any in backward or ``step()``) and of its waits for the
    disk (``disk_wait_s``). [Note: timed CPU steps] The waits count from the
    first timed forward to the end of the last timed step; the updates from
    the first timed ``step()`` on, when every update of the warm-up is done
    (the forward and backward before it waited for the update of every
    parameter they used), to the updates of the last timed step, settled
    after the loop. So the first step, which also creates the Adam states
    (zero-filling their pages on the host), is not in them."""
    if steps < 1:
        raise ValueError(f"run: steps must be >= 1 (got {steps})")
    idx, tgt = batch
    fwd, fb, opt, marks = [], [], [], []
    torch.cuda.reset_peak_memory_stats()

    def retried() -> int:  # allocator retries so far (a cudaFree and a sync each)
        return torch.cuda.memory_stats_as_nested_dict().get("num_alloc_retries", 0)

    def device_calls() -> tuple[int, int]:  # the allocator's cudaMalloc and cudaFree calls so far
        stats = torch.cuda.memory_stats_as_nested_dict()
        return stats.get("num_device_alloc", 0), stats.get("num_device_free", 0)

    before: dict = {}  # the allocator's counters when the timed steps start
    probe = Probe() if os.environ.get(PROBE_ENV, "0") == "1" else None  # [Note: which side slowed]
    kernel_at_end = KERNEL_CLOCK.read()
    collecting = GC_CLOCK  # Python's garbage collections: a pause in any phase
    walls = []  # See [Note: a step lasts from the end of the one before]
    losses = []  # every step's, warm-up too, read after the loop (no sync inside it)
    torch.cuda.synchronize()
    end, cpu_at_end = time.perf_counter(), host_cpu()
    for i in range(warmup + steps):
        if i == warmup:
            before = torch.cuda.memory_stats()
            if offload is not None:
                at_forward = _offload_counters(offload)
            end = time.perf_counter()  # the reads above are no part of the first timed step
        d0, q0 = device_calls(), queued_s()
        r0, t0, c0 = retried(), time.perf_counter(), collecting.seconds
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(idx, tgt)
        torch.cuda.synchronize()
        tf = time.perf_counter()
        losses.append(loss.detach())
        last = i == warmup + steps - 1 and os.environ.get("ZEROSTACK_BENCH_MEMORY_SNAPSHOT")
        if last:  # recorded by measure: each stream's segments at the last step's peaks
            _print_segments(f"{name}, after the last forward", torch.cuda.memory._snapshot())
        probed = probe.mark() if probe is not None and i >= warmup else ""
        rf, tb = retried(), time.perf_counter()  # the allocator's counters read outside the phases
        step_fn(loss, backward_only=True)
        torch.cuda.synchronize()
        t1, q1, adam_in_bwd = time.perf_counter(), queued_s(), KERNEL_CLOCK.busy_since(tb)
        if last:
            _print_segments(f"{name}, after the last backward", torch.cuda.memory._snapshot())
        rb, to = retried(), time.perf_counter()
        if offload is not None and i == warmup:
            at_step = _offload_counters(offload)  # See [Note: timed CPU steps]
        step_fn(loss, backward_only=False)
        sync_compute()  # See [Note: a step lasts from the end of the one before]
        t2, ro, cpu = time.perf_counter(), retried(), host_cpu()
        d1, kernel = device_calls(), KERNEL_CLOCK.read()
        if i >= warmup:
            fwd.append(tf - t0)
            fb.append(tf - t0 + t1 - tb)
            opt.append(t2 - to)
            walls.append(t2 - end)
            retries = "f" * (rf - r0) + "b" * (rb - rf) + "o" * (ro - rb)
            paused = collecting.seconds - c0
            marks.append(
                (f"[retry {retries}]" if retries else "")
                + (f"[gc {paused * 1e3:.0f} ms]" if paused >= 1e-3 else "")
                + device_marks(d0, d1)
                + (f"[queued {(q1 - q0) * 1e3:.0f} ms]" if q1 - q0 >= 1e-3 else "")
                + (f"[adam in bwd {adam_in_bwd * 1e3:.0f} ms]" if adam_in_bwd >= 1e-3 else "")
                + host_marks(cpu_at_end, cpu, t2 - end)
                + adam_mark(kernel_at_end, kernel)
                + probed
            )
        end, cpu_at_end, kernel_at_end = t2, cpu, kernel
    timed = {}
    if offload is not None:  # before any profiled step below adds to the counters
        wait_s = offload.pipeline.wait_s  # settle() below waits too, outside every timed step
        offload.settle()
        update_s, _, disk_s, kernel = _offload_counters(offload)
        timed = dict(
            cpu_step_s=(update_s - at_step[0]) / steps,
            wait_s=(wait_s - at_forward[1]) / steps,
            disk_wait_s=(disk_s - at_step[2]) / steps,
            cpu_kernel=tuple((k - k0) / steps for k, k0 in zip(kernel, at_step[3], strict=True)),
        )
    profiled = os.environ.get("ZEROSTACK_BENCH_PROFILE", "0")  # 1: three steps; N > 1: N
    if profiled.isdigit() and int(profiled) > 0:
        _profile(name, model, step_fn, idx, tgt, autocast, 3 if profiled == "1" else int(profiled))
    host = os.environ.get("ZEROSTACK_BENCH_HOST_PROFILE", "0")  # N steps under cProfile
    if host.isdigit() and int(host) > 0:
        _host_profile(name, model, step_fn, idx, tgt, autocast, int(host))
    return dict(
        name=name,
        tflops=FLOPS_PER_TOKEN[0] * idx.numel() / statistics.median(walls) / 1e12,
        rss_gb=_rss_gb(),
        alloc_retries=_counted(before, "num_alloc_retries"),
        tokens_s=idx.numel() / statistics.median(walls),
        step_s=statistics.median(walls),
        spread=max(walls) / min(walls),
        steps_s=[
            (round(f, 3), round(b - f, 3), round(o, 3), round(w, 3), m)
            for f, b, o, w, m in zip(fwd, fb, opt, walls, marks, strict=True)
        ],
        fwd_s=statistics.median(fwd),
        fwd_bwd_s=statistics.median(fb),
        opt_s=statistics.median(opt),
        peak_gb=torch.cuda.max_memory_allocated() / 1e9,
        peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9,
        device_allocs=_counted(before, "num_device_alloc"),
        device_frees=_counted(before, "num_device_free"),
        loss=loss.item(),
        losses=[float(x) for x in losses],
        **timed,
    )


def host_cpu() -> tuple[float, float, float] | None:
    """Seconds of CPU time so far: the host's stolen by the hypervisor (the
    "steal" of /proc/stat), the host's busy, and this process's (all its
    threads); None where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    tick = os.sysconf("SC_CLK_TCK")
    ours = os.times()
    return steal / tick, (user + nice + system + irq + softirq) / tick, ours.user + ours.system


def queued_s() -> float:
    """Seconds this thread has waited, runnable, for a core (the second field
    of Linux's /proc/thread-self/schedstat); 0.0 where it cannot be read.
    The per-step lines print the training thread's wait over the forward and
    backward as ``[queued N ms]`` (1 ms or more): the thread that launches
    the kernels, kept from a core by other runnable threads (CPU Adam's)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def host_marks(before, after, wall: float) -> str:
    """``[steal N%]`` where the hypervisor took 1% or more of the host's
    cores over a step of ``wall`` seconds, and ``[others N%]`` where CPU time
    outside this process (other processes, the kernel's interrupts) took 2%
    or more: a step slowed by a host that was slow for reasons of its own.
    Either only when it is 5 clock ticks or more (the counters' resolution)."""
    if before is None or after is None or wall <= 0:
        return ""
    least = 5 / os.sysconf("SC_CLK_TCK")
    room = (os.cpu_count() or 1) * wall
    steal = after[0] - before[0]
    others = (after[1] - before[1]) - (after[2] - before[2])
    return (f"[steal {steal / room:.0%}]" if steal >= max(least, 0.01 * room) else "") + (
        f"[others {others / room:.0%}]" if others >= max(least, 0.02 * room) else ""
    )


def device_marks(before: tuple[int, int], after: tuple[int, int]) -> str:
    """``[cudaMalloc N]`` and ``[cudaFree N]``: the caching allocator's calls
    into the driver over a step, each only where there were some. A
    ``cudaFree`` synchronizes the device, and both take the host
    milliseconds: a step that makes them is a candidate for a slow backward
    with no CPU time lost elsewhere (docs/benchmarks.md, "twenty-second
    session": LLaMA's slow stretches, whose hosts also free blocks in every
    capped step)."""
    allocs, frees = after[0] - before[0], after[1] - before[1]
    return (f"[cudaMalloc {allocs}]" if allocs else "") + (f"[cudaFree {frees}]" if frees else "")


PROBE_ENV = "ZEROSTACK_BENCH_PROBE"


class Probe:
    """[Note: which side slowed] ``ZEROSTACK_BENCH_PROBE=1``: after each timed
    forward (its synchronize, before the backward starts), the same small
    piece of work on each side, timed: a pure-Python loop on the training
    thread (the host thread that launches the backward's kernels) and 16
    bf16 matmuls of 2048 x 2048 on the compute stream (CUDA events). A slow
    backward whose host probe is slow too had a slower host thread (a core
    taken, a lower clock); one whose device probe is slow had a slower GPU
    (its clock lowered, for power or heat); one with neither, neither. The
    per-step lines print both as ``[probe host X gpu Y ms]``. About 1.5 ms a
    step, inside the timed step, and 24 MB on the device (allocated before
    the row's warm-up, so placed around): off unless asked for."""

    def __init__(self) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        self.a, self.b = (
            torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2)
        )
        self.out = torch.empty_like(self.a)
        self.start, self.stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))

    @staticmethod
    def host_ms() -> float:
        t0 = time.perf_counter()
        x = 0
        for i in range(20_000):
            x += i * i
        return (time.perf_counter() - t0) * 1e3

    def gpu_ms(self) -> float:
        self.start.record()
        for _ in range(16):
            torch.mm(self.a, self.b, out=self.out)
        self.stop.record()
        self.stop.synchronize()
        return self.start.elapsed_time(self.stop)

    def mark(self) -> str:
        return f"[probe host {self.host_ms():.2f} gpu {self.gpu_ms():.2f} ms]"


class PhaseSpans:
    """[Note: phases on the device's timeline] Where a step's time went with
    no synchronize between its phases (benchmarks/scale.py's loop has none:
    one would move work between them): CUDA events on the compute stream at
    the step's start (``begin``) and after each phase (``after``), read once
    the step's boundary has waited for that stream (``line``). Each span is
    the time between two events on the device's timeline, so a forward that
    waits on the host for the optimizer's updates counts its waits (the
    device idles through them), and a span says which phase a slow step
    lost its time in."""

    def __init__(self, names: tuple[str, ...] = ("fwd", "bwd", "opt")) -> None:
        self.names = names
        self.events: list[Any] = []

    def begin(self) -> None:
        self.events = []
        self.after()

    def after(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)

    def line(self) -> str:
        """`` [fwd X bwd Y opt Z s]``, after the step's boundary (the events
        have happened); empty unless every phase was marked."""
        if len(self.events) != len(self.names) + 1:
            return ""
        ends = zip(self.events[:-1], self.events[1:], strict=True)
        spans = [a.elapsed_time(b) / 1e3 for a, b in ends]
        return (
            " [" + " ".join(f"{n} {t:.2f}" for n, t in zip(self.names, spans, strict=True)) + " s]"
        )


def adam_mark(before: tuple[float, int, int, float], after: tuple[float, int, int, float]) -> str:
    """``[adam N GB/s]``: CPU Adam's kernel over the calls that ended in a
    step (``_KernelClock``'s counters before and after it), at 28 B per
    element: the host's memory bandwidth as the optimizer got it in that
    step, where one ran. The CPU step of step k runs in step k+1's forward,
    so this reads beside the next step's forward."""
    seconds, elements = after[0] - before[0], after[2] - before[2]
    if seconds <= 0 or elements <= 0:
        return ""
    return f"[adam {elements * 28 / seconds / 1e9:.0f} GB/s]"


class _GcClock:
    """A ``gc.callbacks`` entry: seconds Python's garbage collector ran, summed."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


GC_CLOCK = _GcClock()  # registered once: a row that raises leaves nothing behind
gc.callbacks.append(GC_CLOCK)


class _KernelClock:
    """CPU Adam's compiled ``adam_step``, timed: seconds inside it, calls and
    elements, summed; and the seconds the CPU-step worker spent in
    ``torch.cuda.Event.synchronize``. The CPU step (``update_s``) also holds
    the Python around each call (setting ``.grad``, the inner optimizer's
    pass over its parameters, the copy-out) and any wait for the GIL; the
    difference says how much of the CPU step is neither the kernel nor an
    event. Wrappers on the module the launcher calls
    (``zerostack.fused_adam._kernels._cpu``) and on the event's method:
    about a microsecond a call."""

    def __init__(self) -> None:
        self.seconds, self.calls, self.elements, self.event_s = 0.0, 0, 0, 0.0
        self.running = 0  # calls in flight
        self.last_end = 0.0  # perf_counter when the last call ended
        self._module: Any = None
        self.traced = False  # each call in a ``cpu_adam::kernel`` range (a traced profile)

    def install(self) -> None:
        try:
            from zerostack.fused_adam import _kernels
        except ImportError:
            return
        if _kernels._cpu is None or isinstance(_kernels._cpu, _KernelClock):
            return
        self._module, _kernels._cpu = _kernels._cpu, self
        synchronize = torch.cuda.Event.synchronize

        def timed_synchronize(event: torch.cuda.Event) -> None:
            if not threading.current_thread().name.startswith("zerostack-cpu-step"):
                return synchronize(event)
            t0 = time.perf_counter()
            try:
                return synchronize(event)
            finally:
                self.event_s += time.perf_counter() - t0

        torch.cuda.Event.synchronize = timed_synchronize  # type: ignore[method-assign]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)

    def adam_step(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        self.running += 1
        try:
            if self.traced:
                with torch.profiler.record_function("cpu_adam::kernel"):
                    return self._module.adam_step(*args, **kwargs)
            return self._module.adam_step(*args, **kwargs)
        finally:
            self.last_end = time.perf_counter()
            self.running -= 1
            self.seconds += self.last_end - t0
            self.calls += 1
            self.elements += sum(kwargs.get("numels", args[5] if len(args) > 5 else ()))

    def read(self) -> tuple[float, int, int, float]:
        return self.seconds, self.calls, self.elements, self.event_s

    def busy_since(self, start: float) -> float:
        """Seconds from ``start`` to now that CPU Adam kept working: all of
        them while a call is in flight, else until its last call ended."""
        now = time.perf_counter()
        return max(0.0, (now if self.running else min(self.last_end, now)) - start)


KERNEL_CLOCK = _KernelClock()


def _counted(before: dict, key: str) -> int:
    """How much the CUDA allocator's counter ``key`` grew since ``before``
    (its memory_stats): retries, cudaMalloc/cudaFree calls (or maps and
    unmaps of expandable segments)."""
    return torch.cuda.memory_stats().get(key, 0) - before.get(key, 0)


def _profile(name, model, step_fn, idx, tgt, autocast, steps: int = 3) -> None:
    """More steps under torch.profiler: where host and device time goes,
    over all of them and phase by phase (synchronised between phases)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    trace = os.environ.get("ZEROSTACK_BENCH_TRACE")  # PREFIX: PREFIX.NAME.json.gz per row
    config = None
    enabled = torch._C._autograd._profiler_enabled
    if trace:  # the CPU-step worker's phases and CPU Adam's kernel calls too
        from torch._C._profiler import _ExperimentalConfig

        config = _ExperimentalConfig(profile_all_threads=True)
        KERNEL_CLOCK.traced = True
        # zerostack.chunk.phase asks whether a profiler runs on its own thread,
        # which says no on the worker: yes everywhere while this runs.
        torch._C._autograd._profiler_enabled = lambda: True
    try:
        with profile(activities=acts, experimental_config=config) as prof:
            _profiled_steps(model, step_fn, idx, tgt, autocast, steps, record_function)
    finally:
        torch._C._autograd._profiler_enabled = enabled
        KERNEL_CLOCK.traced = False
    print(f"\n[profile] {name}: {steps} steps", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22), flush=True)
    events = prof.events()
    print(f"[profile] {name}: {device_time(events)}", flush=True)
    for line in phase_times(events) + copy_streams(events):
        print(f"[profile] {name}: {line}", flush=True)
    if trace:  # a Chrome trace of the profiled steps (chrome://tracing, ui.perfetto.dev)
        path = f"{trace}.{re.sub(r'[^A-Za-z0-9]+', '_', name)[:40]}.json.gz"
        prof.export_chrome_trace(path)
        print(f"[profile] {name}: trace in {path}", flush=True)


def _profiled_steps(model, step_fn, idx, tgt, autocast, steps: int, record_function) -> None:
    """``steps`` training steps, each phase in a ``bench::`` range and synchronised."""
    for _ in range(steps):
        torch.cuda.synchronize()
        with record_function("bench::forward"):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(idx, tgt)
            torch.cuda.synchronize()
        with record_function("bench::backward"):
            step_fn(loss, backward_only=True)
            torch.cuda.synchronize()
        with record_function("bench::step"):
            step_fn(loss, backward_only=False)
            torch.cuda.synchronize()


def _host_profile(name, model, step_fn, idx, tgt, autocast, steps: int) -> None:
    """More steps whose forward and backward run under cProfile, one profile
    each: the Python functions that hold the host while the device waits for
    launches (a phase under cProfile is slower than without it; the phases'
    own times are printed)."""
    import cProfile
    import io
    import pstats

    profs = {"forward": cProfile.Profile(), "backward": cProfile.Profile()}
    walls: dict[str, list[float]] = {k: [] for k in profs}

    def timed(phase: str, fn: Callable[[], Any]) -> Any:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        profs[phase].enable()
        out = fn()
        profs[phase].disable()
        torch.cuda.synchronize()
        walls[phase].append(time.perf_counter() - t0)
        return out

    def forward() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return model(idx, tgt)

    for _ in range(steps):
        loss = timed("forward", forward)
        timed("backward", functools.partial(step_fn, loss, backward_only=True))
        step_fn(loss, backward_only=False)
        torch.cuda.synchronize()
    for phase, prof in profs.items():
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
        stats.print_stats(18)
        stats.sort_stats("cumulative").print_stats("zerostack", 18)
        print(f"\n[host-profile] {name}: {steps} {phase}s under cProfile, wall "
              f"{' '.join(f'{w:.3f}' for w in walls[phase])} s", flush=True)  # fmt: skip
        print(text.getvalue(), flush=True)


def _where(frames: list[dict], keep: int = 4) -> str:
    """The innermost ``keep`` frames of ours (zerostack, benchmarks) of a stack."""
    ours = [f for f in frames if "zerostack" in f["filename"] or "benchmarks" in f["filename"]]
    return " <- ".join(
        f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in ours[:keep]
    )


def _print_segments(when: str, snap: dict, compute: int | None = None) -> None:
    """Each stream's segments: reserved and allocated GB, and (for the side
    streams: their free blocks are kept for their stream alone) where their
    three largest blocks were allocated."""
    by_stream: dict[int, list[dict]] = {}
    for seg in snap["segments"]:
        by_stream.setdefault(seg["stream"], []).append(seg)
    parts = []
    for stream, segs in sorted(by_stream.items()):
        total = sum(s["total_size"] for s in segs) / 1e9
        used = sum(s["allocated_size"] for s in segs) / 1e9
        parts.append(f"stream {stream}: {total:.2f} GB reserved, {used:.2f} allocated")
    compute = torch.cuda.current_stream().cuda_stream if compute is None else compute
    print(f"[memory] {when} (compute stream {compute}): " + "; ".join(parts), flush=True)
    for stream, segs in sorted(by_stream.items()):
        if stream == compute:
            continue
        blocks = sorted((b for s in segs for b in s["blocks"]), key=lambda b: -b["size"])[:3]
        for b in blocks:
            print(f"[memory]   stream {stream} block {b['size'] / 1e6:.1f} MB {b['state']}: "
                  f"{_where(b.get('frames', []))}", flush=True)  # fmt: skip


def _print_retries(snap: dict, device: int | None = None) -> None:
    """Each run of segments freed in the trace (the allocator's cached blocks
    given back for an allocation that would pass the cap), and that allocation."""
    trace = snap["device_traces"][torch.cuda.current_device() if device is None else device]
    freed = 0
    for entry in trace:
        if entry["action"] in ("segment_free", "segment_unmap"):
            freed += entry["size"]
        elif entry["action"] == "alloc" and freed:
            print(f"[memory] retry: {freed / 1e9:.2f} GB of cached blocks freed for "
                  f"{entry['size'] / 1e6:.1f} MB on stream {entry['stream']}: "
                  f"{_where(entry.get('frames', []), 8)}", flush=True)  # fmt: skip
            freed = 0


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping (start, end) spans merged, in order."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Time in both of two merged span lists."""
    total, j = 0.0, 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k = j
        while k < len(y) and y[k][0] < b:
            total += min(b, y[k][1]) - max(a, y[k][0])
            k += 1
    return total


def _device_spans(events) -> dict[str, list[tuple[float, float]]]:
    """The device's work in a torch.profiler trace, in seconds: kernels,
    copies host to device ("h2d") and device to host ("d2h"), and each
    stream's work ("stream N")."""
    spans: dict[str, list[tuple[float, float]]] = {"kernel": [], "h2d": [], "d2h": []}
    for e in events:
        # A record_function range (zerostack::step) also shows as a device
        # event spanning its kernels: it is no work of its own.
        if str(e.device_type) != "DeviceType.CUDA" or e.is_user_annotation:
            continue
        kind = "h2d" if "HtoD" in e.name else "d2h" if "DtoH" in e.name else "kernel"
        span = (e.time_range.start / 1e6, e.time_range.end / 1e6)
        spans[kind].append(span)
        spans.setdefault(f"stream {e.device_resource_id}", []).append(span)
    return spans


def _clipped(spans: list[tuple[float, float]], a: float, b: float) -> list[tuple[float, float]]:
    return [(max(x, a), min(y, b)) for x, y in spans if y > a and x < b]


def phase_times(events) -> list[str]:
    """One line per ``bench::`` phase of a torch.profiler trace: its wall
    time, the device's kernel time in it, the busiest stream's work, its
    copies, and how long the device did nothing. A phase whose device sat
    idle waited on the host; one whose kernels grew ran slower kernels."""
    spans = {k: _union(v) for k, v in _device_spans(events).items()}
    busy = _union([s for k in ("kernel", "h2d", "d2h") for s in spans[k]])
    streams = [k for k in spans if k.startswith("stream ")]
    lines = []
    phases = sorted(
        (e.time_range.start / 1e6, e.time_range.end / 1e6, e.name)
        for e in events
        if e.name.startswith("bench::") and str(e.device_type) == "DeviceType.CPU"
    )
    for count, (a, b, label) in enumerate(phases):
        kernel = _length(_clipped(spans["kernel"], a, b))
        per_stream = {k: _length(_clipped(spans[k], a, b)) for k in streams}
        top = max(per_stream, key=lambda k: per_stream[k], default="no stream")
        copies = [_length(_clipped(spans[k], a, b)) for k in ("h2d", "d2h")]
        idle = (b - a) - _length(_clipped(busy, a, b))
        lines.append(
            f"step {count // 3} {label[7:]}: {b - a:.3f} s; kernels {kernel:.3f} s ({top} "
            f"{per_stream.get(top, 0.0):.3f} s), H2D {copies[0]:.3f} s, D2H {copies[1]:.3f} s, "
            f"device idle {idle:.3f} s"
        )
    return lines


def copy_streams(events) -> list[str]:
    """Each stream's copies in a torch.profiler trace (host to device and
    device to host, seconds and how many), then, each way, how long copies
    of two or more streams ran at once. Copies of two streams that never
    overlap in time took turns on one copy engine: a short copy queued
    behind a long one waited for it whole (a forward's gather behind the
    device lane's chunk of master and moments); ones that overlap shared
    the link."""
    per: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for e in events:
        if str(e.device_type) != "DeviceType.CUDA" or e.is_user_annotation:
            continue
        way = "h2d" if "HtoD" in e.name else "d2h" if "DtoH" in e.name else None
        if way is not None:
            span = (e.time_range.start / 1e6, e.time_range.end / 1e6)
            per.setdefault((way, e.device_resource_id), []).append(span)
    lines = []
    for (way, stream), spans in sorted(per.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        copies = _count(len(spans), "copy", "copies")
        lines.append(f"stream {stream}: {way.upper()} {_length(_union(spans)):.3f} s ({copies})")
    for way in ("h2d", "d2h"):
        merged = [_union(v) for (w, _), v in per.items() if w == way]
        if not merged:
            continue
        edges = sorted((t, d) for spans in merged for a, b in spans for t, d in ((a, 1), (b, -1)))
        at_once, running, since = 0.0, 0, 0.0
        for t, d in edges:
            if running >= 2:
                at_once += t - since
            running, since = running + d, t
        total = _length(_union([s for spans in merged for s in spans]))
        lines.append(
            f"{way.upper()} of two or more streams at once: {at_once:.3f} s of the {total:.3f} s "
            f"some {way.upper()} copy ran ({_count(len(merged), 'stream', 'streams')})"
        )
    return lines


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def device_time(events) -> str:
    """Where the GPU's time went in a torch.profiler trace (its events):
    kernels, copies host to device and device to host (and how much of each
    ran beside no kernel), idle, over the span from the first device event
    to the last; one line for a log."""
    spans = _device_spans(events)
    streams = {k for k in spans if k.startswith("stream ")}
    spans = {k: spans[k] for k in ("kernel", "h2d", "d2h")}
    if not any(spans.values()):
        return "no device events"
    merged = {k: _union(v) for k, v in spans.items()}
    busy = _union([s for v in spans.values() for s in v])
    wall = busy[-1][1] - busy[0][0]
    kernel = _length(merged["kernel"])
    parts = [f"device span {wall:.3f} s: kernels {kernel:.3f} s ({kernel / wall:.0%})"]
    for way in ("h2d", "d2h"):
        t = _length(merged[way])
        alone = t - _overlap(merged[way], merged["kernel"])
        parts.append(f"{way.upper()} {t:.3f} s ({alone:.3f} s beside no kernel)")
    parts.append(f"idle {wall - _length(busy):.3f} s; {len(streams)} streams")
    return ", ".join(parts)


def plain(config, batch, steps, warmup) -> dict:
    model = build(config, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    label = "plain PyTorch (fp32 params, bf16 autocast, fused AdamW)"
    return run(label, model, torch_step(opt), batch, steps, warmup, True)


def fsdp2_offload(config, batch, steps, warmup) -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = build(config, torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks if isinstance(model, TinyGPT) else model.hf.model.layers:
        fully_shard(block, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    label = "FSDP2 + CPUOffloadPolicy (torch fused AdamW on CPU)"
    return run(label, model, torch_step(opt), batch, steps, warmup, False)


def measure(
    results: list[dict], wanted: list[str], name: str, fn: Callable[[], dict], run: int = 0
) -> None:
    """Run one configuration if asked for; an OOM becomes a row, not a crash."""
    if name not in wanted:
        return
    left = torch.cuda.memory_allocated() / 1e9
    print(f"[bench] {name} ... ({left:.2f} GB still allocated)", file=sys.stderr, flush=True)
    # ZEROSTACK_BENCH_MEMORY_SNAPSHOT=PREFIX: each row leaves the CUDA caching
    # allocator's history (up to its end or its OOM) in PREFIX.NAME.RUN.pickle,
    # for https://pytorch.org/memory_viz or torch.cuda.memory's tools, and
    # prints each stream's segments after the last forward and backward and
    # the allocations that made the allocator free its cached blocks.
    snapshot = os.environ.get("ZEROSTACK_BENCH_MEMORY_SNAPSHOT")
    if snapshot:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=100_000)
    try:
        results.append(dict(fn(), run=run, key=name))
    except torch.OutOfMemoryError as exc:
        print(f"[bench] {name}: {exc}", file=sys.stderr, flush=True)
        results.append(
            dict(name=name, run=run, key=name, error=f"OOM: {str(exc).splitlines()[0][:80]}")
        )
    except Exception as exc:  # one broken configuration must not hide the others
        traceback.print_exc()
        results.append(
            dict(name=name, run=run, key=name, error=f"{type(exc).__name__}: {str(exc)[:80]}")
        )
    if snapshot:
        _print_retries(torch.cuda.memory._snapshot())
        torch.cuda.memory._dump_snapshot(f"{snapshot}.{name}.{run}.pickle")
        torch.cuda.memory._record_memory_history(enabled=None)
    gc.collect()
    torch.cuda.empty_cache()


def print_table(
    title: str,
    results: list[dict],
    setup: str,
    peer: str = "FSDP2 + CPUOffloadPolicy",
    peer_label: str = "FSDP2 offload",
) -> None:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n## {title}\n")
    print(f"- date: {date}; command: `python {' '.join(sys.argv)}`")
    print(
        f"- GPU {torch.cuda.get_device_name()}, {os.cpu_count()} host cores, torch {torch.__version__}"
    )
    print(f"- {setup}\n")
    ok = [r for r in results if "error" not in r]
    print(
        f"| run | configuration | tokens/s | TFLOPS | vs plain | vs {peer_label} | step s | spread | "
        "fwd s | fwd+bwd s | optimizer s | CPU-update wait s | CPU step s | peak GPU GB | "
        "host RSS GB | alloc retries |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        run_no = r.get("run", 0)
        if "error" in r:
            print(f"| {run_no} | {r['name']} | {r['error']} | | | | | | | | | | | | | |")
            continue
        same = [o for o in ok if o.get("run", 0) == run_no]
        plain_r = next((o for o in same if o["name"].startswith("plain")), None)
        fsdp_r = next((o for o in same if o["name"].startswith(peer)), None)
        vp = f"{r['tokens_s'] / plain_r['tokens_s']:.2f}x" if plain_r else "n/a"
        vf = f"{r['tokens_s'] / fsdp_r['tokens_s']:.2f}x" if fsdp_r else "n/a"
        wait = f"{r['wait_s']:.3f}" if "wait_s" in r else ""
        cpu = f"{r['cpu_step_s']:.3f}" if "cpu_step_s" in r else ""
        print(f"| {run_no} | {r['name']} | {r['tokens_s']:,.0f} | {r['tflops']:.0f} | {vp} | {vf} | "
              f"{r['step_s']:.3f} | {r['spread']:.3f} | {r['fwd_s']:.3f} | {r['fwd_bwd_s']:.3f} | "
              f"{r['opt_s']:.3f} | {wait} | {cpu} | {r['peak_gb']:.1f} | {r['rss_gb']:.1f} | "
              f"{r['alloc_retries']} |")  # fmt: skip
    if MACHINE[0] is not None:
        print_floors(results, MACHINE[0])
    print(
        "\nper-step (forward, backward, optimizer = the step's wall time, which also holds what "
        "runs between the phases) seconds, with the phases in which the CUDA "
        "allocator retried ([retry f|b|o]: forward, backward, optimizer) and the time Python's "
        "garbage collector paused it ([gc N ms], when 1 ms or more), the allocator's calls "
        "into the driver ([cudaMalloc N], [cudaFree N], where there were some), the share of the host's "
        "cores that the hypervisor took ([steal N%], 1% or more) and that CPU time outside this "
        "process took ([others N%], 2% or more), CPU Adam's kernel over the calls that ended in "
        "the step ([adam N GB/s] at 28 B an element), with ZEROSTACK_BENCH_PROBE=1 the same "
        "small work timed after the forward on the host thread and the GPU ([probe host X gpu "
        "Y ms]), every step's loss "
        "(the warm-up's too), "
        "the peak of the allocator's reserved memory and its device allocations and frees:"
    )
    for r in ok:
        steps = " ".join(f"{f:.3f}/{b:.3f}/{o:.3f}={w:.3f}{m}" for f, b, o, w, m in r["steps_s"])
        print(
            f"- run {r.get('run', 0)}, {r['name'][:60]}: {steps}; losses "
            f"{' '.join(f'{x:.6f}' for x in r['losses'])}; "
            f"reserved {r['peak_reserved_gb']:.1f} GB at most; {r['device_allocs']} device "
            f"allocations and {r['device_frees']} frees over the timed steps" + _kernel_line(r)
        )


def _kernel_line(r: dict) -> str:
    """A row's CPU Adam kernel a step (see ``_KernelClock``), beside its CPU step."""
    if not r.get("cpu_kernel") or not r["cpu_kernel"][1]:
        return ""
    seconds, calls, elements, event_s = r["cpu_kernel"]
    return (
        f"; CPU Adam kernel {seconds:.3f} s and the worker's event waits {event_s:.3f} s of the "
        f"CPU step's {r['cpu_step_s']:.3f} s a step, "
        f"{calls:.1f} calls, {elements / 1e9:.3f} G elements ({elements / seconds / 1e9:.2f} G "
        f"elements/s, {28 * elements / seconds / 1e9:.1f} GB/s at 28 B each)"
    )


MOVED = (
    "host_numel",
    "gpu_numel",
    "h2d_bytes_per_param",
    "d2h_bytes_per_param",
    "streamed_bytes",
    "host_value_fraction",
)


# The rows whose forward and backward may give an offloaded row's compute
# terms: the same system all on the GPU (bf16 parameters, as the offloaded
# rows compute; ZeRO-2's backward also packs and reduces its buckets) and
# plain PyTorch (fp32 parameters under bf16 autocast), keyed by the rows'
# first word; the faster of them is taken, so the floor stays a lower bound.
ALL_ON_GPU = {"gemini": "gemini_gpu", "zero2": "zero2"}


def compute_row(row: dict, results: list[dict]) -> dict | None:
    """The row of ``row``'s run that gives its floor's forward and backward:
    of ``ALL_ON_GPU``'s for its system and plain's, whichever ran (without
    error) and has the shorter forward plus backward; None if neither."""
    same = [o for o in results if o.get("run", 0) == row.get("run", 0) and "error" not in o]
    wanted = ALL_ON_GPU.get(row.get("key", "").split("_")[0])
    candidates = [
        o for o in same
        if (wanted and o.get("key") == wanted) or o.get("key", o["name"]).startswith("plain")
    ]  # fmt: skip
    return min(candidates, key=lambda o: o["fwd_bwd_s"], default=None)


def floor_of(row: dict, compute: dict | None, profile: MachineProfile) -> dict | str:
    """The floor of an offloaded row (one with ``host_numel``) from the
    forward and backward of ``compute`` (``compute_row``'s), or why there is
    none. See [Note: step-time floor] in zero-shard's ``_step_model.py``."""
    if compute is None:
        return "n/a (no row all on the GPU in this run: add plain, gemini_gpu or zero2)"
    disk = row.get("disk_bytes", 0)
    moved = {k: row[k] for k in MOVED if k in row}  # GeminiDDP.step_amounts(), or host_numel
    try:
        est = step_floor(
            profile, forward_s=compute["fwd_s"],
            backward_s=compute["fwd_bwd_s"] - compute["fwd_s"], disk_read_bytes=disk,
            disk_write_bytes=disk, **moved,
        )  # fmt: skip
    except ValueError as exc:  # a figure the profile lacks: the row says which
        return f"n/a ({exc})"
    return dict(
        floor_s=est.floor_s,
        cpu_only_s=est.cpu_only.step_s,
        split_s=est.split.step_s if est.split is not None else None,
        gpu_fraction=est.split.gpu_fraction if est.split is not None else None,
        bound=est.best.bound,
        achieved=row["step_s"] / est.floor_s,
        compute=compute.get("key", compute["name"]),
    )


def print_floors(results: list[dict], profile: MachineProfile) -> None:
    """A second table: each offloaded row's floor from the machine's profile."""
    print(f"\nfloors from the machine's profile ({profile.machine}); forward and backward from")
    print("the row of the same run named in the table (the faster of plain PyTorch and the same")
    print("system all on the GPU); every resource at once, updates after the global norm,")
    print("hidden behind the whole next forward (zerostack.shard.step_floor):\n")
    print("| run | configuration | host-held params | forward and backward of | floor s | "
          "achieved / floor | CPU-only floor s | split floor s | GPU share of host updates | "
          "bound | CPU Adam GB/s: this run, the profile's alone, beside copies |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    beside = profile.cpu_adam_with_copies_bytes_s
    rates = f"{profile.cpu_adam_bytes_s / 1e9:.0f}, " + (
        "n/a" if beside is None else f"{beside / 1e9:.0f}"
    )
    for r in results:
        if "error" in r or "host_numel" not in r:
            continue
        f = floor_of(r, compute_row(r, results), profile)
        head = f"| {r.get('run', 0)} | {r['name']} | {r['host_numel'] / 1e9:.3f}B |"
        if isinstance(f, str):
            print(f"{head} {f} | | | | | | | |")
            continue
        split = "n/a" if f["split_s"] is None else f"{f['split_s']:.3f}"
        share = "n/a" if f["gpu_fraction"] is None else f"{f['gpu_fraction']:.2f}"
        print(f"{head} {f['compute']} | {f['floor_s']:.3f} | {f['achieved']:.2f}x | "
              f"{f['cpu_only_s']:.3f} | {split} | {share} | {f['bound']} | "
              f"{_run_adam_rate(r)}, {rates} |")  # fmt: skip


def _run_adam_rate(r: dict) -> str:
    """The row's CPU Adam kernel rate over its timed steps at 28 B an
    element, in GB/s: beside the profile's, it says whether the host gave
    this run the memory bandwidth its floor assumes (a host shared with other
    work can give much less, or more, than when the profile was measured)."""
    kernel = r.get("cpu_kernel")
    if not kernel or kernel[0] <= 0:
        return "n/a"
    return f"{28 * kernel[2] / kernel[0] / 1e9:.0f}"
