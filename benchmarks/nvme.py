"""NVMe offload: raw disk bandwidth per backend, and the CPUAdam step with
its states on disk against the same step with states in RAM, in one run.

What is measured:

* Raw bandwidth, per backend (tensornvme's uring/aio where installed, and
  threads): ``--raw-gb`` GB written as 64 MiB tensors, all in flight, then
  fsync; then read back. The page cache is dropped before the read when the
  machine lets us (root); otherwise the read may come from RAM and the table
  says so.
* The step: CPUAdam over ``--params`` fp32 params (16 tensors) at
  nvme_offload_fraction 0 (states in RAM) and 1 (states on disk), with
  prefetch depths 1, 2 and 4. At fraction 1 a step moves 16 bytes/param
  through the disk (8 read, 8 written), so its floor is
  16 * params / disk bandwidth; the "I/O GB/s" column is that traffic over the
  step time, and "% of raw" compares it with the raw read+write figure.

    python benchmarks/nvme.py                      # 1B params, 8 GB raw test
    python benchmarks/nvme.py --params 64M --raw-gb 1 --dir /mnt/nvme
    python benchmarks/nvme.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

from zerostack.fused_adam import CPUAdam, backend_info
from zerostack.nvme import BACKENDS, tensornvme_backends
from zerostack.nvme._backends import open_backend
from zerostack.testing import drop_page_cache


def parse_size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
    return (
        int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)
    )


def raw_bandwidth(backend: str, directory: str, total_bytes: int) -> dict:
    """Write ``total_bytes`` as 64 MiB tensors, all in flight, then read them back.

    Reported: buffered write (done when the backend says so: the pipeline's
    own criterion), durable write (plus fsync), cached read (straight after)
    and cold read (after dropping the page cache, where allowed).
    """
    chunk = 64 * 2**20
    n = max(1, total_bytes // chunk)
    bufs = [torch.full((chunk // 4,), float(i)) for i in range(min(n, 8))]
    workdir = tempfile.mkdtemp(prefix="zs-nvme-raw-", dir=directory)
    path = os.path.join(workdir, "raw.bin")
    io = open_backend(backend, path)

    def read_all() -> float:
        out = [torch.empty(chunk // 4) for _ in range(len(bufs))]
        start = time.perf_counter()
        for base in range(0, n, len(out)):
            handles = [
                io.read(f"c{i}", out[i - base]) for i in range(base, min(n, base + len(out)))
            ]
            for h in handles:
                io.wait(h)
        elapsed = time.perf_counter() - start
        for i in range(n):  # tensornvme frees a key on read: write it again
            io.wait(io.write(f"c{i}", bufs[i % len(bufs)]))
        return elapsed

    try:
        start = time.perf_counter()
        handles = [io.write(f"c{i}", bufs[i % len(bufs)]) for i in range(n)]
        for h in handles:
            io.wait(h)
        buffered_s = time.perf_counter() - start
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        durable_s = time.perf_counter() - start
        cached_s = read_all()
        dropped = drop_page_cache()
        cold_s = read_all()
    finally:
        io.close()
        shutil.rmtree(workdir, ignore_errors=True)
    nbytes = n * chunk
    return dict(
        backend=backend, bytes=nbytes, write_gbps=nbytes / buffered_s / 1e9,
        durable_write_gbps=nbytes / durable_s / 1e9, read_gbps=nbytes / cached_s / 1e9,
        cold_read_gbps=nbytes / cold_s / 1e9, cache_dropped=dropped,
    )  # fmt: skip


def tensornvme_waits(backend: str, directory: str, nbytes: int = 2**30) -> dict | None:
    """tensornvme's own read wait, called as its Python binding offers it:
    a key of ``nbytes`` written, the page cache dropped (so that the read
    goes to the disk), read back. Measured: the submit, ``sync_read_events()``
    and how many of 4096 elements spread over the key were still wrong when
    it returned; then, on a second such read, ``synchronize()`` and how often
    a thread sleeping 1 ms at a time woke up during it (it cannot without
    the GIL). None where the cache cannot be dropped (not root). See
    zerostack.nvme's [Note: tensornvme 0.1.0's waits]."""
    import threading

    from tensornvme._C import Offloader

    workdir = tempfile.mkdtemp(prefix="zs-nvme-waits-", dir=directory)
    off = Offloader(os.path.join(workdir, "waits.bin"), 16, backend)
    src = torch.arange(nbytes // 4, dtype=torch.float32)
    sample = torch.arange(0, src.numel(), src.numel() // 4096)
    dst, wakes, stop = torch.zeros_like(src), [0], threading.Event()

    def cold_read(off) -> float | None:  # the submit's seconds; None: the cache stays
        off.async_write(src, "k", None)
        off.synchronize()
        dst.zero_()
        if not drop_page_cache():
            off.async_read(dst, "k", None)  # tensornvme removes its file at the end
            off.synchronize()
            return None
        start = time.perf_counter()
        off.async_read(dst, "k", None)
        return time.perf_counter() - start

    def sleeper() -> None:
        while not stop.wait(0.001):
            wakes[0] += 1

    try:
        submit_s = cold_read(off)
        if submit_s is None:
            return None
        start = time.perf_counter()
        off.sync_read_events()
        read_wait_s = time.perf_counter() - start
        wrong = int((dst[sample] != src[sample]).sum())
        off.synchronize()
        cold_read(off)
        thread = threading.Thread(target=sleeper)
        thread.start()
        time.sleep(0.01)
        start, before = time.perf_counter(), wakes[0]
        off.synchronize()
        sync_s, woke = time.perf_counter() - start, wakes[0] - before
        stop.set()
        thread.join()
        return dict(
            backend=backend, bytes=nbytes, submit_s=submit_s, read_wait_s=read_wait_s,
            wrong=wrong, sync_s=sync_s, woke=woke, wrong_after=int((dst != src).sum()),
        )  # fmt: skip
    finally:
        stop.set()
        del off  # tensornvme removes its file
        shutil.rmtree(workdir, ignore_errors=True)


def _print_waits(waits: list[dict | None]) -> None:
    rows = [w for w in waits if w is not None]
    if not rows:
        return
    print("\ntensornvme's own waits, a key read back from the disk (page cache dropped):\n")
    print("| backend | bytes | async_read() s | then sync_read_events() s | sampled elements "
          "wrong then | a second read: synchronize() s | wrong after it | a 1 ms sleeper woke "
          "during it |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for w in rows:
        print(f"| {w['backend']} | {w['bytes'] / 2**20:.0f} MiB | {w['submit_s']:.4f} | "
              f"{w['read_wait_s']:.6f} | {w['wrong']} of 4096 | {w['sync_s']:.3f} | "
              f"{w['wrong_after']:,} | {w['woke']} times |")  # fmt: skip


def adam_step_time(params: list[torch.Tensor], repeats: int, **kw) -> list[float]:
    opt = CPUAdam(params, lr=1e-3, weight_decay=0.01, **kw)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        opt.step()
        if i:  # the first step allocates (or reserves and first-writes) the states
            times.append(time.perf_counter() - start)
    del opt
    gc.collect()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--params",
        default="1B",
        help="fp32 params of the CPUAdam step, e.g. 64M, 1B (default %(default)s)",
    )
    ap.add_argument(
        "--raw-gb",
        type=float,
        default=8.0,
        help="GB written and read back per backend in the raw test (default %(default)s)",
    )
    ap.add_argument("--dir", default=None, help="where the files go (default: the temp dir)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed steps per setting (default %(default)s)"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes (4M params, 0.25 GB): checks the script, not speed",
    )
    a = ap.parse_args()
    if a.smoke:
        a.params, a.raw_gb, a.repeats = "4M", 0.25, 2
    n = parse_size(a.params)
    directory = a.dir or tempfile.gettempdir()
    backends = [b for b in BACKENDS if b == "threads" or b in tensornvme_backends()]
    print(f"[nvme-bench] backends {backends}, dir {directory}", file=sys.stderr)

    key_bytes = 2**26 if a.smoke else 2**30
    waits = [tensornvme_waits(b, directory, key_bytes) for b in sorted(tensornvme_backends())]
    raw = []
    for b in backends:
        print(f"[nvme-bench] raw {b} ...", file=sys.stderr)
        raw_bandwidth(b, directory, 2**27)  # warm up the backend
        raw.append(raw_bandwidth(b, directory, int(a.raw_gb * 1e9)))
    best = max(raw, key=lambda r: r["write_gbps"] + r["read_gbps"])

    num_tensors = 16
    params = [torch.full((n // num_tensors,), 0.02) for _ in range(num_tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    total = sum(p.numel() for p in params)
    rows = []
    print("[nvme-bench] step, states in RAM ...", file=sys.stderr)
    ram = statistics.median(adam_step_time(params, a.repeats))
    rows.append(("RAM", "-", "-", ram))
    for depth in (1, 2, 4):
        print(
            f"[nvme-bench] step, states on disk, {best['backend']}, depth {depth} ...",
            file=sys.stderr,
        )
        t = adam_step_time(
            params, a.repeats, nvme_offload_fraction=1.0, nvme_offload_dir=directory,
            nvme_backend=best["backend"], nvme_prefetch_depth=depth,
        )  # fmt: skip
        rows.append(("disk", best["backend"], str(depth), statistics.median(t)))

    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print("\n## NVMe offload\n")
    print(f"- date: {date}; command: `python {' '.join(sys.argv)}`")
    print(f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {backend_info()['cpu_simd']}, {torch.get_num_threads()} threads")  # fmt: skip
    print(
        f"- directory: {directory} ({shutil.disk_usage(directory).total / 1e9:.0f} GB filesystem)\n"
    )
    print("| backend | bytes | write GB/s | write + fsync GB/s | read GB/s (just written) | "
          "read GB/s (page cache dropped) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in raw:
        cold = f"{r['cold_read_gbps']:.2f}" if r["cache_dropped"] else "n/a (cannot drop the cache)"
        print(f"| {r['backend']} | {r['bytes'] / 1e9:.1f} GB | {r['write_gbps']:.2f} | "
              f"{r['durable_write_gbps']:.2f} | {r['read_gbps']:.2f} | {cold} |")  # fmt: skip
    print("\nThe optimizer's pipeline waits for writes as the backend reports them done (the "
          "'write' column) and reads what it wrote one step earlier (the 'just written' column); "
          "those two are its raw bandwidth here.")  # fmt: skip
    _print_waits(waits)
    raw_rw = 2 / (1 / best["write_gbps"] + 1 / best["read_gbps"])  # equal bytes each way
    floor = 16 * total / (raw_rw * 1e9)
    print(f"\nCPUAdam step, {total / 1e9:.2f}B fp32 params in {num_tensors} tensors, median of "
          f"{a.repeats}; disk floor at fraction 1 = 16 B/param / {raw_rw:.2f} GB/s "
          f"(raw read+write of {best['backend']}) = {floor * 1e3:.0f} ms\n")  # fmt: skip
    print("| states | backend | prefetch depth | step ms | vs RAM step | I/O GB/s | % of raw |")
    print("|---|---|---|---|---|---|---|")
    for where, b, depth, t in rows:
        io = f"{16 * total / t / 1e9:.2f}" if where == "disk" else "-"
        pct = f"{100 * 16 * total / t / 1e9 / raw_rw:.0f}%" if where == "disk" else "-"
        print(f"| {where} | {b} | {depth} | {t * 1e3:.1f} | {t / ram:.2f}x | {io} | {pct} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
