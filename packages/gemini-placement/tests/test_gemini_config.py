"""GeminiDDP's settings: configs and keywords, the chunk configuration's
keep_gathered and per-size entries, options without effect, input casts."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from zerostack.chunk import LazyInitContext
from zerostack.fused_adam import HybridAdam
from zerostack.gemini import (
    AutoPlacementConfig,
    ChunkConfig,
    GeminiConfig,
    GeminiDDP,
    GeminiOptimizer,
    MixedPrecision,
    StaticPlacementConfig,
)
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False)


def _model():
    torch.manual_seed(0)
    return TinyGPT(CONFIG)


def _kept(ddp):
    return [c.keep_gathered for c in ddp.param_chunks]


def test_keep_gathered_of_the_configuration_is_honoured(caplog):
    table = {1: {"chunk_size": 20_000, "keep_gathered": True}}
    with caplog.at_level(logging.INFO, logger="zerostack.gemini"):
        ddp = GeminiDDP(_model(), chunk_config_dict=table, compute_device="cpu")
    assert all(_kept(ddp)) and len(ddp.param_chunks) > 1
    assert "kept gathered" in caplog.text and "keep_gathered=True" in caplog.text
    # An explicit share below 1 still wins: the first half sharded.
    half = GeminiDDP(_model(), chunk_config_dict=table, compute_device="cpu", shard_param_frac=0.5)
    assert any(_kept(half)) and not all(_kept(half))
    assert not half.param_chunks[0].keep_gathered and half.param_chunks[-1].keep_gathered


def test_the_layout_line_names_every_chunk_size(caplog):
    # A parameter larger than the chunk size gets a chunk of its own size: the
    # line says how many chunks have each size, not the first chunk's alone
    # (a 4.24B GPT's read "110 chunks of 154389504 elements", its embedding's).
    with caplog.at_level(logging.INFO, logger="zerostack.gemini"):
        ddp = GeminiDDP(
            _model(), chunk_config_dict={1: {"chunk_size": 10_000}}, compute_device="cpu"
        )
    sizes = [c.chunk_size for c in ddp.param_chunks]
    big = [n for n in set(sizes) if n > 10_000]
    assert big, sizes  # the 16,384-element matrices
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GeminiDDP ("))
    for size in set(sizes):
        assert f"{sizes.count(size)} of {size:,} elements" in line, line


def test_the_search_decides_keep_gathered_by_default():
    # A model far smaller than the smallest chunk: the search keeps it whole.
    ddp = GeminiDDP(_model(), compute_device="cpu", min_chunk_size_m=1)
    assert all(_kept(ddp))
    assert all(c.shard is None for c in ddp.param_chunks)


def test_the_entry_for_the_group_size_is_used():
    table = {1: {"chunk_size": 20_000}, 2: {"chunk_size": 50_000}}
    ddp = GeminiDDP(_model(), chunk_config_dict=table, compute_device="cpu")
    assert {c.chunk_size for c in ddp.param_chunks} - {20_000} <= {
        max(p.numel() for p in ddp.params)
    }
    with pytest.raises(
        ValueError, match=r"no entry for the data-parallel size 1 \(got keys \[2, 4\]\)"
    ):
        GeminiDDP(_model(), chunk_config_dict={2: table[2], 4: table[2]}, compute_device="cpu")
    with pytest.raises(ValueError, match=r"chunk_config_dict\[1\] must hold chunk_size"):
        GeminiDDP(_model(), chunk_config_dict={1: {"size": 3}}, compute_device="cpu")


def _entry_per_world(rank, world):
    table = {1: {"chunk_size": 30_000}, world: {"chunk_size": 20_000, "keep_gathered": False}}
    ddp = GeminiDDP(_model(), chunk_config_dict=table, compute_device="cpu")
    biggest = max(p.numel() for p in ddp.params)
    assert {c.chunk_size for c in ddp.param_chunks} <= {20_000, -(-biggest // world) * world}
    assert not any(_kept(ddp))


def test_the_entry_for_the_group_size_is_used_at_world_2():
    spawn(_entry_per_world, 2, backend="gloo", timeout_s=120)


def test_max_prefetch_is_an_option_of_either_policy():
    for policy in ("static", "auto"):
        config = GeminiConfig.from_kwargs(placement_policy=policy, max_prefetch=2)
        assert config.placement.max_prefetch == 2
    with pytest.raises(ValueError, match=r"max_prefetch must be >= 0 \(got -1\)"):
        StaticPlacementConfig(max_prefetch=-1)


def test_static_ignores_auto_options_with_a_warning():
    for name, value in (
        ("steady_cuda_cap_ratio", 0.5),
        ("gpu_capacity_bytes", 1 << 30),
        ("warmup_non_model_data_ratio", 0.3),
    ):
        with pytest.warns(
            UserWarning, match=rf"{name}={value!r} has no effect under placement_policy='static'"
        ):
            GeminiDDP(
                _model(),
                compute_device="cpu",
                chunk_config_dict={1: {"chunk_size": 20_000}},
                **{name: value},
            )


def test_init_fn_on_an_eager_model_warns():
    with pytest.warns(
        UserWarning, match=r"init_fn has no effect on a model that is not built under"
    ):
        GeminiDDP(
            _model(), compute_device="cpu", chunk_config_dict={1: {"chunk_size": 20_000}},
            init_fn=lambda m: None,
        )  # fmt: skip
    # Under LazyInitContext it is used, without a warning.
    with LazyInitContext():
        lazy = TinyGPT(CONFIG)
    called = []
    GeminiDDP(
        lazy, compute_device="cpu", chunk_config_dict={1: {"chunk_size": 20_000}},
        init_fn=lambda m: called.append(m),
    )  # fmt: skip
    assert called


def test_a_config_object_is_the_keywords():
    table = {1: {"chunk_size": 20_000}}
    config = GeminiConfig(
        placement=StaticPlacementConfig(offload_optim_frac=0.5),
        chunk=ChunkConfig(chunk_config_dict=table),
        precision=MixedPrecision(param_dtype=torch.bfloat16),
    )
    assert config == GeminiConfig.from_kwargs(
        offload_optim_frac=0.5, chunk_config_dict=table, mixed_precision=torch.bfloat16
    )
    ddp = GeminiDDP(_model(), config, compute_device="cpu")
    assert ddp.mixed_precision == torch.bfloat16 and ddp.offloaded_masters
    with pytest.raises(TypeError, match=r"pass either config or keyword settings"):
        GeminiDDP(_model(), config, compute_device="cpu", max_prefetch=1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'shard_frac'"):
        GeminiDDP(_model(), compute_device="cpu", shard_frac=0.5)
    with pytest.raises(ValueError, match=r"max_prefetch must be >= 0 \(got -1\)"):
        AutoPlacementConfig(max_prefetch=-1)
    with pytest.raises(TypeError, match=r"placement must be a StaticPlacementConfig"):
        GeminiConfig(placement="auto")


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("offset", torch.full((8,), 0.5))

    def forward(self, x, extra=None):
        y = self.fc(x) + self.offset
        return y if extra is None else y + extra["shift"]


def test_floating_inputs_and_buffers_are_cast_to_the_compute_dtype():
    torch.manual_seed(0)
    ref = _Mlp()
    ddp = GeminiDDP(
        copy.deepcopy(ref), mixed_precision=torch.bfloat16, compute_device="cpu",
        chunk_config_dict={1: {"chunk_size": 1024}},
    )  # fmt: skip
    assert ddp.module.offset.dtype == torch.bfloat16
    x, shift = torch.randn(4, 8), torch.randn(8)
    with torch.no_grad():
        out = ddp(x, extra={"shift": shift})
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref(x, {"shift": shift}), rtol=0, atol=0.05)
    # The opt-out: inputs stay as given (and fp32 inputs meet bf16 weights).
    raw = GeminiDDP(
        copy.deepcopy(ref), mixed_precision=torch.bfloat16, compute_device="cpu",
        chunk_config_dict={1: {"chunk_size": 1024}}, cast_forward_inputs=False,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"dtype"), torch.no_grad():
        raw(x)


def _bf16_inf_is_applied(rank, world):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.bfloat16, compute_device="cpu",
        chunk_config_dict={world: {"chunk_size": 20_000}},
    )  # fmt: skip
    opt = GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-3), ddp)
    model.lm_head.weight.register_hook(lambda g: g * float("inf") if rank == 0 else g)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=rank)
    opt.backward(ddp(idx, tgt).float())
    # See [Note: overflow policy]: only fp16 loss scaling skips steps.
    assert opt.step() is True
    assert not torch.isfinite(ddp.state_dict()["lm_head.weight"]).all()


def test_bf16_nonfinite_gradients_are_applied_as_torch_does(caplog):
    spawn(_bf16_inf_is_applied, 2, backend="gloo", timeout_s=120)
    with caplog.at_level(logging.WARNING, logger="zerostack.shard"):
        _bf16_inf_is_applied(0, 1)
    assert "applied as torch's optimizers would" in caplog.text


def test_torch_adamw_steps_bf16_gradients_of_fp32_masters():
    # torch's Adam needs the gradient in the parameter's dtype; fused-adam
    # reads bf16 gradients as they are: the same fp32 math either way.
    results = []
    for make in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=False),
        lambda ps: HybridAdam(ps, lr=1e-3, weight_decay=0.1),
    ):
        for offload in (0.0, 1.0):
            ddp = GeminiDDP(
                _model(), mixed_precision=torch.bfloat16, compute_device="cpu",
                chunk_config_dict={1: {"chunk_size": 20_000}}, offload_optim_frac=offload,
            )  # fmt: skip
            opt = GeminiOptimizer(make(list(ddp.module.parameters())), ddp, max_norm=1.0)
            for step in range(3):
                idx, tgt = make_batch(CONFIG, 2, 16, seed=step)
                opt.backward(ddp(idx, tgt).float())
                assert opt.step()
            results.append(ddp.state_dict())
    # The CPU and device steps of one optimizer agree exactly; the two
    # optimizers round differently, which Adam can turn into up to 2 lr per
    # step where a gradient is at rounding level (zerostack.testing's
    # training_tolerance derives the same bound).
    for a, b in ((0, 1), (2, 3)):
        assert all(torch.equal(results[a][k], results[b][k]) for k in results[a])
    for name, value in results[0].items():
        torch.testing.assert_close(results[2][name], value, rtol=0, atol=2 * 1e-3 * 3, msg=name)
