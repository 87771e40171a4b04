"""Automatic placement: what a warm-up iteration measured, and the decisions
taken from it (which shards and optimizer chunks live on the GPU, which
gathered chunks to drop when memory runs short)."""

from __future__ import annotations

import bisect
import logging
import zlib
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch

from zerostack.chunk import (
    Chunk,
    ChunkManager,
    GatheredBytes,
    all_reduce_max,
    set_collective_label,
)
from zerostack.gemini._config import AutoPlacementConfig, StaticPlacementConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TensorPlacement:
    """Where one parameter goes when it is registered."""

    sharded: bool  # in a sharded chunk (else kept gathered on every rank)
    param_on_cpu: bool  # its chunk's shard lives on the CPU between uses
    master_on_cpu: bool  # its master chunk (and optimizer state) is stepped on the CPU


class Placement:
    """The interface GeminiDDP drives a placement policy through.

    ``decide`` places each parameter as it is registered; ``attach`` hands
    over the chunks once they exist. Then, per training iteration,
    ``start_iteration``, ``before_access``/``after_access`` around every
    gather, ``end_warmup`` at the end of backward, and ``plan`` at the first
    optimizer step; ``abandon_iteration`` when a forward or backward raised.
    ``offloaded_masters`` are the master chunks stepped on the CPU, written
    only here (``offload_master`` at registration, ``plan``);
    ``keeps_cache`` says whether idle gathered chunks stay gathered; ``busy``
    holds the chunks with an optimizer update not written back (GeminiDDP
    sets it to its optimizer's CPU-step pipeline), which are not prefetched.

    Both policies gather up to ``max_prefetch`` chunks ahead of use, in the
    order of gathers a training iteration recorded (``moment`` counts the
    gathers of the current one); ``prefetched`` holds those not yet used,
    which GeminiDDP does not release, and ``drain`` waits for them.
    """

    warming_up = False
    planned = True
    keeps_cache = False

    def __init__(self, keep_gathered: bool, max_prefetch: int = 0) -> None:
        self.keep_gathered = keep_gathered
        self.max_prefetch = max_prefetch
        self.offloaded_masters: set[Chunk] = set()
        self.manager: ChunkManager | None = None
        self.param_chunks: list[Chunk] = []
        self.busy: Container = ()
        self.moment = 0
        self.prefetches = 0
        self._by_index: dict[int, Chunk] = {}
        self._prefetched: dict[Chunk, Any] = {}

    def decide(self, seen: int, numel: int, total: int) -> TensorPlacement:
        """Place a parameter of ``numel`` elements after ``seen`` of ``total``."""
        raise NotImplementedError

    def attach(self, manager: ChunkManager, param_chunks: list[Chunk]) -> None:
        self.manager, self.param_chunks = manager, param_chunks
        self._by_index = {c.index: c for c in param_chunks}

    def offload_master(self, chunk: Chunk) -> None:
        """A master chunk ``decide`` put on the CPU was created: it is stepped there."""
        self.offloaded_masters.add(chunk)

    def start_iteration(self) -> None:
        pass

    def abandon_iteration(self) -> None:
        """The iteration's forward or backward raised (its batch is dropped):
        wait for the gathers prefetched ahead (collectives every rank
        issued), and record again what a recording iteration recorded."""
        self.drain()
        self.start_iteration()

    def before_access(self, chunks: list[Chunk], training: bool) -> None:
        pass

    def after_access(self, chunks: list[Chunk], training: bool) -> None:
        pass

    def end_warmup(self) -> None:
        pass

    def plan(
        self,
        masters: dict[Chunk, Chunk],
        optim_bytes_per_element: int,
        staging: Callable[[list[Chunk]], int] | None = None,
    ) -> bool:
        """Decide where chunks live for good; True when masters moved."""
        return False

    # -- prefetch ------------------------------------------------------------------

    @property
    def prefetched(self) -> Container[Chunk]:
        """Chunks gathered ahead and not yet used."""
        return self._prefetched

    def kept(self) -> Container[Chunk]:
        """Chunks GeminiDDP does not release when idle: those gathered ahead
        and not yet used."""
        return self._prefetched

    def wait_prefetched(self, chunk: Chunk) -> None:
        handle = self._prefetched.pop(chunk, None)
        if handle is not None:
            handle.wait()

    def drain(self) -> None:
        """Wait for every gather prefetched ahead and not used (the order
        changed, or the iteration ended early): collectives every rank
        issued, and on CUDA copies that read host shards, which the host
        waits for too, before an optimizer update writes them (see
        zerostack.chunk's [Note: a prefetch copies beside compute])."""
        left = list(self._prefetched)
        for chunk in left:
            self.wait_prefetched(chunk)
        if left and left[0].compute_device.type == "cuda":
            torch.cuda.current_stream(left[0].compute_device).synchronize()

    def _prefetch(self, order: list[tuple[int, ...]], fits: Callable[[Chunk, int], bool]) -> None:
        """Gather, asynchronously, the chunks the next moments of ``order``
        need, so that at most ``max_prefetch`` are in flight, while ``fits``
        says one fits (given the moment that needs it); chunks with an update
        pending are left alone."""
        wanted: dict[Chunk, int] = {}
        room = self.max_prefetch - len(self._prefetched)
        for m in range(self.moment, min(len(order), self.moment + 4 * self.max_prefetch)):
            if len(wanted) >= room:
                break
            for i in order[m]:
                c = self._by_index.get(i)
                if c is not None and not c.is_gathered and c not in wanted and c not in self.busy:
                    wanted[c] = m
        for c, m in list(wanted.items())[: max(room, 0)]:
            if not fits(c, m):
                break
            handle = self.manager.access_chunk(c, async_op=True)
            if handle is not None:
                self._prefetched[c] = handle
            self.prefetches += 1


