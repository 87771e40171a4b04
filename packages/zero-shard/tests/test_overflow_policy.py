"""ZeroOptimizer's loss scaler and overflow policy: only the fp16 loss scaler
skips steps; bf16/fp32 inf/nan gradients are applied, as torch applies them
(see [Note: overflow policy])."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.shard import DynamicLossScaler, ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(num_layers=1, dim=32, num_heads=2, bias=False)
_POLICY_LOGGER = "zerostack.shard._mixed_precision"


def _poison(model, rank):
    """Rank 0's lm_head gradient becomes +inf (every element)."""
    return model.lm_head.weight.register_hook(
        lambda g: torch.full_like(g, float("inf")) if rank == 0 else g
    )


class _Records(logging.Handler):
    """caplog does not reach spawned ranks: each rank keeps its own records."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger(_POLICY_LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(_POLICY_LOGGER).removeHandler(self)
        return False


def _fp16_overflow(rank, world):
    for how in ("keywords", "instance"):
        torch.manual_seed(0)
        model = TinyGPT(CONFIG).half()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if how == "keywords":  # ColossalAI's names
            zero = ZeroOptimizer(opt, hysteresis=1, initial_scale=1024.0)
        else:
            scaler = DynamicLossScaler(hysteresis=1, initial_scale=1024.0)
            zero = ZeroOptimizer(opt, loss_scaler=scaler)
            assert zero.scaler is scaler
        before = [p.detach().clone() for p in model.parameters()]
        handle = _poison(model, rank)
        idx, tgt = make_batch(CONFIG, 2, 16, seed=rank)
        zero.backward(model(idx, tgt).float())
        with _Records() as records:
            # Only rank 0 saw an inf: every rank skips, or the ranks' params diverge.
            assert zero.step() is False, f"{how}: rank {rank} stepped on an overflow"
        assert zero.scaler.scale == 512.0
        assert any("gradient overflow" in m and "step skipped" in m for m in records.messages)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert all(
            s.master.grad is None and p.grad is None
            for s, p in zip(zero.shards, model.parameters(), strict=True)
        )
        handle.remove()
        zero.backward(model(idx, tgt).float())
        assert zero.step() is True
        assert zero.scaler.scale == 512.0
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # Without optimizer.backward the fp16 loss is not scaled: a clear error.
    model(idx, tgt).float().backward()
    with pytest.raises(
        RuntimeError, match=r"fp16 gradients were not scaled; call optimizer.backward\(loss\)"
    ):
        zero.step()


@pytest.mark.parametrize("world_size", [1, 2])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(world_size):
    spawn(_fp16_overflow, world_size, backend="gloo")


def _inf_applied(rank, world):
    # DDP + AdamW is the reference: torch applies the inf/nan gradient, and
    # AdamW turns the poisoned weight into nan (inf / sqrt(inf)).
    for dtype, tol in (
        (torch.float32, dict(rtol=1e-5, atol=5e-6)),
        (torch.bfloat16, dict(rtol=0, atol=2e-2)),
    ):
        torch.manual_seed(0)
        ref_model = TinyGPT(CONFIG)
        model = copy.deepcopy(ref_model).to(dtype)
        ref = DDP(ref_model)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
        zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
        before = [p.detach().clone() for p in model.parameters()]
        _poison(model, rank)
        _poison(ref_model, rank)
        idx, tgt = make_batch(CONFIG, 2, 16, seed=rank)
        ref(idx, tgt).backward()
        ref_opt.step()
        zero.backward(model(idx, tgt))
        with _Records() as records:
            assert zero.step() is True, f"{dtype}: rank {rank} skipped a non-fp16 step"
        assert not math.isfinite(zero.last_grad_norm)
        assert any("applied as torch's optimizers would" in m for m in records.messages)
        assert torch.isnan(ref_model.lm_head.weight).all()
        assert torch.isnan(model.lm_head.weight).all()
        for (name, a), b, old in zip(
            model.named_parameters(), ref_model.parameters(), before, strict=True
        ):
            if dtype == torch.float32:  # (bf16 rounds some updates away)
                assert not torch.equal(a, old), f"{name}: not updated"
            assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{dtype} {name}: nan mask"
            torch.testing.assert_close(a.float(), b, equal_nan=True, **tol)


@pytest.mark.parametrize("world_size", [1, 2])
def test_bf16_and_fp32_inf_gradients_are_applied_as_torch_does(world_size):
    spawn(_inf_applied, world_size, backend="gloo")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_fp16_inf_gradient_steps_with_a_warning(caplog, dtype):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG).to(dtype)
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert zero.scaler is None
    _poison(model, 0)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    zero.backward(model(idx, tgt))
    with caplog.at_level(logging.WARNING, logger=_POLICY_LOGGER):
        assert zero.step() is True
    assert torch.isnan(model.lm_head.weight).all()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert (
        "ZeroOptimizer: the gradient norm is inf; applied as torch's optimizers would"
        in warnings[0].getMessage()
    )


def test_fp16_overflow_skips_with_a_warning(caplog):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG).half()
    zero = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        loss_scaler=DynamicLossScaler(initial_scale=64.0, hysteresis=1),
    )
    before = [p.detach().clone() for p in model.parameters()]
    _poison(model, 0)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    zero.backward(model(idx, tgt).float())
    with caplog.at_level(logging.WARNING, logger=_POLICY_LOGGER):
        assert zero.step() is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "ZeroOptimizer: gradient overflow (norm inf), step skipped; loss scale now 32.0"
    ]


def test_scaler_keywords_build_the_scaler():
    model = TinyGPT(CONFIG).half()
    zero = ZeroOptimizer(
        torch.optim.AdamW(model.parameters()), initial_scale=1024.0, growth_interval=7
    )
    assert zero.scaler.scale == 1024.0
    assert zero.scaler.growth_interval == 7
    default = ZeroOptimizer(torch.optim.AdamW(TinyGPT(CONFIG).half().parameters()))
    assert default.scaler.scale == 2.0**16


def test_scaler_instance_and_keywords_together():
    model = TinyGPT(CONFIG).half()
    with pytest.raises(
        TypeError,
        match=r"ZeroOptimizer: pass either loss_scaler or its keyword arguments "
        r"\(got both: \['initial_scale'\]\)",
    ):
        ZeroOptimizer(
            torch.optim.AdamW(model.parameters()),
            loss_scaler=DynamicLossScaler(),
            initial_scale=8.0,
        )


def test_unknown_keyword():
    model = TinyGPT(CONFIG).half()
    with pytest.raises(
        TypeError, match=r"ZeroOptimizer: unknown keyword arguments \['inital_scale'\]"
    ):
        ZeroOptimizer(torch.optim.AdamW(model.parameters()), inital_scale=8.0)


def test_scaler_without_fp16_has_no_effect_and_says_so():
    model = TinyGPT(CONFIG).bfloat16()
    with pytest.warns(UserWarning, match=r"the loss scaler has no effect without fp16"):
        zero = ZeroOptimizer(torch.optim.AdamW(model.parameters()), initial_scale=8.0)
    assert zero.scaler is None
