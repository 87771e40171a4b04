"""Gradient clipping on a CUDA device (one rank): ``booster.clip_grad_norm_``,
the optimizer's ``clip_grad_by_norm`` (ColossalAI's name) and the plugins'
``max_norm`` against plain torch on the same device with torch's
``clip_grad_norm_``, step by step. LowLevelZeroPlugin at stages 1 and 2
with ``cpu_offload=True`` (``overlap_communication`` on and off);
GeminiPlugin with ``placement_policy="static", offload_optim_frac=1.0``
(``overlap_cpu_step`` on and off), ``"auto"`` (room for everything, and a
capacity that sends masters to the host) and its defaults; fp32 and bf16;
torch's AdamW, and SGD and Adam with L2 weight decay, which unlike AdamW
move with the gradient's scale. Every step clips (torch's norm is over
twice ``max_norm``), the returned norm is torch's to fp32 rounding, and a
reference run without clipping is shown to be out of each case's tolerance,
so a clip that did nothing would fail. Where there is no CUDA device the
same cases run on the CPU. See zerostack.shard's [Note: gradient clipping]."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_booster_clip import NORM_RTOL

from zerostack.booster import Booster, GeminiPlugin, LowLevelZeroPlugin
from zerostack.fused_adam import HybridAdam
from zerostack.gemini._optimizer import _grad_share
from zerostack.testing import (
    assert_close,
    loss_tolerance,
    spawn,
    tolerance,
    training_tolerance,
)

STEPS = 6
BATCH, DIM_IN, HIDDEN, DIM_OUT = 16, 64, 256, 32
# The model's gradient 2-norm stays near 0.25 over the steps: every step
# clips, to a tenth or less.
MAX_NORM = 0.02
LR = {"sgd": 0.5, "adamw": 1e-3, "adam-l2": 1e-3}
MOMENTUM = 0.9
WEIGHT_DECAY = 0.1
# Adam's eps (torch's default 1e-8) bounds how far one rounding of a
# gradient element can move an update: by lr * |dg| / eps where the element
# is near 0 (Adam L2: the clipped gradient cancelling the decay term, seen
# at 1.9e-8). The host's kernel and the device's differ by such roundings;
# with eps 1e-6 and lr 1e-3, a few ulps (1e-10) of the largest clipped
# gradient element move an update by 1e-7 at most, a tenth of the fp32
# tolerance (on the CPU the worst element came to 1% of it).
ADAM_EPS = 1e-6
# Roundings in sequence from a parameter to its gradient in bf16: about two
# per layer (three Linear, two GELU).
DEPTH = 2 * 5
# Three chunks: the first Linear, the second, the third.
CHUNKS = {"chunk_size": 70_000, "keep_gathered": False}


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    name: str
    plugin: str  # "zero" or "gemini"
    precision: str = "fp32"  # or "bf16"
    optimizer: str = "sgd"  # "sgd", "adamw" or "adam-l2" (Adam, L2 weight decay)
    # "booster": booster.clip_grad_norm_; "optimizer": optimizer.clip_grad_by_norm;
    # "plugin": the plugin's max_norm (clipping at step).
    clip: str = "booster"
    # gemini: "host" (static, offload_optim_frac=1.0), "auto" (room for
    # everything), "auto-evicting" (a capacity that holds every parameter but
    # only part of the masters and states) or "default" (GeminiPlugin's own).
    placement: str = ""
    torch_adam: bool = False  # gemini: the user's torch Adam/AdamW instead of HybridAdam
    kwargs: dict[str, Any] = field(default_factory=dict)  # more plugin arguments


Z1, Z2 = dict(stage=1, cpu_offload=True), dict(stage=2, cpu_offload=True)
NO_OVERLAP = dict(overlap_communication=False)

CASES = [
    # LowLevelZeroPlugin, masters and states on the host (Adam through CPUAdam).
    Case(name="zero1-adamw", plugin="zero", optimizer="adamw", kwargs=Z1),
    Case(name="zero1-sgd-clip_grad_by_norm", plugin="zero", clip="optimizer", kwargs=Z1),
    Case(name="zero1-adam-l2-no-overlap", plugin="zero", optimizer="adam-l2",
         kwargs=dict(**Z1, **NO_OVERLAP)),
    Case(name="zero1-sgd-max-norm", plugin="zero", clip="plugin", kwargs=Z1),
    Case(name="zero2-sgd", plugin="zero", kwargs=Z2),
    Case(name="zero2-adam-l2", plugin="zero", optimizer="adam-l2", kwargs=Z2),
    Case(name="zero2-adamw-no-overlap", plugin="zero", optimizer="adamw",
         kwargs=dict(**Z2, **NO_OVERLAP)),
    Case(name="zero2-adam-l2-max-norm", plugin="zero", optimizer="adam-l2", clip="plugin",
         kwargs=Z2),
    Case(name="zero2-sgd-no-overlap-max-norm", plugin="zero", clip="plugin",
         kwargs=dict(**Z2, **NO_OVERLAP)),
    Case(name="zero2-bf16-sgd", plugin="zero", precision="bf16", kwargs=Z2),
    Case(name="zero1-bf16-sgd-max-norm", plugin="zero", precision="bf16", clip="plugin",
         kwargs=Z1),
    Case(name="zero2-bf16-adamw", plugin="zero", precision="bf16", optimizer="adamw",
         clip="optimizer", kwargs=Z2),
    # GeminiPlugin, masters and states on the host.
    Case(name="gemini-host-adamw", plugin="gemini", optimizer="adamw", placement="host"),
    Case(name="gemini-host-torch-adamw", plugin="gemini", optimizer="adamw", torch_adam=True,
         clip="optimizer", placement="host"),
    Case(name="gemini-host-adam-l2", plugin="gemini", optimizer="adam-l2", placement="host"),
    Case(name="gemini-host-sgd-clip_grad_by_norm", plugin="gemini", clip="optimizer",
         placement="host"),
    Case(name="gemini-host-sgd-max-norm", plugin="gemini", clip="plugin", placement="host"),
    Case(name="gemini-host-adam-l2-max-norm", plugin="gemini", optimizer="adam-l2",
         clip="plugin", placement="host"),
    Case(name="gemini-host-adam-l2-no-overlap", plugin="gemini", optimizer="adam-l2",
         placement="host", kwargs=dict(overlap_cpu_step=False)),
    Case(name="gemini-host-bf16-sgd", plugin="gemini", precision="bf16", placement="host"),
    Case(name="gemini-host-bf16-adamw", plugin="gemini", precision="bf16", optimizer="adamw",
         placement="host"),
    Case(name="gemini-auto-adam-l2", plugin="gemini", optimizer="adam-l2", placement="auto"),
    Case(name="gemini-auto-evicting-sgd", plugin="gemini", placement="auto-evicting"),
    Case(name="gemini-auto-evicting-adam-l2-max-norm", plugin="gemini", optimizer="adam-l2",
         clip="plugin", placement="auto-evicting"),
    Case(name="gemini-auto-evicting-bf16-sgd", plugin="gemini", precision="bf16",
         placement="auto-evicting"),
    # Static, everything on the compute device, the chunk size searched.
    Case(name="gemini-default-adamw", plugin="gemini", optimizer="adamw", placement="default"),
    Case(name="gemini-default-adam-l2", plugin="gemini", optimizer="adam-l2", clip="optimizer",
         placement="default"),
    Case(name="gemini-default-sgd-max-norm", plugin="gemini", clip="plugin",
         placement="default"),
    Case(name="gemini-default-bf16-sgd", plugin="gemini", precision="bf16",
         placement="default"),
]  # fmt: skip


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(DIM_IN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, DIM_OUT),
    )


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, DIM_IN, generator=gen)
    return x.to(device), torch.randn(BATCH, DIM_OUT, generator=gen).to(device)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target)


def _torch_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=LR[kind], momentum=MOMENTUM)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR[kind], eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)
    return torch.optim.Adam(params, lr=LR[kind], eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)


def _optimizer(case: Case, params) -> torch.optim.Optimizer:
    """What the user hands the booster: torch's (ZeRO's cpu_offload steps
    Adam and AdamW through CPUAdam), HybridAdam for Gemini's Adam cases."""
    if case.plugin == "gemini" and case.optimizer != "sgd" and not case.torch_adam:
        adamw = case.optimizer == "adamw"
        return HybridAdam(
            params, lr=LR[case.optimizer], eps=ADAM_EPS, weight_decay=WEIGHT_DECAY,
            adamw_mode=adamw,
        )  # fmt: skip
    return _torch_optimizer(case.optimizer, params)


