"""Placement bookkeeping on a CPU compute device: what static fractions and
the auto plan put where, MemStats, eviction and prefetch counts."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer, MemStats
from zerostack.gemini._device_lane import staging_bytes
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)
CHUNKS = {1: {"chunk_size": 20_000, "keep_gathered": False}}


def _wrap(**kwargs):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model,
        mixed_precision=torch.float32,
        chunk_config_dict=CHUNKS,
        compute_device="cpu",
        **kwargs,
    )
    return ddp, GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-3), ddp)


def _steps(ddp, opt, n):
    for step in range(n):
        idx, tgt = make_batch(CONFIG, 2, 16, seed=step)
        opt.backward(ddp(idx, tgt))
        opt.step()


def _bytes(chunks):
    return sum(c.chunk_size * c.dtype.itemsize for c in chunks)


@pytest.mark.parametrize("chunk_size", [6_000, 20_000, 60_000])
@pytest.mark.parametrize("frac", [0.05, 0.25, 0.5, 0.75])
def test_any_optimizer_share_offloads_the_fewest_last_chunks_that_hold_it(frac, chunk_size):
    """offload_optim_frac=f puts on the CPU every master chunk holding part
    of the last f of the elements: at least f (so any f > 0 offloads a
    chunk, as ColossalAI's static policy does), and no chunk more. It once
    took only chunks whose first tensor lay in the last f, and 0.25 of a
    model of three chunks offloaded none, silently."""
    torch.manual_seed(0)
    ddp = GeminiDDP(
        TinyGPT(CONFIG), mixed_precision=torch.float32, offload_optim_frac=frac,
        chunk_config_dict={1: {"chunk_size": chunk_size, "keep_gathered": False}},
        compute_device="cpu",
    )  # fmt: skip
    masters = sorted(ddp.chunk_manager.chunks("fp32_param"), key=lambda c: c.index)
    sizes = [m.utilized_size for m in masters]
    offloaded = [m in ddp.offloaded_masters for m in masters]
    k = sum(offloaded)
    assert k >= 1 and offloaded == [False] * (len(masters) - k) + [True] * k
    assert all(m.shard_device.type == "cpu" for m in masters[-k:])
    total = sum(sizes)
    assert sum(sizes[-k:]) >= frac * total  # at least the share
    assert sum(sizes[-k + 1 :]) < frac * total if k > 1 else True  # and no chunk more


@pytest.mark.parametrize("frac", [0.0, 0.3, 0.5, 1.0])
def test_static_fractions_are_shares_of_bytes(frac):
    ddp, _ = _wrap(offload_optim_frac=frac, shard_param_frac=1.0 - frac)
    masters = ddp.chunk_manager.chunks("fp32")
    offloaded = [m for m in masters if m in ddp.offloaded_masters]
    # Whole chunks: the share is met to within one chunk, and it is the last chunks.
    assert abs(_bytes(offloaded) - frac * _bytes(masters)) <= _bytes(masters[:1])
    assert offloaded == masters[len(masters) - len(offloaded) :]
    gathered = [c for c in ddp.grad_chunks if c.keep_gathered]
    assert abs(_bytes(gathered) - frac * _bytes(ddp.grad_chunks)) <= _bytes(ddp.grad_chunks[:1])
    # Exact books: the manager's total is the sum over chunks.
    total = sum(sum(c.memory_usage().values()) for c in ddp.chunk_manager.chunks())
    assert ddp.chunk_manager.total_mem["cpu"] == total
    # What the step-time floor takes: master elements on the host and on the
    # device; on a CPU compute device nothing is streamed, and a host update's
    # new value counts as copied to the device (fp32 here: 4 B each way).
    amounts = ddp.step_amounts()
    host, on_device = amounts["host_numel"], amounts["gpu_numel"]
    assert host == sum(m.shard_size for m in offloaded)
    assert on_device == sum(m.shard_size for m in masters if m not in offloaded)
    assert (host > 0) == (frac > 0) and (on_device > 0) == (frac < 1)
    assert amounts["streamed_bytes"] == 0
    assert amounts["h2d_bytes_per_param"] == amounts["d2h_bytes_per_param"] == (4 if host else 0)


def _check_running_counts(auto):
    """Compare the placement's running byte counts with a sum over every
    chunk before and after each gather (evictions, prefetches, the plan's
    moves between them); returns the model bytes recounted."""
    recounts = []

    def check():
        gathered = sum(c.chunk_size * c.dtype.itemsize for c in auto.param_chunks if c.is_gathered)
        shards = sum(auto.shard_bytes(c) for c in auto.param_chunks if c in auto.on_device)
        assert auto.gathered_bytes() == gathered
        total = shards + gathered + auto.optim_bytes_on_device + auto.reserved_bytes
        assert auto.model_bytes() == total
        recounts.append(total)

    for name in ("before_access", "after_access"):
        hook = getattr(auto, name)

        def checked(chunks, training, hook=hook):
            check()
            hook(chunks, training)
            check()

        setattr(auto, name, checked)
    return recounts


def test_auto_records_plans_evicts_and_prefetches():
    n = sum(p.numel() for p in TinyGPT(CONFIG).parameters())
    capacity = 4 * n + 3 * 20_000 * 4 + 6 * n  # shards, a few gathered chunks, half the optimizer
    ddp, opt = _wrap(
        placement_policy="auto",
        gpu_capacity_bytes=capacity,
        steady_cuda_cap_ratio=1.0,
        max_prefetch=2,
    )
    auto = ddp.auto
    assert auto.warming_up and not auto.planned
    recounts = _check_running_counts(auto)
    _steps(ddp, opt, 3)
    assert recounts and len(set(recounts)) > 1  # checked at every gather, as the books moved
    stats = auto.stats
    assert isinstance(stats, MemStats)
    # Forward then backward: every chunk appears, first uses in creation order.
    assert sorted(stats.chunk_order()) == sorted(c.index for c in ddp.grad_chunks)
    assert stats.chunk_order() == sorted(stats.chunk_order())
    first = stats.order[0][0]
    assert stats.next_use(first, 0) > 0
    assert stats.next_use(first, len(stats.order) - 1) >= len(stats.order) - 1
    assert stats.max_non_model_bytes == 0  # no allocator to ask on a CPU
    # The plan: every shard on the "device", part of the optimizer chunks.
    assert auto.planned and len(auto.on_device & set(ddp.grad_chunks)) == len(ddp.grad_chunks)
    on = len(ddp.grad_chunks) - len(ddp.offloaded_masters)
    assert 0 < on < len(ddp.grad_chunks)
    assert auto.optim_bytes_on_device == on * 20_000 * (4 + 8)
    assert auto.evictions > 0 and auto.prefetches > 0
    assert auto.peak_model_bytes <= auto.steady_limit()


def test_the_running_counts_follow_shards_that_leave_the_device():
    # The plan moves param shards to the CPU when the device cannot keep
    # them all (a 0.6 share of a capacity of the shards and three gathered
    # chunks): the shard count goes down as well as up.
    n = sum(p.numel() for p in TinyGPT(CONFIG).parameters())
    ddp, opt = _wrap(
        placement_policy="auto",
        gpu_capacity_bytes=4 * n + 3 * 20_000 * 4,
        warmup_non_model_data_ratio=0.0,
        steady_cuda_cap_ratio=0.6,
        max_prefetch=2,
    )
    auto = ddp.auto
    moved_off = []
    move = auto.move

    def counted_move(chunk, to_device):
        if chunk in auto.on_device and not to_device and chunk in auto.param_chunks:
            moved_off.append(chunk.index)
        move(chunk, to_device)

    auto.move = counted_move
    recounts = _check_running_counts(auto)
    _steps(ddp, opt, 3)
    assert moved_off and recounts


def _activations(moment):
    """Non-model bytes injected for the warm-up's period ``moment``: rising
    over the forward (16 gathers), falling over the backward, as activations
    do; 10 optimizer chunks' worth (fp32: 12 B a parameter) at the top."""
    top = 10 * 20_000 * 12
    return top * (moment + 1) // 16 if moment < 16 else top * (32 - moment) // 16


def _auto_with_activations(capacity):
    ddp, opt = _wrap(
        placement_policy="auto", gpu_capacity_bytes=capacity, steady_cuda_cap_ratio=1.0
    )
    auto = ddp.auto
    auto._period_non_model_bytes = lambda: _activations(auto._period_open)
    return ddp, opt


def test_auto_fills_what_each_gather_leaves_free():
    # The room for what stays on the device is the smallest that any gather
    # leaves, not the capacity less the peak non-model memory and the peak of
    # gathered chunks, which come at different gathers.
    ddp, opt = _auto_with_activations(10**9)
    _steps(ddp, opt, 1)
    gathered = ddp.auto.stats.gathered_bytes  # the same for every capacity
    need = [_activations(m) + g for m, g in enumerate(gathered)]
    shards = 4 * sum(c.chunk_size for c in ddp.grad_chunks)
    capacity = shards + 3 * 20_000 * 12 + max(need)  # three optimizer chunks fit, no more
    both_peaks = max(map(_activations, range(len(gathered)))) + max(gathered)
    assert both_peaks > max(need), "the peaks coincide: keeping both free fits three too"
    ddp, opt = _auto_with_activations(capacity)
    auto = ddp.auto
    held = []
    after = auto.after_access

    def books(chunks, training):  # model bytes plus the moment's activations, counted apart
        after(chunks, training)
        if training and not auto.warming_up:
            shards = sum(auto.shard_bytes(c) for c in auto.param_chunks if c in auto.on_device)
            total = shards + auto.gathered_bytes() + auto.optim_bytes_on_device
            held.append(total + _activations(auto.moment - 1))

    auto.after_access = books
    _steps(ddp, opt, 3)
    assert auto.stats.gathered_bytes == gathered
    assert auto.non_model_bytes_at == [_activations(m) for m in range(len(gathered))]
    assert auto.room_bytes() == capacity - max(need)
    assert len(ddp.grad_chunks) - len(ddp.offloaded_masters) == 3
    assert len(held) == 2 * len(gathered), "the steady iterations did not gather as the warm-up"
    assert max(held) <= capacity, (max(held), capacity)
    assert auto.evictions > 0 and auto.least_headroom_bytes >= 0


def test_auto_gathers_off_the_warm_ups_path_keep_the_smallest_limit():
    # A steady iteration that gathers other chunks than the warm-up did at
    # some gather (a branch taken later, say) cannot know the non-model
    # peaks ahead: from there on, every gather keeps the smallest limit.
    ddp, opt = _auto_with_activations(10**9)
    _steps(ddp, opt, 1)
    auto = ddp.auto
    auto.stats.order[5] = (-1,)  # as if the warm-up had gathered another chunk there
    seen = []
    make_room = auto._make_room

    def record(chunks, moment):
        seen.append(moment)
        make_room(chunks, moment)

    auto._make_room = record
    _steps(ddp, opt, 2)
    n = len(auto.stats.order)
    assert seen == 2 * ([0, 1, 2, 3, 4] + [None] * (n - 5)), seen
    assert auto.steady_limit(None) == auto.steady_limit(16) < auto.steady_limit(4)


def _ranks_agree_per_gather(rank, world):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, compute_device="cpu", placement_policy="auto",
        chunk_config_dict={world: {"chunk_size": 20_000}}, gpu_capacity_bytes=10**9,
    )  # fmt: skip
    opt = GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-3), ddp)
    auto = ddp.auto

    def mine(m, r=rank):  # each rank peaks at other gathers
        return _activations(m) * (1 + r) if m % world == r else 0

    auto._period_non_model_bytes = lambda: mine(auto._period_open)
    _steps(ddp, opt, 1)
    moments = len(auto.stats.order)
    assert auto.non_model_bytes_at == [
        max(mine(m, r) for r in range(world)) for m in range(moments)
    ]
    assert auto.non_model_reserve == max(auto.non_model_bytes_at)
    # Ranks whose warm-ups gathered in other orders: one limit, the largest peak.
    auto.stats.order[rank] = (-1,)
    auto.stats.non_model_bytes = [5 + rank] * moments
    auto._agree()
    assert auto.non_model_bytes_at == [] and auto.non_model_reserve == 5 + world - 1
    assert auto.steady_limit(0) == auto.steady_limit()


