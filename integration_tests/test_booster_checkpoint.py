"""Booster checkpoints through the real plugins (gloo): saved with Gemini at
2 ranks in the Hugging Face layout, loaded with ZeRO-2 and with DDP at 1 rank
and back into Gemini; a resume at the same world size gives the losses of the
uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)
PLUGINS = {
    "gemini": lambda: GeminiPlugin(
        precision="fp32", chunk_config_dict=None, offload_optim_frac=0.5, hidden_dim=64
    ),
    "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
    "ddp": lambda: TorchDDPPlugin(),
}


def _boosted(kind):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    opt = HybridAdam(list(model.parameters()), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    booster = Booster(plugin=PLUGINS[kind]())
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    return booster, model, opt, sched


def _train(booster, model, opt, sched, steps, rank, start=0):
    losses = []
    for step in range(start, start + steps):
        idx, tgt = make_batch(CONFIG, 4, 32, seed=100 * step + rank)
        loss = model(idx, tgt)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def _save_at_two(rank, world, directory):
    straight = _boosted("gemini")
    expected = _train(*straight, 6, rank)
    booster, model, opt, sched = _boosted("gemini")
    got = _train(booster, model, opt, sched, 3, rank)
    booster.save_model(
        model, f"{directory}/model", shard=True, use_safetensors=True, size_per_shard=1
    )
    booster.save_optimizer(opt, f"{directory}/optim", shard=True, size_per_shard=1)
    booster.save_lr_scheduler(sched, f"{directory}/sched.pt")
    torch.save({"model": model.full_state_dict(only_rank_0=False), "optim": opt.full_state_dict()},
               f"{directory}/expected{rank}.pt")  # fmt: skip
    # Resume at the same world size with a fresh run: the uninterrupted losses.
    booster, model, opt, sched = _boosted("gemini")
    booster.load_model(model, f"{directory}/model")
    booster.load_optimizer(opt, f"{directory}/optim")
    booster.load_lr_scheduler(sched, f"{directory}/sched.pt")
    got += _train(booster, model, opt, sched, 3, rank, start=3)
    assert got == expected


def _load_at_one(rank, world, directory, kind):
    expected = torch.load(f"{directory}/expected0.pt")
    booster, model, opt, sched = _boosted(kind)
    booster.load_model(model, f"{directory}/model")
    booster.load_optimizer(opt, f"{directory}/optim")
    booster.load_lr_scheduler(sched, f"{directory}/sched.pt")
    state = model.full_state_dict(only_rank_0=False)
    for name, value in expected["model"].items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    got = opt.full_state_dict()["state"]
    for name, entry in expected["optim"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[name][k], entry[k], rtol=0, atol=0, msg=f"{name} {k}")
    assert sched.last_epoch == 3
    _train(booster, model, opt, sched, 2, rank, start=3)  # and it trains on


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("saved"))
    spawn(_save_at_two, 2, args=(directory,), backend="gloo", timeout_s=300)
    return directory


@pytest.mark.parametrize("kind", ["zero2", "ddp", "gemini"])
def test_saved_with_gemini_at_two_ranks_loads_at_one(kind, saved):
    spawn(_load_at_one, 1, args=(saved, kind), backend="gloo", timeout_s=300)
