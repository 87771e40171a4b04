"""``GeminiOptimizer(gpu_update_fraction=f)``: a share of the CPU-held
optimizer chunks stepped by the compute device's Adam from pinned host homes
(see zerostack.gemini's [Note: Gemini's device lane]).

On a CPU compute device that lane runs the CPU kernel on its staging copies,
so every run equals the f = 0 run bitwise: AdamW and Adam-L2, clipping, fp16
loss scaling with an overflow, static and auto placement, world sizes 1 and
2, state dicts included. And the lane does what it promises: its gradients
are never staged to the host, its masters and states live in the host homes
between steps with two chunk shards of staging beside them. On CUDA (marked
``gpu``) too: the CUDA kernel gives CPU Adam's bits.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import re

import pytest
import torch

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import CpuStepError, GeminiDDP, GeminiOptimizer
from zerostack.gemini._device_lane import GeminiLane, chunk_lane, staging_bytes
from zerostack.shard import best_gpu_update_fraction
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

CONFIG = GPTConfig(add_unused_param=True, bias=False)
CHUNK = 20_000
FRACTIONS = (0.25, 0.5, 1.0)
STEPS = 4
PLACEMENTS = {
    "static-1.0": dict(offload_optim_frac=1.0),
    "static-0.5": dict(offload_optim_frac=0.5),
    "auto-small": dict(placement_policy="auto", gpu_capacity_bytes=10**5),
}
# CUDA only: parameter shards in host memory, which the lane streams from when pinned.
HOST_SHARDS = {
    "host-shards": dict(offload_optim_frac=1.0, offload_param_frac=1.0, pin_memory=True),
    "half-host-shards": dict(offload_optim_frac=1.0, offload_param_frac=0.5, pin_memory=True),
    "pageable-host-shards": dict(offload_optim_frac=1.0, offload_param_frac=0.5),
}


def _build(fraction, placement, kind="adamw", dtype=torch.bfloat16, world=1, device="cpu", **kw):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=dtype, chunk_config_dict={world: {"chunk_size": CHUNK}},
        compute_device=device, **{**PLACEMENTS, **HOST_SHARDS}[placement],
    )  # fmt: skip
    if dtype == torch.float16:
        kw.update(initial_scale=2.0**12, hysteresis=1)
    # adamw_mode=False: Adam with L2 weight decay, where gradient-scale bugs show.
    inner = HybridAdam(
        list(model.parameters()), lr=1e-2, weight_decay=0.1, adamw_mode=kind == "adamw"
    )
    opt = GeminiOptimizer(inner, ddp, gpu_update_fraction=fraction, **kw)
    return model, ddp, opt


def _train(model, ddp, opt, rank=0, steps=STEPS, overflow_at=None, first=0):
    """``steps`` steps on rank-dependent batches; an inf gradient on rank 0
    at ``overflow_at`` (fp16: every rank skips that step)."""
    losses = []
    for step in range(first, first + steps):
        idx, tgt = (
            t.to(ddp.compute_device) for t in make_batch(CONFIG, 2, 16, seed=100 * step + rank)
        )
        poison = step == overflow_at and rank == 0
        handle = model.lm_head.weight.register_hook(
            lambda g, poison=poison: torch.full_like(g, float("inf")) if poison else g
        )
        loss = ddp(idx, tgt).float()
        opt.backward(loss)
        handle.remove()
        assert opt.step() == (step != overflow_at), step
        losses.append(loss.item())
    ddp.wait_updates()
    return losses


def _same(a, b, what):
    """Two nested state dicts: the same keys, dtypes and values (wherever
    each tensor lives: placements differ in which states stay on the device)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _same(a[k], b[k], f"{what}.{k}")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), what
    else:
        assert a == b, what


def _same_run(ref, other, what):
    (_, ref_ddp, ref_opt), (_, ddp, opt) = ref, other
    _same(ddp.state_dict(), ref_ddp.state_dict(), f"{what}: model")
    _same(opt.state_dict(), ref_opt.state_dict(), f"{what}: optimizer")
    _same(opt.full_state_dict(), ref_opt.full_state_dict(), f"{what}: full optimizer")


# (id, optimizer, dtype, max_norm, overlap_cpu_step, overflow step)
CASES = [
    ("adamw-bf16-clip", "adamw", torch.bfloat16, 0.5, True, None),
    ("l2-bf16", "l2", torch.bfloat16, 0.0, True, None),
    ("adamw-fp16-scaled-clip-overflow", "adamw", torch.float16, 0.5, True, 2),
    ("l2-fp16-scaled-inline", "l2", torch.float16, 1.0, False, None),
]