def _capacity(model: torch.nn.Module, precision: str) -> int:
    """Parameters + three gathered chunks + 20 bytes an element of one
    chunk (its master and Adam states take 12): "auto" keeps one or two of
    the three masters on the device (measured on the CPU), the others on
    the host."""
    n = sum(p.numel() for p in model.parameters())
    item = 2 if precision == "bf16" else 4
    return n * item + 3 * CHUNKS["chunk_size"] * item + CHUNKS["chunk_size"] * 20


def _plugin(case: Case, model: torch.nn.Module, device: str):
    max_norm = MAX_NORM if case.clip == "plugin" else 0.0
    if case.plugin == "zero":
        return LowLevelZeroPlugin(
            precision=case.precision, max_norm=max_norm, reduce_bucket_size_in_m=0.02,
            **case.kwargs,
        )  # fmt: skip
    kwargs: dict[str, Any] = dict(case.kwargs)
    if case.placement != "default":  # GeminiPlugin's own chunk search otherwise
        kwargs["chunk_config_dict"] = {1: CHUNKS}
    if case.placement == "host":
        kwargs.update(placement_policy="static", offload_optim_frac=1.0)
    elif case.placement == "auto-evicting":
        kwargs.update(
            placement_policy="auto", steady_cuda_cap_ratio=1.0,
            gpu_capacity_bytes=_capacity(model, case.precision),
        )  # fmt: skip
    elif case.placement == "auto":
        kwargs.update(placement_policy="auto")
        if device == "cpu":
            kwargs.update(gpu_capacity_bytes=2**30)  # required off CUDA; room for everything
    return GeminiPlugin(precision=case.precision, max_norm=max_norm, **kwargs)


