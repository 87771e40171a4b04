"""A model whose parameters and buffers change with torch.manual_seed, and a
capture of a logger's warnings: for the tests of rank 0's initial values
(zerostack.shard's [Note: rank 0's initial values])."""

from __future__ import annotations

import logging

import torch
from torch import nn


class BufferedNet(nn.Module):
    """Two linear layers, a frozen parameter and buffers of several kinds
    (a permutation, whose sum is the same on every rank; bool; not
    contiguous); ``every_kind`` adds a 0-dim int, a bf16 and a
    non-persistent one."""

    proj: torch.Tensor
    mask: torch.Tensor

    def __init__(self, every_kind: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.frozen = nn.Parameter(torch.randn(8), requires_grad=False)
        self.register_buffer("proj", torch.randn(8, 8))
        self.register_buffer("perm", torch.randperm(64))
        self.register_buffer("mask", torch.rand(8) > 0.3)
        self.register_buffer("cols", torch.randn(6, 8).t())
        if every_kind:
            self.register_buffer("count", torch.randint(1000, ()))
            self.register_buffer("low", torch.randn(5, dtype=torch.bfloat16))
            self.register_buffer("scratch", torch.randn(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x) + self.frozen) @ self.proj
        return self.out(h * self.mask).squeeze(-1)


def tensor_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter and buffer of ``model``, by name."""
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


class LogRecords(logging.Handler):
    """The messages logger ``name`` gives at ``level`` or above while in a ``with``."""

    def __init__(self, name: str, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.messages: list[str] = []
        self._logger = logging.getLogger(name)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> LogRecords:
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)


def reference_step(
    ref: nn.Module, ref_opt: torch.optim.Optimizer, step: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the torch reference on ``BufferedNet``'s input for
    ``step`` and ``rank``; the input and the reference's loss."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
    ref_loss = ref(x).pow(2).mean()
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return x, ref_loss
