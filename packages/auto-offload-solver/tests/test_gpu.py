"""On a CUDA device (the `gpu` session): parity of the offloaded module with
plain training for 10 steps in bf16 and fp16 with clipping, for both plans,
and the measured peak against the budget."""

from __future__ import annotations

import pytest
import torch
from offload_helpers import batch, lm_loss, offload_losses, reference_losses, tiny_gpt2, tiny_llama

from zerostack.auto_offload import AMPOptimizer, HardwareProfile, memory_optimize, plan_offload
from zerostack.fused_adam import HybridAdam

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
HYPER = dict(lr=1e-3, weight_decay=0.1, clip=0.5)
PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _gpt2():
    return tiny_gpt2(4)


def _llama():
    return tiny_llama(8, hidden=512, intermediate=2048)  # ~8 MiB of bf16 parameters a layer


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return HardwareProfile.measure(cache_dir=tmp_path_factory.mktemp("profile"))


_BUDGETS: dict = {}


def _budget(build, solver, precision, profile, inputs, frac=0.5):
    """Between the least plan and no offload (one trace per model and solver:
    fp16 and bf16 plans have the same bytes)."""
    key = (build.__name__, solver, frac)
    if key not in _BUDGETS:
        _BUDGETS[key] = _plan_budget(build, solver, precision, profile, inputs, frac)
    return _BUDGETS[key]


def _plan_budget(build, solver, precision, profile, inputs, frac):
    _, rm, _ = plan_offload(build(), inputs, -1, solver, precision=precision, profile=profile)
    free = rm.solver.best_ts.peak_mem
    least = rm.solver.least_memory_plan().peak_mem
    return (least + frac * (free - least)) / 0.95


def test_measured_profile_is_sane(profile):
    assert profile.device_memory_bytes > 1 << 30
    assert 1e9 < profile.bandwidth("h2d", 1 << 28) < 1e12  # 1 GB/s .. 1 TB/s
    assert profile.gemm_flops["bfloat16"] > 1e12
    assert 0 < profile.kernel_launch_s < 1e-3


@pytest.mark.parametrize("solver", ["syn", "asyn"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_parity_ten_steps(precision, solver, profile):
    inputs = batch(4, 32)
    torch.manual_seed(0)
    model = _gpt2()
    scale = 2.0**16 if precision == "fp16" else 1.0
    ref, ref_masters = reference_losses(
        model, inputs, steps=10, dtype=PRECISION[precision], device="cuda", scale=scale, **HYPER
    )
    budget = _budget(_gpt2, solver, precision, profile, inputs)
    losses, masters, om, opt = offload_losses(
        model, inputs, steps=10, precision=precision, device="cuda", solver=solver,
        budget=budget, profile=profile, **HYPER,
    )  # fmt: skip
    assert any(r.need_offload for r in om.regions)
    if precision == "fp16":
        assert opt.loss_scale == 2.0**16  # no overflow in these 10 steps
    torch.testing.assert_close(losses, ref, rtol=5e-3, atol=5e-3)
    for m, r in zip(masters, ref_masters, strict=True):
        torch.testing.assert_close(m.detach(), r.cpu(), rtol=0, atol=4 * HYPER["lr"])
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("solver", ["syn", "asyn"])
def test_peak_within_budget(solver, profile):
    """A model whose parameters matter: the measured peak stays under the budget."""
    inputs = batch(8, 128)
    budget = _budget(_llama, solver, "bf16", profile, inputs, frac=0.3)
    om = memory_optimize(_llama(), inputs, budget, solver, precision="bf16", profile=profile)
    opt = AMPOptimizer(HybridAdam(om.master_parameters(), lr=1e-3), om, clipping_norm=1.0)
    # cuBLAS allocates its workspace through the caching allocator at the first
    # matmul, outside any plan: allocate it before the baseline is read.
    torch.ones(64, 64, device="cuda", dtype=torch.bfloat16).matmul(
        torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    )
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        opt.zero_grad()
        out = om(**inputs)
        opt.backward(lm_loss(out, out.new_zeros(out.shape[:2], dtype=torch.long)))
        opt.step()
    peak = torch.cuda.max_memory_allocated() - base
    predicted = om.region_manager.solver.best_ts.peak_mem
    print(f"{solver}: budget {budget / 2**20:.1f} MiB, predicted {predicted / 2**20:.1f} MiB, "
          f"measured {peak / 2**20:.1f} MiB")  # fmt: skip
    assert peak <= budget
