"""The Booster's surface in one process: what boost returns, mixed precision,
lr schedulers, warnings and refusals, and checkpoint calls forwarded to the
plugin's checkpoint IO."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from zerostack.booster import (
    Booster,
    GeminiPlugin,
    LowLevelZeroPlugin,
    ModelWrapper,
    OptimizerWrapper,
    TorchDDPModel,
    TorchDDPOptimizer,
    TorchDDPPlugin,
)
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, make_batch

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _model(seed=0):
    torch.manual_seed(seed)
    return TinyGPT(CONFIG)


def test_boost_without_a_plugin_returns_the_five_tuple_and_trains():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = [make_batch(CONFIG, 4, 16, seed=s) for s in range(3)]
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    booster = Booster()
    out = booster.boost(model, opt, lm_loss, loader, scheduler)
    assert isinstance(out, tuple) and len(out) == 5
    b_model, b_opt, criterion, b_loader, b_scheduler = out
    assert isinstance(b_model, TorchDDPModel) and isinstance(b_model, ModelWrapper)
    assert b_model.unwrap() is model  # no process group: no DDP
    assert isinstance(b_opt, TorchDDPOptimizer) and isinstance(b_opt, OptimizerWrapper)
    assert b_opt.optim is opt and b_opt.param_groups is opt.param_groups
    assert criterion is lm_loss and b_loader is loader and b_scheduler is scheduler
    assert scheduler.optimizer is b_opt
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "optimizer.step() ... lr_scheduler" warnings
        for idx, tgt in b_loader:
            loss = criterion(b_model(idx), tgt)
            booster.backward(loss, b_opt)
            b_opt.step()
            b_opt.zero_grad()
            b_scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    own = b_opt.state_dict()  # the torch optimizer's own, positional
    assert own["state"][0]["step"].item() == 3
    b_opt.load_state_dict(own)
    assert not torch.equal(model.lm_head.weight, before["lm_head.weight"])
    with booster.no_sync(b_model):  # one process: nothing to skip, still a context
        pass


def test_bf16_autocast_runs_forward_in_bf16_and_keeps_fp32_weights():
    booster = Booster(mixed_precision="bf16")
    model = _model()
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters()))
    idx, _ = make_batch(CONFIG, 2, 16, seed=0)
    assert model(idx).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert opt.scaler is None


def test_fp16_scales_the_loss_with_a_grad_scaler_and_unscales_at_step():
    reference = _model()
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    lm_loss(reference(idx), tgt).backward()
    booster = Booster(mixed_precision="fp16")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, criterion, *_ = booster.boost(model, opt, lm_loss)
    assert isinstance(opt.scaler, torch.amp.GradScaler) and opt.scaler.get_scale() == 2.0**16
    loss = criterion(model(idx), tgt)
    booster.backward(loss, opt)
    scaled = model.unwrap().lm_head.weight.grad
    ratio = (scaled.norm() / reference.lm_head.weight.grad.norm()).item()
    assert ratio == pytest.approx(2.0**16, rel=1e-2)  # the grad is scaled ...
    before = model.unwrap().lm_head.weight.detach().clone()
    opt.step()
    moved = ((before - model.unwrap().lm_head.weight).norm() / 0.1).item()
    assert moved == pytest.approx(
        reference.lm_head.weight.grad.norm().item(), rel=1e-2
    )  # ... not the step


def test_booster_refusals_and_warnings():
    with pytest.raises(TypeError, match=r"plugin must be a Plugin \(got object\)"):
        Booster(plugin=object())
    for name in ("fp16_apex", "fp16_naive", "fp8"):
        with pytest.raises(
            NotImplementedError, match=rf"mixed_precision='{name}' is not implemented"
        ):
            Booster(mixed_precision=name)
    with pytest.raises(
        ValueError, match=r"mixed_precision must be 'fp16' or 'bf16' \(got 'fp32'\)"
    ):
        Booster(mixed_precision="fp32")
    with pytest.raises(TypeError, match=r"got int"):
        Booster(mixed_precision=16)
    with pytest.warns(UserWarning, match=r"mixed_precision='bf16' has no effect: GeminiPlugin"):
        booster = Booster(mixed_precision="bf16", plugin=GeminiPlugin())
    assert booster.mixed_precision is None
    with pytest.warns(UserWarning, match=r"device='cpu' has no effect: LowLevelZeroPlugin"):
        Booster(device="cpu", plugin=LowLevelZeroPlugin())
    booster = Booster()
    with pytest.raises(NotImplementedError, match=r"pipeline parallelism is not implemented"):
        booster.execute_pipeline(iter([]), None, None)
    mine, other = _model(), _model()
    mixed = [*mine.parameters()][:1] + [*other.parameters()][1:]
    with pytest.raises(
        ValueError, match=r"the optimizer holds parameters that are not the model's"
    ):
        booster.boost(mine, torch.optim.SGD(mixed, lr=0.1))
    model = _model()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"optimizer must be the one boost returned \(got SGD\)"):
        booster.backward(model(make_batch(CONFIG, 2, 8, seed=0)[0]).sum(), opt.optim)


def test_torch_ddp_plugin_needs_a_process_group():
    with pytest.raises(RuntimeError, match=r"TorchDDPPlugin: torch.distributed is not initialised"):
        Booster(plugin=TorchDDPPlugin()).boost(_model())


def test_no_sync_refusals():
    booster = Booster(plugin=GeminiPlugin(precision="fp32"))
    assert not booster.plugin.support_no_sync()
    model, opt, *_ = booster.boost(_model())
    with pytest.raises(NotImplementedError, match=r"GeminiPlugin: no_sync needs gradient chunks"):
        booster.no_sync(model, opt)
    booster = Booster(plugin=LowLevelZeroPlugin(precision="fp32"))
    model = _model()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"pass the boosted optimizer \(got NoneType\)"):
        booster.no_sync(model)
    with booster.no_sync(model, opt):
        assert opt.optim._no_sync
    assert not opt.optim._no_sync


def test_gemini_lr_scheduler_reaches_the_inner_optimizer():
    """GeminiOptimizer copies its own param_groups into the inner optimizer at
    each step: a scheduler left on the user's HybridAdam would be overwritten."""
    model = _model()
    adam = HybridAdam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(adam, lambda step: 0.1 ** (step + 1))
    booster = Booster(plugin=GeminiPlugin(precision="fp32"))
    model, opt, _, _, scheduler = booster.boost(model, adam, lr_scheduler=scheduler)
    assert scheduler.optimizer is opt
    for step in range(2):
        idx, tgt = make_batch(CONFIG, 2, 16, seed=step)
        booster.backward(model(idx, tgt), opt)
        opt.step()
        assert adam.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.1 ** (step + 1))
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.1**3)


