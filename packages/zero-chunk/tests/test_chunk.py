"""Chunk operations at 1, 2 and 4 ranks (gloo) against unsharded references."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist

from zerostack.chunk import Chunk, ChunkFullError, ChunkManager, GatheredBytes, TensorState
from zerostack.testing import spawn

SIZES = [5, 1, 17, 8, 3]  # 34 elements in a 37-element chunk: padding at every world size


def _tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in SIZES]


def _filled(keep_gathered=False, **kw):
    tensors = _tensors()
    ref = [t.clone() for t in tensors]
    chunk = Chunk(37, None, torch.float32, compute_device="cpu", keep_gathered=keep_gathered, **kw)
    for t in tensors:
        chunk.append_tensor(t)
    chunk.close_chunk()
    return chunk, tensors, ref


def _to_ready(chunk, tensors):
    for t in tensors:
        for s in (TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD, TensorState.READY_FOR_REDUCE):
            chunk.trans_tensor_state(t, s)


def _check_gather_release(rank, world):
    chunk, tensors, ref = _filled()
    assert chunk.chunk_size % world == 0 and chunk.shard_size * world == chunk.chunk_size
    assert not chunk.is_gathered and all(t.numel() == 0 for t in tensors)
    flat = torch.cat(ref)
    padded = torch.cat([flat, torch.zeros(chunk.chunk_size - flat.numel())])
    assert torch.equal(chunk.shard, padded[rank * chunk.shard_size : (rank + 1) * chunk.shard_size])
    chunk.access()
    assert all(torch.equal(t, r) for t, r in zip(tensors, ref, strict=True))
    chunk.release()
    assert all(t.numel() == 0 for t in tensors)
    handle = chunk.access(async_op=True)
    handle.wait()
    assert handle.is_completed()
    assert all(torch.equal(t, r) for t, r in zip(tensors, ref, strict=True))
    # A gathered copy serves every use until released: writes stay visible.
    tensors[2].add_(1.0)
    assert torch.equal(tensors[2], ref[2] + 1)


def _check_reduce(rank, world, async_op, use_grad_chunk):
    chunk, tensors, _ = _filled()
    chunk.access()
    target = chunk.init_grad_chunk() if use_grad_chunk else chunk
    grads = [torch.full((n,), float(rank + 1)) * (i + 1) for i, n in enumerate(SIZES)]
    for t, g in zip(tensors, grads, strict=True):
        (chunk.grad_view(t) if use_grad_chunk else t).copy_(g)
    _to_ready(chunk, tensors)
    handle = chunk.reduce(async_op=async_op)
    if async_op:
        handle.wait()
    mean_scale = sum(r + 1 for r in range(world)) / world
    expected = torch.cat([torch.full((n,), mean_scale * (i + 1)) for i, n in enumerate(SIZES)])
    expected = torch.cat([expected, torch.zeros(chunk.chunk_size - expected.numel())])
    mine = expected[rank * chunk.shard_size : (rank + 1) * chunk.shard_size]
    torch.testing.assert_close(target.shard, mine)
    assert all(chunk.tensor_state(t) is TensorState.HOLD for t in tensors)
    assert target.buffer is None
    # The share's norm, taken by the reduction; stale once the share changes.
    torch.testing.assert_close(target.reduced_norm(), mine.norm())
    target.shard.mul_(2.0)
    assert target.reduced_norm() is None
    if not use_grad_chunk:
        assert all(t.numel() == 0 for t in tensors)


def _check_reduce_accumulate(rank, world, async_op):
    # Two reductions into the grad chunk, the second with accumulate: its
    # share is the sum's mean, its kept norm the sum's (Gemini's backward on
    # several batches before one step). The parameter chunk's own share (no
    # grad chunk) is never added to.
    chunk, tensors, _ = _filled()
    reduced = []
    for k in (1.0, 10.0):
        chunk.access()
        grad = chunk.init_grad_chunk()
        for i, t in enumerate(tensors):
            chunk.grad_view(t).fill_(k * (rank + 1) * (i + 1))
        _to_ready(chunk, tensors)
        handle = chunk.reduce(async_op=async_op, accumulate=k > 1.0)
        if async_op:
            handle.wait()
        reduced.append(grad.shard.clone())
    mean_scale = sum(r + 1 for r in range(world)) / world
    expected = torch.cat(
        [torch.full((n,), 11.0 * mean_scale * (i + 1)) for i, n in enumerate(SIZES)]
    )
    expected = torch.cat([expected, torch.zeros(chunk.chunk_size - expected.numel())])
    mine = expected[rank * chunk.shard_size : (rank + 1) * chunk.shard_size]
    torch.testing.assert_close(reduced[1], mine)
    torch.testing.assert_close(grad.reduced_norm(), mine.norm())
    alone, own, _ = _filled()
    alone.access()
    for i, t in enumerate(own):
        t.copy_(torch.full_like(t, float(i + 1)))
    _to_ready(alone, own)
    alone.reduce(accumulate=True)  # no grad chunk: the parameter shard is not a gradient
    plain = torch.cat([torch.full((n,), float(i + 1)) for i, n in enumerate(SIZES)])
    plain = torch.cat([plain, torch.zeros(alone.chunk_size - plain.numel())])
    torch.testing.assert_close(
        alone.shard, plain[rank * alone.shard_size : (rank + 1) * alone.shard_size]
    )


def test_a_dropped_share_is_freed_with_its_norm_kept_weakly():
    # The reduced share's norm keeps no share alive: consume_grad drops a
    # grad chunk's share to free it. See [Note: the reduced share's norm].
    chunk, tensors, _ = _filled()
    chunk.access()
    grad = chunk.init_grad_chunk()
    grad.buffer.fill_(2.0)
    _to_ready(chunk, tensors)
    chunk.reduce()
    torch.testing.assert_close(grad.reduced_norm(), grad.shard.norm())
    grad.forget_reduced_norm()  # a writer the version counter does not see
    assert grad.reduced_norm() is None
    chunk.access()
    _to_ready(chunk, tensors)
    chunk.init_grad_chunk().buffer.fill_(2.0)
    chunk.reduce()
    assert grad.reduced_norm() is not None
    share = weakref.ref(grad.shard)
    grad.shard = None
    assert share() is None and grad.reduced_norm() is None


def _check_keep_gathered(rank, world):
    chunk, tensors, ref = _filled(keep_gathered=True)
    assert chunk.is_gathered and chunk.shard is None
    assert all(torch.equal(t, r) for t, r in zip(tensors, ref, strict=True))
    with pytest.raises(RuntimeError, match="cannot release"):
        chunk.release()
    for t in tensors:
        t.fill_(float(rank))
    _to_ready(chunk, tensors)
    chunk.reduce()
    expected = sum(range(world)) / world
    assert all(torch.allclose(t, torch.full_like(t, expected)) for t in tensors)
    assert chunk.reduced_norm() is None  # all-reduced: no share of its own


def _check_norms(rank, world):
    chunk, tensors, ref = _filled()
    total = chunk.l2_norm_sq()
    dist.all_reduce(total)
    torch.testing.assert_close(total, torch.cat(ref).pow(2).sum())
    bad = dist.get_world_size() - 1 == rank
    chunk.access()
    if bad:
        tensors[-1][0] = float("inf")  # the last element lives in the last rank's shard
    chunk.release()  # the change was to the gathered copy only
    assert not bool(chunk.has_inf_or_nan())
    if bad:
        chunk.shard[0] = float("nan")
    flag = chunk.has_inf_or_nan().float()
    dist.all_reduce(flag)
    assert flag.item() == 1.0


def _check_pairing(rank, world):
    half, tensors, _ = _filled()
    master_tensors = [t.clone() for t in _tensors(seed=1)]
    master = Chunk(37, None, torch.float32, compute_device="cpu")
    for t in master_tensors:
        master.append_tensor(t)
    master.close_chunk()
    half.pair(master)
    assert half.paired_chunk is master and master.paired_chunk is half
    half.copy_from_paired()
    half.access()
    assert all(torch.equal(t, r) for t, r in zip(tensors, _tensors(seed=1), strict=True))


def _check_share_writes(rank, world):
    # write_share / commit_share: this rank's share, and nothing else, changes.
    chunk, tensors, _ = _filled()
    lo = rank * chunk.shard_size
    chunk.write_share(torch.full((chunk.shard_size,), float(rank)))
    chunk.access()
    expected = torch.cat([torch.full((chunk.shard_size,), float(r)) for r in range(world)])
    assert torch.equal(chunk.buffer, expected)
    tensors[0].data.fill_(-1.0)  # write through a gathered tensor, then keep it in the shard
    chunk.commit_share()
    chunk.release()
    chunk.access()
    end = min(SIZES[0], lo + chunk.shard_size)
    if lo < SIZES[0]:
        assert torch.equal(chunk.local_share()[: end - lo], torch.full((end - lo,), -1.0))
    # copy_into_slot: a gradient over one tensor's slot, zeros over another's.
    grad = torch.arange(SIZES[2], dtype=torch.float32)
    chunk.copy_into_slot(tensors[2], grad)
    chunk.copy_into_slot(tensors[1], None)
    assert torch.equal(tensors[2].data, grad) and torch.equal(tensors[1].data, torch.zeros(1))
    # sync_gathered: kept-gathered chunks gather every rank's updated share.
    kept, _, _ = _filled(keep_gathered=True)
    kept.write_share(torch.full((kept.shard_size,), float(rank + 1)))
    kept.sync_gathered()
    expected = torch.cat([torch.full((kept.shard_size,), float(r + 1)) for r in range(world)])
    assert torch.equal(kept.buffer, expected)
    with pytest.raises(RuntimeError, match=r"sync_gathered: the chunk is sharded"):
        chunk.sync_gathered()


def _all_cases(rank, world):
    _check_share_writes(rank, world)
    _check_gather_release(rank, world)
    for async_op in (False, True):
        for use_grad_chunk in (False, True):
            _check_reduce(rank, world, async_op, use_grad_chunk)
        _check_reduce_accumulate(rank, world, async_op)
    _check_keep_gathered(rank, world)
    _check_norms(rank, world)
    _check_pairing(rank, world)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_chunk_operations_match_the_unsharded_reference(world_size):
    spawn(_all_cases, world_size, backend="gloo")


def test_without_a_process_group_the_chunk_is_one_rank():
    _check_gather_release(0, 1)


def _collectives_counted(rank, world):
    """The chunk cases with every collective of the process group counted;
    at one rank none may reach it (see [Note: a collective over one rank])."""
    from zerostack.chunk import _comm

    calls = []

    def counted(real):
        def call(*args, **kwargs):
            calls.append(real.__name__)
            return real(*args, **kwargs)

        return call

    real = _comm._all_gather, _comm._reduce_scatter, dist.all_reduce
    _comm._all_gather, _comm._reduce_scatter = counted(real[0]), counted(real[1])
    dist.all_reduce = counted(real[2])
    try:
        _check_gather_release(rank, world)
        for async_op in (False, True):
            _check_reduce(rank, world, async_op, use_grad_chunk=False)
        t = torch.arange(4.0)
        _comm.all_reduce_sum(t)
        _comm.all_reduce_max(t)
        assert torch.equal(t, torch.arange(4.0) * world)
    finally:
        _comm._all_gather, _comm._reduce_scatter, dist.all_reduce = real
    assert bool(calls) == (world > 1), (world, calls)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_collective_over_one_rank_skips_the_process_group(world_size):
    spawn(_collectives_counted, world_size, backend="gloo")


def _managed():
    """A manager of one closed 37-element chunk holding ``_tensors()``."""
    manager = ChunkManager({1: {"chunk_size": 37}}, compute_device="cpu")
    tensors = _tensors()
    for t in tensors:
        manager.register_tensor(t, "fp32", 1)
    manager.close_all_groups()
    (chunk,) = manager.chunks()
    return manager, chunk, tensors


def test_gathered_bytes_are_counted_through_every_gather_release_and_reduce():
    book, other = GatheredBytes(), GatheredBytes()
    size = 37 * 4
    chunk, tensors, _ = _filled()  # closed: sharded, not gathered
    grads = chunk.init_grad_chunk()
    chunk.report_gathered_to(book)
    grads.report_gathered_to(book)  # a grad chunk is created gathered
    assert book.nbytes == size and chunk.buffer_bytes == size
    chunk.access()
    assert book.nbytes == 2 * size
    chunk.release()
    assert book.nbytes == size
    chunk.access(async_op=True).wait()
    assert book.nbytes == 2 * size
    _to_ready(chunk, tensors)
    chunk.reduce()  # into the grad chunk: its buffer goes, the params' stays
    assert (chunk.is_gathered, grads.is_gathered) == (True, False) and book.nbytes == size
    grads.zero_buffer()
    assert book.nbytes == 2 * size
    with pytest.raises(ValueError, match="reports to another GatheredBytes"):
        grads.report_gathered_to(other)  # one count would miss it
    assert (book.nbytes, other.nbytes) == (2 * size, 0)
    grads.report_gathered_to(None)  # takes its bytes back
    grads.report_gathered_to(other)
    assert (book.nbytes, other.nbytes) == (size, size)
    chunk.report_gathered_to(None)
    assert book.nbytes == 0


def test_an_async_gather_is_finished_by_any_later_use_of_the_chunk():
    # A gather issued ahead (Gemini's max_prefetch) and then used without its
    # handle: access, release and reduce wait for it first, so no tensor is
    # read unbound and no buffer is dropped with a copy into it in flight.
    for use in ("access", "release", "reduce"):
        chunk, tensors, ref = _filled()
        handle = chunk.access(async_op=True)
        assert not handle.is_completed() and all(t.numel() == 0 for t in tensors)
        if use == "access":
            assert chunk.access() is None
            assert all(torch.equal(t, r) for t, r in zip(tensors, ref, strict=True))
        elif use == "release":
            chunk.release()
            assert not chunk.is_gathered
        else:
            _to_ready(chunk, tensors)  # states only: a reduce needs the tensors bound
            chunk.reduce()
        assert handle.is_completed(), use
    manager, chunk, tensors = _managed()
    handle = manager.access_chunk(chunk, async_op=True)
    assert manager.access_chunk(chunk) is None and handle.is_completed()
    assert all(torch.equal(t, r) for t, r in zip(tensors, _tensors(), strict=True))


class _Landing:
    """Stands in for a landing copy's CUDA event: counts the host's waits."""

    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


def test_only_reading_or_replacing_the_shard_waits_for_its_landing_copy():
    # See [Note: a reduced share lands on the host]. The manager's memory
    # accounting after every reduction reads sizes only: a wait there made
    # each reduction wait for the backward queued before it.
    manager, chunk, tensors = _managed()
    chunk._landing = landing = _Landing()
    assert chunk.memory_usage() and landing.waits == 0
    manager.access_chunk(chunk)  # a gather copies from the share: it waits
    assert landing.waits == 1 and chunk._landing is None
    _to_ready(chunk, tensors)
    chunk._landing = landing = _Landing()
    manager.reduce_chunk(chunk)  # reduce settles first, then accounts sizes only
    assert landing.waits == 1
    chunk._landing = landing = _Landing()
    assert manager.total_mem["cpu"] > 0 and chunk.memory_usage() and landing.waits == 0
    share = chunk.shard
    assert landing.waits == 1 and chunk._landing is None
    chunk._landing = landing = _Landing()
    chunk.shard = share.clone()  # a replaced share may still be written: wait first
    assert landing.waits == 1


def test_shard_move_and_pin_memory_without_cuda(monkeypatch):
    import zerostack.chunk._chunk as chunk_module

    monkeypatch.setattr(chunk_module, "_warned_pin", False)
    if torch.cuda.is_available():
        chunk, _, _ = _filled(pin_memory=True)
    else:
        with pytest.warns(UserWarning, match=r"pin_memory=True has no effect without CUDA"):
            chunk, _, _ = _filled(pin_memory=True)
    chunk.shard_move("cpu")
    assert chunk.shard_device.type == "cpu"
    assert chunk.shard.is_pinned() == torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_shards_and_moves_on_cuda():
    tensors = _tensors()
    chunk = Chunk(
        37, None, torch.float32, compute_device="cuda", shard_device="cpu", pin_memory=True
    )
    for t in tensors:
        chunk.append_tensor(t)
    chunk.close_chunk()
    assert chunk.shard.is_pinned() and chunk.shard.device.type == "cpu"
    chunk.access()
    assert all(t.is_cuda for t in tensors)
    assert all(torch.equal(t.cpu(), r) for t, r in zip(tensors, _tensors(), strict=True))
    chunk.release()
    chunk.shard_move("cuda")
    assert chunk.shard.is_cuda
    chunk.shard_move("cpu", non_blocking=True)
    torch.cuda.synchronize()
    assert chunk.shard.is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pin", [False, True])
def test_reduce_writes_into_the_host_shard_it_replaces(pin):
    # The reduced gradient goes into the existing host shard: the same
    # storage (no fresh pages each step), still pinned when it was.
    tensors = _tensors()
    chunk = Chunk(
        37, None, torch.float32, compute_device="cuda", shard_device="cpu", pin_memory=pin
    )
    for t in tensors:
        chunk.append_tensor(t)
    chunk.close_chunk()
    shard = chunk.shard
    chunk.access()
    for t in tensors:
        t.data.fill_(2.5)  # the gradient written over the parameters (reuse_fp16_chunk)
    _to_ready(chunk, tensors)
    chunk.reduce()
    assert chunk.shard is shard and chunk.shard.is_pinned() == pin
    assert not chunk.is_gathered
    used = sum(t.numel() for t in tensors)
    assert torch.equal(chunk.shard[:used], torch.full((used,), 2.5))
    # Its norm was taken on the device, before the copy to the host.
    norm = chunk.reduced_norm()
    assert norm.is_cuda
    torch.testing.assert_close(norm.cpu(), chunk.shard.norm())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_reduced_share_lands_in_pinned_host_memory_without_making_the_host_wait():
    # See [Note: a reduced share lands on the host]: reduce returns while
    # the kernels queued before it still run; the copy runs beside those
    # queued after it, on its side stream; reading the shard waits for it.
    tensors = [torch.randn(1 << 20) for _ in range(4)]
    chunk = Chunk(4 << 20, None, torch.float32, compute_device="cuda", shard_device="cpu",
                  pin_memory=True)  # fmt: skip
    for t in tensors:
        chunk.append_tensor(t)
    chunk.close_chunk()
    share = chunk.shard
    chunk.access()
    for t in tensors:
        t.data.fill_(2.5)
    _to_ready(chunk, tensors)
    torch.cuda._sleep(2_000_000_000)  # ~1 s queued before the reduction
    busy = torch.cuda.Event()
    busy.record()
    chunk.reduce()
    assert not busy.query(), "reduce made the host wait for the kernels queued before it"
    torch.cuda._sleep(2_000_000_000)  # ~1 s queued after it
    after = torch.cuda.Event()
    after.record()
    assert chunk.shard is share and busy.query(), "reading the shard did not wait for the copy"
    assert not after.query(), "the copy waited for the kernels queued after the reduction"
    assert torch.equal(share, torch.full_like(share, 2.5))
    torch.testing.assert_close(chunk.reduced_norm().cpu(), share.norm())


# -- bad input ----------------------------------------------------------------


def test_bad_chunk_size_and_dtype():
    with pytest.raises(ValueError, match=r"chunk_size must be an int >= 1 \(got 0\)"):
        Chunk(0, None, torch.float32)
    with pytest.raises(ValueError, match=r"dtype must be floating point \(got torch.int64\)"):
        Chunk(4, None, torch.int64)


def _open_chunk():
    chunk = Chunk(10, None, torch.float32, compute_device="cpu")
    chunk.append_tensor(torch.ones(4))
    return chunk


def _snapshot(chunk):
    return (chunk.utilized_size, len(chunk.tensors_info), chunk.buffer.clone())


@pytest.mark.parametrize(
    ("tensor", "exc", "match"),
    [
        (
            torch.zeros(3, dtype=torch.float16),
            TypeError,
            r"dtype torch.float16 does not match the chunk's torch.float32",
        ),
        (torch.zeros(4, 4).t(), ValueError, r"must be dense and contiguous"),
        (torch.zeros(3).to_sparse(), ValueError, r"must be dense and contiguous"),
        (torch.zeros(7), ChunkFullError, r"a tensor of 7 elements does not fit \(6 of 10 left\)"),
        (
            torch.zeros(2, device="meta"),
            ValueError,
            r"is on the meta device; build the model under LazyInitContext",
        ),
    ],
)
def test_bad_appends_leave_the_chunk_unchanged(tensor, exc, match):
    chunk = _open_chunk()
    before = _snapshot(chunk)
    with pytest.raises(exc, match=match):
        chunk.append_tensor(tensor)
    after = _snapshot(chunk)
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])


def test_register_twice_and_after_close():
    chunk = Chunk(10, None, torch.float32, compute_device="cpu")
    t = torch.ones(2)
    chunk.append_tensor(t)
    with pytest.raises(ValueError, match=r"already registered"):
        chunk.append_tensor(t)
    chunk.close_chunk()
    with pytest.raises(RuntimeError, match=r"Chunk 0.append_tensor: the chunk is closed"):
        chunk.append_tensor(torch.ones(2))


def test_reduce_before_every_tensor_is_ready_leaves_the_chunk_unchanged():
    chunk, tensors, _ = _filled()
    chunk.access()
    chunk.init_grad_chunk().buffer.fill_(3.0)
    _to_ready(chunk, tensors[:-1])
    with pytest.raises(RuntimeError, match=r"every tensor must be READY_FOR_REDUCE"):
        chunk.reduce()
    assert chunk.state_count[TensorState.READY_FOR_REDUCE] == len(tensors) - 1
    assert torch.equal(chunk.grad_chunk.buffer, torch.full((chunk.chunk_size,), 3.0))


def test_operations_before_close():
    chunk = _open_chunk()
    with pytest.raises(RuntimeError, match=r"Chunk 0.access: call close_chunk first"):
        chunk.access()
    with pytest.raises(RuntimeError, match=r"Chunk 0.reduce: call close_chunk first"):
        chunk.reduce()


def test_release_while_in_use():
    chunk, tensors, _ = _filled()
    chunk.access()
    chunk.trans_tensor_state(tensors[0], TensorState.COMPUTE)
    with pytest.raises(RuntimeError, match=r"cannot release .*'COMPUTE': 1"):
        chunk.release()
    assert chunk.is_gathered


def test_consume_grad_drops_the_reduced_shard_with_exact_books():
    from zerostack.chunk import ChunkManager

    manager = ChunkManager({"k": {"chunk_size": 64}}, compute_device="cpu", reuse_fp16_chunk=False)
    tensors = _tensors()
    for t in tensors:
        manager.register_tensor(t, "fp16_param", "k")
    manager.close_all_groups()
    chunk = manager.get_chunk(tensors[0])
    manager.access_chunk(chunk)
    grad = manager.init_grad_chunk(chunk)
    for t in tensors:
        chunk.grad_view(t).fill_(1.0)
    _to_ready(chunk, tensors)
    manager.reduce_chunk(chunk)
    assert grad.shard is not None
    before = manager.total_mem["cpu"]
    manager.consume_grad(chunk)
    assert grad.shard is None
    assert manager.total_mem["cpu"] == before - chunk.shard_size * 4
    assert manager.total_mem["cpu"] == sum(
        sum(c.memory_usage().values())
        + sum(c.grad_chunk.memory_usage().values() if c.grad_chunk else ())
        for c in manager.chunks()
    )


def test_phase_is_a_profiler_range_only_under_a_profiler():
    from torch.profiler import ProfilerActivity, profile

    from zerostack.chunk import phase

    assert phase("zerostack::x").__class__.__name__ == "nullcontext"
    with profile(activities=[ProfilerActivity.CPU]) as prof, phase("zerostack::x"):
        torch.ones(1).add_(1)
    assert any(e.name == "zerostack::x" for e in prof.events())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pin", [False, True])
def test_an_async_gather_of_a_pinned_host_shard_copies_beside_the_compute_stream(pin):
    # See [Note: a prefetch copies beside compute]: the copy waits for the
    # kernels queued before it, then runs while those queued after it run.
    from zerostack.chunk._streams import copy_stream

    tensors = [torch.randn(1 << 20) for _ in range(4)]
    ref = [t.clone() for t in tensors]
    chunk = Chunk(4 << 20, None, torch.float32, compute_device="cuda", shard_device="cpu",
                  pin_memory=pin)  # fmt: skip
    for t in tensors:
        chunk.append_tensor(t)
    chunk.close_chunk()
    before = torch.cuda.Event(enable_timing=False)
    torch.cuda._sleep(100_000_000)  # queued before the gather (~50 ms)
    before.record()
    handle = chunk.access(async_op=True)
    after = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # queued after it (~1 s)
    after.record()
    if pin:
        copy_stream(chunk.compute_device).synchronize()
        assert before.query(), "the copy did not wait for the kernels queued before it"
        assert not after.query(), "the copy waited for the kernels queued after it"
    handle.wait()
    assert all(torch.equal(t.cpu(), r) for t, r in zip(tensors, ref, strict=True))
    chunk.release()
    torch.cuda.synchronize()
