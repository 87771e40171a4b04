"""``CheckpointIO``: save and load a boosted model, optimizer and lr scheduler
in the [Note: full state format], as single files or Hugging Face style
sharded directories, atomically.

[Note: gathered checkpoint save] The model and optimizer are gathered whole:
``model.full_state_dict(only_rank_0=True)`` gathers the model to rank 0,
``optimizer.full_state_dict()`` the optimizer to every rank, and rank 0
writes. That needs the whole fp32 model (and optimizer state) in rank 0's
host memory. Every rank then waits for rank 0's outcome (a broadcast, which
is also the barrier), so no rank goes on to load a checkpoint that is not
yet in place, and an error on rank 0 is raised on every rank.

[Note: which saves are parallel] ``parallel=None`` (the default) picks the
per-rank parallel save (zerostack.booster._checkpoint_parallel: every rank
writes its own part through ``torch.distributed.checkpoint``, nothing is
gathered) for ``shard=True`` saves of wrappers that implement
``sharded_state_dict`` (every plugin's), except a model saved with
``use_safetensors=True``: that is the Hugging Face export, which
``from_pretrained`` reads, and it is gathered. ``shard=False`` (one file)
is gathered. ``parallel=True`` / ``False`` forces either. Loads tell the
layouts apart by their files.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from zerostack.booster import _checkpoint_atomic as atomic
from zerostack.booster import _checkpoint_dcp as engine
from zerostack.booster import _checkpoint_errors as errors
from zerostack.booster import _checkpoint_files as files
from zerostack.booster import _checkpoint_parallel as parallel_io
from zerostack.booster import _checkpoint_record as record
from zerostack.booster._checkpoint_names import alias_fill, alias_groups, drop_aliases, state_names
from zerostack.booster._interface import ModelWrapper, OptimizerWrapper

logger = logging.getLogger(__name__)

_MB = 1024 * 1024
_MODEL_INDEX_STEMS = ("model.safetensors.index", "pytorch_model.bin.index")
_MODEL_FILES = (files.SAFE_WEIGHTS_NAME, files.WEIGHTS_NAME)
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _check_path(api: str, checkpoint: Any) -> str:
    if isinstance(checkpoint, os.PathLike):
        checkpoint = os.fspath(checkpoint)
    if not isinstance(checkpoint, str) or not checkpoint:
        raise TypeError(
            f"{api}: checkpoint must be a path (got {checkpoint!r}); pass a str or os.PathLike"
        )
    return checkpoint


def _check_bool(api: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{api}: {name} must be a bool (got {value!r})")


def _check_size(api: str, size_per_shard: Any) -> None:
    if (
        isinstance(size_per_shard, bool)
        or not isinstance(size_per_shard, int)
        or size_per_shard < 1
    ):
        raise ValueError(
            f"{api}: size_per_shard must be a positive int of MB (got {size_per_shard!r}); "
            "pass e.g. 1024"
        )


def _check_prefix(api: str, prefix: Any) -> None:
    if prefix is not None and (not isinstance(prefix, str) or "/" in prefix or "\\" in prefix):
        raise ValueError(
            f"{api}: prefix must be None or a file-name part without separators "
            f"(got {prefix!r}); pass e.g. 'ema'"
        )


def _check_type(api: str, name: str, value: Any, cls: type) -> None:
    if not isinstance(value, cls):
        raise TypeError(
            f"{api}: {name} must be a {cls.__name__} (got {type(value).__name__}); "
            f"pass what Booster.boost returned"
        )


def _check_kind(api: str, path: str, shard: bool) -> None:
    """A sharded save replaces a directory, a single one a file, never the other."""
    if shard and os.path.isfile(path):
        raise ValueError(
            f"{api}: shard=True writes a directory but {path} is a file (got an existing "
            "file); pass another path or remove the file"
        )
    if not shard and os.path.isdir(path):
        raise ValueError(
            f"{api}: shard=False writes one file but {path} is a directory (got an existing "
            "directory); pass shard=True, another path, or remove the directory"
        )


def _save_hf_config(module: nn.Module, directory: str) -> None:
    """Write ``config.json`` (and ``generation_config.json``) as ``save_pretrained``
    does, when ``module`` is a transformers model."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        return
    config = copy.deepcopy(config)
    if hasattr(type(module), "config_class") and not getattr(config, "architectures", None):
        config.architectures = [type(module).__name__]
    path = os.path.join(directory, files.CONFIG_NAME)
    config.to_json_file(path)
    atomic.fsync_file(path)
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(directory)
        atomic.fsync_file(os.path.join(directory, files.GENERATION_CONFIG_NAME))


