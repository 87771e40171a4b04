"""GeminiPlugin in one process: ColossalAI's options reach GeminiDDP as one
GeminiConfig, the options not built are refused by name, and a model built
under LazyInitContext is materialized by boost (a transformers model with
the values its eager construction draws)."""

from __future__ import annotations

import pytest
import torch

from zerostack.booster import Booster, GeminiPlugin, LazyInitContext, LowLevelZeroPlugin
from zerostack.fused_adam import HybridAdam
from zerostack.gemini import AutoPlacementConfig, GeminiConfig, StaticPlacementConfig
from zerostack.testing import GPTConfig, TinyGPT, inner_steps, make_batch

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("tp_size", 2, r"tp_size is not implemented \(got 2\)"),
        ("extra_dp_size", 2, r"extra_dp_size is not implemented \(got 2\)"),
        ("enable_all_optimization", True, r"enable_all_optimization is not implemented"),
        ("enable_flash_attention", True, r"enable_flash_attention is not implemented"),
        ("enable_sequence_parallelism", True, r"enable_sequence_parallelism"),
        ("use_fp8", True, r"use_fp8 is not implemented"),
        ("fp8_communication", True, r"fp8_communication is not implemented"),
        ("force_outputs_fp32", True, r"force_outputs_fp32 is not implemented"),
        ("memstats", object(), r"memstats is not implemented .* measures its own"),
        ("gpu_margin_mem_ratio", 0.5, r"gpu_margin_mem_ratio is not implemented .*auto"),
        ("norm_type", 1.0, r"only norm_type=2.0 is implemented \(got 1.0\)"),
        ("master_weights", False, r"master_weights=False .* is not implemented"),
    ],
)
def test_options_not_built_are_refused_by_name(option, value, match):
    with pytest.raises(NotImplementedError, match=match):
        GeminiPlugin(**{option: value})


def test_bad_values_are_refused():
    with pytest.raises(
        ValueError, match=r"precision must be 'fp16', 'bf16' or 'fp32' \(got 'fp8'\)"
    ):
        GeminiPlugin(precision="fp8")
    with pytest.raises(ValueError, match=r"offload_optim_frac must be in \[0, 1\] \(got 1.5\)"):
        GeminiPlugin(offload_optim_frac=1.5)
    with pytest.raises(ValueError, match=r"placement_policy must be 'static' or 'auto'"):
        GeminiPlugin(placement_policy="const")
    with pytest.raises(ValueError, match=r"max_norm must be >= 0 \(got -1\)"):
        GeminiPlugin(max_norm=-1)
    plugin = GeminiPlugin(precision="fp32", chunk_init_device="meta")
    with pytest.raises(
        NotImplementedError, match=r"chunk_init_device other than the compute device"
    ):
        Booster(plugin=plugin).boost(TinyGPT(CONFIG))
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    plugin = GeminiPlugin(precision="bf16", initial_scale=2**8)
    with pytest.warns(
        UserWarning, match=r"no effect with precision='bf16' \(got \['initial_scale'\]\)"
    ):
        Booster(plugin=plugin).boost(model, torch.optim.AdamW(model.parameters()))


def test_colossalai_arguments_build_one_config_handed_to_gemini_ddp():
    plugin = GeminiPlugin(
        placement_policy="auto",
        gpu_capacity_bytes=1 << 22,
        steady_cuda_cap_ratio=0.5,
        max_prefetch=2,
        precision="bf16",
        hidden_dim=32,
        search_range_m=1,
        min_chunk_size_m=0.001,
        enable_gradient_accumulation=True,
        enable_async_reduce=False,
        strict_ddp_mode=True,
    )
    config = plugin.gemini_config
    assert isinstance(config, GeminiConfig)
    assert config.placement == AutoPlacementConfig(
        steady_cuda_cap_ratio=0.5, gpu_capacity_bytes=1 << 22, max_prefetch=2
    )
    assert config.chunk.hidden_dim == 32 and config.chunk.search_range_m == 1
    assert config.chunk.enable_gradient_accumulation and not config.enable_async_reduce
    assert config.precision.param_dtype == torch.bfloat16
    assert plugin.support_no_sync()
    booster = Booster(plugin=plugin)
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    model, opt, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-3))
    assert model.module.config is config  # passed down as it is
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    for _ in range(2):  # the auto placement's warm-up step, then a planned one
        booster.backward(model(idx, tgt), opt)
        assert opt.step()
    static = GeminiPlugin(offload_optim_frac=0.25, shard_param_frac=0.5).gemini_config
    assert static.placement == StaticPlacementConfig(offload_optim_frac=0.25, shard_param_frac=0.5)


