"""GeminiDDP: ZeRO-3 over chunks, gathered and released by module hooks."""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerostack.chunk import (
    Chunk,
    ChunkManager,
    LazyInitContext,
    TensorState,
    search_chunk_configuration,
)
from zerostack.gemini._placement import AutoPlacement
from zerostack.chunk import rank_and_world

logger = logging.getLogger(__name__)
_API = "GeminiDDP"
S = TensorState


class GeminiDDP(nn.Module):
    """Wrap ``module`` for ZeRO-3 data parallelism over chunks.

    Parameters are cast to ``mixed_precision`` and packed into chunks
    (``fp16_param``), each paired with an fp32 master chunk (``fp32_param``)
    that ``GeminiOptimizer`` steps. A chunk is gathered by the forward
    pre-hook of the first module that uses it and serves every use until it
    can be released; before a module's backward it is gathered again. Each
    parameter's gradient is written over its slot of the gathered chunk once
    it is complete (``reuse_fp16_chunk``); a chunk whose tensors are all
    READY_FOR_REDUCE is reduce-scattered, and the reduced shard replaces the
    parameter shard until the optimizer writes the updated parameters back.

    Args:
        module: the model (on the compute device or the CPU), or one built
            under ``LazyInitContext``: then each module's ``reset_parameters``
            runs as its parameters go into the chunks, and the model never
            exists whole.
        placement_policy: "static" (the three fractions below) or "auto"
            (see zerostack.gemini.AutoPlacement: a warm-up iteration
            measures, then GPU memory goes to param shards and optimizer
            chunks, gathered chunks are cached and evicted by farthest next
            use). Default "static".
        shard_param_frac: share of parameter bytes, in registration order,
            in sharded chunks (ZeRO-3); the rest stay whole on every rank
            (ZeRO-2). Static only. Default 1.0.
        offload_optim_frac: share of fp32 master chunks (and so of optimizer
            states) on the CPU: the last ones in registration order, whose
            CPU updates overlap the forward of the others. Static only.
            Default 0.0.
        offload_param_frac: share of parameter shards kept on the CPU between
            uses. Static only. Default 0.0.
        warmup_non_model_data_ratio: auto: share of the capacity left to
            activations during the warm-up iteration. Default 0.8.
        steady_cuda_cap_ratio: auto: share of the capacity the placement may
            use after warm-up (less the measured non-model peak). Default 0.9.
        gpu_capacity_bytes: auto: the device memory to plan for. Default: the
            CUDA device's total memory; required on a CPU compute device
            (where placement is bookkeeping, for tests).
        max_prefetch: auto: gather up to this many chunks ahead of use,
            asynchronously. Default 0.
        enable_async_reduce: reduce chunks asynchronously during backward.
            Default True.
        scatter_after_inference: release gathered chunks after a forward
            without grad. Default True.
        master_weights: keep fp32 master chunks. Only True is implemented.
        init_fn: for a model built under LazyInitContext without
            ``reset_parameters`` on every module (e.g. transformers models):
            a model-level initialiser (``lambda m: m.initialize_weights()``),
            see LazyInitContext.distribute. Default None.
        search_range_m, hidden_dim, min_chunk_size_m: the chunk-size search
            (see zerostack.chunk.search_chunk_configuration). Defaults 32, None, 32.
        pin_memory: pin CPU shards. Default False.
        mixed_precision: torch.float16, torch.bfloat16 (or torch.float32, for
            exact tests). Default torch.float16.
        chunk_config_dict: skip the search and use this configuration.
        enable_gradient_accumulation: keep gradients in chunks of their own
            (instead of over the parameters) so that ``no_sync()`` can
            accumulate several backward passes before one reduction. Default False.
        process_group: the data-parallel group. Default: the default group.
        compute_device: where gathered chunks live. Default: the current CUDA
            device, else the CPU.

    Raises:
        ValueError: a bad fraction, policy name or dtype; "auto" with static
            fractions or without a capacity on a CPU device.
        NotImplementedError: master_weights=False.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        placement_policy: str = "static",
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        search_range_m: int = 32,
        hidden_dim: int | None = None,
        min_chunk_size_m: float = 32,
        pin_memory: bool = False,
        mixed_precision: torch.dtype = torch.float16,
        chunk_config_dict: dict | None = None,
        enable_gradient_accumulation: bool = False,
        process_group: dist.ProcessGroup | None = None,
        compute_device: torch.device | str | None = None,
        warmup_non_model_data_ratio: float = 0.8,
        steady_cuda_cap_ratio: float = 0.9,
        gpu_capacity_bytes: int | None = None,
        max_prefetch: int = 0,
        enable_async_reduce: bool = True,
        scatter_after_inference: bool = True,
        master_weights: bool = True,
        init_fn: Any = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("shard_param_frac", shard_param_frac),
            ("offload_optim_frac", offload_optim_frac),
            ("offload_param_frac", offload_param_frac),
            ("warmup_non_model_data_ratio", warmup_non_model_data_ratio),
            ("steady_cuda_cap_ratio", steady_cuda_cap_ratio),
        ):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{_API}: {name} must be in [0, 1] (got {value}); pass a share")
        if placement_policy not in ("static", "auto"):
            raise ValueError(
                f"{_API}: placement_policy must be 'static' or 'auto' (got {placement_policy!r})"
            )
        if not master_weights:
            raise NotImplementedError(
                f"{_API}: master_weights=False (stepping the fp16/bf16 chunks directly) is not "
                "implemented; use master_weights=True"
            )
        if max_prefetch < 0:
            raise ValueError(f"{_API}: max_prefetch must be >= 0 (got {max_prefetch})")
        auto = placement_policy == "auto"
        if auto and (shard_param_frac, offload_optim_frac, offload_param_frac) != (1.0, 0.0, 0.0):
            raise ValueError(
                f"{_API}: shard_param_frac, offload_optim_frac and offload_param_frac are for "
                "placement_policy='static'; 'auto' decides placement itself"
            )
        if mixed_precision not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"{_API}: mixed_precision must be float16, bfloat16 or float32 (got {mixed_precision})"
            )
        self.module = module
        self.process_group = process_group
        self.rank, self.world_size = rank_and_world(process_group)
        self.mixed_precision = mixed_precision
        self.compute_device = torch.device(compute_device) if compute_device else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )  # fmt: skip
        self.async_reduce = enable_async_reduce
        self.scatter_after_inference = scatter_after_inference
        cuda = self.compute_device.type == "cuda"
        if auto and gpu_capacity_bytes is None:
            if not cuda:
                raise ValueError(
                    f"{_API}: placement_policy='auto' on a {self.compute_device.type} compute device "
                    "needs gpu_capacity_bytes (the memory to plan for)"
                )
            gpu_capacity_bytes = torch.cuda.get_device_properties(self.compute_device).total_memory
        pin_memory = pin_memory or (auto and cuda)

        if chunk_config_dict is None:
            chunk_config_dict = search_chunk_configuration(
                module,
                search_range_m=search_range_m,
                search_interval=hidden_dim or 1024,
                min_chunk_size_m=min_chunk_size_m,
                process_group=process_group,
            ).config
        key = next(iter(chunk_config_dict))
        base = dict(chunk_config_dict[key])
        # Sharded ("s") and kept-gathered ("g") parameter chunks, each with
        # fp32 master chunks laid out the same way ("ms", "mg").
        self.chunk_manager = ChunkManager(
            {
                ("s", key): {**base, "keep_gathered": False},
                ("g", key): {**base, "keep_gathered": True},
                ("ms", key): {**base, "keep_gathered": False},
                ("mg", key): {**base, "keep_gathered": False},
            },
            compute_device=self.compute_device,
            reuse_fp16_chunk=not enable_gradient_accumulation,
        )
        self.accumulate = enable_gradient_accumulation
        self._no_sync = False

        # Register parameters in creation order; tied ones once.
        self.params: list[nn.Parameter] = []
        self.param_names: dict[nn.Parameter, str] = {}
        self.aliases: dict[str, nn.Parameter] = {}  # every name, tied ones included
        for name, p in module.named_parameters(remove_duplicate=False):
            self.aliases[name] = p
            if p in self.param_names:
                continue
            self.param_names[p] = name
            self.params.append(p)
        self.masters: dict[nn.Parameter, torch.Tensor] = {}
        total = sum(p.numel() for p in self.params)
        offload_param_target = offload_param_frac * total
        offload_optim_target = offload_optim_frac * total
        shard_target = shard_param_frac * total
        # auto: param shards on the device while they fit the warm-up share
        # (exactly re-checked per chunk by AutoPlacement.initial_placement).
        warmup_room = (1.0 - warmup_non_model_data_ratio) * (gpu_capacity_bytes or 0)
        item = torch.empty((), dtype=mixed_precision).element_size()
        seen = 0
        self.offloaded_masters: set[Chunk] = set()  # stepped on the CPU

        def register(p: torch.Tensor) -> None:
            nonlocal seen
            with torch.no_grad():
                p.data = p.data.to(device=self.compute_device, dtype=mixed_precision)
            if auto:
                cpu_param = cuda and (seen + p.numel()) * item / self.world_size > warmup_room
                cpu_optim = True
            else:
                cpu_param = seen < offload_param_target
                # The last chunks in compute order: their CPU updates then
                # have the forward of every earlier chunk to hide behind.
                cpu_optim = seen + p.numel() > total - offload_optim_target
            part = "s" if seen < shard_target or shard_target == total else "g"
            seen += p.numel()
            group = "fp16_param" if p.requires_grad else "frozen_param"
            self.chunk_manager.register_tensor(
                p, group, (part, key), process_group, cpu_offload=cpu_param, pin_memory=pin_memory
            )
            if p.requires_grad:
                master = p.detach().to(torch.float32).clone()
                mchunk = self.chunk_manager.register_tensor(
                    master,
                    "fp32_param",
                    ("m" + part, key),
                    process_group,
                    cpu_offload=cpu_optim,
                    pin_memory=pin_memory,
                )
                if cpu_optim and mchunk.num_tensors == 1:  # a chunk is placed when created
                    self.offloaded_masters.add(mchunk)
                self.masters[p] = master

        if any(p.is_meta for p in self.params):
            # Built under LazyInitContext: materialized one module at a time
            # straight into the chunks, never whole.
            LazyInitContext.distribute(
                module, self.chunk_manager, config_key=("s", key), process_group=process_group,
                dtype=mixed_precision, register_fn=register, init_fn=init_fn,
            )  # fmt: skip
        else:
            for p in self.params:
                register(p)
            self.chunk_manager.close_all_groups()
        for p, master in self.masters.items():
            chunk, mchunk = self.chunk_manager.get_chunk(p), self.chunk_manager.get_chunk(master)
            if chunk.paired_chunk is None:
                chunk.pair(mchunk)
        # Buffers live whole on the compute device.
        for b in module.buffers():
            b.data = b.data.to(self.compute_device)

        # chunk -> finishes its pending update (a CPU step still running);
        # run before the chunk is next used.
        self.pending_updates: dict[Chunk, Any] = {}
        self.grad_chunks = sorted(self.chunk_manager.chunks("fp16_param"), key=lambda c: c.index)
        # Every fp16/bf16 (or fp32) parameter chunk, trainable and frozen.
        param_chunks = sorted(
            self.grad_chunks + self.chunk_manager.chunks("frozen_param"), key=lambda c: c.index
        )
        self.auto: AutoPlacement | None = None
        if auto:
            self.auto = AutoPlacement(
                self.chunk_manager, param_chunks, self.compute_device, int(gpu_capacity_bytes),
                warmup_non_model_data_ratio, steady_cuda_cap_ratio, max_prefetch, process_group,
                busy=self.pending_updates,
            )  # fmt: skip
            self.auto.initial_placement()
        # Chunks reduce strictly in reverse order of creation (the order
        # backward produces them), so every rank issues the same collectives
        # even when ranks differ in which parameters got gradients. (Gathers
        # are collectives too: every rank must run forward and backward
        # through the same modules.)
        self._reduce_order = list(reversed(self.grad_chunks))
        self._next_reduce = 0
        self._pending: list[Any] = []
        self._backward_started = False
        self._training = False
        self.used: set[torch.Tensor] = set()  # params that got a gradient since the last step
        self.backward_via_optimizer = False  # set by GeminiOptimizer.backward, checked by step
        # Called at the end of every reducing backward (GeminiOptimizer stages
        # gradients of CPU-stepped chunks to the host there).
        self.backward_end_callbacks: list[Any] = []
        # Called with (chunk, complete) as each chunk's reduced gradient is
        # ready (complete: every tensor got a gradient in this backward).
        self.chunk_reduced_callbacks: list[Any] = []
        self.update_wait_s = 0.0  # time forward spent waiting for CPU updates
        self._register_hooks()
        params = param_chunks
        logger.info(
            "GeminiDDP (%s): %d params (%.1fM elements) in %d %s chunks of %d elements, %d sharded, "
            "%d kept gathered, %d shards on the CPU; %d fp32 master chunks, %d on the CPU; rank %d/%d",
            placement_policy, len(self.params), total / 1e6, len(params), mixed_precision,
            base["chunk_size"], sum(not c.keep_gathered for c in params),
            sum(c.keep_gathered for c in params),
            sum(c.shard is not None and c.shard.device.type == "cpu" for c in params),
            len(self.chunk_manager.chunks("fp32")), len(self.offloaded_masters),
            self.rank, self.world_size,
        )  # fmt: skip

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over backward passes without reducing them;
        the first backward outside reduces the sum. Needs
        ``enable_gradient_accumulation=True``."""
        if not self.accumulate:
            raise RuntimeError(
                f"{_API}.no_sync: build GeminiDDP with enable_gradient_accumulation=True"
            )
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    # -- hooks -------------------------------------------------------------------

    def _register_hooks(self) -> None:
        self._handles = []
        # A tensor hook lives in autograd's C++ graph, out of the garbage
        # collector's sight: through a strong reference it would keep this
        # module (and all its chunks) alive forever.
        me = weakref.ref(self)
        for p in self.params:
            if p.requires_grad:
                self._handles.append(
                    p.register_post_accumulate_grad_hook(lambda t, me=me: me()._on_grad(t))
                )
        for m in self.module.modules():
            direct = [p for p in m.parameters(recurse=False) if p in self.param_names]
            if not direct:
                continue
            self._handles.append(
                m.register_forward_pre_hook(lambda mod, args, ps=direct: self._pre_forward(ps))
            )
            self._handles.append(
                m.register_forward_hook(
                    lambda mod, args, out, ps=direct: self._post_forward(ps, out)
                )
            )

    def _chunks(self, params: Iterable[torch.Tensor]) -> list[Chunk]:
        return self.chunk_manager.get_chunks(params)

    def await_update(self, chunk: Chunk) -> None:
        """Finish ``chunk``'s pending optimizer update (a CPU step) if any."""
        finish = self.pending_updates.pop(chunk, None)
        if finish is not None:
            t0 = time.perf_counter()
            finish()
            self.update_wait_s += time.perf_counter() - t0

    def wait_updates(self) -> None:
        """Finish every pending optimizer update."""
        for chunk in list(self.pending_updates):
            self.await_update(chunk)

    def _gather(self, params: list[torch.Tensor], state: TensorState) -> None:
        chunks = self._chunks(params)
        if self.auto is not None:
            self.auto.before_access(chunks, self._training)
        for chunk in chunks:
            self.await_update(chunk)
            self.chunk_manager.access_chunk(chunk)
        if self.auto is not None:
            self.auto.after_access(chunks, self._training)
        for p in params:
            chunk = self.chunk_manager.get_chunk(p)
            current = chunk.tensor_state(p)
            if current in (S.HOLD, S.FREE, S.HOLD_AFTER_BWD):
                self.chunk_manager.trans_tensor_state(p, state)

    def _release(self, params: list[torch.Tensor], state: TensorState) -> None:
        for p in params:
            chunk = self.chunk_manager.get_chunk(p)
            if chunk.tensor_state(p) is S.COMPUTE:
                self.chunk_manager.trans_tensor_state(p, state)
        self._release_idle(self._chunks(params))

    def _release_idle(self, chunks: Iterable[Chunk]) -> None:
        if self.auto is not None and not self.auto.warming_up:
            return  # auto keeps gathered chunks as a cache, trimmed by next use
        for chunk in chunks:
            if chunk.can_release:
                self.chunk_manager.release_chunk(chunk)

    def _pre_forward(self, params: list[torch.Tensor]) -> None:
        if not self._backward_started:
            # Forward has moved past the chunks this module does not use:
            # release those (a chunk shared by consecutive modules is gathered
            # once). Inside backward (a recomputed forward under activation
            # checkpointing) chunks stay until their gradients are reduced.
            needed = set(self._chunks(params))
            self._release_idle(
                c for c in list(self.chunk_manager.accessed_chunks) if c not in needed
            )
        self._gather(params, S.COMPUTE)

    def _post_forward(self, params: list[torch.Tensor], out: Any) -> Any:
        for p in params:
            if self.chunk_manager.get_chunk(p).tensor_state(p) is S.COMPUTE:
                self.chunk_manager.trans_tensor_state(p, S.HOLD)
        if not torch.is_grad_enabled():
            return None
        tensors = [t for t in _flatten(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            # Before this module's backward, gather its chunks again.
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads, ps=params: self._pre_backward(ps), mode="any"
            )
        return None

    def _pre_backward(self, params: list[torch.Tensor]) -> None:
        if not self._backward_started:
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._gather(params, S.COMPUTE)

    def _on_grad(self, p: torch.Tensor) -> None:
        chunk = self.chunk_manager.get_chunk(p)
        grad = p.grad
        self.used.add(p)
        info = chunk.tensors_info[p]
        if self.accumulate:
            if chunk.grad_chunk is None or chunk.grad_chunk.buffer is None:
                self.chunk_manager.init_grad_chunk(chunk)
            chunk.grad_view(p).add_(grad)
        else:
            # The parameter's value is no longer needed: its slot takes the gradient.
            chunk.buffer[info.offset : info.end].copy_(grad.reshape(-1))
        p.grad = None
        if chunk.tensor_state(p) is S.HOLD:
            self.chunk_manager.trans_tensor_state(p, S.COMPUTE)
        self.chunk_manager.trans_tensor_state(p, S.HOLD_AFTER_BWD)
        if self._no_sync:
            return  # HOLD_AFTER_BWD -> COMPUTE in the next forward, -> READY in the last backward
        self.chunk_manager.trans_tensor_state(p, S.READY_FOR_REDUCE)
        self._reduce_ready()

    def _reduce_ready(self, flush: bool = False) -> None:
        while self._next_reduce < len(self._reduce_order):
            chunk = self._reduce_order[self._next_reduce]
            complete = chunk.can_reduce
            if not complete:
                if not flush:
                    return
                self._zero_fill_unused(chunk)
            handle = self.chunk_manager.reduce_chunk(chunk, async_op=self.async_reduce)
            self._pending.append((chunk, handle, complete))
            self._next_reduce += 1
            # Finish all but the last two reductions: finishing frees the
            # gathered gradient buffer, so backward holds a few chunks, not all.
            while len(self._pending) > 2:
                self._finish_reduce(*self._pending.pop(0))

    def _finish_reduce(self, chunk: Chunk, handle: Any, complete: bool) -> None:
        if handle is not None:
            handle.wait()
        for callback in self.chunk_reduced_callbacks:
            callback(chunk, complete)

    def _zero_fill_unused(self, chunk: Chunk) -> None:
        # Parameters that got no gradient in this backward: their accumulated
        # gradient (zeros, or what earlier no_sync passes left) is reduced.
        # No gather (a collective this rank may reach at another time than
        # the others): a chunk no tensor of which got a gradient here needs
        # only a zero buffer.
        self.await_update(chunk)
        if self.accumulate:
            if chunk.grad_chunk is None or chunk.grad_chunk.buffer is None:
                self.chunk_manager.init_grad_chunk(chunk)
        elif not chunk.is_gathered:
            self.chunk_manager.zero_chunk(chunk)
        for t, info in chunk.tensors_info.items():
            if info.state is S.READY_FOR_REDUCE:
                continue
            if not self.accumulate:
                chunk.buffer[info.offset : info.end].zero_()
            for s in _path_to_ready(info.state):
                self.chunk_manager.trans_tensor_state(t, s)

    def _finish_backward(self) -> None:
        if self.auto is not None and self._training:
            self.auto.end_warmup()
        if self._no_sync:
            self._backward_started = False
            return
        self._reduce_ready(flush=True)
        for entry in self._pending:
            self._finish_reduce(*entry)
        self._pending.clear()
        self._next_reduce = 0
        self._backward_started = False
        # Frozen parameters were gathered for backward too; release them now.
        frozen = [p for p in self.params if not p.requires_grad]
        if frozen:
            self._release(frozen, S.HOLD)
        for callback in self.backward_end_callbacks:
            callback()

    # -- forward ------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = tuple(a.to(self.compute_device) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {
            k: v.to(self.compute_device) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()
        }
        training = torch.is_grad_enabled()
        # auto counts gather points of training iterations only (an
        # evaluation forward has a different order).
        # Pending updates of kept-gathered chunks end in an all-gather: finish
        # them here, in chunk order, where every rank is at the same point.
        for chunk in sorted(self.pending_updates, key=lambda c: c.index):
            if chunk.keep_gathered:
                self.await_update(chunk)
        self._training = training and not self._backward_started
        if self.auto is not None and self._training:
            self.auto.start_iteration()
        out = self.module(*args, **kwargs)
        # The end of forward: nothing is in use until backward gathers again.
        if training or self.scatter_after_inference:
            idle = [c for c in self.chunk_manager.accessed_chunks if c.can_release]
            if self.auto is not None and not training:
                for c in idle:
                    self.chunk_manager.release_chunk(c)
            else:
                self._release_idle(idle)
        return out

    def state_dict(  # type: ignore[override]
        self, *args: Any, only_rank_0: bool = False, **kwargs: Any
    ) -> dict[str, torch.Tensor]:
        """The whole model's parameters (fp32, from the masters) and buffers,
        on the CPU: on every rank, or with ``only_rank_0`` on rank 0 (the
        others still take part in the gathers and get an empty dict)."""
        self.wait_updates()
        keep = not only_rank_0 or self.rank == 0
        by_chunk: dict[Chunk, list[nn.Parameter]] = {}
        for p in self.params:
            by_chunk.setdefault(self.chunk_manager.get_chunk(self.masters.get(p, p)), []).append(p)
        values = {}
        for chunk in sorted(
            by_chunk, key=lambda c: c.index
        ):  # one gather per chunk, same order everywhere
            was = chunk.is_gathered
            self.chunk_manager.access_chunk(chunk)
            for p in by_chunk[chunk]:
                if keep:
                    values[p] = self.masters.get(p, p).detach().cpu().clone()
            if not was and chunk.can_release:
                self.chunk_manager.release_chunk(chunk)
        if not keep:
            return {}
        out = {name: values[p] for name, p in self.aliases.items()}  # tied names share a tensor
        for name, b in _persistent_buffers(self.module).items():
            out[name] = b.detach().cpu().clone()
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:  # type: ignore[override]
        """Load a whole-model state dict (e.g. from ``state_dict()`` or an
        unwrapped model) into the chunks: masters and parameters alike.

        A tied parameter needs only one of its names (checkpoints often
        leave out the tied copy).

        Raises:
            KeyError: ``strict`` and a parameter or buffer is missing or unexpected.
            ValueError: a shape does not match.
        """
        self.wait_updates()
        names = self.aliases
        buffers = _persistent_buffers(self.module)
        if strict:
            present = {names[n] for n in state_dict if n in names}
            missing = sorted(
                [n for n, p in names.items() if p not in present]
                + [n for n in buffers if n not in state_dict]
            )
            unexpected = sorted(set(state_dict) - set(names) - set(buffers))
            if missing or unexpected:
                raise KeyError(
                    f"{_API}.load_state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                    "pass strict=False to load what matches"
                )
        for name, value in state_dict.items():
            if name in buffers:
                buffers[name].copy_(value)
                continue
            p = names.get(name)
            if p is None:
                continue
            info = self.chunk_manager.get_chunk(p).tensors_info[p]
            if tuple(value.shape) != tuple(info.shape):
                raise ValueError(
                    f"{_API}.load_state_dict: {name} has shape {tuple(value.shape)}, the model's is {tuple(info.shape)}"
                )
            for t in (self.masters.get(p), p):
                if t is None:
                    continue
                chunk = self.chunk_manager.get_chunk(t)
                was = chunk.is_gathered
                self.chunk_manager.access_chunk(chunk)
                t.copy_(value)
                if not chunk.keep_gathered:
                    # Write this rank's share back into its shard before releasing.
                    lo = chunk.rank * chunk.shard_size
                    chunk.shard.copy_(chunk.buffer[lo : lo + chunk.shard_size])
                    if not was and chunk.can_release:
                        self.chunk_manager.release_chunk(chunk)
        return None


def _persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` would hold (not the non-persistent ones)."""
    out = {}
    for prefix, m in module.named_modules():
        for name, b in m.named_buffers(recurse=False):
            if b is not None and name not in m._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def _path_to_ready(state: TensorState) -> list[TensorState]:
    return {
        S.HOLD: [S.COMPUTE, S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE],
        S.FREE: [S.COMPUTE, S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE],
        S.COMPUTE: [S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE],
        S.HOLD_AFTER_BWD: [S.READY_FOR_REDUCE],
    }[state]


def _flatten(out: Any) -> list[Any]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flatten(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flatten(o)]
    return []
