"""Search for the chunk size that wastes the least memory on a model's parameters."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

_API = "search_chunk_configuration"
# Sizes in the `_m` arguments are counted in units of 2**20 elements, as the reference does.
_MEGA = 2**20
# The log line reports megabytes of fp16/bf16 parameters.
_LOG_BYTES_PER_ELEMENT = 2
# Most candidate sizes evaluated at once. Below ATen's intra-op grain size (32768)
# each op runs on the calling thread: the scan is thousands of small ops, and a
# thread-pool barrier per op made it 1000x slower (tens of seconds) on a loaded
# 2-core machine.
_MAX_BLOCK = 16384


class ChunkSearchResult(NamedTuple):
    """What :func:`search_chunk_configuration` found; unpacks as
    ``config, total_size, wasted_size`` like the reference's tuple."""

    config: dict[int, dict[str, int | bool]]
    """``{dp_size: {"chunk_size": int, "keep_gathered": bool}}``."""

    total_size: int
    """Parameter elements of the model, shared parameters counted once."""

    wasted_size: int
    """Elements of chunk memory that hold no parameter at the returned chunk size."""

    @property
    def wasted_pct(self) -> float:
        """Waste as a percentage of all chunk memory (``total_size + wasted_size``)."""
        allocated = self.total_size + self.wasted_size
        return 100.0 * self.wasted_size / allocated if allocated else 0.0


