"""The user contract (docs/reliability.md, "User actions take effect"): every
argument, setting and common torch idiom a user applies to a boosted model
or optimizer either takes effect, or raises / warns naming what to do
instead. One row per action and plugin: an effect asserted on what training
does, or the error / warning pinned by its message."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from zerostack.booster import (
    AutoOffloadPlugin,
    Booster,
    GeminiPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
)
from zerostack.booster._plugins._state import ModelFacts
from zerostack.fused_adam import HybridAdam
from zerostack.testing import GPTConfig, TinyGPT, make_batch, one_torch_thread, spawn

CONFIG = GPTConfig(bias=False, vocab_size=64, dim=16, max_seq_len=16, num_layers=1)
PROFILE = dict(
    device_name="test-gpu", device_memory_bytes=10**9, h2d_bandwidth={4096: 1e9, 1 << 20: 2e10},
    d2h_bandwidth={4096: 1e9, 1 << 20: 2e10},
    gemm_flops={"float16": 1e12, "bfloat16": 1e12, "float32": 2.5e11},
    memory_bandwidth=1e12, kernel_launch_s=5e-6,
)  # fmt: skip


def _auto_offload(**kwargs: Any) -> AutoOffloadPlugin:
    from zerostack.auto_offload import HardwareProfile

    idx, _ = make_batch(CONFIG, 2, 8, seed=0)
    return AutoOffloadPlugin(**{
        "precision": "bf16", "example_inputs": {"idx": idx}, "device": "cpu",
        "profile": HardwareProfile.from_dict(PROFILE), **kwargs,
    })  # fmt: skip


def _with(cls: type, **base: Any) -> Callable[..., Any]:
    return lambda **kwargs: cls(**{**base, **kwargs})


# fp32 everywhere (exact comparisons) except AutoOffloadPlugin, which has no fp32.
PLUGINS: dict[str, Callable[..., Any]] = {
    "torch": lambda: None,
    "zero1": _with(LowLevelZeroPlugin, stage=1, precision="fp32"),
    "zero2": _with(LowLevelZeroPlugin, stage=2, precision="fp32"),
    "zero2-offload": _with(LowLevelZeroPlugin, stage=2, precision="fp32", cpu_offload=True),
    # With clipping at step (the plugin's max_norm).
    "zero2-offload-clip": _with(
        LowLevelZeroPlugin, stage=2, precision="fp32", cpu_offload=True, max_norm=100.0
    ),
    "gemini": _with(GeminiPlugin, precision="fp32"),
    "gemini-offload": _with(GeminiPlugin, precision="fp32", offload_optim_frac=1.0),
    "auto-offload": _auto_offload,
}
ALL = tuple(PLUGINS)
TORCH = ("torch",)
ZERO = ("zero1", "zero2", "zero2-offload", "zero2-offload-clip")
GEMINI = ("gemini", "gemini-offload")
SHARDED = ZERO + GEMINI  # fp32 masters apart from the parameters
AUTO = ("auto-offload",)


class Env:
    """A tiny model boosted with one plugin, and what the rows need."""

    def __init__(
        self, plugin: str, *, optimizer: str = "adam", frozen: tuple[str, ...] = (),
        exclude: tuple[str, ...] = (), dropout: float = 0.0, plugin_kwargs: dict | None = None,
    ) -> None:  # fmt: skip
        torch.manual_seed(0)
        self.kind = plugin
        self.config = dataclasses.replace(CONFIG, dropout=dropout)
        self.plain = TinyGPT(self.config)
        for name, p in self.plain.named_parameters():
            if name in frozen:
                p.requires_grad_(False)
        params = [p for n, p in self.plain.named_parameters() if n not in exclude]
        if optimizer == "sgd":
            opt = torch.optim.SGD(params, lr=0.1)
        elif optimizer == "adamw":
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        elif optimizer == "adam-decoupled":  # torch's other spelling of AdamW
            opt = torch.optim.Adam(params, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
        else:
            opt = HybridAdam(params, lr=1e-2)
        self.user_opt = opt  # the object handed to boost
        made = PLUGINS[plugin](**(plugin_kwargs or {}))
        self.booster = Booster(device="cpu") if made is None else Booster(plugin=made)
        self.model, self.opt, *_ = self.booster.boost(self.plain, opt)

    def loss(self, seed: int = 0) -> torch.Tensor:
        idx, tgt = make_batch(self.config, 2, 8, seed=seed)
        if self.kind == "auto-offload":  # traced on idx alone: logits out
            logits = self.model(idx=idx)
            return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tgt.reshape(-1))
        return self.model(idx, tgt)

    def step(self, seed: int = 0) -> None:
        self.booster.backward(self.loss(seed), self.opt)
        self.opt.step()
        self.opt.zero_grad()
        self.settle()

    def settle(self) -> None:
        """Pending CPU updates written back (the parameters hold the step)."""
        inner = self.opt.optim
        if hasattr(inner, "wait_updates"):
            inner.wait_updates()
        module = getattr(inner, "module", None)
        if hasattr(module, "wait_updates"):
            module.wait_updates()

    def weights(self) -> dict[str, torch.Tensor]:
        """The whole fp32 weights by the user's names (the plugin's own export)."""
        names = set(ModelFacts.of(TinyGPT(CONFIG)).shapes)
        full = self.model.full_state_dict(only_rank_0=False)
        return {k: v.float().clone() for k, v in full.items() if k in names}


def _max_change(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    return max((after[k] - v).abs().max().item() for k, v in before.items())


@dataclass(frozen=True)
class Row:
    """One user action on a boosted model or optimizer, and what must follow.

    Args:
        id: the row's name (unique).
        plugins: the PLUGINS it applies to.
        act: ``act(env)`` does what the user does.
        effect: ``effect(env, result)`` asserts the change in behaviour.
        error: the exception ``act`` must raise instead (with ``match``).
        warning: the warning ``act`` must give (with ``match``); ``effect`` may follow.
        options: Env keywords (the optimizer, frozen parameters, dropout).
    """

    id: str
    plugins: tuple[str, ...]
    act: Callable[[Env], Any]
    effect: Callable[[Env, Any], None] | None = None
    error: type[Exception] | None = None
    warning: type[Warning] | None = None
    match: str = ""
    options: dict[str, Any] = field(default_factory=dict)


# -- optimizer ------------------------------------------------------------------------------


def _closure_step(env: Env) -> tuple[Any, list[torch.Tensor], dict]:
    before = env.weights()
    losses: list[torch.Tensor] = []

    def closure():
        loss = env.loss(1)
        env.booster.backward(loss, env.opt)
        losses.append(loss)
        return loss

    out = env.opt.step(closure)
    env.opt.zero_grad()
    env.settle()
    return out, losses, before


def _closure_ran(env: Env, result: Any) -> None:
    out, losses, before = result
    assert len(losses) == 1, "the closure did not run once"
    assert out is losses[0], "step(closure) does not return the closure's loss"
    assert _max_change(before, env.weights()) > 0, "the step did not train"


def _lr_zero(env: Env) -> dict[str, torch.Tensor]:
    env.step(0)
    for group in env.opt.param_groups:
        group["lr"] = 0.0
    before = env.weights()
    env.step(1)
    return before


def _adam_hyperparameters_changed(env: Env) -> dict[str, torch.Tensor]:
    """betas, eps and weight_decay set by hand on the boosted optimizer's
    groups between steps (lr has its own row)."""
    env.step(0)
    for group in env.opt.param_groups:
        group.update(betas=(0.5, 0.6), eps=1e-3, weight_decay=0.5)
    env.step(1)
    env.step(2)
    return env.weights()


def _as_torchs_adamw(env: Env, got: dict[str, torch.Tensor]) -> None:
    ref = Env("torch", optimizer="adamw")
    kept = Env(env.kind, optimizer="adamw")
    for seed in range(3):
        kept.step(seed)
    assert _max_change(_adam_hyperparameters_changed(ref), got) < 1e-6
    assert _max_change(kept.weights(), got) > 1e-3, "the new values changed nothing"


def _evaluations_right_after_step(how: Callable[[], Any]) -> Callable[[Env], tuple]:
    """An evaluation forward right after each ``optimizer.step()`` (before
    any overlapped CPU update is written back), under ``how``."""

    def act(env: Env) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        evaluated = []
        for seed in range(3):
            env.booster.backward(env.loss(seed), env.opt)
            env.opt.step()
            env.opt.zero_grad()
            with how():
                evaluated.append(env.loss(7).detach().clone())
        env.settle()
        return torch.stack(evaluated), env.weights()

    return act


def _as_torch_evaluates(how: Callable[[], Any]) -> Callable[[Env, tuple], None]:
    def check(env: Env, got: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        evaluated, weights = _evaluations_right_after_step(how)(Env("torch", optimizer="sgd"))
        torch.testing.assert_close(got[0], evaluated, rtol=1e-6, atol=0)
        assert _max_change(weights, got[1]) < 1e-6

    return check


def _autocast_forward(env: Env) -> dict[str, torch.Tensor]:
    """``torch.autocast("cpu", dtype=torch.bfloat16)`` around the forward and loss."""
    for seed in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = env.loss(seed)
        env.booster.backward(loss, env.opt)
        env.opt.step()
        env.opt.zero_grad()
        env.settle()
    return env.weights()


def _as_torch_autocasts(env: Env, got: dict[str, torch.Tensor]) -> None:
    plain = Env("torch", optimizer="sgd")
    assert _max_change(_autocast_forward(Env("torch", optimizer="sgd")), got) < 1e-6
    for seed in range(3):
        plain.step(seed)
    assert _max_change(plain.weights(), got) > 1e-5, "autocast changed nothing"


def _unchanged(env: Env, before: dict[str, torch.Tensor]) -> None:
    assert _max_change(before, env.weights()) == 0.0


def _trajectory(plugin: str, zero_grad: Callable[[Any], None], **options) -> dict:
    env = Env(plugin, **options)
    for seed in range(2):
        env.booster.backward(env.loss(seed), env.opt)
        env.opt.step()
        zero_grad(env)
        env.settle()
    return env.weights()


def _same_as_set_to_none(env: Env, _: Any) -> None:
    """The sharding plugins drop the gradients either way, and say so once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keep = _trajectory(env.kind, lambda e: e.opt.zero_grad(set_to_none=False))
    said = [w for w in caught if "(set_to_none=False): the gradients are dropped" in str(w.message)]
    assert len(said) == (env.kind in ZERO + GEMINI), [str(w.message) for w in caught]
    drop = _trajectory(env.kind, lambda e: e.opt.zero_grad())
    assert _max_change(drop, keep) == 0.0


