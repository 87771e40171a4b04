"""A steady-state offloaded training step leaves nothing in reference cycles
for the garbage collector (no GC pauses in the step time)."""

from __future__ import annotations

import collections
import gc

import pytest
from offload_helpers import batch, fake_profile, gpt2_2, halfway_budget, lm_loss

from zerostack.auto_offload import AMPOptimizer, memory_optimize
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
    om = memory_optimize(gpt2_2(), inputs, halfway_budget(gpt2_2, solver), solver,
                         precision="bf16", device="cpu", profile=fake_profile())  # fmt: skip
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
