"""plugin.prepare_dataloader: each data-parallel rank gets its own samples
(gloo, 2 ranks), for every plugin."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from zerostack.booster import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from zerostack.testing import spawn

N = 10


def _seen(loader):
    return [int(i) for (batch,) in loader for i in batch]


def _gather(values):
    """(this rank's values, the other rank's)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    rank = dist.get_rank()
    return out[rank], out[1 - rank]


def _check(rank, world):
    dataset = TensorDataset(torch.arange(N))
    for plugin in (TorchDDPPlugin(), LowLevelZeroPlugin(), GeminiPlugin()):
        name = type(plugin).__name__
        loader = plugin.prepare_dataloader(dataset, batch_size=2)
        mine, other = _gather(_seen(loader))
        assert not set(mine) & set(other), name
        assert sorted(mine + other) == list(range(N)), name
        assert mine == list(range(rank, N, world)), name  # not shuffled: strided, in order

        loader = plugin.prepare_dataloader(dataset, batch_size=2, shuffle=True, seed=7)
        epochs = []
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            mine, other = _gather(_seen(loader))
            assert not set(mine) & set(other) and sorted(mine + other) == list(range(N)), name
            epochs.append(mine)
        assert epochs[0] != epochs[1], name  # reshuffled per epoch, the same on every rank

        loader = plugin.prepare_dataloader(dataset, batch_size=3, drop_last=True)
        assert [len(b) for (b,) in loader] == [3], name  # 5 samples a rank: one full batch

        loader.worker_init_fn(2)  # worker 2: seed + 2 everywhere
        drawn = (random.random(), torch.rand(1))
        random.seed(1024 + 2)
        torch.manual_seed(1024 + 2)
        assert drawn == (random.random(), torch.rand(1)), name


def test_each_rank_gets_its_own_samples():
    spawn(_check, 2, backend="gloo", timeout_s=120)