def _two_backwards(env: Env, retain: bool) -> dict[str, torch.Tensor]:
    """After a first step: two backward passes (of one loss twice, or of
    two batches), one step."""
    env.step(5)
    if retain:
        loss = env.loss(0)
        env.opt.backward(loss, retain_graph=True)
        env.opt.backward(loss)
    else:
        env.booster.backward(env.loss(0), env.opt)
        env.booster.backward(env.loss(1), env.opt)
    env.opt.step()
    env.settle()
    return env.weights()


def _as_one_backward(retain: bool) -> Callable[[Env, Any], None]:
    def check(env: Env, got: dict[str, torch.Tensor]) -> None:
        ref = Env(env.kind, optimizer="sgd")
        ref.step(5)
        before = ref.weights()
        loss = 2 * ref.loss(0) if retain else ref.loss(0) + ref.loss(1)
        ref.booster.backward(loss, ref.opt)
        ref.opt.step()
        ref.settle()
        assert _max_change(ref.weights(), got) < 1e-6
        assert _max_change(before, got) > 1e-3

    return check


def _dropped_by_the_model(how: str) -> Callable[[Env], dict[str, torch.Tensor]]:
    """After a first step: a backward whose gradients the model's own
    ``zero_grad`` (``how``: the boosted model's, or the user's module's
    through ``unwrap()``) drops, then another backward and the step (the
    loop of PyTorch's DCGAN example, whose ``netD.zero_grad()`` drops the
    generator's backward)."""

    def act(env: Env) -> dict[str, torch.Tensor]:
        env.step(5)
        env.booster.backward(env.loss(0), env.opt)
        (env.model if how == "boosted" else env.model.unwrap()).zero_grad()
        env.booster.backward(env.loss(1), env.opt)
        env.opt.step()
        env.settle()
        return env.weights()

    return act


def _as_the_second_backward_alone(env: Env, got: dict[str, torch.Tensor]) -> None:
    ref = Env(env.kind, optimizer="sgd")
    ref.step(5)
    before = ref.weights()
    ref.booster.backward(ref.loss(1), ref.opt)
    ref.opt.step()
    ref.settle()
    assert _max_change(ref.weights(), got) < 1e-6
    assert _max_change(before, got) > 1e-3


def _zero_grad_between_forward_and_backward(env: Env) -> dict[str, torch.Tensor]:
    """After a first step: a backward, then ``optimizer.zero_grad()`` between
    the next forward and its backward (the loop that zeroes before each
    backward), then the step: the first backward's gradients are gone."""
    env.step(5)
    env.booster.backward(env.loss(0), env.opt)
    loss = env.loss(1)
    env.opt.zero_grad()
    env.booster.backward(loss, env.opt)
    env.opt.step()
    env.settle()
    return env.weights()


def _evaluate_before_the_step(env: Env) -> None:
    env.booster.backward(env.loss(0), env.opt)
    with torch.no_grad():
        env.loss(1)


