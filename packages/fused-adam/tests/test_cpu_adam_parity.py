"""CPUAdam against torch's Adam/AdamW run in float64, step by step."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DTYPES,
    HYPER,
    PARAM_TOL,
    SIZES,
    STEPS,
    adam_no_bias_correction,
    make_grads,
    make_params,
)
from conftest import run_parity as _run_parity

from zerostack.fused_adam import CPUAdam, HybridAdam, backend_info, set_cpu_schedule


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("gdt", DTYPES, ids=str)
@pytest.mark.parametrize("pdt", DTYPES, ids=str)
def test_parity_every_dtype_and_level(simd_level, pdt, gdt, adamw_mode):
    _run_parity(pdt, gdt, adamw_mode, sizes=SIZES, div_scale=4.0)


@pytest.mark.parametrize("div_scale", [-1.0, 1.0, 1024.0])
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16], ids=str)
def test_div_scale_is_honoured(simd_level, pdt, div_scale):
    _run_parity(pdt, pdt, False, sizes=[4097], div_scale=div_scale)


def test_no_weight_decay(simd_level):
    _run_parity(
        torch.float32,
        torch.float32,
        True,
        sizes=SIZES,
        div_scale=-1,
        hyper={**HYPER, "weight_decay": 0.0},
    )


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("pdt", DTYPES, ids=str)
def test_without_bias_correction(simd_level, pdt, adamw_mode):
    params = make_params(SIZES, pdt)
    ref = [p.double().clone() for p in params]
    ms = [torch.zeros_like(r) for r in ref]
    vs = [torch.zeros_like(r) for r in ref]
    opt = CPUAdam(params, adamw_mode=adamw_mode, bias_correction=False, **HYPER)
    for step in range(STEPS):
        grads = make_grads(params, pdt, step)
        for p, g, r, m, v in zip(params, grads, ref, ms, vs, strict=True):
            p.grad = g
            adam_no_bias_correction(r, g.double() / 2.0, m, v, adamw_mode=adamw_mode, **HYPER)
            r.copy_(r.to(pdt).double())
        opt.step(div_scale=2.0)
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.double(), r, **PARAM_TOL[pdt])


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16], ids=str)
def test_large_tensor(pdt, num_threads):
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        _run_parity(pdt, pdt, True, sizes=[2**20 + 3], div_scale=8.0)
    finally:
        torch.set_num_threads(before)


def _three_steps(sizes: list[int]) -> list[torch.Tensor]:
    """fp32 parameters of ``sizes`` after three CPUAdam steps on fixed gradients."""
    params = make_params(sizes, torch.float32)
    opt = CPUAdam(params, **HYPER)
    for step in range(3):
        for p, g in zip(params, make_grads(params, torch.float32, step), strict=True):
            p.grad = g
        opt.step()
    return params


def test_threads_do_not_change_results():
    results = []
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append(_three_steps([2**20 + 3, 5]))
    torch.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_both_schedules_give_the_same_bits():
    # Blocks taken by whichever thread is free, or a fixed share each: every
    # block of every tensor is stepped once, by the same arithmetic.
    results = []
    before = torch.get_num_threads(), backend_info()["cpu_schedule"]
    torch.set_num_threads(2)
    try:
        for schedule in ("static", "dynamic"):
            set_cpu_schedule(schedule)
            results.append(_three_steps([5 * 2**16 + 3, 7, 2**16]))
    finally:
        torch.set_num_threads(before[0])
        set_cpu_schedule(before[1])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(results[1][0], make_params([5 * 2**16 + 3], torch.float32)[0])


def test_every_simd_level_gives_the_same_bits(simd_level):
    # fp32 storage: every level runs the same fp32 operations in the same
    # order (fma included), so all levels must agree bit for bit with scalar.
    from zerostack.fused_adam import set_simd_level

    outs = {}
    for level in ("scalar", simd_level):
        set_simd_level(level)
        params = make_params([4097], torch.float32)
        opt = CPUAdam(params, **HYPER)
        for step in range(3):
            params[0].grad = make_grads(params, torch.float32, step)[0]
            opt.step()
        outs[level] = params[0]
    assert torch.equal(outs["scalar"], outs[simd_level])


def test_hybrid_adam_on_cpu_matches_reference():
    _run_parity(torch.float32, torch.bfloat16, True, sizes=SIZES, div_scale=2.0, opt_cls=HybridAdam)


def test_param_without_grad_is_skipped():
    params = make_params([5, 6], torch.float32)
    before = params[1].clone()
    opt = CPUAdam(params, lr=0.1)
    params[0].grad = torch.ones(5)
    opt.step()
    assert torch.equal(params[1], before)
    assert params[1] not in opt.state
    assert not torch.equal(params[0], torch.zeros(5))


def test_closure_loss_is_returned():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = CPUAdam([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == pytest.approx(5.0)
    assert w[0].item() == pytest.approx(0.9, abs=1e-6)


def test_param_groups_use_their_own_hyperparameters():
    a, b = make_params([64, 64], torch.float32)
    opt = CPUAdam([{"params": [a], "lr": 0.0}, {"params": [b], "lr": 0.1}])
    a0, b0 = a.clone(), b.clone()
    a.grad, b.grad = torch.ones(64), torch.ones(64)
    opt.step()
    assert torch.equal(a, a0)
    torch.testing.assert_close(b, b0 - 0.1)