def _check_placement(case: Case, opt, device: str, warmed_up: bool) -> None:
    """The case trains where it says: ZeRO's masters on the host; Gemini's
    masters all on the host ("host"), none ("default"; "auto" with room for
    all, once its warm-up step has planned), some ("auto-evicting"; on a
    GPU, where the memory torch holds counts too, maybe all)."""
    inner = opt.optim
    if case.plugin == "zero":
        devices = {s.master.device.type for s in inner.shards}
        assert devices == {"cpu"}, f"{case.name}: masters on {devices}"
        return
    offloaded, chunks = len(inner.module.offloaded_masters), len(inner.pairs)
    where = f"{case.name}: {offloaded} of {chunks} masters on the host"
    if case.placement == "host":
        assert offloaded == chunks, where
    elif case.placement == "default" or (case.placement == "auto" and warmed_up):
        assert offloaded == 0, where
    elif case.placement == "auto-evicting" and warmed_up:
        assert offloaded > 0 and (offloaded < chunks or device == "cuda"), where


def _own_grads(opt) -> list[torch.Tensor]:
    """The plugin's reduced gradients (one rank: whole), in fp32."""
    inner = opt.optim
    if hasattr(inner, "shards"):  # ZeroOptimizer
        return [s.grad.float() for s in inner.shards if s.grad is not None]
    return [_grad_share(chunk).float() for chunk, _ in inner.pairs]


def _tolerances(case: Case, steps: int, max_grad: float) -> tuple[float, float]:
    """Parameters after ``steps`` steps against the fp32 reference.

    fp32: each step's update comes from another kernel (CPUAdam on the host,
    torch's on the device) and may differ by fp32 rounding, which adds up
    over the steps. bf16: zerostack.testing.training_tolerance, SGD's bound
    from the largest clipped gradient element the reference saw.
    """
    if case.precision == "fp32":
        rtol, atol = tolerance(torch.float32)
        return rtol * steps, atol * steps
    lr = LR[case.optimizer]
    if case.optimizer == "sgd":
        return training_tolerance(
            torch.bfloat16, steps=steps, lr=lr, optimizer="sgd", momentum=MOMENTUM,
            max_grad=max_grad, depth=DEPTH,
        )  # fmt: skip
    return training_tolerance(torch.bfloat16, steps=steps, lr=lr)


