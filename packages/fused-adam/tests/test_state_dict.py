"""state_dict() round-trips with torch.optim.AdamW."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import small_model, train_steps

from zerostack.fused_adam import CPUAdam, HybridAdam

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("cls", [CPUAdam, HybridAdam])
def test_torch_adamw_state_loads_into_ours_and_continues_identically(cls):
    ref_model = small_model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    train_steps(ref_model, ref_opt, 3, seed=1)

    ours_model = small_model()
    ours_model.load_state_dict(ref_model.state_dict())
    ours_opt = cls(ours_model.parameters(), **HYPER)
    ours_opt.load_state_dict(ref_opt.state_dict())
    for st in ours_opt.state.values():
        assert st["step"].device.type == "cpu" and st["step"].dtype == torch.float32
        assert float(st["step"]) == 3

    ref_losses = train_steps(ref_model, ref_opt, 5, seed=2)
    ours_losses = train_steps(ours_model, ours_opt, 5, seed=2)
    torch.testing.assert_close(ours_losses, ref_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_our_state_loads_into_torch_adamw():
    ours_model = small_model()
    ours_opt = CPUAdam(ours_model.parameters(), **HYPER)
    train_steps(ours_model, ours_opt, 3, seed=1)

    ref_model = small_model()
    ref_model.load_state_dict(ours_model.state_dict())
    ref_opt = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    ref_opt.load_state_dict(copy.deepcopy(ours_opt.state_dict()))  # torch aliases otherwise

    ref_losses = train_steps(ref_model, ref_opt, 5, seed=2)
    ours_losses = train_steps(ours_model, ours_opt, 5, seed=2)
    torch.testing.assert_close(ours_losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_round_trip_through_our_own_state_dict():
    a_model, b_model = small_model(), small_model()
    a_opt = CPUAdam(a_model.parameters(), **HYPER)
    train_steps(a_model, a_opt, 3, seed=1)
    b_model.load_state_dict(a_model.state_dict())
    b_opt = CPUAdam(b_model.parameters(), **HYPER)
    b_opt.load_state_dict(a_opt.state_dict())
    assert train_steps(a_model, a_opt, 4, seed=3) == train_steps(b_model, b_opt, 4, seed=3)


def test_bf16_param_with_bf16_torch_states_loads_as_fp32():
    p = torch.nn.Parameter(torch.randn(16).bfloat16())
    ref = torch.optim.AdamW([p], foreach=False, **HYPER)
    p.grad = torch.randn(16).bfloat16()
    ref.step()
    assert ref.state[p]["exp_avg"].dtype == torch.bfloat16
    opt = CPUAdam([p], **HYPER)
    opt.load_state_dict(ref.state_dict())
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    opt.step()
    assert float(opt.state[p]["step"]) == 2


def test_torch_adam_state_keeps_its_l2_decay():
    """torch.optim.Adam's groups say decoupled_weight_decay=False: loaded into
    an optimizer built with adamw_mode=True, the steps go on as torch's Adam
    (L2), not AdamW."""
    ref_model = small_model()
    ref_opt = torch.optim.Adam(ref_model.parameters(), foreach=False, **HYPER)
    train_steps(ref_model, ref_opt, 3, seed=1)

    ours_model = small_model()
    ours_model.load_state_dict(ref_model.state_dict())
    ours_opt = CPUAdam(ours_model.parameters(), adamw_mode=True, **HYPER)
    ours_opt.load_state_dict(ref_opt.state_dict())
    assert [g["adamw_mode"] for g in ours_opt.param_groups] == [False]

    ref_losses = train_steps(ref_model, ref_opt, 5, seed=2)
    ours_losses = train_steps(ours_model, ours_opt, 5, seed=2)
    torch.testing.assert_close(ours_losses, ref_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