def _evaluate_between_backward_and_step(env: Env) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """After a first step: a backward, an evaluation, the step."""
    env.step(5)
    env.booster.backward(env.loss(0), env.opt)
    with torch.no_grad():
        evaluated = env.loss(1)
    env.opt.step()
    env.settle()
    return evaluated, env.weights()


def _as_evaluated_before_the_backward(env: Env, got: tuple[torch.Tensor, dict]) -> None:
    ref = Env(env.kind, optimizer="sgd")
    ref.step(5)
    with torch.no_grad():
        evaluated = ref.loss(1)
    ref.booster.backward(ref.loss(0), ref.opt)
    ref.opt.step()
    ref.settle()
    torch.testing.assert_close(got[0], evaluated, rtol=1e-6, atol=0)
    assert _max_change(ref.weights(), got[1]) < 1e-6


def _torchs_grad_norm() -> float:
    """The gradient's 2-norm of the second batch after one SGD step, by torch."""
    ref = Env("torch", optimizer="sgd")
    ref.step(0)
    ref.loss(1).backward()
    return torch.nn.utils.get_total_norm([p.grad for p in ref.plain.parameters()]).item()


def _grad_norm_by_hand(env: Env) -> float:
    """After a first step, a backward, then the norm logged from ``p.grad``."""
    env.step(0)
    env.booster.backward(env.loss(1), env.opt)
    norms = [p.grad.norm() for p in env.model.unwrap().parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item()


def _grad_norm_by_clip_inf(env: Env) -> tuple[float, dict[str, torch.Tensor]]:
    """What the refusal above says to do; the step is the unclipped one."""
    env.step(0)
    env.booster.backward(env.loss(1), env.opt)
    norm = float(env.opt.clip_grad_by_norm(float("inf")))
    env.opt.step()
    env.settle()
    return norm, env.weights()


def _is_torchs_grad_norm(env: Env, got: Any) -> None:
    norm = got[0] if isinstance(got, tuple) else got
    bf16 = env.kind == "auto-offload"  # bf16 gradients
    torch.testing.assert_close(norm, _torchs_grad_norm(), rtol=1e-3 if bf16 else 1e-6, atol=0)
    if isinstance(got, tuple) and not bf16:
        ref = Env("torch", optimizer="sgd")
        ref.step(0)
        ref.step(1)
        assert _max_change(ref.weights(), got[1]) < 1e-6


def _step_the_optimizer_handed_to_boost(env: Env) -> None:
    env.booster.backward(env.loss(0), env.opt)
    env.user_opt.step()


def _add_group_to_the_optimizer_handed_to_boost(env: Env) -> None:
    env.user_opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


def _add_group(env: Env) -> dict[str, torch.Tensor]:
    env.opt.add_param_group({"params": [env.model.unwrap().tok_emb.weight], "lr": 1e-2})
    before = env.weights()
    env.step(0)
    return before


def _group_trains(env: Env, before: dict[str, torch.Tensor]) -> None:
    after = env.weights()
    assert (after["tok_emb.weight"] - before["tok_emb.weight"]).abs().max() > 0


def _boost_a_resumed_optimizer(env: Env) -> Env:
    """A resumed script's order: the optimizer loads its checkpoint (here of
    two steps of ``env``), then the model and it are boosted."""
    env.step(0)
    env.step(1)
    saved = env.opt.state_dict() if env.kind == "torch" else None
    if saved is None:  # the sharded plugins' own state dicts are per rank: a plain AdamW's
        torch.manual_seed(0)
        plain = TinyGPT(CONFIG)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        for seed in (0, 1):
            plain(*make_batch(CONFIG, 2, 8, seed=seed)).backward()
            plain_opt.step()
        saved = plain_opt.state_dict()
    torch.manual_seed(0)
    net = TinyGPT(CONFIG)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    opt.load_state_dict(saved)
    made = PLUGINS[env.kind]()
    booster = Booster(device="cpu") if made is None else Booster(plugin=made)
    _, boosted, *_ = booster.boost(net, opt)
    return boosted


def _keeps_the_loaded_state(env: Env, boosted: Any) -> None:
    steps = {float(s["step"]) for s in boosted.state_dict()["state"].values()}
    assert steps == {2.0}, steps


def _save_the_optimizer_handed_to_boost(env: Env) -> dict[str, Any]:
    env.step(0)
    return env.user_opt.state_dict()


def _holds_the_states(env: Env, state: dict[str, Any]) -> None:
    """Every trained tensor's Adam moments and step (ZeRO's: of the masters)."""
    assert len(state["state"]) == len(list(env.plain.parameters()))
    for entry in state["state"].values():
        assert float(entry["step"]) == 1.0 and entry["exp_avg"].abs().max() > 0


def _load_into_the_optimizer_handed_to_boost(env: Env) -> None:
    env.user_opt.load_state_dict({"state": {}, "param_groups": env.user_opt.param_groups})


# -- model ----------------------------------------------------------------------------------


def _state_dict(env: Env) -> dict[str, torch.Tensor]:
    env.step(0)
    return env.model.state_dict()


def _whole_and_named(env: Env, state: dict[str, torch.Tensor]) -> None:
    names = {f"module.{k}": v for k, v in env.plain.state_dict(keep_vars=True).items()}
    assert set(state) == set(names)
    full = env.model.full_state_dict(only_rank_0=False)
    for k, v in state.items():
        assert v.shape == names[k].shape, k
        torch.testing.assert_close(v.float(), full[k[len("module.") :]].float(), rtol=0, atol=0)


def _load_zeros(env: Env) -> None:
    env.step(0)
    zeros = {k: torch.zeros_like(v) for k, v in env.model.state_dict().items()}
    env.model.load_state_dict(zeros)
    for group in env.opt.param_groups:
        group["lr"] = 0.0
    env.step(1)


def _all_zero(env: Env, _: Any) -> None:
    assert all(v.abs().max() == 0 for v in env.weights().values())
    if env.kind != "auto-offload":  # its parameters are the device copies of the next forward
        assert all(p.abs().max() == 0 for p in env.model.unwrap().parameters())


def _load_plain_keys(env: Env) -> None:
    env.model.load_state_dict(TinyGPT(CONFIG).state_dict())


def _load_assign(env: Env) -> None:
    env.model.load_state_dict(env.model.state_dict(), assign=True)


def _to_same_device(env: Env) -> dict[str, torch.Tensor]:
    assert env.model.to("cpu") is env.model
    before = env.weights()
    env.step(0)
    return before


def _trains(env: Env, before: dict[str, torch.Tensor]) -> None:
    assert _max_change(before, env.weights()) > 0


def _to_float64(env: Env) -> Any:
    return env.model.to(torch.float64)


def _is_float64(env: Env, _: Any) -> None:
    assert all(p.dtype == torch.float64 for p in env.model.unwrap().parameters())


@torch.no_grad()
def _dropout_outputs(env: Env) -> list[tuple[torch.Tensor, torch.Tensor]]:
    idx, _ = make_batch(env.config, 2, 8, seed=0)
    out = []
    for mode in (False, True):
        env.model.train(mode)
        out.append((env.model(idx).clone(), env.model(idx).clone()))
    return out


def _eval_is_deterministic(env: Env, out: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    (eval_a, eval_b), (train_a, train_b) = out
    assert torch.equal(eval_a, eval_b), "eval() left dropout on"
    assert not torch.equal(train_a, train_b), "train() left dropout off"


def _freeze_later(env: Env) -> tuple[dict, dict]:
    env.step(0)
    env.model.unwrap().tok_emb.weight.requires_grad_(False)
    before = env.weights()
    for seed in (1, 2):
        env.step(seed)
    return before, env.weights()


def _frozen_stays(env: Env, result: tuple[dict, dict]) -> None:
    before, after = result
    assert torch.equal(before["tok_emb.weight"], after["tok_emb.weight"])
    assert (before["lm_head.weight"] - after["lm_head.weight"]).abs().max() > 0


def _unfreeze_later(env: Env) -> tuple[dict, dict]:
    env.step(0)
    env.model.unwrap().pos_emb.weight.requires_grad_(True)
    before = env.weights()
    env.step(1)
    return before, env.weights()


def _unfrozen_trains(env: Env, result: tuple[dict, dict]) -> None:
    before, after = result
    assert (before["pos_emb.weight"] - after["pos_emb.weight"]).abs().max() > 0


def _hooked_output(env: Env) -> tuple[torch.Tensor, torch.Tensor]:
    idx, _ = make_batch(env.config, 2, 8, seed=0)
    with torch.no_grad():
        plain = env.model(idx).clone()
        handle = env.model.unwrap().lm_head.register_forward_hook(lambda m, i, o: o * 0)
        hooked = env.model(idx).clone()
        handle.remove()
    return plain, hooked


def _hook_ran(env: Env, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    plain, hooked = out
    assert plain.abs().max() > 0 and hooked.abs().max() == 0


def _submodule_hook(env: Env) -> None:
    first = next(m for n, m in env.model.unwrap().named_modules() if n)
    first.register_forward_hook(lambda m, i, o: o)
    env.loss(0)


@torch.no_grad()
def _halve_in_place(env: Env) -> None:
    for p in env.model.unwrap().parameters():
        p.mul_(0.5)


def _write_in_place(env: Env) -> dict[str, torch.Tensor]:
    env.step(0)
    _halve_in_place(env)
    env.step(1)
    return env.weights()


def _as_torch_does(env: Env, got: dict[str, torch.Tensor]) -> None:
    ref = Env("torch", optimizer="sgd")
    assert _max_change(_write_in_place(ref), got) < 1e-6


def _write_before_the_write_back(env: Env) -> None:
    env.booster.backward(env.loss(0), env.opt)
    env.opt.step()  # the CPU updates are still to be written back
    env.opt.zero_grad()
    _halve_in_place(env)
    env.loss(1)  # forward: the write-back


def _replace_tensors(env: Env) -> dict[str, torch.Tensor]:
    """torch.nn.utils.vector_to_parameters between steps: ``p.data = t``
    (no version counter moves), as a flat-vector EMA, an evolution strategy
    or a model-soup script does."""
    env.step(0)
    params = list(env.model.unwrap().parameters())
    numel = sum(p.numel() for p in TinyGPT(CONFIG).parameters())  # Gemini's may be empty
    vec = 0.1 * torch.randn(numel, generator=torch.Generator().manual_seed(3))
    torch.nn.utils.vector_to_parameters(vec, params)
    env.step(1)
    return env.weights()


def _as_torch_replaces(env: Env, got: dict[str, torch.Tensor]) -> None:
    ref = Env("torch", optimizer="sgd")
    assert _max_change(_replace_tensors(ref), got) < 1e-6


def _parameters(env: Env) -> list[torch.Tensor]:
    return list(env.model.parameters())


def _every_parameter(env: Env, params: list[torch.Tensor]) -> None:
    want = sorted(p.numel() for p in TinyGPT(CONFIG).parameters())
    assert sorted(p.numel() for p in params) == want


def _as_adamw(env: Env) -> None:
    ref = Env("torch", optimizer="adamw")
    for seed in range(3):
        env.step(seed)
        ref.step(seed)
    assert _max_change(ref.weights(), env.weights()) < 1e-6


def _plugin(**kwargs) -> Callable[[Env], Any]:
    return lambda env: GeminiPlugin(**kwargs)


# -- the plugins' arguments -----------------------------------------------------------------


def _boost_with(plugin: str, **kwargs: Any) -> Callable[[Env], Env]:
    """The action: boosting with these plugin arguments (the row's env is the default)."""
    return lambda env: Env(plugin, plugin_kwargs=kwargs)


def _dtype_is(dtype: torch.dtype) -> Callable[[Env, Any], None]:
    def check(env: Env, _: Any) -> None:
        assert {p.dtype for p in env.model.unwrap().parameters()} == {dtype}
        before = env.weights()
        env.step(0)
        assert _max_change(before, env.weights()) > 0

    return check


def _more_buckets(env: Env, _: Any) -> None:
    assert len(env.opt.optim.buckets) > len(Env(env.kind).opt.optim.buckets) == 1


def _bf16_communication(env: Env, _: Any) -> None:
    ref = Env(env.kind, optimizer="sgd")
    for e in (env, ref):
        e.step(0)
    change = _max_change(ref.weights(), env.weights())
    assert 0 < change < 1e-3, change  # the gradients travelled in bf16


def _launched_in_backward(env: Env) -> bool:
    env.booster.backward(env.loss(0), env.opt)
    launched = any(b.launched for b in env.opt.optim.buckets)
    env.opt.step()
    return launched


def _reduced_at_step(env: Env, launched: bool) -> None:
    assert not launched
    assert _launched_in_backward(Env(env.kind)), "the default reduces during backward"


def _bf16_masters(env: Env, _: Any) -> None:
    assert {s.master.dtype for s in env.opt.optim.shards} == {torch.bfloat16}


def _logged_at_warning(plugin: str, **kwargs: Any) -> Callable[[Env], list[str]]:
    def act(env: Env) -> list[str]:
        records: list[logging.LogRecord] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append
        log = logging.getLogger("zerostack.booster")
        log.addHandler(handler)
        try:
            Env(plugin, plugin_kwargs=kwargs)
        finally:
            log.removeHandler(handler)
        return [r.getMessage() for r in records]

    return act


def _names_the_plugin(name: str) -> Callable[[Env, list[str]], None]:
    def check(env: Env, messages: list[str]) -> None:
        assert any(m.startswith(f"{name}:") for m in messages), messages

    return check


def _float_inputs(env: Env) -> Any:
    torch.manual_seed(0)
    plugin = LowLevelZeroPlugin(precision="bf16", cast_inputs=False)
    model, *_ = Booster(plugin=plugin).boost(torch.nn.Linear(4, 4))
    return model(torch.ones(2, 4))


def _scale_grew(env: Env, new: Env) -> None:
    scaler = new.opt.optim.scaler
    assert scaler.scale == 2.0**8
    new.step(0)
    assert scaler.scale == 2.0**10  # growth_factor 4 after growth_interval 1 clean step


def _chunk_size(env: Env, new: Env, size: int) -> None:
    assert {c.chunk_size for c in new.model.module.param_chunks} == {size}
    assert {c.chunk_size for c in env.model.module.param_chunks} != {size}


def _more_chunks(env: Env, new: Env) -> None:
    assert len(new.model.module.param_chunks) > len(env.model.module.param_chunks) == 1


def _cpu_step_inline(env: Env, new: Env) -> None:
    assert not new.opt.optim.pipeline.overlapping and env.opt.optim.pipeline.overlapping


# fmt: off
ROWS = [
    # -- the boosted optimizer -------------------------------------------------------------
    Row("step-closure", ALL, _closure_step, _closure_ran),
    Row("step-other-argument", SHARDED + AUTO, lambda env: env.opt.step(div_scale=2.0), error=TypeError, match=r"unexpected keyword argument 'div_scale'"),
    Row("param-groups-lr", ALL, _lr_zero, _unchanged),
    Row("param-groups-betas-eps-weight-decay", TORCH + SHARDED, _adam_hyperparameters_changed, _as_torchs_adamw, options=dict(optimizer="adamw")),
    Row("inference-mode-right-after-step", TORCH + SHARDED, _evaluations_right_after_step(torch.inference_mode), _as_torch_evaluates(torch.inference_mode), options=dict(optimizer="sgd")),
    Row("no-grad-right-after-step", TORCH + SHARDED, _evaluations_right_after_step(torch.no_grad), _as_torch_evaluates(torch.no_grad), options=dict(optimizer="sgd")),
    Row("autocast-around-forward", TORCH + SHARDED, _autocast_forward, _as_torch_autocasts, options=dict(optimizer="sgd")),
    Row("zero-grad-set-to-none-false", ALL, lambda env: None, _same_as_set_to_none),
    Row("grad-norm-logged-by-hand", TORCH, _grad_norm_by_hand, _is_torchs_grad_norm, options=dict(optimizer="sgd")),
    Row("grad-norm-logged-by-hand-refused", SHARDED + AUTO, _grad_norm_by_hand, error=RuntimeError, match=r"(ZeroOptimizer|GeminiDDP|AMPOptimizer): this parameter's gradient is reduced and sharded over the ranks, so param\.grad holds no values \(got aten\.linalg_vector_norm\.default on it, e\.g\. from torch\.nn\.utils\.clip_grad_norm_ or a gradient norm logged by hand\).*to log the gradient's total norm, optimizer\.clip_grad_by_norm\(float\('inf'\)\) returns it before step\(\)"),
    Row("grad-norm-read-with-clip-grad-by-norm-inf", ALL, _grad_norm_by_clip_inf, _is_torchs_grad_norm, options=dict(optimizer="sgd")),
    Row("add-param-group", TORCH, _add_group, _group_trains, options=dict(exclude=("tok_emb.weight",))),
    Row("add-param-group-foreign", TORCH, lambda env: env.opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]}), error=ValueError, match=r"TorchDDPOptimizer: the optimizer holds a parameter that is not the model's \(got shape \(3,\)\)"),
    Row("add-param-group-after-boost", SHARDED + AUTO, _add_group, error=NotImplementedError, match=r"add_param_group: adding a parameter group after boost is not supported \(got a group of 1 tensors\); .*build the optimizer with every group before booster\.boost"),
    Row("backward-retain-graph", TORCH + ("zero1", "zero2"), functools.partial(_two_backwards, retain=True), _as_one_backward(True), options=dict(optimizer="sgd")),
    Row("backward-retain-graph-refused", GEMINI + AUTO, lambda env: env.opt.backward(env.loss(0), retain_graph=True), error=NotImplementedError, match=r"backward: retain_graph=True is not supported \(got True\).*add the losses and call backward once"),
    Row("accumulate-without-no-sync", TORCH + ("zero1", "zero2", "zero2-offload", "zero2-offload-clip"), functools.partial(_two_backwards, retain=False), _as_one_backward(False), options=dict(optimizer="sgd")),
    Row("model-zero-grad-drops-a-backward", TORCH + ZERO + GEMINI, _dropped_by_the_model("boosted"), _as_the_second_backward_alone, options=dict(optimizer="sgd")),
    Row("module-zero-grad-drops-a-backward", TORCH + ZERO, _dropped_by_the_model("unwrap"), _as_the_second_backward_alone, options=dict(optimizer="sgd")),
    Row("evaluate-between-backward-and-step-gemini-accumulation", GEMINI, _evaluate_between_backward_and_step, _as_evaluated_before_the_backward, options=dict(optimizer="sgd", plugin_kwargs=dict(enable_gradient_accumulation=True))),
    Row("evaluate-between-backward-and-step-gemini", GEMINI, _evaluate_before_the_step, error=RuntimeError, match=r"an evaluation \(no gradients\) between a backward and its optimizer\.step\(\).*evaluate after optimizer\.step\(\)"),
    Row("step-the-optimizer-handed-to-boost", ZERO, _step_the_optimizer_handed_to_boost, error=RuntimeError, match=r"HybridAdam\.step: this optimizer was handed to ZeroOptimizer .*Step the optimizer booster\.boost returned"),
    Row("add-group-to-the-optimizer-handed-to-boost", ZERO, _add_group_to_the_optimizer_handed_to_boost, error=NotImplementedError, match=r"HybridAdam\.add_param_group: this optimizer was handed to ZeroOptimizer .*a group added now would never be stepped"),
    Row("add-group-to-the-optimizer-handed-to-boost-gemini", GEMINI, _add_group_to_the_optimizer_handed_to_boost, error=NotImplementedError, match=r"HybridAdam\.add_param_group: this optimizer was handed to GeminiOptimizer .*a group added now would never be stepped \(got a group of 1 tensors\)"),
    Row("step-the-optimizer-handed-to-boost-gemini", GEMINI, _step_the_optimizer_handed_to_boost, error=RuntimeError, match=r"HybridAdam: .*gradient holds no values \(got ShardedGradient\).*step the optimizer booster\.boost \(or the wrapper\) returned"),
    Row("optimizer-with-state-before-boost", TORCH, _boost_a_resumed_optimizer, _keeps_the_loaded_state),
    Row("optimizer-with-state-before-boost-refused", SHARDED, _boost_a_resumed_optimizer, error=ValueError, match=r"(Gemini|Zero)Optimizer: .*already has state.*got state for 10 tensors, from a step or optimizer\.load_state_dict before the wrap.*wrap a fresh optimizer \(booster\.boost\), then load the optimizer checkpoint into the wrapper \(booster\.load_optimizer"),
    Row("state-dict-of-the-optimizer-handed-to-boost", TORCH + ("zero1", "zero2"), _save_the_optimizer_handed_to_boost, _holds_the_states),
    Row("state-dict-of-the-optimizer-handed-to-boost-refused", ("zero2-offload", "zero2-offload-clip") + GEMINI, _save_the_optimizer_handed_to_boost, error=RuntimeError, match=r"HybridAdam\.state_dict: this optimizer was handed to (Zero|Gemini)Optimizer \(through booster\.boost or directly\), which steps its states in another object, so this one's would hold none of them .*booster\.save_optimizer\(optimizer, path\)"),
    Row("load-state-dict-of-the-optimizer-handed-to-boost-refused", ("zero2-offload", "zero2-offload-clip") + GEMINI, _load_into_the_optimizer_handed_to_boost, error=RuntimeError, match=r"HybridAdam\.load_state_dict: this optimizer was handed to (Zero|Gemini)Optimizer .*a state loaded here would never be read .*booster\.load_optimizer\(optimizer, path\)"),
    Row("accumulate-without-no-sync-gemini", GEMINI, functools.partial(_two_backwards, retain=False), error=RuntimeError, match=r"call optimizer\.step\(\) before the next forward \(to accumulate gradients over several batches, build with enable_gradient_accumulation=True, as ColossalAI's GeminiPlugin, .*no_sync\(\)"),
    Row("accumulate-without-no-sync-gemini-accumulation", GEMINI, functools.partial(_two_backwards, retain=False), _as_one_backward(False), options=dict(optimizer="sgd", plugin_kwargs=dict(enable_gradient_accumulation=True))),
    Row("zero-grad-between-forward-and-backward", TORCH + ZERO, _zero_grad_between_forward_and_backward, _as_the_second_backward_alone, options=dict(optimizer="sgd")),
    Row("zero-grad-between-forward-and-backward-gemini-accumulation", GEMINI, _zero_grad_between_forward_and_backward, _as_the_second_backward_alone, options=dict(optimizer="sgd", plugin_kwargs=dict(enable_gradient_accumulation=True))),
    # -- the boosted model -----------------------------------------------------------------
    Row("state-dict", ALL, _state_dict, _whole_and_named),
    Row("load-state-dict", ALL, _load_zeros, _all_zero),
    Row("load-state-dict-plain-keys", SHARDED + AUTO, _load_plain_keys, error=KeyError, match=r"load_state_dict: keys without the boosted model's 'module\.' prefix \(got \['blocks"),
    Row("load-state-dict-assign", SHARDED + AUTO, _load_assign, error=NotImplementedError, match=r"load_state_dict: assign=True would replace the parameters the plugin holds"),
    Row("to-same-device", ALL, _to_same_device, _trains),
    Row("to-float64", TORCH, _to_float64, _is_float64),
    Row("to-float64-refused", SHARDED + AUTO, _to_float64, error=NotImplementedError, match=r"moving or casting the boosted model \(to\(\), half\(\), .*\) is not supported \(got a torch\.(float32|bfloat16) tensor on cpu turned into torch\.float64 on cpu\)"),
    Row("half-refused", SHARDED + AUTO, lambda env: env.model.half(), error=NotImplementedError, match=r"into torch\.float16 on cpu\); \w+Plugin places the parameters.*precision=\.\.\."),
    Row("train-eval", TORCH + ZERO + GEMINI, _dropout_outputs, _eval_is_deterministic, options=dict(dropout=0.5)),
    Row("eval-refused", AUTO, lambda env: env.model.eval(), error=NotImplementedError, match=r"train\(False\): the graph was traced in training mode"),
    Row("freeze-after-boost", TORCH + SHARDED, _freeze_later, _frozen_stays),
    Row("unfreeze-after-boost", TORCH + ZERO, _unfreeze_later, _unfrozen_trains, options=dict(frozen=("pos_emb.weight",))),
    Row("unfreeze-after-boost-refused", GEMINI, _unfreeze_later, error=NotImplementedError, match=r"GeminiDDP: parameters frozen when the model was wrapped cannot be unfrozen \(got requires_grad=True on \['pos_emb\.weight'\]\).*before GeminiDDP \(or booster\.boost with GeminiPlugin\)", options=dict(frozen=("pos_emb.weight",))),
    Row("freeze-after-boost-refused", AUTO, _freeze_later, error=NotImplementedError, match=r"BaseOffloadModule\.forward: requires_grad changed after memory_optimize \(or booster\.boost with AutoOffloadPlugin\) planned which parameters train \(got tok_emb\.weight requires_grad=False\); set requires_grad before memory_optimize"),
    Row("unfreeze-after-boost-refused-auto", AUTO, _unfreeze_later, error=NotImplementedError, match=r"requires_grad changed after memory_optimize .*\(got pos_emb\.weight requires_grad=True\)", options=dict(frozen=("pos_emb.weight",))),
    Row("forward-hook", TORCH + SHARDED, _hooked_output, _hook_ran),
    Row("forward-hook-refused", AUTO, _submodule_hook, error=NotImplementedError, match=r"forward hooks on the traced module's submodules do not run under AutoOffloadPlugin \(got a hook on '\w+'\)"),
    Row("parameters", ALL, _parameters, _every_parameter),
    Row("write-parameters-in-place", TORCH + ZERO, _write_in_place, _as_torch_does, options=dict(optimizer="sgd")),
    Row("vector-to-parameters", TORCH + ZERO, _replace_tensors, _as_torch_replaces, options=dict(optimizer="sgd")),
    Row("vector-to-parameters-refused", GEMINI, _replace_tensors, error=RuntimeError, match=r"GeminiDDP: parameters given another tensor between steps \(p\.data = t, e\.g\. by torch\.nn\.utils\.vector_to_parameters\), which their chunks never see \(got \['tok_emb\.weight'.*Write in place under torch\.no_grad\(\) \(p\.copy_\(t\)\)", options=dict(optimizer="sgd")),
    Row("write-parameters-before-the-write-back", ("zero2-offload",), _write_before_the_write_back, warning=UserWarning, match=r"ZeroOptimizer: parameters written in place after their update of this step had started \(got \['"),
    Row("write-parameters-before-the-write-back-refused", ("gemini-offload",), _write_before_the_write_back, error=RuntimeError, match=r"GeminiDDP: \['tok_emb\.weight', .*\] \.\.\. was written between steps while its chunk was released .*optimizer\.wait_updates\(\)\), so the write did nothing"),
    Row("write-parameters-before-the-write-back-refused-gemini-accumulation", ("gemini-offload",), _write_before_the_write_back, error=RuntimeError, match=r"GeminiDDP: \['tok_emb\.weight', .*\] \.\.\. was written after optimizer\.step\(\) while its offloaded update was still running, so the update's write-back replaced the written values\. Call optimizer\.wait_updates\(\) after optimizer\.step\(\), then write the parameters", options=dict(plugin_kwargs=dict(enable_gradient_accumulation=True))),
    # -- the user's optimizer and the plugin's arguments ------------------------------------
    Row("torch-adam-decoupled-weight-decay", ("zero2-offload",), lambda env: None, lambda env, _: _as_adamw(env), options=dict(optimizer="adam-decoupled")),
    Row("gemini-search-with-chunk-config-dict", ("torch",), _plugin(chunk_config_dict={1: {"chunk_size": 1024}}, hidden_dim=64), warning=UserWarning, match=r"GeminiDDP: hidden_dim=64 has no effect with chunk_config_dict \(the chunk size is given, there is no search\)"),
    Row("zero-precision", ("zero2",), lambda env: None, _dtype_is(torch.bfloat16), options=dict(plugin_kwargs=dict(precision="bf16"))),
    Row("zero-reduce-bucket-size-in-m", ("zero2",), lambda env: None, _more_buckets, options=dict(plugin_kwargs=dict(reduce_bucket_size_in_m=0.001))),
    Row("zero-communication-dtype", ("zero2",), lambda env: None, _bf16_communication, options=dict(optimizer="sgd", plugin_kwargs=dict(communication_dtype=torch.bfloat16))),
    Row("zero-overlap-communication", ("zero2",), _launched_in_backward, _reduced_at_step, options=dict(plugin_kwargs=dict(overlap_communication=False))),
    Row("zero-master-weights", ("zero2",), lambda env: None, _bf16_masters, options=dict(plugin_kwargs=dict(precision="bf16", master_weights=False))),
    Row("zero-cast-inputs", TORCH, _float_inputs, error=RuntimeError, match=r"dtype"),
    Row("zero-scaler-arguments", TORCH, _boost_with("zero2", precision="fp16", initial_scale=2.0**8, growth_factor=4.0, growth_interval=1), _scale_grew),
    Row("zero-scaler-arguments-without-fp16", TORCH, _boost_with("zero2", initial_scale=2.0**8), warning=UserWarning, match=r"LowLevelZeroPlugin: the loss scaler's arguments have no effect with precision='fp32' \(got \['initial_scale'\]\)"),
    Row("zero-verbose", TORCH, _logged_at_warning("zero2", verbose=True), _names_the_plugin("LowLevelZeroPlugin")),
    Row("zero-overlap-allgather", TORCH, lambda env: LowLevelZeroPlugin(overlap_allgather=True), error=NotImplementedError, match=r"overlap_allgather=True is not implemented"),
    Row("zero-norm-type", TORCH, lambda env: LowLevelZeroPlugin(norm_type=1.0), error=NotImplementedError, match=r"only norm_type=2\.0 is implemented \(got 1\.0\)"),
    Row("gemini-precision", ("gemini",), lambda env: None, _dtype_is(torch.bfloat16), options=dict(plugin_kwargs=dict(precision="bf16"))),
    Row("gemini-chunk-config-dict", ("gemini",), _boost_with("gemini", chunk_config_dict={1: {"chunk_size": 4096}}), functools.partial(_chunk_size, size=4096)),
    Row("gemini-search-options", ("gemini",), _boost_with("gemini", search_range_m=0.001, min_chunk_size_m=0.001), _more_chunks),
    Row("gemini-hidden-dim", ("gemini",), _boost_with("gemini", search_range_m=0.001, min_chunk_size_m=0.001, hidden_dim=16), functools.partial(_chunk_size, size=2064)),
    Row("gemini-overlap-cpu-step", ("gemini-offload",), _boost_with("gemini-offload", overlap_cpu_step=False), _cpu_step_inline),
    Row("gemini-scaler-arguments", TORCH, _boost_with("gemini", precision="fp16", initial_scale=2.0**8, growth_factor=4.0, growth_interval=1), _scale_grew),
    Row("gemini-verbose", TORCH, _logged_at_warning("gemini", verbose=True), _names_the_plugin("GeminiPlugin")),
    Row("auto-offload-scaler-arguments-without-fp16", TORCH, _boost_with("auto-offload", initial_scale=2.0**8), warning=UserWarning, match=r"AMPOptimizer: the loss scaler has no effect without fp16 parameters"),
    Row("gemini-pin-memory-nothing-on-cpu", ("torch",), _plugin(pin_memory=True), warning=UserWarning, match=r"GeminiDDP: pin_memory=True has no effect: placement_policy='static' without offload_optim_frac or offload_param_frac keeps no chunk on the CPU"),
]
# fmt: on

