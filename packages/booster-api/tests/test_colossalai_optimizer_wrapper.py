"""ColossalAI's ``OptimizerWrapper`` and ``ModelWrapper`` methods
(colossalai/interface/optimizer.py, model.py) on what ``booster.boost``
returns: each takes effect as ColossalAI's does, or raises saying what to
call instead. They were an ``AttributeError`` or a ``TypeError``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin

PLUGINS = ["none", "zero2", "gemini"]


def _plugin(name):
    if name == "gemini":
        return GeminiPlugin(precision="fp32", chunk_config_dict={1: {"chunk_size": 20_000}})
    if name == "zero2":
        return LowLevelZeroPlugin(stage=2, precision="fp32")
    return None


def _setup(name, mixed_precision=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    booster = Booster(plugin=_plugin(name), device="cpu" if name == "none" else None,
                      mixed_precision=mixed_precision)  # fmt: skip
    boosted, opt, *_ = booster.boost(model, optimizer)
    return booster, boosted, opt, optimizer, reference


def _values(boosted):
    return {k: v.float() for k, v in boosted.full_state_dict().items()}


@pytest.mark.parametrize("name", PLUGINS)
def test_backward_by_grad_trains_as_torchs_autograd_backward(name):
    _, boosted, opt, _, reference = _setup(name)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        dy = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 + step))
        y = boosted(x.to(next(boosted.parameters()).device))
        opt.backward_by_grad(y, dy.to(y.device))
        opt.step()
        opt.zero_grad()
        torch.autograd.backward(reference(x), dy)
        ref_opt.step()
        ref_opt.zero_grad()
    got = _values(boosted)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"backward_by_grad: grad must be a tensor shaped like"):
        opt.backward_by_grad(boosted(torch.randn(2, 8)), torch.ones(3, 4))


@pytest.mark.parametrize("name", ["zero2", "gemini"])
def test_get_grad_norm_is_the_last_steps_norm(name):
    _, boosted, opt, _, reference = _setup(name)
    assert opt.get_grad_norm() is None  # ColossalAI's: None before a step
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    opt.backward(boosted(x).pow(2).mean())
    opt.step()
    reference(x).pow(2).mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item()
    assert opt.get_grad_norm() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(NotImplementedError, match=r"get_grad_norm: the step computes the 2-norm"):
        opt.get_grad_norm(norm_type=1.0)


def test_get_grad_norm_without_a_sharding_plugin_names_clip_grad_by_norm():
    _, _, opt, _, _ = _setup("none")
    with pytest.raises(NotImplementedError, match=r"clip_grad_by_norm\(float\('inf'\)"):
        opt.get_grad_norm()


@pytest.mark.parametrize("name", PLUGINS)
def test_wrapper_properties_and_arguments_take_effect(name):
    _, boosted, opt, user, _ = _setup(name)
    assert opt.unwrap() is user
    assert opt.defaults is user.defaults
    assert [id(p) for p in opt.parameters] == [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(opt.parameters) == 4
    assert boosted.unwrap(unwrap_peft=False) is boosted.unwrap()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    opt.backward(boosted(x).pow(2).mean(), inputs=None)
    plain = opt.clip_grad_by_norm(float("inf"))
    assert torch.equal(opt.clip_grad_by_norm(float("inf"), 2.0, False, foreach=True), plain)
    opt.zero_grad()
    if name == "none":
        first = next(boosted.unwrap().parameters())
        opt.backward(boosted(x).pow(2).mean(), inputs=[first])
        assert [p.grad is not None for p in boosted.unwrap().parameters()] == [
            True, False, False, False,
        ]  # fmt: skip
    else:
        with pytest.raises(NotImplementedError, match=r"backward: inputs= is not supported"):
            opt.backward(boosted(x).pow(2).mean(), inputs=[torch.zeros(1)])
    for method in ("scale_loss", "unscale_grad"):
        args = (torch.tensor(1.0),) if method == "scale_loss" else ()
        with pytest.raises(NotImplementedError, match=rf"{method}: the (loss|gradients) (is|are)"):
            getattr(opt, method)(*args)


def test_scale_loss_and_unscale_grad_under_fp16_mixed_precision():
    _, boosted, opt, _, reference = _setup("none", mixed_precision="fp16")
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    loss = boosted(x).float().pow(2).mean()
    scale = opt.scaler.get_scale()
    scaled = opt.scale_loss(loss)
    assert scaled.item() == pytest.approx(loss.item() * scale, rel=1e-6)
    scaled.backward()
    opt.unscale_grad()
    opt.unscale_grad()  # a second call leaves them (GradScaler refuses a second unscale_)
    with torch.autocast("cpu", dtype=torch.float16):
        ref_loss = reference(x).float().pow(2).mean()
    ref_loss.backward()
    for got, want in zip(boosted.unwrap().parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-3, atol=1e-5)
    opt.step()  # does not unscale again
