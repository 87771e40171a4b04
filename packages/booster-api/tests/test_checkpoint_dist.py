"""CheckpointIO at world size 2 (gloo): the state is gathered, rank 0 alone
writes, every rank returns only once the checkpoint is in place, every rank
loads it, and an error on rank 0 is raised on rank 1 too."""

from __future__ import annotations

import errno
import os
import time

import pytest
import torch
import torch.distributed as dist
from test_checkpoint_helpers import PlainModel, PlainOptimizer, ShardedModel, mlp, same, train

from zerostack.booster import CheckpointSaveError, _checkpoint_atomic, _checkpoint_files
from zerostack.booster._checkpoint import CheckpointIO
from zerostack.testing import spawn

WRITE_DELAY_S = 1.0


def _slow_rank_0_writes(rank):
    """Rank 0 writes a sharded save's index late (undone by the returned
    function); rank 1 must never open a checkpoint for writing."""
    original = _checkpoint_files.write_index
    if rank == 0:

        def slow(*args, **kwargs):
            time.sleep(WRITE_DELAY_S)
            return original(*args, **kwargs)

        _checkpoint_files.write_index = slow
    else:

        def refuse(*args, **kwargs):
            raise AssertionError("rank 1 wrote a checkpoint")

        _checkpoint_atomic.atomic_path = refuse

    def restore():
        _checkpoint_files.write_index = original

    return restore


def _world_2_cases(rank, world, root):
    io = CheckpointIO()
    restore = _slow_rank_0_writes(rank)
    source = mlp(0, depth=2)
    expected = {k: v.clone() for k, v in source.state_dict().items()}

    # Model, sharded wrapper, sharded safetensors directory.
    path = os.path.join(root, "model")
    start = time.monotonic()
    io.save_model(ShardedModel(source), path, shard=True, use_safetensors=True, size_per_shard=1)
    # Every rank waited for rank 0's (slow) write and rename.
    assert time.monotonic() - start >= WRITE_DELAY_S, f"rank {rank} returned before the write"
    restore()
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    target = ShardedModel(mlp(1, depth=2))
    io.load_model(target, path)
    same(expected, target.full_state_dict(only_rank_0=False))

    # Model, single torch file.
    io.save_model(target, os.path.join(root, "model.pt"))
    other = ShardedModel(mlp(2, depth=2))
    io.load_model(other, os.path.join(root, "model.pt"))
    same(expected, other.full_state_dict(only_rank_0=False))

    # Optimizer (replicated) and scheduler, sharded directory.
    model = mlp(3, depth=2)
    opt = PlainOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    sched = torch.optim.lr_scheduler.StepLR(opt.optim, step_size=1, gamma=0.5)
    train(model, opt, 2)
    sched.step()
    io.save_optimizer(opt, os.path.join(root, "optim"), shard=True, size_per_shard=1)
    io.save_lr_scheduler(sched, os.path.join(root, "sched.pt"))
    model2 = mlp(4, depth=2)
    opt2 = PlainOptimizer(torch.optim.AdamW(model2.parameters(), lr=1.0), model2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2.optim, step_size=1, gamma=0.5)
    io.load_optimizer(opt2, os.path.join(root, "optim"))
    io.load_lr_scheduler(sched2, os.path.join(root, "sched.pt"))
    same(opt.full_state_dict(), opt2.full_state_dict())
    assert sched2.state_dict() == sched.state_dict()

    # A file where the directory goes: every rank refuses before writing.
    if rank == 0:
        with open(os.path.join(root, "a-file"), "w") as f:
            f.write("x")
    dist.barrier()
    with pytest.raises(ValueError, match=r"shard=True writes a directory but"):
        io.save_model(target, os.path.join(root, "a-file"), shard=True)
    # Rank 0's write fails (a full disk): every rank raises the same error.
    real = _checkpoint_files.write_torch
    if rank == 0:

        def full(path, obj):
            raise OSError(errno.ENOSPC, "No space left on device", path)

        _checkpoint_files.write_torch = full
    try:
        with pytest.raises(
            CheckpointSaveError,
            match=r"^CheckpointIO.save_model: no space left on device: 2\.0 MB needed, .* free "
            r"at .*\(got on rank 0: OSError: \[Errno 28\]",
        ):
            io.save_model(target, os.path.join(root, "model.pt"))
    finally:
        _checkpoint_files.write_torch = real
    io.load_model(other, os.path.join(root, "model.pt"))  # the previous one, unchanged
    same(expected, other.full_state_dict(only_rank_0=False))
    # The group still works after the failed save.
    io.save_model(target, os.path.join(root, "after.pt"))


def test_world_2_gathers_rank_0_writes_all_load(tmp_path):
    spawn(_world_2_cases, 2, args=(str(tmp_path),), timeout_s=60)
    # Saved by a sharded wrapper at world 2, loaded by a plain one at world 1.
    target = PlainModel(mlp(9, depth=2))
    CheckpointIO().load_model(target, tmp_path / "model")
    same(mlp(0, depth=2).state_dict(), target.module.state_dict())
    assert sorted(os.listdir(tmp_path)) == [
        "a-file",
        "after.pt",
        "model",
        "model.pt",
        "optim",
        "sched.pt",
    ]
