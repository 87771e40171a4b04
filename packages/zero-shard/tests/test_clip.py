"""Gradient norms and clipping over shards (see [Note: gradient clipping]):
fp32 accumulation, exactness over ranks, ``ZeroOptimizer.clip_grad_by_norm``
against DDP + torch's ``clip_grad_norm_`` step by step (SGD: it moves with
the gradient's scale), its composition with ``max_norm``, the guard on
``param.grad`` (see [Note: sharded param.grad]), and two backwards before a
step summing as DDP's do."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.shard import (
    ShardedGradient,
    ZeroOptimizer,
    norm_part,
    plan_step,
    record_clip,
)
from zerostack.shard._clip import reduce_norm
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(bias=False, vocab_size=128, dim=32, max_seq_len=32)
TOL32 = dict(rtol=1e-5, atol=5e-6)
NORM_RTOL = 1e-5  # fp32 rounding; bf16's spacing is 3.9e-3


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_norm_of_bf16_tensors_accumulates_in_fp32(p):
    torch.manual_seed(0)
    tensors = [torch.randn(n).bfloat16() for n in (1000, 37, 5000)]
    got = reduce_norm(norm_part(tensors, p, torch.device("cpu")), p, None, sharded=False)
    expected = torch.nn.utils.get_total_norm([t.float() for t in tensors], p).item()
    assert got == pytest.approx(expected, rel=1e-6)
    if p != math.inf:  # torch's per-tensor norms in bf16 would round each to bf16
        rounded = torch.nn.utils.get_total_norm(tensors, p).item()
        assert abs(rounded - expected) > 1e3 * abs(got - expected)


def test_plan_step_clips_after_the_recorded_clip_as_torch_twice():
    # torch: clip_grad_norm_(g, 0.5) then clip_grad_norm_(g, 0.2) (the plugin's).
    g = torch.full((4,), 1.0)  # norm 2
    first = torch.nn.utils.clip_grad_norm_([_param(g)], 0.5)
    ref = _param(g)
    torch.nn.utils.clip_grad_norm_([ref], 0.5)
    torch.nn.utils.clip_grad_norm_([ref], 0.2)
    _, clip = record_clip(
        "test", torch.tensor(4.0), max_norm=0.5, norm_type=2.0, group=None
    )  # one process: no collective
    plan = plan_step("test", 4.0, None, 0.2, clip=clip)
    assert first.item() == pytest.approx(2.0)
    assert (g / plan.div_scale).tolist() == pytest.approx(ref.grad.tolist(), rel=1e-6)


def _param(g):
    p = torch.nn.Parameter(torch.zeros_like(g))
    p.grad = g.clone()
    return p


# -- over ranks ---------------------------------------------------------------------------


def _norms_over_ranks(rank, world):
    torch.manual_seed(rank)
    mine = [torch.randn(53).bfloat16(), torch.randn(3)]  # this rank's pieces
    pieces = torch.cat([t.float().reshape(-1) for t in mine])
    whole = [torch.empty_like(pieces) for _ in range(world)]
    dist.all_gather(whole, pieces)
    for p in (1.0, 2.0, math.inf):
        got = reduce_norm(norm_part(mine, p, torch.device("cpu")), p, None)
        expected = torch.nn.utils.get_total_norm(whole, p).item()
        assert got == pytest.approx(expected, rel=1e-6), (rank, p)


@pytest.mark.parametrize("world_size", [2, 4])
def test_norm_over_ranks_is_the_norm_of_the_whole(world_size):
    spawn(_norms_over_ranks, world_size, backend="gloo")


CASES = [
    # (name, ZeroOptimizer arguments, explicit max_norm, norm_type, second, plugin max_norm)
    ("s1", dict(stage=1), 0.3, 2.0, 0.0, 0.0),
    ("s2-two-calls", dict(stage=2), 0.3, 2.0, 0.1, 0.0),
    ("s2-no-overlap-inf", dict(stage=2, overlap_communication=False), 0.03, math.inf, 0.0, 0.0),
    ("s2-offload-and-max-norm", dict(stage=2, cpu_offload=True), 0.3, 2.0, 0.0, 0.2),
    ("s1-offload-l1", dict(stage=1, cpu_offload=True), 40.0, 1.0, 0.0, 0.0),
]


def _clip_parity(rank, world):
    torch.set_num_threads(1)
    for name, kwargs, max_norm, p, second, plugin_max in CASES:
        torch.manual_seed(0)
        ref_model = TinyGPT(CONFIG)
        model = copy.deepcopy(ref_model)
        ref = DDP(ref_model)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
        zero = ZeroOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01),
            module=model, reduce_bucket_size=20_000, max_norm=plugin_max, **kwargs,
        )  # fmt: skip
        for step in range(3):
            where = f"{name} step {step}"
            idx, tgt = make_batch(CONFIG, 4, 16, seed=100 * step + rank)
            ref(idx, tgt).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, p)
            assert ref_norm > max_norm, f"{where}: nothing to clip"
            if second:
                ref_second = torch.nn.utils.clip_grad_norm_(ref.parameters(), second, p)
            if plugin_max:
                assert torch.nn.utils.clip_grad_norm_(ref.parameters(), plugin_max) > plugin_max
            ref_opt.step()
            ref_opt.zero_grad()
            zero.backward(model(idx, tgt))
            if step == 0:
                with pytest.raises(RuntimeError, match=r"booster\.clip_grad_norm_.*max_norm"):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            norm = zero.clip_grad_by_norm(max_norm, p)
            torch.testing.assert_close(norm, ref_norm, rtol=NORM_RTOL, atol=0, msg=where)
            if second:
                got = zero.clip_grad_by_norm(second, p)
                torch.testing.assert_close(got, ref_second, rtol=NORM_RTOL, atol=0, msg=where)
            assert zero.step(), where
            zero.wait_updates()
            for (n, a), b in zip(model.named_parameters(), ref.module.parameters(), strict=True):
                torch.testing.assert_close(
                    a, b, **TOL32, msg=lambda m, n=n, w=where: f"{w} {n}: {m}"
                )


def test_clip_grad_by_norm_matches_ddp_and_torch_clip():
    spawn(_clip_parity, 2, backend="gloo", timeout_s=300)


def _twice(rank, world):
    # torch's accumulation: two backwards, then the step, without no_sync.
    torch.set_num_threads(1)
    for kwargs in (
        dict(stage=1), dict(stage=2), dict(stage=2, overlap_communication=False),
        dict(stage=2, cpu_offload=True),
    ):  # fmt: skip
        torch.manual_seed(0)
        ref_model = TinyGPT(CONFIG)
        model = copy.deepcopy(ref_model)
        ref = DDP(ref_model)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        zero = ZeroOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5), module=model, reduce_bucket_size=20_000,
            **kwargs,
        )  # fmt: skip
        for step in range(2):
            for m in range(2):
                idx, tgt = make_batch(CONFIG, 4, 16, seed=100 * step + 10 * m + rank)
                ref(idx, tgt).backward()
                zero.backward(model(idx, tgt))
                if m == 1:  # the second backward went through the guards
                    assert all(isinstance(p.grad, ShardedGradient) for p in model.parameters())
            ref_opt.step()
            ref_opt.zero_grad()
            assert zero.step()
            zero.wait_updates()
            for a, b in zip(model.parameters(), ref.module.parameters(), strict=True):
                torch.testing.assert_close(a, b, **TOL32, msg=lambda m, k=kwargs: f"{k}: {m}")


def test_two_backwards_before_a_step_sum_as_ddp():
    spawn(_twice, 2, backend="gloo", timeout_s=300)
