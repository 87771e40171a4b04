"""Gradient clipping the way users write it: ``booster.clip_grad_norm_`` (and
the optimizer's ``clip_grad_by_norm``) against DDP + torch's
``clip_grad_norm_`` step by step (gloo, 1 and 2 ranks; SGD, which unlike
Adam moves with the gradient's scale), every plugin and placement; torch's
own clip on a boosted model's parameters raises instead of returning 0.0;
norms accumulate in fp32 in bf16 and fp16; misuse is refused. See
zerostack.shard's [Note: gradient clipping] and [Note: sharded param.grad]."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.booster import Booster, GeminiModel, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from zerostack.chunk import all_gather_into
from zerostack.fused_adam import HybridAdam
from zerostack.gemini._optimizer import _grad_share
from zerostack.shard import ShardedGradient
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)
STEPS = 4
CHUNKS = {"chunk_size": 6_000, "keep_gathered": False}
TOL32 = dict(rtol=1e-5, atol=5e-6)
# Norms from pieces summed in another order than torch's: fp32 rounding. A
# norm rounded to bf16 (spacing 2**-8 = 3.9e-3 relative) or fp16 (9.8e-4) is far off.
NORM_RTOL = 1e-5
TORCH_CLIP_MATCH = r"booster\.clip_grad_norm_\(model, optimizer, max_norm\)"


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    name: str
    plugin: str | None  # "ddp", "zero", "gemini" or None (no plugin)
    kind: str = "sgd"  # sgd, adamw, hybrid (HybridAdam), hybrid-nvme
    max_norm: float = 0.3  # the explicit clip's; TinyGPT's 2-norm starts near 1.2
    norm_type: float = 2.0
    second: float = 0.0  # a second explicit clip in the same step, to this
    plugin_max_norm: float = 0.0  # the plugin's clipping at step, after the explicit one
    clip_from: int = 0  # the first step that clips (a script that starts clipping later)
    kwargs: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case(name="ddp", plugin="ddp"),
    Case(name="no-plugin-inf", plugin=None, norm_type=math.inf, max_norm=0.03),
    Case(name="zero1", plugin="zero", kwargs=dict(stage=1)),
    Case(name="zero2", plugin="zero", kwargs=dict(stage=2)),
    Case(name="zero2-no-overlap", plugin="zero", kwargs=dict(stage=2, overlap_communication=False)),
    Case(name="zero2-offload", plugin="zero", kwargs=dict(stage=2, cpu_offload=True)),
    # Unclipped steps first: no CPU update may have begun before the clip.
    Case(name="zero2-offload-late-clip", plugin="zero", clip_from=2,
         kwargs=dict(stage=2, cpu_offload=True)),
    # CPUAdam takes the clip as div_scale; Adam barely moves with a gradient's
    # scale, so SGD carries the parity and this the kernel's path.
    Case(name="zero1-offload-adamw", plugin="zero", kind="adamw",
         kwargs=dict(stage=1, cpu_offload=True)),
    Case(name="zero2-inf", plugin="zero", norm_type=math.inf, max_norm=0.03,
         kwargs=dict(stage=2)),
    Case(name="zero1-l1", plugin="zero", norm_type=1.0, max_norm=40.0, kwargs=dict(stage=1)),
    Case(name="zero2-and-plugin-max-norm", plugin="zero", plugin_max_norm=0.2,
         kwargs=dict(stage=2)),
    Case(name="zero2-two-calls", plugin="zero", second=0.1, kwargs=dict(stage=2)),
    Case(name="gemini", plugin="gemini"),
    Case(name="gemini-kept-gathered", plugin="gemini", kwargs=dict(shard_param_frac=0.0)),
    Case(name="gemini-cpu-step", plugin="gemini", kwargs=dict(offload_optim_frac=1.0)),
    Case(name="gemini-cpu-step-late-clip", plugin="gemini", clip_from=2,
         kwargs=dict(offload_optim_frac=1.0)),
    Case(name="gemini-params-on-cpu", plugin="gemini",
         kwargs=dict(offload_optim_frac=1.0, offload_param_frac=1.0)),
    Case(name="gemini-nvme", plugin="gemini", kind="hybrid-nvme",
         kwargs=dict(offload_optim_frac=1.0)),
    Case(name="gemini-auto", plugin="gemini",
         kwargs=dict(placement_policy="auto", gpu_capacity_bytes=10**6)),
    Case(name="gemini-inf", plugin="gemini", norm_type=math.inf, max_norm=0.03),
    Case(name="gemini-and-plugin-max-norm", plugin="gemini", plugin_max_norm=0.2,
         kwargs=dict(offload_optim_frac=0.5)),
    Case(name="gemini-two-calls", plugin="gemini", second=0.1),
]  # fmt: skip


def _optimizer(kind, params, tmp=None):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.01)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
    if kind == "hybrid":
        return HybridAdam(params, lr=1e-2, weight_decay=0.1)
    return HybridAdam(
        params, lr=1e-2, weight_decay=0.1, nvme_offload_fraction=1.0, nvme_offload_dir=tmp
    )


def _plugin(case, world):
    if case.plugin == "ddp":
        return TorchDDPPlugin()
    if case.plugin == "zero":
        return LowLevelZeroPlugin(
            precision="fp32", max_norm=case.plugin_max_norm, reduce_bucket_size_in_m=0.02,
            **case.kwargs,
        )  # fmt: skip
    if case.plugin == "gemini":
        return GeminiPlugin(
            precision="fp32", max_norm=case.plugin_max_norm, chunk_config_dict={world: CHUNKS},
            **case.kwargs,
        )  # fmt: skip
    return None


def _torch_clip_raises(model):
    """torch's clip on the boosted model's parameters fails loudly (it used
    to return 0.0 and clip nothing)."""
    for params in (model.unwrap().parameters(), model.parameters()):
        with pytest.raises(RuntimeError, match=TORCH_CLIP_MATCH) as error:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        assert "max_norm" in str(error.value)
    with pytest.raises(RuntimeError, match=TORCH_CLIP_MATCH):
        torch.nn.utils.clip_grad_norm_(model.unwrap().parameters(), 1.0, foreach=True)
    with pytest.raises(RuntimeError, match=TORCH_CLIP_MATCH):
        torch.nn.utils.clip_grad_value_(model.unwrap().parameters(), 1.0)


def _run_case(rank, world, case, tmp):
    torch.manual_seed(0)
    ref_model = TinyGPT(CONFIG)
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model)
    ref_opt = _optimizer("adamw" if case.kind != "sgd" else "sgd", ref.parameters())
    booster = Booster(plugin=_plugin(case, world)) if case.plugin else Booster(device="cpu")
    model, opt, *_ = booster.boost(model, _optimizer(case.kind, model.parameters(), tmp))
    p = case.norm_type
    for step in range(STEPS):
        where = f"{case.name} step {step}"
        idx, tgt = make_batch(CONFIG, 4, 16, seed=1000 * step + rank)
        ref_loss = lm_loss(ref(idx), tgt)
        ref_loss.backward()
        clips = step >= case.clip_from
        if clips:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), case.max_norm, p)
            assert ref_norm > case.max_norm, f"{where}: nothing to clip, the test proves nothing"
        if case.second:
            ref_second = torch.nn.utils.clip_grad_norm_(ref.parameters(), case.second, p)
        if case.plugin_max_norm:
            left = torch.nn.utils.clip_grad_norm_(ref.parameters(), case.plugin_max_norm)
            assert left > case.plugin_max_norm, f"{where}: the plugin's clip would do nothing"
        ref_opt.step()
        ref_opt.zero_grad()

        loss = lm_loss(model(idx), tgt)
        booster.backward(loss, opt)
        if case.plugin in ("zero", "gemini") and step == 0:
            _torch_clip_raises(model)
        if clips:
            norm = booster.clip_grad_norm_(model, opt, case.max_norm, norm_type=p)
            assert norm.dtype == torch.float32 and norm.dim() == 0, where
            torch.testing.assert_close(norm, ref_norm, rtol=NORM_RTOL, atol=0, msg=where)
        if case.second:
            second = opt.clip_grad_by_norm(case.second, p)  # ColossalAI's name
            torch.testing.assert_close(second, ref_second, rtol=NORM_RTOL, atol=0, msg=where)
        assert opt.step() is not False, f"{where}: skipped"
        opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, **TOL32, msg=lambda m, w=where: f"{w}: {m}")
        full = model.full_state_dict(only_rank_0=False)
        for name, value in ref.module.state_dict().items():
            torch.testing.assert_close(
                full[name], value, **TOL32, msg=lambda m, n=name, w=where: f"{w} {n}: {m}"
            )


def _all(rank, world, cases, tmp):
    torch.set_num_threads(1)  # tiny tensors, a busy machine: threads only spin
    for case in cases:
        _run_case(rank, world, case, f"{tmp}/{case.name}-{rank}")


@pytest.mark.parametrize("world_size", [1, 2])
def test_clip_matches_ddp_and_torch_clip_step_by_step(world_size, tmp_path):
    spawn(_all, world_size, args=(CASES, str(tmp_path)), backend="gloo", timeout_s=600)


# -- norms in fp32: the plugins' gradients, gathered whole, against torch's ------------

LOW = [
    ("zero2-bf16", "zero", dict(stage=2, precision="bf16")),
    # CPUAdam reads the bf16 pieces on the host as they are.
    ("zero1-bf16-offload", "zero", dict(stage=1, precision="bf16", cpu_offload=True)),
    ("zero2-fp16", "zero", dict(stage=2, precision="fp16", initial_scale=2**8)),
    ("gemini-bf16", "gemini", dict(precision="bf16")),
    ("gemini-bf16-cpu", "gemini", dict(precision="bf16", offload_optim_frac=1.0)),
    ("gemini-fp16", "gemini", dict(precision="fp16", initial_scale=2**8)),
]


def _whole(piece: torch.Tensor, numel: int, group=None) -> torch.Tensor:
    piece = piece.detach().float().reshape(-1)
    world = dist.get_world_size(group)
    out = torch.empty(world * piece.numel())
    all_gather_into(out, piece, group)
    return out[:numel]


def _gathered_grads(opt) -> list[torch.Tensor]:
    """The plugin's reduced gradients, whole and in fp32 (unscaled), from
    every rank's pieces: what a DDP reference with fp32 gradients of the
    same values would hold."""
    inner = opt.optim
    scale = inner.scaler.scale if inner.scaler is not None else 1.0
    if hasattr(inner, "shards"):  # ZeroOptimizer
        return [_whole(s.grad, s.param.numel(), inner.group) / scale for s in inner.shards]
    return [
        _whole(_grad_share(chunk), chunk.chunk_size, chunk.process_group) / scale
        for chunk, _ in inner.pairs
    ]


def _low_precision(rank, world, cases):
    torch.set_num_threads(1)
    for name, plugin, kwargs in cases:
        torch.manual_seed(0)
        model = TinyGPT(CONFIG)
        if plugin == "zero":
            plugin_obj = LowLevelZeroPlugin(reduce_bucket_size_in_m=0.02, **kwargs)
        else:
            plugin_obj = GeminiPlugin(chunk_config_dict={world: CHUNKS}, **kwargs)
        booster = Booster(plugin=plugin_obj)
        opt = HybridAdam(model.parameters(), lr=1e-3)
        model, opt, *_ = booster.boost(model, opt)
        for step in range(3):
            where = f"{name} step {step}"
            idx, tgt = make_batch(CONFIG, 4, 16, seed=100 * step + rank)
            booster.backward(lm_loss(model(idx), tgt), opt)
            # max_norm inf reads the norm only (the first call also finishes the reduction).
            got = {
                p: booster.clip_grad_norm_(model, opt, math.inf, norm_type=p) for p in (2, "inf")
            }
            grads = _gathered_grads(opt)
            for p, norm in got.items():
                expected = torch.nn.utils.get_total_norm(grads, float(p))
                torch.testing.assert_close(norm, expected, rtol=NORM_RTOL, atol=0, msg=where)
            assert opt.step() is not False, f"{where}: skipped"
            opt.zero_grad()
            # The step's own norm (for the plugin's max_norm) is fp32 too.
            expected = torch.nn.utils.get_total_norm(grads, 2.0).item()
            assert opt.optim.last_grad_norm == pytest.approx(expected, rel=NORM_RTOL), where


@pytest.mark.parametrize("world_size", [1, 2])
def test_norms_accumulate_in_fp32_in_bf16_and_fp16(world_size):
    spawn(_low_precision, world_size, args=(LOW,), backend="gloo", timeout_s=300)


def test_gemini_bf16_norms_are_not_rounded_to_bf16():
    # The symptom before: every one of the step's global norms was a
    # bf16-representable value (each chunk's norm rounded to bf16 on the way;
    # here one chunk holds the whole model, as the chunk search picks for a
    # small one).
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    one_chunk = {1: {"chunk_size": 2**16, "keep_gathered": False}}
    booster = Booster(plugin=GeminiPlugin(precision="bf16", chunk_config_dict=one_chunk))
    model, opt, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-3))
    norms = []
    with _one_thread():
        for step in range(24):
            idx, tgt = make_batch(CONFIG, 2, 16, seed=step)
            booster.backward(lm_loss(model(idx), tgt), opt)
            norms.append(booster.clip_grad_norm_(model, opt, 1.0).item())
            opt.step()
            norms.append(opt.optim.last_grad_norm)
            opt.zero_grad()
    representable = [n for n in norms if float(torch.tensor(n).bfloat16()) == n]
    # A fp32 value is bf16-representable once in 2**16 by chance.
    assert len(representable) <= 2, representable


# -- misuse fails loudly, and the guard on param.grad stays out of the way ---------------


class _one_thread:
    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def _boosted(plugin, **opt_kwargs):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1, **opt_kwargs))
    return booster, model, opt


def _backward(booster, model, opt, seed=0):
    idx, tgt = make_batch(CONFIG, 2, 16, seed=seed)
    booster.backward(lm_loss(model(idx), tgt), opt)


@pytest.mark.parametrize(
    "plugin",
    [
        lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
        lambda: LowLevelZeroPlugin(stage=1, precision="bf16", overlap_communication=False),
        lambda: GeminiPlugin(precision="bf16", chunk_config_dict={1: CHUNKS}),
    ],
    ids=["zero2", "zero1-no-overlap", "gemini"],
)
def test_param_grad_is_guarded_and_zero_grad_still_works(plugin):
    with _one_thread():
        booster, model, opt = _boosted(plugin())
        _backward(booster, model, opt)
        params = list(model.unwrap().parameters())
        assert all(isinstance(p.grad, ShardedGradient) for p in params)
        assert "ShardedGradient(shape=" in repr(params[0].grad)
        with pytest.raises(RuntimeError, match=TORCH_CLIP_MATCH):
            params[0].grad.norm()  # any read: a per-parameter norm too
        model.zero_grad(set_to_none=False)
        if isinstance(model, GeminiModel):
            # GeminiModel.zero_grad drops the batch, as optimizer.zero_grad()
            # does (GeminiDDP's recovery after an exception): no guard left.
            assert all(p.grad is None for p in params)
        else:  # nn.Module's: zero_() on the guards
            assert all(isinstance(p.grad, ShardedGradient) for p in params)
        opt.step()
        assert all(p.grad is None for p in params)  # the step clears them
        before = model.full_state_dict(only_rank_0=False)  # gemini's params are chunk views
        _backward(booster, model, opt, seed=1)
        assert opt.step() is not False
        after = model.full_state_dict(only_rank_0=False)
        assert any(not torch.equal(before[k], after[k]) for k in before)
        for set_to_none in (True, False):
            _backward(booster, model, opt, seed=2)
            model.zero_grad(set_to_none=set_to_none)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)


def test_zero_backward_twice_before_the_step_accumulates_through_the_guard():
    # A second backward before the step (torch's accumulation, no no_sync):
    # autograd adds into the guard, whose content is reduced again.
    with _one_thread():
        torch.manual_seed(0)
        ref = TinyGPT(CONFIG)
        twice = copy.deepcopy(ref)
        booster, model, opt = _boosted(LowLevelZeroPlugin(stage=2, precision="fp32"))
        for seed in (0, 1):
            _backward(booster, model, opt, seed)
            idx, tgt = make_batch(CONFIG, 2, 16, seed=seed)
            lm_loss(twice(idx), tgt).backward()
        expected = torch.nn.utils.clip_grad_norm_(twice.parameters(), 0.3)
        got = booster.clip_grad_norm_(model, opt, 0.3)
        torch.testing.assert_close(got, expected, rtol=NORM_RTOL, atol=0)


def test_clip_refuses_what_it_cannot_do_exactly():
    with _one_thread():
        # ZeRO: inside no_sync (nothing reduced yet), and a backward after the clip.
        booster, model, opt = _boosted(LowLevelZeroPlugin(stage=2, precision="fp32"))
        with booster.no_sync(model, opt):
            _backward(booster, model, opt)
            with pytest.raises(RuntimeError, match=r"clip_grad_by_norm: called inside no_sync"):
                booster.clip_grad_norm_(model, opt, 1.0)
        _backward(booster, model, opt, seed=1)
        booster.clip_grad_norm_(model, opt, 1.0)
        with pytest.raises(RuntimeError, match=r"a backward after clip_grad_by_norm\(\)"):
            _backward(booster, model, opt, seed=2)
        opt.zero_grad()  # drops the step: training goes on
        _backward(booster, model, opt, seed=3)
        booster.clip_grad_norm_(model, opt, 1.0)
        assert opt.step()
        # Gemini: no backward to clip.
        booster, model, opt = _boosted(
            GeminiPlugin(precision="fp32", chunk_config_dict={1: CHUNKS})
        )
        with pytest.raises(
            RuntimeError, match=r"the model is in state IDLE; clip after a backward"
        ):
            booster.clip_grad_norm_(model, opt, 1.0)


def test_ddp_fp16_unscales_once_then_clips():
    # torch's recipe: scaler.unscale_ then clip_grad_norm_; step does not unscale again.
    with _one_thread():
        torch.manual_seed(0)
        ref = TinyGPT(CONFIG)
        model = copy.deepcopy(ref)
        booster = Booster(device="cpu", mixed_precision="fp16")
        model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.5))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
        booster.backward(lm_loss(model(idx), tgt), opt)
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = lm_loss(ref(idx), tgt)
        ref_loss.backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        got = booster.clip_grad_norm_(model, opt, 0.3)
        again = opt.clip_grad_by_norm(math.inf)  # unscaled once only: the clipped norm
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=0)
        torch.testing.assert_close(again, torch.tensor(0.3), rtol=1e-4, atol=0)
        opt.step()
        ref_opt.step()
        for a, b in zip(model.unwrap().parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_clip_by_value_clamps_as_torch_and_sharded_plugins_refuse():
    # ColossalAI's OptimizerWrapper.clip_grad_by_value: torch's clip_grad_value_
    # on the gradients of the coming step (fp16: unscaled first); the plugins
    # whose gradients are sharded refuse, as ColossalAI's Gemini does.
    with _one_thread():
        for precision in ("fp32", "fp16"):
            torch.manual_seed(0)
            ref = TinyGPT(CONFIG)
            model = copy.deepcopy(ref)
            booster = Booster(
                device="cpu", mixed_precision=None if precision == "fp32" else precision
            )
            model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.5))
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
            idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
            booster.backward(lm_loss(model(idx), tgt), opt)
            with torch.autocast("cpu", dtype=torch.float16, enabled=precision == "fp16"):
                ref_loss = lm_loss(ref(idx), tgt)
            ref_loss.backward()
            assert max(p.grad.abs().max().item() for p in ref.parameters()) > 2e-3
            torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
            opt.clip_grad_by_value(1e-3)
            grads = [p.grad for p in model.unwrap().parameters() if p.grad is not None]
            assert max(g.abs().max().item() for g in grads) <= 1e-3 * (1 + torch.finfo().eps)
            opt.step()
            ref_opt.step()
            for a, b in zip(model.unwrap().parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
        with pytest.raises(
            ValueError, match=r"clip_grad_by_value: clip_value must be > 0 \(got 0\)"
        ):
            opt.clip_grad_by_value(0)
        for plugin in (
            LowLevelZeroPlugin(stage=2, precision="fp32"),
            GeminiPlugin(precision="fp32", chunk_config_dict={1: CHUNKS}),
        ):
            booster, model, opt = _boosted(plugin)
            _backward(booster, model, opt)
            with pytest.raises(NotImplementedError, match=r"clip_grad_by_value: clipping by value is "
                               r"not supported by this plugin.*\(got clip_value=1\.0\); clip by norm"):  # fmt: skip
                opt.clip_grad_by_value(1.0)
