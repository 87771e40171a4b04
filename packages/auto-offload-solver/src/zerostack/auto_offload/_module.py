"""BaseOffloadModule: the offloaded model as training code calls it."""

from __future__ import annotations

import weakref
from typing import cast

import torch
import torch.fx
from torch.utils._pytree import tree_unflatten

from zerostack.auto_offload._region import Region
from zerostack.auto_offload._region_manager import RegionManager
from zerostack.auto_offload._runtime import RUNTIME_NAME, OffloadRuntime
from zerostack.shard import ShardedGradient


def _grad_ready(module_ref, param: torch.nn.Parameter) -> None:
    module = module_ref()
    if module is not None:
        module._grad_ready(param)


class BaseOffloadModule:
    """A model whose parameters move between host and device by a plan.

    Built by :func:`~zerostack.auto_offload.memory_optimize`. Each
    parameter's gradient is folded into its region's device buffer as soon as
    it is complete; when a region has all of them, their norm is added on the
    device and they are copied to pinned host memory (behind compute, in the
    asynchronous plan) and the buffer is freed.

    Args:
        model: the graph module with the offload ops inserted.
        region_manager: the manager that planned it.
        is_sync: the plan is "syn". Default True.
        dtype: the compute dtype (float16 or bfloat16).
        device: the compute device.
    """

    def __init__(
        self,
        model: torch.fx.GraphModule,
        region_manager: RegionManager,
        is_sync: bool = True,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.region_manager = region_manager
        self.is_sync = is_sync
        self.dtype = dtype
        self.device = device
        self.runtime = cast(OffloadRuntime, model.get_submodule(RUNTIME_NAME))
        self._input_names = [n.target for n in model.graph.nodes if n.op == "placeholder"]
        self._out_spec = getattr(model, "zerostack_out_spec", None)
        self.input_shapes: dict[str, tuple[int, ...]] = {}
        """Traced shape of each tensor input, by name (set by memory_optimize)."""
        self.regions: list[Region] = region_manager.region_list
        self._norm_sq = torch.zeros((), dtype=torch.float32, device=device)
        self.grads_ready = False
        """A backward's gradients wait in the host buffers for the optimizer."""
        self._param_region: dict[torch.nn.Parameter, Region] = {}
        # From a backward to the step, each trained parameter's .grad is a
        # guard that raises on use (torch's clip_grad_norm_ would otherwise
        # read None and clip nothing): the gradient lives in the region buffer.
        self._guards: dict[torch.nn.Parameter, ShardedGradient] = {}
        self._hooks = []
        ref = weakref.ref(self)
        for region in self.regions:
            for p in region.grad_params:
                self._param_region[p] = region
                self._guards[p] = ShardedGradient(p.shape, p.dtype, p.device, "AMPOptimizer")
                # Built once; holds the module weakly (no cycle through the hook).
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda p, ref=ref: _grad_ready(ref, p)
                ))  # fmt: skip
        # Whether each parameter trains is fixed by the plan (the regions'
        # gradient buffers and the optimizer's masters): checked at forward.
        self._trained_at_plan = [(n, p, p.requires_grad) for n, p in model.named_parameters()]
        # Buffers and lifted constants the graph reads go to the device once.
        for node in model.graph.nodes:
            if node.op != "get_attr":
                continue
            owner, _, attr = node.target.rpartition(".")
            holder = model.get_submodule(owner)
            value = getattr(holder, attr)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                if attr in holder._buffers:
                    holder._buffers[attr] = value.to(device)
                else:
                    setattr(holder, attr, value.to(device))

    # -- calling -------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def _cast(self, x):
        if isinstance(x, torch.Tensor):
            x = x.to(self.device, non_blocking=True)
            return x.to(self.dtype) if x.is_floating_point() else x
        return x

    def _flat_inputs(self, args: tuple, kwargs: dict) -> list:
        """The graph's inputs in placeholder order (no pytree: see
        ``_plain_calling``)."""
        if len(args) > len(self._input_names):
            raise TypeError(
                f"BaseOffloadModule: {len(args)} positional inputs for a graph that takes "
                f"{len(self._input_names)} ({self._input_names})"
            )
        unknown = set(kwargs) - set(self._input_names[len(args) :])
        missing = [n for n in self._input_names[len(args) :] if n not in kwargs]
        if unknown or missing:
            raise TypeError(
                f"BaseOffloadModule: the traced inputs are {self._input_names} (unknown "
                f"{sorted(unknown)}, missing {missing}); call it as it was traced"
            )
        flat = [*args, *(kwargs[n] for n in self._input_names[len(args) :])]
        for name, x in zip(self._input_names, flat, strict=True):
            want = self.input_shapes.get(name)
            if want is not None and isinstance(x, torch.Tensor) and tuple(x.shape) != want:
                raise ValueError(
                    f"BaseOffloadModule: input {name!r} has shape {tuple(x.shape)} but the module "
                    f"was traced and planned for {want}; run memory_optimize for that shape"
                )
        return [self._cast(x) for x in flat]

    def forward(self, *args, **kwargs):
        """Run the model on the traced inputs (floating tensors cast to the
        compute dtype, every tensor moved to the device).

        Raises:
            TypeError: inputs other than those traced.
            NotImplementedError: a parameter's ``requires_grad`` changed
                since the plan was made.
        """
        flat = self._flat_inputs(args, kwargs)
        self._check_requires_grad()
        self.sync_halves()
        for region in self.regions:
            region.grad_numel_done = 0
        out = self.model(*flat)
        if self._out_spec is None:
            return out
        return tree_unflatten(list(out), self._out_spec)

    def _check_requires_grad(self) -> None:
        """A parameter frozen after the plan left its region waiting for its
        gradient (the backward then raised naming the loss); one unfrozen
        after it had no master and never trained, silently."""
        changed = [
            (n, p.requires_grad) for n, p, was in self._trained_at_plan if p.requires_grad != was
        ]
        if changed:
            raise NotImplementedError(
                "BaseOffloadModule.forward: requires_grad changed after memory_optimize (or "
                f"booster.boost with AutoOffloadPlugin) planned which parameters train (got "
                f"{', '.join(f'{n} requires_grad={g}' for n, g in changed[:3])}); set "
                "requires_grad before memory_optimize (to stop training parameters later, give "
                "them a parameter group of their own before booster.boost and set its lr to 0)"
            )

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, then wait for the gradient downloads.

        Raises:
            RuntimeError: a region did not receive all its gradients (the loss
                does not depend on some trained parameter), or the last
                backward's gradients were not consumed yet (there is no
                gradient accumulation: the host buffers hold one backward).
        """
        if self.grads_ready:
            raise RuntimeError(
                "BaseOffloadModule.backward: the previous backward's gradients are still waiting; "
                "call AMPOptimizer.step() or zero_grad() between backwards (no gradient accumulation)"
            )
        loss.backward()
        self._post_backward()
        self.grads_ready = True

    def _post_backward(self) -> None:
        self.runtime.finish()
        for region in self.regions:
            if region.grad_numel_done:
                got, want = region.grad_numel_done, region.grad_numel
                region.grad_numel_done = 0
                raise RuntimeError(
                    f"BaseOffloadModule.backward: region {region.r_id} got {got} of {want} gradient "
                    "elements; every trained parameter must take part in the loss"
                )

    def _grad_ready(self, param: torch.nn.Parameter) -> None:
        # The gradient overwrites the parameter's slice of the region buffer:
        # every use of the parameter is done once its gradient is complete.
        # See [Note: region storage].
        region = self._param_region[param]
        with torch.profiler.record_function("zerostack::grad_to_region"):
            region.copy_grad_to_region_slice(param, param.grad)
            param.grad = self._guards[param]
            if region.can_release:
                self._norm_sq += region.grad_norm_sq()
                self.runtime.offload_grads(region)

    def sync_halves(self, every_region: bool = False) -> None:
        """Copy into the half copy the next forward uploads every region's fp32
        masters that were written since their half copy last matched them
        (``every_region``: all of them, written or not).

        [Note: half copies follow the masters] A region's masters are views
        of one host buffer and share its version counter, which every write
        through torch moves: a torch optimizer's step, a step hook, a load, or
        the user's own edit between steps (``with torch.no_grad():
        master.mul_(0.9)`` on ``master_parameters()`` or the optimizer's
        params). fused-adam's kernels write the half copy with the master
        (copy-out) and move no counter. So the step, a load and every forward
        call this: a region whose counter moved is copied whole (after the
        runtime let go of what a forward left resident), and one that did
        not costs nothing. Before, a master written between steps stayed out
        of the forwards until the next step overwrote it. An optimizer that
        writes through ``p.data`` moves no counter: the step of any
        optimizer but fused-adam's copies every region.
        """
        stale = [
            r
            for r in self.regions
            if r.params and (every_region or r.cpu_master._version != r.half_version)
        ]
        if not stale:
            return
        self.runtime.finish()  # nothing resident or in flight keeps or reads the old copy
        with torch.no_grad():
            for region in stale:
                region.cpu_half.copy_(region.cpu_master)
                region.half_version = region.cpu_master._version

    # -- gradients -----------------------------------------------------------

    def grad_norm_sq(self) -> torch.Tensor:
        """The squared L2 norm of all gradients of the last backward, on the device."""
        return self._norm_sq

    def zero_grad(self) -> None:
        """Forget the last backward's gradients (and their norm)."""
        self._norm_sq.zero_()
        self.grads_ready = False
        for p in self._guards:
            p.grad = None

    # -- nn.Module-like ------------------------------------------------------

    def master_parameters(self) -> list[torch.nn.Parameter]:
        """fp32 CPU masters, one per owned parameter, views of the regions'
        host buffers, in the order of ``parameters()`` (the model's, as
        torch's optimizers number their states: a state saved from an
        optimizer built on either list loads into one built on the other):
        build the optimizer on these (or on ``parameters()``;
        :class:`AMPOptimizer` swaps those for these)."""
        if not hasattr(self, "_masters"):
            self._masters: dict[torch.nn.Parameter, torch.nn.Parameter] = {}
            for region in self.regions:
                for p in region.params:
                    begin, end = region.param_to_range[p]
                    m = torch.nn.Parameter(
                        region.cpu_master[begin:end].view(p.shape), requires_grad=p.requires_grad
                    )
                    if hasattr(m, "grad_dtype"):
                        m.grad_dtype = None  # torch >= 2.10: half gradients stepped as they came
                    self._masters[p] = m
        return [self._masters[p] for p in self.model.parameters() if p in self._masters]

    def master_of(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """The fp32 master of a model parameter."""
        self.master_parameters()
        return self._masters[param]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights by the model's names: each parameter's fp32 master (on
        the host; tied names share one tensor) and each buffer, detached. The
        device copies are not used: between steps their storage is freed."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            out[name] = self.master_of(p).detach()
        for name, b in self.model.named_buffers():
            out[name] = b.detach()
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights by name into the masters (and the half copies the next
        forward uploads) and the buffers.

        Raises:
            KeyError: a parameter or buffer of the model is missing, or a name
                is unknown.
            ValueError: a shape differs.
        """
        params = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(self.model.named_buffers())
        missing = sorted((set(params) | set(buffers)) - set(state))
        unknown = sorted(set(state) - set(params) - set(buffers))
        if missing or unknown:
            raise KeyError(
                f"BaseOffloadModule.load_state_dict: missing {missing}, unknown {unknown}"
            )
        self.runtime.finish()  # nothing resident keeps the old values
        with torch.no_grad():
            for name, value in state.items():
                target = self.master_of(params[name]) if name in params else buffers[name]
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(
                        f"BaseOffloadModule.load_state_dict: {name} has shape "
                        f"{tuple(value.shape)}, the model {tuple(target.shape)}"
                    )
                target.copy_(value)
        self.sync_halves()

    def placement_table(self) -> str:
        """Where every region's parameters live over a step, as a text table
        (the memory picture of zerostack-gemini's ``chunk_placement`` for this
        module): device bytes in the compute dtype, whether the region leaves
        the device between its forward and its backward, how it comes back,
        and the host bytes that stay (fp32 masters, the half copy, gradients).
        The plan's predicted peak and step time close it."""
        rows = ["| region | params | device MB | between forward and backward | upload for backward | host MB |",
                "|---|---|---|---|---|---|"]  # fmt: skip
        for r in self.regions:
            if not r.params:
                continue
            if r.need_offload:
                where, upload = "host", "synchronous" if r.is_syn else "prefetched"
            else:
                where, upload = "device (shared)" if r.shared else "device", "-"
            host = sum(t.numel() * t.element_size() for t in (r.cpu_master, r.cpu_half, r.cpu_grad)
                       if t is not None)  # fmt: skip
            rows.append(
                f"| {r.r_id} | {len(r.params)} | {r.param_bytes / 2**20:.2f} | {where} | "
                f"{upload} | {host / 2**20:.2f} |"
            )
        return "\n".join([*rows, "", self.region_manager.solver.describe()])

    def train(self, mode: bool = True) -> BaseOffloadModule:
        """Kept for API parity; the traced graph is fixed in training mode."""
        if not mode:
            raise NotImplementedError(
                "BaseOffloadModule.train(False): the graph was traced in training mode "
                "(dropout on); to evaluate, load module.state_dict() into a fresh model (the original "
                "model's parameters were moved into the plan's regions)"
            )
        return self

    def parameters(self, recurse: bool = True):
        """The model's (half-precision, device) parameters."""
        return self.model.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        return self.model.named_parameters(prefix, recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True):
        return self.model.named_buffers(prefix, recurse)

    def named_children(self):
        return self.model.named_children()

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        return self.model.named_modules(memo, prefix, remove_duplicate)
