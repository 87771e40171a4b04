"""A DeepSpeed training program ported by changing its imports
(examples/deepspeed_zero2.py) runs under torchrun with 2 CPU ranks (gloo)
from a ds_config.json: the config's batch keys, gradient accumulation,
optimizer and scheduler take effect. Data-driven: one case per config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "deepspeed_zero2.py"
WORLD = 2
SAMPLES_PER_RANK = 32  # the smoke data set (64 samples) over two ranks
EPOCHS = 3

sys.path.insert(0, str(SCRIPT.parent))
from deepspeed_zero2 import GUIDE_CONFIG  # noqa: E402


def _warmup_decay(step: int, peak: float, warmup: int, total: int) -> float:
    """DeepSpeed's WarmupDecayLR (linear warmup) after ``step`` optimizer steps."""
    i = step - 1
    gamma = i / warmup if i < warmup else max(0.0, (total - i) / max(1.0, total - warmup))
    return peak * gamma


CASES = [
    # (id, config, micro batch, accumulation steps, the lr after the run or None)
    ("zero2-guide-bf16-offload", GUIDE_CONFIG, 4, 2,
     _warmup_decay(EPOCHS * SAMPLES_PER_RANK // 8, 3e-3, 4, 40)),
    ("zero1-fp32-sgd-train-batch-size",
     {"zero_optimization": {"stage": 1}, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
      "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
      "gradient_clipping": 1.0, "steps_per_print": 10}, 4, 4, None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "config", "micro", "gas", "lr"), CASES, ids=[c[0] for c in CASES])
def test_a_deepspeed_program_trains_from_its_config(tmp_path, name, config, micro, gas, lr):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    summary = tmp_path / "summary.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={WORLD}", str(SCRIPT), "--deepspeed_config", str(path), "--smoke",
         "--epochs", str(EPOCHS), "--summary", str(summary)],
        capture_output=True, text=True, timeout=300, env=env, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = json.loads(summary.read_text())
    micro_steps = EPOCHS * SAMPLES_PER_RANK // micro
    assert done["world_size"] == WORLD and done["micro_batch"] == micro
    assert done["gradient_accumulation_steps"] == gas
    assert done["micro_steps"] == micro_steps and done["optimizer_steps"] == micro_steps // gas
    if lr is not None:
        assert done["lr"] == pytest.approx(lr, rel=1e-9)
    losses = done["losses"]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
