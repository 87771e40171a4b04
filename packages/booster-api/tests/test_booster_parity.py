"""Every plugin through the Booster against DDP + torch optimizers, step by step
(gloo, 1 and 2 ranks): losses every step, and the whole model (read through
``full_state_dict``) every step."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.booster import (
    Booster,
    GeminiOptimizerWrapper,
    GeminiPlugin,
    LowLevelZeroOptimizer,
    LowLevelZeroPlugin,
    TorchDDPOptimizer,
    TorchDDPPlugin,
)
from zerostack.fused_adam import HybridAdam
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
CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)
STEPS = 6
LR = {"adamw": 1e-3, "adam_l2": 1e-3, "hybrid": 1e-3, "sgd": 0.5}
# Small chunks, so that this 40K-parameter model spans several of them.
CHUNKS = {"chunk_size": 6_000, "keep_gathered": False}
TOL32 = dict(rtol=1e-5, atol=5e-6)
# Roundings in sequence from a parameter to the loss and back (see the gemini tests).
DEPTH = 2 * (6 * CONFIG.num_layers + 3)


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    name: str
    plugin: str | None  # "ddp", "zero", "gemini" or None (no plugin)
    kind: str = "adamw"  # adamw, adam_l2, hybrid (HybridAdam) or sgd
    dtype: torch.dtype = torch.float32  # what the run computes in
    mixed_precision: str | None = None
    max_norm: float = 0.0
    kwargs: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case(name="ddp-fp32-adamw", plugin="ddp"),
    Case(name="ddp-fp32-sgd", plugin="ddp", kind="sgd"),
    Case(name="none-fp32-adam-l2", plugin=None, kind="adam_l2"),
    Case(name="none-bf16-autocast", plugin=None, dtype=torch.bfloat16, mixed_precision="bf16"),
    Case(name="ddp-fp16-amp", plugin="ddp", dtype=torch.float16, mixed_precision="fp16"),
    Case(name="zero1-fp32-adamw", plugin="zero", kwargs=dict(stage=1, precision="fp32")),
    Case(name="zero2-fp32-sgd-clip", plugin="zero", kind="sgd", max_norm=0.05,
         kwargs=dict(stage=2, precision="fp32")),
    Case(name="zero1-fp32-adam-l2-offload", plugin="zero", kind="adam_l2",
         kwargs=dict(stage=1, precision="fp32", cpu_offload=True)),
    # The overlapped CPU step (worker thread, forward waits per bucket).
    Case(name="zero2-fp32-adamw-clip-offload", plugin="zero", max_norm=0.05,
         kwargs=dict(stage=2, precision="fp32", cpu_offload=True)),
    # Half the offloaded buckets stepped by the device's Adam (gpu_update_fraction).
    Case(name="zero2-fp32-adam-l2-clip-offload-device-lane", plugin="zero", kind="adam_l2",
         max_norm=0.05, kwargs=dict(stage=2, precision="fp32", cpu_offload=True,
                                    gpu_update_fraction=0.5)),
    Case(name="zero2-bf16-adamw", plugin="zero", dtype=torch.bfloat16,
         kwargs=dict(stage=2, precision="bf16")),
    # The plugin's default initial_scale (2**32) overflows fp16 at once: the
    # scaler's arguments must reach ZeroOptimizer for any step to be taken.
    Case(name="zero2-fp16-adamw", plugin="zero", dtype=torch.float16,
         kwargs=dict(stage=2, precision="fp16", initial_scale=2**8)),
    Case(name="gemini-fp32-hybridadam", plugin="gemini", kind="hybrid",
         kwargs=dict(precision="fp32")),
    Case(name="gemini-fp32-sgd-clip-offload", plugin="gemini", kind="sgd", max_norm=0.05,
         kwargs=dict(precision="fp32", offload_optim_frac=0.5)),
    Case(name="gemini-fp32-adam-l2-zero2", plugin="gemini", kind="adam_l2",
         kwargs=dict(precision="fp32", shard_param_frac=0.0)),
    Case(name="gemini-bf16-hybridadam", plugin="gemini", kind="hybrid", dtype=torch.bfloat16,
         kwargs=dict(precision="bf16")),
    # Auto placement (a warm-up step measures, then chunks move), and every
    # optimizer chunk on the CPU.
    Case(name="gemini-fp32-hybridadam-auto", plugin="gemini", kind="hybrid",
         kwargs=dict(precision="fp32", placement_policy="auto", gpu_capacity_bytes=10**6)),
    Case(name="gemini-fp32-hybridadam-cpu", plugin="gemini", kind="hybrid", max_norm=0.05,
         kwargs=dict(precision="fp32", offload_optim_frac=1.0)),
    # Half the CPU-held optimizer chunks stepped by the device's Adam (gpu_update_fraction).
    Case(name="gemini-fp32-hybridadam-cpu-device-lane", plugin="gemini", kind="hybrid",
         max_norm=0.05, kwargs=dict(precision="fp32", offload_optim_frac=1.0,
                                    gpu_update_fraction=0.5)),
]  # fmt: skip


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _optimizer(kind, params):
    lr = LR[kind]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=False)
    if kind == "adam_l2":
        return torch.optim.Adam(params, lr=lr, weight_decay=0.1, foreach=False)
    if kind == "hybrid":
        return HybridAdam(params, lr=lr, weight_decay=0.1)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.01)


def _plugin(case, world):
    if case.plugin == "ddp":
        return TorchDDPPlugin()
    if case.plugin == "zero":
        return LowLevelZeroPlugin(
            max_norm=case.max_norm, reduce_bucket_size_in_m=0.02, **case.kwargs
        )
    if case.plugin == "gemini":
        return GeminiPlugin(
            max_norm=case.max_norm, chunk_config_dict={world: CHUNKS}, **case.kwargs
        )
    return None


WRAPPERS = {
    "ddp": TorchDDPOptimizer,
    None: TorchDDPOptimizer,
    "zero": LowLevelZeroOptimizer,
    "gemini": GeminiOptimizerWrapper,
}


def _tol(case, step, what):
    if case.dtype == torch.float32:
        return TOL32
    if what == "loss":
        rtol, atol = loss_tolerance(case.dtype, depth=DEPTH)
    else:
        rtol, atol = training_tolerance(case.dtype, steps=step + 1, lr=LR[case.kind])
    return dict(rtol=rtol, atol=atol)


def _run_case(rank, world, case, device="cpu"):
    """``case`` next to DDP on ``device`` (the plugin picks its own: the
    current CUDA device where there is one)."""
    torch.manual_seed(0)
    ref_model = TinyGPT(CONFIG)
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model.to(device))
    ref_opt = _optimizer("adamw" if case.kind == "hybrid" else case.kind, ref.parameters())
    booster = Booster(plugin=_plugin(case, world), mixed_precision=case.mixed_precision)
    out = booster.boost(model, _optimizer(case.kind, model.parameters()), lm_loss)
    assert len(out) == 5 and out[3] is None and out[4] is None, case.name
    model, opt, criterion = out[:3]
    assert isinstance(opt, WRAPPERS[case.plugin]), f"{case.name}: {type(opt).__name__}"
    for step in range(STEPS):
        idx, tgt = make_batch(CONFIG, 4, 16, seed=1000 * step + rank, device=device)
        ref_loss = lm_loss(ref(idx), tgt)
        ref_loss.backward()
        if case.max_norm:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), case.max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = criterion(model(idx), tgt)
        booster.backward(loss, opt)
        stepped = opt.step()
        opt.zero_grad()
        assert stepped is not False, f"{case.name} step {step}: skipped"
        where = f"{case.name} step {step}"
        torch.testing.assert_close(
            loss.float().to(device),
            ref_loss,
            **_tol(case, step, "loss"),
            msg=lambda m, w=where: f"{w} loss: {m}",
        )
        full = model.full_state_dict(only_rank_0=False)
        expected = ref.module.state_dict()
        assert list(full) == list(expected), where
        for name, value in expected.items():
            assert full[name].dtype == torch.float32 and full[name].device.type == "cpu", name
            torch.testing.assert_close(
                full[name], value.cpu(), **_tol(case, step, "params"),
                msg=lambda m, n=name, w=where: f"{w} {n}: {m}",
            )  # fmt: skip
    if case.mixed_precision == "fp16":
        assert opt.scaler is not None and opt.scaler.get_scale() == 2.0**16, case.name


def _all(rank, world, cases):
    # A model this small gains nothing from threads, and two threads on a
    # busy 2-core machine spin against each other (10x slower seen).
    torch.set_num_threads(1)
    for case in cases:
        _run_case(rank, world, case)


@pytest.mark.parametrize("world_size", [1, 2])
def test_plugins_match_ddp_step_by_step(world_size):
    spawn(_all, world_size, args=(CASES,), backend="gloo", timeout_s=240)
