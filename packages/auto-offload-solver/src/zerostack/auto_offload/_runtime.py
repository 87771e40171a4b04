"""Graph passes that insert the upload / offload / prefetch ops, and the ops.

At every region boundary (see [Note: region cuts]) the one gradient-carrying
value that crosses it goes through :class:`OffloadRuntime` (a submodule of
the graph module, so the graph stays a plain ``call_module``). Its forward
frees the previous region if the plan offloads it, then makes this region's
parameters ready (synchronous upload, or a wait on the event of the
prefetch issued one region earlier) and, in the asynchronous mode, issues the
next region's prefetch on the H2D stream. Its backward runs when the region
before the boundary starts its backward: it makes that region ready again
(waits for its prefetch, or uploads it) and issues the prefetch the plan
hosts there. ColossalAI's asynchronous op never freed offloaded regions in
forward; here both modes do.
"""

from __future__ import annotations

import torch
import torch.fx

from zerostack.auto_offload._region import Region

RUNTIME_NAME = "_zerostack_offload"


class _BoundaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, runtime, fwd_info, bwd_info):
        ctx.runtime, ctx.bwd_info = runtime, bwd_info
        runtime.forward_actions(fwd_info)
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.runtime.backward_actions(ctx.bwd_info)
        return grad, None, None, None