class CheckpointIO:
    """Saves and loads what ``Booster.boost`` returned, in the one format every
    plugin speaks, so a checkpoint moves between plugins and world sizes.

    Model checkpoints are a single file (a torch file, or safetensors) or a
    Hugging Face style directory (shards of at most ``size_per_shard`` MB, an
    index with ``metadata.total_size`` and ``weight_map``, and ``config.json``
    for a transformers model) that ``from_pretrained`` loads. Optimizer
    checkpoints hold the name-keyed full state, a single torch file or a
    directory of shards by parameter plus an index.

    Sharded saves are written by every rank in parallel, nothing gathered
    (see [Note: which saves are parallel]); single files and the Hugging
    Face export gather the state to rank 0, which writes (see [Note:
    gathered checkpoint save]). Every save is atomic (see [Note: atomic checkpoint
    save]): the previous checkpoint at the path stays whole until the new one
    is complete. Loads check every file against the sizes and hashes the save
    recorded (see [Note: checkpoint integrity]).

    Every rank must call each method (they hold collectives).

    A directory checkpoint is valid by its record, written last (see [Note:
    checkpoint record]); a save holds a lock beside its path (see [Note:
    checkpoint save lock]) and fails with ``CheckpointSaveError`` on every
    rank (see [Note: checkpoint save errors]).

    Args:
        verify: the default of the loads' ``verify``: True requires a
            directory's record and checks each file's size and SHA-256
            (sharded directories) or CRC-32/SHA-256 (single files) before
            reading; False (for checkpoints written before the records)
            checks byte sizes only, skipping one read of every file, and
            accepts a directory without a record, with a warning once.
            Default True.
    """

    def __init__(self, *, verify: bool = True) -> None:
        if not isinstance(verify, bool):
            raise TypeError(
                f"CheckpointIO: verify must be a bool (got {type(verify).__name__}); "
                "pass True or False"
            )
        self.verify = verify

    # --- model ------------------------------------------------------------

    def save_model(
        self,
        model: ModelWrapper,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        *,
        parallel: bool | None = None,
    ) -> None:
        """Save the model: with ``shard=True`` every rank writes its own part
        in parallel (see [Note: which saves are parallel]), else rank 0 writes
        the full state.

        The gathered layouts (one file, the Hugging Face export) hold the
        whole fp32 model in rank 0's host memory (see [Note: gathered
        checkpoint save]); tied weights are written once there (see [Note:
        tied weights in checkpoints]).

        Args:
            model: the model ``Booster.boost`` returned.
            checkpoint: with ``shard=False`` the file to write; with
                ``shard=True`` the directory to write (replaced whole).
            shard: write a directory: in parallel (the default without
                safetensors), one DCP file per rank and ``.metadata``; with
                ``use_safetensors=True`` (or ``parallel=False``) the Hugging
                Face layout: shards named ``model-00001-of-0000N.safetensors``
                (or ``pytorch_model-...bin``), the index
                ``model.safetensors.index.json`` (or
                ``pytorch_model.bin.index.json``) and, for a transformers
                model, ``config.json``. Default False: one file.
            gather_dtensor: accepted for ColossalAI's signature; the state is
                always gathered, so False only warns. Default True.
            prefix: inserted before the last extension of every file name
                (``model.<prefix>-00001-of-00002.safetensors``), as ColossalAI
                does; ``from_pretrained`` needs None. Default None.
            size_per_shard: most MB per shard file (a larger tensor gets a
                file of its own). Default 1024.
            use_safetensors: write safetensors instead of torch files.
                Default False.
            parallel: each rank writes its own part (no gather) through
                ``torch.distributed.checkpoint`` into the directory
                ``checkpoint``, loadable at any world size and with any
                plugin. Default None: see [Note: which saves are parallel].

        Raises:
            TypeError: ``model`` is not a ModelWrapper, or ``checkpoint`` not a path.
            ValueError: a bad ``size_per_shard`` or ``prefix``; ``checkpoint``
                is a file where a directory goes or the other way round.
            NotImplementedError: ``parallel=True`` for a wrapper without
                ``sharded_state_dict``.
            CheckpointSaveError: the write failed (on every rank, the root
                cause in the first line, e.g. a full disk), or another save
                to ``checkpoint`` is running; the previous checkpoint is
                unchanged.
        """
        api = "CheckpointIO.save_model"
        _check_bool(api, "shard", shard)
        _check_type(api, "model", model, ModelWrapper)
        parallel = _resolve_parallel(
            api, parallel, shard, use_safetensors, _supports(model, ModelWrapper)
        )
        path = self._check_save(api, checkpoint, size_per_shard, prefix, gather_dtensor, parallel)
        _check_kind(api, path, shard or parallel)
        if parallel:
            parallel_io.save_model(
                api, model, path, extra=lambda tmp: _save_hf_config(model.unwrap(), tmp)
            )
            return
        self._save_gathered(api, model, path, shard, prefix, size_per_shard, use_safetensors)

    def _save_gathered(
        self,
        api: str,
        model: ModelWrapper,
        path: str,
        shard: bool,
        prefix: str | None,
        size_per_shard: int,
        use_safetensors: bool,
    ) -> None:
        """Gather the full state to rank 0, which writes it; every rank
        raises if the write failed."""
        state = model.full_state_dict(only_rank_0=True)
        error, needed = None, files.nbytes(state)
        if _rank() == 0:
            try:
                self._write_model(
                    api, model, state, path, shard, prefix, size_per_shard, use_safetensors
                )
            except BaseException as exc:
                error = exc
        del state
        _finish(api, path, error, needed)

    def _write_model(
        self,
        api: str,
        model: ModelWrapper,
        state: dict[str, Any],
        path: str,
        shard: bool,
        prefix: str | None,
        size_per_shard: int,
        use_safetensors: bool,
    ) -> None:
        if not isinstance(state, dict) or not state:
            raise AssertionError(
                f"rank 0: {api}: model.full_state_dict(only_rank_0=True) gave rank 0 no state "
                f"(got {type(state).__name__} of length {len(state) if isinstance(state, dict) else '-'})"
            )
        module = model.unwrap()
        state = drop_aliases(state, alias_groups(module, state))
        if not shard:
            with atomic.atomic_path(path, is_dir=False, api=api) as tmp:
                if use_safetensors:
                    files.write_safetensors(tmp, state, embed_sha256=True)
                else:
                    files.write_torch(tmp, state)
            return
        if use_safetensors:
            file_name, index_name = files.SAFE_WEIGHTS_NAME, files.SAFE_WEIGHTS_INDEX_NAME
            write: Callable[..., None] = files.write_safetensors
        else:
            file_name, index_name = files.WEIGHTS_NAME, files.WEIGHTS_INDEX_NAME
            write = files.write_torch
        numel = sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor))
        with atomic.atomic_path(path, is_dir=True, api=api) as tmp:
            written = files.save_sharded(
                tmp,
                state,
                file_name=files.add_prefix(file_name, prefix),
                index_name=files.add_prefix(index_name, prefix),
                limit_bytes=size_per_shard * _MB,
                write=write,
                extra_metadata={"total_parameters": numel},
            )
            _save_hf_config(module, tmp)
            record.seal(tmp, save_id=record.allocate_save_id(), kind="model", files=written)
        logger.info("%s: wrote %s", api, path)

    def load_model(
        self,
        model: ModelWrapper,
        checkpoint: str,
        strict: bool = True,
        *,
        verify: bool | None = None,
    ) -> _IncompatibleKeys:
        """Load a model checkpoint on every rank.

        Accepts what :meth:`save_model` writes (a parallel directory, of
        which each rank reads only the ranges it holds; a torch or
        safetensors file, a sharded directory with either) and Hugging Face
        directories (with an
        index, or one ``model.safetensors`` / ``pytorch_model.bin``). A
        directory with an index is read one shard at a time, each passed to
        ``model.load_full_state_dict(part, strict=False)`` after the names
        were checked against the whole index, so host memory holds one shard.

        Args:
            model: the model ``Booster.boost`` returned.
            checkpoint: a file or directory :meth:`save_model` wrote.
            strict: the checkpoint's names must equal the model's
                ``state_dict`` names (tied names count as present). With
                False, names the model lacks are skipped and names the
                checkpoint lacks keep their values; both are returned and
                logged (a warning, once per call). Default True.
            verify: True: the checkpoint must be whole and of one save (see
                [Note: checkpoint record]): a directory needs its record,
                and every file's size and SHA-256 are checked before any is
                read. False: for checkpoints written before zerostack wrote
                records; sizes only, a directory without a record loads
                (warns once). Default None: this CheckpointIO's ``verify``.

        Returns:
            torch's ``_IncompatibleKeys`` (as ``nn.Module.load_state_dict``):
            ``missing_keys``, the model's names the checkpoint lacks (they
            kept their values), and ``unexpected_keys``, the checkpoint's
            names the model lacks (skipped); both empty with ``strict``.

        Raises:
            FileNotFoundError: nothing at ``checkpoint``.
            CheckpointCorruptError: the record of a directory is missing, a
                file is missing, truncated or altered, or files of different
                saves are mixed; the message names it.
            ValueError: with ``strict``, missing or unexpected names; a
                directory without a model checkpoint.
        """
        api = "CheckpointIO.load_model"
        _check_bool(api, "strict", strict)
        _check_type(api, "model", model, ModelWrapper)
        verify = self._resolve_verify(api, verify)
        path = atomic.resolve_for_load(_check_path(api, checkpoint), api)
        if engine.is_dcp_dir(path):
            parallel_io.check(api, path, verify=verify)
            missing, unexpected = parallel_io.load_model(api, model, path, strict)
            return _incompatible(api, path, missing, unexpected)
        return _load_gathered(api, model, path, strict, verify)

    # --- optimizer ----------------------------------------------------------

    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        *,
        parallel: bool | None = None,
    ) -> None:
        """Save the optimizer's name-keyed state: with ``shard=True`` every rank
        writes its own part in parallel (see [Note: which saves are
        parallel]), else rank 0 writes the gathered state
        (``optimizer.full_state_dict()``, see [Note: gathered checkpoint
        save]). Either loads at any world size and with any plugin.

        Args:
            optimizer: the optimizer ``Booster.boost`` returned.
            checkpoint: with ``shard=False`` the file to write; with
                ``shard=True`` the directory to write (replaced whole).
            shard: write a directory: in parallel, one DCP file per rank
                (``__<rank>_0.distcp``) and ``.metadata``; with
                ``parallel=False``, each parameter's state whole in one of
                ``pytorch_optim-0000i-of-0000N.bin`` (at most
                ``size_per_shard`` MB each), the param groups and loss scaler
                in ``pytorch_optim_group.bin``, and the index
                ``pytorch_optim.bin.index.json``. Default False: one torch file.
            gather_dtensor: accepted for ColossalAI's signature; False only warns.
                Default True.
            prefix: inserted before the last extension of every file name, as
                ColossalAI does. Default None.
            size_per_shard: most MB per shard file. Default 1024.
            parallel: each rank writes its own part (no gather) through
                ``torch.distributed.checkpoint`` into the directory
                ``checkpoint``, loadable at any world size and with any
                plugin. Default None: see [Note: which saves are parallel].

        Raises:
            TypeError: ``optimizer`` is not an OptimizerWrapper, or
                ``checkpoint`` not a path.
            ValueError: a bad ``size_per_shard`` or ``prefix``; ``checkpoint``
                is a file where a directory goes or the other way round.
            NotImplementedError: ``parallel=True`` for a wrapper without
                ``sharded_state_dict``.
            CheckpointSaveError: the write failed (on every rank, the root
                cause in the first line, e.g. a full disk), or another save
                to ``checkpoint`` is running; the previous checkpoint is
                unchanged.
        """
        api = "CheckpointIO.save_optimizer"
        _check_bool(api, "shard", shard)
        _check_type(api, "optimizer", optimizer, OptimizerWrapper)
        parallel = _resolve_parallel(
            api, parallel, shard, False, _supports(optimizer, OptimizerWrapper)
        )
        path = self._check_save(api, checkpoint, size_per_shard, prefix, gather_dtensor, parallel)
        _check_kind(api, path, shard or parallel)
        if parallel:
            parallel_io.save_optimizer(api, optimizer, path)
            return
        state = optimizer.full_state_dict()
        error, needed = None, files.nbytes(state)
        if _rank() == 0:
            try:
                self._write_optimizer(api, state, path, shard, prefix, size_per_shard)
            except BaseException as exc:
                error = exc
        del state
        _finish(api, path, error, needed)

    def _write_optimizer(
        self,
        api: str,
        state: dict[str, Any],
        path: str,
        shard: bool,
        prefix: str | None,
        size_per_shard: int,
    ) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
            raise AssertionError(
                f"rank 0: {api}: optimizer.full_state_dict() is not in the full state format "
                f"(got {type(state).__name__} with keys {list(state)[:5] if isinstance(state, dict) else '-'})"
            )
        if not shard:
            with atomic.atomic_path(path, is_dir=False, api=api) as tmp:
                files.write_torch(tmp, state)
            return
        groups_name = files.add_prefix(files.OPTIM_GROUPS_NAME, prefix)
        rest = {k: v for k, v in state.items() if k != "state"}
        with atomic.atomic_path(path, is_dir=True, api=api) as tmp:
            written = files.save_sharded(
                tmp,
                state["state"],
                file_name=files.add_prefix(files.OPTIM_NAME, prefix),
                index_name=files.add_prefix(files.OPTIM_INDEX_NAME, prefix),
                limit_bytes=size_per_shard * _MB,
                write=files.write_torch,
                extra_files={groups_name: rest},
                extra_metadata={"param_groups": groups_name},
            )
            record.seal(tmp, save_id=record.allocate_save_id(), kind="optimizer", files=written)
        logger.info("%s: wrote %s", api, path)

    def load_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        *,
        verify: bool | None = None,
    ) -> None:
        """Load an optimizer checkpoint on every rank: from a parallel
        directory each rank reads the ranges it holds
        (``optimizer.load_sharded_state_dict``); from the gathered layouts
        each rank reads the whole state (``optimizer.load_full_state_dict``).

        Args:
            optimizer: the optimizer ``Booster.boost`` returned.
            checkpoint: a file or directory :meth:`save_optimizer` wrote.
            prefix: picks the index ``pytorch_optim.bin.index.<prefix>.json``
                in a directory; None takes the directory's only index.
                Default None.
            size_per_shard: accepted for ColossalAI's signature; no effect.
                Default 1024.
            verify: as :meth:`load_model`'s. Default None: this
                CheckpointIO's ``verify``.

        Raises:
            FileNotFoundError: nothing at ``checkpoint``.
            CheckpointCorruptError: the record of a directory is missing, a
                file is missing, truncated or altered, or files of different
                saves are mixed; the message names it.
            ValueError: the checkpoint does not hold an optimizer state, or
                its parameter groups list other parameters than the
                optimizer's (a state of another model, which torch's
                ``load_state_dict`` refuses too); nothing is loaded.
        """
        api = "CheckpointIO.load_optimizer"
        _check_type(api, "optimizer", optimizer, OptimizerWrapper)
        _check_prefix(api, prefix)
        verify = self._resolve_verify(api, verify)
        path = atomic.resolve_for_load(_check_path(api, checkpoint), api)
        if engine.is_dcp_dir(path):
            parallel_io.check(api, path, verify=verify)
            parallel_io.load_optimizer(api, optimizer, path)
            return
        if os.path.isdir(path):
            vouched = record.check_present(api, path, verify=verify)
            check_hash = verify and not vouched
            stem = files.add_prefix(files.OPTIM_INDEX_NAME, prefix).removesuffix(".json")
            index_path = files.find_index(path, (stem,), api)
            if index_path is None:
                raise ValueError(
                    f"{api}: {path} holds no optimizer index (got files "
                    f"{sorted(os.listdir(path))[:8]}); pass a directory save_optimizer wrote"
                )
            index = files.read_index(index_path, api)
            if not vouched:
                record.require_for_index(api, path, index, verify=verify)
            per_param: dict[str, Any] = {}
            for _, part in files.iter_index_files(index_path, api, check_hash=check_hash):
                per_param.update(part)
            groups_name = (index.get("metadata") or {}).get("param_groups", files.OPTIM_GROUPS_NAME)
            groups_path = os.path.join(path, groups_name)
            groups_record = files.index_records(index).get(groups_name)
            files.verify_file(groups_path, groups_record, api, check_hash=check_hash)
            rest = files.read_torch(groups_path, api, check_crc=check_hash and not groups_record)
            state = {"state": per_param, **rest}
        else:
            state = files.read_torch(path, api, check_crc=verify)
        if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
            raise ValueError(
                f"{api}: {path} does not hold an optimizer state (got "
                f"{sorted(state)[:5] if isinstance(state, dict) else type(state).__name__}); "
                "pass a checkpoint save_optimizer wrote"
            )
        optimizer.load_full_state_dict(state)

    # --- lr scheduler -------------------------------------------------------

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        """Save ``lr_scheduler.state_dict()`` to one torch file; rank 0 writes it.

        Args:
            lr_scheduler: anything with ``state_dict()`` (a torch lr scheduler).
            checkpoint: the file to write.

        Raises:
            TypeError: ``lr_scheduler`` has no ``state_dict``, or
                ``checkpoint`` is not a path.
            ValueError: ``checkpoint`` is a directory.
            CheckpointSaveError: the write failed (on every rank, the root
                cause in the first line, e.g. a full disk), or another save
                to ``checkpoint`` is running; the previous checkpoint is
                unchanged.
        """
        api = "CheckpointIO.save_lr_scheduler"
        path = os.path.abspath(_check_path(api, checkpoint))
        if not callable(getattr(lr_scheduler, "state_dict", None)):
            raise TypeError(
                f"{api}: lr_scheduler must have state_dict() (got {type(lr_scheduler).__name__}); "
                "pass a torch.optim.lr_scheduler instance"
            )
        _check_kind(api, path, False)
        error = None
        if _rank() == 0:
            try:
                with atomic.atomic_path(path, is_dir=False, api=api) as tmp:
                    files.write_torch(tmp, lr_scheduler.state_dict())
            except BaseException as exc:
                error = exc
        _finish(api, path, error, None)

    def load_lr_scheduler(
        self, lr_scheduler: Any, checkpoint: str, *, verify: bool | None = None
    ) -> None:
        """Load a file :meth:`save_lr_scheduler` wrote, on every rank.

        Args:
            lr_scheduler: anything with ``load_state_dict``.
            checkpoint: the file to read.
            verify: check the file's CRC-32s. Default None: this
                CheckpointIO's ``verify``.

        Raises:
            FileNotFoundError: nothing at ``checkpoint``.
            CheckpointCorruptError: the file is truncated or altered.
        """
        api = "CheckpointIO.load_lr_scheduler"
        verify = self._resolve_verify(api, verify)
        path = atomic.resolve_for_load(_check_path(api, checkpoint), api)
        lr_scheduler.load_state_dict(files.read_torch(path, api, check_crc=verify))

    # --- shared -------------------------------------------------------------

    def _resolve_verify(self, api: str, verify: Any) -> bool:
        if verify is None:
            verify = self.verify
        _check_bool(api, "verify", verify)
        if not verify:
            record.warn_unverified(api)
        return verify

    def _check_save(
        self,
        api: str,
        checkpoint: Any,
        size_per_shard: Any,
        prefix: Any,
        gather_dtensor: bool,
        parallel: bool,
    ) -> str:
        path = os.path.abspath(_check_path(api, checkpoint))
        _check_size(api, size_per_shard)
        _check_prefix(api, prefix)
        if parallel and (prefix is not None or size_per_shard != 1024):
            _warn_once(
                "parallel-names",
                f"{api}: prefix and size_per_shard have no effect on a parallel save (got "
                f"prefix={prefix!r}, size_per_shard={size_per_shard}); every rank writes one "
                "file (__<rank>_0.distcp)",
            )
        if not gather_dtensor and not parallel:
            _warn_once(
                "gather_dtensor",
                f"{api}: gather_dtensor=False has no effect; the state is always gathered "
                "whole (see zerostack.booster._checkpoint)",
            )
        return path


