"""The names ColossalAI's auto-offload example imports besides memory_optimize
and AMPOptimizer: NOT_NVML (its solver's) and parameter_size (its fx profiler's)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from zerostack.auto_offload import parameter_size


def test_parameter_size_counts_bytes_in_the_current_dtype_and_tied_weights_once():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    assert parameter_size(model) == (40 + 40 + 10) * 4
    model[1].weight = model[0].weight  # a tied head
    assert parameter_size(model) == (40 + 10) * 4
    assert parameter_size(model.half()) == (40 + 10) * 2
    assert parameter_size(torch.nn.ReLU()) == 0


def test_not_nvml_says_whether_pynvml_is_installed(tmp_path):
    code = "from zerostack.auto_offload import NOT_NVML; print(NOT_NVML)"
    (tmp_path / "pynvml.py").write_text("")  # an importable pynvml
    base = os.environ.get("PYTHONPATH", "")
    seen = {}
    for label, path in (("with", f"{tmp_path}{os.pathsep}{base}"), ("without", base)):
        env = {**os.environ, "PYTHONPATH": path}
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr
        seen[label] = run.stdout.strip()
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert seen == {"with": "False", "without": "True"}
    else:
        assert seen == {"with": "False", "without": "False"}