CASES = [pytest.param(row, kind, id=f"{row.id}[{kind}]") for row in ROWS for kind in row.plugins]


@pytest.mark.parametrize(("row", "plugin"), CASES)
def test_user_action(row: Row, plugin: str) -> None:
    with one_torch_thread(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # one of ours unexpected fails the row
        env = Env(plugin, **row.options)
        if row.error is not None:
            with pytest.raises(row.error, match=row.match):
                row.act(env)
            return
        with pytest.warns(row.warning, match=row.match) if row.warning else _nothing():
            result = row.act(env)
        if row.effect is not None:
            row.effect(env, result)


@contextlib.contextmanager
def _nothing():
    yield


def test_the_rows_have_unique_ids() -> None:
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def _at_two_ranks(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    # A dataloader every rank reads whole.
    dataset = torch.utils.data.TensorDataset(torch.arange(8))
    with pytest.warns(UserWarning, match=r"the dataloader has no DistributedSampler \(got SequentialSampler\) at 2 ranks"):  # fmt: skip
        Booster(plugin=LowLevelZeroPlugin()).boost(TinyGPT(CONFIG), dataloader=torch.utils.data.DataLoader(dataset))  # fmt: skip
    plugin = LowLevelZeroPlugin()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Booster(plugin=plugin).boost(TinyGPT(CONFIG), dataloader=plugin.prepare_dataloader(dataset, 2))  # fmt: skip

    # Gemini's sharded parameters: unwrap().state_dict() refuses, state_dict() gathers.
    torch.manual_seed(0)
    plain = TinyGPT(CONFIG)
    whole = {k: v.clone() for k, v in plain.state_dict().items()}
    chunks = {world: {"chunk_size": 2048, "keep_gathered": False}}
    booster = Booster(plugin=GeminiPlugin(precision="fp32", chunk_config_dict=chunks))
    model, *_ = booster.boost(plain)
    with pytest.raises(RuntimeError, match=r"model\.unwrap\(\)\.state_dict\(\) would hold empty tensors \(got tok_emb\.weight of shape \(0,\)\)"):  # fmt: skip
        model.unwrap().state_dict()
    with pytest.raises(RuntimeError, match=r"would hold empty tensors \(got blocks\.0\."):
        model.unwrap().blocks[0].state_dict()  # a submodule's: it gave (0,) tensors
    state = model.state_dict()
    assert set(state) == {f"module.{k}" for k in whole}
    for k, v in whole.items():
        assert torch.equal(state[f"module.{k}"], v), k

    # TorchDDPPlugin's arguments reach torch's DistributedDataParallel.
    plugin = TorchDDPPlugin(
        broadcast_buffers=False, bucket_cap_mb=1, find_unused_parameters=True,
        gradient_as_bucket_view=True, static_graph=True,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own notes on these arguments
        ddp = Booster(plugin=plugin).boost(TinyGPT(CONFIG))[0].module
    assert ddp.find_unused_parameters and ddp.gradient_as_bucket_view and ddp.static_graph
    assert ddp.bucket_bytes_cap == 2**20
    assert getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)) is False

    # Two backward passes before step() under ZeRO-2: as torch DDP.
    got = {}
    for kind in ("ddp", "zero2"):
        torch.manual_seed(0)
        m = TinyGPT(CONFIG)
        made = TorchDDPPlugin() if kind == "ddp" else LowLevelZeroPlugin(stage=2, precision="fp32")
        booster = Booster(plugin=made)
        model, opt, *_ = booster.boost(m, torch.optim.SGD(m.parameters(), lr=0.1))
        for seed in (2 * rank, 2 * rank + 1):
            booster.backward(model(*make_batch(CONFIG, 2, 8, seed=seed)), opt)
        opt.step()
        got[kind] = {k: v.clone() for k, v in model.unwrap().state_dict().items()}
    for k, v in got["ddp"].items():
        torch.testing.assert_close(got["zero2"][k], v, rtol=0, atol=1e-6)


def test_at_two_ranks() -> None:
    spawn(_at_two_ranks, 2)


def test_gemini_refuses_a_copy_of_its_module():
    """``AveragedModel(model.unwrap())`` under GeminiPlugin deep-copied
    GeminiDDP's hooks with copies of the chunks: the EMA computed with the
    weights of the time of the copy (bitwise the untrained model's after
    training), silently. The copy raises, naming the way that works."""
    torch.manual_seed(0)
    net = TinyGPT(CONFIG)
    booster = Booster(plugin=GeminiPlugin(precision="fp32"))
    model, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"copy\.deepcopy of a module wrapped by GeminiDDP"):
        torch.optim.swa_utils.AveragedModel(model.unwrap())
    with pytest.raises(RuntimeError, match=r"update the copy from the boosted model's state_dict"):
        copy.deepcopy(model.unwrap().blocks[0])
    # torch.save(model) of a whole module: torch's "cannot pickle 'weakref.ReferenceType'".
    for module in (model.unwrap(), model, model.unwrap().blocks[0]):
        with pytest.raises(NotImplementedError, match=r"GeminiModel: pickling a module wrapped by GeminiDDP is not supported \(got torch\.save or pickle of GeminiPlugin's model\.unwrap\(\).*booster\.save_model\(model, path\)"):  # fmt: skip
            torch.save(module, io.BytesIO())


