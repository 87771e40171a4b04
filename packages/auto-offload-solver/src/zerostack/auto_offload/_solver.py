"""Greedy offload solvers: choose regions to offload until the simulated peak fits.

Profit of a choice = (memory saved per second of added step time, memory
saved, peak saved), compared lexicographically; memory saved is the area
under the per-node memory curve (a choice can lower many nodes without
lowering the peak yet). A choice that costs no time and saves memory has
infinite profit; one that saves nothing has none (ColossalAI called it
infinite when its cost was zero).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import ClassVar

from zerostack.auto_offload._profile import HardwareProfile
from zerostack.auto_offload._region import Region
from zerostack.auto_offload._simulator import (
    AsynTrainingSimulator,
    RegionCost,
    SynTrainingSimulator,
    TrainingSimulator,
)

logger = logging.getLogger(__name__)
_MB = 1024**2


class MemoryBudgetError(ValueError):
    """The memory budget is below the least that any offload plan needs.

    Attributes:
        least_bytes: the smallest ``memory_budget`` (whole bytes, before the
            error factor) that a plan fits in.
    """

    def __init__(self, message: str, least_bytes: int) -> None:
        super().__init__(message)
        self.least_bytes = least_bytes


class Solver:
    """Base of the greedy solvers.

    Args:
        region_list: the regions (plan fields are reset and then set).
        costs: their :class:`RegionCost`.
        profile: the hardware rates.
        memory_budget: bytes; ``<= 0`` means the device's total memory. Default -1.
        error_factor: the budget is scaled by it, for estimation error. Default 0.95.
        baseline_bytes: memory held throughout the step (inputs, buffers). Default 0.
    """

    simulator_cls: type[TrainingSimulator] = TrainingSimulator

    def __init__(
        self,
        region_list: Sequence[Region],
        costs: Sequence[RegionCost],
        profile: HardwareProfile,
        memory_budget: float = -1.0,
        error_factor: float = 0.95,
        baseline_bytes: int = 0,
    ) -> None:
        if not 0 < error_factor <= 1:
            raise ValueError(
                f"{type(self).__name__}: error_factor must be in (0, 1] (got {error_factor})"
            )
        if len(costs) != len(region_list):
            raise ValueError(
                f"{type(self).__name__}: {len(region_list)} regions but {len(costs)} costs"
            )
        self.region_list = list(region_list)
        self.costs = list(costs)
        self.profile = profile
        self.error_factor = error_factor
        self.baseline_bytes = baseline_bytes
        raw = memory_budget if memory_budget > 0 else profile.device_memory_bytes
        self.memory_budget = raw * error_factor
        self._candidates = self._offloadable()
        for reg in self.region_list:
            reg.need_offload = reg.is_syn = False
            reg.bwd_prefetch_region = None
        self.best_ts = self._simulate()

    def _offloadable(self) -> list[Region]:
        """Regions the solver may offload: all offloadable but the last one
        with parameters (its backward follows its forward at once)."""
        with_params = [r for r in self.region_list if r.params]
        last = with_params[-1] if with_params else None
        return [r for r in self.region_list if r.offloadable and r is not last]

    def _simulate(self) -> TrainingSimulator:
        return self.simulator_cls(
            self.region_list, self.costs, self.profile, self.baseline_bytes
        ).execute()

    def _compute_offload_profit(
        self, ts: TrainingSimulator, best: TrainingSimulator
    ) -> tuple[float, float, float]:
        """(saving per second of added time, saving, peak saving) of ``ts`` over ``best``."""
        saving = best.total_mem - ts.total_mem
        peak_saving = best.peak_mem - ts.peak_mem
        extra = max(ts.step_time - best.step_time, 0.0)
        if saving <= 0 and peak_saving <= 0:
            return (0.0, saving, peak_saving)
        rate = math.inf if extra == 0 else max(saving, peak_saving) / extra
        return (rate, saving, peak_saving)

    @staticmethod
    def _compare_profit(a: tuple, b: tuple) -> bool:
        """Lexicographic: is ``a`` strictly better than ``b``."""
        for x, y in zip(a, b, strict=False):
            if x != y:
                return x > y
        return False

    def least_memory_plan(self) -> TrainingSimulator:
        """Simulate the plan that needs least memory (every candidate offloaded,
        uploaded synchronously); the plan fields are restored afterwards."""
        saved = [(r.need_offload, r.is_syn, r.bwd_prefetch_region) for r in self.region_list]
        for r in self.region_list:
            r.bwd_prefetch_region = None
        for r in self._candidates:
            r.need_offload = r.is_syn = True
        ts = self._simulate()
        for r, (a, b, c) in zip(self.region_list, saved, strict=True):
            r.need_offload, r.is_syn, r.bwd_prefetch_region = a, b, c
        return ts

    def _check_feasible(self) -> None:
        least = self.least_memory_plan()
        if least.peak_mem > self.memory_budget:
            need = math.ceil(least.peak_mem / self.error_factor)
            raise MemoryBudgetError(
                f"{type(self).__name__}: memory_budget {self.memory_budget / self.error_factor / _MB:.2f} MB "
                f"is below the least that would work, {need / _MB:.2f} MB ({need} bytes: every offloadable region "
                f"offloaded; peak {least.peak_mem / _MB:.1f} MB / error_factor {self.error_factor}); "
                "raise memory_budget or shrink the batch",
                least_bytes=need,
            )

    def _call_solver(self) -> TrainingSimulator:
        """Search the plan; sets the regions' plan fields and returns the best simulation.

        Raises:
            MemoryBudgetError: no plan fits the budget (the message states the least).
        """
        if self.best_ts.peak_mem <= self.memory_budget:
            return self.best_ts
        self._check_feasible()
        self._search()
        if self.best_ts.peak_mem > self.memory_budget:
            # The greedy stalled; the all-synchronous plan fits (checked above).
            logger.warning(
                "%s: greedy search stalled at %.1f MB; falling back to synchronous uploads of "
                "every offloadable region", type(self).__name__, self.best_ts.peak_mem / _MB,
            )  # fmt: skip
            for r in self.region_list:
                r.bwd_prefetch_region = None
            for r in self._candidates:
                r.need_offload = r.is_syn = True
            self.best_ts = self._simulate()
        return self.best_ts

    def _search(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}._search: use a concrete solver")

    def describe(self) -> str:
        """One line: peak, step time and how many regions are offloaded."""
        off = [r for r in self.region_list if r.need_offload]
        pre = [r for r in off if not r.is_syn]
        return (
            f"peak={self.best_ts.peak_mem / _MB:.1f} MB (budget {self.memory_budget / _MB:.1f} MB "
            f"after error_factor) | step={self.best_ts.step_time * 1e3:.2f} ms | "
            f"offloaded {len(off)}/{len(self.region_list)} regions ({len(pre)} prefetched)"
        )


class SynGreedySolver(Solver):
    """Offload, one region at a time, the one with the best profit; uploads
    in backward are synchronous."""

    simulator_cls = SynTrainingSimulator

    def _search(self) -> None:
        while self.best_ts.peak_mem > self.memory_budget:
            best = None
            for region in self._candidates:
                if region.need_offload:
                    continue
                ts, profit = self._try_to_offload(region)
                if best is None or self._compare_profit(profit, best[1]):
                    best = (region, profit, ts)
            if best is None or not self._compare_profit(best[1], (0.0,)):
                return
            best[0].need_offload = best[0].is_syn = True
            self.best_ts = best[2]

    def _try_to_offload(self, region: Region) -> tuple[TrainingSimulator, tuple]:
        region.need_offload = region.is_syn = True
        ts = self._simulate()
        region.need_offload = region.is_syn = False
        return ts, self._compute_offload_profit(ts, self.best_ts)


class AsynGreedySolver(Solver):
    """Offload the region with the best profit and choose where its backward
    upload is prefetched: by one of the ``search_window_size`` regions whose
    backward runs just before it, or synchronously when it is reached.

    Args:
        search_window_size: how many later regions may host the prefetch. Default 3.
    """

    simulator_cls = AsynTrainingSimulator

    def __init__(self, *args, search_window_size: int = 3, **kwargs) -> None:
        if search_window_size < 1:
            raise ValueError(
                f"AsynGreedySolver: search_window_size must be >= 1 (got {search_window_size})"
            )
        self.search_window_size = search_window_size
        self.region_to_region_map: dict[int, Region] = {}
        """Offloaded region id -> the region that prefetches it in backward."""
        super().__init__(*args, **kwargs)

    def _hosts(self, region: Region) -> list[Region | None]:
        """None (synchronous upload) and the free prefetch slots after ``region``."""
        later = self.region_list[region.r_id + 1 : region.r_id + 1 + self.search_window_size]
        return [None, *[h for h in later if h.bwd_prefetch_region is None]]

    def _search(self) -> None:
        while self.best_ts.peak_mem > self.memory_budget:
            best = None
            for region in self._candidates:
                if region.need_offload:
                    continue
                for host in self._hosts(region):
                    ts, profit = self._try_to_offload(host, region)
                    if best is None or self._compare_profit(profit, best[2]):
                        best = (region, host, profit, ts)
            if best is not None and self._compare_profit(best[2], (0.0,)):
                region, host, _, ts = best
                region.need_offload = True
                region.is_syn = host is None
                if host is not None:
                    host.bwd_prefetch_region = region
                    self.region_to_region_map[region.r_id] = host
                self.best_ts = ts
            elif not self._repair_strategy():
                return

    def _try_to_offload(
        self, host: Region | None, region: Region
    ) -> tuple[TrainingSimulator, tuple]:
        region.need_offload = True
        region.is_syn = host is None
        if host is not None:
            host.bwd_prefetch_region = region
        ts = self._simulate()
        region.need_offload = region.is_syn = False
        if host is not None:
            host.bwd_prefetch_region = None
        return ts, self._compute_offload_profit(ts, self.best_ts)

    def _repair_strategy(self) -> bool:
        """Turn prefetches into synchronous uploads (best profit first) until
        the peak drops; False when there was nothing left to turn."""
        start_peak = self.best_ts.peak_mem
        while self.region_to_region_map and self.best_ts.peak_mem >= start_peak:
            best = None
            for rid, host in self.region_to_region_map.items():
                region = self.region_list[rid]
                host.bwd_prefetch_region, region.is_syn = None, True
                ts = self._simulate()
                host.bwd_prefetch_region, region.is_syn = region, False
                profit = self._compute_offload_profit(ts, self.best_ts)
                if best is None or self._compare_profit(profit, best[1]):
                    best = (rid, profit, ts)
            rid, _, ts = best
            host = self.region_to_region_map.pop(rid)
            host.bwd_prefetch_region, self.region_list[rid].is_syn = None, True
            self.best_ts = ts
        return self.best_ts.peak_mem < start_peak


class SolverFactory:
    """Solvers by name: "syn" and "asyn"."""

    solvers: ClassVar[dict[str, type[Solver]]] = {"syn": SynGreedySolver, "asyn": AsynGreedySolver}

    @staticmethod
    def create(solver_name: str) -> type[Solver]:
        """The solver class called ``solver_name``.

        Raises:
            ValueError: an unknown name.
        """
        if solver_name not in SolverFactory.solvers:
            raise ValueError(
                f"SolverFactory: unknown solver_name {solver_name!r}; use one of "
                f"{sorted(SolverFactory.solvers)}"
            )
        return SolverFactory.solvers[solver_name]

    @staticmethod
    def get_solver_names() -> tuple[str, ...]:
        """The registered names."""
        return tuple(SolverFactory.solvers)
