"""Greedy solvers on a traced GPT-2 and a given profile: plans fit the budget,
an impossible budget names the least that works."""

from __future__ import annotations

import pytest
from offload_helpers import batch, fake_profile, tiny_gpt2

from zerostack.auto_offload import (
    AsynGreedySolver,
    MemoryBudgetError,
    RegionManager,
    SolverFactory,
    SynGreedySolver,
    propagate,
    trace_model,
)


@pytest.fixture(scope="module")
def traced():
    model = tiny_gpt2(4).half()
    inputs = batch(4, 16)
    gm = trace_model(model, inputs)
    return gm, propagate(gm, inputs)


def _plan(traced, solver, budget, **profile):
    gm, infos = traced
    rm = RegionManager(gm, infos, fake_profile(**profile), solver_name=solver, memory_budget=budget)
    return rm, rm.build_regions()


@pytest.mark.parametrize("solver", ["syn", "asyn"])
def test_plans_fit_the_budget(traced, solver):
    _, free = _plan(traced, solver, -1)
    none_peak = free.best_ts.peak_mem
    least = free.least_memory_plan().peak_mem
    assert least < none_peak
    assert not any(r.need_offload for r in free.region_list)
    for frac in (0.75, 0.5, 0.25):
        budget = (least + frac * (none_peak - least)) / 0.95
        rm, s = _plan(traced, solver, budget)
        assert s.best_ts.peak_mem <= budget * 0.95
        assert any(r.need_offload for r in rm.region_list)
        for r in rm.region_list:  # the plan is consistent
            assert not r.need_offload or r.offloadable
            assert r.need_offload or (not r.is_syn and r not in
                                      [h.bwd_prefetch_region for h in rm.region_list])  # fmt: skip
            if r.need_offload and solver == "asyn":
                hosts = [h for h in rm.region_list if h.bwd_prefetch_region is r]
                assert r.is_syn == (not hosts) and len(hosts) <= 1
                assert all(h.r_id > r.r_id for h in hosts)


def test_asyn_prefetches_when_bandwidth_is_plentiful(traced):
    # fast links: hiding the upload behind compute costs nothing
    _, free = _plan(traced, "asyn", -1)
    budget = (free.least_memory_plan().peak_mem + free.best_ts.peak_mem) / 2 / 0.95
    rm, s = _plan(traced, "asyn", budget)
    prefetched = [r for r in rm.region_list if r.need_offload and not r.is_syn]
    assert prefetched, s.describe()
    _, syn = _plan(traced, "syn", budget)
    assert s.best_ts.step_time <= syn.best_ts.step_time


@pytest.mark.parametrize("solver", ["syn", "asyn"])
def test_impossible_budget_states_the_least(traced, solver):
    with pytest.raises(MemoryBudgetError, match="below the least that would work") as info:
        _plan(traced, solver, 1000)
    least = info.value.least_bytes
    assert isinstance(least, int) and least > 1000 and f"({least} bytes" in str(info.value)
    _, s = _plan(traced, solver, least)  # and that much is enough
    assert s.best_ts.peak_mem <= least * 0.95


def test_factory_and_arguments():
    assert SolverFactory.create("syn") is SynGreedySolver
    assert SolverFactory.create("asyn") is AsynGreedySolver
    assert SolverFactory.get_solver_names() == ("syn", "asyn")
    with pytest.raises(ValueError, match="unknown solver_name 'greedy'"):
        SolverFactory.create("greedy")
    with pytest.raises(ValueError, match="search_window_size must be >= 1"):
        AsynGreedySolver([], [], fake_profile(), search_window_size=0)
    with pytest.raises(ValueError, match=r"error_factor must be in \(0, 1\]"):
        SynGreedySolver([], [], fake_profile(), error_factor=1.5)


def test_budget_defaults_to_device_memory(traced):
    _, s = _plan(traced, "syn", -1, device_memory_bytes=2 * 10**9)
    assert s.memory_budget == pytest.approx(2 * 10**9 * 0.95)
    assert isinstance(s.best_ts.peak_mem, int | float) and s.best_ts.peak_mem > 0
