"""GeminiOptimizer.full_state_dict / load_full_state_dict: saved at one world
size, loaded at the same one (training resumes bitwise), at others (the state
round-trips bitwise), and under auto placement (the state follows the plan)."""

from __future__ import annotations

import pytest
import torch

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)
CHUNKS = {"chunk_size": 20_000, "keep_gathered": False}


def _build(world, **kwargs):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model,
        mixed_precision=torch.float32,
        chunk_config_dict={world: CHUNKS},
        compute_device="cpu",
        **kwargs,
    )
    opt = GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-2, weight_decay=0.1), ddp)
    return ddp, opt


def _train(ddp, opt, steps, rank, start):
    losses = []
    for step in range(start, start + steps):
        idx, tgt = make_batch(CONFIG, 4, 32, seed=100 * step + rank)
        loss = ddp(idx, tgt)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def _save(rank, world, path):
    ddp, opt = _build(world)
    _train(ddp, opt, 3, rank, 0)
    checkpoint = {"model": ddp.state_dict(), "optim": opt.full_state_dict()}
    after = _train(ddp, opt, 2, rank, 3)
    if rank == 0:
        torch.save(checkpoint, path)
    torch.save(after, f"{path}.after{rank}")  # each rank's losses after the checkpoint


def _same(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    else:
        assert a == b, where


def _load(rank, world, path, saved_world, kwargs):
    checkpoint = torch.load(path, weights_only=False)
    ddp, opt = _build(world, **kwargs)
    ddp.load_state_dict(checkpoint["model"])
    opt.load_full_state_dict(checkpoint["optim"])
    _same(opt.full_state_dict(), checkpoint["optim"])
    losses = _train(ddp, opt, 2, rank, 3)
    if world == saved_world:
        after = torch.load(f"{path}.after{rank}")
        assert losses == after, (losses, after)
    assert all(torch.isfinite(torch.tensor(losses)))
    if "placement_policy" in kwargs:  # the plan moved masters with their loaded states
        assert len(ddp.offloaded_masters) < len(ddp.grad_chunks)


@pytest.mark.parametrize(
    "world, kwargs",
    [
        (2, {}),
        (1, {}),
        (4, dict(offload_optim_frac=0.5)),
        (1, dict(placement_policy="auto", gpu_capacity_bytes=1 << 30)),
    ],
    ids=["same-world", "world-1", "world-4-offload", "world-1-auto"],
)
def test_full_optimizer_state_reloads_at_any_world_size(tmp_path, world, kwargs):
    path = str(tmp_path / "ckpt.pt")
    spawn(_save, 2, args=(path,), backend="gloo")
    spawn(_load, world, args=(path, 2, kwargs), backend="gloo")


def test_missing_parameter_state_is_named():
    _, opt = _build(1)
    full = opt.full_state_dict()
    del full["params"]["lm_head.weight"]
    with pytest.raises(KeyError, match=r"no state for \['lm_head.weight'\]"):
        opt.load_full_state_dict(full)
