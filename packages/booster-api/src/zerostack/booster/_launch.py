"""launch_from_torch: join the process group torchrun describes, pick the
rank's GPU and seed every RNG, as ColossalAI's ``colossalai.launch_from_torch``."""

from __future__ import annotations

import logging
import os
import random
from datetime import timedelta

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
) -> None:
    """Initialise torch.distributed from torchrun's environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT``, calls ``init_process_group`` (``env://``), makes
    ``LOCAL_RANK`` the current CUDA device when CUDA is present, and seeds
    Python's ``random``, numpy's global RNG (when numpy is installed) and
    torch (CPU and CUDA) with ``seed``, the same on every rank.

    Idempotent: when a process group exists already (a second call, or a
    group made by other code) it is kept as it is, the environment is not
    read, and only the device and the seeds are set.

    Args:
        seed: the seed of every RNG. Default 1024.
        backend: the process-group backend. Default None: "nccl" when CUDA is
            available, else "gloo".
        timeout: the process group's timeout, in seconds or as a timedelta.
            Default None: torch's default.

    Raises:
        RuntimeError: one of torchrun's variables is missing (start the
            script with ``torchrun``).
        ValueError: a variable is not an integer, LOCAL_RANK names no CUDA
            device, or ``timeout`` is not positive.
    """
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
    kwargs = {}
    if timeout is not None:
        kwargs["timeout"] = _timedelta(timeout)
    dist.init_process_group(
        backend=backend, init_method="env://", rank=rank, world_size=world_size, **kwargs
    )
    _exit.register()  # See [Note: exit code under gloo]
    _seed_all(seed)
    logger.info(
        "%s: rank %d of %d (local rank %d), backend %s, seed %d",
        _API, rank, world_size, local_rank, backend, seed,
    )  # fmt: skip


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"{_API}: environment variable {name} must be an integer (got {value!r}); "
            "let torchrun set it"
        ) from None


def _timedelta(timeout: float | timedelta) -> timedelta:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"{_API}: timeout must be > 0 seconds (got {timeout!r})")
    return timedelta(seconds=seconds)


def _set_device(local_rank: int | None) -> None:
    if local_rank is None or not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise ValueError(
            f"{_API}: LOCAL_RANK {local_rank} names no CUDA device (got {count} devices); "
            "start at most one process per GPU (torchrun --nproc-per-node)"
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