def _distance(actual: dict, expected: dict, rtol: float, atol: float) -> float:
    """The largest ``|a - e| / (atol + rtol |e|)`` over every element: 1 is
    the edge of the tolerance."""
    worst = 0.0
    for name, e in expected.items():
        a, e = actual[name].double().cpu(), e.double().cpu()
        worst = max(worst, float(((a - e).abs() / (atol + rtol * e.abs())).max()))
    return worst


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run_case(case: Case, device: str) -> None:
    torch.manual_seed(0)
    model = _model()
    ref = copy.deepcopy(model).to(device)
    free = copy.deepcopy(model).to(device)  # not clipped: what a clip that did nothing gives
    ref_opt = _torch_optimizer(case.optimizer, ref.parameters())
    free_opt = _torch_optimizer(case.optimizer, free.parameters())
    booster = Booster(plugin=_plugin(case, model, device))
    model, opt, *_ = booster.boost(model, _optimizer(case, model.parameters()))
    _check_placement(case, opt, device, warmed_up=False)
    bf16 = case.precision == "bf16"
    max_grad = 0.0
    for step in range(STEPS):
        where = f"{case.name} step {step}"
        x, y = _batch(step, torch.device(device))
        ref_loss = _loss(ref(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert ref_norm > 2 * MAX_NORM, f"{where}: little to clip (norm {ref_norm})"
        max_grad = max([max_grad] + [p.grad.abs().max().item() for p in ref.parameters()])
        ref_opt.step()
        ref_opt.zero_grad()
        _loss(free(x), y).backward()
        free_opt.step()
        free_opt.zero_grad()

        loss = _loss(model(x), y)
        booster.backward(loss, opt)
        norm = None
        if case.clip == "booster":
            norm = booster.clip_grad_norm_(model, opt, MAX_NORM)
        elif case.clip == "optimizer":
            norm = opt.clip_grad_by_norm(MAX_NORM)
        if norm is not None:
            assert norm.dtype == torch.float32 and norm.dim() == 0, f"{where}: {norm!r}"
            assert norm.device.type == device, f"{where}: the norm on {norm.device}"
            if bf16:  # the norm of the plugin's own bf16 gradients, taken in fp32
                own = torch.nn.utils.get_total_norm(_own_grads(opt))
                assert_close(norm, own, rtol=NORM_RTOL, atol=0, msg=f"{where} norm, own gradients")
        assert opt.step() is not False, f"{where}: skipped"
        if case.clip == "plugin":
            norm = torch.tensor(opt.optim.last_grad_norm)
        opt.zero_grad()
        if step == 0:
            _check_placement(case, opt, device, warmed_up=True)
        # fp32: the same gradients up to fp32 rounding. bf16: at the first
        # step, the same weights up to their rounding to bf16.
        if not bf16 or step == 0:
            rtol = loss_tolerance(torch.bfloat16, depth=DEPTH + 1)[0] if bf16 else NORM_RTOL
            assert_close(norm, ref_norm, rtol=rtol, atol=0, msg=f"{where} norm")
        rtol, atol = _tolerances(case, step + 1, max_grad)
        loss_tol = loss_tolerance(torch.bfloat16, depth=DEPTH) if bf16 else (rtol, atol)
        assert_close(loss, ref_loss, rtol=loss_tol[0], atol=loss_tol[1], msg=f"{where} loss")
        full = model.full_state_dict(only_rank_0=False)
        for name, value in ref.named_parameters():
            assert_close(full[name], value, rtol=rtol, atol=atol, msg=f"{where} {name}")
    # The clip shows: a run without it is more than twice the tolerance away
    # from the clipped reference somewhere, so it cannot pass for the plugin.
    # (bf16 AdamW's bound, 2 lr per step, is wider than what the clip moves.)
    if not (bf16 and case.optimizer != "sgd"):
        away = _distance(_params(free), _params(ref), rtol, atol)
        assert away > 2, f"{case.name}: the unclipped run is within {away:.2f}x the tolerance"


def _all(rank: int, world: int, cases: list[Case], device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # a tiny model: threads only spin
    for case in cases:
        _run_case(case, device)


DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            torch.cuda.is_available(),
            reason="the plugins train on the current CUDA device where there is one: the cuda "
            "variant runs these cases there",
        ),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.mark.parametrize("plugin", ["zero", "gemini"])
@pytest.mark.parametrize("device", DEVICES)
def test_clip_matches_torch_on_the_same_device_step_by_step(device, plugin):
    cases = [c for c in CASES if c.plugin == plugin]
    backend = "nccl" if device == "cuda" else "gloo"
    spawn(_all, 1, args=(cases, device), backend=backend, timeout_s=600)
