"""GeminiDDP: ZeRO-3 over chunks, gathered and released by module hooks."""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerostack.chunk import (
    Chunk,
    ChunkManager,
    CollectiveMismatchError,
    LazyInitContext,
    TensorInfo,
    TensorState,
    check_device,
    debug_collectives,
    default_compute_device,
    path_between,
    persistent_buffers,
    phase,
    rank_and_world,
    search_chunk_configuration,
    set_collective_label,
)
from zerostack.gemini._config import AutoPlacementConfig, GeminiConfig
from zerostack.gemini._cpu_step import CpuStepPipeline, write_back
from zerostack.gemini._placement import AutoPlacement, Placement, StaticPlacement
from zerostack.shard import ShardedGradient, fix_structure, local_grad, sync_from_rank0

logger = logging.getLogger(__name__)
_API = "GeminiDDP"
S = TensorState
_GATHERABLE = frozenset({S.HOLD, S.FREE, S.HOLD_AFTER_BWD})
_Slot = tuple[Chunk, TensorInfo]  # a parameter's chunk and its entry in the chunk


def shard_on_host(chunk: Chunk) -> bool:
    """``chunk``'s parameter shard lives on the host between uses (it is
    gathered onto the compute device for each use, and its gradient is
    reduced into host memory)."""
    return not chunk.keep_gathered and chunk.shard_device.type == "cpu"


class ChunkGroup(Enum):
    """The chunk sequences of a GeminiDDP model (ChunkManager config keys)."""

    SHARDED = "sharded"  # parameter chunks, each rank holding 1/N (ZeRO-3)
    GATHERED = "gathered"  # parameter chunks kept whole on every rank (ZeRO-2)
    SHARDED_MASTER = "sharded_master"  # fp32 masters of SHARDED chunks, 1/N per rank
    GATHERED_MASTER = "gathered_master"  # fp32 masters of GATHERED chunks, 1/N per rank


class TrainingState(Enum):
    """Where GeminiDDP is in a training iteration (changed only by ``_transition``)."""

    IDLE = 0  # between iterations: chunks hold parameters (or updates about to be written back)
    FORWARD = 1  # a forward with grad runs: chunks are gathered as modules start
    AWAIT_BACKWARD = 2  # a forward with grad ended: its activations wait for backward
    BACKWARD = 3  # backward runs; a forward inside it recomputes a checkpointed module
    ACCUMULATED = 4  # a backward under no_sync ended: gradients wait in the grad chunks
    REDUCED = 5  # a backward ended, every chunk reduced: reduced gradients sit in the shards


T = TrainingState
# [Note: training state table] Inference forwards (no grad) do not move the
# state. REDUCED -> IDLE is the optimizer's step (or a step skipped);
# REDUCED -> FORWARD a forward before the step with
# enable_gradient_accumulation (see [Note: backward on several batches
# before one step]). A forward that raises goes back to the state it
# started from (FORWARD -> IDLE, ACCUMULATED, AWAIT_BACKWARD or REDUCED);
# zero_grad() drops the batch from ACCUMULATED, BACKWARD (a backward that
# raised) and REDUCED (-> IDLE). See zerostack.shard's [Note: dropping a
# batch].
#
# [Note: backward on several batches before one step] ColossalAI's Gemini
# accumulates, with enable_gradient_accumulation, over backward passes
# without no_sync: forward and backward on each batch, optimizer.step()
# every few (its gradient accumulation guide). The reduced gradients live in
# grad chunks then, apart from the parameters, so a forward after a
# reducing backward computes with the parameters: it carries the reduced
# gradients (``_carry``), and each reduction of the next backward adds its
# reduced share to the carried one (Chunk.reduce's ``accumulate``), whose
# norm is then the sum's. The step, or zero_grad() (which drops them, as a
# batch), ends the carry. An evaluation (no gradients) may run between them
# too. Without enable_gradient_accumulation a reduced gradient sits in place
# of the parameter shard, so such a forward raises.
_MOVES: dict[TrainingState, frozenset[TrainingState]] = {
    T.IDLE: frozenset({T.FORWARD}),
    T.FORWARD: frozenset({T.AWAIT_BACKWARD, T.IDLE, T.ACCUMULATED, T.REDUCED}),
    T.AWAIT_BACKWARD: frozenset({T.FORWARD, T.BACKWARD}),
    T.BACKWARD: frozenset({T.ACCUMULATED, T.REDUCED, T.IDLE}),
    T.ACCUMULATED: frozenset({T.FORWARD, T.BACKWARD, T.IDLE}),
    T.REDUCED: frozenset({T.IDLE, T.FORWARD}),
}


