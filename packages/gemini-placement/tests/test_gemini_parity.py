"""GeminiDDP + GeminiOptimizer against DDP + torch optimizers, step by step (gloo)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import (
    GPTConfig,
    TinyGPT,
    loss_tolerance,
    make_batch,
    spawn,
    training_tolerance,
)

# No biases: softmax is blind to the key bias, whose gradient is rounding noise
# that Adam inflates to lr-sized steps of random sign.
CONFIG = GPTConfig(add_unused_param=True, bias=False)
STEPS = 8
# Small chunks, so a model this size still spans several of them.
CHUNKS = {"chunk_size": 20_000, "keep_gathered": False}
# auto with a capacity (set per case by _capacity) that holds every param
# shard but only part of the optimizer chunks and of the gathered-chunk cache.
AUTO = dict(placement_policy="auto", steady_cuda_cap_ratio=1.0)
PREFETCH = dict(offload_param_frac=1.0, max_prefetch=2)
PREFETCH_OFFLOAD = dict(PREFETCH, offload_optim_frac=0.5)
# (id, mixed_precision, optimizer, max_norm, freeze, micro_steps, GeminiDDP arguments)
CASES = [
    ("fp32-adamw", torch.float32, "adamw", 0.0, False, 1, {}),
    ("fp32-adam-l2-clip", torch.float32, "adam", 0.05, False, 1, {}),
    ("fp32-sgd-clip-offload", torch.float32, "sgd", 0.05, False, 1, dict(offload_optim_frac=0.5)),
    ("fp32-zero2", torch.float32, "adamw", 0.0, False, 1, dict(shard_param_frac=0.0)),
    ("fp32-half-sharded", torch.float32, "adam", 0.0, False, 1, dict(shard_param_frac=0.5)),
    ("fp32-frozen-embedding", torch.float32, "adamw", 0.0, True, 1, dict(offload_optim_frac=0.5)),
    ("bf16-adamw", torch.bfloat16, "adamw", 0.0, False, 1, dict(offload_optim_frac=1.0)),
    ("bf16-clip-offload", torch.bfloat16, "adam", 0.05, False, 1, dict(offload_optim_frac=0.5)),
    ("fp16-clip-offload", torch.float16, "adamw", 0.05, False, 1, dict(offload_optim_frac=0.5)),
    ("fp32-l2-accum4", torch.float32, "adam", 0.0, False, 4, {}),
    ("fp32-zero2-accum4", torch.float32, "adamw", 0.05, False, 4, dict(shard_param_frac=0.0)),
    ("fp32-tied-embeddings", torch.float32, "adamw", 0.0, False, 1, {}),
    ("fp32-auto-evicting", torch.float32, "adam", 0.05, False, 1, dict(AUTO, max_prefetch=2)),
    ("bf16-auto-evicting", torch.bfloat16, "adamw", 0.0, False, 1, AUTO),
    # Static gathers ahead (max_prefetch), host shards (on a GPU: the copy stream).
    ("fp32-offload-prefetch", torch.float32, "adam", 0.05, False, 1, PREFETCH_OFFLOAD),
    ("fp32-accum4-prefetch", torch.float32, "adamw", 0.0, False, 4, dict(PREFETCH, max_prefetch=1)),
    # ColossalAI's accumulation: a reducing backward on every batch, one step
    # (see [Note: backward on several batches before one step]); SGD shows the
    # sum's scale, clipping its norm; host shards gathered ahead.
    ("fp32-sgd-each-reduced", torch.float32, "sgd", 0.05, False, 3, dict(offload_optim_frac=0.5)),
    ("fp32-each-reduced-prefetch", torch.float32, "adamw", 0.05, False, 3, PREFETCH_OFFLOAD),
]
TIED = GPTConfig(add_unused_param=True, bias=False, tie_embeddings=True)
# Chunks reduce in a fixed order, so the unused parameter's chunk (the last
# one created, the first to reduce) holds every gradient chunk until the end
# of backward: the auto cases leave it out to see the cache trimmed.
ALL_USED = GPTConfig(bias=False)
TOL32 = dict(rtol=1e-5, atol=5e-6)
# Roundings in sequence from a parameter to the loss and back: about six per
# block (two norms, qkv, attention, proj, mlp), plus embedding, norm and head.
DEPTH = 2 * (6 * CONFIG.num_layers + 3)


def _tol(dtype, kind, steps, what):
    """fp32: about 1e-6. bf16/fp16: derived from the dtype's eps and the steps
    taken (see zerostack.testing.training_tolerance): Adam may move a
    rounding-level gradient's element the other way, 2 lr per step at most."""
    if dtype == torch.float32:
        return TOL32
    if what == "loss":
        rtol, atol = loss_tolerance(dtype, depth=DEPTH)
    elif kind == "sgd":
        raise NotImplementedError("a low-precision SGD case needs training_tolerance's max_grad")
    else:
        rtol, atol = training_tolerance(dtype, steps=steps, lr=1e-3)  # the Adam cases' lr
    return dict(rtol=rtol, atol=atol)


