"""Per-rank parallel checkpoints (save_model / save_optimizer with shard=True):
every rank writes its own part, nothing is gathered, and the checkpoint
loads at another world size into another plugin (Gemini at 2 ranks ->
LowLevelZero and DDP at 1 -> Gemini at 2), with training going on as the
uninterrupted run; optimizer states held on disk (HybridAdam's
nvme_offload_fraction) are saved and restored."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin
from zerostack.booster.consolidate import consolidate
from zerostack.chunk import _comm
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)
TOL = dict(rtol=1e-5, atol=1e-5)


def _gemini(world, **kwargs):
    return GeminiPlugin(
        precision="fp32", chunk_config_dict={world: {"chunk_size": 6_000}}, **kwargs
    )


def _boost(plugin, seed, **adam):
    torch.manual_seed(seed)
    model = TinyGPT(CONFIG)
    opt = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.1, **adam)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def _train(booster, model, opt, start, steps):
    """Mean losses over the ranks; every step the same 8 samples, split."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    losses = []
    for step in range(start, start + steps):
        idx, tgt = make_batch(CONFIG, 8, 16, seed=step)
        part = slice(rank * 8 // world, (rank + 1) * 8 // world)
        loss = model(idx[part], tgt[part])
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


class _GatherCounter:
    """Counts the bytes of every tensor all-gather (zerostack's collectives)."""

    def __init__(self):
        self.bytes = 0

    def __enter__(self):
        self._real = _comm._all_gather

        def counting(out, shard, **kwargs):
            self.bytes += out.numel() * out.element_size()
            return self._real(out, shard, **kwargs)

        _comm._all_gather = counting
        return self

    def __exit__(self, *exc):
        _comm._all_gather = self._real


def _elements_per_rank(path):
    """{rank: tensor elements stored in its file}, from DCP's metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(path).read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        tensor = md.state_dict_metadata[index.fqn]
        if not hasattr(tensor, "chunks"):
            continue
        [chunk] = [c for c in tensor.chunks if c.offsets == index.offset]
        rank = int(info.relative_path.split("_")[2])  # __<rank>_<save id>_0.distcp
        out[rank] = out.get(rank, 0) + chunk.sizes.numel()
    return out


def _state_bytes(model):
    numel = sum(p.numel() for p in TinyGPT(CONFIG).parameters())
    return numel * 4  # fp32


def _save_at_2(rank, world, root):
    torch.set_num_threads(1)
    booster, model, opt = _boost(_gemini(world, offload_optim_frac=0.5), seed=0)
    _train(booster, model, opt, 0, 3)
    with _GatherCounter() as parallel:
        booster.save_model(model, f"{root}/model", shard=True)
        booster.save_optimizer(opt, f"{root}/optim", shard=True)
    with _GatherCounter() as gathered:
        booster.save_model(model, f"{root}/model.pt")
    assert parallel.bytes == 0, f"rank {rank}: a parallel save gathered {parallel.bytes} bytes"
    assert gathered.bytes >= _state_bytes(model)  # the control: the one-file save gathers
    # Each rank's file holds exactly the elements of its own ranges, less than the whole.
    per_rank = _elements_per_rank(f"{root}/model")
    mine = sum(end - start for start, end, _ in model.local_ranges().values())
    assert per_rank[rank] == mine < _state_bytes(model) // 4, (per_rank, mine)
    assert sum(per_rank.values()) == _state_bytes(model) // 4
    losses = _train(booster, model, opt, 3, 4)
    if rank == 0:
        torch.save(losses, f"{root}/losses.pt")


def _load_at_1(root):
    """In this process, without a process group (a spawn costs seconds)."""
    expected = torch.load(f"{root}/losses.pt")
    for plugin in (None, LowLevelZeroPlugin(stage=2, precision="fp32")):
        booster, model, opt = _boost(plugin, seed=1)
        booster.load_model(model, f"{root}/model")
        booster.load_optimizer(opt, f"{root}/optim")
        losses = _train(booster, model, opt, 3, 2)
        torch.testing.assert_close(losses, expected[:2], **TOL)
    # LowLevelZero at 1 process saves (after step 5); Gemini at 2 ranks goes on from there.
    booster.save_model(model, f"{root}/model5", shard=True)
    booster.save_optimizer(opt, f"{root}/optim5", shard=True)
    names = sorted(os.listdir(f"{root}/model5"))
    assert names[0] == ".metadata" and names[2] == "zerostack-checkpoint.json", names
    assert re.fullmatch(r"__0_[0-9a-f]{16}_0\.distcp", names[1]) and len(names) == 3, names


def _back_at_2(rank, world, root):
    torch.set_num_threads(1)
    expected = torch.load(f"{root}/losses.pt")
    booster, model, opt = _boost(_gemini(world), seed=2)
    booster.load_optimizer(opt, f"{root}/optim5")  # either order
    booster.load_model(model, f"{root}/model5")
    torch.testing.assert_close(_train(booster, model, opt, 5, 2), expected[2:], **TOL)
    _nvme(rank, world, root)  # in the same processes: a spawn costs seconds


def _nvme(rank, world, root):
    """Optimizer states held on disk (HybridAdam nvme_offload_fraction=1)
    are saved and restored."""
    disk = dict(nvme_offload_fraction=1.0, nvme_offload_dir=f"{root}/swap-{rank}")
    plugin = _gemini(world, offload_optim_frac=1.0)
    booster, model, opt = _boost(plugin, seed=0, **disk)
    _train(booster, model, opt, 0, 2)
    inner = opt.optim.optimizer
    assert inner.nvme_bytes_on_disk() > 0  # the effect: states are on disk
    booster.save_optimizer(opt, f"{root}/optim", shard=True)
    booster.save_model(model, f"{root}/model", shard=True)
    expected = _train(booster, model, opt, 2, 2)
    disk = dict(nvme_offload_fraction=1.0, nvme_offload_dir=f"{root}/swap2-{rank}")
    booster, model, opt = _boost(_gemini(world, offload_optim_frac=1.0), seed=1, **disk)
    booster.load_model(model, f"{root}/model")
    booster.load_optimizer(opt, f"{root}/optim")
    assert opt.optim.optimizer.nvme_bytes_on_disk() > 0
    assert _train(booster, model, opt, 2, 2) == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_parallel_save_reshards_across_plugins_and_world_sizes(tmp_path):
    """Gemini at 2 -> LowLevelZero and the plain (DDP) wrapper at 1 -> Gemini
    at 2; then NVMe."""
    root = str(tmp_path)
    spawn(_save_at_2, 2, args=(root,), backend="gloo", timeout_s=180)
    # The consolidator turns the parallel checkpoint into the gathered one's tensors.
    consolidate(f"{root}/model", f"{root}/hf")
    with safe_open(f"{root}/hf/model-00001-of-00001.safetensors", "pt") as f:
        exported = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    gathered = torch.load(f"{root}/model.pt")
    assert exported.keys() <= gathered.keys()
    for name, value in exported.items():
        assert torch.equal(value, gathered[name]), name
    _load_at_1(root)
    spawn(_back_at_2, 2, args=(root,), backend="gloo", timeout_s=240)


# A child saves over the checkpoint at PATH and stops for good while DCP writes.
CHILD = r"""
import os, sys, time, torch
path, marker = sys.argv[1:]
from zerostack.booster import Booster, _checkpoint_dcp
from zerostack.testing import GPTConfig, TinyGPT

def stop(*args):
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)