def test_ranks_agree_on_each_gathers_non_model_peak():
    spawn(_ranks_agree_per_gather, 2, backend="gloo", timeout_s=120)


def test_auto_with_no_room_keeps_everything_on_the_cpu_and_trains():
    ddp, opt = _wrap(placement_policy="auto", gpu_capacity_bytes=1)
    _steps(ddp, opt, 2)
    assert not ddp.auto.on_device
    assert len(ddp.offloaded_masters) == len(ddp.grad_chunks)


@pytest.mark.parametrize("scatter", [True, False])
def test_scatter_after_inference(scatter):
    ddp, _ = _wrap(scatter_after_inference=scatter)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    with torch.no_grad():
        ddp(idx, tgt)
    assert (not ddp.chunk_manager.accessed_chunks) == scatter


def test_auto_keeps_the_device_lanes_staging_out_of_the_room_for_gathered_chunks():
    # The plan takes the device lane's staging (gpu_update_fraction) out of its
    # room; the steady state's evictions must too. They once counted shards,
    # gathered chunks and optimizer chunks only, so gathered chunks filled the
    # staging's bytes: LLaMA 1.1B capped at 12 GiB kept every chunk gathered,
    # 1.2 GB over the plan, and ran out of memory in most runs.
    n = sum(p.numel() for p in TinyGPT(CONFIG).parameters())
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.bfloat16, chunk_config_dict=CHUNKS, compute_device="cpu",
        placement_policy="auto", gpu_capacity_bytes=2 * n + 12 * 20_000 * 2 + 6 * n,
        steady_cuda_cap_ratio=1.0, max_prefetch=0,
    )  # fmt: skip
    opt = GeminiOptimizer(
        HybridAdam(list(model.parameters()), lr=1e-3), ddp, gpu_update_fraction=1.0
    )
    auto = ddp.auto
    worst = [0]
    after = auto.after_access

    def staging():  # the lane's slots (made at the first update; planned from the first step)
        return opt._lane.staging.staging_bytes() if opt._lane is not None else 0

    def books(chunks, training):  # what the device holds, counted apart from model_bytes()
        after(chunks, training)
        shards = sum(auto.shard_bytes(c) for c in auto.param_chunks if c in auto.on_device)
        held = shards + auto.gathered_bytes() + auto.optim_bytes_on_device + staging()
        worst[0] = max(worst[0], held if not auto.warming_up else 0)

    auto.after_access = books
    _steps(ddp, opt, 4)
    assert opt.device_lane_chunks and staging() > 0, "no device lane: nothing to test"
    assert 0 < worst[0] <= auto.steady_limit(), (worst[0], auto.steady_limit())
    assert auto.evictions > 0, "nothing evicted: the capacity leaves the test no limit to keep"
    assert auto.reserved_bytes == staging()


