"""The step hooks users register on the optimizer they hand to
``booster.boost`` (zerostack.shard's [Note: the user's step hooks]): a
pre-hook runs once a step, with that optimizer, and what it sets stays, as
in torch; a post-hook runs once a step where that optimizer steps itself
(ZeRO without ``cpu_offload``) and raises where the updates run on a worker."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin

PLUGINS = {
    "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
    "zero2-cpu-offload": lambda: LowLevelZeroPlugin(stage=2, precision="fp32", cpu_offload=True),
    "gemini": lambda: GeminiPlugin(precision="fp32"),
    "gemini-auto": lambda: GeminiPlugin(
        precision="fp32", placement_policy="auto", gpu_capacity_bytes=2000
    ),
}


def _halve_lr(seen: list):
    def hook(optimizer, args, kwargs):
        seen.append(optimizer)
        for group in optimizer.param_groups:
            group["lr"] *= 0.5

    return hook


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_a_pre_hook_runs_once_a_step_on_the_users_optimizer_and_its_lr_stays(plugin):
    """Under cpu_offload and Gemini the hook ran on an inner copy of the
    optimizer, once per CPU update, and the lr it halved was set back from
    the user's groups at the next step: 9.4e-3 off torch after two SGD steps."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_seen: list = []
    ref_opt.register_step_pre_hook(_halve_lr(ref_seen))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    seen: list = []
    opt.register_step_pre_hook(_halve_lr(seen))
    booster = Booster(plugin=PLUGINS[plugin]())
    model, boosted, *_ = booster.boost(net, opt)
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        booster.backward(model(x).square().mean(), boosted)
        boosted.step()
        boosted.zero_grad()
    boosted.wait_updates()
    assert len(seen) == 4 and all(o is opt for o in seen), (len(seen), plugin)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 * 0.5**4
    got = model.state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[f"module.{name}"], value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_a_post_hook_runs_once_a_step_or_raises_where_updates_run_on_a_worker(plugin):
    """A post-hook ran once per CPU update (twice a step under Gemini's auto
    placement): a hook that scales the parameters scaled them twice."""
    torch.manual_seed(0)
    net = nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    calls: list = []
    opt.register_step_post_hook(lambda optimizer, args, kwargs: calls.append(optimizer))
    booster = Booster(plugin=PLUGINS[plugin]())
    model, boosted, *_ = booster.boost(net, opt)
    booster.backward(model(torch.randn(4, 8)).square().mean(), boosted)
    if plugin != "zero2":
        with pytest.raises(
            NotImplementedError, match=r"a step post-hook \(register_step_post_hook\)"
        ):
            boosted.step()
        return
    boosted.step()
    assert calls == [opt]


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_torchs_global_step_hooks_run_once_a_step_with_the_users_optimizer(plugin, caplog):
    """torch's global hooks (register_optimizer_step_pre_hook, ..._post_hook:
    step counters, memory trackers) ran once per inner step, with an inner
    optimizer: twice a step under Gemini's auto placement."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    booster = Booster(plugin=PLUGINS[plugin]())
    model, boosted, *_ = booster.boost(net, opt)
    calls: list = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o))),
        register_optimizer_step_post_hook(lambda o, args, kwargs: calls.append(("post", o))),
    ]
    try:
        with caplog.at_level(logging.INFO, logger="zerostack.shard._hyper"):
            for _ in range(3):
                booster.backward(model(torch.randn(4, 8)).square().mean(), boosted)
                boosted.step()
                boosted.zero_grad()
        boosted.wait_updates()
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [("pre", opt), ("post", opt)] * 3, (plugin, calls)
    # Where updates run on a worker, the post-hooks wait for them: said once.
    said = [r for r in caplog.records if "post-hooks are registered" in r.getMessage()]
    assert len(said) == (plugin != "zero2"), [r.getMessage() for r in said]