def _supports(obj: Any, base: Any) -> bool:
    """True when the wrapper implements the per-rank sharded state."""
    return type(obj).sharded_state_dict is not base.sharded_state_dict


def _resolve_parallel(
    api: str, parallel: bool | None, shard: bool, use_safetensors: bool, supported: bool
) -> bool:
    """See [Note: which saves are parallel]."""
    if parallel is None:
        return shard and not use_safetensors and supported
    if not isinstance(parallel, bool):
        raise TypeError(f"{api}: parallel must be a bool or None (got {parallel!r})")
    if parallel and use_safetensors:
        raise ValueError(
            f"{api}: a parallel save writes DCP files, not safetensors (got parallel=True, "
            "use_safetensors=True); pass parallel=False for a Hugging Face export"
        )
    return parallel


def _find_model_files(api: str, path: str) -> tuple[str | None, str | None]:
    """``(index, None)`` or ``(None, single file)`` for a model checkpoint path."""
    if not os.path.isdir(path):
        return None, path
    index = files.find_index(path, _MODEL_INDEX_STEMS, api)
    if index is not None:
        return index, None
    for name in _MODEL_FILES:
        if os.path.isfile(os.path.join(path, name)):
            return None, os.path.join(path, name)
    raise ValueError(
        f"{api}: {path} holds no model checkpoint (got files {sorted(os.listdir(path))[:8]}); "
        "pass a directory save_model(shard=True) wrote, or a model file"
    )


