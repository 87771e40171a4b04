"""LazyInitContext: meta construction, eager-equal materialization, and
distribution into chunks at 1 and 2 ranks (gloo) against eagerly registered
references."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from zerostack.chunk import ChunkManager, LazyInitContext
from zerostack.testing import GPTConfig, TinyGPT, spawn

_PAGE = 4096


class TiedLM(nn.Module):
    """Tied after construction, as GPT-2 does; ``after`` draws once the tie is made."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.LayerNorm(8))
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight
        self.after = nn.Linear(8, 3)


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def _stack() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(10, 16, padding_idx=0), nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 5)
    )


def _tied() -> nn.Module:
    return TiedLM()


def _gpt() -> nn.Module:
    return TinyGPT(GPTConfig(tie_embeddings=True, add_unused_param=True))


# (builder, init_fn): init_fn None means the modules' own reset_parameters.
CASES = {
    "stack": (_stack, None),
    "tied_after_construction": (_tied, None),
    "tinygpt": (_gpt, None),
}


def _build(name: str, lazy: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if not lazy:
        return CASES[name][0]()
    with LazyInitContext():
        return CASES[name][0]()


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters()) + list(model.named_buffers())


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def test_construction_allocates_nothing():
    with LazyInitContext():
        small = _gpt()
    assert all(t.is_meta for _, t in _tensors(small))
    assert not nn.Linear(2, 2).weight.is_meta  # the context is gone after the block
    if not sys.platform.startswith("linux"):
        pytest.skip("RSS is read from /proc")
    rss = _rss_bytes()
    start = time.perf_counter()
    with LazyInitContext():
        xl = TinyGPT(GPTConfig.gpt2_xl())
    elapsed = time.perf_counter() - start
    grown = _rss_bytes() - rss
    assert sum(p.numel() for p in xl.parameters()) > 1.5e9
    assert all(t.is_meta for _, t in _tensors(xl))
    assert elapsed < 2.0, f"building GPT-2 XL lazily took {elapsed:.2f}s"
    assert grown < 64 * 2**20, f"building GPT-2 XL lazily grew RSS by {grown / 2**20:.0f} MB"


@pytest.mark.parametrize("name", list(CASES))
def test_materialize_equals_eager(name):
    model = _build(name, lazy=True)
    params = list(model.parameters())
    if name == "stack":
        model[0].weight.requires_grad_(False)
    torch.randn(100)  # draws between the block and materialization change nothing
    rng = torch.random.get_rng_state()
    LazyInitContext.materialize(model, init_fn=CASES[name][1])
    assert torch.equal(torch.random.get_rng_state(), rng)  # the global RNG is left alone
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    ref = _build(name, lazy=False)
    got, want = _tensors(model), _tensors(ref)
    assert [n for n, _ in got] == [n for n, _ in want]
    for (n, a), (_, b) in zip(got, want, strict=True):
        assert a.device.type == "cpu" and a.dtype == b.dtype, n
        assert torch.equal(a, b), f"{name}: {n} differs from eager construction"
    if name == "stack":
        assert not model[0].weight.requires_grad and model[1].weight.requires_grad
    if name != "stack":
        head, emb = (model.lm_head, model.tok_emb) if name == "tinygpt" else (model.head, model.emb)
        assert head.weight is emb.weight


def test_errors():
    eager = _build("stack", lazy=False)
    with pytest.raises(ValueError, match=r"materialize: the model was not built under LazyInit"):
        LazyInitContext.materialize(eager)
    manager = ChunkManager({"k": {"chunk_size": 64}}, compute_device="cpu")
    with pytest.raises(ValueError, match=r"distribute: the model was not built under LazyInit"):
        LazyInitContext.distribute(eager, manager, config_key="k")

    model = _build("stack", lazy=True)
    LazyInitContext.materialize(model)
    with pytest.raises(RuntimeError, match=r"materialize: the model was already materialized"):
        LazyInitContext.materialize(model)
    with pytest.raises(RuntimeError, match=r"distribute: the model was already materialized"):
        LazyInitContext.distribute(model, manager, config_key="k")

    with LazyInitContext():
        odd = nn.Sequential(nn.Linear(4, 4), NoReset())
    with pytest.raises(
        NotImplementedError, match=r"have no reset_parameters\(\) \(got 1 \(NoReset\)"
    ):
        LazyInitContext.materialize(odd)
    assert all(p.is_meta for p in odd.parameters())  # refused before touching anything
    LazyInitContext.materialize(odd, init_fn=lambda m: [p.fill_(2.0) for p in m.parameters()])
    assert torch.equal(odd[1].scale, torch.full((4,), 2.0))
    assert manager.chunks() == []


