"""ColossalAI programs as printed: the older Gemini placement names and
``device=`` argument, ``Booster(plugin)`` with the plugin passed
positionally, and an optimizer built on a twin of the model it trains
(ColossalAI's GPT-2 demo builds its HybridAdam on one model and then the
model it trains under LazyInitContext)."""

from __future__ import annotations

import pytest
import torch

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin
from zerostack.fused_adam import HybridAdam
from zerostack.gemini import StaticPlacementConfig
from zerostack.testing import GPTConfig, TinyGPT, make_batch

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)
CHUNKS = {1: {"chunk_size": 20_000}}


@pytest.mark.parametrize(
    ("policy", "shares"),
    [("cpu", (1.0, 1.0, 1.0)), ("cuda", (1.0, 0.0, 0.0))],
)
def test_older_placement_names_are_their_static_shares(policy, shares):
    config = GeminiPlugin(placement_policy=policy).gemini_config
    shard, optim, param = shares
    assert config.placement == StaticPlacementConfig(
        shard_param_frac=shard, offload_optim_frac=optim, offload_param_frac=param
    )


def test_older_placement_name_with_other_shares_is_refused():
    with pytest.raises(ValueError, match=r"placement_policy='cpu' fixes shard_param_frac"):
        GeminiPlugin(placement_policy="cpu", offload_param_frac=0.5)


def test_device_argument_is_the_compute_device():
    plugin = GeminiPlugin(device="cpu", placement_policy="cpu", precision="fp32",
                          chunk_config_dict=CHUNKS)  # fmt: skip
    booster = Booster(plugin)  # positional, as ColossalAI's NVMe guide writes it
    assert booster.plugin is plugin
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    model, opt, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-2))
    before = {k: v.clone() for k, v in model.full_state_dict().items()}
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    booster.backward(model(idx, tgt), opt)
    assert opt.step()
    after = model.full_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match=r"device and chunk_init_device .* disagree"):
        GeminiPlugin(device="cpu", chunk_init_device="cuda:0")
    with pytest.raises(TypeError, match=r"device must be a torch.device, a str or a CUDA index"):
        GeminiPlugin(device=1.5)


def _plugin(name):
    if name == "gemini":
        return GeminiPlugin(precision="fp32", chunk_config_dict=CHUNKS)
    if name == "zero2":
        return LowLevelZeroPlugin(stage=2, precision="fp32")
    return None  # Booster without a plugin: the model on the CPU


@pytest.mark.parametrize("name", ["none", "zero2", "gemini"])
def test_an_optimizer_built_on_a_twin_model_steps_the_boosted_one(name):
    torch.manual_seed(0)
    twin = TinyGPT(CONFIG)
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    twin_before = [p.detach().clone() for p in twin.parameters()]
    torch.manual_seed(1)
    model = TinyGPT(CONFIG)
    reference = TinyGPT(CONFIG)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: 0.5**step)
    booster = Booster(plugin=_plugin(name))
    with pytest.warns(UserWarning, match=r"built on another model .* now steps this model"):
        boosted, opt, *_ = booster.boost(model, optimizer, lr_scheduler=scheduler)
    for step in range(3):
        idx, tgt = make_batch(CONFIG, 2, 16, seed=step)
        booster.backward(boosted(idx, tgt), opt)
        opt.step()
        opt.zero_grad()
        scheduler.step()
        reference(idx, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    full = boosted.full_state_dict() if name == "gemini" else boosted.unwrap().state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key].float(), value, rtol=1e-5, atol=1e-6)
    for p, q in zip(twin.parameters(), twin_before, strict=True):
        assert torch.equal(p, q)  # the twin is left alone


def test_an_optimizer_over_another_models_parameters_is_refused():
    torch.manual_seed(0)
    model, other = TinyGPT(CONFIG), TinyGPT(GPTConfig(bias=False, vocab_size=64, dim=32,
                                                      max_seq_len=32))  # fmt: skip
    booster = Booster(device="cpu")
    with pytest.raises(ValueError, match=r"not the model's \(got \d+ of \d+ foreign; their number"):
        booster.boost(model, torch.optim.SGD(other.parameters(), lr=0.1))
    mixed = [*model.parameters()][:2] + [*other.parameters()][:1]
    with pytest.raises(ValueError, match=r"got 1 of 3 foreign; some are the model's"):
        booster.boost(model, torch.optim.SGD(mixed, lr=0.1))
    twin = TinyGPT(CONFIG)
    stepped = torch.optim.AdamW(twin.parameters())
    twin(*make_batch(CONFIG, 2, 16, seed=0)).backward()
    stepped.step()
    with pytest.raises(ValueError, match=r"it has optimizer state already"):
        booster.boost(model, stepped)


