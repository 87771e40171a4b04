"""Loading and launching the compiled Adam kernels.

Both modules are torch-free (see [Note: torch-free kernels]); this module
turns tensors into the pointers, element counts and dtype codes they take.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from importlib.machinery import EXTENSION_SUFFIXES
from typing import Any

import torch

logger = logging.getLogger(__name__)

# [Note: torch-free kernels]
# The compiled modules never see a torch header: Python validates devices,
# dtypes, shapes and contiguity (_adam.py) and passes data_ptr()s here. That
# keeps `pip install` free of torch at build time and lets one build serve
# every torch version. The dtype codes below are the ones in csrc/*.
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
SIMD_ENV = "ZEROSTACK_CPU_ADAM_SIMD"
THREADS_ENV = "ZEROSTACK_CPU_THREADS"
SCHEDULE_ENV = "ZEROSTACK_CPU_ADAM_SCHEDULE"
_logged_threads: list[int] = []


def cpu_threads() -> int:
    """Threads the CPU kernel uses.

    [Note: CPU threads per rank] ``$ZEROSTACK_CPU_THREADS`` when set; else
    ``torch.get_num_threads()``, which follows the user's
    ``torch.set_num_threads`` / ``OMP_NUM_THREADS`` — except torchrun's
    default: torchrun sets ``OMP_NUM_THREADS=1`` for every rank, which left
    the CPU Adam of each rank on one core (Gemini with the optimizer on the
    CPU fell from 13.0k to 5.9k tokens/s per GPU at 2 ranks). Under torchrun
    (``LOCAL_WORLD_SIZE`` set) with one thread from ``OMP_NUM_THREADS=1``,
    the kernel takes the cores this process may run on divided by the ranks
    on the host, and says so once. A user who really wants one thread sets
    ``ZEROSTACK_CPU_THREADS=1``.
    """
    env = os.environ.get(THREADS_ENV)
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{THREADS_ENV} must be an int >= 1 (got {env!r})")
        return n
    n = torch.get_num_threads()
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if n == 1 and local.isdigit() and int(local) >= 1 and os.environ.get("OMP_NUM_THREADS") == "1":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        n = max(1, (cores or 1) // int(local))
        if not _logged_threads:
            _logged_threads.append(n)
            logger.info(
                "CPU Adam: %d threads per rank (%d cores / %s ranks on this host; torchrun's "
                "OMP_NUM_THREADS=1 is not taken for the optimizer, set %s to choose)",
                n, cores, local, THREADS_ENV,
            )  # fmt: skip
    return n


def _import_error(name: str, error: ImportError) -> str:
    """Why kernel module ``name`` did not load: one never built, or built for
    another Python, says so (Python's own text blames a circular import)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        built = sorted(f for f in os.listdir(here) if f.startswith(name + "."))
    except OSError:
        return str(error)
    if not built:
        return f"no compiled module {name} in {here}"
    if not any(f == name + suffix for f in built for suffix in EXTENSION_SUFFIXES):
        return f"{name} in {here} was built for another Python (found {', '.join(built)})"
    return str(error)


# The import errors are kept as text: an exception kept whole keeps its
# traceback, whose frames reach whatever imported this module first (a
# ZeroOptimizer being built, say), and that object would never be freed.
try:
    from zerostack.fused_adam import _adam_cpu as _cpu  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - only a broken install gets here
    _cpu = None
    _cpu_error: str | None = _import_error("_adam_cpu", exc)
else:
    _cpu_error = None

try:
    from zerostack.fused_adam import _adam_cuda as _cuda  # type: ignore[attr-defined]
except ImportError as exc:
    _cuda = None
    _cuda_error: str | None = _import_error("_adam_cuda", exc)
else:
    _cuda_error = None


def _require_cpu() -> Any:
    if _cpu is None:
        raise RuntimeError(
            f"zerostack.fused_adam: the CPU kernel failed to load ({_cpu_error}); "
            "reinstall with `pip install --force-reinstall zerostack-fused-adam`"
        )
    return _cpu


def cuda_kernel_available() -> bool:
    """True when the CUDA kernel was compiled into this install."""
    return _cuda is not None


def require_cuda(api: str) -> Any:
    if _cuda is None:
        raise RuntimeError(
            f"{api}: the CUDA kernel is not part of this install ({_cuda_error}); "
            "it is compiled only where nvcc is found at install time: reinstall with "
            "nvcc on PATH and ZEROSTACK_BUILD_CUDA=1 "
            "(`ZEROSTACK_BUILD_CUDA=1 pip install --force-reinstall zerostack-fused-adam`)"
        )
    return _cuda


def set_simd_level(name: str) -> None:
    """Force the CPU kernel's SIMD level: "avx512", "avx2" or "scalar"."""
    _require_cpu().set_simd_level(name)
    logger.info("CPU Adam: SIMD level set to %s", name)


def set_cpu_schedule(name: str) -> None:
    """How the CPU kernel's threads share a step's blocks: "dynamic" (the
    default: each free thread takes the next block) or "static" (a fixed
    share each, the kernel before 2026-12-03, kept for measuring). Both give
    the same bits; see the Note in ``csrc/adam_cpu.cpp``, [Note: CPU Adam's
    blocks go to whichever thread is free]."""
    _require_cpu().set_schedule(name)
    logger.info("CPU Adam: schedule set to %s", name)


def available_simd_levels() -> list[str]:
    """The SIMD levels this CPU can run, best first."""
    return list(_require_cpu().supported_levels())


def backend_info() -> dict[str, Any]:
    """What the kernels will use: SIMD level, threads and whether CUDA is built."""
    cpu = _require_cpu()
    return {
        "cpu_simd": cpu.simd_level(),
        "cpu_simd_available": list(cpu.supported_levels()),
        "cpu_schedule": cpu.schedule(),
        "cpu_threads": cpu_threads(),
        "cuda_kernel": _cuda is not None,
    }


if _cpu is not None and os.environ.get(SIMD_ENV):
    # An explicit request that cannot be met is an error, not a silent fallback.
    try:
        set_simd_level(os.environ[SIMD_ENV].strip().lower())
    except ValueError as exc:
        raise ValueError(f"{SIMD_ENV}={os.environ[SIMD_ENV]!r}: {exc}") from None
if _cpu is not None and os.environ.get(SCHEDULE_ENV):
    try:
        set_cpu_schedule(os.environ[SCHEDULE_ENV].strip().lower())
    except ValueError as exc:
        raise ValueError(f"{SCHEDULE_ENV}={os.environ[SCHEDULE_ENV]!r}: {exc}") from None


def _ptrs(tensors: Sequence[torch.Tensor]) -> list[int]:
    return [t.data_ptr() for t in tensors]


def launch(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor] | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction1: float,
    bias_correction2: float,
    adamw_mode: bool,
    grad_scale: float,
) -> None:
    """One kernel call over tensors that share a device and dtypes.

    The caller has validated everything (see [Note: torch-free kernels]).
    """
    device = params[0].device
    common = dict(
        params=_ptrs(params),
        grads=_ptrs(grads),
        exp_avgs=_ptrs(exp_avgs),
        exp_avg_sqs=_ptrs(exp_avg_sqs),
        outs=_ptrs(outs) if outs else [],
        numels=[p.numel() for p in params],
        param_dtype=DTYPE_CODES[params[0].dtype],
        grad_dtype=DTYPE_CODES[grads[0].dtype],
        out_dtype=DTYPE_CODES[outs[0].dtype] if outs else -1,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        bias_correction1=bias_correction1,
        bias_correction2=bias_correction2,
        adamw_mode=adamw_mode,
        grad_scale=grad_scale,
    )
    if device.type == "cpu":
        _require_cpu().adam_step(**common, num_threads=cpu_threads())
    else:
        cuda = require_cuda("FusedAdam")
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device).cuda_stream
            cuda.multi_tensor_adam(stream, *common.values())