@pytest.mark.parametrize(
    "plugin",
    [
        lambda: GeminiPlugin(precision="fp32", offload_optim_frac=1.0, gpu_update_fraction="auto"),
        lambda: LowLevelZeroPlugin(precision="fp32", cpu_offload=True, gpu_update_fraction="auto"),
    ],
    ids=["gemini", "zero"],
)
def test_gpu_update_fraction_auto_reaches_the_optimizer(plugin, caplog):
    # On a CPU compute device there is no GPU Adam: "auto" chooses 0.0 and says so.
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    with caplog.at_level("INFO", logger="zerostack.shard._machine"):
        model, opt, *_ = Booster(plugin=plugin()).boost(model, HybridAdam(model.parameters()))
    inner = getattr(opt, "optim", opt)
    assert inner.gpu_update_fraction == 0.0
    assert "gpu_update_fraction='auto' chose 0.0: the compute device is cpu" in caplog.text


@pytest.mark.parametrize("numel", [1, 10**9])
def test_cpu_update_numel_reaches_the_optimizer(numel):
    """LowLevelZeroPlugin(cpu_update_numel=n) sets ZeroOptimizer's CPU Adam
    calls: 1 makes one a bucket, a value above the model's size one a step."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    plugin = LowLevelZeroPlugin(
        precision="fp32", cpu_offload=True, reduce_bucket_size_in_m=0.002, cpu_update_numel=numel
    )
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, HybridAdam(model.parameters()))
    zero = opt.optim
    assert zero.cpu_update_numel == numel and len(zero.buckets) >= 3
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    with inner_steps(zero.optimizer) as calls:
        booster.backward(model(idx, tgt), opt)
        assert opt.step()
        zero.wait_updates()
    assert len(calls) == (len(zero.buckets) if numel == 1 else 1)


def _gpt2(transformers):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("plugin", ["gemini", "zero"])
def test_a_lazy_transformers_model_is_materialized_with_its_eager_values(plugin):
    """GPT-2's Conv1D has no reset_parameters and its post_init draws every
    weight again: the replayed construction gives the eager weights."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    with LazyInitContext():
        lazy = _gpt2(transformers)
    assert all(p.is_meta for p in lazy.parameters())
    # fused-adam's optimizers refuse meta parameters; torch's do not.
    opt = torch.optim.AdamW(lazy.parameters(), lr=1e-3)
    if plugin == "gemini":
        plugin = GeminiPlugin(precision="fp32", chunk_config_dict={1: {"chunk_size": 20_000}})
    else:
        plugin = LowLevelZeroPlugin(precision="fp32")
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(lazy, opt)
    torch.manual_seed(0)
    eager = _gpt2(transformers)
    full = model.full_state_dict()
    assert list(full) == list(eager.state_dict())
    for name, p in eager.named_parameters():
        assert torch.equal(full[name], p.detach()), name
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    booster.backward(model(idx, labels=idx).loss, opt)
    assert opt.step()


def test_a_loaded_checkpoint_reaches_frozen_parameters_under_auto_placement(tmp_path):
    # Auto placement keeps gathered chunks as a cache: a frozen parameter (no
    # master) loaded into a cached chunk was written there and the copy
    # released unwritten, so the model kept its old values.
    def boosted(seed):
        torch.manual_seed(seed)
        config = GPTConfig(bias=False, vocab_size=64, dim=16, max_seq_len=16, num_layers=2)
        model = TinyGPT(config)
        model.tok_emb.weight.requires_grad_(False)
        plugin = GeminiPlugin(
            precision="fp32", placement_policy="auto", gpu_capacity_bytes=10**8,
            chunk_config_dict={1: {"chunk_size": 2_000}},
        )  # fmt: skip
        booster = Booster(plugin=plugin)
        trainable = [p for p in model.parameters() if p.requires_grad]
        model, opt, *_ = booster.boost(model, HybridAdam(trainable, lr=1e-3))
        for step in range(2):
            idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
            booster.backward(model(idx, idx), opt)
            opt.step()
            opt.zero_grad()
        return booster, model

    booster, model = boosted(0)
    booster.save_model(model, tmp_path / "model", shard=True)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    booster, model = boosted(1)
    frozen = "module.tok_emb.weight"  # the boosted model wraps the module
    assert not torch.equal(model.state_dict()[frozen], want[frozen])
    booster.load_model(model, tmp_path / "model")
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