def search_chunk_configuration(
    model: nn.Module,
    search_range_m: float,
    search_interval: int = 1024,
    min_chunk_size_m: float = 32,
    filter_exlarge_params: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> ChunkSearchResult:
    """Pick the chunk size that wastes the least memory when the model's
    parameters are packed into chunks in registration order.

    Every parameter (frozen ones too; shared ones once) belongs to one
    data-parallel group, ``process_group``. Packing is sequential: a parameter
    that does not fit in the space left in the open chunk closes it, and that
    space is wasted, as is the unused tail of the last chunk. Candidate sizes
    start at ``max(largest parameter, min chunk size)`` rounded up to a multiple
    of ``search_interval`` and step by ``search_interval`` across
    ``search_range_m``; the one with the least waste wins (ties: the smallest).
    It is then rounded up to a multiple of the group's size so that every rank
    holds an equal shard, and the waste is recomputed for that size. Only
    ``numel`` is read, so the model may live on the ``meta`` device.

    Sizes given in millions are in units of ``2**20`` elements, as in the
    reference (ColossalAI's ``search_chunk_configuration``). One INFO line is
    logged (on rank 0 of the group) with the search time and the parameter and
    wasted memory in MB, counted at 2 bytes per element (fp16/bf16 parameters).

    Args:
        model: the module whose ``parameters()`` are searched.
        search_range_m: width of the range of candidate sizes, in ``2**20``
            elements; must be > 0.
        search_interval: step between candidate sizes, in elements; the model's
            hidden size is a good value. Default 1024.
        min_chunk_size_m: smallest chunk, in ``2**20`` elements; a group whose
            parameters total less becomes one ``keep_gathered`` chunk of exactly
            that total. Default 32.
        filter_exlarge_params: leave parameters larger than the mean plus three
            standard deviations of all parameter sizes out of the search (the
            chunk manager gives each of them a chunk of its own); they still
            count in ``total_size``. Default True.
        process_group: the data-parallel group. Default None: the default group
            when ``torch.distributed`` is initialised, else a world of one.

    Returns:
        A :class:`ChunkSearchResult` ``(config, total_size, wasted_size)``:
        ``config`` is ``{dp_size: {"chunk_size": int, "keep_gathered": bool}}``,
        sizes are in elements.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or a size argument is not
            a number (``search_interval``: not an int).
        ValueError: ``search_range_m`` <= 0, ``search_interval`` < 1,
            ``min_chunk_size_m`` < 0, a size is not finite, the model has no
            parameters, or this rank is not in ``process_group``.
    """
    start_time = time.perf_counter()
    _check_args(model, search_range_m, search_interval, min_chunk_size_m)
    dp_size, dp_rank = _group_size_and_rank(process_group)
    sizes = _parameter_sizes(model)
    total_size = sum(sizes)
    min_chunk_size = round(min_chunk_size_m * _MEGA)

    if total_size < min_chunk_size:
        # Too small to be worth sharding: one chunk, replicated on every rank.
        chunk_size, keep_gathered, wasted_size = total_size, True, 0
    else:
        if filter_exlarge_params:
            sizes = _drop_exlarge(sizes)
        search_range = round(search_range_m * _MEGA)
        chunk_size, wasted_size = _sharded_chunk_size(
            sizes, min_chunk_size, search_range, search_interval, dp_size
        )
        keep_gathered = False
    setting: dict[str, int | bool] = {"chunk_size": chunk_size, "keep_gathered": keep_gathered}
    result = ChunkSearchResult({dp_size: setting}, total_size, wasted_size)
    if dp_rank == 0:
        _log_result(result, dp_size, time.perf_counter() - start_time)
    return result


def _parameter_sizes(model: nn.Module) -> list[int]:
    # parameters() yields a shared (tied) parameter once, by identity, in registration order.
    sizes = [param.numel() for param in model.parameters()]
    if not sizes:
        raise ValueError(
            f"{_API}: the model has no parameters (got {type(model).__name__}); "
            "pass a model that has parameters"
        )
    return sizes


def _sharded_chunk_size(
    sizes: list[int], min_chunk_size: int, search_range: int, step: int, dp_size: int
) -> tuple[int, int]:
    """The least-waste chunk size rounded up to a multiple of ``dp_size``, and
    its waste."""
    start = max(max(sizes), min_chunk_size, 1)
    start = -(-start // step) * step
    best = _best_chunk_size(sizes, start, start + search_range, step)
    chunk_size = best + (-best % dp_size)
    return chunk_size, int(_waste(sizes, torch.tensor([chunk_size]))[0].item())


def _log_result(result: ChunkSearchResult, dp_size: int, seconds: float) -> None:
    (setting,) = result.config.values()
    to_mb = _LOG_BYTES_PER_ELEMENT / _MEGA
    logger.info(
        "%s: chunk_size=%d keep_gathered=%s dp_size=%d, found in %.3f s; "
        "used %.1f MB, wasted %.1f MB (%.2f%%) at 2 bytes per element (fp16/bf16)",
        _API,
        setting["chunk_size"],
        setting["keep_gathered"],
        dp_size,
        seconds,
        result.total_size * to_mb,
        result.wasted_size * to_mb,
        result.wasted_pct,
    )


def _check_args(
    model: object, search_range_m: Any, search_interval: Any, min_chunk_size_m: Any
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{_API}: model must be an nn.Module (got {type(model).__name__}); pass the model"
        )
    for name, value in (("search_range_m", search_range_m), ("min_chunk_size_m", min_chunk_size_m)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(
                f"{_API}: {name} must be a number (got {value!r}); pass a size in 2**20 elements"
            )
        if not math.isfinite(value):
            raise ValueError(f"{_API}: {name} must be finite (got {value!r}); pass e.g. 32")
    if search_range_m <= 0:
        raise ValueError(
            f"{_API}: search_range_m must be > 0 (got {search_range_m!r}); "
            "pass the width of the range to scan in 2**20 elements, e.g. 32"
        )
    if isinstance(search_interval, bool) or not isinstance(search_interval, int):
        raise TypeError(
            f"{_API}: search_interval must be an int (got {search_interval!r}); "
            "pass a step in elements, e.g. the hidden size"
        )
    if search_interval < 1:
        raise ValueError(
            f"{_API}: search_interval must be >= 1 (got {search_interval!r}); "
            "pass a step in elements, e.g. the hidden size"
        )
    if min_chunk_size_m < 0:
        raise ValueError(
            f"{_API}: min_chunk_size_m must be >= 0 (got {min_chunk_size_m!r}); "
            "pass 0 to shard every model, or a size in 2**20 elements"
        )


def _group_size_and_rank(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    size = dist.get_world_size(process_group)
    if size < 1:  # torch answers -1 for a group this rank is not in
        raise ValueError(
            f"{_API}: this rank is not in process_group (got world size {size}); "
            "call it only on the group's ranks"
        )
    return size, dist.get_rank(process_group)


def _drop_exlarge(sizes: list[int]) -> list[int]:
    """Sizes at most mean + 3 sigma (population sigma, as the reference's np.std)."""
    arr = torch.tensor(sizes, dtype=torch.float64)
    limit = (arr.mean() + 3 * arr.std(correction=0)).item()
    return [s for s in sizes if s <= limit]


def _waste(sizes: list[int], candidates: torch.Tensor) -> torch.Tensor:
    """Wasted elements of sequential packing, for each candidate chunk size.

    The waste is the chunks' capacity minus the parameters, so only the number
    of chunks opened is tracked: one loop over parameters, vector ops over
    candidates (each candidate must be >= every size).
    """
    left = torch.zeros_like(candidates)
    num_chunks = torch.zeros_like(candidates)
    no_room = torch.empty_like(candidates, dtype=torch.bool)
    for size in sizes:
        # The reference's rule: a parameter that does not fit closes the chunk.
        torch.lt(left, size, out=no_room)
        num_chunks += no_room
        torch.where(no_room, candidates, left, out=left)
        left -= size
    return num_chunks * candidates - sum(sizes)


def _best_chunk_size(sizes: list[int], start: int, stop: int, step: int) -> int:
    """The candidate in ``range(start, stop + 1, step)`` with the least waste (ties: smallest)."""
    candidates = torch.arange(start, stop + 1, step, dtype=torch.int64)
    num_blocks = -(-len(candidates) // _MAX_BLOCK)
    best_size, best_waste = start, math.inf
    for block in candidates.tensor_split(num_blocks):  # near-equal blocks, in order
        waste = _waste(sizes, block)
        i = int(torch.argmin(waste))  # the first minimum: the smallest size
        if waste[i].item() < best_waste:
            best_size, best_waste = int(block[i]), waste[i].item()
    return best_size