@pytest.mark.parametrize("tied", [True, False])
def test_auto_keeps_free_the_staging_of_the_lanes_largest_shard(tied):
    # The device lane's staging holds the largest shard it takes. The
    # embedding's chunk, larger than a layer's, is first in compute order and
    # goes to the device first; an untied head's, as large, is left to CPU
    # Adam (the lane takes no chunk larger than the median): a layer's
    # staging stays free.
    config = GPTConfig(bias=False, vocab_size=1024, tie_embeddings=tied)

    def wrap(capacity):
        torch.manual_seed(0)
        model = TinyGPT(config)
        ddp = GeminiDDP(
            model, mixed_precision=torch.bfloat16, chunk_config_dict=CHUNKS, compute_device="cpu",
            placement_policy="auto", gpu_capacity_bytes=capacity, steady_cuda_cap_ratio=1.0,
        )  # fmt: skip
        adam = HybridAdam(list(model.parameters()), lr=1e-3)
        return ddp, GeminiOptimizer(adam, ddp, gpu_update_fraction=0.5)

    ddp, opt = wrap(10**9)
    _steps(ddp, opt, 1)
    gathered = 10**9 - ddp.auto.room_bytes()  # no non-model bytes on a CPU
    sizes = [c.chunk_size for c in ddp.grad_chunks]
    assert sizes[0] == 1024 * 64 > max(sizes[1 : len(sizes) - (not tied)]) == 20_000, sizes
    layer = staging_bytes(20_000, torch.bfloat16)
    assert staging_bytes(sizes[0], torch.bfloat16) - layer > 2 * 20_000 * 12
    # The embedding's and two layers' optimizer chunks fit beside a layer's staging.
    capacity = gathered + 2 * sum(sizes) + (sizes[0] + 2 * 20_000) * 12 + layer
    ddp, opt = wrap(capacity)
    _steps(ddp, opt, 3)
    on_device = [
        i for i, m in enumerate(ddp.chunk_manager.chunks("fp32")) if m in ddp.auto.on_device
    ]
    assert on_device == [0, 1, 2], on_device
    assert opt.device_lane_chunks, "no device lane: nothing to test"
    assert ddp.auto.reserved_bytes == opt.device_lane_staging_bytes == layer