def test_checkpoint_calls_are_forwarded_to_the_plugins_checkpoint_io(monkeypatch):
    calls = []

    class RecordingIO:
        def __getattr__(self, name):
            return lambda *args, **kwargs: calls.append((name, args, kwargs))

    fake = types.ModuleType("zerostack.booster._checkpoint")
    fake.CheckpointIO = RecordingIO
    monkeypatch.setitem(sys.modules, "zerostack.booster._checkpoint", fake)
    booster = Booster()
    model = _model()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    booster.save_model(model, "m", shard=True, prefix="p", size_per_shard=7, use_safetensors=True)
    booster.load_model(model, "m", strict=False)
    booster.save_optimizer(opt, "o", shard=True, gather_dtensor=False, size_per_shard=3)
    booster.load_optimizer(opt, "o", verify=False)
    booster.save_lr_scheduler("sched", "s")
    booster.load_lr_scheduler("sched", "s")
    assert calls == [
        ("save_model", (model,), dict(checkpoint="m", shard=True, gather_dtensor=True,
                                      prefix="p", size_per_shard=7, use_safetensors=True)),
        ("load_model", (model, "m"), dict(strict=False, verify=True)),
        ("save_optimizer", (opt,), dict(checkpoint="o", shard=True, gather_dtensor=False,
                                        prefix=None, size_per_shard=3)),
        ("load_optimizer", (opt, "o"), dict(verify=False)),
        ("save_lr_scheduler", ("sched", "s"), {}),
        ("load_lr_scheduler", ("sched", "s"), dict(verify=True)),
    ]  # fmt: skip


def test_checkpoint_io_not_built_yet(monkeypatch):
    monkeypatch.setitem(sys.modules, "zerostack.booster._checkpoint", None)  # import fails
    booster = Booster()
    model, *_ = booster.boost(_model())
    with pytest.raises(NotImplementedError, match=r"checkpoint IO not built yet"):
        booster.save_model(model, "m")
