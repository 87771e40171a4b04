"""Adam step throughput: zerostack.fused_adam against torch.optim.AdamW, same run.

What is measured, per device (CPU always, CUDA when present):

* fp32: one ``step()`` over N fp32 params split into a few large tensors, for
  ours (``CPUAdam`` / ``FusedAdam``) and torch's ``AdamW(fused=True)`` and
  ``AdamW(foreach=True)``, with the same tensors and hyperparameters (AdamW,
  lr=1e-3, weight_decay=0.01). The key column is the speed against torch fused.
* bf16 params + fp32 master: ours steps the fp32 master with the bf16 grad and
  writes the bf16 model param in the same pass (``set_copy_out``). The peer is
  what a user writes with torch: cast the bf16 grad into an fp32 grad buffer
  (preallocated, so no allocator cost), fused AdamW on the master, then
  ``model_param.copy_(master)``. All three passes are timed.
* Memory bandwidth: ``dst.copy_(src)`` (2 streams) and ``torch.add(a, b,
  alpha=s, out=c)`` (3 streams) on the CPU, a device-to-device copy on the GPU.
  Adam's moved GB/s is then given as a % of that bandwidth.

The floor: an fp32 Adam step reads p, g, m, v and writes p, m, v, 28 bytes per
param, so "GB/s @28B" = params/s * 28 is comparable across all rows. The
mixed-precision rows also show the bytes they actually move (ours: 28 B, the
bf16 grad read and bf16 copy-out balance out; the torch peer: 40 B, with its
cast and copy passes). Tensors are filled with a repeated random block
(params ~0.02, grads ~1e-3; no NaNs or denormals): throughput does not depend
on the values, and filling gigabytes with randn would dominate the run.

Timing: ``--warmup`` steps, then the median of ``--repeats`` steps (CPU:
perf_counter; GPU: CUDA events around each step). Threads: torch's (the CPU
kernel follows torch.get_num_threads()).

Run:
    python benchmarks/adam.py                      # CPU 256M + GPU 1B params
    python benchmarks/adam.py --device cpu --cpu-params 16M --repeats 3
    python benchmarks/adam.py --smoke              # tiny sizes, seconds
    python benchmarks/adam.py --json results.json  # also write every figure
The markdown table printed last can be pasted into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

from zerostack.fused_adam import CPUAdam, FusedAdam, backend_info

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)  # AdamW for all
FLOOR = 28  # bytes/param of an fp32 step: read p, g, m, v + write p, m, v
MIXED_OURS = 4 + 2 + 8 + 4 + 8 + 2  # read master, bf16 g, m, v; write master, m, v, bf16 p
MIXED_PEER = (2 + 4) + FLOOR + (4 + 2)  # cast g, fp32 step, copy master -> bf16 p
MIXED = "bf16 + fp32 master"
SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}


def count(text: str) -> int:
    text = text.strip().upper()
    scale = SUFFIX.get(text[-1:], 1)
    n = int(float(text[:-1] if text[-1:] in SUFFIX else text) * scale)
    if n < 1:
        raise argparse.ArgumentTypeError(f"need a positive count, got {text!r}")
    return n


def log(msg: str) -> None:
    print(f"[adam-bench] {msg}", file=sys.stderr, flush=True)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make(n: int, parts: int, dtype: torch.dtype, device: str, scale: float) -> list[torch.Tensor]:
    """n elements split into `parts` tensors, filled with a repeated randn block."""
    block = (torch.randn(1 << 16, generator=torch.Generator().manual_seed(parts)) * scale).to(
        device=device, dtype=dtype
    )
    out = []
    for i in range(parts):
        t = torch.empty(n // parts + (i < n % parts), dtype=dtype, device=device)
        rows, b = divmod(t.numel(), block.numel())
        t[: rows * block.numel()].view(rows, block.numel()).copy_(block.expand(rows, -1))
        t[rows * block.numel() :].copy_(block[:b])
        out.append(t)
    return out


def set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        if g.dtype != p.dtype and hasattr(p, "grad_dtype"):
            p.grad_dtype = None  # torch >= 2.10 pins grad dtype unless told not to
        p.grad = g


def time_it(fn: Callable[[], object], device: str, warmup: int, repeats: int) -> list[float]:
    """Seconds per call of fn, after warmup calls."""
    for _ in range(warmup):
        fn()
    if device == "cpu":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times
    torch.cuda.synchronize()
    events = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in events]


def bandwidth(device: str, nbytes: int, warmup: int, repeats: int) -> dict[str, float]:
    n = nbytes // 4
    src = torch.ones(n, device=device)
    dst = torch.zeros(n, device=device)
    out = {"bytes": n * 4}
    t = statistics.median(time_it(lambda: dst.copy_(src), device, warmup, repeats))
    out["copy_gbps"] = 2 * n * 4 / t / 1e9
    if device == "cpu":
        c = torch.zeros(n)
        t = statistics.median(
            time_it(lambda: torch.add(src, dst, alpha=0.5, out=c), device, warmup, repeats)
        )
        out["triad_gbps"] = 3 * n * 4 / t / 1e9
    # In place, as Adam updates p, m and v: a is read and written back, so no
    # cache line is fetched only to be overwritten (copy and triad pay such
    # write-allocate reads that the byte count above does not see).
    t = statistics.median(time_it(lambda: dst.add_(src, alpha=0.5), device, warmup, repeats))
    out["inplace_gbps"] = 3 * n * 4 / t / 1e9
    return out


def result(device, case, name, role, n, times, moved) -> dict:
    t = statistics.median(times)
    return dict(
        device=device, case=case, optimizer=name, role=role, params=n, median_s=t,
        min_s=min(times), times_s=times, params_per_s=n / t, bytes_per_param=moved,
        gbps_moved=n * moved / t / 1e9, gbps_at_28=n * FLOOR / t / 1e9,
    )  # fmt: skip


Step = Callable[[], object]
Run = Callable[[str, str, str, Callable[[], Step], int], None]


def fp32_cases(ours: type | None, run: Run, device: str, n: int, parts: int) -> None:
    """One set of fp32 params and grads; states are rebuilt per optimizer."""
    params = make(n, parts, torch.float32, device, 0.02)
    set_grads(params, make(n, parts, torch.float32, device, 1e-3))
    makers = {
        "torch AdamW fused": ("peer", lambda: torch.optim.AdamW(params, fused=True, **HYPER)),
        "torch AdamW foreach": ("other", lambda: torch.optim.AdamW(params, foreach=True, **HYPER)),
    }
    if ours is not None:
        makers = {ours.__name__: ("ours", lambda: ours(params, adamw_mode=True, **HYPER))} | makers
    for name, (role, build) in makers.items():
        run("fp32", name, role, lambda build=build: build().step, FLOOR)


def mixed_ours(ours: type, device: str, n: int, parts: int) -> Step:
    """bf16 grads into the fp32 master; the bf16 model param written in the same pass."""
    masters = make(n, parts, torch.float32, device, 0.02)
    model = [m.to(torch.bfloat16) for m in masters]
    set_grads(masters, make(n, parts, torch.bfloat16, device, 1e-3))
    opt = ours(masters, adamw_mode=True, **HYPER)
    for m, p16 in zip(masters, model, strict=True):
        opt.set_copy_out(m, p16)
    return opt.step


def mixed_peer(device: str, n: int, parts: int) -> Step:
    """What a torch user writes: cast the grads, fused AdamW on the master, copy back."""
    masters = make(n, parts, torch.float32, device, 0.02)
    model = [m.to(torch.bfloat16) for m in masters]
    grads16 = make(n, parts, torch.bfloat16, device, 1e-3)
    grads32 = [torch.empty_like(m) for m in masters]  # preallocated: no allocator cost
    set_grads(masters, grads32)
    opt = torch.optim.AdamW(masters, fused=True, **HYPER)

    def step() -> None:
        for g32, g16 in zip(grads32, grads16, strict=True):
            g32.copy_(g16)
        opt.step()
        for p16, m in zip(model, masters, strict=True):
            p16.copy_(m)

    return step


def bench_device(
    device: str, n: int, parts: int, warmup: int, repeats: int, errors: list[str]
) -> list[dict]:
    """Every case on one device; a case that fails is logged and left out, not fatal."""
    ours = CPUAdam if device == "cpu" else FusedAdam
    if device == "cuda" and not backend_info()["cuda_kernel"]:
        errors.append("cuda: the CUDA kernel is not built into this install: FusedAdam skipped")
        ours = None
    rows: list[dict] = []

    def guard(what: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as exc:  # keep the other cases: the device time is short
            traceback.print_exc()
            errors.append(f"{device} {what} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        free()

    def run(case: str, name: str, role: str, setup: Callable[[], Step], moved: int) -> None:
        def go() -> None:
            log(f"{device} {case}: {name} ({n:,} params) ...")
            times = time_it(setup(), device, warmup, repeats)
            rows.append(result(device, case, name, role, n, times, moved))
            log(f"  median {rows[-1]['median_s'] * 1e3:.1f} ms")

        guard(f"{case} {name}", go)

    guard("fp32 setup", lambda: fp32_cases(ours, run, device, n, parts))
    if ours is not None:
        name = f"{ours.__name__} + copy-out"
        run(MIXED, name, "ours", lambda: mixed_ours(ours, device, n, parts), MIXED_OURS)
    name = "torch cast + AdamW fused + copy_"
    run(MIXED, name, "peer", lambda: mixed_peer(device, n, parts), MIXED_PEER)
    for r in rows:
        ref = [p for p in rows if p["role"] == "peer" and p["case"] == r["case"]]
        r["peer_name"] = ref[0]["optimizer"] if ref else None
        r["speed_vs_peer"] = ref[0]["median_s"] / r["median_s"] if ref else None
    return rows


def machine() -> dict:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = dict(
        cpu=model, cpu_count=os.cpu_count(), cpu_affinity=len(os.sched_getaffinity(0)),
        torch_threads=torch.get_num_threads(), torch=torch.__version__,
        torch_cuda=torch.version.cuda, python=platform.python_version(),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        backend=backend_info(),
    )  # fmt: skip
    return info


def human(n: int) -> str:
    return next(f"{n / d:g}{u}" for d, u in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, "")) if n >= d)


def table(rows: list[dict], bw: dict[str, float]) -> str:
    head = (
        "| device | case | optimizer | params | median step ms | Gparam/s | GB/s @28 B/param "
        "| B/param moved | GB/s moved | % of mem BW | speed vs peer |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        speed = "n/a" if r["speed_vs_peer"] is None else f"**{r['speed_vs_peer']:.2f}x**"
        pct = f"{100 * r['gbps_moved'] / bw[r['device']]:.0f}%" if r["device"] in bw else "n/a"
        cells = [r["device"], r["case"], r["optimizer"], human(r["params"]),
                 f"{r['median_s'] * 1e3:.2f}", f"{r['params_per_s'] / 1e9:.3f}",
                 f"{r['gbps_at_28']:.1f}", str(r["bytes_per_param"]), f"{r['gbps_moved']:.1f}",
                 pct, speed]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks(rows: list[dict], bw: dict[str, dict], bw_ref: dict[str, float]) -> list[str]:
    """The headline facts: bf16 path vs fp32 path, and ours as a share of memory bandwidth."""
    out = []
    for dev in bw_ref:
        ours = {r["case"]: r for r in rows if r["device"] == dev and r["role"] == "ours"}
        if "fp32" in ours:
            shares = ", ".join(
                f"{100 * ours['fp32']['gbps_moved'] / v:.0f}% of {k.removesuffix('_gbps')}"
                for k, v in bw[dev].items()
                if k.endswith("_gbps")
            )
            out.append(f"{dev}: ours fp32 moves {ours['fp32']['gbps_moved']:.1f} GB/s = {shares}.")
        if "fp32" in ours and MIXED in ours:
            ratio = ours["fp32"]["median_s"] / ours[MIXED]["median_s"]
            verdict = "OK, bf16 at least as fast" if ratio >= 1.0 else "bf16 SLOWER than fp32"
            out.append(
                f"{dev}: ours bf16+copy-out vs ours fp32 (fp32 time / bf16 time, same "
                f"params) = {ratio:.2f}x: {verdict}."
            )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda", "all"],
        default="all",
        help="which kernels to time (default %(default)s: CPU, and CUDA when present)",
    )
    ap.add_argument("--cpu-params", type=count, help="fp32 params on the CPU (default 256M)")
    ap.add_argument("--gpu-params", type=count, help="fp32 params on the GPU (default 1B)")
    ap.add_argument("--tensors", type=int, default=8, help="split params into this many tensors")
    ap.add_argument("--repeats", type=int, help="timed steps (default CPU 5, GPU 20)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 3)")
    ap.add_argument("--json", help="also write every figure here")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script, not speed")
    a = ap.parse_args()
    small = a.smoke
    size = {
        "cpu": a.cpu_params or (10**6 if small else 256 * 10**6),
        "cuda": a.gpu_params or (16 * 10**6 if small else 10**9),
    }
    warmup = a.warmup if a.warmup is not None else (1 if small else 3)
    reps = {"cpu": a.repeats or (2 if small else 5), "cuda": a.repeats or (2 if small else 20)}
    bw_bytes = {"cpu": 2**24 if small else 2**30, "cuda": 2**26 if small else 2**32}

    has_cuda = torch.cuda.is_available()
    if a.device == "cuda" and not has_cuda:
        sys.exit(
            f"error: --device cuda, but torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}) sees no CUDA device; use --device cpu"
        )
    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "all": ["cpu", "cuda"][: 1 + has_cuda]}[a.device]
    notes: list[str] = []
    if a.device == "all" and not has_cuda:
        notes.append("GPU cases skipped: torch.cuda.is_available() is False.")
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    info = machine()
    rows, bw, bw_ref = [], {}, {}
    for dev in devices:
        log(f"{dev}: memory bandwidth ...")
        bw[dev] = bandwidth(dev, bw_bytes[dev], warmup, max(reps[dev], 5))
        free()
        bw_ref[dev] = max(v for k, v in bw[dev].items() if k.endswith("_gbps"))
        n = size[dev]
        rows += bench_device(dev, n, min(a.tensors, n), warmup, reps[dev], notes)
    notes += checks(rows, bw, bw_ref)

    cmd = " ".join(["python benchmarks/adam.py", *sys.argv[1:]])
    print(f"\n## Adam step throughput\n\n- date: {date}\n- command: `{cmd}`")
    print(
        f"- CPU: {info['cpu']}, {info['cpu_count']} logical cores "
        f"({info['cpu_affinity']} usable), torch threads {info['torch_threads']}"
    )
    print(f"- GPU: {info['gpu'] or 'none'}")
    print(f"- torch {info['torch']} (CUDA {info['torch_cuda']}), Python {info['python']}")
    print(f"- zerostack.fused_adam backend_info(): {info['backend']}")
    runs = ", ".join(f"{d} {human(size[d])} params x {reps[d]} repeats" for d in devices)
    print(f"- {runs}; {a.tensors} tensors each; warmup {warmup}\n")
    for dev, b in bw.items():
        streams = ", ".join(
            f"{k.removesuffix('_gbps')} {v:.1f} GB/s" for k, v in b.items() if k.endswith("_gbps")
        )
        print(
            f"- {dev} memory bandwidth (median; read+write bytes: copy 2 streams, triad "
            f"c = a + s*b 3 streams, inplace a += s*b 3 streams; {b['bytes'] / 2**30:g} GiB "
            f"tensors): {streams}"
        )
    for note in notes:
        print(f"- {note}")
    print(
        "- speed vs peer = peer median time / this row's (> 1: faster than the peer); peer: "
        "torch AdamW fused (fp32 case), torch cast + AdamW fused + copy_ (bf16 case).\n"
        "- GB/s @28 B/param = params/s x 28, the fp32 Adam floor; GB/s moved counts the "
        "bytes the row really moves; % of mem BW = GB/s moved / the best bandwidth above.\n"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                dict(date=date, command=cmd, machine=info, bandwidth=bw, notes=notes, results=rows),
                f,
                indent=2,
            )
        log(f"wrote {a.json}")
    print(table(rows, bw_ref), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
