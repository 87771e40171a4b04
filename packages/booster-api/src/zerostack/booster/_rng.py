"""Every random number generator a training step draws from, captured and
restored per rank: Python's ``random``, numpy's global generator (when numpy
is installed), torch's CPU generator and every CUDA device's.

The captured state holds only what ``torch.load(weights_only=True)`` reads
back (tensors, ints, tuples, strings): numpy's key array becomes a tensor.
"""

from __future__ import annotations

import random
from typing import Any

import torch

_API = "load_rng_state"


def _numpy():
    try:
        import numpy as np
    except ImportError:
        return None
    return np


def rng_state() -> dict[str, Any]:
    """This process's generator states: ``{"python", "numpy", "torch", "cuda"}``
    (``numpy`` None without numpy, ``cuda`` an empty list without CUDA)."""
    np = _numpy()
    numpy_state = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        numpy_state = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "python": random.getstate(),
        "numpy": numpy_state,
        "torch": torch.get_rng_state(),
        "cuda": list(cuda),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured.

    Raises:
        ValueError: ``state`` is not what rng_state() returns, or it holds
            CUDA states for another number of devices.
    """
    if not isinstance(state, dict) or not {"python", "torch"} <= set(state):
        raise ValueError(
            f"{_API}: state must be what rng_state() returned (got "
            f"{sorted(state) if isinstance(state, dict) else type(state).__name__})"
        )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np = _numpy()
    saved_np = state.get("numpy")
    if np is not None and saved_np is not None:
        np.random.set_state(
            (
                saved_np["kind"],
                saved_np["keys"].numpy().astype(np.uint32),
                saved_np["pos"],
                saved_np["has_gauss"],
                saved_np["cached_gaussian"],
            )
        )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"{_API}: the state holds {len(cuda)} CUDA generators, this process sees "
                f"{torch.cuda.device_count()} devices; resume with the same devices per process"
            )
        torch.cuda.set_rng_state_all(cuda)