class GeminiDDP(nn.Module):
    """Wrap ``module`` for ZeRO-3 data parallelism over chunks.

    Parameters are cast to the compute dtype and packed into chunks
    (``fp16_param``), each paired with an fp32 master chunk (``fp32_param``)
    that ``GeminiOptimizer`` steps. A chunk is gathered by the forward
    pre-hook of the first module that uses it and serves every use until it
    can be released; before a module's backward it is gathered again. Each
    parameter's gradient is written over its slot of the gathered chunk once
    it is complete; a chunk whose tensors are all READY_FOR_REDUCE is
    reduce-scattered, and the reduced shard replaces the parameter shard until
    the optimizer writes the updated parameters back.

    Settings come as a :class:`GeminiConfig` (``config=``) or as ColossalAI's
    keyword arguments, which build one (not both):

    Args:
        module: the model (on the compute device or the CPU), or one built
            under ``LazyInitContext``: then it is materialized module by
            module straight into the chunks and never exists whole.
        config: every setting at once. Default None (from the keywords).
        process_group: the data-parallel group. Default: the default group.
        compute_device: where gathered chunks live. Default: the current CUDA
            device, else the CPU.
        init_fn: for a model built under LazyInitContext: called as
            ``init_fn(model)`` after its construction is replayed (see
            LazyInitContext.materialize; it needs the whole model at once).
            Default None: the replay alone, which gives any model the values
            an eager build would.
        debug_collectives: True: before every gather and reduce, check that
            all ranks issue the same collective (for the same module), and
            raise CollectiveMismatchError on every rank, naming what each was
            about to do, instead of hanging. A blocking exchange per
            collective: for debugging. Switches it for the whole process.
            Default None: the ``ZEROSTACK_DEBUG_COLLECTIVES`` environment
            variable decides.
        placement_policy: "static" (shard_param_frac, offload_optim_frac,
            offload_param_frac) or "auto" (see AutoPlacement and
            warmup_non_model_data_ratio, steady_cuda_cap_ratio,
            gpu_capacity_bytes); max_prefetch under either. Default "static".
        search_range_m: see ChunkConfig, as for hidden_dim, min_chunk_size_m,
            chunk_config_dict, pin_memory and enable_gradient_accumulation.
        mixed_precision: the compute dtype, torch.float16 (default),
            torch.bfloat16 or torch.float32; cast_forward_inputs: see
            MixedPrecision.
        enable_async_reduce, scatter_after_inference, master_weights: see
            GeminiConfig (master_weights=False is not implemented).

    Raises:
        ValueError: a bad share, policy name or dtype; "auto" with static
            fractions or without a capacity on a CPU device; no entry in
            chunk_config_dict for the group's size.
        TypeError: ``config`` together with keyword settings, or an unknown keyword.
        NotImplementedError: master_weights=False.
    """

    def __init__(
        self,
        module: nn.Module,
        config: GeminiConfig | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        compute_device: torch.device | str | None = None,
        init_fn: Callable[[nn.Module], None] | None = None,
        debug_collectives: bool | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        if config is not None and settings:
            raise TypeError(
                f"{_API}: pass either config or keyword settings (got both: {sorted(settings)})"
            )
        if config is not None and not isinstance(config, GeminiConfig):
            raise TypeError(
                f"{_API}: config must be a GeminiConfig or None (got {type(config).__name__}); "
                "or pass the settings as keywords"
            )
        _check_module(module)
        device = _check_device(compute_device)
        self.config = config = config or GeminiConfig.from_kwargs(**settings)
        if debug_collectives is not None:
            _set_debug(debug_collectives)
        self.module = module
        self.process_group = process_group
        self.rank, self.world_size = rank_and_world(process_group)
        self.mixed_precision = config.precision.param_dtype
        self.compute_device = device
        self.accumulate = config.chunk.enable_gradient_accumulation
        self._register_params(module, init_fn)
        self._state = T.IDLE
        self._no_sync = False  # the no_sync() mode (the state records its effect)
        self._reduce_order = list(reversed(self.grad_chunks))  # the order backward produces them
        self._next_reduce = 0
        self._pending: list[tuple[Chunk, Any]] = []  # reductions in flight, with their handle
        self._used: set[torch.Tensor] = set()  # params that got a gradient since the last step
        # params whose .grad is their guard since the last step (see refuse_changed_grads)
        self._handed: set[int] = set()  # indices into params: no Tensor.__hash__ in backward
        # The optimizer's link, see attach_step: its CPU-step pipeline, and
        # what to call at the end of a reducing backward and when a batch is dropped.
        self._updates: CpuStepPipeline | None = None
        self._on_reduced: Callable[[], None] | None = None
        self._on_drop: Callable[[], None] | None = None
        self._on_chunk_reduced: Callable[[Chunk], None] | None = None
        self._accumulated = False  # gradients of no_sync backwards wait in the grad chunks
        # Reduced gradients of an earlier backward wait for the step: see
        # [Note: backward on several batches before one step].
        self._carry = False
        self._register_hooks()
        _WRAPPED.add(module)
        fix_structure(self, module, _API, _FIXED)  # See [Note: the structure is fixed once wrapped]
        self._log_layout()

    # -- construction ------------------------------------------------------------

    def _chunk_layout(self, module: nn.Module) -> tuple[int, bool]:
        """(chunk_size, keep_gathered): the configured entry for this group's
        size, or the search's answer."""
        cfg = self.config.chunk
        table = cfg.chunk_config_dict
        if table is None:
            table = search_chunk_configuration(
                module,
                search_range_m=cfg.search_range_m,
                search_interval=cfg.hidden_dim or 1024,
                min_chunk_size_m=cfg.min_chunk_size_m,
                process_group=self.process_group,
            ).config
        if self.world_size not in table:
            raise ValueError(
                f"{_API}: chunk_config_dict has no entry for the data-parallel size {self.world_size} "
                f"(got keys {sorted(table)}); key each entry by the process group's size"
            )
        entry = table[self.world_size]
        size, keep = int(entry["chunk_size"]), bool(entry.get("keep_gathered", False))
        placement = self.config.placement
        frac = getattr(placement, "shard_param_frac", 1.0)
        logger.info(
            "GeminiDDP: chunk_size=%d keep_gathered=%s (%s, data-parallel size %d)%s",
            size, keep, "chunk_config_dict" if cfg.chunk_config_dict is not None else "search",
            self.world_size,
            f"; shard_param_frac={frac} decides what is sharded" if keep and frac < 1.0 else "",
        )  # fmt: skip
        return size, keep

    def _make_placement(self, keep_gathered: bool) -> Placement:
        placement = self.config.placement
        if isinstance(placement, AutoPlacementConfig):  # self.config.auto
            item = torch.empty((), dtype=self.mixed_precision).element_size()
            return AutoPlacement(
                placement, self.compute_device, keep_gathered, item, self.world_size,
                self.process_group,
            )  # fmt: skip
        return StaticPlacement(placement, keep_gathered)

    def _register_params(self, module: nn.Module, init_fn: Callable | None) -> None:
        """Pack every parameter (tied ones once) and its fp32 master into chunks."""
        self.params: list[nn.Parameter] = []
        self.param_names: dict[torch.Tensor, str] = {}
        self.aliases: dict[str, nn.Parameter] = {}  # every name, tied ones included
        for name, p in module.named_parameters(remove_duplicate=False):
            self.aliases[name] = p
            if p not in self.param_names:
                self.param_names[p] = name
                self.params.append(p)
        chunk_size, keep_gathered = self._chunk_layout(module)
        self.placement = self._make_placement(keep_gathered)
        cfg = {"chunk_size": chunk_size}
        self.chunk_manager = ChunkManager(
            {
                ChunkGroup.SHARDED: {**cfg, "keep_gathered": False},
                ChunkGroup.GATHERED: {**cfg, "keep_gathered": True},
                ChunkGroup.SHARDED_MASTER: {**cfg, "keep_gathered": False},
                ChunkGroup.GATHERED_MASTER: {**cfg, "keep_gathered": False},
            },
            compute_device=self.compute_device,
            reuse_fp16_chunk=not self.accumulate,
        )
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        self._total_numel = sum(p.numel() for p in self.params)
        self._seen = 0
        pin = self.config.chunk.pin_memory or (
            self.config.auto and self.compute_device.type == "cuda"
        )
        register = _WeakCall(self, "_register_one", pin)
        # Before any goes into a chunk; see [Note: rank 0's initial values] (meta ones skipped).
        sync_from_rank0(
            [*self.aliases.items(), *module.named_buffers()], group=self.process_group, api=_API
        )
        if any(p.is_meta for p in self.params):
            # Built under LazyInitContext: materialized one module at a time
            # straight into the chunks, never whole.
            LazyInitContext.distribute(
                module, self.chunk_manager, config_key=ChunkGroup.SHARDED,
                process_group=self.process_group, dtype=self.mixed_precision,
                register_fn=register, init_fn=init_fn,
            )  # fmt: skip
        else:
            if init_fn is not None:
                warnings.warn(
                    f"{_API}: init_fn has no effect on a model that is not built under "
                    "LazyInitContext (its parameters exist already)",
                    UserWarning,
                    stacklevel=3,
                )
            for p in self.params:
                register(p)
            self.chunk_manager.close_all_groups()
        self._pair_and_place_buffers(module)
        self._frozen = [p for p in self.params if p not in self.masters]  # see _refuse_unfrozen
        self._note_versions()
        # Each parameter's chunk and byte offset: see _refuse_replaced.
        self._homes = [
            (c := self.chunk_manager.get_chunk(p), c.tensors_info[p].offset * c.dtype.itemsize)
            for p in self.params
        ]

    def _register_one(self, pin: bool, p: torch.Tensor) -> None:
        where = self.placement.decide(self._seen, p.numel(), self._total_numel)
        self._seen += p.numel()
        with torch.no_grad():
            p.data = p.data.to(device=self.compute_device, dtype=self.mixed_precision)
        group = ChunkGroup.SHARDED if where.sharded else ChunkGroup.GATHERED
        self.chunk_manager.register_tensor(
            p, "fp16_param" if p.requires_grad else "frozen_param", group, self.process_group,
            cpu_offload=where.param_on_cpu, pin_memory=pin,
        )  # fmt: skip
        if not p.requires_grad:
            return
        master = p.detach().to(torch.float32).clone()
        master_group = ChunkGroup.SHARDED_MASTER if where.sharded else ChunkGroup.GATHERED_MASTER
        mchunk = self.chunk_manager.register_tensor(
            master, "fp32_param", master_group, self.process_group,
            cpu_offload=where.master_on_cpu, pin_memory=pin,
        )  # fmt: skip
        if where.master_on_cpu:
            # A chunk is placed when created; one that a later tensor of it
            # puts on the CPU goes there whole once closed (_pair_and_place_buffers):
            # every chunk holding part of the last offload_optim_frac is
            # offloaded, so any share > 0 offloads one chunk at least, as
            # ColossalAI's static policy offloads whole chunks up to the share.
            self.placement.offload_master(mchunk)
        self.masters[p] = master

    def _pair_and_place_buffers(self, module: nn.Module) -> None:
        for mchunk in self.placement.offloaded_masters:  # see _register_one
            if mchunk.shard_device.type != "cpu":
                self.chunk_manager.move_chunk(mchunk, "cpu")
        for p, master in self.masters.items():
            chunk, mchunk = self.chunk_manager.get_chunk(p), self.chunk_manager.get_chunk(master)
            if chunk.paired_chunk is None:
                chunk.pair(mchunk)
        precision = self.config.precision
        for b in module.buffers():  # buffers live whole on the compute device
            cast = precision.cast_buffers and b.is_floating_point()
            b.data = b.data.to(self.compute_device, self.mixed_precision if cast else b.dtype)
        self.grad_chunks = sorted(self.chunk_manager.chunks("fp16_param"), key=lambda c: c.index)
        # Every fp16/bf16 (or fp32) parameter chunk, trainable and frozen.
        self.param_chunks = sorted(
            self.grad_chunks + self.chunk_manager.chunks("frozen_param"), key=lambda c: c.index
        )
        self.placement.attach(self.chunk_manager, self.param_chunks)

    def _log_layout(self) -> None:
        chunks = self.param_chunks
        policy = "auto" if self.config.auto else "static"
        # A parameter larger than the chunk size has a chunk of its own size.
        sizes = Counter(c.chunk_size for c in chunks).most_common()
        logger.info(
            "GeminiDDP (%s): %d params (%.1fM elements) in %d %s chunks (%s), %d sharded, "
            "%d kept gathered, %d shards on the CPU; %d fp32 master chunks, %d on the CPU; rank %d/%d",
            policy, len(self.params), self._total_numel / 1e6, len(chunks), self.mixed_precision,
            ", ".join(f"{n} of {size:,} elements" for size, n in sizes) or "none",
            sum(not c.keep_gathered for c in chunks),
            sum(c.keep_gathered for c in chunks),
            sum(c.shard is not None and c.shard.device.type == "cpu" for c in chunks),
            len(self.chunk_manager.chunks("fp32")), len(self.offloaded_masters),
            self.rank, self.world_size,
        )  # fmt: skip

    # -- public state ------------------------------------------------------------

    @property
    def auto(self) -> AutoPlacement | None:
        """The auto placement (None under "static")."""
        return self.placement if isinstance(self.placement, AutoPlacement) else None

    @property
    def offloaded_masters(self) -> frozenset[Chunk]:
        """The fp32 master chunks stepped on the CPU (the placement decides them)."""
        return frozenset(self.placement.offloaded_masters)

    def step_amounts(
        self,
        offloaded: Container[Chunk] | None = None,
        host_shards: Container[Chunk] | None = None,
    ) -> dict[str, float]:
        """What one training step moves under this rank's placement now (or
        under the one ``offloaded`` and ``host_shards`` describe: the master
        chunks stepped on the host, the param chunks whose shards live
        there), as ``zerostack.shard.step_floor``'s keywords (see its [Note:
        step-time floor]).

        Returns:
            ``host_numel`` and ``gpu_numel``: fp32 master elements on the
            host and on the compute device; ``h2d_bytes_per_param``: per
            host-updated element, the bytes of its new value copied to the
            compute device (its parameter dtype's size where its parameter
            shard lives there, 0 where that shard lives on the host too),
            as a mean; ``d2h_bytes_per_param``: its gradient's bytes;
            ``streamed_bytes``: parameter shard bytes on the host of a CUDA
            compute device, copied for the forward and again for the
            backward; ``host_value_fraction``: the share of ``host_numel``
            whose parameter shards live on the host.
        """
        if offloaded is None:
            offloaded = self.placement.offloaded_masters
        host = h2d = d2h = streamed = values = 0
        for c in self.param_chunks:
            item = c.dtype.itemsize
            # A shard on the host of a GPU (on a CPU compute device nothing moves).
            gpu = c.compute_device.type != "cpu"
            on_host = gpu and (shard_on_host(c) if host_shards is None else c in host_shards)
            if on_host:
                streamed += c.shard_size * item
            master = c.paired_chunk
            if master is not None and master in offloaded:
                host += master.shard_size
                d2h += master.shard_size * item
                h2d += 0 if on_host else master.shard_size * item
                values += master.shard_size if on_host else 0
        every = sum(c.shard_size for c in self.chunk_manager.chunks("fp32"))
        return dict(
            host_numel=host, gpu_numel=every - host, h2d_bytes_per_param=h2d / max(host, 1),
            d2h_bytes_per_param=d2h / max(host, 1), streamed_bytes=streamed,
            host_value_fraction=values / max(host, 1),
        )  # fmt: skip

    @property
    def training_state(self) -> TrainingState:
        return self._state

    @property
    def update_wait_s(self) -> float:
        """Seconds spent waiting for CPU updates (the exposed CPU step)."""
        return self._updates.wait_s if self._updates is not None else 0.0

    @property
    def step_pipeline(self) -> CpuStepPipeline | None:
        """The CPU-step pipeline of the model's GeminiOptimizer (None before one)."""
        return self._updates

    # -- the optimizer's interface -------------------------------------------------
    # [Note: who owns the Gemini step] GeminiDDP owns the chunks' states and
    # gathers; the placement decides where chunks live (the only writer of
    # its offloaded masters); GeminiOptimizer owns the step and its CPU-step
    # pipeline (it builds it, closes it, and submits every update). They meet
    # here: the optimizer attaches its pipeline (whose updates every use of a
    # chunk waits for) and three callbacks; it asks which parameters got
    # gradients (take_used) and in which order chunks are used
    # (chunk_compute_order), lets the placement plan (plan_placement) and
    # ends the step (finish_step).

    def attach_step(
        self, pipeline: CpuStepPipeline, on_reduced: Callable[[], None] | None = None,
        on_drop: Callable[[], None] | None = None,
        on_chunk_reduced: Callable[[Chunk], None] | None = None,
    ) -> None:  # fmt: skip
        """GeminiOptimizer's link (see [Note: who owns the Gemini step]): the
        model waits for ``pipeline``'s update of a chunk before it uses that
        chunk, calls ``on_chunk_reduced(chunk)`` in backward once a chunk's
        reduction is finished (not those the end of backward finishes),
        ``on_reduced`` at the end of every reducing backward and
        ``on_drop`` first when ``zero_grad`` drops a batch. A new pipeline
        first finishes what the one before left: its pending updates and
        its failed ones, run again (every rank builds its optimizer at the
        same point: write-backs may be collectives).

        Raises:
            CpuStepError: a failed update of the pipeline before failed
                again; that pipeline stays attached (see zerostack.shard's
                [Note: a failed CPU update]).
        """
        old = self._updates
        if old is not None and old is not pipeline:
            old.check()  # a failed update is kept until it runs: never dropped with its pipeline
            old.await_all()
        self._updates, self._on_reduced, self._on_drop = pipeline, on_reduced, on_drop
        self._on_chunk_reduced = on_chunk_reduced
        self.placement.busy = pipeline

    def take_gather_trace(self) -> list[float]:
        """This rank's trace of the chunks gathered since the last step
        (``ChunkManager.take_gather_trace``) as four 6-bit pieces, each with
        its square, for the step's all-reduce (sums exact in fp32 up to 4096
        ranks); empty at one rank or above 4096. See ``check_gather_traces``."""
        trace = self.chunk_manager.take_gather_trace()
        if not 1 < self.world_size <= 4096:
            return []
        pieces = [(trace >> shift) & 63 for shift in (0, 6, 12, 18)]
        return [float(v) for b in pieces for v in (b, b * b)]

    def check_gather_traces(self, sums: Sequence[float]) -> None:
        """The ``take_gather_trace`` values summed over the ranks: at N ranks,
        N * sum(b*b) == sum(b)**2 for every piece only when every rank's
        piece is the same, so every rank raises alike.

        [Note: ranks that gathered different chunks] Gathers are collectives
        paired by order: ranks that ran different modules (a branch taken by
        the data, MoE routing) gather different chunks, and where those are
        the same size nothing hangs: each rank computes with the other
        ranks' chunks, and the step would train on wrong gradients, silently.
        The step checks the ranks' traces in the all-reduce it makes anyway
        (one hash collision in 2**24 a step).

        Raises:
            CollectiveMismatchError: the ranks' traces differ.
        """
        n = self.world_size
        if any(n * sq != s * s for s, sq in zip(sums[0::2], sums[1::2], strict=True)):
            raise CollectiveMismatchError(
                f"{_API}: the ranks gathered different chunks since the last step: different "
                "modules ran on different ranks (a branch taken by the data, MoE routing), so "
                "each gather was paired with another chunk's on the other ranks and the "
                "forward and backward used wrong parameters; this step's gradients are "
                "dropped. Every rank must run forward and backward through the same modules, "
                "as under ColossalAI's GeminiDDP; run with ZEROSTACK_DEBUG_COLLECTIVES=1 to "
                "see the first module where the ranks differ"
            )

    def refuse_changed_grads(self, api: str) -> None:
        """Raise, before the step uses the reduced gradients, where the user
        changed a ``.grad`` after the backward: ``model.zero_grad()`` (the
        wrapped module's), ``p.grad = None``, ``p.grad = g`` or
        ``p.grad.zero_()``. The reduced gradients live in the chunks and
        ``.grad`` only stands for them, so the step used them as if nothing
        had changed, silently. Dropping the whole batch is
        ``optimizer.zero_grad()``."""
        if self._state is not T.REDUCED:
            return
        names = []
        for i in sorted(self._handed):
            guard = self._guards[i]  # handed out: never None here
            if guard is None or self.params[i].grad is not guard or guard.cleared:
                names.append(self.param_names[self.params[i]])
        if not names:
            return
        raise RuntimeError(
            f"{api}: .grad of {_few(names)} was dropped, zeroed "
            "or replaced after the backward (model.zero_grad(), p.grad = None, p.grad = g); "
            "the reduced gradients live in GeminiDDP's chunks (.grad only stands for them), "
            "so the step cannot leave out or change one parameter's. Call optimizer.zero_grad() "
            "to drop the batch; change gradients before they are reduced with a tensor hook "
            "(param.register_hook)"
        )

    def _forget_used(self) -> None:
        self._used.clear()
        self._handed.clear()

    def take_used(self, params: Sequence[torch.Tensor]) -> list[float]:
        """1.0 for each of ``params`` that got a gradient since the last step,
        else 0.0; forgets them (the step consumes them)."""
        used = [float(p in self._used) for p in params]
        self._forget_used()
        return used

    def plan_placement(
        self,
        masters: dict[Chunk, Chunk],
        optim_bytes_per_element: int,
        staging: Callable[[list[Chunk]], int] | None = None,
    ) -> bool:
        """The placement's plan at the first step (auto), ``staging`` the
        device bytes the optimizer keeps while the given masters stay on the
        host (see ``AutoPlacement.plan``); True when masters moved."""
        return self.placement.plan(masters, optim_bytes_per_element, staging)

    def chunk_compute_order(self) -> list[int]:
        """Chunk indices in the order a training iteration first uses them,
        as auto placement recorded it (empty under static placement)."""
        auto = self.auto
        return auto.stats.chunk_order() if auto is not None else []

    def _transition(self, new: TrainingState) -> None:
        """The only place the training state changes. See [Note: training state table]."""
        if new not in _MOVES[self._state]:
            raise RuntimeError(
                f"{_API} rank {self.rank}: illegal transition {self._state.name} -> {new.name}"
            )
        self._state = new

    def finish_step(self) -> None:
        """The optimizer consumed the reduced gradients (REDUCED -> IDLE)."""
        self._transition(T.IDLE)
        self._forget_grads()

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

    def await_update(self, chunk: Chunk) -> None:
        """Finish ``chunk``'s pending optimizer update (a CPU step) if any.

        Raises:
            CpuStepError: the update failed twice (see zerostack.shard's
                [Note: a failed CPU update]).
        """
        if self._updates is not None:
            self._updates.await_chunk(chunk)

    def _note_versions(self) -> None:
        """Each parameter's version counter now: what ``adopt_writes`` compares."""
        self._versions = [p._version for p in self.params]

    @torch.no_grad()
    def adopt_writes(self) -> None:
        """Parameters the user wrote between steps become their masters' values.

        [Note: parameters written between steps] A user who writes a
        parameter between steps (``p.mul_()`` or ``p.copy_()`` under
        ``torch.no_grad()``, the wrapped module's own ``load_state_dict``)
        expects the next step to start from it, as with torch's optimizers;
        the step updated the fp32 master and wrote the old value plus the
        update back, silently. Such a write lands in the parameter's slot of
        its gathered chunk (a released chunk's parameters have no elements:
        no write fits) and moves the parameter's version counter, which
        none of this package's writes does (they go through the chunks'
        buffers; ``load_state_dict`` notes the counters after it). So every
        forward and every ``state_dict()`` first compares the counters, and
        a parameter whose counter moved has its slot copied into its master
        (this rank's share of it, or the whole slot of a gathered master)
        and into the chunk's shard: no collective, whatever the ranks did.
        The counters are noted again at the end of each forward: a write
        inside it (an embedding's ``max_norm`` renorm) is the model's own.
        A write to a parameter of a released chunk (no elements: ``p.mul_()``
        does nothing there) raises, once. Offloaded updates still running
        are waited for first, where a parameter moved; a write made before
        its own step's update was written back would be lost to it (the
        parameter had no elements, or held the values of before the step
        under gradient accumulation): it raises, once, naming
        ``optimizer.wait_updates()`` (so what is pending is noted before
        waiting). ``p.data.copy_()`` moves
        no counter and is not seen (zero-shard's [Note: parameters written
        in place] has the same limit); ``p.data = t`` (torch's
        ``vector_to_parameters``) raises (see ``_refuse_replaced``).
        """
        if self._state is T.IDLE:
            self._refuse_replaced()
        moved = [
            p
            for p, version in zip(self.params, self._versions, strict=True)
            if p._version != version
        ]
        if not moved or self._state is not T.IDLE:
            return
        # Before wait_updates: its write-back gives an offloaded chunk's
        # parameters their elements again (a write that did nothing looked
        # like one to adopt), or writes the step's values over a write made
        # to the values of before the step (gradient accumulation keeps
        # them): either way the write was lost, silently.
        empty = {p for p in moved if p.numel() == 0}
        pending = self._updates
        overwritten = {
            p
            for p in moved
            if p not in empty and pending is not None and self.chunk_manager.get_chunk(p) in pending
        }
        self.wait_updates()
        for p in moved:
            chunk = self.chunk_manager.get_chunk(p)
            if p in empty or p in overwritten or not chunk.is_gathered:
                continue
            info = chunk.tensors_info[p]
            slot = chunk.buffer[info.offset : info.end]
            master = self.masters.get(p)
            if master is not None:
                _write_slot(self.chunk_manager.get_chunk(master), info.offset, slot)
            chunk.commit_share()
        self._note_versions()  # a lost write is said once
        self._refuse_lost_writes(moved, empty, overwritten)

    def _refuse_lost_writes(self, moved: list, empty: set, overwritten: set) -> None:
        """Raise for the writes ``adopt_writes`` could not keep."""
        released = [self.param_names[p] for p in moved if p in empty]
        if released:
            raise RuntimeError(
                f"{_API}: {_few(released)} was written between "
                "steps while its chunk was released (a parameter has no elements outside forward "
                "and backward here, or until an offloaded update is written back: "
                "optimizer.wait_updates()), so the write did nothing. Change parameters through "
                "the boosted model: model.state_dict(), edit, model.load_state_dict() (or "
                "booster.load_model)"
            )
        lost = [self.param_names[p] for p in moved if p in overwritten]
        if lost:
            raise RuntimeError(
                f"{_API}: {_few(lost)} was written after "
                "optimizer.step() while its offloaded update was still running, so the update's "
                "write-back replaced the written values. Call optimizer.wait_updates() after "
                "optimizer.step(), then write the parameters"
            )

    def _refuse_replaced(self) -> None:
        """Raise for parameters given another tensor (``p.data = t``, torch's
        ``vector_to_parameters``), after pointing them back at their chunks.

        Such a parameter no longer views its chunk: the next forward used
        ``t`` while the step updated the master, whose values the chunk's
        next gather wrote back over it (0.59 off torch after three SGD
        steps), silently. Between steps a parameter views its slot of a
        gathered chunk or is empty (data_ptr 0); any other storage is the
        user's."""
        replaced = []
        for p, (chunk, offset) in zip(self.params, self._homes, strict=True):
            ptr = p.data_ptr()
            if ptr == 0 or (chunk.is_gathered and ptr == chunk.buffer.data_ptr() + offset):
                continue
            info = chunk.tensors_info[p]
            if chunk.is_gathered:
                p.data = chunk.buffer[info.offset : info.end].view(info.shape)
            else:
                p.data = torch.empty(0, dtype=chunk.dtype, device=chunk.compute_device)
            replaced.append(self.param_names[p])
        if replaced:
            raise RuntimeError(
                f"{_API}: parameters given another tensor between steps (p.data = t, e.g. by "
                f"torch.nn.utils.vector_to_parameters), which their chunks never see (got "
                f"{_few(replaced)}); they are pointed back at "
                "their chunks' values. Write in place under torch.no_grad() (p.copy_(t)) while "
                "the parameters hold their values, or through the boosted model: "
                "model.state_dict(), edit, model.load_state_dict() (or booster.load_model)"
            )

    def wait_updates(self) -> None:
        """Finish every pending optimizer update (failed ones stay kept)."""
        if self._updates is not None:
            self._updates.await_all()

    def retry_failed_updates(self) -> None:
        """Run the failed CPU updates again, in chunk order.

        Raises:
            CpuStepError: an update failed again; nothing else changed.
        """
        if self._updates is not None:
            self._updates.check()

    def chunk_placement(self, *, table: bool = False) -> Any:
        """Where every chunk lives now (this rank): a list of
        zerostack.gemini ChunkRow (index, kind, dtype, chunk_size, sharded,
        home tier, gathered, bytes per tier), or with ``table`` a text table
        of them with a per-tier summary and the chunk size. See [Note:
        memory tiers]."""
        from zerostack.gemini._memory import chunk_placement, format_placement

        rows = chunk_placement(self)
        return format_placement(rows) if table else rows

    def host_bytes(self, optimizer: Any = None) -> Any:
        """Host bytes by owner now (this rank): a zerostack.gemini HostBytes
        with fp16/bf16 parameter chunks, fp32 masters, optimizer states in
        RAM (with ``optimizer``), the CPU step's staging buffers, NVMe
        staging, the process's RSS and what it holds beyond them
        (``unaccounted``); ``.table()`` prints it. See [Note: host bytes]."""
        from zerostack.gemini._memory import host_bytes

        return host_bytes(self, optimizer)

    def memory_timeline(self, optimizer: Any = None) -> Any:
        """A zerostack.gemini MemoryTimeline: ``with model.memory_timeline(opt)
        as t:`` around one step records the bytes on each tier (gpu, pinned,
        pageable host, disk) at every module's forward and backward;
        ``t.table()``, ``t.save_png(path)``."""
        from zerostack.gemini._memory import MemoryTimeline

        return MemoryTimeline(self, optimizer)

    # -- hooks -------------------------------------------------------------------

    def _register_hooks(self) -> None:
        # Hooks hold this module weakly: a tensor hook lives in autograd's C++
        # graph, out of the garbage collector's sight, and would keep the
        # model (and all its chunks) alive forever through a strong reference.
        self._handles = []
        # A parameter's hook names its slot by index: a chunk held by the hook
        # would be a cycle through autograd's C++ side, never collected.
        tensor_chunk = self.chunk_manager.tensor_chunk_map
        self._slots = [(tensor_chunk[p], tensor_chunk[p].tensors_info[p]) for p in self.params]
        # What param.grad holds from the reducing backward to the step (see
        # zerostack.shard's [Note: sharded param.grad]): one per parameter,
        # made at its first gradient (like the parameter, then gathered), reused.
        self._guards: list[ShardedGradient | None] = [None] * len(self.params)
        self._guarded = [p for p in self.params if p.requires_grad]
        for i, p in enumerate(self.params):
            if p.requires_grad:
                on_grad = _WeakCall(self, "_on_grad", i)
                self._handles.append(p.register_post_accumulate_grad_hook(on_grad))
        for name, m in self.module.named_modules():
            direct = [p for p in m.parameters(recurse=False) if p in self.param_names]
            if not direct:
                continue
            hooks = _ModuleHooks(self, name or "(the root)", direct, self._chunks(direct))
            self._handles.append(m.register_forward_pre_hook(hooks.pre_forward))
            self._handles.append(m.register_forward_hook(hooks.post_forward))

    def _chunks(self, params: Iterable[torch.Tensor]) -> list[Chunk]:
        return self.chunk_manager.get_chunks(params)

    @property
    def _training(self) -> bool:
        # Gathers of training iterations are auto placement's moments (an
        # evaluation forward has another order).
        return self._state in (T.FORWARD, T.BACKWARD)

    def _gather(
        self, slots: list[_Slot], state: TensorState, chunks: list[Chunk], label: str
    ) -> None:
        """Gather ``chunks`` (those holding the tensors of ``slots``) and mark
        the tensors in use. The hot path: it runs for every module with
        parameters, three times a step."""
        pipeline, manager = self._updates, self.chunk_manager
        set_collective_label(label)
        with phase("zerostack::gather"):
            training = self._state is T.FORWARD or self._state is T.BACKWARD
            self.placement.before_access(chunks, training)
            for chunk in chunks:
                if pipeline is not None and chunk in pipeline:
                    pipeline.await_chunk(chunk)
                manager.access_chunk(chunk)
            self.placement.after_access(chunks, training)
        for chunk, info in slots:
            if info.state in _GATHERABLE:
                chunk.trans_info_state(info, state)

    def _release(self, params: Sequence[torch.Tensor], state: TensorState) -> None:
        for p in params:
            chunk = self.chunk_manager.get_chunk(p)
            if chunk.tensor_state(p) is S.COMPUTE:
                chunk.trans_tensor_state(p, state)
        self._release_idle(self._chunks(params))

    def _release_idle(self, chunks: Iterable[Chunk]) -> None:
        if self.placement.keeps_cache:
            return  # auto keeps gathered chunks as a cache, trimmed by next use
        # Gathered ahead of their use, or needed next: kept (see zerostack.chunk's
        # [Note: a prefetch copies beside compute]; drain() waits for those left unused).
        ahead = self.placement.kept()
        for chunk in chunks:
            if chunk.can_release and chunk not in ahead:
                self.chunk_manager.release_chunk(chunk)

    def _pre_forward(self, slots: list[_Slot], chunks: list[Chunk], label: str) -> None:
        # Not through forward(), which says so first: unwrap(). With grad
        # chunks the parameters hold their values: an evaluation may run.
        evaluating = self.accumulate and not torch.is_grad_enabled()
        if self._state is T.REDUCED and not evaluating:
            raise RuntimeError(
                f"{_API}: the {label} between a backward and its optimizer.step() (through "
                "model.unwrap() or a submodule): the reduced gradients sit where the "
                "parameters belong, and it would compute with them; run it after "
                "optimizer.step() (or drop the gradients with optimizer.zero_grad())"
            )
        if self._state is not T.BACKWARD and not self.placement.keeps_cache:
            # Forward has moved past the chunks this module does not use:
            # release those (a chunk shared by consecutive modules is gathered
            # once). Inside backward (a recomputed forward under activation
            # checkpointing) chunks stay until their gradients are reduced.
            idle = [c for c in self.chunk_manager.accessed_chunks if c not in chunks]
            if idle:
                self._release_idle(idle)
        self._gather(slots, S.COMPUTE, chunks, label)

    def _post_forward(self, slots: list[_Slot], pre_backward: Callable, out: Any) -> None:
        for chunk, info in slots:
            if info.state is S.COMPUTE:
                chunk.trans_info_state(info, S.HOLD)
        if not torch.is_grad_enabled():
            return
        # Before this module's backward, gather its chunks again. One output
        # (most modules): a plain tensor hook, a fifth of the host time of a
        # multi-grad hook; the gather is idempotent if backward passes twice.
        if isinstance(out, torch.Tensor):
            if out.requires_grad:
                out.register_hook(pre_backward)
            return
        tensors = [t for t in _flatten(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(tensors) == 1:
            tensors[0].register_hook(pre_backward)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, pre_backward, mode="any")

    def _pre_backward(
        self, slots: list[_Slot], chunks: list[Chunk], label: str, grads: Any
    ) -> None:
        if self._state is T.REDUCED:
            raise RuntimeError(
                f"{_API}: a second backward before optimizer.step() (got a backward in state "
                "REDUCED: the last backward's gradients are reduced already); to accumulate "
                "gradients run all but the last backward inside no_sync() (booster.no_sync("
                "model)) with enable_gradient_accumulation=True, or add the losses first"
            )
        if self._state is not T.BACKWARD:
            self._transition(T.BACKWARD)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._gather(slots, S.COMPUTE, chunks, label)

    def _on_grad(self, index: int, p: torch.Tensor) -> None:
        chunk, info = self._slots[index]
        self._used.add(p)
        grad = local_grad(p)  # a guard holds what autograd added into it, if anything
        if self.accumulate:
            if chunk.grad_chunk is None or chunk.grad_chunk.buffer is None:
                self.chunk_manager.init_grad_chunk(chunk)
            chunk.grad_view(p).add_(grad)
        else:
            # The value is no longer needed: its slot takes the gradient.
            chunk.buffer[info.offset : info.end].copy_(grad.reshape(-1))
        # Under no_sync nothing is reduced: param.grad stays None until the
        # reducing backward (a guard there would make autograd accumulate into it).
        if self._no_sync:
            p.grad = None
        else:
            guard = self._guards[index]
            if guard is None:
                guard = self._guards[index] = ShardedGradient(p.shape, p.dtype, p.device, _API)
            guard.local, guard.cleared = None, False  # taken into the chunk above
            p.grad = guard
            self._handed.add(index)
        if info.state is S.HOLD:
            chunk.trans_info_state(info, S.COMPUTE)
        chunk.trans_info_state(info, S.HOLD_AFTER_BWD)
        if self._no_sync:
            return  # HOLD_AFTER_BWD -> COMPUTE in the next forward, -> READY in the last backward
        chunk.trans_info_state(info, S.READY_FOR_REDUCE)
        self._reduce_ready()

    # -- reduction -----------------------------------------------------------------

    def _reduce_ready(self, flush: bool = False) -> None:
        """Reduce chunks strictly in reverse order of creation, so every rank
        issues the same collectives even when ranks differ in which parameters
        got gradients. (Gathers are collectives too: every rank must run
        forward and backward through the same modules.)"""
        while self._next_reduce < len(self._reduce_order):
            chunk = self._reduce_order[self._next_reduce]
            if not chunk.can_reduce:
                if not flush:
                    return
                self._zero_fill_unused(chunk)
            set_collective_label(f"gradient reduction of chunk {chunk.index}")
            with phase("zerostack::reduce"):
                handle = self.chunk_manager.reduce_chunk(
                    chunk, async_op=self.config.enable_async_reduce, accumulate=self._carry
                )
            self._pending.append((chunk, handle))
            self._next_reduce += 1
            # Finish all but the last two reductions: finishing frees the
            # gathered gradient buffer, so backward holds a few chunks, not all.
            while len(self._pending) > 2:
                done = self._pending.pop(0)
                _finish_reduce(*done)
                # See zerostack.gemini's [Note: gradients leave during backward].
                if self._on_chunk_reduced is not None:
                    self._on_chunk_reduced(done[0])

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
                chunk.copy_into_slot(t, None)
            for s in path_between(info.state, S.READY_FOR_REDUCE):
                chunk.trans_tensor_state(t, s)

    def _finish_backward(self) -> None:
        self.placement.end_warmup()
        self.placement.drain()  # gathers ahead that this backward did not use
        if self._no_sync:
            self._transition(T.ACCUMULATED)
            self._accumulated = True
            return
        self._accumulated = False
        self._reduce_ready(flush=True)
        for entry in self._pending:
            _finish_reduce(*entry)
        self._pending.clear()
        self._next_reduce = 0
        self._transition(T.REDUCED)
        # Frozen parameters were gathered for backward too; release them now.
        frozen = [p for p in self.params if not p.requires_grad]
        if frozen:
            self._release(frozen, S.HOLD)
        if self._on_reduced is not None:
            self._on_reduced()

    # -- forward ------------------------------------------------------------------

    def _cast_inputs(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            cast = self.config.precision.cast_forward_inputs and obj.is_floating_point()
            return obj.to(self.compute_device, self.mixed_precision if cast else obj.dtype)
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._cast_inputs(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self._cast_inputs(v) for k, v in obj.items()}
        return obj

    def _refuse_unfrozen(self) -> None:
        """A parameter frozen when the model was wrapped has no fp32 master
        and no gradient hook: set ``requires_grad`` later, it would never be
        trained, silently."""
        if self._frozen and any(p.requires_grad for p in self._frozen):
            names = [self.param_names[p] for p in self._frozen if p.requires_grad]
            raise NotImplementedError(
                f"{_API}: parameters frozen when the model was wrapped cannot be unfrozen (got "
                f"requires_grad=True on {names[:3]}); they have no fp32 master and would not be "
                "trained: set requires_grad before GeminiDDP (or booster.boost with "
                "GeminiPlugin) wraps the model (freezing a trained parameter later is fine)"
            )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.retry_failed_updates()  # a failed CPU update: the model cannot go on
        if self._state is T.REDUCED and not torch.is_grad_enabled() and not self.accumulate:
            raise RuntimeError(
                f"{_API}.forward: an evaluation (no gradients) between a backward and its "
                "optimizer.step(): the reduced gradients sit where the parameters belong; "
                "evaluate after optimizer.step() (or drop the gradients with optimizer.zero_grad())"
            )
        if self._state is T.REDUCED and not self.accumulate:
            raise RuntimeError(
                f"{_API}.forward: the reduced gradients of the last backward sit where the "
                "parameters belong; call optimizer.step() before the next forward (to accumulate "
                "gradients over several batches, build with enable_gradient_accumulation=True, "
                "as ColossalAI's GeminiPlugin, then backward on each batch and step every few, or "
                "run all but the last backward inside no_sync() (booster.no_sync(model))), or "
                "optimizer.zero_grad() to drop them (the boosted model's zero_grad() does too)"
            )
        if self._state is T.BACKWARD:
            raise RuntimeError(
                f"{_API}.forward: the last backward did not finish (an exception in it?); call "
                "optimizer.zero_grad() to drop that batch, then forward again"
            )
        self._refuse_unfrozen()
        self.adopt_writes()  # See [Note: parameters written between steps]
        args, kwargs = self._cast_inputs(args), self._cast_inputs(kwargs)
        training = torch.is_grad_enabled()
        if self._updates is not None:
            self._updates.await_kept_gathered()  # See [Note: write-back order]
        before = self._state
        if training:
            # See [Note: backward on several batches before one step].
            self._carry = self._carry or before is T.REDUCED
            self._transition(T.FORWARD)
            self.placement.start_iteration()
        try:
            out = self.module(*args, **kwargs)
        except BaseException:
            self._abandon_forward(before if training else None)
            raise
        if training:
            self._transition(T.AWAIT_BACKWARD)
        # Writes inside forward (an embedding's max_norm renorm) are not the
        # user's between steps: see [Note: parameters written between steps].
        self._note_versions()
        # The end of forward: nothing is in use until backward gathers again.
        if training or self.config.scatter_after_inference:
            idle = [c for c in self.chunk_manager.accessed_chunks if c.can_release]
            if self.auto is not None and not training:
                kept = self.placement.kept()  # gathered ahead by a training iteration
                for c in idle:
                    if c not in kept:
                        self.chunk_manager.release_chunk(c)
            else:
                self._release_idle(idle)
        return out

    def _abandon_forward(self, before: TrainingState | None) -> None:
        """A forward raised: what it gathered is released and the state goes
        back to ``before`` (None: an inference forward, which moved none).
        A forward changes no values: the batch is dropped already."""
        for chunk in self.param_chunks:
            for info in chunk.tensors_info.values():
                if info.state is S.COMPUTE:
                    chunk.trans_info_state(info, S.HOLD)
        if before is None:
            self.placement.drain()  # an inference forward: no gather of it was recorded
        else:
            self.placement.abandon_iteration()
        self._release_idle([c for c in self.chunk_manager.accessed_chunks if c.can_release])
        if before is not None:
            self._transition(before)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this iteration's gradients (``optimizer.zero_grad()`` calls it).

        Between a forward and its backward only gradients accumulated under
        ``no_sync`` are dropped. After a backward (under ``no_sync`` or not,
        finished or ended by an exception) the batch is dropped: reductions in
        flight are waited for, every chunk's parameters are as before the
        batch and the model is IDLE, so the steps that follow are those of a
        run that never saw the batch (see zerostack.shard's [Note: dropping a
        batch]). Between steps, nothing to do.

        Args:
            set_to_none: accepted for torch's interface (gradients live in
                the chunks either way).
        """
        state = self._state
        if state is T.IDLE:
            return
        if state is T.FORWARD or state is T.AWAIT_BACKWARD:
            if self._carry:
                self._drop_carried()
            if self._accumulated:
                self._drop_accumulated()
            return
        self._drop_batch()

    def drop_batch_for_load(self) -> None:
        """What every load calls first: a batch a backward left behind (one
        that raised, or gradients not stepped) is dropped, as by
        ``zero_grad()``."""
        if self._state is T.BACKWARD or self._state is T.ACCUMULATED or self._state is T.REDUCED:
            self._drop_batch()
        else:
            if self._carry:
                self._drop_carried()
            self.placement.drain()  # gathers ahead read the host shards a load writes

    def _drop_carried(self) -> None:
        """Drop the reduced gradients carried into this forward (see [Note:
        backward on several batches before one step]): the next reduction
        writes over them, a kept-gathered grad chunk starts from zeros."""
        if self._on_drop is not None:
            self._on_drop()  # the optimizer's staged copies of them
        for chunk in self.grad_chunks:
            self.chunk_manager.consume_grad(chunk)
        self._forget_grads()

    def _forget_grads(self) -> None:
        """No reduced gradient is left for the step: none carried, no
        parameter counted as used, and the next backward accumulates into
        None again (``param.grad`` of the guarded parameters)."""
        self._carry = False
        self._forget_used()
        for p in self._guarded:
            p.grad = None

    def _drop_accumulated(self) -> None:
        """Zero the gradients that no_sync backwards left in the grad chunks."""
        for chunk in self.grad_chunks:
            grad = chunk.grad_chunk
            if grad is not None and grad.buffer is not None:
                grad.buffer.zero_()
            for info in chunk.tensors_info.values():
                if info.state is S.HOLD_AFTER_BWD:
                    for s in path_between(info.state, S.HOLD):
                        chunk.trans_info_state(info, s)
        self._forget_used()
        self._accumulated = False

    @torch.no_grad()
    def _drop_batch(self) -> None:
        """From ACCUMULATED, BACKWARD or REDUCED: every chunk as before the
        batch, IDLE. Reductions are collectives every rank issued in the same
        order: they are waited for, never left behind. The optimizer's
        ``on_drop`` first (see attach_step)."""
        if self._on_drop is not None:
            self._on_drop()
        for _chunk, handle in self._pending:
            if handle is not None:
                handle.wait()
        self._pending.clear()
        # Before the host shards are written back: see zerostack.chunk's
        # [Note: a prefetch copies beside compute].
        self.placement.abandon_iteration()
        self._next_reduce = 0
        for chunk in self.param_chunks:
            for info in chunk.tensors_info.values():
                if info.state is not S.HOLD and info.state is not S.FREE:
                    for s in path_between(info.state, S.HOLD):
                        chunk.trans_info_state(info, s)
        # A reduced gradient sits in place of the parameter shard, gradients
        # in the slots of gathered chunks or in grad chunks: the masters hold
        # the parameters (a chunk with an update of an earlier step still
        # pending, or kept after a failure, is that step's and stays).
        for chunk in self.grad_chunks:
            if self._updates is None or chunk not in self._updates:
                write_back(self.chunk_manager, chunk)
        self._release_idle([c for c in self.chunk_manager.accessed_chunks if c.can_release])
        self._accumulated = False
        self._transition(T.IDLE)
        self._forget_grads()

    def state_dict(  # type: ignore[override]
        self, *args: Any, only_rank_0: bool = False, **kwargs: Any
    ) -> dict[str, torch.Tensor]:
        """The whole model's parameters (fp32, from the masters) and buffers,
        on the CPU: on every rank, or with ``only_rank_0`` on rank 0 (the
        others still take part in the gathers and get an empty dict)."""
        self.retry_failed_updates()
        self.wait_updates()
        self.adopt_writes()
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
        for name, b in persistent_buffers(self.module, remove_duplicate=False).items():
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
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"{_API}.load_state_dict: state_dict must be a dict of tensors (got "
                f"{type(state_dict).__name__})"
            )
        self.drop_batch_for_load()
        self.wait_updates()
        names = self.aliases
        buffers = persistent_buffers(self.module, remove_duplicate=False)
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
        # Every value is checked before the first is loaded: a bad one leaves
        # the model as it was.
        for name, value in state_dict.items():
            target = buffers.get(name)
            shape = None if target is None else target.shape
            if target is None and name in names:
                p = names[name]
                shape = self.chunk_manager.get_chunk(p).tensors_info[p].shape
            if shape is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{_API}.load_state_dict: {name} must be a tensor (got {type(value).__name__})"
                )
            if tuple(value.shape) != tuple(shape):
                raise ValueError(
                    f"{_API}.load_state_dict: {name} has shape {tuple(value.shape)}, the model's "
                    f"is {tuple(shape)}"
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
                    chunk.commit_share()  # this rank's share into its shard before releasing
                    if not was and chunk.can_release:
                        self.chunk_manager.release_chunk(chunk)
        self._note_versions()  # its own writes: see [Note: parameters written between steps]
        return None


def _write_slot(master: Chunk, offset: int, values: torch.Tensor) -> None:
    """``values`` over the elements from ``offset`` on of ``master``: the
    whole slot where it is gathered, else the part in this rank's share."""
    master.settle()
    if master.is_gathered:
        master.buffer[offset : offset + values.numel()].copy_(values)
        master.commit_share()
        return
    lo = master.rank * master.shard_size
    begin, end = max(offset, lo), min(offset + values.numel(), lo + master.shard_size)
    if begin < end:
        master.local_share()[begin - lo : end - lo].copy_(values[begin - offset : end - offset])


_set_debug = debug_collectives  # the argument of GeminiDDP shadows the function
# Modules a GeminiDDP holds: their parameters are views into its chunks.
_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_FIXED = (  # why a submodule assigned after wrapping is refused
    "the wrapped model's parameters live in GeminiDDP's chunks: the forward would use the new "
    "ones, no step would train them, and state_dict() and checkpoints would keep the old values"
)


def _check_module(module: object) -> None:
    if isinstance(module, GeminiDDP):
        raise TypeError(f"{_API}: the module is a GeminiDDP already; wrap the plain model once")
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_API}: module must be an nn.Module (got {type(module).__name__})")
    if module in _WRAPPED:
        raise RuntimeError(
            f"{_API}: the module is wrapped by another GeminiDDP already (got "
            f"{type(module).__name__}); its parameters live in that wrapper's chunks"
        )


