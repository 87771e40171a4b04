"""The per-rank parallel checkpoint engine: ``torch.distributed.checkpoint``
(DCP) with planners that understand :class:`Piece`, this rank's contiguous
slice of a flattened tensor.

[Note: pieces in DCP] ZeRO-1/2 and Gemini shard flat buffers, not tensors:
a rank owns ``[offset, offset + n)`` of a parameter's flattened elements,
with offsets no DTensor placement describes (Gemini packs parameters into
chunks split in equal shares, so a parameter may start mid-share on any
rank, and ranks own nothing of it). DCP's metadata already speaks in
chunks (``ChunkStorageMetadata(offsets, sizes)``) and reshards by
overlapping saved chunks with requested ones, so a piece is exactly one
1-D chunk of a 1-D global tensor: the planners below emit one write item
(save) or the overlapping read items (load) per piece, and DCP does the
rest: every rank writes its own file (``__<rank>_0.distcp``) in parallel,
the coordinator writes ``.metadata``, replicated plain tensors are written
once (DCP's dedup), and a load at any world size and with any plugin reads
the byte ranges it needs. Every parameter-shaped tensor is stored 1-D
(``numel``,) so whole tensors (DDP) and pieces (ZeRO, Gemini) meet in one
layout; the shapes travel in the ``shapes`` object.

ShardedTensor would express such pieces too but is deprecated in favour of
DTensor; the ``_Checkpointable`` protocol is private and needs a tensor
subclass. The planners use DCP's public planner interface only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

METADATA_FILE = ".metadata"


@dataclass(frozen=True, slots=True)
class Piece:
    """This rank's elements ``[offset, offset + tensor.numel())`` of a
    flattened tensor of ``global_numel`` elements. ``tensor`` is 1-D; on
    load it is the destination DCP reads into."""

    tensor: torch.Tensor
    offset: int
    global_numel: int

    def __post_init__(self) -> None:
        n = self.tensor.numel()
        if self.tensor.dim() != 1 or self.offset < 0 or self.offset + n > self.global_numel:
            raise AssertionError(
                f"Piece: [{self.offset}, {self.offset + n}) of a {self.tensor.dim()}-D tensor does "
                f"not fit a flat tensor of {self.global_numel} elements"
            )


def _split(state: dict[str, Any]) -> tuple[dict[str, Piece], dict[str, Any]]:
    pieces = {k: v for k, v in state.items() if isinstance(v, Piece)}
    return pieces, {k: v for k, v in state.items() if not isinstance(v, Piece)}


def _chunk(piece: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(
        offsets=torch.Size([piece.offset]), sizes=torch.Size([piece.tensor.numel()])
    )


class _PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus one write item per non-empty piece."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.pieces, plain = _split(state_dict)
        super().set_up_planner(plain, storage_meta, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([p.offset])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(p),
                    properties=TensorProperties.create_from_tensor(p.tensor),
                    size=torch.Size([p.global_numel]),
                ),
            )
            for fqn, p in self.pieces.items()
            if p.tensor.numel()
        ]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        piece = self.pieces.get(write_item.index.fqn)
        if piece is not None:
            return piece.tensor.detach()  # DCP's writer compacts and moves it to the CPU
        return super().resolve_data(write_item)


class _PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus the read items that overlap each
    piece with the saved chunks (any world size, any plugin)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.pieces, plain = _split(state_dict)
        super().set_up_planner(plain, metadata, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for fqn, p in self.pieces.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata) or md.size != torch.Size([p.global_numel]):
                raise ValueError(
                    f"load: {fqn} is saved as {getattr(md, 'size', md)}, this model has "
                    f"{p.global_numel} elements; load a checkpoint of the same model"
                )
            if p.tensor.numel():
                items += create_read_items_for_chunk_list(fqn, md, [_chunk(p)])
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        piece = self.pieces.get(index.fqn)
        if piece is not None:
            return piece.tensor
        return super().lookup_tensor(index)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group, even with no_dist=True
    (which says exactly that): silence that one warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class _Writer(FileSystemWriter):
    """DCP's file writer, with the save id in every rank's file names
    (``__<rank>_<save id>_0.distcp``, which ``.metadata`` records), so a
    file of another save is never read as this one's (see [Note:
    checkpoint record])."""

    def __init__(self, path: str, save_id: str) -> None:
        super().__init__(path, sync_files=True, overwrite=True)
        self._save_id = save_id

    def prepare_global_plan(self, plans):
        return [
            dataclasses.replace(plan, storage_data=_StoragePrefix(file_prefix(i, self._save_id)))
            for i, plan in enumerate(plans)
        ]


def file_prefix(rank: int, save_id: str) -> str:
    """The start of the names of the files ``rank`` writes in save ``save_id``."""
    return f"__{rank}_{save_id}_"


def save(path: str, state: dict[str, Any], save_id: str, process_group: Any = None) -> None:
    """Every rank writes its pieces and its share of the plain entries into
    the directory ``path`` (which must exist), in parallel; a collective.

    Args:
        path: the directory (a temporary one: see ``collective_dir``).
        state: flat ``{key: Piece | tensor | picklable}``. Plain tensors
            with the same key on several ranks must be equal; DCP writes
            them once.
        save_id: goes into every file name (see :class:`_Writer`).
        process_group: the group. Default: the default group.
    """
    with _single_process_quiet():
        dcp.save(
            state,
            storage_writer=_Writer(path, save_id),
            planner=_PieceSavePlanner(),
            process_group=process_group,
            no_dist=not _distributed(),
        )


def load(path: str, state: dict[str, Any], process_group: Any = None) -> dict[str, Any]:
    """Fill ``state``'s pieces and plain tensors in place from ``path``; the
    non-tensor entries come back in the returned dict (a collective).

    Raises:
        ValueError: a key is missing or sized otherwise in the checkpoint.
    """
    planner = _PieceLoadPlanner()
    with _single_process_quiet():
        dcp.load(
            state,
            storage_reader=FileSystemReader(path),
            planner=planner,
            process_group=process_group,
            no_dist=not _distributed(),
        )
    return {**state, **planner.state_dict}


def check_save_id(api: str, path: str, save_id: str) -> None:
    """Refuse a ``.metadata`` that names files of another save than ``save_id``.

    Raises:
        CheckpointCorruptError: naming ``.metadata``.
    """
    from zerostack.booster._checkpoint_record import check_save_id

    for info in FileSystemReader(path).read_metadata().storage_data.values():
        name = getattr(info, "relative_path", "")
        parts = name.split("_")
        got = parts[3] if name.startswith("__") and len(parts) >= 5 else name
        if got != save_id:
            check_save_id(api, os.path.join(path, METADATA_FILE), save_id, got)


def saved_keys(path: str) -> dict[str, Any]:
    """``{key: TensorStorageMetadata | BytesStorageMetadata}`` of a DCP directory."""
    return dict(FileSystemReader(path).read_metadata().state_dict_metadata)


def is_dcp_dir(path: str) -> bool:
    """True when ``path`` is a directory DCP wrote."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))
