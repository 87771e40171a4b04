"""Two runs with the same seed give bitwise equal losses and parameters, for
every plugin (gloo, 2 ranks, CPU): the CPU worker that steps offloaded
chunks, the asynchronous reductions and auto placement change nothing
between runs."""

from __future__ import annotations

import pytest
import torch
from test_booster_parity import CHUNKS, CONFIG, lm_loss

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from zerostack.fused_adam import HybridAdam
from zerostack.testing import TinyGPT, make_batch, spawn

AUTO = dict(precision="fp16", initial_scale=2**8, placement_policy="auto", gpu_capacity_bytes=10**6)
PLUGINS = {
    "ddp": lambda world: TorchDDPPlugin(),
    "zero1-offload": lambda world: LowLevelZeroPlugin(
        stage=1, precision="fp32", cpu_offload=True, reduce_bucket_size_in_m=0.02
    ),
    "zero2-bf16-clip": lambda world: LowLevelZeroPlugin(
        stage=2, precision="bf16", max_norm=1.0, reduce_bucket_size_in_m=0.02
    ),
    "gemini-offload-clip": lambda world: GeminiPlugin(
        precision="bf16", max_norm=1.0, offload_optim_frac=0.5, chunk_config_dict={world: CHUNKS}
    ),
    "gemini-auto": lambda world: GeminiPlugin(**AUTO, chunk_config_dict={world: CHUNKS}),
}


def _run(name, rank, world):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    booster = Booster(plugin=PLUGINS[name](world))
    model, opt, criterion, _, _ = booster.boost(
        model, HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.1), lm_loss
    )
    losses = []
    for step in range(5):
        idx, tgt = make_batch(CONFIG, 4, 16, seed=1000 * step + rank)
        loss = criterion(model(idx), tgt)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.full_state_dict(only_rank_0=False)


def _twice(rank, world):
    torch.set_num_threads(1)
    for name in PLUGINS:
        (first, params), (second, again) = _run(name, rank, world), _run(name, rank, world)
        assert first == second, (name, first, second)
        for key, value in params.items():
            assert torch.equal(value, again[key]), (name, key)


@pytest.mark.parametrize("world_size", [2])
def test_two_runs_with_one_seed_are_bitwise_equal(world_size):
    spawn(_twice, world_size, backend="gloo", timeout_s=300)
