"""Ranks that build their model from different seeds train rank 0's model, as
under torch DDP (zerostack.shard's [Note: rank 0's initial values]): GeminiDDP
broadcasts rank 0's parameters and buffers before they go into chunks when
the ranks differ, says so once, and broadcasts nothing when they agree."""

from __future__ import annotations

import copy
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import BufferedNet, LogRecords, reference_step, spawn, tensor_values

STEPS = 5
TOL32 = dict(rtol=1e-6, atol=1e-6)
CHUNKS = {2: {"chunk_size": 64, "keep_gathered": False}}  # several chunks, each sharded


def _wrap(model):
    ddp = GeminiDDP(model, mixed_precision=torch.float32, chunk_config_dict=CHUNKS,
                    compute_device="cpu")  # fmt: skip
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ddp, GeminiOptimizer(torch.optim.SGD(trainable, lr=0.1, momentum=0.9), ddp)


def _differently_seeded(rank, world):
    torch.manual_seed(100 + rank)
    model = BufferedNet(every_kind=False)
    before = tensor_values(model)
    ref = DDP(copy.deepcopy(model))  # DDP broadcasts rank 0's values
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1,
                              momentum=0.9)  # fmt: skip
    with LogRecords("zerostack.shard._rank0_sync") as said:
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
        x, ref_loss = reference_step(ref, ref_opt, step, rank)
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
    model = BufferedNet(every_kind=False)
    before = tensor_values(model)
    no_broadcast = mock.patch.object(dist, "broadcast", side_effect=AssertionError("broadcast"))
    with LogRecords("zerostack.shard._rank0_sync") as said, no_broadcast:
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
