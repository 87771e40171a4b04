"""``Booster.save_state`` / ``load_state``: everything an exact resume needs
in one directory, written atomically (Accelerate's ``save_state`` /
``load_state``, with the Booster's objects passed explicitly).

[Note: training state directory] Layout of ``save_state(dir, ...)``::

    dir/model/                  save_model(shard=True): every rank writes its part
    dir/optimizer/              save_optimizer(shard=True), when an optimizer is given
    dir/lr_scheduler.pt         save_lr_scheduler, when a scheduler is given
    dir/rank-00000-of-00002.pt  per rank: its RNG states, its dataloader position, the save id
    dir/zerostack-checkpoint.json  the record, written last (see [Note: checkpoint record])

The whole directory appears at once (``collective_dir``): a save killed at
any point leaves the previous state. One save id marks every part (the
records of ``model/`` and ``optimizer/``, the per-rank files), so a load
refuses parts of different saves. Resuming is exact (the losses of the
uninterrupted run, bitwise in fp32) at the same world size; at another one
the model, optimizer and scheduler load as usual, the sampler position is
scaled, and each rank takes the RNG state of the rank with its number
modulo the saved world size (a warning says so).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Any

import torch.distributed as dist

from zerostack.booster import _checkpoint_atomic as atomic
from zerostack.booster import _checkpoint_files as files
from zerostack.booster import _checkpoint_record as record
from zerostack.booster._interface import ModelWrapper
from zerostack.booster._rng import rng_state, set_rng_state

logger = logging.getLogger(__name__)
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
SCHEDULER_FILE = "lr_scheduler.pt"
_RANK_FILE = "rank-{rank:05d}-of-{world:05d}.pt"
_RANK_RE = re.compile(r"rank-(\d{5})-of-(\d{5})\.pt$")


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_dataloader(api: str, dataloader: Any) -> None:
    if dataloader is not None and not callable(getattr(dataloader, "state_dict", None)):
        raise TypeError(
            f"{api}: dataloader must have state_dict()/load_state_dict() (got "
            f"{type(dataloader).__name__}); build it with plugin.prepare_dataloader"
        )


def save_state(
    booster: Any,
    checkpoint: str,
    model: ModelWrapper,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    dataloader: Any = None,
) -> None:
    """See ``Booster.save_state``."""
    api = "Booster.save_state"
    if not isinstance(checkpoint, (str, os.PathLike)) or not os.fspath(checkpoint):
        raise TypeError(f"{api}: checkpoint must be a directory path (got {checkpoint!r})")
    if not isinstance(model, ModelWrapper):
        raise TypeError(
            f"{api}: model must be the model booster.boost returned (got {type(model).__name__})"
        )
    _check_dataloader(api, dataloader)
    rank, world = _rank_world()
    with atomic.collective_dir(os.fspath(checkpoint), api, kind="state") as save:
        tmp = save.path
        booster.save_model(model, os.path.join(tmp, MODEL_DIR), shard=True)
        if optimizer is not None:
            booster.save_optimizer(optimizer, os.path.join(tmp, OPTIMIZER_DIR), shard=True)
        if lr_scheduler is not None:
            booster.save_lr_scheduler(lr_scheduler, os.path.join(tmp, SCHEDULER_FILE))
        mine = {
            "rng": rng_state(),
            "dataloader": dataloader.state_dict() if dataloader is not None else None,
            "save_id": save.save_id,
        }
        save.needed_bytes = files.nbytes(mine)
        name = _RANK_FILE.format(rank=rank, world=world)
        files.write_torch(os.path.join(tmp, name), mine)
        atomic.fsync_file(os.path.join(tmp, name))
        save.add(name)
    logger.info("%s: wrote %s", api, checkpoint)


def _rank_files(api: str, path: str) -> dict[int, tuple[int, str]]:
    """``{rank: (saved world size, file)}`` of a state directory."""
    found = {}
    for name in os.listdir(path):
        m = _RANK_RE.match(name)
        if m:
            found[int(m.group(1))] = (int(m.group(2)), os.path.join(path, name))
    if not found:
        raise ValueError(
            f"{api}: {path} holds no rank-*-of-*.pt files (got {sorted(os.listdir(path))[:8]}); "
            "pass a directory Booster.save_state wrote"
        )
    return found


def load_state(
    booster: Any,
    checkpoint: str,
    model: ModelWrapper,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    dataloader: Any = None,
    verify: bool = True,
) -> None:
    """See ``Booster.load_state``."""
    api = "Booster.load_state"
    _check_dataloader(api, dataloader)
    if not isinstance(verify, bool):
        raise TypeError(f"{api}: verify must be a bool (got {verify!r})")
    if not verify:
        record.warn_unverified(api)
    path = atomic.resolve_for_load(os.fspath(checkpoint), api)
    found = record.check(api, path, verify=verify)
    ranks = _rank_files(api, path)
    for what, given, name in (
        ("optimizer", optimizer, OPTIMIZER_DIR),
        ("lr_scheduler", lr_scheduler, SCHEDULER_FILE),
    ):
        if given is not None and not os.path.exists(os.path.join(path, name)):
            raise ValueError(
                f"{api}: {path} holds no {what} (got {what}=... but no {name}); pass "
                f"{what}=None or a state saved with one"
            )
    rank, world = _rank_world()
    saved_world = next(iter(ranks.values()))[0]
    source = rank if saved_world == world else rank % saved_world
    if saved_world != world:
        warnings.warn(
            f"{api}: saved at world size {saved_world}, loaded at {world}: rank {rank} takes "
            f"the RNG states of saved rank {source} and a scaled sampler position, so the run "
            "is not the uninterrupted one",
            UserWarning,
            stacklevel=3,
        )
    if source not in ranks:
        raise files.CheckpointCorruptError(
            f"{api}: {path} lacks the file of rank {source} (got ranks {sorted(ranks)}); copy the "
            "whole directory"
        )
    mine = files.read_torch(ranks[source][1], api, check_crc=verify and found is None)
    if found is not None:
        record.check_save_id(api, ranks[source][1], found["save_id"], mine.get("save_id"))
    if dataloader is not None:  # first: it may refuse the position, and is put back on a failure
        if mine.get("dataloader") is None:
            raise ValueError(
                f"{api}: {path} holds no dataloader position (got dataloader=... but it was "
                "saved without one); pass dataloader=None"
            )
        before = dataloader.state_dict()
        dataloader.load_state_dict(mine["dataloader"])
    io = booster.checkpoint_io
    try:
        io.load_model(model, os.path.join(path, MODEL_DIR), verify=verify)
        if optimizer is not None:
            io.load_optimizer(optimizer, os.path.join(path, OPTIMIZER_DIR), verify=verify)
        if lr_scheduler is not None:
            io.load_lr_scheduler(lr_scheduler, os.path.join(path, SCHEDULER_FILE), verify=verify)
    except BaseException:
        if dataloader is not None:
            dataloader.load_state_dict(before)
        raise
    set_rng_state(mine["rng"])
