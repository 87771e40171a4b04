"""What this machine's resources achieve, each measured on its own and some
all at once: the figures of zerostack.shard's MachineProfile, from which
``step_floor`` computes the floor of an offloaded step (see the Note
"step-time floor" in zero-shard's ``_step_model.py``).

What is measured (by ``zerostack.shard.measure_machine``, which
``gpu_update_fraction="auto"`` runs at a smaller size; the disk here):

* CPU Adam alone: ``zerostack.fused_adam.CPUAdam`` stepping N fp32 masters
  with bf16 gradients and the bf16 copy-out (as ZeRO cpu_offload and Gemini
  step host-held chunks), reported at 28 B per parameter (read master,
  exp_avg, exp_avg_sq and the gradient, write the three and the copy-out);
* pinned copies, CUDA only: host to device alone, device to host alone, and
  both directions at once on two streams (each direction timed by its own
  CUDA events);
* CPU Adam and both copies at once, CUDA only: the copies run on a thread
  for as long as CPU Adam's timed steps, each figure from its own timing;
* the GPU's Adam, CUDA only: ``zerostack.fused_adam.FusedAdam`` on N fp32
  parameters, parameters per second;
* the disk, with ``--disk-dir``: a file of ``--disk-bytes`` written and
  fsynced, then read back, with O_DIRECT where the file system takes it
  (else buffered, with the file's pages dropped from the cache first).

Timing: ``--warmup`` runs, then the median of ``--repeats`` (CPU work with
time.perf_counter, GPU work with CUDA events). The CPU kernel's threads
follow torch.get_num_threads().

    python benchmarks/machine.py --json machine.json                 # 256M params on CUDA
    python benchmarks/machine.py --params 16M --disk-dir /nvme --json machine.json
    python benchmarks/gemini.py --machine machine.json               # rows print their floor
"""

from __future__ import annotations

import argparse
import datetime
import mmap
import os
import sys
import time

import adam as A
import torch

from zerostack.fused_adam import backend_info
from zerostack.shard import MachineProfile, measure_machine

IO_BLOCK = 64 * 2**20  # bytes per os.write/os.read; a multiple of any O_DIRECT alignment


def log(msg: str) -> None:
    print(f"[machine] {msg}", file=sys.stderr, flush=True)


def _open_direct(path: str, flags: int) -> tuple[int, bool]:
    """The file opened with O_DIRECT where the file system takes it."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), True
        except OSError:
            pass
    return os.open(path, flags, 0o600), False


def disk(directory: str, nbytes: int) -> dict[str, float]:
    """Write ``nbytes`` (fsynced) to a new file in ``directory``, then read them."""
    nbytes = max(IO_BLOCK, nbytes // IO_BLOCK * IO_BLOCK)
    buf = mmap.mmap(-1, IO_BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(4096) * (IO_BLOCK // 4096))
    path = os.path.join(directory, f".zerostack-machine-{os.getpid()}.bin")
    try:
        fd, direct = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        t0 = time.perf_counter()
        for offset in range(0, nbytes, IO_BLOCK):
            os.pwritev(fd, [buf], offset)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)
        fd, read_direct = _open_direct(path, os.O_RDONLY)
        if not read_direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for offset in range(0, nbytes, IO_BLOCK):
            os.preadv(fd, [buf], offset)
        read_s = time.perf_counter() - t0
        os.close(fd)
    finally:
        if os.path.exists(path):
            os.remove(path)
        buf.close()
    how = "O_DIRECT" if direct and read_direct else "buffered, fsync and page cache dropped"
    log(f"disk: {nbytes / 1e9:.2f} GB in {directory} ({how})")
    return dict(disk_read_bytes_s=nbytes / read_s, disk_write_bytes_s=nbytes / write_s)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--params", type=A.count, default=None,
        help="parameters of the Adam runs, e.g. 256M (default 256M with CUDA, 16M without)",
    )  # fmt: skip
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs (median; default 5)")
    ap.add_argument(
        "--copy-bytes", type=A.count, default=2**30,
        help="bytes per pinned copy, CUDA only (default 1 GiB)",
    )  # fmt: skip
    ap.add_argument("--disk-dir", default=None, help="measure this directory's disk (default: no)")
    ap.add_argument(
        "--disk-bytes", type=A.count, default=4 * 2**30,
        help="bytes written and read in --disk-dir, in whole 64 MiB blocks (default 4 GiB)",
    )  # fmt: skip
    ap.add_argument("--json", default=None, help="write the MachineProfile as JSON to this path")
    a = ap.parse_args()
    if a.warmup < 0 or a.repeats < 1:
        ap.error(f"--warmup must be >= 0 and --repeats >= 1 (got {a.warmup}, {a.repeats})")
    return a


def _describe(info: dict, n: int) -> str:
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    gpu = info["gpu"] or "no GPU"
    return (
        f"{date}; {info['cpu']}, {info['cpu_count']} cores, {info['torch_threads']} torch "
        f"threads, CPU Adam's {backend_info()['cpu_schedule']} schedule; {gpu}; torch "
        f"{info['torch']}; Adam over {A.human(n)} parameters"
    )


def main() -> int:
    a = _args()
    cuda = torch.cuda.is_available()
    n = a.params or (256 * 10**6 if cuda else 16 * 10**6)
    where = "CPU Adam, pinned copies one way, both ways and beside CPU Adam, GPU Adam"
    log(f"{where if cuda else 'CPU Adam (no CUDA device)'}: {A.human(n)} parameters")
    measured = measure_machine(
        torch.device("cuda", torch.cuda.current_device()) if cuda else None, numel=n,
        copy_bytes=a.copy_bytes, warmup=a.warmup, repeats=a.repeats,
    )  # fmt: skip
    figures = {k: v for k, v in measured.to_dict().items() if k != "machine"}
    if not cuda:
        print("skipped (no CUDA device): pinned copies, CPU Adam beside the copies, GPU Adam")
    if a.disk_dir is not None:
        figures |= disk(a.disk_dir, a.disk_bytes)
    else:
        print("skipped (no --disk-dir): disk read and write")
    profile = MachineProfile(**figures, machine=_describe(A.machine(), n))
    print(f"\n## This machine\n\n- {profile.machine}\n- command: `python {' '.join(sys.argv)}`\n")
    print("| figure | value |\n|---|---|")
    for name, value in profile.to_dict().items():
        if name != "machine":
            unit = "G params/s" if name.endswith("params_s") else "GB/s"
            print(
                f"| {name} | {'not measured' if value is None else f'{value / 1e9:.2f} {unit}'} |"
            )
    if a.json:
        profile.save(a.json)
        log(f"profile written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
