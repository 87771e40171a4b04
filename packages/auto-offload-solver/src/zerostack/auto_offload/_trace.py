"""Tracing and per-node facts: shapes, bytes, saved activations, FLOPs.

[Note: tracer choice] transformers 5 removed ``transformers.utils.fx``, and
``torch.fx.symbolic_trace`` stops at the first data-dependent branch of a
GPT-2 or LLaMA forward ("symbolically traced variables cannot be used as
inputs to control flow"). ``torch.export.export`` traces both on fake
tensors (no memory, no compute) into the training IR: one flat graph of
aten ops that keeps ``linear``, ``layer_norm`` and
``scaled_dot_product_attention`` whole, whose ``module()`` reads the
model's own ``Parameter`` objects through ``get_attr``, and which autograd
trains as it stands. Its price: the graph is specialised to the traced
shapes (another shape is refused by the graph's guards) and device
constants of the trace (``arange(device=cpu)``) are baked in, so
:func:`retarget_devices` rewrites them for the device that runs it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

_PLACEHOLDER = -1  # owner index of storages that belong to inputs, params and buffers
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


@dataclass(slots=True)
class NodeInfo:
    """What the planner knows about one compute node of the linearized graph."""

    index: int
    """Position among the compute nodes (graph order)."""
    node: torch.fx.Node
    """The graph node."""
    inputs: tuple[int, ...] = ()
    """Indices of the compute nodes that own the storages this node reads."""
    params: tuple[torch.nn.Parameter, ...] = ()
    """Parameters this node reads (unique, graph order)."""
    out_bytes: int = 0
    """Bytes of new storage its outputs allocate (0 for views and in-place ops)."""
    grad_bytes: int = 0
    """Bytes of the gradient of its new outputs that require grad."""
    temp_bytes: int = 0
    """Bytes it saves for backward that are neither its inputs nor its outputs."""
    saves: tuple[int, ...] = ()
    """Owners (compute-node indices) of the activations it saves for backward."""
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes_moved: float = 0.0
    """Bytes read and written in forward (the memory side of the roofline)."""
    kernels: int = 0
    """Kernels launched in forward (0 for views and Python-level ops)."""
    requires_grad: bool = False
    """Some output requires grad (gradient flows through it)."""
    dtype: torch.dtype | None = None
    """Dtype of its first floating output."""
    param_grad_bytes: int = 0
    """Bytes of the gradients of the trainable parameters it reads (transient)."""
    is_output: bool = False
    """Some graph output is (a view of) one of its storages."""
    users: list[int] = field(default_factory=list)
    """Compute nodes that read a storage it owns (filled after propagation)."""


def trace_model(model: torch.nn.Module, inputs: dict | tuple) -> torch.fx.GraphModule:
    """Trace ``model`` on ``inputs`` with ``torch.export`` (see [Note: tracer choice]).

    Args:
        model: the model, on the CPU; only fake tensors are made from it.
        inputs: keyword arguments (dict) or positional arguments (tuple) of
            its forward; tensors may live anywhere (CPU stand-ins are traced).

    Returns:
        A ``GraphModule`` that reads ``model``'s own parameters.

    Raises:
        TypeError: ``inputs`` is neither a dict nor a tuple.
        RuntimeError: torch.export could not trace the model (its message).
    """
    if isinstance(inputs, dict):
        args, kwargs = (), inputs
    elif isinstance(inputs, tuple | list):
        args, kwargs = tuple(inputs), {}
    else:
        raise TypeError(
            f"trace_model: inputs must be a dict of keyword arguments or a tuple of positional "
            f"arguments (got {type(inputs).__name__})"
        )
    cpu = tree_map(_cpu_stand_in, (args, kwargs))
    try:
        exported = torch.export.export(model, cpu[0], cpu[1], strict=False)
    except Exception as err:
        raise RuntimeError(
            f"trace_model: torch.export could not trace {type(model).__name__} ({type(err).__name__}: "
            f"{err}); outputs must be tensors or tuples/dicts of them (e.g. pass use_cache=False to "
            "transformers models or wrap the model to return logits)"
        ) from err
    return _plain_calling(exported.module())


def _plain_calling(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Drop the exported module's pytree calling convention (its input-spec
    pre-hook and pytree codegen rebuild closures that form reference cycles on
    every call, i.e. garbage-collector work in every step). The module then
    takes its placeholders positionally and returns the flat outputs;
    ``gm.zerostack_out_spec`` rebuilds the original output structure. Input
    shapes are still checked by the graph's own guard node."""
    codegen = gm.graph._codegen
    out_spec = codegen.pytree_info.out_spec if hasattr(codegen, "pytree_info") else None
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm._forward_pre_hooks.clear()
    gm._forward_pre_hooks_with_kwargs.clear()
    gm._forward_hooks.clear()
    gm._forward_hooks_always_called.clear()
    gm.zerostack_out_spec = out_spec
    gm.recompile()
    return gm


