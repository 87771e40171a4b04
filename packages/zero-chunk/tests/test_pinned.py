"""pinned_empty: page-locked host buffers of their exact size (see
[Note: exact pinned buffers]). The CPU tests stand a recording fake in for
the CUDA runtime; the GPU tests lock real pages and measure them."""

import gc
import logging

import pytest
import torch

from zerostack.chunk import Chunk, _chunk, _pinned, exact_pinned, pinned_empty

MIB = 1 << 20


class _Runtime:
    """Records cudaHostRegister/cudaHostUnregister and synchronize calls in order."""

    def __init__(self, status=0):
        self.calls, self.status = [], status
        self.contexts, self.sync_fails = {3}, False  # devices with a CUDA context

    def cudaHostRegister(self, address, nbytes, flags):
        self.calls.append(("register", address, nbytes, flags))
        return self.status

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return 0


@pytest.fixture
def runtime(monkeypatch):
    rt = _Runtime()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)

    def synchronize(device=None):
        if rt.sync_fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        rt.calls.append(("sync", device))

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(
        torch._C, "_cuda_hasPrimaryContext", lambda d: d in rt.contexts, raising=False
    )
    monkeypatch.setattr(_pinned, "_cudart", lambda: rt)
    monkeypatch.setattr(_pinned, "_clear_cuda_error", lambda: rt.calls.append(("clear",)))
    torch_blocks = []

    def torch_pinned(numel, dtype, zero):
        torch_blocks.append((numel, dtype, zero))
        return torch.full((numel,), 7, dtype=dtype)

    monkeypatch.setattr(_pinned, "_torch_pinned", torch_pinned)
    monkeypatch.setattr(_pinned, "_warned", False)
    rt.torch_blocks = torch_blocks
    return rt


def test_without_cuda_it_says_that_pinning_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        pinned_empty(MIB, torch.float32)


def test_a_large_buffer_takes_exactly_its_bytes_and_is_locked_once(runtime):
    numel = (1 << 20) + 5  # bf16: 2 MiB + 10 bytes, which torch's allocator would make 4 MiB
    t = pinned_empty(numel, torch.bfloat16)
    assert t.shape == (numel,) and t.dtype == torch.bfloat16
    assert t.untyped_storage().nbytes() == numel * 2
    assert torch.count_nonzero(t) == 0  # fresh pages are zeros
    assert runtime.calls == [("register", t.data_ptr(), numel * 2, 1)]
    assert runtime.torch_blocks == []


def test_the_pages_are_unlocked_after_the_last_view_dies_and_the_device_is_synchronized_first(
    runtime,
):
    t = pinned_empty(MIB, torch.float32)
    address = t.data_ptr()
    view = t[10:20]
    assert exact_pinned(t) and exact_pinned(view) and not exact_pinned(torch.empty(MIB))
    del t
    gc.collect()
    assert [c[0] for c in runtime.calls] == ["register"]  # a view still reads the pages
    view.fill_(1.0)
    del view
    gc.collect()
    assert runtime.calls[1:] == [("sync", 3), ("unregister", address)]
    assert not _pinned._locked  # forgotten with its pages


def test_every_device_with_a_context_is_synchronized_and_none_is_created(runtime):
    # Locked while device 3 was current, copies may have run on device 1 as well.
    runtime.contexts = {1, 3}
    t = pinned_empty(MIB, torch.float32)
    del t
    gc.collect()
    assert [c for c in runtime.calls if c[0] == "sync"] == [("sync", 1), ("sync", 3)]


def test_pages_whose_device_cannot_be_synchronized_stay_mapped_and_locked(runtime):
    t = pinned_empty(MIB, torch.float32)
    runtime.sync_fails = True
    kept = len(_pinned._kept)
    del t
    gc.collect()
    assert "unregister" not in [c[0] for c in runtime.calls]
    assert len(_pinned._kept) == kept + 1 and len(_pinned._kept[-1]) == MIB * 4
    _pinned._kept.pop()  # this test's: let it go (its locked_on is None already)


def test_small_requests_use_torch_allocator(runtime):
    t = pinned_empty(100, torch.float32, zero=True)
    assert runtime.torch_blocks == [(100, torch.float32, True)] and runtime.calls == []
    assert t.numel() == 100


