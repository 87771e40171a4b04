"""RegionManager: cut the linearized graph into regions and plan their offload.

[Note: region cuts] A region boundary is placed only where exactly one
gradient-carrying value crosses it (the residual stream between two
transformer sub-blocks, say). The runtime wraps that value in an autograd
function whose backward runs once every later use of the value has
produced its gradient, which is exactly when the region before it starts
its backward: the moment to upload (or wait for) its parameters. Before a
node that reads a not-yet-seen parameter, a new region starts at the latest
such cut after the previous parameter read (before an RMSNorm's arithmetic,
say, not at its weight multiply). A parameter belongs to the first region that reads
it; if a later region reads it too (tied embeddings, any number of them),
its owner is ``shared`` and stays resident from its forward to its
backward, which is the last one to touch it, so every reader finds it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch
import torch.fx

from zerostack.auto_offload._profile import HardwareProfile
from zerostack.auto_offload._region import Region
from zerostack.auto_offload._simulator import ActivationProfile, RegionCost, region_costs
from zerostack.auto_offload._solver import Solver, SolverFactory
from zerostack.auto_offload._trace import NodeInfo

logger = logging.getLogger(__name__)


class RegionManager:
    """Builds the regions of a traced model and runs the solver on them.

    Args:
        graph_module: the traced module (its parameters are the model's).
        node_infos: :func:`~zerostack.auto_offload.propagate` of it.
        profile: the hardware rates.
        solver_name: "syn" or "asyn". Default "asyn".
        memory_budget: bytes; ``<= 0`` means the device's memory. Default -1.
        baseline_bytes: memory held throughout (inputs, buffers). Default 0.
        search_interval_bytes: step of the block-size search. Default 1024.
        search_range_bytes: how far above the largest region it looks. Default 128 MiB.

    Raises:
        ValueError: an unknown ``solver_name`` or a graph without nodes.
    """

    def __init__(
        self,
        graph_module: torch.fx.GraphModule,
        node_infos: Sequence[NodeInfo],
        profile: HardwareProfile,
        solver_name: str = "asyn",
        memory_budget: float = -1.0,
        baseline_bytes: int = 0,
        search_interval_bytes: int = 1024,
        search_range_bytes: int = 128 * 1024**2,
    ) -> None:
        self.solver_cls = SolverFactory.create(solver_name)
        if not node_infos:
            raise ValueError("RegionManager: the graph has no compute nodes")
        self.graph_module = graph_module
        self.nodes = list(node_infos)
        self.profile = profile
        self.solver_name = solver_name
        self.memory_budget = memory_budget
        self.baseline_bytes = baseline_bytes
        self.search_interval_bytes = search_interval_bytes
        self.search_range_bytes = search_range_bytes
        self.region_list: list[Region] = []
        self.param_region_map: dict[torch.nn.Parameter, Region] = {}
        self.mem_block_size = 0
        self.activations: ActivationProfile | None = None
        self.costs: list[RegionCost] = []
        self.solver: Solver | None = None

    # -- public --------------------------------------------------------------

    def build_regions(self) -> Solver:
        """Linearize, cut, merge, then solve; returns the solver (its
        ``best_ts`` is the chosen plan's simulation).

        Raises:
            MemoryBudgetError: no plan fits the budget.
        """
        regions = self._linearize_graph()
        self.mem_block_size = self._search_block_size(regions)
        self.region_list = self._merge_small_regions(regions)
        for i, reg in enumerate(self.region_list):
            reg.r_id = i
        self.param_region_map = {p: reg for reg in self.region_list for p in reg.params}
        self.activations = ActivationProfile(self.nodes)  # See [Note: memory model]
        self.costs = region_costs(self.region_list, self.activations, self.profile)
        self.solver = self.solver_cls(
            self.region_list, self.costs, self.profile, self.memory_budget,
            baseline_bytes=self.baseline_bytes,
        )  # fmt: skip
        self.solver._call_solver()
        self._link_forward_prefetch()
        logger.info("auto_offload: %s", self.solver.describe())
        return self.solver

    def get_region(self, param: torch.nn.Parameter) -> Region:
        """The region that owns ``param``.

        Raises:
            KeyError: ``param`` is not a parameter of the traced model.
        """
        try:
            return self.param_region_map[param]
        except KeyError:
            raise KeyError(
                "RegionManager.get_region: not a parameter of the traced model"
            ) from None

    # -- cutting -------------------------------------------------------------

    def _clean_cuts(self) -> dict[int, torch.fx.Node]:
        """Positions k (cut before compute node k) where exactly one
        gradient-carrying value crosses, and that value. See [Note: region cuts]."""
        index = {info.node: info.index for info in self.nodes}
        end = len(self.nodes)
        last_use: dict[int, int] = {}
        for info in self.nodes:
            if not info.requires_grad:
                continue
            uses = [index.get(u, end) for u in info.node.users]  # the output node counts as the end
            if uses:
                last_use[info.index] = max(uses)
        cuts: dict[int, torch.fx.Node] = {}
        live: set[int] = set()
        for k in range(1, end):
            live.add(k - 1)
            live = {i for i in live if last_use.get(i, -1) >= k}
            if len(live) == 1:
                cuts[k] = self.nodes[next(iter(live))].node
        return cuts

    def _boundaries(self) -> dict[int, torch.fx.Node]:
        """Where regions start: at the latest clean cut between the previous
        parameter read and the next read of a not-yet-seen parameter."""
        cuts = self._clean_cuts()
        seen: set[int] = set()
        starts: dict[int, torch.fx.Node] = {}
        last_read = None
        for info in self.nodes:
            new = any(id(p) not in seen for p in info.params)
            if new and last_read is not None:
                k = next((k for k in range(info.index, last_read, -1) if k in cuts), None)
                if k is not None:
                    starts[k] = cuts[k]
            if info.params:
                last_read = info.index
                seen.update(id(p) for p in info.params)
        return starts

    def _linearize_graph(self) -> list[Region]:
        """First cut: a region per parameter-reading run of nodes."""
        starts = self._boundaries()
        owner: dict[int, Region] = {}
        readers: dict[int, set[int]] = {}
        region = Region(r_id=0)
        regions = [region]
        for info in self.nodes:
            if info.index in starts:
                region = Region(r_id=len(regions))
                region.cut_node = starts[info.index]
                regions.append(region)
            region.nodes.append(info)
            for p in info.params:
                if id(p) not in owner:
                    owner[id(p)] = region
                    region.params.append(p)
                    if p.requires_grad:
                        region.grad_params.append(p)
                readers.setdefault(id(p), set()).add(region.r_id)
        for pid, rids in readers.items():
            if len(rids) > 1:
                owner[pid].shared = True
        self._adopt_unread(owner, regions)
        return regions

    def _adopt_unread(self, owner: dict[int, Region], regions: list[Region]) -> None:
        """Parameters no node reads still get a region (the last one with
        parameters); they get no gradient and are not waited for."""
        home = next((r for r in reversed(regions) if r.params), regions[-1])
        seen: set[int] = set()
        for p in self.graph_module.parameters():
            if id(p) not in owner and id(p) not in seen:
                seen.add(id(p))
                home.params.append(p)
                logger.info("auto_offload: a parameter of shape %s is never read", tuple(p.shape))

    # -- merging -------------------------------------------------------------

    @staticmethod
    def _wasted(sizes: list[int], block: int) -> int:
        """Bytes left empty when ``sizes`` fill blocks of ``block`` in order."""
        waste, left = 0, 0
        for s in sizes:
            if left + s > block:
                waste += block - left
                left = 0
            left += s
        return waste + block - left

    def _search_block_size(self, regions: list[Region]) -> int:
        """The block size that wastes least, from the largest mergeable region
        up to ``search_range_bytes`` more, at most twice the largest."""
        sizes = [r.param_bytes for r in regions if r.offloadable]
        if not sizes:
            return max((r.param_bytes for r in regions), default=0)
        start = max(sizes)
        # Up to twice the largest region: a larger block would merge a small
        # model into one region and leave the solver nothing to choose.
        span = min(self.search_range_bytes, start)
        # At most ~4096 candidates: the search stays well under a second.
        step = max(self.search_interval_bytes, span // 4096, 1)
        best, best_waste = start, None
        for block in range(start, start + span + 1, step):
            waste = self._wasted(sizes, block)
            if best_waste is None or waste < best_waste:
                best, best_waste = block, waste
        return best

    def _merge_small_regions(self, regions: list[Region]) -> list[Region]:
        """Merge runs of consecutive offloadable regions up to the block size
        (fewer, larger transfers); shared and gradient-less regions stay alone."""
        out: list[Region] = []
        for reg in regions:
            prev = out[-1] if out else None
            if (
                prev is not None
                and reg.offloadable
                and prev.offloadable
                and prev.param_bytes + reg.param_bytes <= self.mem_block_size
            ):
                prev.nodes.extend(reg.nodes)
                prev.params.extend(reg.params)
                prev.grad_params.extend(reg.grad_params)
            else:
                out.append(reg)
        return out

    def _link_forward_prefetch(self) -> None:
        with_params = [r for r in self.region_list if r.params]
        for a, b in itertools.pairwise(with_params):
            a.fwd_prefetch_region = b
