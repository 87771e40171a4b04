"""``optimizer.zero_grad(set_to_none=False)`` on a boosted optimizer: the
gradients live in the plugin's shards or chunks, so they are dropped as
with ``set_to_none=True``; a parameter that gets no gradient in a later step
is then not stepped, where torch steps its kept zero ``.grad``. Said once."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin

PLUGINS = {
    "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
    "zero2-cpu-offload": lambda: LowLevelZeroPlugin(stage=2, precision="fp32", cpu_offload=True),
    "gemini": lambda: GeminiPlugin(precision="fp32"),
}


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_zero_grad_keeping_zeros_says_once_that_the_gradients_are_dropped(plugin):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    booster = Booster(plugin=PLUGINS[plugin]())
    model, optimizer, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.warns(
        UserWarning, match=r"zero_grad\(set_to_none=False\): the gradients are dropped"
    ):
        optimizer.zero_grad(set_to_none=False)
    booster.backward(model(torch.randn(4, 8)).square().mean(), optimizer)
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.zero_grad(set_to_none=False)  # once
        optimizer.zero_grad()