def _parity(rank, world, placements, cases):
    for placement in placements:
        for name, kind, dtype, max_norm, overlap, overflow in cases:
            kw = dict(max_norm=max_norm, overlap_cpu_step=overlap)
            ref = _build(0.0, placement, kind, dtype, world, **kw)
            ref_losses = _train(*ref, rank, overflow_at=overflow)
            assert ref[2]._lane is None
            stepped = STEPS - (overflow is not None)
            for fraction in FRACTIONS:
                what = f"{placement} {name} f={fraction} rank {rank}/{world}"
                run = _build(fraction, placement, kind, dtype, world, **kw)
                assert _train(*run, rank, overflow_at=overflow) == ref_losses, what
                _same_run(ref, run, what)
                lane = run[2]._lane
                assert lane is not None and lane.updates == stepped * len(lane.homes), what
                if ref[2].scaler is not None:
                    assert run[2].scaler.scale == ref[2].scaler.scale, what


def test_every_fraction_equals_cpu_adam_only_bitwise_at_world_1():
    spawn(_parity, 1, args=(list(PLACEMENTS), CASES), backend="gloo", timeout_s=900)


def test_every_fraction_equals_cpu_adam_only_bitwise_at_world_2():
    spawn(_parity, 2, args=(["static-0.5", "auto-small"], CASES[::2]), backend="gloo",
          timeout_s=900)  # fmt: skip


def test_the_lane_is_spread_through_the_cpu_held_chunks_and_logs_its_share(caplog):
    with caplog.at_level(logging.INFO, logger="zerostack.gemini"):
        _, ddp, opt = _build(0.5, "static-0.5")
    host = opt._host
    lane = opt._lane
    sizes = [opt.masters[i].numel() for i in host]
    assert len(host) >= 4 and sorted(lane.homes) == [host[k] for k in chunk_lane(sizes, 0.5)]
    assert 0 < len(lane.homes) < len(host) and sorted(lane.homes) != host[: len(lane.homes)]
    assert opt.device_lane_chunks == sorted(opt.pairs[i][0].index for i in lane.homes)
    assert "step in the Adam of cpu" in caplog.text and "spread through" in caplog.text
    # Auto placement decides at its plan, over the CPU-held chunks in compute order.
    model, ddp, opt = _build(0.5, "auto-small")
    assert opt._lane is None
    _train(model, ddp, opt, steps=1)
    order = opt._cpu_order()
    sizes = [opt.masters[i].numel() for i in order]
    assert opt._lane is not None and sorted(opt._lane.homes) == sorted(
        order[k] for k in chunk_lane(sizes, 0.5)
    )
    # No chunk larger than the median shard: its staging would be the lane's.
    assert chunk_lane([4] * 8 + [9], 1.0) == list(range(8))
    assert chunk_lane([4] * 8 + [9], 0.25) == [0, 2, 6]  # 12 of 41 elements, spread


def test_auto_placement_plans_with_the_staging_kept_free(monkeypatch):
    # 3 MB: with f = 0 the plan puts 8 of the 10 optimizer chunks on the
    # device; the lane's two slots (2 x 20,000 x 14 B) take the room of two
    # more (12 B per element each), which stay on the CPU.
    monkeypatch.setitem(PLACEMENTS, "auto-3mb", dict(placement_policy="auto",
                                                     gpu_capacity_bytes=3 * 10**6))  # fmt: skip
    on_cpu = []
    for fraction in (0.0, 0.5):
        model, ddp, opt = _build(fraction, "auto-3mb")
        _train(model, ddp, opt, steps=1)
        on_cpu.append(len(ddp.offloaded_masters))
    reserve = staging_bytes(CHUNK, torch.bfloat16)
    assert on_cpu[1] - on_cpu[0] >= reserve // (CHUNK * 12), on_cpu
    assert opt.device_lane_chunks


def test_gradients_stay_on_the_device_and_states_live_in_the_host_homes():
    model, ddp, opt = _build(1.0, "static-1.0")
    staged: list[int] = []
    stage = opt.pipeline.stage_grad
    opt.pipeline.stage_grad = lambda chunk, grad: (staged.append(chunk.index), stage(chunk, grad))
    lane = opt._lane
    assert sorted(lane.homes) == opt._host  # every CPU-held chunk in the lane
    _train(model, ddp, opt, steps=3)
    assert staged == [] and opt.pipeline.host_buffers("grads") == []
    assert opt.pipeline.host_buffers("values") == []  # nothing staged for the parameters either
    for i, homes in lane.homes.items():
        master = opt.masters[i]
        state = opt.optimizer.state[master]
        assert master.data_ptr() == homes.master.data_ptr() and master.device.type == "cpu"
        assert state["exp_avg"] is homes.exp_avg and state["exp_avg_sq"] is homes.exp_avg_sq
        assert float(state["step"]) == 3
    # Two slots of one chunk shard each: fp32 master and moments, bf16 values.
    shard = max(opt.masters[i].numel() for i in lane.homes)
    assert lane.staging.staging_bytes() == staging_bytes(shard, torch.bfloat16)
    assert lane.staging.staging_bytes() == 2 * shard * (4 + 4 + 4 + 2)


