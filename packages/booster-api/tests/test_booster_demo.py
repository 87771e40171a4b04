"""examples/gpt2_booster_demo.py --smoke: plain python (one process, the
fallback environment) and torchrun with 2 processes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

DEMO = Path(__file__).resolve().parents[3] / "examples" / "gpt2_booster_demo.py"
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd):
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    # A new session: on a timeout the whole group (torchrun's workers too) is killed.
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            stdout, stderr = proc.communicate()
            raise AssertionError(f"timed out:\n{stdout}{stderr}") from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = re.findall(
        r"^\[(\d)/3\] loss [\d.]+, step [\d.]+s, TFLOPS [\d.]+, peak ", done.stdout, re.M
    )
    assert steps == ["1", "2", "3"], done.stdout
    return done.stdout


def test_smoke_in_one_plain_process_lazy_gemini():
    out = _run([sys.executable, str(DEMO), "--smoke", "--plugin", "gemini", "--lazy"])
    assert "plugin gemini, fp16, 1 process(es) on cpu" in out


def test_smoke_under_torchrun_with_two_processes_zero2():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(DEMO), "--smoke", "--plugin", "zero2"]  # fmt: skip
    out = _run(cmd)
    assert "plugin zero2, fp16, 2 process(es) on cpu" in out
