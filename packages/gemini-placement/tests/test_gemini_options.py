"""GeminiDDP / GeminiOptimizer options without a parity case elsewhere, each
against DDP + a torch optimizer step by step, with its effect asserted too:
offload_param_frac, enable_async_reduce=False, overlap_cpu_step=False,
pin_memory=True without CUDA (gloo, 2 ranks), and a process_group that is a
subgroup of the world (gloo, 4 ranks in two groups of 2)."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)
STEPS = 6
# Small chunks, so that this model spans several of them.
CHUNKS = {"chunk_size": 20_000, "keep_gathered": False}
# fp32 throughout: parity to about 1e-6 (as test_gemini_parity.py). Adam can
# still move an element whose gradient is at the rounding level (summation
# order) the other way, hence atol a few fp32 ulps above 1e-6.
TOL = dict(rtol=1e-5, atol=5e-6)


def _optimizers(kind, ref_params, params):
    """Reference and inner optimizer. SGD shows a wrong gradient scale, and so
    does Adam in L2 mode (weight decay goes through the gradient)."""
    if kind == "sgd":
        return (
            torch.optim.SGD(ref_params, lr=0.5, momentum=0.9, foreach=False),
            torch.optim.SGD(params, lr=0.5, momentum=0.9, foreach=False),
        )
    assert kind == "adam-l2", kind
    return (
        torch.optim.Adam(ref_params, lr=1e-3, weight_decay=0.1, foreach=False),
        HybridAdam(params, lr=1e-3, weight_decay=0.1, adamw_mode=False),
    )


def _parity(
    name,
    rank,
    kind,
    ddp_kwargs,
    *,
    opt_kwargs=None,
    max_norm=0.0,
    group=None,
    device="cpu",
    on_build=None,
    after_step=None,
):
    """Train GeminiDDP and a DDP reference over ``group`` side by side on
    rank-dependent batches, comparing losses and every parameter each step;
    ``on_build(ddp)`` and ``after_step(ddp, opt)`` check the option's effect.
    Returns (ddp, opt)."""
    world = dist.get_world_size(group)
    torch.manual_seed(0)
    ref_model = TinyGPT(CONFIG)
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model.to(device), process_group=group)
    ddp = GeminiDDP(
        model,
        mixed_precision=torch.float32,
        chunk_config_dict={world: CHUNKS},
        compute_device=device,
        process_group=group,
        **ddp_kwargs,
    )
    if on_build is not None:
        on_build(ddp)
    ref_opt, inner = _optimizers(kind, list(ref.parameters()), list(model.parameters()))
    opt = GeminiOptimizer(inner, ddp, max_norm=max_norm, **(opt_kwargs or {}))
    for step in range(STEPS):
        idx, tgt = (t.to(device) for t in make_batch(CONFIG, 4, 32, seed=100 * step + rank))
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        loss = ddp(idx, tgt)
        opt.backward(loss)
        assert opt.step()
        if after_step is not None:
            after_step(ddp, opt)
        torch.testing.assert_close(
            loss, ref_loss, **TOL, msg=lambda m, s=step: f"{name} step {s} loss: {m}"
        )
        full = ddp.state_dict()
        for pname, p in ref.module.named_parameters():
            torch.testing.assert_close(
                full[pname],
                p.detach().cpu(),
                **TOL,
                msg=lambda m, p=pname, s=step: f"{name} step {s} {p}: {m}",
            )
    return ddp, opt


def _param_chunks(ddp):
    return sorted(ddp.grad_chunks + ddp.chunk_manager.chunks("frozen_param"), key=lambda c: c.index)


def _shard_bytes(chunks):
    return sum(c.shard_size * c.dtype.itemsize for c in chunks)


# -- the cases ------------------------------------------------------------------------


def _pin_memory_without_cuda(rank, world):
    # First in its process: the warning is issued once per process.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _parity(
            "pin-memory",
            rank,
            "adam-l2",
            dict(pin_memory=True, offload_param_frac=0.5, offload_optim_frac=0.5),
            max_norm=0.05,
        )
    pin = [w for w in caught if "pin_memory=True has no effect without CUDA" in str(w.message)]
    assert len(pin) == 1, f"rank {rank}: {[str(w.message) for w in caught]}"


def _offload_param_frac(rank, world):
    # Both sides of the placement are host memory on a CPU-only machine; a
    # compute device with an index ("cpu:0") tells a shard placed on the CPU
    # (device "cpu") from one placed on the compute device. On CUDA the bytes
    # themselves are checked: test_param_offload_moves_bytes_to_the_host_on_cuda.
    compute = torch.device("cpu", 0)

    def placed_as_planned(ddp, opt):
        chunks = _param_chunks(ddp)
        on_cpu = [c for c in chunks if c.shard_device == torch.device("cpu")]
        assert all(c.shard_device in (compute, torch.device("cpu")) for c in chunks)
        # Whole chunks, the first ones in registration order: half the bytes
        # to within one chunk.
        assert on_cpu == chunks[: len(on_cpu)], f"rank {rank}: {on_cpu}"
        share = _shard_bytes(on_cpu) - 0.5 * _shard_bytes(chunks)
        assert 0 <= share < _shard_bytes(chunks[:1]), f"rank {rank}: {share} bytes off"
        # Between steps nothing stays gathered: the shards are all there is.
        assert all(c.shard is not None and not c.is_gathered for c in chunks)

    ddp, _ = _parity(
        "offload-param-frac",
        rank,
        "sgd",
        dict(offload_param_frac=0.5),
        max_norm=0.05,
        device=compute,
        after_step=placed_as_planned,
    )
    # The masters stayed on the compute device (offload_optim_frac=0).
    assert not ddp.offloaded_masters


def _sync_reduce(rank, world):
    calls = []

    def spy_on(manager):
        real = manager.reduce_chunk

        def reduce_chunk(chunk, async_op=False, **kwargs):
            calls.append(async_op)
            return real(chunk, async_op=async_op, **kwargs)

        manager.reduce_chunk = reduce_chunk

    def reduced_synchronously(ddp, opt):
        # Every chunk once per step, none asynchronously.
        assert calls == [False] * len(ddp.grad_chunks), f"rank {rank}: async_op {calls}"
        calls.clear()

    _parity(
        "sync-reduce",
        rank,
        "sgd",
        dict(enable_async_reduce=False, offload_optim_frac=0.5),
        max_norm=0.05,
        on_build=lambda ddp: spy_on(ddp.chunk_manager),
        after_step=reduced_synchronously,
    )


def _cpu_step_without_overlap(rank, world):
    def workers():
        return {t for t in threading.enumerate() if t.name.startswith("zerostack-cpu-step")}

    before = set()  # earlier cases' workers may live on

    def updated_in_step(ddp, opt):
        # No update left pending for the next forward: each CPU-held chunk's
        # parameter shard holds its updated master already (with overlap it
        # would still hold the reduced gradient).
        assert not opt.pipeline.pending(), f"rank {rank}: {opt.pipeline.pending()}"
        held = [c for c in ddp.grad_chunks if c.paired_chunk in ddp.offloaded_masters]
        assert held and len(held) < len(ddp.grad_chunks)
        for c in held:
            assert torch.equal(c.shard, c.paired_chunk.shard), f"rank {rank}: chunk {c.index}"
        assert workers() <= before, f"rank {rank}: a CPU-step worker thread was started"

    _, opt = _parity(
        "no-overlap",
        rank,
        "adam-l2",
        dict(offload_optim_frac=0.5),
        opt_kwargs=dict(overlap_cpu_step=False),
        on_build=lambda ddp: before.update(workers()),
        after_step=updated_in_step,
    )
    assert opt.cpu_step_s > 0


def _options(rank, world):
    _pin_memory_without_cuda(rank, world)
    _offload_param_frac(rank, world)
    _sync_reduce(rank, world)
    _cpu_step_without_overlap(rank, world)


def test_options_match_ddp():
    spawn(_options, 2, backend="gloo", timeout_s=300)


def _subgroups(rank, world):
    # Every rank creates every group, in the same order.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    ddp, _ = _parity(
        "subgroup",
        rank,
        "sgd",
        dict(offload_optim_frac=0.5),
        max_norm=0.05,  # the gradient norm is a reduction over the group too
        group=group,
    )
    # Chunks are sharded over the group, not the world.
    assert all(c.world_size == 2 and c.chunk_size == 2 * c.shard_size for c in ddp.grad_chunks)
    # The groups trained on different data, each in step within itself.
    full = ddp.state_dict()
    mine = torch.cat([full[n].flatten() for n in sorted(full)])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    assert torch.equal(everyone[0], everyone[1]) and torch.equal(everyone[2], everyone[3])
    apart = float((everyone[0] - everyone[2]).abs().max())
    assert apart > 1e-4, f"rank {rank}: the groups' models are {apart} apart"


def test_process_group_subgroups_match_ddp_over_the_same_subgroup():
    spawn(_subgroups, 4, backend="gloo", timeout_s=300)


# -- CUDA -------------------------------------------------------------------------------


def _param_offload_on_cuda(rank, world):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)

    def bytes_on_the_host(ddp, opt):
        chunks = _param_chunks(ddp)
        on_cpu = [c for c in chunks if c.shard.device.type == "cpu"]
        assert on_cpu and on_cpu == chunks[: len(on_cpu)]
        assert all(c.shard.device == device for c in chunks[len(on_cpu) :])
        share = _shard_bytes(on_cpu) - 0.5 * _shard_bytes(chunks)
        assert 0 <= share < _shard_bytes(chunks[:1])
        # Masters and the rest on the device: the host holds exactly those shards.
        assert ddp.chunk_manager.total_mem["cpu"] == _shard_bytes(on_cpu)

    _parity(
        "offload-param-frac-cuda",
        rank,
        "sgd",
        dict(offload_param_frac=0.5),
        max_norm=0.05,
        device=device,
        after_step=bytes_on_the_host,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_param_offload_moves_bytes_to_the_host_on_cuda():
    spawn(_param_offload_on_cuda, 1, backend="nccl", timeout_s=300)