@pytest.mark.parametrize("name", ["zero2", "gemini"])
def test_a_hybrid_adam_built_on_a_twin_steps_a_lazily_built_model(name):
    """ColossalAI's GPT-2 demo: HybridAdam on a first model, the trained one
    built under LazyInitContext afterwards."""
    from zerostack.booster import LazyInitContext

    torch.manual_seed(0)
    optimizer = HybridAdam(TinyGPT(CONFIG).parameters(), lr=1e-2)
    with LazyInitContext():
        model = TinyGPT(CONFIG)
    booster = Booster(plugin=_plugin(name))
    with pytest.warns(UserWarning, match=r"built on another model"):
        model, opt, *_ = booster.boost(model, optimizer)
    assert opt.optim is not None
    full = model.full_state_dict() if name == "gemini" else model.unwrap().state_dict()
    before = {k: v.detach().clone() for k, v in full.items()}
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    booster.backward(model(idx, tgt), opt)
    assert opt.step() is not False
    full = model.full_state_dict() if name == "gemini" else model.unwrap().state_dict()
    moved = [k for k in before if not torch.equal(before[k], full[k])]
    assert moved, "no parameter moved"


@pytest.mark.parametrize("port", ["as printed", "no_sync"])
def test_colossalai_gemini_accumulation_loop_matches_torch(port):
    """ColossalAI's gradient accumulation guide, GeminiPlugin part
    (enable_gradient_accumulation=True): backward on every batch, step
    (which zeroes the gradients) every few. As printed, and with all but
    the last backward of a window inside booster.no_sync, it trains as plain
    torch accumulating over the window."""
    import contextlib

    accumulation = 3
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    reference = TinyGPT(CONFIG)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    plugin = GeminiPlugin(precision="fp32", chunk_config_dict=CHUNKS,
                          enable_gradient_accumulation=True)  # fmt: skip
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.full_state_dict()
    for idx in range(2 * accumulation):
        last = idx % accumulation == accumulation - 1
        batch = make_batch(CONFIG, 2, 16, seed=idx)
        quiet = last or port == "as printed"
        with contextlib.nullcontext() if quiet else booster.no_sync(model, opt):
            booster.backward(model(*batch) / accumulation, opt)
        (reference(*batch) / accumulation).backward()
        if last:
            opt.step()  # no zero_grad: the step zeroes the gradients, as ColossalAI's
            ref_opt.step()
            ref_opt.zero_grad()
    full = model.full_state_dict()
    assert any(not torch.equal(before[k], full[k]) for k in before), "no parameter moved"
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key].float(), value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("make", "dtype", "scale"),
    [
        (lambda m: m.FP16TorchMixedPrecision(init_scale=2.0**10, growth_factor=4.0,
                                             backoff_factor=0.25, growth_interval=1),
         torch.float16, [2.0**10, 2.0**12]),
        (lambda m: m.FP16TorchMixedPrecision(), torch.float16, [2.0**16, 2.0**16]),
        (lambda m: m.BF16MixedPrecision(), torch.bfloat16, None),
    ],
)  # fmt: skip
def test_colossalai_mixed_precision_objects_take_effect(make, dtype, scale):
    """ColossalAI's mixed precision guide: Booster(mixed_precision=
    FP16TorchMixedPrecision(init_scale=..., growth_factor=..., backoff_factor=...,
    growth_interval=...)), as Booster(mixed_precision="fp16") (TorchDDPPlugin
    or no plugin)."""
    import zerostack.booster as booster_api

    booster = Booster(device="cpu", mixed_precision=make(booster_api))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scales = []
    for _ in range(2):
        out = model(torch.randn(4, 8))
        assert out.dtype == dtype
        booster.backward(out.float().pow(2).mean(), opt)
        if scale is not None:
            scales.append(opt.scaler.get_scale())
        opt.step()
        opt.zero_grad()
    assert scales == (scale or [])
