"""launch_from_torch / launch: join a process group (torchrun's, or one
described by rank, world size, host and port), pick the rank's GPU and seed
every RNG, as ColossalAI's ``colossalai.launch_from_torch`` and
``colossalai.launch``."""

from __future__ import annotations

import logging
import numbers
import os
import random
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zerostack.booster import _exit

logger = logging.getLogger(__name__)
_API = "launch_from_torch"
# What torchrun sets for every worker.
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launch_from_torch(
    seed: int = 1024,
    backend: str | None = None,
    timeout: float | timedelta | None = None,
    *,
    config: Mapping[str, Any] | None = None,
    verbose: bool = True,
) -> None:
    """Initialise torch.distributed from torchrun's environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``, calls ``init_process_group`` (``env://``), makes
    ``LOCAL_RANK`` the current CUDA device when CUDA is present, and seeds
    Python's ``random``, numpy's global RNG (when numpy is installed) and
    torch (CPU and CUDA) with ``seed``, the same on every rank.

    Idempotent: when a process group exists already (a second call, or a
    group made by other code) it is kept as it is, the environment is not
    read, and only the device and the random number generators are set.

    Args:
        seed: the seed of every RNG. Default 1024. A dict in its place is
            ColossalAI's older first argument, ``config``
            (``launch_from_torch({})``), and is read as ``config``.
        backend: the process-group backend. Default None: "nccl" when CUDA is
            available, else "gloo".
        timeout: the process group's timeout, in seconds or as a timedelta.
            Default None: torch's default.
        config: ColossalAI's older ``config`` (``launch_from_torch(config={})``):
            None or empty only, as the Booster API's programs pass it.
            Default None.
        verbose: log the group at INFO (else DEBUG), as ColossalAI's.
            Default True.

    Raises:
        RuntimeError: one of torchrun's variables is missing (start the
            script with ``torchrun``).
        TypeError: ``seed`` is not an int (ColossalAI's ``backend``, first
            since it dropped ``config``, passed positionally).
        NotImplementedError: ``config`` has settings (they belong to the
            Booster's plugin here).
        ValueError: a variable is not an integer, LOCAL_RANK names no CUDA
            device, or ``timeout`` is not positive.
    """
    seed = _colossalai_config(_API, seed, config)
    if dist.is_available() and dist.is_initialized():
        _exit.register()
        local_rank = _int_env("LOCAL_RANK") if "LOCAL_RANK" in os.environ else None
        _set_device(local_rank)
        _seed_all(seed)
        logger.info("%s: a process group exists already; kept it, seeded with %d", _API, seed)
        return
    missing = [name for name in _ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"{_API}: torchrun's environment variables are missing (got none for "
            f"{', '.join(missing)}); start the script with `torchrun --nproc-per-node N "
            "script.py`, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
        )
    rank, world_size, local_rank = (_int_env(n) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    _int_env("MASTER_PORT")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    _set_device(local_rank)
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = _timedelta(timeout)
    dist.init_process_group(
        backend=backend, init_method="env://", rank=rank, world_size=world_size, **kwargs
    )
    _exit.register()  # See [Note: exit code under gloo]
    _seed_all(seed)
    logger.log(
        logging.INFO if verbose else logging.DEBUG,
        "%s: rank %d of %d (local rank %d), backend %s, seed %d",
        _API, rank, world_size, local_rank, backend, seed,
    )  # fmt: skip


def launch(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str | None = None,
    local_rank: int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
    *,
    config: Mapping[str, Any] | None = None,
) -> None:
    """Initialise torch.distributed for a process that knows its rank, as
    ColossalAI's ``colossalai.launch`` (the processes started by the script
    itself, e.g. ``torch.multiprocessing.spawn``; under torchrun use
    :func:`launch_from_torch`).

    Calls ``init_process_group`` with ``tcp://host:port`` (an IPv6 host is
    bracketed), makes ``local_rank`` the current CUDA device when CUDA is
    present, and seeds Python's ``random``, numpy's global RNG (when numpy
    is installed) and torch with ``seed``.

    Args:
        rank: this process's rank, in ``[0, world_size)``.
        world_size: the number of processes.
        host: the address of rank 0.
        port: a free port on ``host``.
        backend: the process-group backend. Default None: "nccl" when CUDA is
            available, else "gloo" (ColossalAI's default is "nccl").
        local_rank: the CUDA device of this process. Default None:
            ``rank % torch.cuda.device_count()``.
        seed: the seed of every RNG. Default 1024.
        verbose: log the group at INFO (else DEBUG). Default True.
        timeout: the process group's timeout, in seconds or as a timedelta.
            Default None: torch's default.
        config: ColossalAI's older ``config`` (``launch(config={}, ...)``):
            None or empty only. Default None.

    Raises:
        TypeError: ``rank``, ``world_size``, ``port``, ``seed`` or
            ``local_rank`` is not an int, or ``host`` not a str.
        NotImplementedError: ``config`` has settings (they belong to the
            Booster's plugin here).
        ValueError: ``rank`` outside ``[0, world_size)``, a port outside
            1..65535, ``local_rank`` names no CUDA device, or ``timeout`` is
            not positive.
        RuntimeError: a process group exists already.
    """
    api = "launch"
    seed = _colossalai_config(api, seed, config)
    _check_launch_args(api, rank, world_size, host, port, local_rank)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            f"{api}: a process group exists already (got world size {dist.get_world_size()}); "
            "call launch once per process, or destroy_process_group() first"
        )
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": _timedelta(timeout, api)}
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if local_rank is None and torch.cuda.is_available():
        local_rank = rank % torch.cuda.device_count()
    _set_device(local_rank, api)
    address = f"[{host}]" if ":" in host else host
    dist.init_process_group(
        backend=backend, init_method=f"tcp://{address}:{port}", rank=rank,
        world_size=world_size, **kwargs,
    )  # fmt: skip
    _exit.register()  # See [Note: exit code under gloo]
    _seed_all(seed)
    logger.log(
        logging.INFO if verbose else logging.DEBUG,
        "%s: rank %d of %d (%s:%d), backend %s, seed %d",
        api, rank, world_size, host, port, backend, seed,
    )  # fmt: skip


