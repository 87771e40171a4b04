"""Ranks that build their model from different seeds start from rank 0's
model once boosted, as under torch DDP (zerostack.shard's [Note: rank 0's
initial values]): LowLevelZeroPlugin (with and without an optimizer) and
GeminiPlugin broadcast rank 0's parameters and buffers."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin
from zerostack.testing import spawn


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("proj", torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) @ self.proj).sum(-1)


CASES = {
    "zero2": (lambda: LowLevelZeroPlugin(stage=2, precision="fp32"), True),
    "zero2-no-optimizer": (lambda: LowLevelZeroPlugin(stage=2, precision="fp32"), False),
    "gemini": (lambda: GeminiPlugin(precision="fp32"), True),
}


def _boost_seeded_per_rank(rank, world):
    for name, (make, with_optimizer) in CASES.items():
        torch.manual_seed(100 + rank)
        net = _Net()
        before = {n: t.detach().clone() for n, t in net.state_dict().items()}
        opt = torch.optim.SGD(net.parameters(), lr=0.1) if with_optimizer else None
        model, *_ = Booster(plugin=make()).boost(net, opt)
        every = [None] * world
        dist.all_gather_object(every, before)
        assert not torch.equal(every[0]["lin.weight"], every[1]["lin.weight"]), name
        now = {k.removeprefix("module."): v for k, v in model.state_dict().items()}
        for n, want in every[0].items():
            assert torch.equal(now[n].float().cpu(), want), (
                f"{name} rank {rank}: {n} is not rank 0's"
            )


def test_boosted_ranks_start_from_rank_0s_model():
    spawn(_boost_seeded_per_rank, 2, backend="gloo", timeout_s=120)
