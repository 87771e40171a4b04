"""A steady-state ZeroOptimizer step leaves no objects in reference cycles:
nothing for the garbage collector to find, so no GC pauses in the step time."""

from __future__ import annotations

import collections
import gc
import importlib.util
import threading
import time
import weakref

import pytest
import torch

from zerostack.shard import ZeroOptimizer
from zerostack.testing import GPTConfig, TinyGPT, make_batch, spawn

HAVE_FUSED_ADAM = importlib.util.find_spec("zerostack.fused_adam") is not None
CONFIG = GPTConfig(num_layers=1, dim=32, num_heads=2, bias=False)
WARMUP = 3

# (id, ZeroOptimizer keywords, model dtype)
CASES = [
    (f"s{stage}-{'overlap' if overlap else 'no-overlap'}-{name}", kw, dtype)
    for stage in (1, 2)
    for overlap in (True, False)
    for name, dtype, kw in (
        ("fp32", torch.float32, dict(stage=stage, overlap_communication=overlap)),
        # A small initial scale: every measured step is a real (not skipped) step.
        ("fp16", torch.float16, dict(stage=stage, overlap_communication=overlap,
                                     initial_scale=256.0)),
    )
] + [
    ("s2-clip-bf16", dict(max_norm=0.01), torch.bfloat16),
    ("s2-accum-fp32", dict(), torch.float32),
]  # fmt: skip
if HAVE_FUSED_ADAM:
    CASES.append(("s2-offload-fp32", dict(cpu_offload=True), torch.float32))
    # Half the buckets in the device's Adam (see [Note: Adam where the bandwidth is]).
    CASES.append(
        ("s2-offload-device-lane-bf16", dict(cpu_offload=True, gpu_update_fraction=0.5),
         torch.bfloat16)
    )  # fmt: skip


def _garbage_of(step) -> tuple[int, collections.Counter]:
    """What ``gc.collect()`` finds after ``step()``, and its types. The
    automatic collector is off meanwhile, so it cannot hide a cycle."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        found = gc.collect()
        kinds = collections.Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return found, kinds


class _LeakyZero(ZeroOptimizer):
    """The kind of bug this guards against: a callback built per step that
    refers to itself (or to the step's other objects)."""

    def step(self):
        def on_done():
            return on_done, self

        self._callback = on_done  # last step's closure is now a dead cycle
        return super().step()


def _train_step(model, zero, step, rank, micro=1):
    for m in range(micro):
        idx, tgt = make_batch(CONFIG, 2, 16, seed=1000 * step + 10 * m + rank)
        if m < micro - 1:
            with zero.no_sync():
                zero.backward(model(idx, tgt))
        else:
            zero.backward(model(idx, tgt))
    assert zero.step(), f"step {step} skipped"
    zero.zero_grad()


def _plain_step(model, opt, step, rank):
    idx, tgt = make_batch(CONFIG, 2, 16, seed=1000 * step + rank)
    model(idx, tgt).backward()
    opt.step()
    opt.zero_grad()


def _count(rank, world):
    # zerostack.testing's spawn froze what was alive when this rank started
    # (torch's objects, mostly): the counts below are about objects made
    # from here on, which are collected as before.
    # Control: the model and a plain torch optimizer leave nothing, so any
    # count below is ZeroOptimizer's own.
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(WARMUP):
        _plain_step(model, opt, step, rank)
    found, kinds = _garbage_of(lambda: _plain_step(model, opt, WARMUP, rank))
    assert found == 0, f"plain torch: {found} objects in cycles ({dict(kinds)})"

    failures = []
    for name, kw, dtype in [*CASES, ("leaky", dict(), torch.float32)]:
        torch.manual_seed(0)
        model = TinyGPT(CONFIG).to(dtype)
        cls = _LeakyZero if name == "leaky" else ZeroOptimizer
        zero = cls(torch.optim.AdamW(model.parameters(), lr=1e-3), reduce_bucket_size=4096, **kw)
        micro = 3 if "accum" in name else 1
        for step in range(WARMUP):
            _train_step(model, zero, step, rank, micro)
        found, kinds = _garbage_of(lambda m=model, z=zero, k=micro: _train_step(m, z, 9, rank, k))
        if name == "leaky":  # the harness sees a cycle made inside step()
            assert found >= 2 and kinds["function"] >= 1, (found, kinds)
        elif found:
            failures.append(f"{name}: {found} objects in cycles ({dict(kinds)})")
    assert not failures, "\n".join(failures)


def test_a_steady_state_step_leaves_no_cyclic_garbage():
    spawn(_count, 2, backend="gloo", timeout_s=300)


def _dropped(rank, world):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG).to(torch.bfloat16)
    zero = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)
    _train_step(model, zero, 0, rank)
    alive = [weakref.ref(model.lm_head.weight), weakref.ref(zero.shards[0].master)]
    del model, zero
    gc.collect()
    # A parameter's gradient hook is out of the collector's sight: had it held
    # the parameter (through its shard), the parameters and fp32 masters of a
    # dropped model would stay allocated for the rest of the process.
    assert [r() is None for r in alive] == [True, True]


def test_a_dropped_model_and_optimizer_free_their_parameters_and_masters():
    spawn(_dropped, 1, backend="gloo", timeout_s=120)


def _freed_within(refs: list, seconds: float = 30.0) -> bool:
    """Wait until every weak reference is dead, with no cycle collection (the
    caller turned the collector off): what reference counting alone frees
    once an update still running on the worker, which holds its optimizer
    until it ends, is done."""
    assert not gc.isenabled()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(r() is None for r in refs):
            return True
        time.sleep(0.05)
    return False


def _dropped_with_updates_pending(rank, world):
    torch.manual_seed(0)
    model = TinyGPT(CONFIG).to(torch.bfloat16)
    before = set(threading.enumerate())
    zero = ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2, cpu_offload=True, module=model
    )
    gc.collect()
    gc.disable()
    try:
        _train_step(model, zero, 0, rank)  # step() returns with the updates queued on the worker
        assert zero._pipe.held, "no update left pending: the test would not cover the leak"
        worker = [t for t in threading.enumerate() if t not in before]
        alive = [weakref.ref(zero), weakref.ref(zero.shards[0].master)]
        del model, zero
        # Freed without a cycle collection: its pending updates, kept by the
        # pipeline, once closed a cycle through it (see zerostack.shard's
        # [Note: a dropped owner is freed]), so masters, states and device
        # buffers stayed until the next full collection; a gc.collect() at
        # once found the worker still holding them. Before that, its
        # finalizer held the pipeline: they were never freed.
        assert _freed_within(alive), [r() is None for r in alive]
    finally:
        gc.enable()
    for thread in worker:
        thread.join(30)
    assert [t.is_alive() for t in worker] == [False] * len(worker)


@pytest.mark.skipif(not HAVE_FUSED_ADAM, reason="cpu_offload steps with zerostack-fused-adam")
def test_a_dropped_cpu_offload_optimizer_is_freed_with_updates_pending():
    spawn(_dropped_with_updates_pending, 1, backend="gloo", timeout_s=120)
