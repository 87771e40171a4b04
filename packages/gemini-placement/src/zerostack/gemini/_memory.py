"""A picture of memory: where every chunk of a GeminiDDP model lives, and
how the bytes on each tier move over a training step.

[Note: memory tiers] Four tiers, by where a tensor's bytes are: ``gpu``
(any CUDA device), ``pinned`` (page-locked host memory), ``pageable``
(ordinary host memory) and ``disk`` (optimizer states HybridAdam keeps on
NVMe, ``nvme_bytes_on_disk()``). Chunk bytes are counted from the chunks'
own buffers (shards, gathered buffers, gradient chunks), optimizer-state
bytes from the inner optimizer's state tensors; nothing is estimated. On a
CPU compute device the "gpu" tier stays 0 and gathered chunks are host bytes.

The timeline samples the tiers at each module's forward start and end,
when backward reaches a module's output, and wherever the caller asks
(``sample(label)``, e.g. around the optimizer step), through hooks of its
own (module hooks removed when the recording ends; a gradient hook lives
only as long as its step's graph), so it needs no support from GeminiDDP's
hooks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from zerostack.chunk import Chunk, exact_pinned

TIERS = ("gpu", "pinned", "pageable", "disk")
_KINDS = (("fp16_param", "param"), ("fp32_param", "master"), ("frozen_param", "frozen"))


def _tier(t: torch.Tensor) -> str:
    if t.device.type == "cuda":
        return "gpu"
    return "pinned" if t.device.type == "cpu" and t.is_pinned() else "pageable"


def _add(usage: dict[str, int], t: torch.Tensor | None) -> None:
    if t is not None and t.numel():
        usage[_tier(t)] += t.numel() * t.element_size()


def _chunk_usage(chunk: Chunk) -> dict[str, int]:
    usage = dict.fromkeys(TIERS, 0)
    _add(usage, chunk.shard)
    _add(usage, chunk.buffer)
    grad = chunk.grad_chunk
    if grad is not None and grad is not chunk:
        _add(usage, grad.shard)
        _add(usage, grad.buffer)
    return usage


@dataclass(frozen=True, slots=True)
class ChunkRow:
    """Where one chunk lives now."""

    index: int
    kind: str  # "param" (compute dtype), "master" (fp32), "frozen"
    dtype: torch.dtype
    chunk_size: int  # elements of the whole chunk
    num_tensors: int
    sharded: bool  # split over the ranks (else kept whole on every rank)
    home: str  # the tier of this rank's shard (or of the kept buffer)
    gathered: bool  # the whole buffer is on the compute device now
    usage: dict[str, int]  # bytes by tier, this rank


def chunk_placement(ddp: Any) -> list[ChunkRow]:
    """One :class:`ChunkRow` per chunk of ``ddp`` (a GeminiDDP), in chunk order."""
    rows = []
    for prefix, kind in _KINDS:
        for c in ddp.chunk_manager.chunks(prefix):
            home = c.shard if c.shard is not None else c.buffer
            rows.append(
                ChunkRow(
                    index=c.index, kind=kind, dtype=c.dtype, chunk_size=c.chunk_size,
                    num_tensors=c.num_tensors, sharded=not c.keep_gathered,
                    home=_tier(home) if home is not None else "-", gathered=c.is_gathered,
                    usage=_chunk_usage(c),
                )
            )  # fmt: skip
    return sorted(rows, key=lambda r: (r.kind != "param", r.kind, r.index))


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f}"


def format_placement(rows: list[ChunkRow], *, per_chunk: bool = True) -> str:
    """``rows`` as a text table: one line per chunk (with ``per_chunk``), then
    per kind and tier how many chunks live there and their MB."""
    lines = []
    if per_chunk:
        lines.append(
            f"{'chunk':>5} {'kind':<6} {'dtype':<14} {'elements':>10} {'tensors':>7} "
            f"{'layout':<8} {'home':<8} {'gathered':<8} "
            + " ".join(f"{t + ' MB':>11}" for t in TIERS)
        )
        for r in rows:
            lines.append(
                f"{r.index:>5} {r.kind:<6} {r.dtype!s:<14} {r.chunk_size:>10} {r.num_tensors:>7} "
                f"{'sharded' if r.sharded else 'whole':<8} {r.home:<8} {'yes' if r.gathered else 'no':<8} "
                + " ".join(f"{_mb(r.usage[t]):>11}" for t in TIERS)
            )
        lines.append("")
    lines.append(f"{'kind':<6} {'home':<8} {'chunks':>6} {'MB':>10}")
    summary: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        entry = summary.setdefault((r.kind, r.home), [0, 0])
        entry[0] += 1
        entry[1] += sum(r.usage.values())
    for (kind, home), (count, nbytes) in sorted(summary.items()):
        lines.append(f"{kind:<6} {home:<8} {count:>6} {_mb(nbytes):>10}")
    sizes = sorted({r.chunk_size for r in rows})
    lines.append(f"chunk size: {', '.join(map(str, sizes))} elements")
    return "\n".join(lines)


def tier_bytes(ddp: Any, optimizer: Any = None) -> dict[str, int]:
    """Bytes on each tier now: every chunk (and its gradient chunk), plus the
    optimizer's states (in memory, and on disk) when ``optimizer`` is given
    (a GeminiOptimizer or the torch optimizer inside it)."""
    usage = dict.fromkeys(TIERS, 0)
    for c in ddp.chunk_manager.chunks():
        for tier, n in _chunk_usage(c).items():
            usage[tier] += n
    inner = getattr(optimizer, "optimizer", optimizer)
    if inner is not None:
        for state in inner.state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    _add(usage, v)
        on_disk = getattr(inner, "nvme_bytes_on_disk", None)
        if callable(on_disk):
            usage["disk"] += int(on_disk())
    return usage


@dataclass
class MemoryTimeline:
    """Bytes per tier sampled over a training step of a GeminiDDP model.

    ```python
    with MemoryTimeline(model, optimizer) as timeline:
        loss = model(x, y)
        optimizer.backward(loss)
        timeline.sample("step")
        optimizer.step()
    print(timeline.table())
    timeline.save_png("memory.png")  # needs matplotlib: pip install 'zerostack-gemini[plot]'
    ```

    Args:
        ddp: the GeminiDDP model.
        optimizer: its GeminiOptimizer (for optimizer-state bytes). Default None.
    """

    ddp: Any
    optimizer: Any = None
    samples: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list, repr=False)

    def sample(self, label: str) -> None:
        """Record the tiers now, under ``label``."""
        self.samples.append((label, tier_bytes(self.ddp, self.optimizer)))

    def __enter__(self) -> MemoryTimeline:
        self.sample("start")
        for name, module in self.ddp.module.named_modules():
            if module is self.ddp.module or next(module.parameters(recurse=False), None) is None:
                continue
            self._handles += [
                module.register_forward_pre_hook(self._hook(f"fwd {name}")),
                module.register_forward_hook(self._post_hook(name)),
            ]
        return self

    def _hook(self, label: str):
        def record(*_: Any) -> None:
            self.sample(label)

        return record

    def _post_hook(self, name: str):
        """Samples at the forward's end, and (a hook on the output's
        gradient) when backward reaches the module."""
        at_end, at_backward = self._hook(f"fwd end {name}"), self._hook(f"bwd {name}")

        def record(module: Any, args: Any, out: Any) -> None:
            at_end()
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(at_backward)

        return record

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.sample("end")

    def peak(self) -> dict[str, int]:
        """The largest bytes seen on each tier."""
        return {t: max((s[t] for _, s in self.samples), default=0) for t in TIERS}

    def table(self) -> str:
        """The samples as a text table (MB per tier), then the peaks."""
        head = f"{'#':>4} {'moment':<40} " + " ".join(f"{t + ' MB':>11}" for t in TIERS)
        lines = [head]
        for i, (label, usage) in enumerate(self.samples):
            lines.append(
                f"{i:>4} {label[:40]:<40} " + " ".join(f"{_mb(usage[t]):>11}" for t in TIERS)
            )
        peak = self.peak()
        lines.append(f"{'':>4} {'peak':<40} " + " ".join(f"{_mb(peak[t]):>11}" for t in TIERS))
        return "\n".join(lines)

    def save_png(self, path: str | os.PathLike) -> str:
        """Plot the tiers over the samples into a PNG.

        Returns:
            The path written.

        Raises:
            ImportError: matplotlib is missing (the message names the pip command).
            RuntimeError: nothing was recorded.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError(
                "MemoryTimeline.save_png needs matplotlib: pip install 'zerostack-gemini[plot]'"
            ) from None
        if not self.samples:
            raise RuntimeError("MemoryTimeline.save_png: no samples; record a step first")
        fig, ax = plt.subplots(figsize=(10, 4))
        xs = range(len(self.samples))
        for tier in TIERS:
            ax.plot(xs, [s[tier] / 2**20 for _, s in self.samples], label=tier)
        ticks = _ticks(self.samples)
        ax.set_xticks([i for i, _ in ticks], [label for _, label in ticks], rotation=60,
                      ha="right", fontsize=7)  # fmt: skip
        ax.set_ylabel("MB (this rank)")
        ax.set_title("GeminiDDP memory over one step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return os.fspath(path)


def _ticks(samples: list[tuple[str, dict[str, int]]]) -> list[tuple[int, str]]:
    """At most ~16 labelled moments: the first of each phase change, and the ends."""
    step = max(1, len(samples) // 16)
    return list(_every(samples, step))


def _every(samples: list[tuple[str, dict[str, int]]], step: int) -> Iterator[tuple[int, str]]:
    for i, (label, _) in enumerate(samples):
        if i % step == 0 or i == len(samples) - 1:
            yield i, label


# -- host bytes by owner ---------------------------------------------------------------

# [Note: host bytes] Every host (CPU) byte that zerostack holds for a
# GeminiDDP model, by owner, each tensor's storage counted once (the first
# owner in this order that holds it):
#   param_chunks     fp16/bf16 (or fp32) parameter chunks: shards and gathered
#                    buffers on the host (also reduced gradients written over them)
#   grad_chunks      separate gradient chunks (gradient accumulation)
#   masters          fp32 master chunks held on the host
#   optim_states     the inner optimizer's state tensors in RAM (Adam m, v)
#   cpu_step_values  CpuStepPipeline's host buffers for new fp16/bf16 shards
#   cpu_step_grads   CpuStepPipeline's pinned copies of device-held gradients
#   copy_out         other copy-out targets of the inner optimizer
#   nvme_staging     the NVMe pipeline's slots and states kept after a failed write
#   module_buffers   the model's buffers on the host
# ``rss`` is the process's resident set (VmRSS) and ``unaccounted`` what it
# holds beyond the owners: the interpreter, torch and CUDA libraries,
# activations and temporaries on a CPU compute device, freed memory the C
# heap has not returned, and pinned blocks cached by torch's host allocator
# (``pinned_cached``, when CUDA reports it).
HOST_OWNERS = (
    "param_chunks",
    "grad_chunks",
    "masters",
    "optim_states",
    "cpu_step_values",
    "cpu_step_grads",
    "copy_out",
    "nvme_staging",
    "module_buffers",
)


@dataclass(frozen=True, slots=True)
class HostBytes:
    """Host bytes of a GeminiDDP model by owner (see [Note: host bytes])."""

    owners: dict[str, int]  # bytes by owner, HOST_OWNERS order
    pinned: dict[str, int]  # of which page-locked
    num_params: int  # elements of the model's parameters (tied ones once)
    rss: int  # the process's resident bytes now (0 where /proc is missing)
    pinned_cached: (
        int  # pinned bytes torch's host allocator owns beyond the owners' (rounding, freed blocks)
    )

    @property
    def total(self) -> int:
        return sum(self.owners.values())

    @property
    def unaccounted(self) -> int:
        """RSS minus the owners' bytes (negative when pages of the owners are not resident)."""
        return self.rss - self.total

    def per_param(self, nbytes: int) -> float:
        return nbytes / max(1, self.num_params)

    def table(self) -> str:
        """One line per owner: GB, bytes per parameter, pinned GB; then the total, RSS and the rest."""
        lines = [f"{'owner':<16} {'GB':>9} {'B/param':>8} {'pinned GB':>10}"]
        for name in HOST_OWNERS:
            n = self.owners[name]
            lines.append(
                f"{name:<16} {n / 1e9:>9.3f} {self.per_param(n):>8.2f} {self.pinned[name] / 1e9:>10.3f}"
            )
        for name, n in (
            ("total", self.total),
            ("pinned_cached", self.pinned_cached),
            ("rss", self.rss),
            ("unaccounted", self.unaccounted),
        ):
            lines.append(f"{name:<16} {n / 1e9:>9.3f} {self.per_param(n):>8.2f}")
        return "\n".join(lines)


def rss_bytes() -> int:
    """VmRSS of this process (0 where /proc/self/status is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _pinned_allocator_bytes() -> int:
    """Bytes of pinned blocks torch's host allocator owns (live and cached), or 0."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return 0
    try:
        return int(stats().get("allocated_bytes.current", 0))
    except Exception:  # an older torch without the counters
        return 0


def host_bytes(ddp: Any, optimizer: Any = None) -> HostBytes:
    """Host bytes of ``ddp`` (a GeminiDDP) and, when given, its optimizer (a
    GeminiOptimizer or the torch optimizer inside it), by owner. See [Note:
    host bytes]."""
    seen: set[int] = set()
    owners = dict.fromkeys(HOST_OWNERS, 0)
    pinned = dict.fromkeys(HOST_OWNERS, 0)
    from_allocator = 0  # pinned owner bytes in torch's host allocator's blocks

    def add(owner: str, t: Any) -> None:
        nonlocal from_allocator
        if not torch.is_tensor(t) or t.device.type != "cpu" or t.numel() == 0:
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or key == 0:
            return
        seen.add(key)
        n = storage.nbytes()
        owners[owner] += n
        if t.is_pinned():
            pinned[owner] += n
            if not exact_pinned(t):  # zerostack.chunk.pinned_empty's are not its blocks
                from_allocator += n

    manager = ddp.chunk_manager
    for prefix, owner in (("fp16_param", "param_chunks"), ("frozen_param", "param_chunks"),
                          ("fp32_param", "masters")):  # fmt: skip
        for c in manager.chunks(prefix):
            add(owner, c.shard)
            add(owner, c.buffer)
            grad = c.grad_chunk
            if grad is not None and grad is not c:
                add("grad_chunks", grad.shard)
                add("grad_chunks", grad.buffer)
    inner = getattr(optimizer, "optimizer", optimizer)
    if inner is not None:
        for state in inner.state.values():
            for v in state.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    add("optim_states", v)
    pipeline = ddp.step_pipeline
    if pipeline is not None:
        for buf in pipeline.host_buffers("values"):
            add("cpu_step_values", buf)
        for buf in pipeline.host_buffers("grads"):
            add("cpu_step_grads", buf)
    if inner is not None:
        for buf in getattr(inner, "_copy_out", {}).values():
            add("copy_out", buf)
        staging = getattr(inner, "nvme_host_buffers", None)
        if callable(staging):
            for buf in staging():
                add("nvme_staging", buf)
    for b in ddp.module.buffers():
        add("module_buffers", b)
    allocator = _pinned_allocator_bytes()
    return HostBytes(
        owners=owners,
        pinned=pinned,
        num_params=sum(_param_numels(ddp)),
        rss=rss_bytes(),
        pinned_cached=max(0, allocator - from_allocator) if allocator else 0,
    )


def _param_numels(ddp: Any) -> Iterator[int]:
    """Elements of each parameter of ``ddp`` (its registered shape, tied ones once)."""
    manager = ddp.chunk_manager
    for p in ddp.params:
        yield manager.get_chunk(p).tensors_info[p].numel
