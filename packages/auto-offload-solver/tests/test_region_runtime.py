"""Region's runtime methods on a CPU device, and the fp16 overflow skip."""

from __future__ import annotations

import math

import torch
from offload_helpers import batch, fake_profile, lm_loss, tiny_gpt2

from zerostack.auto_offload import AMPOptimizer, Region, memory_optimize


def _region():
    r = Region(0)
    a = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).view(2, 3))
    b = torch.nn.Parameter(torch.full((4,), 0.5))
    r.params, r.grad_params = [a, b], [a, b]
    masters = {id(a): a.data.clone(), id(b): b.data.clone()}
    r.init_param_data(torch.device("cpu"), torch.bfloat16, masters)
    return r, a, b


def test_storage_moves_and_views_stay_valid():
    r, a, _ = _region()
    assert not r.is_resident and a.untyped_storage().nbytes() == 0  # freed after init
    r.move_param_to_cuda()
    assert r.is_resident and a.dtype == torch.bfloat16
    saved_view = a.t()  # as autograd would save it in forward
    torch.testing.assert_close(saved_view.float(), torch.arange(6.0).view(2, 3).t())
    r.free_cuda_data()
    r.cpu_half.fill_(2.0)  # what the optimizer's copy-out would write
    r.move_param_to_cuda()  # the same storage grows back: old views see the new data
    assert torch.equal(saved_view.float(), torch.full((3, 2), 2.0))
    assert r.param_numel == 10 and r.param_bytes == 20 and r.grad_numel == 10


def test_gradients_release_and_overflow_flags():
    r, a, b = _region()
    r.move_param_to_cuda()
    r.copy_grad_to_region_slice(a, torch.ones(2, 3))
    assert not r.can_release
    r.copy_grad_to_region_slice(b, torch.full((4,), 2.0))
    assert r.can_release and not bool(r.has_inf_or_nan)
    assert float(r.grad_norm_sq()) == 6 * 1.0 + 4 * 4.0
    r.move_grad_to_cpu()
    assert not r.is_resident and r.grad_numel_done == 0
    assert r.cpu_grad.float().tolist() == [1.0] * 6 + [2.0] * 4
    r.move_param_to_cuda()
    r.copy_grad_to_region_slice(a, torch.full((2, 3), math.inf))
    assert bool(r.has_inf_or_nan) and not math.isfinite(float(r.grad_norm_sq()))


def test_fp16_overflow_skips_the_step_and_backs_off():
    om = memory_optimize(
        tiny_gpt2(1), batch(), precision="fp16", device="cpu", profile=fake_profile()
    )
    opt = AMPOptimizer(torch.optim.SGD(om.master_parameters(), lr=0.1), om, hysteresis=1)
    before = [m.detach().clone() for m in om.master_parameters()]
    halves = [r.cpu_half.clone() for r in om.regions if r.params]
    opt.zero_grad()
    out = om(**batch())
    opt.backward(lm_loss(out, batch()["input_ids"]) * math.inf)
    assert opt.step() is None and opt.loss_scale == 2.0**15
    assert all(torch.equal(m, b) for m, b in zip(om.master_parameters(), before, strict=True))
    assert all(
        torch.equal(r.cpu_half, h)
        for r, h in zip([r for r in om.regions if r.params], halves, strict=True)
    )
    opt.zero_grad()
    out = om(**batch())
    opt.backward(lm_loss(out, batch()["input_ids"]))
    opt.step()
    assert not all(torch.equal(m, b) for m, b in zip(om.master_parameters(), before, strict=True))
    assert math.isfinite(opt.last_grad_norm) and opt.last_grad_norm > 0


def test_frozen_and_unread_values_are_not_gradients():
    r = Region(0)
    a = torch.nn.Parameter(torch.zeros(3))
    frozen = torch.nn.Parameter(torch.full((2,), math.inf), requires_grad=False)
    b = torch.nn.Parameter(torch.zeros(2))
    r.params, r.grad_params = [a, frozen, b], [a, b]
    r.init_param_data(torch.device("cpu"), torch.bfloat16, {id(p): p.data for p in r.params})
    r.move_param_to_cuda()
    r.copy_grad_to_region_slice(a, torch.ones(3))
    r.copy_grad_to_region_slice(b, torch.full((2,), 3.0))
    assert r.can_release and r.grad_numel == 5
    assert math.isclose(float(r.grad_norm_sq()), 3 * 1.0 + 2 * 9.0, rel_tol=1e-6)  # inf: a value
    assert not bool(r.has_inf_or_nan)