def _run_case(rank, world, case, device="cpu"):
    name, dtype, kind, max_norm, freeze, micro, kwargs = case
    config = TIED if "tied" in name else ALL_USED if "auto" in name else CONFIG
    torch.manual_seed(0)
    ref_model = TinyGPT(config)
    model = copy.deepcopy(ref_model)
    if freeze:
        ref_model.tok_emb.weight.requires_grad_(False)
        model.tok_emb.weight.requires_grad_(False)
    ref_model.to(device)
    # Only where a parameter is unused: DDP warns about the flag otherwise.
    ref = DDP(ref_model, find_unused_parameters=config.add_unused_param)
    ref_trainable = [p for p in ref.parameters() if p.requires_grad]
    kwargs = _placed(kwargs, model, dtype, world, device)
    ddp = GeminiDDP(
        model,
        mixed_precision=dtype,
        chunk_config_dict={world: CHUNKS},
        compute_device=device,
        enable_gradient_accumulation=micro > 1,
        **kwargs,
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":  # gradient scale shows through SGD, not through Adam
        ref_opt = torch.optim.SGD(ref_trainable, lr=0.5, momentum=0.9, foreach=False)
        inner = torch.optim.SGD(trainable, lr=0.5, momentum=0.9, foreach=False)
    else:
        ref_cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        ref_opt = ref_cls(ref_trainable, lr=1e-3, weight_decay=0.1, foreach=False)
        inner = HybridAdam(trainable, lr=1e-3, weight_decay=0.1, adamw_mode=kind == "adamw")
    opt = GeminiOptimizer(inner, ddp, max_norm=max_norm)
    unused_before = ddp.state_dict().get("unused.weight")
    for step in range(STEPS):
        for m in range(micro - 1):  # gradient accumulation: all but the last micro-step
            idx, tgt = (
                t.to(device)
                for t in make_batch(config, 4, 32, seed=100 * step + 10 * m + rank + 50)
            )
            with ref.no_sync():
                (ref(idx, tgt) / micro).backward()
            with contextlib.nullcontext() if "each-reduced" in name else ddp.no_sync():
                opt.backward(ddp(idx, tgt).float() / micro)
        idx, tgt = (t.to(device) for t in make_batch(config, 4, 32, seed=100 * step + rank))
        ref_loss = ref(idx, tgt)
        (ref_loss / micro).backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        loss = ddp(idx, tgt)
        opt.backward(loss.float() / micro)
        assert opt.step()
        torch.testing.assert_close(
            loss.float(),
            ref_loss,
            **_tol(dtype, kind, step + 1, "loss"),
            msg=lambda m, s=step: f"{name} step {s} loss: {m}",
        )
        full = ddp.state_dict()
        for pname, b in ref.module.named_parameters():
            torch.testing.assert_close(
                full[pname],
                b.detach().cpu(),
                **_tol(dtype, kind, step + 1, "params"),
                msg=lambda m, p=pname, s=step: f"{name} step {s} {p}: {m}",
            )
    if unused_before is not None:
        assert torch.equal(ddp.state_dict()["unused.weight"], unused_before), (
            f"{name}: unused param moved"
        )
    _check_placement(name, ddp, kwargs, device)


def _check_placement(name, ddp, kwargs, device):
    """Gathers ahead happened; auto's capacity forced evictions and held."""
    # Auto gathers ahead only within its limit; on a GPU the measured non-model
    # memory there holds the reference DDP model and its Adam states too, which
    # leaves this small capacity no room.
    if kwargs.get("max_prefetch") and (ddp.auto is None or device == "cpu"):
        assert ddp.placement.prefetches > 0, f"{name}: nothing was gathered ahead"
    if ddp.auto is not None and device == "cpu":  # on a GPU, real non-model memory counts too
        auto = ddp.auto
        assert auto.evictions > 0, f"{name}: the capacity should force evictions"
        assert 0 < len(ddp.offloaded_masters) < len(ddp.grad_chunks), name
        assert auto.peak_model_bytes <= auto.steady_limit(), (
            f"{name}: {auto.peak_model_bytes} model bytes over the limit {auto.steady_limit()}"
        )


def _placed(kwargs, model, dtype, world, device):
    """The case's placement: auto's capacity; on a GPU, pinned host shards
    for the gathers ahead (the copy stream, then NCCL's all-gather)."""
    if kwargs.get("placement_policy") == "auto":
        kwargs = dict(kwargs, gpu_capacity_bytes=_capacity(model, dtype, world))
    if kwargs.get("max_prefetch") and device != "cpu":
        kwargs = dict(kwargs, pin_memory=True)
    return kwargs


def _capacity(model, dtype, world):
    """Param shards + three gathered chunks + half of masters and Adam states."""
    n = sum(p.numel() for p in model.parameters())
    item = torch.empty((), dtype=dtype).element_size()
    return n * item // world + 3 * CHUNKS["chunk_size"] * item + n * 12 // world // 2


def _all(rank, world, cases):
    for case in cases:
        _run_case(rank, world, case)


# At 4 ranks, the cases whose shards and collectives change with the world
# size in ways 2 ranks do not show (uneven padding, ranks holding halves of
# offloaded and gathered-ahead chunks); all of them at 1 and 2.
AT_FOUR = {
    "fp32-sgd-clip-offload", "fp32-half-sharded", "fp32-frozen-embedding", "bf16-clip-offload",
    "fp32-zero2-accum4", "fp32-auto-evicting", "fp32-offload-prefetch",
    "fp32-sgd-each-reduced",
}  # fmt: skip


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parity_with_ddp(world_size):
    cases = [c for c in CASES if world_size < 4 or c[0] in AT_FOUR]
    assert world_size < 4 or len(cases) == len(AT_FOUR)
    spawn(_all, world_size, args=(cases,), backend="gloo", timeout_s=300)
