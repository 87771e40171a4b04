"""AutoOffloadPlugin: the Booster path to memory_optimize + AMPOptimizer
(run on the CPU with a given hardware profile): the same losses as the
package used directly, with part of the model really offloaded; checkpoints
by name; clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

from zerostack.auto_offload import AMPOptimizer, HardwareProfile, memory_optimize
from zerostack.booster import AutoOffloadOptimizer, AutoOffloadPlugin, Booster, TorchDDPPlugin
from zerostack.booster._plugins import _auto_offload
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT

CONFIG = GPTConfig(vocab_size=64, max_seq_len=16, num_layers=3, dim=32, num_heads=4)
PROFILE = dict(
    device_name="test-gpu", device_memory_bytes=10**9, h2d_bandwidth={4096: 1e9, 1 << 20: 2e10},
    d2h_bandwidth={4096: 1e9, 1 << 20: 2e10},
    gemm_flops={"float16": 1e12, "bfloat16": 1e12, "float32": 2.5e11},
    memory_bandwidth=1e12, kernel_launch_s=5e-6,
)  # fmt: skip
GB = 1024**3


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return {"idx": torch.randint(0, CONFIG.vocab_size, (2, 8), generator=g)}


def _loss(logits, idx):
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1)
    )


def _budget():
    """A budget halfway between the least plan and none, from the solver itself."""
    from zerostack.auto_offload import plan_offload

    torch.manual_seed(0)
    profile = HardwareProfile.from_dict(PROFILE)
    _, rm, _ = plan_offload(
        TinyGPT(CONFIG), _inputs(0), -1, "asyn", precision="bf16", profile=profile
    )
    free, least = rm.solver.best_ts.peak_mem, rm.solver.least_memory_plan().peak_mem
    return (least + 0.5 * (free - least)) / 0.95


def _train(model, optimizer_step, backward, steps=3):
    losses = []
    for step in range(steps):
        batch = _inputs(step)
        loss = _loss(model(**batch), batch["idx"])
        backward(loss)
        optimizer_step()
        losses.append(loss.item())
    return losses


def test_booster_path_trains_as_the_package_used_directly(tmp_path):
    budget = _budget()
    profile = HardwareProfile.from_dict(PROFILE)
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    direct_model = copy.deepcopy(model)
    plugin = AutoOffloadPlugin(
        memory_budget=budget / GB, solver_name="asyn", precision="bf16", max_norm=1.0,
        example_inputs=_inputs(0), profile=profile, device="cpu",
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-3))
    assert isinstance(opt, AutoOffloadOptimizer)
    assert any(r.need_offload for r in boosted.module.regions), "the budget offloads nothing"
    got = _train(boosted, opt.step, lambda loss: booster.backward(loss, opt))

    om = memory_optimize(direct_model, _inputs(0), budget, "asyn", precision="bf16",
                         profile=profile, device="cpu")  # fmt: skip
    amp = AMPOptimizer(HybridAdam(direct_model.parameters(), lr=1e-3), om, clipping_norm=1.0)
    expected = _train(om, amp.step, amp.backward)
    assert got == expected

    # A checkpoint by name: the masters load into a plain model, and the
    # optimizer's state into another auto-offload run.
    booster.save_model(boosted, str(tmp_path / "model.pt"))
    booster.save_optimizer(opt, str(tmp_path / "optim.pt"))
    plain = TinyGPT(CONFIG)
    Booster(plugin=None).load_model(
        Booster(plugin=None).boost(plain)[0], str(tmp_path / "model.pt")
    )
    for name, value in boosted.full_state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name
    torch.manual_seed(0)
    again = TinyGPT(CONFIG)
    plugin2 = AutoOffloadPlugin(
        memory_budget=budget / GB, precision="bf16", example_inputs=_inputs(0), profile=profile,
        device="cpu",
    )  # fmt: skip
    booster2 = Booster(plugin=plugin2)
    model2, opt2, *_ = booster2.boost(again, HybridAdam(again.parameters(), lr=1e-3))
    booster2.load_model(model2, str(tmp_path / "model.pt"))
    booster2.load_optimizer(opt2, str(tmp_path / "optim.pt"))
    saved, loaded = opt.full_state_dict(), opt2.full_state_dict()
    for name, entry in saved["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                assert torch.equal(loaded["state"][name][key], value), (name, key)


def test_bad_settings_and_several_processes_are_refused(monkeypatch):
    with pytest.raises(
        ValueError, match=r"solver_name must be one of \('asyn', 'syn'\) \(got 'fast'\)"
    ):
        AutoOffloadPlugin(solver_name="fast")
    with pytest.raises(
        ValueError, match=r"precision must be one of \('fp16', 'bf16'\) \(got 'fp32'\)"
    ):
        AutoOffloadPlugin(precision="fp32")
    with pytest.raises(ValueError, match=r"max_norm must be >= 0 \(got -1\)"):
        AutoOffloadPlugin(max_norm=-1)
    model = TinyGPT(CONFIG)
    with pytest.raises(ValueError, match=r"example_inputs is required"):
        Booster(plugin=AutoOffloadPlugin(device="cpu")).boost(model)
    monkeypatch.setattr(_auto_offload, "rank_and_world", lambda: (0, 2))
    with pytest.raises(
        NotImplementedError, match=r"2 processes; the offload plan is for one device"
    ):
        Booster(plugin=AutoOffloadPlugin(example_inputs=_inputs(0), device="cpu")).boost(model)
    assert TorchDDPPlugin  # the plain path used above is the default plugin's


def test_clipping_the_way_users_write_it():
    """booster.clip_grad_norm_ clips this step only, as torch's clip_grad_norm_
    on the same gradients (the package used directly with clipping_norm for
    that step is the reference); torch's own clip on the model's parameters
    raises instead of returning 0.0 and clipping nothing."""
    budget = _budget()
    profile = HardwareProfile.from_dict(PROFILE)
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    reference = copy.deepcopy(model)
    plugin = AutoOffloadPlugin(
        memory_budget=budget / GB, solver_name="asyn", precision="bf16",
        example_inputs=_inputs(0), profile=profile, device="cpu",
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.5))
    om = memory_optimize(reference, _inputs(0), budget, "asyn", precision="bf16",
                         profile=profile, device="cpu")  # fmt: skip
    amp = AMPOptimizer(torch.optim.SGD(reference.parameters(), lr=0.5), om)
    norms = []
    for step in range(3):
        batch = _inputs(step)
        booster.backward(_loss(boosted(**batch), batch["idx"]), opt)
        if step == 0:
            with pytest.raises(RuntimeError, match=r"booster.clip_grad_norm_.*max_norm"):
                torch.nn.utils.clip_grad_norm_(boosted.unwrap().parameters(), 0.01)
        clip = 0.01 if step < 2 else None  # the third step is not clipped
        if clip is not None:
            norms.append(float(booster.clip_grad_norm_(boosted, opt, clip)))
        opt.step()
        amp.max_norm = clip or 0.0
        amp.backward(_loss(om(**batch), batch["idx"]))
        amp.step()
        assert norms[-1] == pytest.approx(amp.last_grad_norm) if clip else True
    masters = {n: om.master_of(p) for n, p in om.model.named_parameters()}
    got = boosted.full_state_dict()
    assert set(masters) <= set(got)
    for name, master in masters.items():
        assert torch.equal(got[name], master), name
    assert len(norms) == 2
