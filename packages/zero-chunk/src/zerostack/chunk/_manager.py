"""ChunkManager: tensors registered into groups of chunks, with exact byte
accounting per device that a placement policy can trust."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zerostack.chunk._chunk import Chunk, ChunkFullError, check_device
from zerostack.chunk._state import TensorState
from zerostack.chunk._streams import Handle

logger = logging.getLogger(__name__)


class ChunkManager:
    """Registers tensors into named groups of chunks and moves them.

    Args:
        chunk_configuration: per config key, ``{"chunk_size": int,
            "keep_gathered": bool}`` (what ``search_chunk_configuration``
            returns, keyed by data-parallel size).
        compute_device: where gathered chunks live. Default: the current CUDA
            device, else the CPU.
        reuse_fp16_chunk: gradients are written over the fp16/bf16 parameter
            chunk instead of a separate gradient chunk. Default True.

    Raises:
        ValueError: a configuration without a positive chunk_size.
    """

    def __init__(
        self,
        chunk_configuration: dict[Any, dict[str, Any]],
        compute_device: torch.device | str | None = None,
        reuse_fp16_chunk: bool = True,
    ) -> None:
        if not isinstance(chunk_configuration, Mapping):
            raise TypeError(
                "ChunkManager: chunk_configuration must be a dict of {config key: "
                f"{{'chunk_size': int, 'keep_gathered': bool}}}} (got {chunk_configuration!r})"
            )
        for key, cfg in chunk_configuration.items():
            if not isinstance(cfg, Mapping):
                raise TypeError(
                    f"ChunkManager: chunk_configuration[{key!r}] must be a dict with chunk_size "
                    f"(got {cfg!r})"
                )
            size = cfg.get("chunk_size")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"ChunkManager: chunk_size of config {key!r} must be an int >= 1 (got {size!r})"
                )
        self.config = chunk_configuration
        self.compute_device = (
            check_device("ChunkManager", "compute_device", compute_device)
            if compute_device is not None
            else None
        )
        self.reuse_fp16_chunk = reuse_fp16_chunk
        self.chunk_groups: dict[str, list[Chunk]] = {}
        self.tensor_chunk_map: dict[torch.Tensor, Chunk] = {}
        self.accessed_chunks: set[Chunk] = set()
        self.total_mem: Counter[str] = Counter()
        self._next_index = 0
        self._gathers = 0  # see take_gather_trace

    # -- accounting ----------------------------------------------------------

    def _apply(self, chunk: Chunk, fn, *args, **kwargs):
        """Run ``fn`` and update total_mem by what it changed on ``chunk``."""
        before = chunk.memory_usage()
        grad_before = chunk.grad_chunk.memory_usage() if chunk.grad_chunk else {}
        try:
            return fn(*args, **kwargs)
        finally:
            after = chunk.memory_usage()
            grad_after = chunk.grad_chunk.memory_usage() if chunk.grad_chunk else {}
            for dev in set(before) | set(after) | set(grad_before) | set(grad_after):
                self.total_mem[dev] += (
                    after.get(dev, 0)
                    - before.get(dev, 0)
                    + grad_after.get(dev, 0)
                    - grad_before.get(dev, 0)
                )

    @property
    def accessed_mem(self) -> int:
        """Bytes of the gathered buffers of accessed (sharded) chunks."""
        return sum(
            c.chunk_size * c.buffer.element_size()
            for c in self.accessed_chunks
            if c.buffer is not None
        )

    # -- registration ----------------------------------------------------------

    def register_tensor(
        self,
        tensor: torch.Tensor,
        group_type: str,
        config_key: Any,
        process_group: dist.ProcessGroup | None = None,
        cpu_offload: bool = False,
        pin_memory: bool = False,
    ) -> Chunk:
        """Append ``tensor`` to the open chunk of ``group_type`` (e.g.
        "fp16_param", "fp32_param"), opening the next chunk when it is full.
        A tensor larger than the configured chunk size gets a chunk of its own.

        Returns:
            The chunk now holding the tensor.

        Raises:
            KeyError: ``config_key`` is not in the configuration.
            ValueError: the tensor is already registered.
        """
        api = "ChunkManager.register_tensor"
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{api}: tensor must be a tensor (got {type(tensor).__name__})")
        # Checked before a chunk is opened for it: a rejected tensor leaves
        # no empty chunk behind.
        if not tensor.is_floating_point():
            raise TypeError(
                f"{api}: tensor must be floating point (got {tensor.dtype}, shape "
                f"{tuple(tensor.shape)})"
            )
        if tensor.is_meta:
            raise ValueError(
                f"{api}: tensor (shape {tuple(tensor.shape)}) is on the meta device; build the "
                "model under LazyInitContext and use LazyInitContext.distribute"
            )
        if tensor.is_sparse or not tensor.is_contiguous():
            raise ValueError(
                f"{api}: tensor must be dense and contiguous (got shape {tuple(tensor.shape)}, "
                f"{tensor.layout}, contiguous={not tensor.is_sparse and tensor.is_contiguous()})"
            )
        if tensor in self.tensor_chunk_map:
            # The registered shape: a sharded tensor's own data is empty.
            shape = self.tensor_chunk_map[tensor].tensors_info[tensor].shape
            raise ValueError(
                f"{api}: tensor of shape {tuple(shape)} is already registered (in chunk "
                f"{self.tensor_chunk_map[tensor].index})"
            )
        if config_key not in self.config:
            raise KeyError(
                f"ChunkManager.register_tensor: no chunk configuration for {config_key!r}"
            )
        cfg = self.config[config_key]
        name = f"{group_type}_{config_key}"
        group = self.chunk_groups.setdefault(name, [])
        chunk = group[-1] if group and not group[-1].closed else None
        if chunk is not None:
            try:
                self._apply(chunk, chunk.append_tensor, tensor)
                self.tensor_chunk_map[tensor] = chunk
                return chunk
            except ChunkFullError:
                self._close(chunk)
        chunk = Chunk(
            max(cfg["chunk_size"], tensor.numel()),
            process_group,
            tensor.dtype,
            index=self._next_index,
            compute_device=self.compute_device,
            shard_device="cpu" if cpu_offload else None,
            keep_gathered=cfg.get("keep_gathered", False),
            pin_memory=pin_memory,
        )
        self._next_index += 1
        self.total_mem += Counter(chunk.memory_usage())
        group.append(chunk)
        self._apply(chunk, chunk.append_tensor, tensor)
        self.tensor_chunk_map[tensor] = chunk
        return chunk

    def _close(self, chunk: Chunk) -> None:
        self._apply(chunk, chunk.close_chunk)
        logger.debug(
            "chunk %d closed: %d tensors, %d/%d elements",
            chunk.index,
            chunk.num_tensors,
            chunk.utilized_size,
            chunk.chunk_size,
        )

    def close_all_groups(self) -> None:
        """Close every open chunk (after the last registration)."""
        for group in self.chunk_groups.values():
            if group and not group[-1].closed:
                self._close(group[-1])
        summary = {name: len(chunks) for name, chunks in self.chunk_groups.items()}
        logger.info("chunks: %s; memory %s", summary, dict(self.total_mem))

    # -- operations --------------------------------------------------------------

    def access_chunk(self, chunk: Chunk, async_op: bool = False) -> Handle | None:
        """Gather ``chunk`` on the compute device (an earlier ``async_op``
        gather of it in flight is waited for, and None returned)."""
        if chunk in self.accessed_chunks:
            chunk.settle()
            return None
        if chunk.is_gathered:  # kept gathered (or zero-filled): nothing moves, nothing to count
            chunk.bind()
            if not chunk.keep_gathered:
                self.accessed_chunks.add(chunk)
            return None
        handle = self._apply(chunk, chunk.access, async_op)
        self._gathers = (self._gathers * 33 + chunk.index + 1) % (1 << 24)
        if not chunk.keep_gathered:
            self.accessed_chunks.add(chunk)
        return handle

    def take_gather_trace(self) -> int:
        """A 24-bit hash of the chunks gathered (by index, in order) since the
        last call, and start again: ranks whose traces differ issued their
        all-gathers for different chunks, pairing each gather with another
        chunk's on the other ranks (GeminiDDP checks it at every step)."""
        trace, self._gathers = self._gathers, 0
        return trace

    def release_chunk(self, chunk: Chunk) -> None:
        """Drop ``chunk``'s gathered copy (it must be releasable)."""
        if chunk not in self.accessed_chunks:
            return
        self._apply(chunk, chunk.release)
        self.accessed_chunks.discard(chunk)

    def zero_chunk(self, chunk: Chunk) -> None:
        """Give ``chunk`` a zeroed buffer without gathering (see Chunk.zero_buffer)."""
        self._apply(chunk, chunk.zero_buffer)

    def move_chunk(
        self, chunk: Chunk, device: torch.device | str, non_blocking: bool = False
    ) -> None:
        """Move ``chunk``'s shard to ``device``."""
        self._apply(chunk, chunk.shard_move, device, non_blocking)

    def reduce_chunk(
        self, chunk: Chunk, async_op: bool = False, *, accumulate: bool = False
    ) -> Handle | None:
        """Average ``chunk``'s gradients over its group, with ``accumulate``
        adding the reduced share to the last one (see Chunk.reduce)."""
        handle = self._apply(chunk, chunk.reduce, async_op, accumulate=accumulate)

        def finish() -> None:
            if handle is not None:
                self._apply(chunk, handle.wait)
            if chunk.grad_chunk is None and not chunk.keep_gathered:
                self.accessed_chunks.discard(chunk)  # the gradient replaced the gathered params

        if handle is not None:
            return Handle(None, finish)
        finish()
        return None

    def consume_grad(self, chunk: Chunk) -> None:
        """The reduced gradient of ``chunk`` was used: drop the grad chunk's
        shard and zero its gathered buffer for the next accumulation."""
        grad = chunk.grad_chunk
        if grad is None:
            return

        def drop() -> None:
            grad.shard = None
            if grad.buffer is not None:
                grad.buffer.zero_()

        self._apply(chunk, drop)

    def init_grad_chunk(self, chunk: Chunk) -> Chunk:
        """Give ``chunk`` a zeroed gradient chunk (not with reuse_fp16_chunk)."""
        if self.reuse_fp16_chunk:
            raise RuntimeError(
                "ChunkManager.init_grad_chunk: gradients reuse the fp16 chunk (reuse_fp16_chunk=True)"
            )
        return self._apply(chunk, chunk.init_grad_chunk)

    def trans_tensor_state(self, tensor: torch.Tensor, state: TensorState) -> None:
        self.get_chunk(tensor).trans_tensor_state(tensor, state)

    # -- lookups -----------------------------------------------------------------

    def get_chunk(self, tensor: torch.Tensor) -> Chunk:
        try:
            return self.tensor_chunk_map[tensor]
        except KeyError:
            raise KeyError(
                f"ChunkManager: tensor of shape {tuple(tensor.shape)} is not registered"
            ) from None

    def get_chunks(self, tensors: Iterable[torch.Tensor]) -> list[Chunk]:
        """The chunks holding ``tensors``, each once, in first-seen order."""
        return list(dict.fromkeys(self.get_chunk(t) for t in tensors))

    def chunks(self, group_type: str | None = None) -> list[Chunk]:
        return [
            c
            for name, group in self.chunk_groups.items()
            if group_type is None or name.startswith(group_type)
            for c in group
        ]

    def __repr__(self) -> str:
        return f"ChunkManager({ {n: len(g) for n, g in self.chunk_groups.items()} }, mem={dict(self.total_mem)})"