def _check_launch_args(
    api: str, rank: Any, world_size: Any, host: Any, port: Any, local_rank: Any
) -> None:
    for name, value in (("rank", rank), ("world_size", world_size), ("port", port)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{api}: {name} must be an int (got {value!r})")
    if local_rank is not None and (isinstance(local_rank, bool) or not isinstance(local_rank, int)):
        raise TypeError(f"{api}: local_rank must be an int or None (got {local_rank!r})")
    if not isinstance(host, str) or not host:
        raise TypeError(f"{api}: host must be a non-empty str (got {host!r}); e.g. 'localhost'")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"{api}: rank must be in [0, world_size) (got rank={rank}, world_size={world_size})"
        )
    if not 0 < port < 65536:
        raise ValueError(f"{api}: port must be in 1..65535 (got {port})")


def _colossalai_config(api: str, seed: Any, config: Any) -> int:
    """``seed``, after checking ColossalAI's ``config``: an empty one (what
    its Booster programs pass) asks for nothing; settings in it would be
    dropped silently, so they are refused. A dict passed as ``seed`` is
    ``config`` passed positionally, ColossalAI's first argument before it
    dropped ``config``."""
    if isinstance(seed, Mapping) and config is None:
        seed, config = 1024, seed
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(
            f"{api}: seed must be an int (got {seed!r}); ColossalAI's later versions take "
            "backend first: pass the arguments by keyword, e.g. "
            f"{api}(backend='gloo', seed=1024)"
        )
    if config is None or (isinstance(config, Mapping) and not config):
        return int(seed)
    got = sorted(map(str, config)) if isinstance(config, Mapping) else repr(config)
    raise NotImplementedError(
        f"{api}: ColossalAI's config is not read (got {got}); its settings belong to the "
        "Booster's plugin here (e.g. GeminiPlugin(precision='fp16', max_norm=1.0), "
        f"LowLevelZeroPlugin(stage=2)): call {api} without config, or with config={{}}"
    )


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{_API}: environment variable {name} must be an integer (got {value!r}); "
            "let torchrun set it"
        ) from None


def _timedelta(timeout: float | timedelta, api: str = _API) -> timedelta:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"{api}: timeout must be > 0 seconds (got {timeout!r})")
    return timedelta(seconds=seconds)


def _set_device(local_rank: int | None, api: str = _API) -> None:
    if local_rank is None or not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        how = (
            "start at most one process per GPU (torchrun --nproc-per-node)"
            if api == _API
            else "pass local_rank=None (rank % the device count) or a device index"
        )
        name = "LOCAL_RANK" if api == _API else "local_rank"
        raise ValueError(
            f"{api}: {name} {local_rank} names no CUDA device (got {count} devices); {how}"
        )
    torch.cuda.set_device(local_rank)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # every CUDA device too
