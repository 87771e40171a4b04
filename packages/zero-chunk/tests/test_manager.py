"""ChunkManager: groups, chunk opening, and exact byte accounting."""

from __future__ import annotations

import pytest
import torch

from zerostack.chunk import ChunkManager, TensorState
from zerostack.testing import spawn

CONFIG = {
    "dp": {"chunk_size": 64, "keep_gathered": False},
    "small": {"chunk_size": 16, "keep_gathered": True},
}


def _expected_mem(manager):
    """Bytes from first principles: gathered buffers plus shards, by device."""
    mem = {}
    for chunk in manager.chunks():
        esize = torch.empty(0, dtype=chunk.dtype).element_size()
        for t, numel in ((chunk.buffer, chunk.chunk_size), (chunk.shard, chunk.shard_size)):
            if t is not None:
                mem[t.device.type] = mem.get(t.device.type, 0) + numel * esize
        if chunk.grad_chunk is not None:
            g = chunk.grad_chunk
            for t, numel in ((g.buffer, g.chunk_size), (g.shard, g.shard_size)):
                if t is not None:
                    mem[t.device.type] = mem.get(t.device.type, 0) + numel * esize
    return mem


def _check(manager):
    assert {k: v for k, v in manager.total_mem.items() if v} == {
        k: v for k, v in _expected_mem(manager).items() if v
    }


def _accounting(rank, world):
    manager = ChunkManager(CONFIG, compute_device="cpu", reuse_fp16_chunk=False)
    params = [torch.randn(n) for n in (30, 30, 10, 100, 7)]  # 100 > 64: a chunk of its own
    halves = [torch.randn(n).bfloat16() for n in (5, 6)]
    for p in params:
        manager.register_tensor(p, "fp32_param", "dp")
        _check(manager)
    for h in halves:
        manager.register_tensor(h, "fp16_param", "small")
        _check(manager)
    manager.close_all_groups()
    _check(manager)
    chunks = manager.chunks("fp32_param")
    assert [c.utilized_size for c in chunks] == [60, 10, 100, 7]
    assert manager.get_chunk(params[3]).chunk_size >= 100
    assert manager.get_chunk(params[0]) is manager.get_chunk(params[1])
    assert manager.get_chunks(params[:3]) == [chunks[0], chunks[1]]
    for chunk in chunks:
        manager.access_chunk(chunk)
        _check(manager)
        assert manager.accessed_mem == sum(c.chunk_size * 4 for c in manager.accessed_chunks)
    first = chunks[0]
    manager.init_grad_chunk(first)
    _check(manager)
    for t in list(first.tensors_info):
        for s in (TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD, TensorState.READY_FOR_REDUCE):
            manager.trans_tensor_state(t, s)
    handle = manager.reduce_chunk(first, async_op=True)
    handle.wait()
    _check(manager)
    for chunk in chunks:
        manager.release_chunk(chunk)
        _check(manager)
    assert manager.accessed_mem == 0
    for chunk in chunks:
        manager.move_chunk(chunk, "cpu")
        _check(manager)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_byte_accounting_is_exact_after_every_operation(world_size):
    spawn(_accounting, world_size, backend="gloo")


def test_groups_open_a_new_chunk_when_full():
    manager = ChunkManager(CONFIG, compute_device="cpu")
    tensors = [torch.randn(30) for _ in range(5)]
    for t in tensors:
        manager.register_tensor(t, "fp32_param", "dp")
    manager.close_all_groups()
    assert [c.utilized_size for c in manager.chunks()] == [60, 60, 30]
    assert all(c.closed for c in manager.chunks())


def test_bad_input():
    with pytest.raises(ValueError, match=r"chunk_size of config 'x' must be an int >= 1 \(got 0\)"):
        ChunkManager({"x": {"chunk_size": 0}})
    manager = ChunkManager(CONFIG, compute_device="cpu")
    t = torch.zeros(3)
    manager.register_tensor(t, "fp32_param", "dp")
    with pytest.raises(ValueError, match=r"already registered"):
        manager.register_tensor(t, "fp32_param", "dp")
    with pytest.raises(KeyError, match=r"no chunk configuration for 'nope'"):
        manager.register_tensor(torch.zeros(3), "fp32_param", "nope")
    with pytest.raises(KeyError, match=r"not registered"):
        manager.get_chunk(torch.zeros(2))
    with pytest.raises(RuntimeError, match=r"reuse_fp16_chunk=True"):
        manager.init_grad_chunk(manager.get_chunk(t))


def test_zero_chunk_gives_a_zeroed_buffer_without_gathering_and_counts_it():
    manager = ChunkManager(CONFIG, compute_device="cpu")
    for _ in range(2):
        manager.register_tensor(torch.randn(30), "fp32_param", "dp")
    manager.close_all_groups()
    chunk = manager.chunks()[0]
    before = manager.total_mem["cpu"]
    manager.zero_chunk(chunk)
    assert chunk.is_gathered and not chunk.buffer.any()
    assert manager.total_mem["cpu"] == before + chunk.chunk_size * 4
    with pytest.raises(RuntimeError, match=r"zero_buffer: the chunk is gathered"):
        manager.zero_chunk(chunk)
    # Accessing a chunk that is gathered already moves and counts nothing, and
    # makes it an accessed chunk that a release drops.
    gathered = manager.total_mem["cpu"]
    buffer = chunk.buffer
    assert manager.access_chunk(chunk) is None
    assert chunk.buffer is buffer and chunk in manager.accessed_chunks
    assert manager.total_mem["cpu"] == gathered
    manager.release_chunk(chunk)
    assert not chunk.is_gathered and manager.total_mem["cpu"] == before
