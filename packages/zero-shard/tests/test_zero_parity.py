"""ZeroOptimizer against DDP + torch optimizers, step by step (gloo, 1/2/4 ranks)."""

from __future__ import annotations

import copy
import importlib.util
import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

HAVE_FUSED_ADAM = importlib.util.find_spec("zerostack.fused_adam") is not None
# No biases: softmax is blind to the key bias, whose gradient is rounding noise
# that Adam inflates to lr-sized steps of random sign.
CONFIG = GPTConfig(add_unused_param=True, bias=False)
STEPS = 10


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One parity run against DDP."""

    name: str
    stage: int = 2
    dtype: torch.dtype = torch.float32
    kind: str = "adamw"
    """adamw, adam_l2 or sgd (see _make_opt)."""
    offload: bool = False
    max_norm: float = 0.0
    micro: int = 1
    """Micro-batches per step (no_sync for all but the last)."""
    overlap: bool = True


CASES = [
    Case(name="s1-fp32-adamw", stage=1),
    Case(name="s2-fp32-adamw"),
    Case(name="s2-fp32-adam-l2", kind="adam_l2"),
    Case(name="s2-fp32-sgd", kind="sgd"),
    Case(name="s1-fp32-sgd-clip", stage=1, kind="sgd", max_norm=0.05),
    Case(name="s2-fp32-adamw-clip", max_norm=0.05),
    Case(name="s2-fp32-accum4", kind="adam_l2", micro=4),
    Case(name="s1-fp32-accum4", stage=1, kind="sgd", micro=4),
    Case(name="s2-bf16-adamw", dtype=torch.bfloat16),
    Case(name="s2-fp16-adamw-clip", dtype=torch.float16, max_norm=1.0),
    Case(name="s2-fp32-offload", kind="adam_l2", offload=True, max_norm=0.05),
    Case(name="s1-bf16-offload-accum", stage=1, dtype=torch.bfloat16, offload=True, micro=4),
    # The offloaded step pipeline (worker thread, forward waits per bucket):
    # plain torch SGD on the masters, and CPUAdam with clipping in fp16.
    Case(name="s2-fp32-offload-sgd-clip", kind="sgd", offload=True, max_norm=0.05),
    Case(name="s2-fp16-offload-adamw-clip", dtype=torch.float16, offload=True, max_norm=1.0),
    # No clipping, no fp16 scale (updates once started during backward here).
    Case(name="s2-fp32-offload-adamw", offload=True),
    Case(name="s2-bf16-offload-sgd", kind="sgd", dtype=torch.bfloat16, offload=True),
    # Everything reduced at step(), none during backward.
    Case(name="s2-fp32-adamw-no-overlap", overlap=False),
    Case(name="s1-fp32-sgd-no-overlap", stage=1, kind="sgd", overlap=False),
    Case(name="s2-fp32-sgd-clip-no-overlap-accum2", kind="sgd", max_norm=0.05, micro=2,
         overlap=False),
]  # fmt: skip

TOL = {
    torch.float32: dict(rtol=1e-5, atol=5e-6),
    torch.bfloat16: dict(rtol=0, atol=2e-2),
    torch.float16: dict(rtol=0, atol=5e-3),
}


def _make_opt(kind, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=False)
    if kind == "adam_l2":
        return torch.optim.Adam(params, lr=1e-3, weight_decay=0.1, foreach=False)
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.01)


def _run_case(rank, world, case, device="cpu", group=None):
    """Train ``case`` next to DDP over ``group`` and compare every step;
    returns the model."""
    torch.manual_seed(0)
    ref_model = TinyGPT(CONFIG).to(device)
    model = copy.deepcopy(ref_model).to(case.dtype)
    ref = DDP(ref_model, find_unused_parameters=True, process_group=group)
    ref_opt = _make_opt(case.kind, ref.parameters())
    zero = ZeroOptimizer(
        _make_opt(case.kind, model.parameters()),
        stage=case.stage,
        cpu_offload=case.offload,
        max_norm=case.max_norm,
        overlap_communication=case.overlap,
        module=model,
        reduce_bucket_size=20_000,
        process_group=group,
    )
    if group is not None:
        world = dist.get_world_size(group)
    name, dtype, micro, max_norm = case.name, case.dtype, case.micro, case.max_norm
    unused_before = model.unused.weight.detach().clone()
    for step in range(STEPS):
        for m in range(micro):
            idx, tgt = make_batch(CONFIG, 4, 32, seed=1000 * step + 10 * m + rank, device=device)
            last = m == micro - 1
            ctx_ref = ref.no_sync() if not last else _null()
            with ctx_ref:
                ref_loss = ref(idx, tgt)
                (ref_loss / micro).backward()
            ctx = zero.no_sync() if not last else _null()
            with ctx:
                # With cpu_offload the forward waits for the last step's
                # updates bucket by bucket: its loss shows it saw them.
                loss = model(idx, tgt).float()
                zero.backward(loss / micro)
            torch.testing.assert_close(
                loss, ref_loss, **TOL[dtype], msg=lambda m, s=step: f"{name} step {s} loss: {m}"
            )
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert zero.step(), f"{name}: step {step} skipped"
        zero.wait_updates()  # cpu_offload: the parameters are read outside forward
        for (pname, a), b in zip(model.named_parameters(), ref.module.parameters(), strict=True):
            torch.testing.assert_close(
                a.float(),
                b,
                **TOL[dtype],
                msg=lambda msg, p=pname, s=step: f"{name} step {s} {p}: {msg}",
            )
    assert torch.equal(model.unused.weight, unused_before), (
        f"{name}: a parameter with no gradient moved"
    )
    # Stage 1 and 2 hold the same optimizer-state bytes: 1/N pieces of every parameter.
    pieces = sum(math.ceil(p.numel() / world) for p in model.parameters())
    master_bytes = sum(s.master.numel() * s.master.element_size() for s in zero.shards)
    assert master_bytes == pieces * 4
    state_bytes = sum(
        t.numel() * t.element_size()
        for st in zero.optimizer.state.values()
        for t in st.values()
        if t.dim() > 0
    )
    used_pieces = sum(
        math.ceil(p.numel() / world)
        for n, p in model.named_parameters()
        if not n.startswith("unused")
    )
    per_param = {"adamw": 2, "adam_l2": 2, "sgd": 1}[case.kind]  # exp_avg + exp_avg_sq, or momentum
    assert state_bytes == used_pieces * 4 * per_param, (
        f"{name}: optimizer state is not the 1/N share"
    )
    return model


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _all_cases(rank, world, cases):
    # What is alive now (torch's modules, mostly) out of the collector's way:
    # each ZeroOptimizer's first step runs a full collection, which walked it
    # (0.15 s a case, a quarter of this test).
    for case in cases:
        _run_case(rank, world, case)


def _cases():
    return [c for c in CASES if HAVE_FUSED_ADAM or not c.offload]


# At 4 ranks, the cases whose buckets and partitions change with the world
# size in ways 2 ranks do not show (clipping's norm over four partitions,
# accumulation, offloaded steps); all of them at 1 and 2.
AT_FOUR = {
    "s1-fp32-sgd-clip", "s2-fp32-accum4", "s2-fp16-adamw-clip", "s2-fp32-offload",
    "s1-bf16-offload-accum", "s2-fp32-offload-sgd-clip", "s2-fp32-sgd-clip-no-overlap-accum2",
}  # fmt: skip


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parity_with_ddp(world_size):
    cases = [c for c in _cases() if world_size < 4 or c.name in AT_FOUR]
    assert {c.name for c in CASES} >= AT_FOUR  # no name mistyped
    spawn(_all_cases, world_size, args=(cases,), backend="gloo", timeout_s=300)


SUBGROUP_CASES = [
    # SGD and Adam-L2: a gradient averaged over the wrong ranks changes their update.
    Case(name="s2-fp32-sgd-subgroup", kind="sgd"),
    Case(name="s1-fp32-adam-l2-subgroup", stage=1, kind="adam_l2"),
]


def _subgroups(rank, world):
    # Every rank creates every group, in the same order; each uses its own.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    for case in SUBGROUP_CASES:
        model = _run_case(rank, world, case, group=group)
        # The pairs trained on different data: equal within a pair, not across.
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        assert torch.equal(every[0], every[1]) and torch.equal(every[2], every[3]), case.name
        assert not torch.equal(every[0], every[2]), f"{case.name}: the pairs did not differ"


def test_parity_with_ddp_on_a_subgroup():
    # Two ZeRO groups, [0, 1] and [2, 3], in a world of 4, each against a
    # DDP reference that averages over the same pair.
    spawn(_subgroups, 4, backend="gloo", timeout_s=300)


def _stage1_equals_stage2(rank, world):
    results = []
    for stage in (1, 2):
        torch.manual_seed(0)
        model = TinyGPT(CONFIG)
        zero = ZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage, reduce_bucket_size=5000
        )
        for step in range(5):
            idx, tgt = make_batch(CONFIG, 4, 32, seed=step * 10 + rank)
            zero.backward(model(idx, tgt))
            zero.step()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    if world <= 2:
        assert torch.equal(results[0], results[1])
    else:
        torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage1_and_stage2_give_the_same_parameters(world_size):
    spawn(_stage1_equals_stage2, world_size, backend="gloo")


def _global_batch(step, rank, world):
    idx, tgt = make_batch(CONFIG, 8, 32, seed=step)  # the same 8 samples whatever the world size
    per = 8 // world
    return idx[rank * per : (rank + 1) * per], tgt[rank * per : (rank + 1) * per]


def _train(model, zero, steps, start, rank, world):
    losses = []
    for step in range(start, start + steps):
        idx, tgt = _global_batch(step, rank, world)
        loss = model(idx, tgt)
        zero.backward(loss)
        zero.step()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _save(rank, world, path):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), stage=2)
    _train(model, zero, 3, 0, rank, world)
    # Same world size: each rank's own shard.
    mine = zero.state_dict()
    fresh_model = TinyGPT(CONFIG)  # not a deepcopy: that would copy the grad hooks too
    fresh_model.load_state_dict(model.state_dict())
    fresh = ZeroOptimizer(
        torch.optim.AdamW(fresh_model.parameters(), lr=1e-3, weight_decay=0.1), stage=2
    )
    fresh.load_state_dict(mine)
    full = zero.full_state_dict()
    expected = _train(model, zero, 3, 3, rank, world)
    assert _train(fresh_model, fresh, 3, 3, rank, world) == expected
    if rank == 0:
        torch.save({"model": model.state_dict(), "full": full, "expected": expected}, path)


def _resume(rank, world, path, saved_world):
    ckpt = torch.load(path, weights_only=False)
    torch.manual_seed(1)  # other weights: the checkpoint's masters must replace them
    model = TinyGPT(CONFIG)
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), stage=2)
    zero.load_full_state_dict(ckpt["full"])
    got = _train(model, zero, 3, 3, rank, world)
    torch.testing.assert_close(got, ckpt["expected"], rtol=1e-5, atol=1e-6)
    with pytest.raises(
        ValueError,
        match=r"saved by rank 0 of 10, this is rank \d of \d; save with full_state_dict\(\)",
    ):
        zero.load_state_dict(
            {
                **zero.state_dict(),
                "layout": {
                    "world": saved_world + 8,
                    "rank": 0,
                    "numels": [p.numel() for p in model.parameters()],
                },
            }
        )
    other = ZeroOptimizer(torch.optim.AdamW(TinyGPT(GPTConfig(dim=32)).parameters()))
    with pytest.raises(ValueError, match=r"the state is for another model"):
        other.load_full_state_dict(ckpt["full"])


def test_state_dict_round_trip_and_reload_at_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    spawn(_save, 2, args=(path,), backend="gloo")
    spawn(_resume, 4, args=(path, 2), backend="gloo")
    spawn(_resume, 1, args=(path, 2), backend="gloo")


def _gpu_cases(rank, world):
    torch.cuda.set_device(rank)
    for case in _cases():
        _run_case(rank, world, case, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_parity_with_ddp_on_cuda():
    # NCCL, the side stream for reductions, pinned offload buffers.
    spawn(_gpu_cases, min(2, torch.cuda.device_count()), backend="nccl", timeout_s=300)
