"""Ranks that build their model from different seeds train rank 0's model, as
under torch DDP (zerostack.shard's [Note: rank 0's initial values]): GeminiDDP
broadcasts rank 0's parameters and buffers before they go into chunks when
the ranks differ, says so once, and broadcasts nothing when they agree."""

from __future__ import annotations

import copy
import logging
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import spawn

STEPS = 5
TOL32 = dict(rtol=1e-6, atol=1e-6)
CHUNKS = {2: {"chunk_size": 64, "keep_gathered": False}}  # several chunks, each sharded


class _Net(nn.Module):
    """Parameters, a frozen one, and buffers of several kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.frozen = nn.Parameter(torch.randn(8), requires_grad=False)
        self.register_buffer("proj", torch.randn(8, 8))
        self.register_buffer("perm", torch.randperm(64))  # the same sum on every rank
        self.register_buffer("mask", torch.rand(8) > 0.3)  # bool
        self.register_buffer("cols", torch.randn(6, 8).t())  # not contiguous

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x) + self.frozen) @ self.proj
        return self.out(h * self.mask).squeeze(-1)


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


class _Records(logging.Handler):
    """The warnings of zerostack.shard's sync_from_rank0, while in a ``with``."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._logger = logging.getLogger("zerostack.shard._rank0_sync")

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Records:
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)


def _wrap(model):
    ddp = GeminiDDP(model, mixed_precision=torch.float32, chunk_config_dict=CHUNKS,
                    compute_device="cpu")  # fmt: skip
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ddp, GeminiOptimizer(torch.optim.SGD(trainable, lr=0.1, momentum=0.9), ddp)


def _differently_seeded(rank, world):
    torch.manual_seed(100 + rank)
    model = _Net()
    before = _values(model)
    ref = DDP(copy.deepcopy(model))  # DDP broadcasts rank 0's values
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1,
                              momentum=0.9)  # fmt: skip
    with _Records() as said:
        ddp, opt = _wrap(model)
    every = [None] * world
    dist.all_gather_object(every, before)
    now = {**ddp.state_dict(), **dict(ddp.module.named_buffers())}
    for n, want in every[0].items():
        assert torch.equal(now[n].detach(), want), f"rank {rank}: {n} is not rank 0's"
    differ = [n for n in before if not torch.equal(every[1][n], every[0][n])]
    assert len(differ) > len(before) // 2, differ
    assert said.messages == ([
        f"GeminiDDP: {len(differ)} of {len(before)} parameters and buffers differ between the 2 "
        f"ranks (e.g. {', '.join(differ[:3])}, ...); every rank now holds rank 0's values, "
        "broadcast as torch DDP and DeepSpeed's engine do when they wrap a model; seed every "
        "rank alike before building the model to skip this broadcast"
    ] if rank == 0 else [])  # fmt: skip
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = ddp(x).pow(2).mean()
        opt.backward(loss)
        assert opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, **TOL32, msg=f"step {step} loss")
        full = ddp.state_dict()
        for n, q in ref.module.named_parameters():
            torch.testing.assert_close(full[n], q.detach(), **TOL32, msg=f"step {step} {n}")


def _same_seed(rank, world):
    torch.manual_seed(0)
    model = _Net()
    before = _values(model)
    no_broadcast = mock.patch.object(dist, "broadcast", side_effect=AssertionError("broadcast"))
    with _Records() as said, no_broadcast:
        ddp, _ = _wrap(model)
    assert said.messages == []
    now = {**ddp.state_dict(), **dict(ddp.module.named_buffers())}
    for n, t in before.items():
        assert torch.equal(now[n].detach(), t), n


def _both(rank, world):
    _differently_seeded(rank, world)
    _same_seed(rank, world)


def test_differently_seeded_ranks_train_rank_0s_model_and_agreeing_ranks_broadcast_nothing():
    spawn(_both, 2, backend="gloo", timeout_s=120)