_checkpoint_dcp._PieceSavePlanner.resolve_data = stop
torch.manual_seed(1)
booster = Booster(device="cpu")
model, *_ = booster.boost(TinyGPT(GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)))
booster.save_model(model, path, shard=True)
raise SystemExit("the save was not stopped")
"""


def test_a_killed_parallel_save_leaves_the_previous_checkpoint(tmp_path):
    booster = Booster(device="cpu")
    torch.manual_seed(0)
    model, *_ = booster.boost(TinyGPT(CONFIG))
    path, marker = tmp_path / "ckpt", tmp_path / "marker"
    booster.save_model(model, path, shard=True)
    assert (path / ".metadata").is_file()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(marker)], env=env)
    deadline = time.monotonic() + 120
    while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), f"the child did not reach the write (exit code {child.poll()})"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # its half-written directory
    torch.manual_seed(5)
    fresh, *_ = Booster(device="cpu").boost(TinyGPT(CONFIG))
    booster.load_model(fresh, path)
    mine, theirs = model.unwrap().state_dict(), fresh.unwrap().state_dict()
    for (name, a), b in zip(mine.items(), theirs.values(), strict=True):
        assert torch.equal(a, b), name
    booster.save_model(fresh, path, shard=True)  # the next save cleans up
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "marker"]


def test_parallel_save_refuses_bad_input(tmp_path):
    booster, model, opt = _boost(_gemini(1), seed=0)
    with pytest.raises(ValueError, match=r"a parallel save writes DCP files, not safetensors"):
        booster.checkpoint_io.save_model(model, tmp_path / "m", parallel=True, use_safetensors=True)
    booster.checkpoint_io.save_model(model, tmp_path / "m", parallel=True)
    with pytest.raises(ValueError, match=r"is not a parallel optimizer checkpoint"):
        booster.load_optimizer(opt, tmp_path / "m")
    other = Booster(plugin=_gemini(1))
    torch.manual_seed(0)
    small = TinyGPT(GPTConfig(bias=False, vocab_size=64, dim=32, max_seq_len=32))
    small, *_ = other.boost(small, None)
    with pytest.raises(
        ValueError,
        match=r"holds tensors of other shapes than this model's \(got \[.*\(128, 32\), \(64, 32\)\)",
    ):
        other.load_model(small, tmp_path / "m")


def test_kept_gathered_chunks_round_trip_into_other_chunks(tmp_path):
    """One process: Gemini with kept-gathered chunks and parameter shards on
    the host -> Gemini with other, sharded chunks: the same full state."""
    plugin = GeminiPlugin(
        precision="fp32", chunk_config_dict={1: {"chunk_size": 9_000, "keep_gathered": True}}
    )
    booster, model, opt = _boost(plugin, seed=0)
    _train(booster, model, opt, 0, 2)
    booster.save_model(model, tmp_path / "m", shard=True)
    booster.save_optimizer(opt, tmp_path / "o", shard=True)
    other, target, target_opt = _boost(_gemini(1, offload_param_frac=0.5), seed=1)
    other.load_model(target, tmp_path / "m")
    other.load_optimizer(target_opt, tmp_path / "o")
    torch.testing.assert_close(target.full_state_dict(), model.full_state_dict(), rtol=0, atol=0)
    mine, theirs = opt.full_state_dict(), target_opt.full_state_dict()
    torch.testing.assert_close(theirs["state"], mine["state"], rtol=0, atol=0)
    assert _train(other, target, target_opt, 2, 2) == _train(booster, model, opt, 2, 2)
