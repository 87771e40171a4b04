"""GeminiOptimizer.full_state_dict / load_full_state_dict: saved at one world
size and loaded at others, under static and auto placement. The global batch
is split over the ranks, so training resumed at any world size gives the
losses the saving run went on to give."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)
CHUNKS = {"chunk_size": 20_000, "keep_gathered": False}


def _build(world, device="cpu", **kwargs):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model,
        mixed_precision=torch.float32,
        chunk_config_dict={world: CHUNKS},
        compute_device=device,
        **kwargs,
    )
    opt = GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-2, weight_decay=0.1), ddp)
    return ddp, opt


def _train(ddp, opt, steps, rank, world, start):
    """Mean losses over the ranks; the same 8 samples per step at any world size."""
    losses = []
    for step in range(start, start + steps):
        idx, tgt = make_batch(CONFIG, 8, 32, seed=step)
        per = 8 // world
        loss = ddp(idx[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per])
        opt.backward(loss)
        opt.step()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _save(rank, world, path, device="cpu"):
    ddp, opt = _build(world, device)
    _train(ddp, opt, 3, rank, world, 0)
    checkpoint = {"model": ddp.state_dict(), "optim": opt.full_state_dict()}
    checkpoint["after"] = _train(ddp, opt, 2, rank, world, 3)
    if rank == 0:
        torch.save(checkpoint, path)


def _same(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    else:
        assert a == b, where


def _load(rank, world, path, kwargs, device="cpu"):
    checkpoint = torch.load(path, weights_only=False)
    ddp, opt = _build(world, device, **kwargs)
    ddp.load_state_dict(checkpoint["model"])
    opt.load_full_state_dict(checkpoint["optim"])
    _same(opt.full_state_dict(), checkpoint["optim"])
    losses = _train(ddp, opt, 2, rank, world, 3)
    torch.testing.assert_close(losses, checkpoint["after"], rtol=1e-5, atol=1e-6)
    if "placement_policy" in kwargs:  # the plan moved masters with their loaded states
        assert len(ddp.offloaded_masters) < len(ddp.grad_chunks)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoint of 2 ranks, saved once for every row below (the save is
    the same for each; a spawn costs seconds)."""
    path = str(tmp_path_factory.mktemp("gemini-ckpt") / "ckpt.pt")
    spawn(_save, 2, args=(path,), backend="gloo")
    return path


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
def test_full_optimizer_state_reloads_at_any_world_size(saved, world, kwargs):
    spawn(_load, world, args=(saved, kwargs), backend="gloo")


def test_missing_parameter_state_is_named():
    _, opt = _build(1)
    full = opt.full_state_dict()
    del full["params"]["lm_head.weight"]
    with pytest.raises(KeyError, match=r"no state for \['lm_head.weight'\]"):
        opt.load_full_state_dict(full)


def _auto(nvme_dir=None):
    """Auto placement planning for 2 MB of device memory: 4 of this model's 9
    master chunks stay on the host, the rest on the compute device."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(bias=False, num_layers=2))
    ddp = GeminiDDP(
        model, mixed_precision=torch.bfloat16, compute_device="cpu", placement_policy="auto",
        gpu_capacity_bytes=2_000_000, chunk_config_dict={1: {"chunk_size": 20_000}},
    )  # fmt: skip
    nvme = {"nvme_offload_fraction": 1.0, "nvme_offload_dir": nvme_dir} if nvme_dir else {}
    return ddp, GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-2, **nvme), ddp)


def test_auto_placement_with_states_on_disk_resumes_from_a_state_dict(tmp_path):
    """HybridAdam(nvme_offload_fraction=1.0) under auto placement, loaded
    before its first step (a resume): disk is taken only for the states of
    the chunks the plan keeps on the host (nothing at boost), the states of
    the others come back from disk, and training goes on exactly as with
    every state in RAM."""
    pytest.importorskip("zerostack.nvme")
    config = GPTConfig(bias=False, num_layers=2)
    idx, tgt = make_batch(config, 2, 16, seed=0)

    def steps(ddp, opt, n):
        for _ in range(n):
            opt.backward(ddp(idx, tgt))
            opt.step()
        ddp.wait_updates()

    ddp, opt = _auto()
    steps(ddp, opt, 2)
    saved = opt.state_dict()
    runs = []
    for nvme_dir in (None, str(tmp_path)):
        ddp, opt = _auto(nvme_dir)
        if nvme_dir:
            assert opt.optimizer._nvme.swapper.reserved_bytes == 0  # the plan decides
        opt.load_state_dict(saved)
        steps(ddp, opt, 2)
        runs.append([p.detach().clone() for p in ddp.module.parameters()])
    host = ddp.offloaded_masters
    assert 0 < len(host) < len(ddp.grad_chunks)
    on_disk = 8 * sum(m.shard.numel() for m in host)
    assert opt.optimizer.nvme_bytes_on_disk() == on_disk
    assert opt.optimizer._nvme.swapper.reserved_bytes == on_disk
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