def _flaky_first_lane_chunk(opt):
    """The first lane chunk's update raises while ``faults["left"]`` > 0 (one
    fewer each time). Returns its pair index and ``faults``."""
    lane = opt._lane
    first = min(lane.homes)
    real = lane.staging.run
    faults = {"left": 0}

    def flaky(homes, *args, **kwargs):
        if homes is lane.homes[first] and faults["left"] > 0:
            faults["left"] -= 1
            raise RuntimeError("injected device fault")
        return real(homes, *args, **kwargs)

    lane.staging.run = flaky
    return first, faults


def test_a_failed_lane_update_runs_again_and_the_run_goes_on_as_without_it():
    ref = _build(0.0, "static-1.0", overlap_cpu_step=False)
    _train(*ref, steps=3)
    model, ddp, opt = _build(0.5, "static-1.0", overlap_cpu_step=False)
    first, faults = _flaky_first_lane_chunk(opt)
    _train(model, ddp, opt, steps=1)
    faults["left"] = 2  # the step's update and its retry at the end of step() fail
    idx, tgt = make_batch(CONFIG, 2, 16, seed=100)
    opt.backward(ddp(idx, tgt).float())
    with pytest.raises(CpuStepError, match=r"the device update of chunk \d+ failed") as info:
        opt.step()
    assert info.value.chunk_index == opt.pairs[first][0].index
    assert opt.pipeline.failed == [info.value.chunk_index]
    _train(model, ddp, opt, steps=1, first=2)  # the next forward runs it again: it succeeds
    assert opt.pipeline.failed == []
    _same_run(ref, (model, ddp, opt), "after a failed lane update")


def test_a_lane_update_that_fails_on_the_worker_runs_again_where_it_is_waited_for():
    ref = _build(0.0, "static-1.0")
    _train(*ref, steps=3)
    model, ddp, opt = _build(0.5, "static-1.0")  # overlap_cpu_step: on the worker
    first, faults = _flaky_first_lane_chunk(opt)
    _train(model, ddp, opt, steps=1)
    faults["left"] = 2  # on the worker, then where it is waited for
    idx, tgt = make_batch(CONFIG, 2, 16, seed=100)
    opt.backward(ddp(idx, tgt).float())
    opt.step()
    with pytest.raises(CpuStepError, match=r"the device update of chunk \d+ failed"):
        ddp.wait_updates()
    assert faults["left"] == 0 and opt.pipeline.failed == [opt.pairs[first][0].index]
    opt.retry_failed_updates()
    assert opt.pipeline.failed == []
    _train(model, ddp, opt, steps=1, first=2)
    _same_run(ref, (model, ddp, opt), "after a lane update failed on the worker")


def test_a_dropped_batch_leaves_no_trace():
    ref = _build(0.0, "static-0.5")
    _train(*ref, steps=3)
    model, ddp, opt = _build(0.5, "static-0.5")
    _train(model, ddp, opt, steps=1)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=7)
    opt.backward(ddp(idx, tgt).float())  # a batch whose step never comes
    opt.zero_grad()
    _train(model, ddp, opt, steps=2, first=1)
    _same_run(ref, (model, ddp, opt), "after a dropped batch")


def test_a_checkpoint_moves_between_fractions():
    ref = _build(0.0, "static-0.5")
    _train(*ref, steps=2)
    model, ddp, opt = _build(0.5, "static-0.5")
    ddp.load_state_dict(ref[1].state_dict())
    opt.load_state_dict(ref[2].state_dict())  # copied into the homes at the next step
    assert _train(model, ddp, opt, steps=2, first=2) == _train(*ref, steps=2, first=2)
    _same_run(ref, (model, ddp, opt), "loaded at f=0.5")
    back = _build(0.0, "static-0.5")
    back[1].load_state_dict(ddp.state_dict())
    back[2].load_full_state_dict(opt.full_state_dict())
    assert _train(*back, steps=1, first=4) == _train(*ref, steps=1, first=4)