class OffloadRuntime(torch.nn.Module):
    """The streams, events and actions of one offloaded module.

    Args:
        regions: the planned regions.
        is_sync: every transfer on the compute stream (the "syn" plan).
        device: the compute device (a CPU device runs the same actions with
            plain copies: for tests of the mechanics, with no memory saving).
    """

    def __init__(self, regions: list[Region], is_sync: bool, device: torch.device) -> None:
        super().__init__()
        self.regions = regions
        self.is_sync = is_sync
        self.device = device
        cuda = device.type == "cuda"
        self.h2d_stream = torch.cuda.Stream(device) if cuda and not is_sync else None
        self.d2h_stream = torch.cuda.Stream(device) if cuda and not is_sync else None
        self.fwd_events: dict[int, torch.cuda.Event] = {}
        self.bwd_events: dict[int, torch.cuda.Event] = {}

    def forward(self, x, fwd_info: dict, bwd_info: dict):
        """Run the boundary's forward actions; ``x`` passes through (and, when it
        needs grad, carries ``bwd_info`` into backward)."""
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            return _BoundaryFn.apply(x, self, fwd_info, bwd_info)
        self.forward_actions(fwd_info)
        return x

    # -- actions -------------------------------------------------------------

    def forward_actions(self, info: dict) -> None:
        with torch.profiler.record_function("zerostack::offload_fwd"):
            if "free" in info:
                self.regions[info["free"]].free_cuda_data()
            if "upload" in info:
                self._ready(info["upload"], self.fwd_events)
            if "prefetch" in info:
                self._prefetch(info["prefetch"], self.fwd_events)

    def backward_actions(self, info: dict) -> None:
        with torch.profiler.record_function("zerostack::offload_bwd"):
            if "upload" in info:
                self._ready(info["upload"], self.bwd_events)
            if "prefetch" in info:
                self._prefetch(info["prefetch"], self.bwd_events)

    def _ready(self, rid: int, events: dict) -> None:
        """Make region ``rid`` usable on the current stream: wait for its
        prefetch if one was issued, else upload it now."""
        event = events.pop(rid, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            return
        region = self.regions[rid]
        if not region.is_resident:
            region.move_param_to_cuda()

    def _prefetch(self, rid: int, events: dict) -> None:
        region = self.regions[rid]
        if self.h2d_stream is None:  # synchronous mode, or a CPU device
            region.move_param_to_cuda()
            return
        main = torch.cuda.current_stream(self.device)
        # The storage is grown on the compute stream (its allocator pool);
        # the copy waits for everything queued there, since the memory may
        # have been freed by work still in flight.
        storage = region.cuda_data.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(region.cuda_data.numel() * region.cuda_data.element_size())
        self.h2d_stream.wait_stream(main)
        with torch.cuda.stream(self.h2d_stream):
            region.cuda_data.copy_(region.cpu_half, non_blocking=True)
        region.cuda_data.record_stream(self.h2d_stream)
        event = torch.cuda.Event()
        event.record(self.h2d_stream)
        events[rid] = event

    def offload_grads(self, region: Region) -> None:
        """Download a region's finished gradients and free its buffer, behind
        compute in the asynchronous mode."""
        if self.d2h_stream is None:
            region.move_grad_to_cpu()
            return
        self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            region.cuda_data.record_stream(self.d2h_stream)
            region.move_grad_to_cpu()

    def finish(self) -> None:
        """After backward: wait for the downloads, drop stale events, free
        what is still resident (regions without gradients). Before the host
        rewrites the half copies (a step, a load): the same, for what a
        forward that no backward followed left resident (an evaluation
        under ``torch.no_grad()``, or a forward that raised), so the next
        forward uploads the new values and no copy in flight reads them."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.fwd_events.clear()
        self.bwd_events.clear()
        for region in self.regions:
            if region.is_resident:
                region.free_cuda_data()


def _insert_boundary(gm, runtime_node_target, before, value, fwd_info, bwd_info):
    """Insert ``value' = runtime(value, fwd, bwd)`` before ``before`` and make
    the readers of ``value`` from ``before`` on read ``value'``. See [Note: region cuts]."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(before):
        new = graph.call_module(runtime_node_target, args=(value, fwd_info, bwd_info))
    if value is not None:
        for user in list(value.users):
            if user is not new and order.get(user, len(order)) >= order[before]:
                user.replace_input_with(value, new)
    return new


def _apply_pass(
    gm: torch.fx.GraphModule, regions: list[Region], runtime: OffloadRuntime, asyn: bool
):
    gm.add_submodule(RUNTIME_NAME, runtime)
    for idx, region in enumerate(regions):
        fwd, bwd = {}, {}
        prev = regions[idx - 1] if idx else None
        if prev is not None and prev.need_offload:
            fwd["free"] = prev.r_id
            bwd["upload"] = prev.r_id
        if prev is not None and prev.bwd_prefetch_region is not None:
            bwd["prefetch"] = prev.bwd_prefetch_region.r_id
        if region.params:
            fwd["upload"] = region.r_id
            if asyn and region.fwd_prefetch_region is not None:
                fwd["prefetch"] = region.fwd_prefetch_region.r_id
        if idx and region.cut_node is None and bwd:
            raise AssertionError(
                f"auto_offload: region {idx} has no boundary value for its backward"
            )
        if fwd or bwd:
            _insert_boundary(gm, RUNTIME_NAME, region.nodes[0].node, region.cut_node, fwd, bwd)
    last = regions[-1]
    if last.bwd_prefetch_region is not None:
        # The last region's backward starts when the output's gradient arrives.
        out = next(n for n in gm.graph.nodes if n.op == "output")
        infos = {n.node: n for r in regions for n in r.nodes}
        value = next(
            (a for a in out.all_input_nodes if a in infos and infos[a].requires_grad), None
        )
        if value is None:
            raise AssertionError("auto_offload: a prefetch is planned but no output needs grad")
        _insert_boundary(
            gm, RUNTIME_NAME, out, value, {}, {"prefetch": last.bwd_prefetch_region.r_id}
        )
    gm.graph.lint()
    gm.recompile()
    return gm


def runtime_syn_offload_apply_pass(
    gm: torch.fx.GraphModule, region_list: list[Region], device: torch.device
) -> torch.fx.GraphModule:
    """Insert synchronous upload/offload ops (every transfer on the compute stream)."""
    return _apply_pass(gm, region_list, OffloadRuntime(region_list, True, device), asyn=False)


def runtime_asyn_offload_apply_pass(
    gm: torch.fx.GraphModule, region_list: list[Region], device: torch.device
) -> torch.fx.GraphModule:
    """Insert prefetching upload/offload ops (H2D and D2H on side streams, with events)."""
    return _apply_pass(gm, region_list, OffloadRuntime(region_list, False, device), asyn=True)