class StaticPlacement(Placement):
    """``placement_policy="static"``: fixed shares, decided at registration.

    The last parameters (in registration order) have their masters on the
    CPU: their CPU updates then have the forward of every earlier chunk to
    hide behind. The first ``offload_param_frac`` have their shards on the
    CPU, and the first ``shard_param_frac`` are sharded (all of them unless
    the chunk configuration keeps chunks gathered and the share is 1).

    With ``max_prefetch`` the first training iteration records the order of
    its gathers, and later ones gather that many chunks ahead of it.
    """

    def __init__(self, config: StaticPlacementConfig, keep_gathered: bool) -> None:
        super().__init__(keep_gathered, config.max_prefetch)
        self.config = config
        self.order: list[tuple[int, ...]] = []
        self.recording = config.max_prefetch > 0

    def decide(self, seen: int, numel: int, total: int) -> TensorPlacement:
        c = self.config
        if c.shard_param_frac < 1.0:
            sharded = seen < c.shard_param_frac * total
        else:
            sharded = not self.keep_gathered
        return TensorPlacement(
            sharded=sharded,
            param_on_cpu=seen < c.offload_param_frac * total,
            master_on_cpu=seen + numel > total - c.offload_optim_frac * total,
        )

    def start_iteration(self) -> None:
        """A training forward: while recording, a forward without a backward
        before it (a sanity check, say) is not part of the order."""
        self.moment = 0
        if self.recording:
            self.order = []

    def before_access(self, chunks: list[Chunk], training: bool) -> None:
        if self.max_prefetch == 0:
            return
        for c in chunks:
            self.wait_prefetched(c)
        if training:
            if self.recording:
                self.order.append(tuple(c.index for c in chunks))
            self.moment += 1

    def after_access(self, chunks: list[Chunk], training: bool) -> None:
        if training and self.max_prefetch > 0 and not self.recording:
            self._prefetch(self.order, lambda c, m: True)

    def kept(self) -> Container[Chunk]:
        """Those gathered ahead, and those the next ``max_prefetch`` moments
        need: a chunk forward used last and backward needs first stays
        gathered across the end of forward, instead of a release and a
        gather again."""
        if self.recording or self.max_prefetch == 0:
            return self._prefetched
        soon = set(self._prefetched)
        for m in range(self.moment, min(len(self.order), self.moment + 1 + self.max_prefetch)):
            soon.update(self._by_index[i] for i in self.order[m] if i in self._by_index)
        return soon

    def end_warmup(self) -> None:
        """The end of a backward: the recording (the first iteration) ends."""
        if self.recording:
            self.recording = False
            logger.info(
                "Gemini static: recorded %d gathers over %d chunks; %d chunks gathered ahead",
                len(self.order), len({i for m in self.order for i in m}), self.max_prefetch,
            )  # fmt: skip