def test_a_dropped_model_and_optimizer_are_freed_with_lane_updates_pending():
    import threading
    import time
    import weakref

    before = set(threading.enumerate())
    model, ddp, opt = _build(0.5, "static-0.5")
    _train(model, ddp, opt, steps=1)
    idx, tgt = make_batch(CONFIG, 2, 16, seed=1)
    opt.backward(ddp(idx, tgt).float())
    opt.step()  # no wait_updates(): the updates stay held until the next forward
    assert opt.pipeline.updates.held, "no update left pending: the test would not cover the leak"
    workers = [t for t in threading.enumerate() if t not in before]
    alive = [weakref.ref(opt), weakref.ref(ddp), weakref.ref(opt._lane)]
    del model, ddp, opt
    deadline = time.monotonic() + 30
    while any(r() is not None for r in alive) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert [r() is None for r in alive] == [True, True, True]
    for thread in workers:
        thread.join(30)
    assert [t.is_alive() for t in workers] == [False] * len(workers)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda ps: torch.optim.AdamW(ps), NotImplementedError,
         r"GeminiOptimizer: gpu_update_fraction steps Adam/AdamW in fused-adam's kernels \(got "
         r"AdamW\); use zerostack.fused_adam's HybridAdam"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), NotImplementedError, r"\(got SGD\)"),
        pytest.param(
            lambda ps: HybridAdam(ps, nvme_offload_fraction=0.5), NotImplementedError,
            r"gpu_update_fraction with Adam states on disk is not implemented \(got "
            r"nvme_offload_fraction=0.5\)",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("zerostack.nvme") is None,
                reason="HybridAdam's states on disk need zerostack-nvme",
            ),
        ),
    ],
    ids=["torch-adamw", "sgd", "nvme"],
)  # fmt: skip
def test_what_the_lane_cannot_step_is_refused(make, error, match, tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(model, chunk_config_dict={1: {"chunk_size": CHUNK}}, compute_device="cpu",
                    offload_optim_frac=1.0)  # fmt: skip
    with pytest.raises(error, match=match):
        GeminiOptimizer(make(list(model.parameters())), ddp, gpu_update_fraction=0.5)


@pytest.mark.parametrize(
    ("fraction", "error", "match"),
    [
        (1.5, ValueError, r"GeminiOptimizer: gpu_update_fraction must be in \[0, 1\] \(got 1.5\)"),
        (
            "0.5",
            TypeError,
            r"gpu_update_fraction must be a number in \[0, 1\] or 'auto' \(got '0.5'\)",
        ),
    ],
)
def test_bad_fractions(fraction, error, match):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(model, chunk_config_dict={1: {"chunk_size": CHUNK}}, compute_device="cpu",
                    offload_optim_frac=1.0)  # fmt: skip
    with pytest.raises(error, match=match):
        GeminiOptimizer(HybridAdam(list(model.parameters())), ddp, gpu_update_fraction=fraction)


def test_without_cpu_held_chunks_it_warns_and_does_nothing():
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(model, chunk_config_dict={1: {"chunk_size": CHUNK}}, compute_device="cpu")
    with pytest.warns(UserWarning, match=r"gpu_update_fraction has no effect when no optimizer"):
        opt = GeminiOptimizer(HybridAdam(list(model.parameters())), ddp, gpu_update_fraction=0.5)
    assert opt._lane is None


@pytest.mark.parametrize(
    ("placement", "why"),
    [
        ({"offload_optim_frac": 1.0}, "the compute device is cpu"),
        ({}, "the static placement offloads no optimizer chunk (offload_optim_frac=0.0)"),
    ],
)
def test_auto_chooses_no_share_where_none_can_run_and_logs_why(placement, why, caplog):
    # See zerostack.shard's [Note: gpu_update_fraction="auto"].
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(model, chunk_config_dict={1: {"chunk_size": CHUNK}}, compute_device="cpu",
                    **placement)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
        opt = GeminiOptimizer(HybridAdam(list(model.parameters())), ddp, gpu_update_fraction="auto")
    assert opt.gpu_update_fraction == 0.0 and opt._lane is None
    assert f"GeminiOptimizer: gpu_update_fraction='auto' chose 0.0: {why}" in caplog.text


@pytest.mark.parametrize(("placement", "said"), [("auto-small", True), ("static-1.0", False)])
def test_on_a_cpu_device_the_default_steps_in_cpu_adam(placement, said, caplog):
    # See zerostack.gemini's [Note: Gemini's split where the model finds it
    # faster]: under auto placement the default is "auto", which on a CPU
    # compute device chooses 0.0 and says why; under static placement 0.0,
    # nothing said.
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(model, chunk_config_dict={1: {"chunk_size": CHUNK}}, compute_device="cpu",
                    **PLACEMENTS[placement])  # fmt: skip
    with caplog.at_level(logging.INFO, logger="zerostack"):
        opt = GeminiOptimizer(HybridAdam(list(model.parameters())), ddp)
        _train(model, ddp, opt, steps=2)
    assert opt.gpu_update_fraction == 0.0 and opt._lane is None
    assert opt.device_lane_updates == 0
    chose = "gpu_update_fraction='auto' chose 0.0: the compute device is cpu"
    assert (chose in caplog.text) == said and caplog.text.count("gpu_update_fraction") == said


def test_only_an_explicit_auto_requires_the_machines_profile(monkeypatch):
    # The default ("auto" under auto placement, 0.0 under static) is resolved
    # with required=False; an explicit "auto" with required=True: a profile
    # that cannot be taken raises.
    import inspect

    import zerostack.gemini._optimizer as gemini_module

    real, seen = gemini_module.resolve_gpu_update_fraction, []

    def record(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        seen.append((bound.arguments["fraction"], bound.arguments["required"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(gemini_module, "resolve_gpu_update_fraction", record)
    for placement, fraction in (("auto-small", None), ("auto-small", "auto"), ("static-1.0", None)):
        model = TinyGPT(CONFIG)
        ddp = GeminiDDP(model, chunk_config_dict={1: {"chunk_size": CHUNK}}, compute_device="cpu",
                        **PLACEMENTS[placement])  # fmt: skip
        GeminiOptimizer(HybridAdam(list(model.parameters())), ddp, gpu_update_fraction=fraction)
    assert seen == [("auto", False), ("auto", True), (0.0, False)]


def _weighing(tmp_path, monkeypatch, cpu_adam_bytes_s):
    """Auto placement under 3 MB on the CPU, with "auto" made to give 0.5 (a
    CPU device splits nothing by itself) and a profile file whose CPU Adam
    runs at ``cpu_adam_bytes_s`` alone and beside the copies."""
    import zerostack.gemini._optimizer as gemini_module
    from zerostack.shard import PROFILE_ENV, MachineProfile

    real = gemini_module.resolve_gpu_update_fraction

    def half(api, fraction, *args, **kwargs):
        return 0.5 if fraction == "auto" else real(api, fraction, *args, **kwargs)

    monkeypatch.setattr(gemini_module, "resolve_gpu_update_fraction", half)
    MachineProfile(
        cpu_adam_bytes_s=cpu_adam_bytes_s, h2d_bytes_s=50e9, d2h_bytes_s=50e9,
        cpu_adam_with_copies_bytes_s=cpu_adam_bytes_s, h2d_with_adam_bytes_s=50e9,
        d2h_with_adam_bytes_s=50e9, gpu_adam_params_s=100e9,
    ).save(tmp_path / "machine.json")  # fmt: skip
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "machine.json"))
    monkeypatch.setitem(PLACEMENTS, "auto-3mb", dict(placement_policy="auto",
                                                     gpu_capacity_bytes=3 * 10**6))  # fmt: skip


@pytest.mark.parametrize(("cpu_adam_bytes_s", "split"), [(1e9, True), (1e12, False)])
def test_auto_placement_weighs_the_split_against_cpu_adam_alone(
    cpu_adam_bytes_s, split, tmp_path, monkeypatch, caplog
):
    # zerostack.shard's [Note: a placement weighed with its split]: the plan
    # with the lane's staging keeps two more optimizer chunks on the host
    # (test_auto_placement_plans_with_the_staging_kept_free). CPU Adam at
    # 1 GB/s: the split is faster and kept, as 0.5 would be. At 1 TB/s: CPU
    # Adam alone, with the plan of 0.0. Either way the same bits as 0.0.
    _weighing(tmp_path, monkeypatch, cpu_adam_bytes_s)
    runs = {}
    for fraction in (0.0, 0.5, None):
        with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
            model, ddp, opt = _build(fraction, "auto-3mb", dtype=torch.float32)
            runs[fraction] = (model, ddp, opt), _train(model, ddp, opt, steps=2)
    opt = runs[None][0][2]
    like = 0.5 if split else 0.0
    assert opt.gpu_update_fraction == like and bool(opt.device_lane_chunks) == split
    offloaded = [len(run[1].offloaded_masters) for run, _ in runs.values()]
    assert offloaded[0] < offloaded[1] and offloaded[2] == offloaded[1 if split else 0]
    assert caplog.text.count("weighed the placement with the split") == 1
    assert caplog.text.rstrip().endswith("the split" if split else "CPU Adam alone")
    _equal_to(runs[None], runs[0.0])


def _weighed_alike(rank, world, folder):
    # Rank 0's CPU Adam at 1 GB/s (the split wins), rank 1's at 1 TB/s (CPU
    # Adam alone would): every rank takes rank 0's answer, with rank 0's
    # plan, and trains as 0.0 does.
    import os

    import zerostack.gemini._optimizer as gemini_module
    from zerostack.shard import PROFILE_ENV, MachineProfile

    real = gemini_module.resolve_gpu_update_fraction
    gemini_module.resolve_gpu_update_fraction = lambda api, fraction, *args, **kwargs: (
        0.5 if fraction == "auto" else real(api, fraction, *args, **kwargs)
    )
    rate = 1e9 if rank == 0 else 1e12
    path = os.path.join(folder, f"machine{rank}.json")
    MachineProfile(
        cpu_adam_bytes_s=rate, h2d_bytes_s=50e9, d2h_bytes_s=50e9,
        cpu_adam_with_copies_bytes_s=rate, h2d_with_adam_bytes_s=50e9,
        d2h_with_adam_bytes_s=50e9, gpu_adam_params_s=100e9,
    ).save(path)  # fmt: skip
    os.environ[PROFILE_ENV] = path
    PLACEMENTS["auto-3mb"] = dict(placement_policy="auto", gpu_capacity_bytes=3 * 10**6 // world)
    ref = _build(0.0, "auto-3mb", dtype=torch.float32, world=world)
    ref_losses = _train(*ref, rank)
    run = _build(None, "auto-3mb", dtype=torch.float32, world=world)
    assert _train(*run, rank) == ref_losses
    assert run[2].gpu_update_fraction == 0.5 and run[2].device_lane_chunks, rank
    _same_run(ref, run, f"rank {rank}")


def test_ranks_take_the_first_ranks_weighing(tmp_path):
    spawn(_weighed_alike, 2, args=(str(tmp_path),), backend="gloo", timeout_s=300)


def test_a_previewed_plan_is_the_plan(monkeypatch):
    # AutoPlacement.preview decides as plan does and moves nothing.
    monkeypatch.setitem(PLACEMENTS, "auto-3mb", dict(placement_policy="auto",
                                                     gpu_capacity_bytes=3 * 10**6))  # fmt: skip
    for fraction in (0.0, 0.5):
        model, ddp, opt = _build(fraction, "auto-3mb")
        auto = ddp.auto
        seen = {}

        def plan(masters, state, staging, auto=auto, seen=seen, real=auto.plan):
            before = set(auto.on_device)
            seen["preview"] = auto.preview(masters, state, staging)
            assert set(auto.on_device) == before  # nothing moved
            return real(masters, state, staging)

        auto.plan = plan
        _train(model, ddp, opt, steps=1)
        masters, shards = seen["preview"]
        assert masters == ddp.offloaded_masters and masters
        assert shards == frozenset(c for c in auto.param_chunks if c not in auto.on_device)


# -- CUDA: the device lane in FusedAdam's kernel ---------------------------------------------


def _cuda_run(fraction, dtype, steps=STEPS, placement="static-1.0", **kw):
    run = _build(fraction, placement, dtype=dtype, device="cuda", max_norm=1.0, **kw)
    return run, _train(*run, steps=steps)


def _equal_to(run, ref):
    """The run equals the CPU-Adam-only run bit for bit, losses and state
    dict: the CUDA kernel does CPU Adam's operations (fused-adam's
    adam_math.h), so moving updates to the GPU changes no bit."""
    (ref_run, ref_losses), (got, losses) = ref, run
    assert losses == ref_losses
    _same(got[1].state_dict(), ref_run[1].state_dict(), "model")
    _same(got[2].state_dict(), ref_run[2].state_dict(), "optimizer")


def _chunk(run, i):
    return run[2].pairs[i][0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_lane_steps_chunks_whose_shards_live_in_pinned_host_memory_on_cuda():
    # Every parameter shard on the host (offload_param_frac=1.0), f = 1.0:
    # the lane copies each landed gradient up and the new values down into
    # the shard, which the next forward gathers; the unused parameter's
    # chunk too, whose saved values go back into its host shard.
    ref = _cuda_run(0.0, torch.float32, placement="host-shards")
    run = _cuda_run(1.0, torch.float32, placement="host-shards")
    lane: GeminiLane = run[0][2]._lane
    assert sorted(lane.homes) == run[0][2]._host and lane.host_grads
    assert all(_chunk(run[0], i).shard_device.type == "cpu" for i in lane.homes)
    assert lane.updates == STEPS * len(lane.homes)  # none fell back to CPU Adam
    assert run[0][2].pipeline.host_buffers("values") == []  # written into the shards themselves
    _equal_to(run, ref)
    # The pinned host shards hold the stepped values: their masters, as the lane wrote them.
    for i in lane.homes:
        shard = _chunk(run[0], i).shard
        assert shard.is_pinned() and torch.equal(shard, run[0][2].masters[i].reshape(-1)), i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_and_device_shards_share_one_staging_ring_on_cuda():
    # Half the shards on the host: one ring of slots, and one gradient
    # buffer per slot beside it (2 x shard x (12 + 4 + 4) B with fp32
    # parameters; 2 + 2 with bf16).
    ref = _cuda_run(0.0, torch.float32, steps=3, placement="half-host-shards")
    run = _cuda_run(1.0, torch.float32, steps=3, placement="half-host-shards")
    lane: GeminiLane = run[0][2]._lane
    places = {_chunk(run[0], i).shard_device.type for i in lane.homes}
    assert places == {"cpu", "cuda"} and lane.updates == 3 * len(lane.homes)
    shard = max(run[0][2].masters[i].numel() for i in lane.homes)
    assert lane.staging.staging_bytes() == staging_bytes(shard, torch.float32, True)
    assert lane.staging.staging_bytes() == 2 * shard * (4 + 4 + 4 + 4 + 4)
    assert staging_bytes(shard, torch.bfloat16, True) == 2 * shard * (4 + 4 + 4 + 2 + 2)
    _equal_to(run, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_failed_update_of_a_host_shard_runs_again_on_cuda():
    ref = _cuda_run(0.0, torch.float32, steps=3, placement="host-shards", overlap_cpu_step=False)
    model, ddp, opt = _build(1.0, "host-shards", dtype=torch.float32, device="cuda", max_norm=1.0,
                             overlap_cpu_step=False)  # fmt: skip
    first, faults = _flaky_first_lane_chunk(opt)
    losses = _train(model, ddp, opt, steps=1)
    faults["left"] = 2  # the step's update and its retry at the end of step() fail
    idx, tgt = (t.cuda() for t in make_batch(CONFIG, 2, 16, seed=100))
    loss = ddp(idx, tgt).float()
    opt.backward(loss)
    with pytest.raises(CpuStepError, match=r"the device update of chunk \d+ failed") as info:
        opt.step()
    assert info.value.chunk_index == opt.pairs[first][0].index
    assert opt.pairs[first][0].shard_device.type == "cpu"
    losses.append(loss.item())
    losses += _train(model, ddp, opt, steps=1, first=2)  # the next forward runs it again
    assert opt.pipeline.failed == []
    _equal_to(((model, ddp, opt), losses), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pageable_host_shards_stay_in_cpu_adam_and_say_so():
    with pytest.warns(UserWarning, match=r"pageable host memory \(pin_memory=False\)"):
        model, ddp, opt = _build(1.0, "pageable-host-shards", device="cuda")
    lane: GeminiLane = opt._lane
    assert all(_chunk((model, ddp, opt), i).shard_device.type == "cuda" for i in lane.homes)
    assert 0 < len(lane.homes) < len(opt._host)
    _train(model, ddp, opt, steps=1)
    assert lane.updates == len(lane.homes)
    opt.close()


def _profile_file(tmp_path, monkeypatch):
    """A profile of the H200 host of docs/benchmarks.md, rounded, in the
    file "auto" reads (``ZEROSTACK_MACHINE_PROFILE``)."""
    from zerostack.shard import PROFILE_ENV, MachineProfile

    profile = MachineProfile(
        cpu_adam_bytes_s=111.6e9, h2d_bytes_s=55e9, d2h_bytes_s=55e9,
        cpu_adam_with_copies_bytes_s=88.5e9, h2d_with_adam_bytes_s=35.3e9,
        d2h_with_adam_bytes_s=46e9, gpu_adam_params_s=140.5e9,
    )  # fmt: skip
    profile.save(tmp_path / "machine.json")
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "machine.json"))
    return profile


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("placement", ["host-shards", "half-host-shards"])
def test_auto_keeps_host_held_parameter_shards_in_cpu_adam(
    tmp_path, monkeypatch, caplog, placement
):
    # [Note: "auto" and parameter shards on the host]: the split of chunks
    # whose new values go down to the host and up again measured slower
    # than CPU Adam alone, so "auto" (asked for) gives 0.0 and says why; a
    # number still runs it.
    _profile_file(tmp_path, monkeypatch)
    with caplog.at_level(logging.INFO, logger="zerostack.shard._machine"):
        model, ddp, opt = _build("auto", placement, device="cuda")
    assert opt.gpu_update_fraction == 0.0 and opt._lane is None
    assert ddp.step_amounts()["host_value_fraction"] > 0  # what the lane would have taken
    assert re.search(r"chose 0\.0: \d+ of the \d+ CPU-held optimizer chunks keep their "
                     r"parameter shard on the host \(offload_param_frac\)", caplog.text), caplog.text  # fmt: skip
    _train(model, ddp, opt, steps=1)
    opt.close()
    model, ddp, opt = _build(0.5, placement, device="cuda")
    assert opt._lane is not None and len(opt._lane.homes) > 0
    _train(model, ddp, opt, steps=1)
    assert opt._lane.updates == len(opt._lane.homes)
    opt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_lane_gives_cpu_adams_bits_on_cuda():
    # fp32 parameters: the CUDA kernel and CPU Adam do the same operations,
    # so the GPU's half of the updates leaves every bit as CPU Adam would.
    ref = _cuda_run(0.0, torch.float32)
    run = _cuda_run(0.5, torch.float32)
    _equal_to(run, ref)
    assert run[0][2]._lane.updates == STEPS * len(run[0][2]._lane.homes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_lane_ran_on_cuda_and_left_only_its_staging():
    def allocated():
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    base = allocated()
    ref, _ = _cuda_run(0.0, torch.bfloat16, steps=2)
    ref_use = allocated() - base
    del ref
    base = allocated()
    run, _ = _cuda_run(0.5, torch.bfloat16, steps=2)
    use = allocated() - base
    lane: GeminiLane = run[2]._lane
    assert lane.updates == 2 * len(lane.homes)
    assert all(h.master.is_pinned() and h.exp_avg.is_pinned() for h in lane.homes.values())
    slack = 1 << 20
    assert use <= ref_use + lane.staging.staging_bytes() + slack, (use, ref_use)
    _train(*run, steps=1, first=2)
    assert allocated() - base <= use + slack, "device memory grew per step"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_takes_the_models_share_from_the_profile_file(tmp_path, monkeypatch):
    # See zerostack.shard's [Note: gpu_update_fraction="auto"]: the share
    # the profile's floor favours; the lane takes the first CPU-held chunks.
    profile = _profile_file(tmp_path, monkeypatch)
    model, ddp, opt = _build("auto", "static-1.0", device="cuda")
    assert opt.gpu_update_fraction == pytest.approx(best_gpu_update_fraction(profile))
    assert opt._lane is not None and 0 < len(opt._lane.homes) < len(opt.pairs)
    _train(model, ddp, opt, steps=2)
    opt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_placement_on_cuda_with_a_share_gives_cpu_adams_bits(tmp_path, monkeypatch):
    # With a share, and with the default "auto" that weighs one, the bits of
    # the run without one (fp32
    # parameters; its device-held chunks step in the GPU's FusedAdam, which
    # does CPU Adam's operations, and the plan keeps more of them there
    # without the lane's staging). A model this small does not provoke the
    # staging's race (zero-shard's test of [Note: staging allocated on its own
    # stream] does). A profile file is set, so nothing measures the machine.
    from zerostack.gemini._device_lane import staging_bytes
    from zerostack.gemini._placement import AutoPlacement

    def room(self):  # every parameter shard, one optimizer chunk, a lane's staging for the rest
        one = max(c.shard_size for c in self.param_chunks)
        shards = sum(self.shard_bytes(c) for c in self.param_chunks)
        return shards + one * (4 + 8) + staging_bytes(one, torch.float32)

    _profile_file(tmp_path, monkeypatch)
    monkeypatch.setitem(PLACEMENTS, "auto-cuda", dict(placement_policy="auto",
                                                      gpu_capacity_bytes=1 << 28))  # fmt: skip
    monkeypatch.setattr(AutoPlacement, "room_bytes", room)  # the plan, whatever the warm-up saw
    ref = _cuda_run(0.0, torch.float32, placement="auto-cuda")
    assert ref[0][2].gpu_update_fraction == 0.0 and ref[0][2].device_lane_chunks == []
    for fraction in (0.5, 1.0, None):  # None: "auto", weighed (either way, the same bits)
        run = _cuda_run(fraction, torch.float32, placement="auto-cuda")
        opt = run[0][2]
        assert fraction is None or (opt.device_lane_chunks and opt.device_lane_updates > 0)
        _equal_to(run, ref)
        opt.close()
    ref[0][2].close()


def _passes_its_group(rank, world):
    import inspect

    import torch.distributed as dist

    import zerostack.gemini._optimizer as gemini_module

    real, groups = gemini_module.resolve_gpu_update_fraction, []

    def record(*args, **kwargs):
        groups.append(inspect.signature(real).bind(*args, **kwargs).arguments.get("group"))
        return real(*args, **kwargs)

    gemini_module.resolve_gpu_update_fraction = record
    group = dist.new_group(list(range(world)))  # not the default group object
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=torch.float32, compute_device="cpu", process_group=group,
        chunk_config_dict={world: {"chunk_size": CHUNK}}, offload_optim_frac=1.0,
    )  # fmt: skip
    GeminiOptimizer(HybridAdam(list(model.parameters()), lr=1e-3), ddp, gpu_update_fraction="auto")
    assert groups == [group], groups


def test_auto_is_taken_over_the_models_process_group():
    # "auto" is a collective over the data-parallel group: GeminiDDP's, not
    # the default group, when the user gave one.
    spawn(_passes_its_group, 2, backend="gloo", timeout_s=120)


def test_masters_read_outside_an_update_wait_for_the_lanes_copies_back(monkeypatch):
    """A skipped fp16 step, a dropped batch and dropped fp16 gradients write
    chunks back from their masters. A lane chunk's master is its pinned home,
    which the last step's copies back (the lane's ``down`` stream) may still
    be writing on CUDA: each path waits for them (the lane's host wait; here
    a spy, as a CPU lane copies nothing) before the first write-back."""
    import zerostack.gemini._ddp as ddp_module
    import zerostack.gemini._optimizer as optimizer_module

    model, ddp, opt = _build(0.5, "static-0.5", dtype=torch.float16)
    _train(model, ddp, opt, steps=1)
    events: list[str] = []
    settle = opt.pipeline.lane_settle
    assert settle is not None

    def spied_settle():
        events.append("settle")
        settle()

    opt.pipeline.lane_settle = spied_settle

    def spied(real):
        def write_back(*args, **kwargs):
            events.append("write")
            return real(*args, **kwargs)

        return write_back

    for module in (ddp_module, optimizer_module):
        monkeypatch.setattr(module, "write_back", spied(module.write_back))

    def first_write_waited(what):
        assert "write" in events, what
        assert "settle" in events[: events.index("write")], f"{what}: {events[:5]}"
        events.clear()

    _train(model, ddp, opt, steps=1, overflow_at=1, first=1)  # the scaler skips it
    first_write_waited("a skipped step")
    idx, tgt = make_batch(CONFIG, 2, 16, seed=7)
    opt.backward(ddp(idx, tgt).float())
    opt.zero_grad()  # a batch whose step never comes
    first_write_waited("a dropped batch")
    ddp(idx, tgt).float().backward()  # not scaled: the step refuses and drops the gradients
    with pytest.raises(RuntimeError, match="fp16 gradients were not scaled"):
        opt.step()
    first_write_waited("dropped gradients")
    _train(model, ddp, opt, steps=1, first=3)  # and training goes on
