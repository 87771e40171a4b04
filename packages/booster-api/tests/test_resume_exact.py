"""Booster.save_state / load_state resume exactly: a run saved at step k and
continued by a fresh process group gives the losses of the uninterrupted run,
bitwise (fp32, CPU), with dropout on and a shuffled sampler, so that both the
RNG states and the sampler position must come back. The same resume with
either one spoiled gives other losses (the test can fail)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch.utils.data import TensorDataset

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from zerostack.booster._plugins._data import ResumableDataLoader, StatefulDistributedSampler
from zerostack.booster._rng import rng_state, set_rng_state
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False, vocab_size=64, dim=32, num_layers=2, max_seq_len=16, dropout=0.2)
SAMPLES, BATCH, STEPS, SAVE_AT = 40, 4, 8, 3  # 5 batches a rank and epoch at world 2


def _dataset():
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, CONFIG.vocab_size, (SAMPLES, 17), generator=gen))


def _setup(world, seed):
    plugin = GeminiPlugin(precision="fp32", chunk_config_dict={world: {"chunk_size": 5_000}})
    torch.manual_seed(seed)
    model = TinyGPT(CONFIG)
    opt = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = plugin.prepare_dataloader(_dataset(), batch_size=BATCH, shuffle=True, seed=3)
    booster = Booster(plugin=plugin)
    model, opt, _, loader, sched = booster.boost(model, opt, None, loader, sched)
    return booster, model, opt, sched, loader


def _train(parts, steps_done, path=None):
    """Train to STEPS from ``steps_done``; losses of this rank, and a state
    saved at SAVE_AT when ``path`` is given."""
    booster, model, opt, sched, loader = parts
    losses, epoch = [], loader.sampler.epoch
    while steps_done < STEPS:
        loader.sampler.set_epoch(epoch)  # the loaded epoch keeps its position
        epoch += 1
        for (batch,) in loader:
            loss = model(batch[:, :-1], batch[:, 1:])
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
            steps_done += 1
            if path is not None and steps_done == SAVE_AT:
                booster.save_state(path, model, opt, sched, loader)
            if steps_done == STEPS:
                break
    return losses


def _uninterrupted(rank, world, root):
    torch.set_num_threads(1)
    losses = _train(_setup(world, seed=0), 0, os.path.join(root, "state"))
    torch.save(losses, os.path.join(root, f"losses-{rank}.pt"))


def _resumed(rank, world, root):
    torch.set_num_threads(1)
    expected = torch.load(os.path.join(root, f"losses-{rank}.pt"))[SAVE_AT:]
    state = os.path.join(root, "state")
    parts = _setup(world, seed=1)
    parts[0].load_state(state, *parts[1:])
    assert parts[4].sampler.epoch == 0 and parts[4].sampler.consumed == SAVE_AT * BATCH
    assert _train(parts, SAVE_AT) == expected  # bitwise
    # Spoiled RNG: the dropout masks differ.
    parts = _setup(world, seed=1)
    parts[0].load_state(state, *parts[1:])
    torch.manual_seed(1234)
    assert _train(parts, SAVE_AT) != expected
    # Spoiled position: the epoch starts over with batches already seen.
    parts = _setup(world, seed=1)
    parts[0].load_state(state, *parts[1:])
    parts[4].sampler.load_state_dict({"epoch": 0, "consumed": 0})
    assert _train(parts, SAVE_AT) != expected


def test_resume_is_exact_with_dropout_and_shuffle(tmp_path):
    spawn(_uninterrupted, 2, args=(str(tmp_path),), backend="gloo", timeout_s=180)
    assert sorted(os.listdir(tmp_path / "state")) == [
        "lr_scheduler.pt", "model", "optimizer", "rank-00000-of-00002.pt", "rank-00001-of-00002.pt",
        "zerostack-checkpoint.json",
    ]  # fmt: skip
    spawn(_resumed, 2, args=(str(tmp_path),), backend="gloo", timeout_s=180)


def test_sampler_position_round_trip():
    dataset = TensorDataset(torch.arange(20))
    sampler = StatefulDistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
    loader = ResumableDataLoader(dataset, batch_size=3, sampler=sampler)
    sampler.set_epoch(1)
    seen = [int(i) for (b,) in loader for i in b]
    it = iter(loader)
    first = [int(i) for i in next(it)[0]]
    assert sampler.state_dict()["consumed"] == 3 and first == seen[:3]
    state = sampler.state_dict()
    other = StatefulDistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
    resumed = ResumableDataLoader(dataset, batch_size=3, sampler=other)
    other.load_state_dict(state)
    other.set_epoch(1)  # the loaded epoch: the position holds
    before = torch.get_rng_state()
    assert [int(i) for (b,) in resumed for i in b] == seen[3:]
    assert torch.equal(torch.get_rng_state(), before)  # the resumed iter drew under fork_rng
    assert other.consumed == 10
    other.set_epoch(2)  # a new epoch starts from its beginning
    assert len([i for (b,) in resumed for i in b]) == 10
    # Saved at world 2, loaded at world 1: the same number of samples over all ranks.
    alone = StatefulDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=5)
    alone.load_state_dict(state)
    assert alone.consumed == 6
    with pytest.raises(ValueError, match=r"state must be a state_dict\(\) of this sampler"):
        alone.load_state_dict({"epoch": 1})
    # Another order of the data: the position would skip samples and repeat others.
    for kwargs, got in (
        (dict(seed=6), r"\{'seed': \(5, 6\)\}"),
        (dict(shuffle=False), r"\{'shuffle': \(True, False\)\}"),
        (dict(dataset=TensorDataset(torch.arange(24))), r"\{'dataset_len': \(20, 24\)\}"),
    ):
        kw = {"dataset": dataset, "shuffle": True, "seed": 5, **kwargs}
        again = StatefulDistributedSampler(kw.pop("dataset"), num_replicas=2, rank=1, **kw)
        with pytest.raises(ValueError, match=r"saved position is in another order .*got " + got):
            again.load_state_dict(state)
        assert again.consumed == 0


def test_rng_state_round_trip():
    np = pytest.importorskip("numpy")
    state = rng_state()
    drawn = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert drawn[:2] == again[:2] and torch.equal(drawn[2], again[2])
    with pytest.raises(ValueError, match=r"state must be what rng_state\(\) returned"):
        set_rng_state({"torch": state["torch"]})


def test_load_state_refuses_what_was_not_saved(tmp_path):
    plugin = LowLevelZeroPlugin(stage=1, precision="fp32")
    booster = Booster(plugin=plugin)
    model, *_ = booster.boost(TinyGPT(CONFIG), None)
    booster.save_state(tmp_path / "s", model)
    assert not os.path.exists(tmp_path / "s" / "optimizer")
    sampler_less = torch.utils.data.DataLoader(_dataset())
    with pytest.raises(TypeError, match=r"dataloader must have state_dict"):
        booster.save_state(tmp_path / "s", model, dataloader=sampler_less)
    sched = object()
    with pytest.raises(ValueError, match=r"holds no lr_scheduler"):
        booster.load_state(tmp_path / "s", model, lr_scheduler=sched)


NO_DROPOUT = GPTConfig(bias=False, vocab_size=64, dim=32, num_layers=2, max_seq_len=16)
AFTER_LOAD = {
    "ddp": lambda: TorchDDPPlugin(),
    "zero2-offload": lambda: LowLevelZeroPlugin(stage=2, precision="fp32", cpu_offload=True),
    "gemini": lambda: GeminiPlugin(precision="fp32", chunk_config_dict={1: {"chunk_size": 5_000}}),
}


def _halving(epoch: int) -> float:
    return 0.5**epoch


def _lrs_and_losses(booster, model, opt, sched, start, steps):
    out = []
    for step in range(start, start + steps):
        idx, tgt = make_batch(NO_DROPOUT, 4, 15, seed=step)
        loss = model(idx, tgt)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        sched.step()
        out += [opt.param_groups[0]["lr"], loss.item()]
    return out


def _scheduler_after_load(rank, world, root, plugin):
    del rank, world
    torch.set_num_threads(1)
    for shard in (True, False):
        path = f"{root}/{plugin}-{shard}"
        torch.manual_seed(0)
        net = TinyGPT(NO_DROPOUT)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _halving)
        booster = Booster(plugin=AFTER_LOAD[plugin]())
        model, opt, _, _, sched = booster.boost(net, opt, lr_scheduler=sched)
        _lrs_and_losses(booster, model, opt, sched, 0, 3)
        booster.save_model(model, f"{path}-model", shard=shard)
        booster.save_optimizer(opt, f"{path}-optim", shard=shard)
        expected = _lrs_and_losses(booster, model, opt, sched, 3, 3)

        torch.manual_seed(1)
        net = TinyGPT(NO_DROPOUT)
        booster = Booster(plugin=AFTER_LOAD[plugin]())
        model, opt, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        booster.load_model(model, f"{path}-model")
        booster.load_optimizer(opt, f"{path}-optim")
        assert opt.param_groups[0]["initial_lr"] == 1e-2, (plugin, shard)
        # torch's resume recipe: the scheduler built after the load, at its epoch.
        sched = torch.optim.lr_scheduler.LambdaLR(opt.unwrap(), _halving, last_epoch=2)
        got = _lrs_and_losses(booster, model, opt, sched, 3, 3)
        assert got == pytest.approx(expected, rel=1e-6), (plugin, shard)


@pytest.mark.parametrize("plugin", list(AFTER_LOAD))
def test_a_scheduler_built_after_load_optimizer_resumes_as_in_torch(tmp_path, plugin):
    """torch's ``optimizer.load_state_dict`` restores the groups' ``initial_lr``
    that an lr scheduler put there, and ``LambdaLR(opt, f, last_epoch=k)``
    built after the load starts from it. Before, ``load_optimizer`` dropped
    it (the fresh optimizer had none), and the scheduler raised torch's
    KeyError "param 'initial_lr' is not specified in param_groups[0]"."""
    spawn(_scheduler_after_load, 1, args=(str(tmp_path), plugin), backend="gloo", timeout_s=180)
