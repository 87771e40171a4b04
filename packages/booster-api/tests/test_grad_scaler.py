"""torch.amp.GradScaler around a boosted optimizer (booster-api's [Note:
torch's GradScaler]): under the sharded plugins it raises naming the
plugin's own loss scaling, where it failed with torch's "No inf checks were
recorded for this optimizer" or a message about clipping; under
TorchDDPPlugin it works as in torch."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from zerostack.testing import spawn

SHARDED = {
    "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
    "zero2-cpu-offload": lambda: LowLevelZeroPlugin(stage=2, precision="fp32", cpu_offload=True),
    "gemini": lambda: GeminiPlugin(precision="fp32"),
}
_REFUSED = (
    r"torch.amp.GradScaler cannot scale this optimizer's steps .*Drop the GradScaler .*"
    r"precision='fp16' scales the loss dynamically"
)


def _boost(plugin):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return booster, model, optimizer


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-then-step"])
@pytest.mark.parametrize("plugin", list(SHARDED))
def test_torchs_grad_scaler_is_refused_naming_the_plugins_loss_scaling(plugin, unscale_first):
    booster, model, optimizer = _boost(SHARDED[plugin]())
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(4, 8)
    scaler.scale(model(x).square().mean()).backward()
    with pytest.raises(RuntimeError, match=_REFUSED) as refused:
        if unscale_first:  # before clipping, as torch's AMP recipe does
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
    assert re.match(r"(LowLevelZeroOptimizer|GeminiDDP)[.:]", str(refused.value)), refused.value
    optimizer.zero_grad()  # the scaled batch goes; training goes on without the scaler
    before = [v.clone() for v in model.state_dict().values()]
    booster.backward(model(x).square().mean(), optimizer)
    assert optimizer.step() is not False
    optimizer.zero_grad()
    after = model.state_dict().values()  # waits for cpu_offload's updates
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


def _ddp_matches_torch(rank, world):
    def train(boosted: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        model, optimizer = net, torch.optim.SGD(net.parameters(), lr=0.1)
        if boosted:
            model, optimizer, *_ = Booster(plugin=TorchDDPPlugin()).boost(net, optimizer)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            scaler.scale(model(x).square().mean()).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        return [p.detach().clone() for p in net.parameters()]

    for got, want in zip(train(True), train(False), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_torchs_grad_scaler_works_under_torch_ddp_as_in_torch():
    spawn(_ddp_matches_torch, 1, backend="gloo")
