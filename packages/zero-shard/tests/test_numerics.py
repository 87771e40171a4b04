"""Partition math, the loss scaler and the clipping coefficient."""

from __future__ import annotations

import math

import pytest
import torch

from zerostack.shard import (
    DynamicLossScaler,
    clip_coefficient,
    grad_stats,
    shard_bounds,
    shard_numel,
)
from zerostack.shard._partition import padded_flat
from zerostack.testing import spawn


@pytest.mark.parametrize(("numel", "world"), [(1, 1), (1, 4), (3, 4), (7, 2), (8, 4), (1000, 3)])
def test_pieces_cover_every_element_once(numel, world):
    size = shard_numel(numel, world)
    assert size * world >= numel and size >= 1
    covered = []
    for rank in range(world):
        start, end = shard_bounds(numel, world, rank)
        assert end - start <= size
        covered.extend(range(start, end))
    assert covered == list(range(numel))
    flat = padded_flat(torch.arange(numel, dtype=torch.float32), world)
    assert flat.numel() == size * world and torch.equal(
        flat[:numel], torch.arange(numel, dtype=torch.float32)
    )
    assert torch.all(flat[numel:] == 0)


def test_loss_scaler_backs_off_after_hysteresis_and_grows():
    s = DynamicLossScaler(initial_scale=1024, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024  # the first overflow is absorbed by hysteresis
    s.update(True)
    assert s.scale == 512
    for _ in range(3):
        s.update(False)
    assert s.scale == 1024
    s = DynamicLossScaler(initial_scale=2, min_scale=1, hysteresis=1)
    for _ in range(5):
        s.update(True)
    assert s.scale == 1
    s = DynamicLossScaler(initial_scale=4, max_scale=4, growth_interval=1)
    s.update(False)
    assert s.scale == 4
    state = s.state_dict()
    t = DynamicLossScaler()
    t.load_state_dict(state)
    assert t.scale == 4


def test_loss_scaler_settings_assigned_take_effect_and_are_checked():
    s = DynamicLossScaler(initial_scale=1024, hysteresis=1)
    s.backoff_factor = 0.25
    s.update(True)
    assert s.scale == 256 and s.config.backoff_factor == 0.25
    with pytest.raises(ValueError, match=r"growth_interval must be >= 1 \(got 0\)"):
        s.growth_interval = 0
    assert s.growth_interval == 1000  # a refused value leaves the setting as it was


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(min_scale=0), r"min_scale must be > 0 \(got 0\)"),
        (dict(initial_scale=2**40), r"initial_scale must lie in \[min_scale, max_scale\]"),
        (dict(growth_factor=1.0), r"growth_factor must be > 1"),
        (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
        (dict(growth_interval=0), r"growth_interval must be >= 1"),
        (dict(hysteresis=0), r"hysteresis must be >= 1"),
    ],
)
def test_loss_scaler_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)


def test_clip_coefficient():
    assert clip_coefficient(10.0, 0.0) == 1.0
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(0.25, rel=1e-6)
    assert clip_coefficient(math.inf, 1.0) == 1.0


def _stats(rank, world):
    shards = [torch.full((3,), float(rank + 1)), torch.full((2,), 1.0)]
    flags = torch.tensor([1.0 if rank == 0 else 0.0, 1.0])
    out = grad_stats(shards, flags, None)
    expected_sq = sum(3 * (r + 1) ** 2 + 2 for r in range(world))
    assert out[0] == pytest.approx(expected_sq)
    assert out[1:] == [1.0, float(world)]
    if rank == world - 1:
        shards[0][0] = float("nan")
    assert not math.isfinite(grad_stats(shards, flags, None)[0])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_grad_stats_sum_over_ranks_in_one_all_reduce(world_size):
    spawn(_stats, world_size, backend="gloo")
