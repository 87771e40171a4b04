"""Optimizers that cannot step flat pieces of the parameters are refused
where ZeroOptimizer is built (zero-shard's [Note: optimizers over flat
pieces]); the element-wise ones of torch.optim step as torch does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zerostack.shard import ZeroOptimizer, check_flat_optimizer

SHAPED = {
    "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "LBFGS": lambda ps: torch.optim.LBFGS(ps),
    "SparseAdam": lambda ps: torch.optim.SparseAdam(ps),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}
EXACT = {
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2, foreach=False),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=0, foreach=False),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, foreach=False),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, foreach=False),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, foreach=False),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, foreach=False),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, foreach=False),
}


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return (self.b(h) if use_b else h).pow(2).sum()


@pytest.mark.parametrize("name", list(SHAPED))
def test_an_optimizer_that_cannot_step_flat_shards_is_refused(name):
    """Adafactor under ZeRO-2 was 7.3e-3 off torch after four steps, silently;
    Adagrad was refused as an optimizer that already stepped."""
    model = nn.Linear(8, 8)
    with pytest.raises(NotImplementedError, match=rf"torch.optim.{name} cannot step the flat"):
        ZeroOptimizer(SHAPED[name](model.parameters()), module=model)


@pytest.mark.parametrize("name", list(EXACT))
def test_element_wise_torch_optimizers_step_as_torch(name):
    """Per-parameter state (step sizes, step counts) holds in ZeRO's pieces,
    with a parameter without a gradient at some steps."""
    torch.manual_seed(0)
    ref = _Branch()
    model = copy.deepcopy(ref)
    ref_opt = EXACT[name](list(ref.parameters()))
    opt = ZeroOptimizer(EXACT[name](list(model.parameters())), module=model)
    for step, use_b in enumerate([True, False, True, True]):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        ref(x, use_b).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(model(x, use_b))
        opt.step()
        opt.zero_grad()
    got = model.state_dict()
    for key, want in ref.state_dict().items():
        torch.testing.assert_close(got[key], want, rtol=1e-6, atol=1e-7)


def test_chunks_refuse_the_optimizers_that_keep_one_number_per_parameter():
    params = [nn.Parameter(torch.zeros(4))]
    for make in (EXACT["Rprop"], EXACT["ASGD"]):
        optimizer = make(params)
        check_flat_optimizer("Flat", optimizer, chunks=False)
        with pytest.raises(NotImplementedError, match=r"^Chunks: torch.optim.(Rprop|ASGD) .*"):
            check_flat_optimizer("Chunks", optimizer, chunks=True)
