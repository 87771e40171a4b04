"""benchmarks/machine.py on a machine without a GPU: it measures CPU Adam and
the disk, says what it skipped, and writes a MachineProfile that
zerostack.shard loads, with every CUDA figure absent."""

from __future__ import annotations

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
