"""Hyperparameters set on the optimizer the user built reach every step of
ZeroOptimizer, also with cpu_offload (where a CPUAdam, or a twin of the
user's optimizer, steps the masters on a worker): an lr scheduler built on
it, never handed to the wrapper, and edits of its ``param_groups`` mid-run,
against DDP with the same scheduler, step by step (see [Note: the user's
hyperparameters])."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

HAVE_FUSED_ADAM = importlib.util.find_spec("zerostack.fused_adam") is not None
CONFIG = GPTConfig(bias=False)
STEPS, EDIT, ZERO = 7, 3, 5
TOL32 = dict(rtol=1e-5, atol=5e-6)


def _factor(step: int) -> float:
    """Warm-up over three steps, then 0 from step ZERO."""
    return 0.0 if step >= ZERO else min(1.0, (step + 1) / 3)


def _make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.1)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    return cls(params, lr=1e-3, weight_decay=0.1, foreach=False)


# (id, stage, optimizer, cpu_offload, overlap_cpu_step, max_norm)
CASES = [
    ("s2", 2, "adamw", False, True, 0.0),
    ("s2-offload-sgd-clip", 2, "sgd", True, True, 0.05),
    ("s1-offload-sgd-inline", 1, "sgd", True, False, 0.0),
]
if HAVE_FUSED_ADAM:  # torch Adam/AdamW with cpu_offload step through CPUAdam
    CASES += [
        ("s2-offload-adamw-worker", 2, "adamw", True, True, 0.0),
        ("s1-offload-adam-l2-inline", 1, "adam", True, False, 0.0),
    ]


def _run_case(rank, world, case):
    name, stage, kind, offload, overlap, max_norm = case
    torch.manual_seed(0)
    ref_model = TinyGPT(CONFIG)
    model = copy.deepcopy(ref_model)
    ref = DDP(ref_model)
    ref_opt, user = _make_opt(kind, ref.parameters()), _make_opt(kind, model.parameters())
    zero = ZeroOptimizer(
        user, stage=stage, cpu_offload=offload, overlap_cpu_step=overlap, max_norm=max_norm,
        module=model, reduce_bucket_size=20_000,
    )  # fmt: skip
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _factor)
    sched = torch.optim.lr_scheduler.LambdaLR(user, _factor)  # never handed to the wrapper
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(STEPS):
        if step == EDIT:
            for o in (ref_opt, user):
                o.param_groups[0]["weight_decay"] = 0.3
        idx, tgt = make_batch(CONFIG, 4, 32, seed=100 * step + rank)
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_sched.step()
        loss = model(idx, tgt)
        zero.backward(loss)
        assert zero.step()
        sched.step()
        zero.wait_updates()
        torch.testing.assert_close(
            loss, ref_loss, **TOL32, msg=lambda m, s=step: f"{name} step {s} loss: {m}"
        )
        after = [p.detach().clone() for p in model.parameters()]
        for a, b in zip(after, ref.module.parameters(), strict=True):
            torch.testing.assert_close(a, b, **TOL32, msg=lambda m, s=step: f"{name} step {s}: {m}")
        moved = max((a - b).abs().max().item() for a, b in zip(after, before, strict=True))
        if step >= ZERO:
            assert moved == 0.0, f"{name} step {step}: lr is 0, the parameters moved {moved}"
        else:
            assert moved > 0.0, f"{name} step {step}: the parameters did not move"
        before = after
    assert zero.param_groups is user.param_groups and user.param_groups[0]["lr"] == 0.0


def _all(rank, world):
    for case in CASES:
        _run_case(rank, world, case)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_scheduler_and_edits_on_the_users_optimizer_reach_every_step(world_size):
    spawn(_all, world_size, backend="gloo", timeout_s=300)
