"""Ranks that build their model from different seeds train rank 0's model, as
under torch DDP (see [Note: rank 0's initial values]): ZeroOptimizer
broadcasts rank 0's parameters and buffers at wrap time when the ranks differ,
says so once, and costs one small all-reduce when they agree."""

from __future__ import annotations

import copy
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.shard import ZeroOptimizer, sync_from_rank0
from zerostack.testing import BufferedNet, LogRecords, reference_step, spawn, tensor_values

STEPS = 5
TOL32 = dict(rtol=1e-6, atol=1e-6)


def _check_rank0s(rank, model, before, source):
    """Every tensor of ``model`` holds ``source``'s ``before``; returns the
    names of those that differed between the ranks, in the module's order."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, before)
    theirs = every[source]
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.dtype == theirs[n].dtype and t.shape == theirs[n].shape, n
        assert torch.equal(t.detach(), theirs[n]), f"rank {rank}: {n} is not rank {source}'s"
    return [n for n in before if any(not torch.equal(e[n], theirs[n]) for e in every)]


def _differently_seeded(rank, world):
    torch.manual_seed(100 + rank)
    model = BufferedNet()
    before = tensor_values(model)
    ref = DDP(copy.deepcopy(model))  # DDP broadcasts rank 0's values
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    with LogRecords("zerostack.shard._rank0_sync") as said:
        zero = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             module=model, stage=2)  # fmt: skip
    differ = _check_rank0s(rank, model, before, 0)
    assert len(differ) > len(before) // 2, differ
    if rank == 0:
        assert said.messages == [
            f"ZeroOptimizer: {len(differ)} of {len(before)} parameters and buffers differ between "
            f"the 2 ranks (e.g. {', '.join(differ[:3])}, ...); every rank now holds rank 0's "
            "values, broadcast as torch DDP and DeepSpeed's engine do when they wrap a model; "
            "seed every rank alike before building the model to skip this broadcast"
        ]
    else:
        assert said.messages == []
    for step in range(STEPS):
        x, ref_loss = reference_step(ref, ref_opt, step, rank)
        loss = model(x).pow(2).mean()
        zero.backward(loss)
        assert zero.step()
        torch.testing.assert_close(loss, ref_loss, **TOL32, msg=f"step {step} loss")
        for (n, p), (_, q) in zip(model.named_parameters(), ref.module.named_parameters(),
                                  strict=True):  # fmt: skip
            torch.testing.assert_close(p, q, **TOL32, msg=f"step {step} {n}")
    # Without a module: the optimizer's parameters (the buffers are not its).
    torch.manual_seed(200 + rank)
    bare = BufferedNet()
    before = tensor_values(bare)
    ZeroOptimizer(torch.optim.SGD(bare.parameters(), lr=0.1))
    every = [None] * world
    dist.all_gather_object(every, before)
    params = dict(bare.named_parameters())
    for n, t in tensor_values(bare).items():
        assert torch.equal(t, every[0][n] if n in params else before[n]), f"rank {rank}: {n}"


def _same_seed(rank, world):
    torch.manual_seed(0)
    model = BufferedNet()
    before = tensor_values(model)
    reduces = mock.patch.object(dist, "all_reduce", wraps=dist.all_reduce)
    no_broadcast = mock.patch.object(dist, "broadcast", side_effect=AssertionError("broadcast"))
    with LogRecords("zerostack.shard._rank0_sync") as said, no_broadcast:
        with reduces as counted:
            assert sync_from_rank0([*model.named_parameters(), *model.named_buffers()]) == 0
        assert counted.call_count == 1  # the one small all-reduce
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), module=model)
    assert said.messages == []
    for n, t in tensor_values(model).items():
        assert torch.equal(t, before[n]), n


def _both(rank, world):
    _differently_seeded(rank, world)
    _same_seed(rank, world)


def test_differently_seeded_ranks_train_rank_0s_model_and_agreeing_ranks_broadcast_nothing():
    spawn(_both, 2, backend="gloo", timeout_s=120)


def _in_groups(rank, world):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    torch.manual_seed(100 + rank)
    model = BufferedNet()
    before = tensor_values(model)
    with LogRecords("zerostack.shard._rank0_sync") as said:
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), module=model,
                      process_group=group)  # fmt: skip
    # Each pair now holds its own first rank's values: 0's for 0 and 1, 2's for 2 and 3.
    _check_rank0s(rank, model, before, rank - rank % 2)
    assert len(said.messages) == (1 if rank % 2 == 0 else 0), said.messages
    if said.messages:
        assert "differ between the 2 ranks" in said.messages[0]


def test_the_optimizers_process_group_sends_its_first_ranks_values():
    spawn(_in_groups, 4, backend="gloo", timeout_s=120)
