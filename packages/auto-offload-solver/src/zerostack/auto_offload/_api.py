"""memory_optimize: trace, plan and rewrite a model for offloaded training."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch.utils._pytree import tree_map

from zerostack.auto_offload._module import BaseOffloadModule
from zerostack.auto_offload._profile import HardwareProfile
from zerostack.auto_offload._region_manager import RegionManager
from zerostack.auto_offload._runtime import (
    runtime_asyn_offload_apply_pass,
    runtime_syn_offload_apply_pass,
)
from zerostack.auto_offload._solver import SolverFactory
from zerostack.auto_offload._trace import propagate, retarget_devices, trace_model
from zerostack.shard import fix_structure

logger = logging.getLogger(__name__)

_PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16}
_FIXED = (  # why a submodule assigned after memory_optimize is refused
    "the traced graph holds the parameters it was traced with: the forward, the steps and "
    "state_dict() would go on with the old ones"
)


def _cast_input(dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype)
        return x

    return cast


def plan_offload(
    model: torch.nn.Module,
    inputs: dict | tuple,
    memory_budget: float = -1.0,
    solver_name: str = "asyn",
    *,
    precision: str = "fp16",
    profile: HardwareProfile | None = None,
):
    """Trace ``model`` (cast in place to ``precision``) and plan its offload,
    without touching any device. Returns ``(graph_module, region_manager,
    masters)`` where ``masters`` maps ``id(param)`` to its value before the cast.

    Arguments as in :func:`memory_optimize`; ``profile`` is required here.
    """
    if precision not in _PRECISIONS:
        raise ValueError(
            f"memory_optimize: precision must be one of {sorted(_PRECISIONS)} (got {precision!r})"
        )
    SolverFactory.create(solver_name)  # a bad name fails before the slow work
    if profile is None:
        raise ValueError(
            "plan_offload: pass a HardwareProfile (HardwareProfile.measure() on a GPU)"
        )
    dtype = _PRECISIONS[precision]
    model = model.cpu()
    # Keep each parameter's full-precision value for its master (no copy).
    masters = {id(p): p.data for p in model.parameters()}
    model.to(dtype)
    inputs = tree_map(_cast_input(dtype), inputs)
    gm = trace_model(model, inputs)
    infos = propagate(gm, inputs)
    flat = [x for x in torch.utils._pytree.tree_flatten(inputs)[0] if isinstance(x, torch.Tensor)]
    baseline = sum(x.numel() * x.element_size() for x in flat)
    baseline += sum(b.numel() * b.element_size() for b in gm.buffers())
    manager = RegionManager(
        gm, infos, profile, solver_name=solver_name, memory_budget=memory_budget,
        baseline_bytes=baseline,
    )  # fmt: skip
    manager.build_regions()
    return gm, manager, masters


def memory_optimize(
    model: torch.nn.Module,
    inputs: dict | tuple,
    memory_budget: float = -1.0,
    solver_name: str = "asyn",
    *,
    precision: str = "fp16",
    profile: HardwareProfile | None = None,
    device: torch.device | str | None = None,
) -> BaseOffloadModule:
    """Make ``model`` train within ``memory_budget`` bytes of device memory.

    The model is cast to ``precision`` (its parameters' full-precision values
    become the fp32 masters on the host), traced with ``torch.export`` on fake
    tensors, measured per node on meta tensors, cut into regions, planned by
    the ``solver_name`` solver against ``profile``, and rewritten with the
    upload/offload/prefetch ops. Train it with :class:`AMPOptimizer`.

    Args:
        model: the model (moved to the CPU; its parameter objects are kept).
        inputs: one batch as keyword arguments (dict) or positional ones
            (tuple); the module is specialised to these shapes.
        memory_budget: bytes of device memory; ``<= 0`` means all of it. Default -1.
        solver_name: "asyn" (prefetch on side streams) or "syn". Default "asyn".
        precision: "fp16" (with loss scaling) or "bf16". Default "fp16".
        profile: the hardware rates. Default: ``HardwareProfile.measure(device)``
            (on a CPU device: measured once per process; 0.3-1.2 s on a shared 2-core host).
        device: the compute device. Default: the current CUDA device. A CPU
            device runs the same plan with host copies, to test the mechanics.

    Returns:
        The :class:`BaseOffloadModule`; ``.region_manager.solver`` holds the
        plan and its predicted peak (``best_ts.peak_mem``) and step time.

    Raises:
        TypeError: ``model``, ``inputs``, ``memory_budget``, ``profile`` or
            ``device`` of the wrong type.
        ValueError: an unknown ``solver_name`` or ``precision``, a NaN
            ``memory_budget``, a ``device`` string that names no device.
        MemoryBudgetError: no plan fits; its message states the least budget.
        RuntimeError: no CUDA device and none named (pass ``device="cpu"``
            to run the mechanics on the CPU).
    """
    _check_args(model, inputs, memory_budget, profile, device)
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "memory_optimize: no CUDA device; offloading needs one (pass device='cpu' to "
                "exercise the plan on the CPU, without any memory saving)"
            )
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if profile is None:
        profile = HardwareProfile.measure(device)
    gm, manager, masters = plan_offload(
        model, inputs, memory_budget, solver_name, precision=precision, profile=profile
    )
    retarget_devices(gm, torch.device("cpu"), device)  # See [Note: tracer choice]
    dtype = _PRECISIONS[precision]
    for region in manager.region_list:
        if region.params:
            region.init_param_data(device, dtype, masters)
    apply = (
        runtime_syn_offload_apply_pass if solver_name == "syn" else runtime_asyn_offload_apply_pass
    )
    gm = apply(gm, manager.region_list, device)
    module = BaseOffloadModule(gm, manager, solver_name == "syn", dtype=dtype, device=device)
    for tree in (model, gm):  # See [Note: the structure is fixed once wrapped] in zero-shard
        fix_structure(module, tree, "memory_optimize", _FIXED)
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    flat = [inputs[n] for n in names] if isinstance(inputs, dict) else list(inputs)
    module.input_shapes = {
        n: tuple(x.shape) for n, x in zip(names, flat, strict=False) if isinstance(x, torch.Tensor)
    }
    return module


def _check_args(model: Any, inputs: Any, memory_budget: Any, profile: Any, device: Any) -> None:
    """memory_optimize's argument types, before anything is traced or moved."""
    api = "memory_optimize"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{api}: model must be an nn.Module (got {type(model).__name__})")
    if not isinstance(inputs, dict | tuple):
        raise TypeError(
            f"{api}: inputs must be a dict (keyword arguments) or a tuple (positional ones) "
            f"(got {type(inputs).__name__})"
        )
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int | float):
        raise TypeError(
            f"{api}: memory_budget must be a number of bytes (got {memory_budget!r}); <= 0 means "
            "all of the device's memory"
        )
    if math.isnan(memory_budget):
        raise ValueError(f"{api}: memory_budget must be a number of bytes (got nan)")
    if profile is not None and not isinstance(profile, HardwareProfile):
        raise TypeError(
            f"{api}: profile must be a HardwareProfile or None (got {type(profile).__name__}); "
            "build it with HardwareProfile.from_dict or HardwareProfile.measure"
        )
    if device is not None and not isinstance(device, str | torch.device):
        raise TypeError(f"{api}: device must be a str, a torch.device or None (got {device!r})")
    if isinstance(device, str):
        try:
            torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"{api}: device is not a device (got {device!r})") from error
