"""benchmarks/machine.py on a machine without a GPU: it measures CPU Adam and
the disk, says what it skipped, and writes a MachineProfile that
zerostack.shard loads, with every CUDA figure absent."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerostack.shard import MachineProfile, step_floor

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "machine.py"
CUDA_FIELDS = (
    "h2d_bytes_s", "d2h_bytes_s", "h2d_both_bytes_s", "d2h_both_bytes_s",
    "cpu_adam_with_copies_bytes_s", "h2d_with_adam_bytes_s", "d2h_with_adam_bytes_s",
    "gpu_adam_params_s",
)  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only profile")
def test_machine_benchmark_writes_a_cpu_only_profile(tmp_path: Path) -> None:
    out = tmp_path / "machine.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--params", "1M", "--repeats", "2", "--json", str(out),
         "--disk-dir", str(tmp_path), "--disk-bytes", "64M"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "skipped (no CUDA device): pinned copies" in done.stdout
    profile = MachineProfile.load(out)
    assert all(getattr(profile, name) is None for name in CUDA_FIELDS)
    assert profile.cpu_adam_bytes_s > 0
    assert profile.disk_read_bytes_s > 0 and profile.disk_write_bytes_s > 0
    assert "no GPU" in profile.machine and "1M parameters" in profile.machine
    assert list(tmp_path.iterdir()) == [out]  # the disk test's file is gone
    # Without copy bandwidths, only a floor with no PCIe traffic can be computed.
    est = step_floor(
        profile, forward_s=0.1, backward_s=0.2, host_numel=10**6,
        h2d_bytes_per_param=0, d2h_bytes_per_param=0, forward_hide_fraction=0.0,
    )  # fmt: skip
    assert est.split is None
    assert est.floor_s == pytest.approx(0.3 + 28e6 / profile.cpu_adam_bytes_s)


def _training():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import _training
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return _training


PROFILE = MachineProfile(
    cpu_adam_bytes_s=28e9, h2d_bytes_s=10e9, d2h_bytes_s=10e9,
    cpu_adam_with_copies_bytes_s=14e9, h2d_with_adam_bytes_s=12e9, d2h_with_adam_bytes_s=12e9,
    gpu_adam_params_s=100e9, disk_read_bytes_s=4e9, disk_write_bytes_s=2e9, machine="made up",
)  # fmt: skip
PLAIN = dict(name="plain PyTorch", run=0, fwd_s=0.1, fwd_bwd_s=0.3, step_s=0.35)


def test_an_offloaded_row_gets_the_floor_of_the_plain_row_of_its_run() -> None:
    T = _training()
    row = dict(name="ZeRO-2 + cpu_offload", run=0, host_numel=10**9, step_s=1.2)
    f = T.floor_of(row, PLAIN, PROFILE)
    # backward 0.2; CPU only 0.1 + 0.2 + 1.0 - 0.1; split at f = 11/17 (test_step_model.py)
    assert f["cpu_only_s"] == pytest.approx(1.2)
    assert f["gpu_fraction"] == pytest.approx(11 / 17)
    assert f["floor_s"] == pytest.approx(0.2 + 12 / 17 + 11 / 1700) == f["split_s"]
    assert f["achieved"] == pytest.approx(1.2 / f["floor_s"])
    # GPU-held masters' updates lengthen backward; states on disk are read and written
    gemini = dict(row, gpu_numel=10**10, disk_bytes=4e9)
    g = T.floor_of(gemini, PLAIN, PROFILE)
    assert g["cpu_only_s"] == pytest.approx(0.1 + (0.2 + 0.1) + 3.0 - 0.1)  # disk: 1 s + 2 s
    assert g["bound"] == "disk"
    assert T.floor_of(row, None, PROFILE).startswith("n/a (no row all on the GPU in this run")


def test_the_floor_takes_the_faster_row_all_on_the_gpu_of_its_run() -> None:
    T = _training()
    plain = dict(PLAIN, key="plain")  # forward and backward 0.3 s
    zero2 = dict(name="ZeRO-2", run=0, key="zero2", fwd_s=0.08, fwd_bwd_s=0.32, step_s=0.36)
    gemini_gpu = dict(name="Gemini all on the GPU", run=1, key="gemini_gpu", fwd_s=0.09,
                      fwd_bwd_s=0.25, step_s=0.3)  # fmt: skip
    offload = dict(name="ZeRO-2 + cpu_offload", run=0, key="zero2_offload", host_numel=10**9)
    capped = dict(name="Gemini auto", run=1, key="gemini_auto", host_numel=10**9)
    rows = [plain, zero2, gemini_gpu, dict(plain, run=1), offload, capped]
    assert T.compute_row(offload, rows) is plain  # ZeRO-2's backward is the slower here
    assert T.compute_row(capped, rows) is gemini_gpu
    faster = dict(zero2, fwd_bwd_s=0.28)
    assert T.compute_row(offload, [plain, faster, offload]) is faster
    # another run's row, a failed row and another system's row are not taken
    assert T.compute_row(dict(capped, run=0), rows) is plain
    failed = dict(gemini_gpu, error="OOM: ...")
    assert T.compute_row(capped, [failed, dict(plain, run=1)])["run"] == 1
    assert T.compute_row(offload, [gemini_gpu, dict(zero2, run=1)]) is None


def test_the_floor_table_lists_offloaded_rows_only(capsys) -> None:
    T = _training()
    rows = [
        PLAIN,
        dict(name="ZeRO-2 (bf16 params, fp32 masters)", run=0, step_s=0.3),
        dict(
            name="ZeRO-2 + cpu_offload",
            run=0,
            host_numel=10**9,
            step_s=1.2,
            cpu_kernel=(0.28, 8.0, 10**9, 0.0),
        ),  # 1e9 elements in 0.28 s: 100 GB/s
        dict(name="ZeRO-2 + cpu_offload", run=1, host_numel=10**9, step_s=1.3),
        dict(name="Gemini auto", run=0, error="OOM: ..."),
    ]  # without keys (results of an older script): plain's row by its name
    T.print_floors(rows, PROFILE)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert len(lines) == 3  # the header and two offloaded rows
    head = "| 0 | ZeRO-2 + cpu_offload | 1.000B | plain PyTorch | 0.912 | 1.32x | 1.200 |"
    assert lines[1].startswith(head)
    # This run's CPU Adam rate, then the profile's alone (28) and beside copies (14).
    assert lines[1].endswith("| 100, 28, 14 |"), lines[1]
    assert lines[2].startswith("| 1 | ZeRO-2 + cpu_offload | 1.000B | n/a (no row all on the GPU")
    assert all(ln.count("|") == lines[0].count("|") for ln in lines), lines


class _Range:
    def __init__(self, start_s: float, end_s: float) -> None:
        self.start, self.end = start_s * 1e6, end_s * 1e6  # the profiler's microseconds


class _Event:
    """What phase_times reads of a torch.profiler event."""

    def __init__(self, name: str, device: str, start_s: float, end_s: float, stream: int = 0):
        self.name, self.device_type = name, f"DeviceType.{device}"
        self.time_range, self.device_resource_id = _Range(start_s, end_s), stream
        self.is_user_annotation = False


def test_phase_times_splits_each_phase_into_kernels_copies_and_idle() -> None:
    T = _training()
    events = [
        _Event("bench::forward", "CPU", 0.0, 1.0),
        _Event("bench::backward", "CPU", 1.0, 3.0),
        _Event("bench::step", "CPU", 3.0, 3.5),
        _Event("gemm", "CUDA", 0.1, 0.6, stream=7),
        _Event("gemm", "CUDA", 0.5, 0.9, stream=7),  # overlaps the first: 0.8 s of kernels
        _Event("Memcpy HtoD (Pinned -> Device)", "CUDA", 0.2, 0.3, stream=9),
        _Event("gemm", "CUDA", 1.5, 2.0, stream=7),
        _Event("reduce", "CUDA", 1.8, 2.6, stream=8),  # a side stream's kernel, longer
        _Event("Memcpy DtoH (Device -> Pinned)", "CUDA", 2.8, 3.2, stream=9),  # spans two phases
    ]
    lines = T.phase_times(events)
    assert lines == [
        "step 0 forward: 1.000 s; kernels 0.800 s (stream 7 0.800 s), H2D 0.100 s, "
        "D2H 0.000 s, device idle 0.200 s",
        "step 0 backward: 2.000 s; kernels 1.100 s (stream 8 0.800 s), H2D 0.000 s, "
        "D2H 0.200 s, device idle 0.700 s",
        "step 0 step: 0.500 s; kernels 0.000 s (stream 9 0.200 s), H2D 0.000 s, "
        "D2H 0.200 s, device idle 0.300 s",
    ]


def test_copy_streams_says_whether_two_streams_copies_ran_at_once() -> None:
    T = _training()
    h2d, d2h = "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"
    events = [
        _Event("gemm", "CUDA", 0.0, 5.0, stream=7),  # no copy: not counted
        _Event(h2d, "CUDA", 0.0, 1.0, stream=20),  # the lane's long copy up
        _Event(h2d, "CUDA", 1.0, 1.1, stream=21),  # a gather, after it: took turns
        _Event(h2d, "CUDA", 2.0, 3.0, stream=20),
        _Event(h2d, "CUDA", 2.5, 2.75, stream=21),  # a gather beside it: shared the link
        _Event(h2d, "CUDA", 2.6, 2.8, stream=21),  # overlaps its own stream's copy
        _Event(d2h, "CUDA", 4.0, 4.5, stream=22),
    ]
    assert T.copy_streams(events) == [
        "stream 20: H2D 2.000 s (2 copies)",
        "stream 21: H2D 0.400 s (3 copies)",
        "stream 22: D2H 0.500 s (1 copy)",
        "H2D of two or more streams at once: 0.300 s of the 2.100 s some H2D copy ran (2 streams)",
        "D2H of two or more streams at once: 0.000 s of the 0.500 s some D2H copy ran (1 stream)",
    ]


def test_the_gc_clock_sums_the_collectors_pauses() -> None:
    T = _training()
    clock = T._GcClock()
    gc.callbacks.append(clock)
    try:
        gc.collect()
        gc.collect()
    finally:
        gc.callbacks.remove(clock)
    assert clock.seconds > 0.0
    then = clock.seconds
    gc.collect()  # no longer counted
    assert clock.seconds == then
