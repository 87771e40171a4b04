"""A steady-state offloaded training step leaves nothing in reference cycles
for the garbage collector (no GC pauses in the step time)."""

from __future__ import annotations

import collections
import gc

import pytest
from conftest import batch, fake_profile, lm_loss, tiny_gpt2

from zerostack.auto_offload import AMPOptimizer, memory_optimize, plan_offload
from zerostack.fused_adam import HybridAdam


def _garbage_of(step) -> tuple[int, collections.Counter]:
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


@pytest.mark.parametrize("solver", ["syn", "asyn"])
def test_step_makes_no_cyclic_garbage(solver):
    inputs = batch()
    _, rm, _ = plan_offload(
        tiny_gpt2(2), inputs, -1, solver, precision="bf16", profile=fake_profile()
    )
    budget = (rm.solver.least_memory_plan().peak_mem + rm.solver.best_ts.peak_mem) / 2 / 0.95
    om = memory_optimize(tiny_gpt2(2), inputs, budget, solver, precision="bf16", device="cpu",
                         profile=fake_profile())  # fmt: skip
    assert any(r.need_offload for r in om.regions)
    opt = AMPOptimizer(HybridAdam(om.master_parameters(), lr=1e-3), om, clipping_norm=1.0)

    def step():
        opt.zero_grad()
        opt.backward(lm_loss(om(**inputs), inputs["input_ids"]))
        opt.step()

    for _ in range(2):
        step()
    found, kinds = _garbage_of(step)
    assert found == 0, kinds.most_common(8)
