"""Chunks: tensors packed into equal-sized contiguous buffers that are
gathered, released, reduced and moved as one."""

from zerostack.chunk.__about__ import __version__
from zerostack.chunk._buffers import persistent_buffers
from zerostack.chunk._chunk import (
    Chunk,
    ChunkFullError,
    check_device,
    default_compute_device,
)
from zerostack.chunk._colo_init import ColoInitContext
from zerostack.chunk._comm import (
    CollectiveMismatchError,
    all_gather_into,
    all_reduce_max,
    all_reduce_sum,
    debug_collectives,
    rank_and_world,
    reduce_scatter_sum,
    set_collective_label,
)
from zerostack.chunk._lazy import LazyInitContext
from zerostack.chunk._manager import ChunkManager
from zerostack.chunk._pinned import exact_pinned, pinned_empty
from zerostack.chunk._profiling import phase
from zerostack.chunk._search import ChunkSearchResult, search_chunk_configuration
from zerostack.chunk._state import TRANSITIONS, TensorInfo, TensorState, path_between
from zerostack.chunk._streams import GatheredBytes, Handle

__all__ = [
    "TRANSITIONS",
    "Chunk",
    "ChunkFullError",
    "ChunkManager",
    "ChunkSearchResult",
    "CollectiveMismatchError",
    "ColoInitContext",
    "GatheredBytes",
    "Handle",
    "LazyInitContext",
    "TensorInfo",
    "TensorState",
    "__version__",
    "all_gather_into",
    "all_reduce_max",
    "all_reduce_sum",
    "check_device",
    "debug_collectives",
    "default_compute_device",
    "exact_pinned",
    "path_between",
    "persistent_buffers",
    "phase",
    "pinned_empty",
    "rank_and_world",
    "reduce_scatter_sum",
    "search_chunk_configuration",
    "set_collective_label",
]