@pytest.mark.parametrize("placement", ["static", "auto"])
def test_gemini_parameters_never_show_gradients_between_backward_and_write_back(placement):
    """One rank, kept-gathered chunks (gradients written over the
    parameters): from backward until the next forward writes the step's
    values back, a Gemini parameter read through the model is empty (as
    when sharded at several ranks), never the gradient; unwrap().state_dict()
    refuses; the next forward's parameters are torch's after the step."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 16), torch.randn(8, 1)

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    tol = 3 * 16 * torch.finfo(torch.float32).eps  # 3 fp32 Adam steps, a few ulp each
    where = {"offload_optim_frac": 1.0} if placement == "static" else {"gpu_capacity_bytes": 4000}
    plugin = GeminiPlugin(precision="fp32", placement_policy=placement, **where)
    plain = build()
    model, opt, *_ = Booster(plugin=plugin).boost(
        plain, torch.optim.AdamW(plain.parameters(), lr=1e-2)
    )
    ref_before: list[torch.Tensor] = []
    for step in range(3):
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        out = model(x)
        if step:  # the last step's values, written back by this forward
            for p, q in zip(plain.parameters(), ref_before, strict=True):
                torch.testing.assert_close(p.detach(), q, rtol=0, atol=tol)
        opt.backward(F.mse_loss(out, y))
        opt.step()
        ref_before = [p.detach().clone() for p in ref.parameters()]
        assert model.module.offloaded_masters, "chunks stepped on the CPU"
        assert all(p.numel() == 0 for p in plain.parameters()), "no gradient shows as a parameter"
        with pytest.raises(RuntimeError, match=r"hold no values from a backward until the next forward"):  # fmt: skip
            model.unwrap().state_dict()
        state = model.state_dict()  # gathers from the masters
        for (name, v), q in zip(state.items(), ref_before, strict=True):
            torch.testing.assert_close(v, q, rtol=0, atol=tol, msg=name)


@pytest.mark.parametrize("plugin", ["zero-offload", "gemini-offload"])
def test_wait_updates_puts_the_steps_values_in_the_parameters(plugin):
    """Read right after step() (an EMA), the parameters of an overlapped CPU
    step are not yet the step's (ZeRO: the values before it; Gemini at one
    rank: empty); the boosted optimizer's wait_updates() writes them back."""
    torch.manual_seed(1)
    x = torch.randn(8, 16)

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref(x).square().mean().backward()
    ref_opt.step()
    if plugin == "zero-offload":
        chosen = LowLevelZeroPlugin(stage=2, precision="fp32", cpu_offload=True)
    else:
        chosen = GeminiPlugin(precision="fp32", offload_optim_frac=1.0)
    plain = build()
    before = [p.detach().clone() for p in plain.parameters()]
    booster = Booster(plugin=chosen)
    model, opt, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    booster.backward(model(x).square().mean(), opt)
    opt.step()
    for p, b in zip(plain.parameters(), before, strict=True):  # not the step's yet
        assert p.numel() == 0 if plugin == "gemini-offload" else torch.equal(p, b)
    opt.wait_updates()
    tol = 16 * torch.finfo(torch.float32).eps  # one fp32 Adam step
    for p, q in zip(plain.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=tol)