def _check_device(value: object) -> torch.device:
    """The compute device: the current CUDA device, else the CPU, when None."""
    if value is None:
        return default_compute_device()
    return check_device(_API, "compute_device", value, optional=True)


class _WeakCall:
    """``getattr(target, name)(*args, *call_args)``, holding ``target``
    weakly; built once, so a step creates no closure."""

    __slots__ = ("_args", "_name", "_ref")

    def __init__(self, target: Any, name: str, *args: Any) -> None:
        self._ref, self._name, self._args = weakref.ref(target), name, args

    def __call__(self, *call_args: Any) -> Any:
        target = self._ref()
        if target is not None:
            return getattr(target, self._name)(*self._args, *call_args)
        return None


class _ModuleHooks:
    """The forward and pre-backward hooks of one module with parameters of
    its own (and the chunks holding them); holds the GeminiDDP weakly and is
    built once."""

    __slots__ = ("_ddp", "_forward_label", "_pre_backward", "chunks", "slots")

    def __init__(
        self, ddp: GeminiDDP, name: str, params: list[torch.Tensor], chunks: list[Chunk]
    ) -> None:
        self._ddp = weakref.ref(ddp)
        tensor_chunk = ddp.chunk_manager.tensor_chunk_map
        # (chunk, TensorInfo) per parameter, looked up once: a lookup keyed by
        # a tensor calls Tensor.__hash__ in Python, thousands of times a step.
        self.slots = [(tensor_chunk[p], tensor_chunk[p].tensors_info[p]) for p in params]
        self.chunks = chunks
        self._forward_label = f"forward of module {name}"
        backward_label = f"backward of module {name}"
        self._pre_backward = _WeakCall(ddp, "_pre_backward", self.slots, chunks, backward_label)

    def __deepcopy__(self, memo: dict) -> _ModuleHooks:
        # A copy would run GeminiDDP's hooks on copies of the chunks: the
        # copied module computes with the weights of the time of the copy.
        raise RuntimeError(
            f"{_API}: copy.deepcopy of a module wrapped by GeminiDDP (GeminiPlugin's "
            "model.unwrap(), or one of its submodules; torch.optim.swa_utils.AveragedModel "
            "makes such a copy): its parameters are views into chunks that the copy would not "
            "follow, so it would compute with the weights of the time of the copy. For an EMA, "
            "copy the model before booster.boost and update the copy from the boosted model's "
            "state_dict() (on every rank); see the booster guide, 'Reading the weights "
            "during training'"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # torch.save(model.unwrap()) pickles the module with its hooks: it
        # failed with "cannot pickle 'weakref.ReferenceType' object".
        raise NotImplementedError(
            f"{_API}: pickling a module wrapped by GeminiDDP is not supported (got "
            "torch.save or pickle of GeminiPlugin's model.unwrap(), the boosted model, or one "
            "of its submodules): its parameters are views into chunks, empty between steps at "
            "several ranks. Save the weights with booster.save_model(model, path), or "
            "torch.save(model.state_dict()) (call state_dict() on every rank), and rebuild the "
            "module from its class"
        )

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        ddp = self._ddp()
        if ddp is not None:
            ddp._pre_forward(self.slots, self.chunks, self._forward_label)

    def post_forward(self, module: nn.Module, args: Any, out: Any) -> None:
        ddp = self._ddp()
        if ddp is not None:
            ddp._post_forward(self.slots, self._pre_backward, out)


def _few(names: list[str]) -> str:
    """The first three of ``names`` for a message, `` ...`` when there are more."""
    return f"{names[:3]}{' ...' if len(names) > 3 else ''}"


def _flatten(out: Any) -> list[Any]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flatten(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flatten(o)]
    return []


def _finish_reduce(chunk: Chunk, handle: Any) -> None:
    """Wait for ``chunk``'s reduction in flight (None: it ran synchronously)."""
    if handle is not None:
        handle.wait()
