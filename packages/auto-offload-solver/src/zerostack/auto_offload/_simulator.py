"""Training simulators: memory replay per node and compute/H2D/D2H timelines.

[Note: memory model] Activation memory does not depend on the offload plan,
so it is replayed once per node (:class:`ActivationProfile`): a node's new
storages are allocated when it runs and freed after their last forward
reader unless some node saved them for backward, in which case they live
until the backward of the earliest such node; a gradient is allocated by
the first backward that produces it and freed by the backward of the node
that owns the storage; parameter gradients are transient (the region's
hook folds them into its buffer at once). The plan only adds the resident
parameter buffers, which are constant within a region's forward or
backward, so a simulator is O(regions) per plan: node memory is the
activation replay plus the region's resident parameter bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from zerostack.auto_offload._profile import HardwareProfile
from zerostack.auto_offload._region import Region
from zerostack.auto_offload._trace import NodeInfo


class ActivationProfile:
    """Per-node activation bytes in forward (``fwd``) and backward (``bwd``),
    excluding parameters. See [Note: memory model].

    Args:
        nodes: the compute nodes in graph order.
    """

    def __init__(self, nodes: Sequence[NodeInfo]) -> None:
        n = len(nodes)
        last_read = list(range(n))
        saved_until: list[int | None] = [None] * n  # backward of this node frees the storage
        for info in nodes:
            for i in info.inputs:
                last_read[i] = max(last_read[i], info.index)
            for i in info.saves:
                until = saved_until[i]
                saved_until[i] = info.index if until is None else min(until, info.index)
        for info in nodes:
            if info.is_output:
                saved_until[info.index] = min(saved_until[info.index] or info.index, info.index)
        free_fwd: list[list[int]] = [[] for _ in range(n)]
        free_bwd: list[list[int]] = [[] for _ in range(n)]
        for i, until in enumerate(saved_until):
            (free_bwd[until] if until is not None else free_fwd[last_read[i]]).append(i)
        self.fwd = [0] * n
        self.bwd = [0] * n
        mem = 0
        for info in nodes:
            mem += info.out_bytes + info.temp_bytes
            self.fwd[info.index] = mem
            mem -= sum(nodes[i].out_bytes for i in free_fwd[info.index])
        self.after_forward = mem
        have_grad = {i for i in range(n) if nodes[i].is_output and nodes[i].grad_bytes}
        mem += sum(nodes[i].grad_bytes for i in have_grad)
        for info in reversed(nodes):
            for i in info.inputs:
                if i not in have_grad and nodes[i].grad_bytes and info.requires_grad:
                    have_grad.add(i)
                    mem += nodes[i].grad_bytes
            self.bwd[info.index] = mem + info.param_grad_bytes
            if info.index in have_grad:
                mem -= info.grad_bytes
            mem -= info.temp_bytes + sum(nodes[i].out_bytes for i in free_bwd[info.index])
            if mem < 0:
                raise AssertionError(
                    f"auto_offload: activation replay went below zero at node {info.node.name}"
                )
        if mem != 0:
            raise AssertionError(f"auto_offload: activation replay ends with {mem} bytes held")


@dataclass(frozen=True, slots=True)
class RegionCost:
    """What a simulator needs of one region, computed once."""

    param_bytes: int
    grad_bytes: int
    fwd_peak: int
    fwd_sum: int
    bwd_peak: int
    bwd_sum: int
    num_nodes: int
    fwd_time: float
    bwd_time: float


def region_costs(
    regions: Sequence[Region], act: ActivationProfile, profile: HardwareProfile
) -> list[RegionCost]:
    """Aggregate the node facts of each region for the simulators."""
    out = []
    for r in regions:
        idx = [n.index for n in r.nodes]
        fwd_t = bwd_t = 0.0
        for n in r.nodes:
            if n.dtype is None and not n.kernels:
                continue
            dtype = n.dtype or next((p.dtype for p in r.params), None)
            fwd_t += profile.compute_time(n.fwd_flops, n.fwd_bytes_moved, dtype, n.kernels)
            if n.requires_grad and n.kernels:
                bwd_t += profile.compute_time(
                    n.bwd_flops, 2 * n.fwd_bytes_moved, dtype, n.kernels, backward=True
                )
        fwd = [act.fwd[i] for i in idx] or [0]
        bwd = [act.bwd[i] for i in idx] or [0]
        out.append(RegionCost(
            param_bytes=r.param_bytes, grad_bytes=r.param_bytes if r.grad_params else 0,
            fwd_peak=max(fwd), fwd_sum=sum(fwd), bwd_peak=max(bwd), bwd_sum=sum(bwd),
            num_nodes=len(idx), fwd_time=fwd_t, bwd_time=bwd_t,
        ))  # fmt: skip
    return out


class TrainingSimulator:
    """Replays one training step of a plan: peak memory, step time and
    per-region resident parameter bytes.

    Args:
        region_list: the regions, with the plan's fields set.
        costs: :func:`region_costs` of the regions.
        profile: the hardware rates.
        baseline_bytes: memory held throughout (inputs, buffers). Default 0.
    """

    def __init__(
        self,
        region_list: Sequence[Region],
        costs: Sequence[RegionCost],
        profile: HardwareProfile,
        baseline_bytes: int = 0,
    ) -> None:
        self.region_list = region_list
        self.costs = costs
        self.profile = profile
        self.baseline_bytes = baseline_bytes
        self.peak_mem = 0
        self.total_mem = 0
        """Sum over nodes of the memory at that node (the area under the curve)."""
        self.step_time = 0.0
        self.fwd_resident: list[int] = [0] * len(region_list)
        self.bwd_resident: list[int] = [0] * len(region_list)

    def execute(self) -> TrainingSimulator:
        """Run the simulation; returns self."""
        raise NotImplementedError(
            "TrainingSimulator.execute: use SynTrainingSimulator or AsynTrainingSimulator"
        )

    def _account(self, r: int, resident: int, fwd: bool) -> None:
        c = self.costs[r]
        base = self.baseline_bytes + resident
        peak, total = (c.fwd_peak, c.fwd_sum) if fwd else (c.bwd_peak, c.bwd_sum)
        if c.num_nodes:
            self.peak_mem = max(self.peak_mem, base + peak)
            self.total_mem += base * c.num_nodes + total
        (self.fwd_resident if fwd else self.bwd_resident)[r] = resident

    def _h2d(self, r: int) -> float:
        return self.profile.transfer_time("h2d", self.costs[r].param_bytes)

    def _d2h(self, r: int) -> float:
        return self.profile.transfer_time("d2h", self.costs[r].grad_bytes)

    def node_memory(self, act: ActivationProfile) -> tuple[dict[int, int], dict[int, int]]:
        """Per-node memory of the last run, forward and backward, keyed by node index."""
        fwd, bwd = {}, {}
        for r, region in enumerate(self.region_list):
            for n in region.nodes:
                fwd[n.index] = self.baseline_bytes + self.fwd_resident[r] + act.fwd[n.index]
                bwd[n.index] = self.baseline_bytes + self.bwd_resident[r] + act.bwd[n.index]
        return fwd, bwd


class SynTrainingSimulator(TrainingSimulator):
    """Everything on one stream: upload, compute, then gradient download."""

    def execute(self) -> SynTrainingSimulator:
        regions, costs = self.region_list, self.costs
        resident, t = 0, 0.0
        for r, reg in enumerate(regions):
            resident += costs[r].param_bytes
            t += self._h2d(r) + costs[r].fwd_time
            self._account(r, resident, fwd=True)
            if reg.need_offload:
                resident -= costs[r].param_bytes
        for r in reversed(range(len(regions))):
            reg = regions[r]
            if reg.need_offload:
                resident += costs[r].param_bytes
                t += self._h2d(r)
            t += costs[r].bwd_time
            self._account(r, resident, fwd=False)
            if costs[r].grad_bytes:
                t += self._d2h(r)
                resident -= costs[r].param_bytes
        self.step_time = t
        return self


class AsynTrainingSimulator(TrainingSimulator):
    """Compute, H2D and D2H on three streams. Forward prefetches the next
    region while computing this one; backward uploads an offloaded region
    when it is reached (``is_syn``) or has it prefetched by the region named
    in ``bwd_prefetch_region``; gradient downloads run behind compute and
    a region's buffer is freed at the first region boundary after its download
    has finished."""

    def execute(self) -> AsynTrainingSimulator:
        regions, costs = self.region_list, self.costs
        n = len(regions)
        comp = h2d = d2h = 0.0
        ready = [0.0] * n
        resident = 0
        with_params = [r for r in range(n) if costs[r].param_bytes]
        nxt = dict(itertools.pairwise(with_params))
        for r in range(n):
            if r == (with_params[0] if with_params else -1):
                h2d = ready[r] = max(h2d, comp) + self._h2d(r)
                resident += costs[r].param_bytes
            if r in nxt:  # prefetch the next region while this one computes
                h2d = ready[nxt[r]] = max(h2d, comp) + self._h2d(nxt[r])
                resident += costs[nxt[r]].param_bytes
            comp = max(comp, ready[r]) + costs[r].fwd_time
            self._account(r, resident, fwd=True)
            if regions[r].need_offload:
                resident -= costs[r].param_bytes
        pending: list[tuple[float, int]] = []  # (download end, region) not yet freed
        prefetched: set[int] = set()
        for r in reversed(range(n)):
            reg = regions[r]
            still = []
            for end, q in pending:  # free what finished downloading before this region starts
                if end <= comp:
                    resident -= costs[q].param_bytes
                else:
                    still.append((end, q))
            pending = still
            # An offloaded region nobody prefetches is uploaded when reached, as at run time.
            if reg.need_offload and (reg.is_syn or r not in prefetched):
                h2d = ready[r] = max(h2d, comp) + self._h2d(r)
                resident += costs[r].param_bytes
            target = reg.bwd_prefetch_region
            if target is not None:
                h2d = ready[target.r_id] = max(h2d, comp) + self._h2d(target.r_id)
                resident += costs[target.r_id].param_bytes
                prefetched.add(target.r_id)
            start = max(comp, ready[r]) if reg.need_offload else comp
            comp = start + costs[r].bwd_time
            self._account(r, resident, fwd=False)
            if costs[r].grad_bytes:
                d2h = max(d2h, comp) + self._d2h(r)
                pending.append((d2h, r))
        self.step_time = max(comp, d2h)
        return self
