"""Steady step time: a training step leaves nothing for the cycle collector,
and the collector runs on the wrappers' schedule, not at random steps."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch

CONFIG = GPTConfig(bias=False)
CHUNKS = {1: {"chunk_size": 20_000, "keep_gathered": False}}
CASES = {
    "all-on-device": dict(),
    "offload": dict(offload_optim_frac=0.5),
    "offload-clip": dict(offload_optim_frac=0.5, max_norm=1.0),
    "fp16-offload": dict(dtype=torch.float16, offload_optim_frac=0.5),
    "zero2-accumulation": dict(shard_param_frac=0.0, enable_gradient_accumulation=True),
    "auto-prefetch": dict(placement_policy="auto", gpu_capacity_bytes=10**7, max_prefetch=2),
    "static-prefetch": dict(offload_param_frac=1.0, offload_optim_frac=0.5, max_prefetch=2),
    "inline-cpu-step": dict(offload_optim_frac=1.0, overlap=False),
    # Half the CPU-held chunks in the device's Adam (gpu_update_fraction).
    "offload-device-lane": dict(offload_optim_frac=1.0, gpu_update_fraction=0.5, max_norm=1.0),
}


def _trainer(kwargs, gc_every_n_steps=0, device="cpu"):
    kwargs = dict(kwargs)
    max_norm, overlap = kwargs.pop("max_norm", 0.0), kwargs.pop("overlap", True)
    fraction = kwargs.pop("gpu_update_fraction", 0.0)
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    ddp = GeminiDDP(
        model, mixed_precision=kwargs.pop("dtype", torch.float32), chunk_config_dict=CHUNKS,
        compute_device=device, **kwargs,
    )  # fmt: skip
    opt = GeminiOptimizer(
        HybridAdam(list(model.parameters()), lr=1e-3), ddp, max_norm=max_norm,
        overlap_cpu_step=overlap, gc_every_n_steps=gc_every_n_steps,
        gpu_update_fraction=fraction,
    )  # fmt: skip
    idx, tgt = (t.to(device) for t in make_batch(CONFIG, 2, 16, seed=0))

    def step():
        if ddp.accumulate:
            with ddp.no_sync():
                opt.backward(ddp(idx, tgt).float())
        opt.backward(ddp(idx, tgt).float())
        opt.step()
        ddp.wait_updates()

    return step, opt


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("case", list(CASES))
def test_a_steady_step_leaves_no_cyclic_garbage(case, device):
    step, _ = _trainer(CASES[case], device=device)
    for _ in range(3):  # warm-up: auto's plan, lazily made buffers, the fp16 scale settling
        step()
    # Drain earlier garbage: a collected optimizer's finalizer (its pipeline's
    # close) lets go of its chunks, which the next collection then finds.
    while gc.collect():
        pass
    for _ in range(2):
        step()
    assert gc.collect() == 0, f"{case}: a steady training step left objects in reference cycles"


def test_the_collector_runs_on_the_schedule():
    from zerostack.shard._gc import _users

    gc.collect()  # wrappers of earlier tests that are garbage stop using the schedule
    others = len(_users)
    runs = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    step, opt = _trainer({}, gc_every_n_steps=3)
    gc.callbacks.append(count)
    try:
        step()  # automatic collection is off from the first step on
        assert not gc.isenabled() and opt.collector in _users
        runs.clear()
        junk = [[] for _ in range(50_000)]  # would trigger automatic collections
        del junk
        step()
        assert runs == []
        step()  # the third step: a generation-1 collection
        assert runs == [1] and opt.collector.collections == 1
    finally:
        gc.callbacks.remove(count)
        opt.close()
    # The last user gives automatic collection back.
    assert gc.isenabled() == (others == 0)
    with pytest.raises(ValueError, match=r"gc_every_n_steps must be an int >= 0 \(got -1\)"):
        _trainer({}, gc_every_n_steps=-1)


def test_the_hooks_look_no_tensor_up_by_hash(monkeypatch):
    # Host time per step: a dict or set keyed by a tensor calls Tensor.__hash__,
    # a Python function, and the hooks run for every module three times a step.
    # The hooks hold each parameter's chunk and TensorInfo instead; what is
    # left in forward and backward is one set insertion per parameter that got
    # a gradient and the reduction's walk over each chunk's tensors.
    step, opt = _trainer({})
    step()
    ddp = opt.module
    idx, tgt = make_batch(CONFIG, 2, 16, seed=0)
    calls = [0]
    original = torch.Tensor.__hash__

    def counting(self):
        calls[0] += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "__hash__", counting)
    opt.backward(ddp(idx, tgt).float())
    monkeypatch.undo()
    opt.step()
    # The old hooks looked every parameter up about 15 times in forward and backward.
    assert 0 < calls[0] <= 2 * len(ddp.params), (calls[0], len(ddp.params))


@pytest.mark.parametrize(
    "kwargs",
    [
        CASES["offload"],
        dict(placement_policy="auto", gpu_capacity_bytes=10**5),
        dict(placement_policy="auto", gpu_capacity_bytes=10**5, gpu_update_fraction=0.5),
    ],
    ids=["static-offload", "auto-small-capacity", "auto-device-lane"],
)
def test_a_dropped_model_and_optimizer_are_freed_with_updates_pending(kwargs):
    # Their finalizer once held the CPU-step pipeline, whose pending updates
    # hold the optimizer (and through it the model): masters, states, chunks
    # and the worker thread stayed for the rest of the process. Then the
    # pipeline's pending calls closed a cycle through the optimizer, so they
    # stayed until the next full collection (zerostack.shard's [Note: a
    # dropped owner is freed]): freed here by reference counting alone.
    before = set(threading.enumerate())
    step, opt = _trainer(kwargs)
    step()
    ddp = opt.module
    idx, tgt = make_batch(CONFIG, 2, 16, seed=1)
    gc.collect()
    gc.disable()
    try:
        opt.backward(ddp(idx, tgt).float())
        opt.step()  # no wait_updates(): the updates stay held until the next forward
        assert opt.pipeline.updates.held, "no update left pending: the test would not cover it"
        workers = [t for t in threading.enumerate() if t not in before]
        alive = [weakref.ref(opt), weakref.ref(ddp)]
        del step, opt, ddp
        deadline = time.monotonic() + 30  # an update still running holds them until it ends
        while any(r() is not None for r in alive) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r() is None for r in alive] == [True, True]
    finally:
        gc.enable()
    for thread in workers:
        thread.join(30)
    assert [t.is_alive() for t in workers] == [False] * len(workers)