def test_a_refused_lock_falls_back_to_torch_allocator_with_one_warning(runtime, caplog):
    runtime.status = 2  # cudaErrorMemoryAllocation
    with caplog.at_level(logging.WARNING, logger="zerostack.chunk._pinned"):
        a = pinned_empty(MIB, torch.float32, zero=True)
        b = pinned_empty(MIB, torch.float32)
    assert runtime.torch_blocks == [(MIB, torch.float32, True), (MIB, torch.float32, False)]
    assert a.numel() == b.numel() == MIB
    warnings = [r for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(warnings) == 1 and "power of two" in warnings[0].getMessage()
    # The refusal is read away, not left for torch's next kernel-launch check.
    assert [c[0] for c in runtime.calls] == ["register", "clear", "register", "clear"]
    del a, b
    gc.collect()
    assert "unregister" not in [c[0] for c in runtime.calls]  # nothing was locked


def test_pinned_chunk_shards_are_exact_where_placed_and_when_allocated_for_a_move(monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        _chunk, "pinned_empty", lambda n, d: made.append(("exact", n)) or torch.zeros(n, dtype=d)
    )
    chunk = Chunk(
        64, None, torch.float32, compute_device="cpu", shard_device="cpu", pin_memory=True
    )
    chunk.append_tensor(torch.randn(40))
    chunk.close_chunk()  # the shard's first place
    assert made == [("exact", 64)]
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        assert not pin_memory, "a pinned shard came from torch's power-of-two allocator"
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    _chunk._empty_on(8, torch.float32, torch.device("cpu"), pin=True)  # a move to the CPU
    _chunk._empty_on(8, torch.float32, torch.device("cpu"), pin=False)
    assert made == [("exact", 64), ("exact", 8)]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_locked_buffer_on_cuda_is_pinned_and_takes_its_size_not_the_next_power_of_two():
    numel = (1 << 26) + 20480  # an 8B GPT's bf16 chunk shard: 128 MiB + 40 KiB
    nbytes = numel * 2
    gc.collect()
    before = _rss_bytes()
    t = pinned_empty(numel, torch.bfloat16)
    grown = _rss_bytes() - before
    assert t.is_pinned()
    # Locking faults every page in: the resident set grows by the buffer, not
    # by 256 MiB as torch's power-of-two block would.
    assert 0.9 * nbytes <= grown <= 1.1 * nbytes, (grown, nbytes)
    del t
    gc.collect()
    assert _rss_bytes() - before < 0.1 * nbytes  # unlocked and unmapped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_asynchronous_copies_through_a_locked_buffer_and_its_release_mid_copy():
    numel = 64 * MIB
    src = torch.arange(numel, dtype=torch.float32, device="cuda")
    host = pinned_empty(numel, torch.float32)
    host.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host[-5:], torch.arange(numel - 5, numel, dtype=torch.float32))
    host.mul_(2)
    dev = host.to("cuda", non_blocking=True)
    # Released mid-copy: the release synchronizes first. (The CPU tests check
    # that order; freed pages often keep their data a while, so this alone
    # could pass without it.)
    del host
    gc.collect()
    torch.cuda.synchronize()
    assert torch.equal(dev, src * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_non_blocking_move_to_pinned_host_memory_is_waited_for_by_the_shard():
    """``shard_move("cpu", non_blocking=True)`` returns with its copy still
    running; the ``shard`` property waits for it (a kernel queued before the
    copy keeps the device busy, so an unwaited read would see zeros)."""
    numel = 16 * MIB
    chunk = Chunk(numel, None, torch.float32, compute_device="cuda", shard_device="cuda",
                  pin_memory=True)  # fmt: skip
    chunk.append_tensor(torch.ones(numel, device="cuda"))
    chunk.close_chunk()
    torch.cuda._sleep(200_000_000)  # the copy queues behind about 0.1 s of device time
    chunk.shard_move("cpu", non_blocking=True)
    shard = chunk.shard
    assert shard.device.type == "cpu" and shard.is_pinned()
    assert bool((shard == 1).all())