def _check_names(
    api: str,
    path: str,
    names: set[str],
    expected: set[str],
    groups: list[list[str]],
    strict: bool,
) -> tuple[dict[str, str], list[str], list[str]]:
    """``(the tied-name fill, missing names, unexpected names)``; with
    ``strict``, raise unless the names match."""
    fill = {m: s for m, s in alias_fill(names, groups).items() if m in expected}
    missing = sorted(expected - names - set(fill))
    unexpected = sorted(names - expected)
    if strict and (missing or unexpected):
        raise ValueError(
            f"{api}: {path} does not match the model (got missing names {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected names {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}); load the checkpoint of this model, "
            "or pass strict=False"
        )
    return fill, missing, unexpected


def _load_gathered(
    api: str, model: ModelWrapper, path: str, strict: bool, verify: bool
) -> _IncompatibleKeys:
    """load_model from a gathered layout: one file, or a directory with an
    index read one shard at a time."""
    module = model.unwrap()
    expected = set(state_names(module))
    groups = alias_groups(module)
    vouched = record.check_present(api, path, verify=verify)
    index_path, single = _find_model_files(api, path)
    if index_path is not None:
        index = files.read_index(index_path, api)
        if not vouched:
            record.require_for_index(api, path, index, verify=verify)
        names = set(index["weight_map"])
        fill, missing, unexpected = _check_names(api, path, names, expected, groups, strict)
        parts = files.iter_index_files(index_path, api, check_hash=verify and not vouched)
        whole = len(set(index["weight_map"].values())) <= 1
    else:
        state = files.read_state(single, api, check=verify and not vouched)
        fill, missing, unexpected = _check_names(api, path, set(state), expected, groups, strict)
        parts, whole = iter([(single, state)]), True
    for name, part in parts:
        part.update({m: part[s] for m, s in fill.items() if s in part})
        part = {k: v for k, v in part.items() if k in expected}
        logger.debug("%s: loading %d tensors from %s", api, len(part), name)
        model.load_full_state_dict(part, strict=strict and whole)
        del part
    return _incompatible(api, path, missing, unexpected)


def _incompatible(
    api: str, path: str, missing: list[str], unexpected: list[str]
) -> _IncompatibleKeys:
    """What ``load_model(strict=False)`` returns, logged once (rank 0)."""
    if (missing or unexpected) and _rank() == 0:
        logger.warning(
            "%s: strict=False: %s: %d names the checkpoint lacks kept their values %s; %d "
            "names the model lacks were skipped %s",
            api,
            path,
            len(missing),
            missing[:8],
            len(unexpected),
            unexpected[:8],
        )
    return _IncompatibleKeys(missing, unexpected)


def _finish(api: str, path: str, error: BaseException | None, needed: int | None) -> None:
    """Every rank learns rank 0's outcome after its rename; this is the
    barrier. A failure raises ``CheckpointSaveError`` on every rank. See
    [Note: gathered checkpoint save] and [Note: checkpoint save errors]."""
    summary = None if error is None else errors.summarize(error, 0)
    if _world_size() > 1:
        box = [summary]
        dist.broadcast_object_list(box, src=0)
        summary = box[0]
    if summary is not None:
        atomic.fail_everywhere(api, path, [summary], error, needed)
