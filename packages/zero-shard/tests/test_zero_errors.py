"""ZeroOptimizer's errors for bad input and wrong order."""

from __future__ import annotations

import sys

import pytest
import torch

from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT


def _model():
    return TinyGPT(GPTConfig(num_layers=1, dim=16, num_heads=2))


@pytest.mark.parametrize("stage", [0, 3, "2"])
def test_stage_must_be_1_or_2(stage):
    m = _model()
    with pytest.raises(
        ValueError, match=r"stage must be 1 or 2 \(got .*\); use gemini for stage 3"
    ):
        ZeroOptimizer(torch.optim.AdamW(m.parameters()), stage=stage)


def test_module_param_missing_from_the_optimizer():
    m = _model()
    params = [p for n, p in m.named_parameters() if n != "lm_head.weight"]
    with pytest.raises(
        ValueError,
        match=r"parameter 'lm_head.weight' of the module is missing from the wrapped optimizer",
    ):
        ZeroOptimizer(torch.optim.AdamW(params), module=m)


def test_optimizer_that_already_stepped():
    m = _model()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"wrap the optimizer before its first step"):
        ZeroOptimizer(opt)


def test_bad_numbers():
    m = _model()
    with pytest.raises(ValueError, match=r"reduce_bucket_size must be >= 1 \(got 0\)"):
        ZeroOptimizer(torch.optim.AdamW(m.parameters()), reduce_bucket_size=0)
    with pytest.raises(ValueError, match=r"max_norm must be >= 0 \(got -1\)"):
        ZeroOptimizer(torch.optim.AdamW(m.parameters()), max_norm=-1)


def test_cpu_offload_without_fused_adam_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "zerostack.fused_adam", None)
    m = _model()
    with pytest.raises(ImportError, match=r"pip install zerostack-fused-adam"):
        ZeroOptimizer(torch.optim.AdamW(m.parameters()), cpu_offload=True)


def test_cpu_offload_keeps_other_optimizers():
    m = _model()
    z = ZeroOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), cpu_offload=True)
    assert isinstance(z.optimizer, torch.optim.SGD)
    assert all(s.master.device.type == "cpu" for s in z.shards)
