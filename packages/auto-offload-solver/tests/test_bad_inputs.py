"""Bad inputs to the auto-offload entry points (memory_optimize,
AMPOptimizer, HardwareProfile.from_dict): each case raises the right error,
names the argument, and changes nothing (the model handed in, the planned
module's masters and the optimizer's state); a training step still works
afterwards. See docs/reliability.md."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from offload_helpers import batch, fake_profile, tiny_gpt2

from zerostack.auto_offload import AMPOptimizer, HardwareProfile, memory_optimize
from zerostack.testing import (
    BadInput,
    GPTConfig,
    TinyGPT,
    check_bad_input,
    check_unique_ids,
    one_torch_thread,
)


@pytest.fixture(scope="module")
def planned() -> dict[str, Any]:
    """One planned module and its optimizer (planning takes seconds)."""
    with one_torch_thread():
        torch.manual_seed(0)
        om = memory_optimize(
            tiny_gpt2(1), batch(), precision="bf16", device="cpu", profile=fake_profile()
        )
    return {"om": om, "opt": AMPOptimizer(torch.optim.SGD(om.master_parameters(), lr=0.1), om)}


@pytest.fixture
def env(planned) -> dict[str, Any]:
    torch.manual_seed(1)
    return {**planned, "model": TinyGPT(GPTConfig(num_layers=1, dim=16, num_heads=2))}


def _snapshot(env):
    return {
        "model": [p.detach().clone() for p in env["model"].parameters()],
        "model_dtype_device": [(p.dtype, p.device) for p in env["model"].parameters()],
        "masters": [p.detach().clone() for p in env["om"].master_parameters()],
        "state": env["opt"].optim.state_dict(),
    }


def _still_works(env):
    before = [p.detach().clone() for p in env["om"].master_parameters()]
    opt = env["opt"]
    opt.backward(env["om"](**batch()).float().mean())
    opt.step()
    opt.zero_grad()
    after = list(env["om"].master_parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _mo(*args, **kwargs):
    def call(env):
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("profile", fake_profile())
        return memory_optimize(env["model"], *args, **kwargs)

    return call


def _amp(**kwargs):
    return lambda env: AMPOptimizer(
        torch.optim.SGD(env["om"].master_parameters(), lr=0.1), env["om"], **kwargs
    )


def _profile_without(name):
    def call(env):
        data = {
            "device_name": "x", "device_memory_bytes": 10**9, "h2d_bandwidth": {4096: 1e9},
            "d2h_bandwidth": {4096: 1e9}, "gemm_flops": {"float32": 1e11}, "memory_bandwidth": 1e11,
        }  # fmt: skip
        del data[name]
        return HardwareProfile.from_dict(data)

    return call


# fmt: off
CASES = [
    # -- memory_optimize ---------------------------------------------------------------------
    BadInput("memory-optimize-model-str", lambda env: memory_optimize("gpt2", batch(), device="cpu", profile=fake_profile()), TypeError, r"memory_optimize: model must be an nn\.Module \(got str\)", True),
    BadInput("memory-optimize-inputs-list", _mo([1, 2]), TypeError, r"memory_optimize: inputs must be a dict .* or a tuple .* \(got list\)", True),
    BadInput("memory-optimize-budget-str", _mo(batch(), "1GB"), TypeError, r"memory_optimize: memory_budget must be a number of bytes \(got '1GB'\)", True),
    BadInput("memory-optimize-budget-nan", _mo(batch(), math.nan), ValueError, r"memory_optimize: memory_budget must be a number of bytes \(got nan\)", True),
    BadInput("memory-optimize-solver", _mo(batch(), solver_name="greedy"), ValueError, r"unknown solver_name 'greedy'; use one of \['asyn', 'syn'\]"),
    BadInput("memory-optimize-precision", _mo(batch(), precision="fp8"), ValueError, r"memory_optimize: precision must be one of \['bf16', 'fp16'\] \(got 'fp8'\)"),
    BadInput("memory-optimize-profile-dict", _mo(batch(), profile={"device_name": "x"}), TypeError, r"memory_optimize: profile must be a HardwareProfile or None \(got dict\)", True),
    BadInput("memory-optimize-device-bogus", _mo(batch(), device="gpu"), ValueError, r"memory_optimize: device is not a device \(got 'gpu'\)", True),
    BadInput("memory-optimize-device-list", _mo(batch(), device=["cpu"]), TypeError, r"memory_optimize: device must be a str, a torch\.device or None \(got \['cpu'\]\)", True),
    # -- AMPOptimizer ------------------------------------------------------------------------
    BadInput("amp-optimizer-str", lambda env: AMPOptimizer("sgd", env["om"]), TypeError, r"AMPOptimizer: optimizer must be a torch\.optim\.Optimizer \(got str\)", True),
    BadInput("amp-module-plain", lambda env: AMPOptimizer(torch.optim.SGD(env["model"].parameters(), lr=0.1), env["model"]), TypeError, r"AMPOptimizer: module must be the BaseOffloadModule memory_optimize returned \(got TinyGPT\)", True),
    BadInput("amp-foreign-parameter", lambda env: AMPOptimizer(torch.optim.SGD(env["model"].parameters(), lr=0.1), env["om"]), ValueError, r"AMPOptimizer: the optimizer holds a tensor of shape .* that is not a parameter of the offloaded module"),
    BadInput("amp-norm-type", _amp(norm_type=1.0), NotImplementedError, r"AMPOptimizer: norm_type must be 2\.0 \(got 1\.0\)"),
    BadInput("amp-clipping-norm-negative", _amp(clipping_norm=-1.0), ValueError, r"AMPOptimizer: clipping_norm must be >= 0 \(got -1\.0\)"),
    BadInput("amp-clipping-norm-str", _amp(clipping_norm="1"), TypeError, r"AMPOptimizer: clipping_norm must be a number \(got '1'\)", True),
    # -- HardwareProfile.from_dict -----------------------------------------------------------
    BadInput("profile-not-a-dict", lambda env: HardwareProfile.from_dict([1]), TypeError, r"HardwareProfile\.from_dict: data must be a dict of the fields \(got list\)", True),
    BadInput("profile-missing-field", _profile_without("gemm_flops"), ValueError, r"HardwareProfile\.from_dict: missing fields \['gemm_flops'\]"),
    BadInput("profile-unknown-field", lambda env: HardwareProfile.from_dict({"gpu": "x"}), ValueError, r"unknown fields \['gpu'\]"),
    BadInput("profile-memory-negative", lambda env: fake_profile(device_memory_bytes=-1), ValueError, r"HardwareProfile: device_memory_bytes must be > 0 \(got -1\)"),
    BadInput("profile-memory-str", lambda env: fake_profile(device_memory_bytes="lots"), TypeError, r"HardwareProfile: device_memory_bytes must be a number \(got 'lots'\)", True),
    BadInput("profile-name-int", lambda env: fake_profile(device_name=3), TypeError, r"HardwareProfile: device_name must be a str \(got 3\)", True),
    BadInput("profile-bandwidth-negative", lambda env: fake_profile(h2d_bandwidth={4096: -1.0}), ValueError, r"HardwareProfile: h2d_bandwidth needs positive sizes and finite positive bandwidths \(got 4096: -1\.0\)"),
    BadInput("profile-bandwidth-float", lambda env: fake_profile(d2h_bandwidth=1e9), ValueError, r"HardwareProfile: d2h_bandwidth must be a non-empty dict .* \(got 1000000000\.0\)"),
    BadInput("profile-gemm-dtype", lambda env: fake_profile(gemm_flops={"float8": 1e12}), ValueError, r"HardwareProfile: gemm_flops must map dtype names .* \(got \{'float8': 1000000000000\.0\}\)", True),
    BadInput("profile-launch-negative", lambda env: fake_profile(kernel_launch_s=-1), ValueError, r"HardwareProfile: kernel_launch_s must be >= 0 \(got -1\)"),
    BadInput("profile-memory-bandwidth-0", lambda env: fake_profile(memory_bandwidth=0), ValueError, r"HardwareProfile: memory_bandwidth must be > 0 bytes/s \(got 0\)"),
]
# fmt: on


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: BadInput, env: dict[str, Any]) -> None:
    with one_torch_thread():
        check_bad_input(case, env, _snapshot, _still_works)


def test_the_table_names_every_case_once() -> None:
    check_unique_ids(CASES)