def test_auto_places_the_most_optimizer_chunks_that_fit_beside_their_staging():
    # The staging need not shrink as optimizer chunks move to the device (a
    # lane left with no chunk costs nothing): a plan that stopped at the first
    # chunk that did not fit kept a staging larger than its room.
    ddp, opt = _wrap(placement_policy="auto", gpu_capacity_bytes=10**9, steady_cuda_cap_ratio=1.0)
    _steps(ddp, opt, 1)
    gathered = 10**9 - ddp.auto.room_bytes()
    need = 20_000 * 12  # an optimizer chunk: fp32 master and two moments
    shards = 4 * sum(c.chunk_size for c in ddp.grad_chunks)
    room = 2 * need + 1_000  # beside the shards: two optimizer chunks, with no staging
    ddp, opt = _wrap(
        placement_policy="auto", gpu_capacity_bytes=gathered + shards + room,
        steady_cuda_cap_ratio=1.0,
    )  # fmt: skip
    masters = len(ddp.grad_chunks)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    opt.backward(ddp(idx, tgt))  # the warm-up; the plan comes at the step

    def staging(host_held):  # large while eight or nine chunks stay on the host, else none
        return 3 * need if len(host_held) >= masters - 1 else 0

    assert ddp.plan_placement(dict(opt.pairs), 8, staging)
    auto = ddp.auto
    assert len(auto.on_device & set(ddp.chunk_manager.chunks("fp32"))) == 2
    assert auto.reserved_bytes == 0 and auto.optim_bytes_on_device == 2 * need
    opt.step()  # the plan stands: the optimizer's own plan is not taken again


