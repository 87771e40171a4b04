"""A submodule or parameter assigned into the model after GeminiDDP wrapped
it (GeminiDDP's [Note: the structure is fixed once wrapped]): it raises at
the assignment, where state_dict() kept the old values silently."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from zerostack.gemini import GeminiDDP, GeminiOptimizer

_REFUSED = r"was assigned a .* after the model was wrapped .*Build the model whole"


def _wrap():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.0), nn.Linear(16, 1))
    ddp = GeminiDDP(net, chunk_config_dict={1: {"chunk_size": 256, "keep_gathered": False}},
                    compute_device="cpu", mixed_precision=torch.float32)  # fmt: skip
    return net, ddp


def _step(ddp):
    opt = GeminiOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
    opt.backward(ddp(torch.ones(2, 8)).square().mean())
    opt.step()
    opt.zero_grad()


def test_a_submodule_with_parameters_assigned_after_wrapping_raises_and_changes_nothing():
    """It used to be used in forward and never trained, and state_dict()
    kept the replaced head's values (0.67 off in the first version)."""
    net, ddp = _wrap()
    head = net[2]
    before = {k: v.clone() for k, v in ddp.state_dict().items()}
    with pytest.raises(
        RuntimeError, match=r"^GeminiDDP: 2 was assigned a submodule after .*\(got a new Linear\)"
    ):
        net[2] = nn.Linear(16, 1)
    with pytest.raises(RuntimeError, match=_REFUSED):
        net.add_module("extra", nn.Linear(1, 1))
    assert net[2] is head and not hasattr(net, "extra")
    for name, value in ddp.state_dict().items():
        assert torch.equal(value, before[name]), name
    _step(ddp)  # training goes on


def test_a_parameter_assigned_after_wrapping_raises():
    """Tying two weights after wrapping (lm_head.weight = wte.weight) is one."""
    net, ddp = _wrap()
    weight = net[0].weight
    with pytest.raises(RuntimeError, match=r"GeminiDDP: 0.weight was assigned a parameter"):
        net[0].weight = nn.Parameter(torch.zeros(16, 8))
    assert net[0].weight is weight
    _step(ddp)


def test_assignments_that_change_no_parameter_pass():
    net, ddp = _wrap()
    net[1] = nn.Identity()  # no parameters in place of none
    net[2] = net[2]  # the same module again
    net[0].weight = net[0].weight
    net.extra_flag = True  # not a module
    _step(ddp)
    assert isinstance(net[1], nn.Identity)


def test_modules_no_live_gemini_ddp_holds_are_not_watched():
    other = nn.Sequential(nn.Linear(2, 2))
    other[0] = nn.Linear(2, 3)  # never wrapped
    net, ddp = _wrap()
    del ddp
    gc.collect()
    net[2] = nn.Linear(16, 1)  # its wrapper is gone