@dataclass
class MemStats:
    """What the warm-up iteration (the first forward + backward) recorded.

    A *moment* is one gather point: a module's forward pre-hook or the hook
    before its backward. ``order[i]`` are the indices of the chunks moment i
    needed, ``non_model_bytes[i]`` the peak memory of the compute device that
    was not model data (activations, temporaries) from moment i to moment
    i + 1, and ``gathered_bytes[i]`` the gathered chunk buffers at moment i.
    On a CPU compute device there is no allocator to ask and non-model bytes
    are recorded as 0.
    """

    order: list[tuple[int, ...]] = field(default_factory=list)
    non_model_bytes: list[int] = field(default_factory=list)
    gathered_bytes: list[int] = field(default_factory=list)
    _uses: dict[int, list[int]] = field(default_factory=dict, repr=False)

    @property
    def max_non_model_bytes(self) -> int:
        return max(self.non_model_bytes, default=0)

    @property
    def max_gathered_bytes(self) -> int:
        return max(self.gathered_bytes, default=0)

    def chunk_order(self) -> list[int]:
        """Chunk indices in the order of first use."""
        return list(dict.fromkeys(i for moment in self.order for i in moment))

    def finish(self) -> None:
        self._uses = {}
        for m, moment in enumerate(self.order):
            for i in moment:
                self._uses.setdefault(i, []).append(m)

    def next_use(self, chunk_index: int, moment: int) -> int:
        """The first moment after ``moment`` that needs the chunk; uses in the
        next iteration count as ``len(order)`` further on; a chunk never used
        is infinitely far."""
        uses = self._uses.get(chunk_index)
        if not uses:
            return 1 << 62
        k = bisect.bisect_right(uses, moment)
        return uses[k] if k < len(uses) else uses[0] + len(self.order)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Auto placement's decision at its plan: the param chunks in compute
    order and whether each shard goes to the compute device, the master
    chunks in that order, the bytes of the first ``optim_on`` of them (with
    their states) that go there, and the bytes kept free for the optimizer's
    staging."""

    ordered: list[Chunk]
    params_fit: list[bool]
    candidates: list[Chunk]
    needs: list[int]
    optim_on: int
    reserved_bytes: int


class AutoPlacement(Placement):
    """``placement_policy="auto"`` of GeminiDDP.

    During the warm-up iteration parameter shards sit on the GPU while they
    fit in ``(1 - warmup_non_model_data_ratio)`` of the capacity, the rest and
    every optimizer chunk on the CPU, and ``MemStats`` are recorded. ``plan``
    (at the first optimizer step, when the optimizer's bytes per element are
    known) then gives the GPU's room first to parameter shards and then to
    optimizer chunks (master + states), in compute order; the rest step on
    the CPU. See [Note: the room auto placement fills]. Afterwards gathered
    chunks stay on the GPU after use, a cache that ``before_access`` trims
    by farthest next use whenever a gather would not fit the limit of that
    moment, and the next ``max_prefetch`` chunks are gathered ahead
    asynchronously while they fit every moment until their use.

    [Note: the room auto placement fills]
    The warm-up records, at every gather (moment m), the chunks gathered
    (``gathered_bytes[m]``) and the peak of the rest of the device's memory
    until the next gather (``non_model_bytes[m]``: activations,
    temporaries). The device may hold ``limit(m) = steady_cuda_cap_ratio x
    capacity - non_model_bytes[m]`` bytes of model data from moment m to the
    next, so what stays there for good (shards, optimizer chunks, the device
    lane's staging) gets the smallest ``limit(m) - gathered_bytes[m]`` over
    the moments; chunks gathered ahead use what the other moments leave.
    Keeping both peaks free, the non-model one and that of gathered chunks,
    would leave idle up to the peak of gathered chunks: they do not coincide
    (activations peak at the end of forward, when few chunks are gathered).
    The steady state holds every gather to its own limit; a gather the
    warm-up did not record (an inference forward, an iteration that gathers
    other chunks from some point on, or more) to the smallest limit of all.
    The warm-up keeps no cache: a chunk released within a period lowers the
    model bytes its peak is measured against, so a peak that comes after the
    release counts short by that chunk, which the steady state may keep
    cached; the margin ``1 - steady_cuda_cap_ratio`` leaves covers it where
    a module's chunks are smaller than that.

    On a CPU compute device the capacity is a number (``capacity``) and the
    placement is bookkeeping only: nothing moves, but every decision and the
    byte counts are the same.
    """

    planned = False
    warming_up = True

    def __init__(
        self,
        config: AutoPlacementConfig,
        compute_device: torch.device,
        keep_gathered: bool,
        param_bytes_per_element: int,
        world_size: int,
        process_group=None,
    ) -> None:
        super().__init__(keep_gathered, config.max_prefetch)
        capacity = config.gpu_capacity_bytes
        self._cuda = compute_device.type == "cuda"
        if capacity is None:
            if not self._cuda:
                raise ValueError(
                    f"GeminiDDP: placement_policy='auto' on a {compute_device.type} compute device "
                    "needs gpu_capacity_bytes (the memory to plan for)"
                )
            capacity = torch.cuda.get_device_properties(compute_device).total_memory
        self.process_group = process_group
        self.device = compute_device
        self.capacity = int(capacity)
        self.warmup_ratio = config.warmup_non_model_data_ratio
        self.steady_ratio = config.steady_cuda_cap_ratio
        self._item = param_bytes_per_element
        self._world = world_size
        self.stats = MemStats()
        self.on_device: set[Chunk] = set()  # shards (param or master) on the compute device
        self._param_set: set[Chunk] = set()
        self._param_shard_bytes_on_device = 0  # of the param chunks in on_device
        self._gathered = GatheredBytes()  # the param chunks' gathered buffers
        self.optim_bytes_on_device = 0  # masters + states on the compute device (after plan)
        self.reserved_bytes = 0  # the optimizer's own bytes there (plan's staging)
        self.evictions = 0
        self.peak_model_bytes = 0
        # The least of limit(m) - model bytes over the steady gathers seen (None before any).
        self.least_headroom_bytes: int | None = None
        self.non_model_reserve = 0  # the peak non-model bytes over ranks, after warm-up
        self.non_model_bytes_at: list[int] = []  # per moment, the peak over ranks, after warm-up
        self._period_open: int | None = None
        self._model_after_gather = 0
        self._on_track = True  # this iteration gathers as the warm-up did, so far
        self._now: int | None = None  # the moment of the gather in progress, when known

    @property
    def keeps_cache(self) -> bool:  # type: ignore[override]
        return not self.warming_up

    def decide(self, seen: int, numel: int, total: int) -> TensorPlacement:
        """Warm-up placement: param shards on the device while they fit the
        warm-up share (re-checked per chunk in ``attach``); every master on the CPU."""
        room = (1.0 - self.warmup_ratio) * self.capacity
        on_cpu = self._cuda and (seen + numel) * self._item / self._world > room
        return TensorPlacement(
            sharded=not self.keep_gathered, param_on_cpu=on_cpu, master_on_cpu=True
        )

    def attach(self, manager: ChunkManager, param_chunks: list[Chunk]) -> None:
        super().attach(manager, param_chunks)
        for c in param_chunks:
            c.report_gathered_to(self._gathered)
        self._param_set = set(param_chunks)
        self._param_shard_bytes_on_device = sum(
            self.shard_bytes(c) for c in param_chunks if c in self.on_device
        )
        self.initial_placement()

    # -- byte accounting ---------------------------------------------------------

    @staticmethod
    def shard_bytes(chunk: Chunk) -> int:
        return chunk.shard_size * chunk.dtype.itemsize

    def gathered_bytes(self) -> int:
        """The param chunks' gathered buffers (a running count the chunks keep)."""
        return self._gathered.nbytes

    def model_bytes(self) -> int:
        """Model data on the compute device by this placement's books: param
        shards there, gathered buffers, optimizer chunks there with states,
        and what the plan reserved for the optimizer (the device lane's
        staging): the steady state's evictions keep all of it under the
        limit, as the plan did. Running counts, not sums over the chunks:
        it is asked several times at every gather."""
        return (
            self._param_shard_bytes_on_device
            + self._gathered.nbytes
            + self.optim_bytes_on_device
            + self.reserved_bytes
        )

    def warmup_limit(self) -> int:
        return int((1.0 - self.warmup_ratio) * self.capacity)

    def steady_limit(self, moment: int | None = None) -> int:
        """The model bytes the compute device may hold from gather ``moment``
        of a training iteration to the next; the smallest of them where the
        moment is None or was not recorded. See [Note: the room auto placement fills]."""
        at = self.non_model_bytes_at
        known = moment is not None and 0 <= moment < len(at)
        non_model = at[moment] if known else self.non_model_reserve
        return int(self.steady_ratio * self.capacity) - non_model

    def _window_limit(self, first: int | None, last: int) -> int:
        """The smallest limit from moment ``first`` to ``last`` (of all, for None)."""
        if first is None:
            return self.steady_limit()
        return min(self.steady_limit(m) for m in range(first, last + 1))

    # -- placement moves ---------------------------------------------------------

    def move(self, chunk: Chunk, to_device: bool) -> None:
        """Put ``chunk``'s shard on the compute device or the CPU (books only on a CPU device)."""
        if chunk in self._param_set and (chunk in self.on_device) != to_device:
            sign = 1 if to_device else -1
            self._param_shard_bytes_on_device += sign * self.shard_bytes(chunk)
        if to_device:
            self.on_device.add(chunk)
        else:
            self.on_device.discard(chunk)
        if self._cuda:
            self.manager.move_chunk(chunk, self.device if to_device else torch.device("cpu"))

    def initial_placement(self) -> None:
        """Warm-up placement: param shards on the device while they fit."""
        room = self.warmup_limit()
        for chunk in self.param_chunks:
            fits = self.shard_bytes(chunk) + chunk.buffer_bytes <= room
            if fits:
                room -= self.shard_bytes(chunk)
            self.move(chunk, fits)

    # -- hooks -------------------------------------------------------------------

    def start_iteration(self) -> None:
        """A training forward: during the warm-up, a forward without a
        backward before it is not part of what the warm-up records."""
        if self.warming_up:
            self.stats = MemStats()
            self._period_open = None
        self.moment = 0
        self._on_track = True

    def _known_moment(self, chunks: list[Chunk], training: bool) -> int | None:
        """This gather's moment while the iteration gathers as the warm-up
        did; None otherwise (an inference forward, or a training iteration
        that took another path: its later gathers too)."""
        order, m = self.stats.order, self.moment
        if training and self._on_track:
            if m < len(order) and order[m] == tuple(c.index for c in chunks):
                return m
            self._on_track = False
        return None

    def before_access(self, chunks: list[Chunk], training: bool) -> None:
        """Called before ``chunks`` are gathered: record (warm-up) or make
        room. Only gathers of training iterations are moments."""
        if not self.warming_up:
            self._now = self._known_moment(chunks, training)
            self._make_room(chunks, self._now)
        elif training:
            self._record(chunks)
        if training:
            self.moment += 1

    def after_access(self, chunks: list[Chunk], training: bool) -> None:
        """Called once ``chunks`` are gathered: account, and prefetch what comes next."""
        if self.warming_up:
            if training:
                self._model_after_gather = self._cuda_model_bytes()
                self.stats.gathered_bytes.append(self.gathered_bytes())
        elif training:
            now = self._now
            if self.max_prefetch > 0:
                self._prefetch(
                    self.stats.order,
                    lambda c, m: self.model_bytes() + c.buffer_bytes <= self._window_limit(now, m),
                )
        held = self.model_bytes()
        if training and not self.warming_up:
            headroom = self.steady_limit(self._now) - held
            if self.least_headroom_bytes is None or headroom < self.least_headroom_bytes:
                self.least_headroom_bytes = headroom
        self.peak_model_bytes = max(self.peak_model_bytes, held)

    def end_warmup(self) -> None:
        """The end of the first backward: close the last period and stop recording."""
        if not self.warming_up:
            return
        self._close_period()
        self.stats.finish()
        self.non_model_reserve = self.stats.max_non_model_bytes
        self._agree()
        self.warming_up = False
        logger.info(
            "Gemini auto: warm-up recorded %d moments over %d chunks; peak non-model memory %.2f GB, "
            "peak gathered chunks %.2f GB",
            len(self.stats.order), len(self.stats.chunk_order()),
            self.stats.max_non_model_bytes / 1e9, self.stats.max_gathered_bytes / 1e9,
        )  # fmt: skip

    # -- warm-up recording ---------------------------------------------------------

    def _agree(self) -> None:
        """Every rank must take the same decisions (a gather is a collective):
        plan with the largest non-model peaks (per moment, and of all) and the
        smallest capacity of any rank."""
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        at = self.stats.non_model_bytes
        path = zlib.crc32(repr(self.stats.order).encode())  # the same on every rank, or not
        mine = torch.tensor(
            [max(at, default=0), -self.capacity, path, -path],
            dtype=torch.float64, device=device,
        )  # fmt: skip
        set_collective_label("auto placement's agreement after the warm-up")
        all_reduce_max(mine, self.process_group)
        worst, neg_capacity, most, neg_least = (int(v) for v in mine.tolist())
        self.non_model_reserve = worst
        self.capacity = -neg_capacity
        if most != -neg_least:  # the ranks gathered differently: one limit for all
            logger.warning(
                "Gemini auto: the ranks' warm-ups gathered chunks in different orders; every "
                "gather keeps the largest non-model peak of any"
            )
            self.non_model_bytes_at = []
            return
        peaks = torch.tensor(at, dtype=torch.float64, device=device)
        set_collective_label("auto placement's agreement after the warm-up (per moment)")
        all_reduce_max(peaks, self.process_group)
        self.non_model_bytes_at = [int(v) for v in peaks.tolist()]

    def _cuda_model_bytes(self) -> int:
        return self.manager.total_mem.get("cuda", 0) if self._cuda else 0

    def _period_non_model_bytes(self) -> int:
        """The peak of the device's memory that was not model data since the
        last gather (0 on a CPU: no allocator to ask)."""
        if not self._cuda:
            return 0
        peak = torch.cuda.max_memory_allocated(self.device)
        return max(0, peak - self._model_after_gather)

    def _close_period(self) -> None:
        if self._period_open is None:
            return
        self.stats.non_model_bytes.append(self._period_non_model_bytes())
        self._period_open = None

    def _record(self, chunks: list[Chunk]) -> None:
        self._close_period()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.stats.order.append(tuple(c.index for c in chunks))
        self._period_open = len(self.stats.order) - 1

    # -- steady state ------------------------------------------------------------

    def _make_room(self, chunks: list[Chunk], moment: int | None) -> None:
        for c in chunks:
            self.wait_prefetched(c)
        incoming = sum(c.buffer_bytes for c in chunks if not c.is_gathered)
        limit = self.steady_limit(moment)
        while self.model_bytes() + incoming > limit:
            victim = self._farthest(exclude=set(chunks))
            if victim is None:
                break  # only chunks in use are gathered: nothing to give back
            self.manager.release_chunk(victim)
            self.evictions += 1

    def _farthest(self, exclude: set[Chunk]) -> Chunk | None:
        """The idle gathered chunk whose next use is farthest away."""
        best, best_use = None, -1
        # In chunk order, ties to the lowest index: every rank picks the same.
        for c in sorted(self.manager.accessed_chunks, key=lambda c: c.index):
            if c in exclude or c in self._prefetched or not c.can_release:
                continue
            use = self.stats.next_use(c.index, self.moment)
            if use > best_use:
                best, best_use = c, use
        return best

    # -- the plan ------------------------------------------------------------------

    def room_bytes(self) -> int:
        """What may stay on the device for good, the optimizer's own bytes
        included: the smallest of ``limit(m) - gathered_bytes[m]``. See
        [Note: the room auto placement fills]."""
        gathered = self.stats.gathered_bytes
        if self.non_model_bytes_at and len(gathered) == len(self.non_model_bytes_at):
            return min(self.steady_limit(m) - g for m, g in enumerate(gathered))
        return self.steady_limit() - self.stats.max_gathered_bytes

    def plan(
        self,
        masters: dict[Chunk, Chunk],
        optim_bytes_per_element: int,
        staging: Callable[[list[Chunk]], int] | None = None,
    ) -> bool:
        """Decide, once, where param shards and optimizer chunks live.

        Args:
            masters: param chunk -> its fp32 master chunk.
            optim_bytes_per_element: bytes of optimizer state per master
                element (8 for Adam's two fp32 moments).
            staging: the device bytes the optimizer holds beside the chunks
                while the given masters (in compute order) stay on the host:
                GeminiOptimizer's device-lane staging. Default None: none.

        Returns:
            True when this call planned (masters may have moved).
        """
        if self.planned:
            return False
        self.end_warmup()
        self.planned = True
        plan = self._decide(masters, optim_bytes_per_element, staging)
        for c, fits in zip(plan.ordered, plan.params_fit, strict=True):
            self.move(c, fits)
        for master, need in zip(plan.candidates[: plan.optim_on], plan.needs, strict=True):
            self.move(master, True)
            self.optim_bytes_on_device += need
        self.reserved_bytes = plan.reserved_bytes
        params_on, optim_on = sum(plan.params_fit), plan.optim_on
        n_masters = len(masters)
        self.offloaded_masters = {m for m in masters.values() if m not in self.on_device}
        limits = [self.steady_limit(m) for m in range(len(self.non_model_bytes_at))]
        logger.info(
            "Gemini auto placement: capacity %.2f GB; model data may take %.2f-%.2f GB (ratio "
            "%.2f less each gather's non-model peak, %.2f GB at most); room %.2f GB for what "
            "stays (%.2f GB of it the optimizer's staging); %d/%d param chunks and %d/%d "
            "optimizer chunks on %s, the rest on the CPU",
            self.capacity / 1e9, self.steady_limit() / 1e9, max(limits, default=self.steady_limit()) / 1e9,
            self.steady_ratio, self.non_model_reserve / 1e9, self.room_bytes() / 1e9,
            self.reserved_bytes / 1e9, params_on, len(plan.ordered), optim_on, n_masters, self.device,
        )  # fmt: skip
        return True

    def preview(
        self,
        masters: dict[Chunk, Chunk],
        optim_bytes_per_element: int,
        staging: Callable[[list[Chunk]], int] | None = None,
    ) -> tuple[frozenset[Chunk], frozenset[Chunk]]:
        """What ``plan`` with these arguments would decide, moving nothing
        (the warm-up ends here if it has not): the master chunks it would
        leave on the host, and the param chunks whose shards it would."""
        self.end_warmup()
        plan = self._decide(masters, optim_bytes_per_element, staging)
        on = set(plan.candidates[: plan.optim_on])
        return (
            frozenset(m for m in masters.values() if m not in on),
            frozenset(c for c, fits in zip(plan.ordered, plan.params_fit, strict=True) if not fits),
        )

    def _decide(
        self,
        masters: dict[Chunk, Chunk],
        optim_bytes_per_element: int,
        staging: Callable[[list[Chunk]], int] | None,
    ) -> _Plan:
        """``plan``'s decision from the warm-up's record; moves nothing."""
        order = {i: k for k, i in enumerate(self.stats.chunk_order())}
        ordered = sorted(self.param_chunks, key=lambda c: order.get(c.index, len(order) + c.index))
        candidates = [masters[c] for c in ordered if c in masters]

        needs = [m.shard_size * (4 + optim_bytes_per_element) for m in candidates]

        def cost(k: int) -> int:  # the first k optimizer chunks on the device, the rest's staging
            return sum(needs[:k]) + (staging(candidates[k:]) if staging else 0)

        # Shards first, beside the cheapest outcome for the optimizer when all
        # fit (its chunks follow them); else beside the staging for them all.
        # The staging need not shrink as chunks move (a lane of none left costs
        # nothing), so the optimizer takes the most chunks that fit with it.
        room = self.room_bytes()
        costs = [cost(k) for k in range(len(candidates) + 1)]
        keep = min(costs)
        if sum(map(self.shard_bytes, ordered)) > room - keep:
            keep = costs[0]
        params_fit = []
        for c in ordered:
            fits = self.shard_bytes(c) <= room - keep
            if fits:
                room -= self.shard_bytes(c)
            params_fit.append(fits)
        optim_on = 0
        if all(params_fit):
            optim_on = max(k for k, need in enumerate(costs) if need <= room)
        return _Plan(
            ordered, params_fit, candidates, needs[:optim_on], optim_on,
            costs[optim_on] - sum(needs[:optim_on]),
        )  # fmt: skip