def test_auto_keeps_no_room_for_a_device_lane_that_took_no_chunk():
    # Every optimizer chunk fits on the device: gpu_update_fraction finds no
    # CPU-held chunk, no staging is allocated, and none may be counted as held.
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.bfloat16, chunk_config_dict=CHUNKS, compute_device="cpu",
        placement_policy="auto", gpu_capacity_bytes=10**9,
    )  # fmt: skip
    opt = GeminiOptimizer(
        HybridAdam(list(model.parameters()), lr=1e-3), ddp, gpu_update_fraction=0.5
    )
    _steps(ddp, opt, 2)
    assert not ddp.offloaded_masters and not opt.device_lane_chunks
    assert ddp.auto.reserved_bytes == 0


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a failing backward")


class _Blocks(torch.nn.Module):
    """Six linear layers, one chunk each; ``skip`` leaves one out of forward
    (an order the first iteration did not record); ``fail`` raises in it,
    ``fail_backward`` in its backward; ``checkpointed`` layers recompute."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64, bias=False) for _ in range(6))
        self.skip = self.fail = self.fail_backward = None
        self.checkpointed: tuple[int, ...] = ()

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == self.fail:
                raise RuntimeError("a failing forward")
            if i in self.checkpointed:
                x = checkpoint(lambda y, f=layer: torch.tanh(f(y)), x, use_reentrant=False)
            elif i != self.skip:
                x = torch.tanh(layer(x))
            if i == self.fail_backward:
                x = _FailingBackward.apply(x)
        return x.square().mean()


def _blocks(max_prefetch, device="cpu", **kwargs):
    torch.manual_seed(0)
    model = _Blocks()
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, compute_device=device,
        chunk_config_dict={1: {"chunk_size": 64 * 64, "keep_gathered": False}},
        max_prefetch=max_prefetch, **{"offload_param_frac": 1.0, **kwargs},
    )  # fmt: skip
    opt = GeminiOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ddp)
    return model, ddp, opt


def _watch(placement):
    """Per gather: how many of its chunks were gathered ahead, and the most
    chunks in flight at once."""
    seen = {"ahead": [], "in_flight": 0}
    before = placement.before_access

    def watched(chunks, training):
        seen["ahead"].append(sum(c in placement.prefetched for c in chunks))
        seen["in_flight"] = max(seen["in_flight"], len(placement._prefetched))
        before(chunks, training)

    placement.before_access = watched
    return seen


def _train(
    model, ddp, opt, steps, skip_at=None, fail_at=None, fail_backward_at=None, evaluate=True
):
    for step in range(steps):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        x = x.to(ddp.compute_device)
        model.skip = 3 if step == skip_at else None
        model.fail = 4 if step == fail_at else None
        model.fail_backward = 2 if step == fail_backward_at else None
        try:
            loss = ddp(x)
            opt.backward(loss)
        except RuntimeError:
            opt.zero_grad()
            assert not ddp.placement.prefetched, "a failed batch left gathers in flight"
            continue
        assert not ddp.placement.prefetched, "gathers in flight after backward"
        opt.step()
        opt.zero_grad()
        if evaluate:  # an evaluation between steps (it waits for every update)
            with torch.no_grad():
                ddp(x)
    return {k: v.clone() for k, v in ddp.state_dict().items()}


@pytest.mark.parametrize("depth", [1, 2])
def test_static_gathers_ahead_in_the_recorded_order_and_trains_the_same(depth):
    want = _train(*_blocks(0), 4, evaluate=False)
    model, ddp, opt = _blocks(depth)
    seen = _watch(ddp.placement)
    access, copies = ddp.chunk_manager.access_chunk, []

    def counted(chunk, async_op=False):  # a gather that copies: "ahead" or "on use"
        if not chunk.is_gathered:
            copies[-1].append("ahead" if async_op else "on use")
        return access(chunk, async_op)

    ddp.chunk_manager.access_chunk = counted
    forward = ddp.forward
    ddp.forward = lambda *a: copies.append([]) or forward(*a)  # one list per iteration
    got = _train(model, ddp, opt, 4, evaluate=False)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert len(ddp.placement.order) == 6 + 6  # one gather per layer in forward and in backward
    recording, *later = copies
    assert later[-1][-6:] == ["on use"] * 6  # _train's state_dict() at the end
    later[-1] = later[-1][:-6]
    assert recording == ["on use"] * 12
    # Later: only forward's first gather waits for its copy (its chunk was
    # reduced and released at the end of the last backward); the chunks that
    # forward uses last and backward first stay gathered across the end of
    # forward (depth 1 keeps one of the two).
    assert later == [["on use"] + ["ahead"] * (11 - depth)] * 3
    assert ddp.placement.prefetches == sum(seen["ahead"]) == 3 * (11 - depth)
    assert seen["in_flight"] <= depth


@pytest.mark.parametrize("checkpointed", [(), (1, 2, 3)])
def test_static_gathers_ahead_survive_a_changed_order_and_failing_passes(checkpointed):
    runs = []
    for depth in (0, 2):
        model, ddp, opt = _blocks(depth)
        model.checkpointed = checkpointed
        runs.append(_train(model, ddp, opt, 7, skip_at=2, fail_at=4, fail_backward_at=5))
    assert all(torch.equal(runs[1][k], runs[0][k]) for k in runs[0])
    assert ddp.placement.prefetches > 0


def test_static_records_one_iteration_whatever_runs_before_its_backward():
    # A forward with grad enabled but no backward (a sanity check), and an
    # evaluation forward that raises, before the first backward: the order is
    # still the iteration's twelve gathers, and every gather ahead is used.
    model, ddp, opt = _blocks(2)
    seen = _watch(ddp.placement)
    x = torch.randn(8, 64)
    ddp(x)
    loss = ddp(x)
    model.fail = 4
    with pytest.raises(RuntimeError, match="a failing forward"), torch.no_grad():
        ddp(x)
    model.fail = None
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    assert len(ddp.placement.order) == 12
    _train(model, ddp, opt, 3)
    assert ddp.placement.prefetches == sum(seen["ahead"]) > 0


def test_a_chunk_whose_cpu_update_is_pending_is_not_gathered_ahead():
    # Every master on the CPU: updates run on the CPU-step worker beside the
    # next forward (slowed down here, so that the forward catches up with
    # them), and a chunk is gathered ahead only once its update is in.
    want = _train(*_blocks(0, offload_optim_frac=1.0), 4, evaluate=False)
    model, ddp, opt = _blocks(2, offload_optim_frac=1.0)
    pipeline, access = ddp.step_pipeline, ddp.chunk_manager.access_chunk
    submit, early = pipeline.submit, []

    def slow_submit(chunk, update, *args, **kwargs):
        def slow(*a):
            time.sleep(0.02)
            update(*a)

        return submit(chunk, slow, *args, **kwargs)

    pipeline.submit = slow_submit

    def checked(chunk, async_op=False):
        if async_op and chunk in pipeline:
            early.append(chunk.index)
        return access(chunk, async_op)

    ddp.chunk_manager.access_chunk = checked
    got = _train(model, ddp, opt, 4, evaluate=False)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not early and ddp.placement.prefetches > 0


@pytest.mark.parametrize("policy", ["static", "auto"])
def test_a_load_keeps_its_values_in_chunks_gathered_or_gathered_ahead(policy):
    # A frozen layer (no master): its values are written into its chunk. A
    # gathered copy (auto's cache; static's gathers ahead of a backward) took
    # them and was released unwritten to the shard: the load was lost.
    from zerostack.gemini._local_state import load_local_model_state, local_model_state

    torch.manual_seed(0)
    model = _Blocks()
    model.layers[4].weight.requires_grad_(False)
    placement = (
        dict(placement_policy="auto", gpu_capacity_bytes=10**8)
        if policy == "auto"
        else dict(offload_param_frac=1.0, max_prefetch=2)
    )
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, compute_device="cpu",
        chunk_config_dict={1: {"chunk_size": 64 * 64, "keep_gathered": False}}, **placement,
    )  # fmt: skip
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = GeminiOptimizer(torch.optim.SGD(trainable, lr=0.1), ddp)
    x = torch.randn(8, 64)
    for _ in range(3):
        opt.backward(ddp(x))
        opt.step()
        opt.zero_grad()
    if policy == "static":
        loss = ddp(x)  # the load comes between forward and backward
        assert ddp.placement.prefetched, "nothing gathered ahead: nothing to test"
    (name,) = [n for n in local_model_state(ddp) if n.startswith("layers.4")]
    load_local_model_state(ddp, {name: torch.full((64 * 64,), 7.0)})
    if policy == "static":
        opt.backward(loss)
        opt.step()
    assert bool((ddp.state_dict()[name] == 7).all())
