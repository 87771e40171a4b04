"""The main job (examples/train_booster.py) puts optimizer states on disk
when --nvme-fraction asks for it: HybridAdam's nvme_offload_fraction is a
share of the CPU-held states (as ColossalAI's), so the job places every
optimizer chunk on the CPU for it, logs that decision, and its summary's
bytes on disk are the share's (on a CPU compute device the placement decides
as on a GPU: see zerostack.gemini's [Note: NVMe on the host tier])."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_booster.py"
pytest.importorskip("zerostack.nvme")


def _job_module(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its sibling modules, as when run
    spec = importlib.util.spec_from_file_location("train_booster", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("nvme_fraction", "asked", "expected"),
    [(0.5, None, 1.0), (1.0, None, 1.0), (0.0, None, 0.5), (0.5, 0.25, 0.25), (0.0, 1.0, 1.0)],
)
def test_the_placement_offloads_optimizer_states_when_states_go_to_disk(
    nvme_fraction, asked, expected, monkeypatch
):
    frac, why = _job_module(monkeypatch).offload_optim_frac(nvme_fraction, asked)
    assert frac == expected
    assert ("ColossalAI's NVMe guide" in why) == (nvme_fraction > 0 and asked is None)


def _run(tmp_path: Path, *args: str) -> tuple[dict, str]:
    run_dir = tmp_path / "run"
    env = dict(os.environ, ZEROSTACK_NVME_BACKEND="threads")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--steps", "3", "--run-dir", str(run_dir), *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((run_dir / "summary.json").read_text()), done.stdout + done.stderr


def test_the_main_job_puts_the_share_of_states_on_disk(tmp_path):
    summary, out = _run(tmp_path, "--nvme-fraction", "0.5")
    assert "placement: offload_optim_frac=1.0 (--nvme-fraction 0.5 puts" in out
    masters = summary["placement"]["master on pageable"]
    shard = masters["bytes"] // (4 * masters["chunks"])  # fp32 master shards, all equal
    # Every master on the host; whole chunks in order within half their elements.
    assert summary["nvme_bytes"] == 8 * shard * (masters["chunks"] // 2) > 0


def test_no_host_held_states_is_a_warning_and_nothing_on_disk(tmp_path):
    summary, out = _run(tmp_path, "--nvme-fraction", "0.5", "--offload-optim-frac", "0")
    assert summary["nvme_bytes"] == 0
    assert "nvme_offload_fraction=0.5 has no effect" in out
    assert "set placement_policy='static' with offload_optim_frac=1.0" in out