def _register_eager(model, dtype, chunk_size, cpu_offload=False):
    manager = ChunkManager({"k": {"chunk_size": chunk_size}}, compute_device="cpu")
    for p in model.parameters():
        if dtype is not None:
            p.data = p.data.to(dtype)
        manager.register_tensor(p, "fp16_param", "k", cpu_offload=cpu_offload)
    manager.close_all_groups()
    return manager


def _check_distribute(rank, world, name, dtype, chunk_size):
    init_fn = CASES[name][1]
    model = _build(name, lazy=True)
    manager = ChunkManager({"k": {"chunk_size": chunk_size}}, compute_device="cpu")
    LazyInitContext.distribute(model, manager, config_key="k", dtype=dtype, init_fn=init_fn)
    ref = _build(name, lazy=False)
    ref_manager = _register_eager(ref, dtype, chunk_size)
    chunks, ref_chunks = manager.chunks(), ref_manager.chunks()
    assert len(chunks) == len(ref_chunks) > 1, name  # several chunks: some closed mid-walk
    for c, r in zip(chunks, ref_chunks, strict=True):
        assert c.closed and not c.is_gathered and c.dtype == (dtype or torch.float32)
        assert torch.equal(c.shard, r.shard), f"{name}: rank {rank} shard of chunk {c.index}"
        c.access()
        r.access()
    for (n, a), (_, b) in zip(_tensors(model), _tensors(ref), strict=True):
        assert torch.equal(a, b), f"{name}: {n} after access"


def _check_rng_mismatch(rank, world):
    model = _build("stack", lazy=True, seed=rank)
    manager = ChunkManager({"k": {"chunk_size": 64}}, compute_device="cpu")
    with pytest.raises(RuntimeError, match=r"ranks entered LazyInitContext with different CPU RNG"):
        LazyInitContext.distribute(model, manager, config_key="k")
    assert manager.chunks() == [] and all(p.is_meta for p in model.parameters())


def _check_peak_memory(rank, world):
    """Peak RSS while distributing 128 MB of Linear layers stays near this rank's share."""
    torch.manual_seed(0)
    with LazyInitContext():
        model = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(32)))
    model_bytes = 32 * 1024 * 1024 * 4
    manager = ChunkManager({"k": {"chunk_size": 2 * 2**20}}, compute_device="cpu")
    rss = _rss_bytes()
    Path("/proc/self/clear_refs").write_text("5")
    LazyInitContext.distribute(model, manager, config_key="k")
    grown = _peak_rss_bytes() - rss
    budget = model_bytes / world + 24 * 2**20  # this rank's shards + open chunk + one layer
    assert grown < budget, f"rank {rank}: peak grew {grown / 2**20:.0f} MB > {budget / 2**20:.0f}"


def _run_all(rank, world, check_memory):
    _check_distribute(rank, world, "stack", None, 200)
    _check_distribute(rank, world, "tied_after_construction", torch.bfloat16, 40)
    _check_distribute(rank, world, "tinygpt", torch.float16, 20000)
    if world > 1:
        _check_rng_mismatch(rank, world)
    if check_memory:
        _check_peak_memory(rank, world)


@pytest.mark.parametrize("world", [1, 2])
def test_distribute_equals_eager_registration(world, monkeypatch):
    # glibc keeps freed blocks above its adaptive mmap threshold resident, so RSS
    # would count freed temporaries; a fixed threshold unmaps them on free.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    spawn(_run_all, world, args=(_can_reset_peak(),), backend="gloo", timeout_s=60)