def _cpu_stand_in(x):
    if isinstance(x, torch.Tensor):
        return torch.zeros(x.shape, dtype=x.dtype, device="cpu")
    return x


def retarget_devices(gm: torch.fx.GraphModule, src: torch.device, dst: torch.device) -> int:
    """Rewrite the ``src`` device constants baked into ``gm`` by the trace to
    ``dst``; returns how many arguments changed."""
    src, dst = torch.device(src), torch.device(dst)
    changed = 0

    def fix(a):
        nonlocal changed
        if isinstance(a, torch.device) and a.type == src.type:
            changed += 1
            return dst
        return a

    for node in gm.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, fix)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, fix)
    gm.recompile()
    return changed


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _meta_like(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return out.requires_grad_(requires_grad) if t.is_floating_point() else out


def _fetch_attr(gm: torch.nn.Module, target: str):
    obj = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


class _Propagator:
    """Runs each node on meta tensors once, in isolation: forward under a flop
    counter and a saved-tensor hook, then its own backward."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.env: dict[torch.fx.Node, object] = {}
        self.owner: dict[int, int] = {}  # storage key -> owning compute node (or _PLACEHOLDER)
        self.params: dict[torch.fx.Node, torch.nn.Parameter] = {}
        self.infos: list[NodeInfo] = []

    def _register(self, value, owner: int):
        """Record the owner of every storage in ``value``; returns ``value``."""
        flat, _ = tree_flatten(value)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self.owner.setdefault(_key(t), owner)
        return value

    def placeholder(self, node: torch.fx.Node, example) -> None:
        meta = tree_map(
            lambda t: _meta_like(t, False) if isinstance(t, torch.Tensor) else t, example
        )
        self.env[node] = self._register(meta, _PLACEHOLDER)

    def get_attr(self, node: torch.fx.Node) -> None:
        attr = _fetch_attr(self.gm, node.target)
        if isinstance(attr, torch.nn.Parameter):
            self.params[node] = attr
            value = _meta_like(attr, attr.requires_grad)
        elif isinstance(attr, torch.Tensor):
            value = _meta_like(attr, False)
        else:
            value = attr
        self.env[node] = self._register(value, _PLACEHOLDER)

    def call(self, node: torch.fx.Node) -> NodeInfo:
        info = NodeInfo(index=len(self.infos), node=node)
        params: list[torch.nn.Parameter] = []
        for n in node.all_input_nodes:
            p = self.params.get(n)
            if p is not None and not any(p is q for q in params):
                params.append(p)
        info.params = tuple(params)
        info.param_grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        # Device constants baked in by the trace run on meta here.
        args = torch.fx.node.map_aggregate(
            torch.fx.node.map_arg(node.args, self.env.__getitem__), _to_meta_device
        )
        kwargs = torch.fx.node.map_aggregate(
            torch.fx.node.map_arg(node.kwargs, self.env.__getitem__), _to_meta_device
        )
        in_flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        in_keys = {_key(t) for t in in_flat}
        info.inputs = tuple(sorted({self.owner[k] for k in in_keys if self.owner.get(k, -1) >= 0}))
        out, saved = self._run(node, info, args, kwargs, in_flat)
        out_flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        new = {}
        for t in out_flat:
            k = _key(t)
            if k not in in_keys and k not in self.owner:
                new[k] = t
                self.owner[k] = info.index
        info.out_bytes = sum(t.untyped_storage().nbytes() for t in new.values())
        info.grad_bytes = sum(t.untyped_storage().nbytes() for t in new.values() if t.requires_grad)
        info.requires_grad = any(t.requires_grad for t in out_flat)
        info.dtype = next((t.dtype for t in out_flat if t.is_floating_point()), None)
        info.kernels = 1 if new and node.target is not operator.getitem else 0
        moved = sum(t.numel() * t.element_size() for t in in_flat if _key(t) not in new)
        info.fwd_bytes_moved = float(moved + info.out_bytes) if info.kernels else 0.0
        saves, temp = set(), 0
        for k, nbytes in saved.items():
            owner = self.owner.get(k)
            if owner is None:
                temp += nbytes  # an intermediate of the op kept for its backward
            elif owner >= 0:
                saves.add(owner)
        info.saves, info.temp_bytes = tuple(sorted(saves)), temp
        if node.target is _SDPA and info.requires_grad:
            self._fused_attention_saves(info, args, new)
        self.env[node] = out
        self.infos.append(info)
        return info

    def _fused_attention_saves(self, info: NodeInfo, args, new: dict) -> None:
        """What the fused CUDA attention kernels keep for backward: q, k, v,
        the output and an fp32 log-sum-exp per query row. (Meta tensors run
        the math kernel, which keeps its score matrices too.)"""
        q = args[0]
        qkv = [t for t in args[:3] if isinstance(t, torch.Tensor)]
        owners = {self.owner.get(_key(t), _PLACEHOLDER) for t in qkv}
        info.saves = tuple(sorted({o for o in owners if o >= 0} | {info.index}))
        info.temp_bytes = q[..., 0].numel() * 4 if isinstance(q, torch.Tensor) else 0

    def _run(self, node, info, args, kwargs, in_flat):
        """Forward (and, when something needs grad, backward) of one node."""
        fn = _callable(self.gm, node)
        saved: dict[int, int] = {}
        needs_grad = any(t.requires_grad for t in in_flat)
        mutable = isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable
        if not needs_grad or mutable:
            with torch.no_grad(), FlopCounterMode(display=False) as fc:
                out = fn(*args, **kwargs)
            info.fwd_flops = float(fc.get_total_flops())
            if needs_grad:  # an in-place op on a tensor that needs grad stays one
                out = tree_map(_regrad, out)
            return out, saved
        # Re-leaf the inputs (same storages) so that only this node's backward is measured.
        leaves: dict[int, torch.Tensor] = {}

        def releaf(t):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                leaves[id(t)] = leaves.get(id(t)) or t.detach().requires_grad_()
                return leaves[id(t)]
            return t

        args, kwargs = tree_map(releaf, (args, kwargs))

        def pack(t):
            saved[_key(t)] = t.untyped_storage().nbytes()
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, FlopCounterMode(display=False) as fc:
            out = fn(*args, **kwargs)
        info.fwd_flops = float(fc.get_total_flops())
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        wrt = list(leaves.values())
        if outs and wrt:
            with FlopCounterMode(display=False) as fc:
                torch.autograd.grad(
                    outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True
                )
            info.bwd_flops = float(fc.get_total_flops())
        return out, saved


def _to_meta_device(a):
    return torch.device("meta") if isinstance(a, torch.device) else a


def _regrad(t):
    if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad:
        return t.detach().requires_grad_()
    return t


def _callable(gm: torch.fx.GraphModule, node: torch.fx.Node):
    if node.op == "call_function":
        return node.target
    if node.op == "call_module":
        return gm.get_submodule(node.target)
    if node.op == "call_method":
        return lambda self_, *a, **k: getattr(self_, node.target)(*a, **k)
    raise AssertionError(f"auto_offload: node {node.name} has op {node.op}")


def propagate(gm: torch.fx.GraphModule, inputs: dict | tuple) -> list[NodeInfo]:
    """Run ``gm`` node by node on meta tensors and return the facts of every
    compute node, in graph order (the ``MetaInfoProp`` of ColossalAI).

    Args:
        gm: a traced module (see :func:`trace_model`).
        inputs: the same inputs as traced (only shapes and dtypes are read).

    Returns:
        One :class:`NodeInfo` per ``call_*`` node.
    """
    prop = _Propagator(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if isinstance(inputs, dict):
        missing = [n.target for n in placeholders if n.target not in inputs]
        if missing:
            raise ValueError(f"propagate: inputs lack the graph's arguments {missing}")
        flat_inputs = [inputs[n.target] for n in placeholders]
    else:
        flat_inputs = list(inputs)
    if len(placeholders) != len(flat_inputs):
        raise ValueError(
            f"propagate: the graph takes {len(placeholders)} inputs (got {len(flat_inputs)})"
        )
    for node, example in zip(placeholders, flat_inputs, strict=True):
        prop.placeholder(node, example)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            prop.get_attr(node)
        elif node.op in ("call_function", "call_module", "call_method"):
            prop.call(node)
        elif node.op == "output":
            for t in tree_flatten(torch.fx.node.map_arg(node.args, prop.env.__getitem__))[0]:
                if isinstance(t, torch.Tensor) and prop.owner.get(_key(t), -1) >= 0:
                    prop.infos[prop.owner[_key(t)]].is_output = True
    for info in prop.infos:
        for i in info.inputs:
            prop.infos[i].users.append(info.index)
    return prop.infos
