"""Default comparison tolerances per dtype, tolerances for low-precision
training against an fp32 reference, and a float64 ``assert_close``."""

from __future__ import annotations

import math
from typing import Any

import torch

# (rtol, atol). Floating rows follow torch.testing's defaults except float64,
# tightened to what a change of summation order costs, and float32's atol,
# tightened to the house's "fp32 paths match to about 1e-6".
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1.3e-6, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}
_EXACT = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """The default ``(rtol, atol)`` for results computed in ``dtype``.

    ========= ======== ========
    dtype     rtol     atol
    ========= ======== ========
    float64   1e-12    1e-12
    float32   1.3e-6   1e-6
    bfloat16  1.6e-2   1e-5
    float16   1e-3     1e-5
    integers  0        0
    ========= ======== ========

    Args:
        dtype: the dtype the compared values were computed in.

    Returns:
        ``(rtol, atol)``; an element passes when ``|a - e| <= atol + rtol * |e|``.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``.
        ValueError: no default for ``dtype`` (e.g. float8); pass rtol and atol.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"tolerance: dtype must be a torch.dtype (got {type(dtype).__name__}); "
            "pass e.g. torch.float32"
        )
    if dtype in _TOLERANCES:
        return _TOLERANCES[dtype]
    if dtype in _EXACT:
        return (0.0, 0.0)
    raise ValueError(
        f"tolerance: no default tolerance for this dtype (got {dtype}); "
        "pass rtol and atol explicitly"
    )


_LOW_PRECISION = (torch.float16, torch.bfloat16)
_OPTIMIZERS = ("adam", "sgd")


def training_tolerance(
    dtype: torch.dtype,
    *,
    steps: int,
    lr: float,
    optimizer: str = "adam",
    betas: tuple[float, float] = (0.9, 0.999),
    momentum: float = 0.0,
    max_grad: float | None = None,
    depth: int = 1,
) -> tuple[float, float]:
    """``(rtol, atol)`` for fp32 master weights trained ``steps`` steps in
    ``dtype`` against an fp32 reference run from the same weights and data.

    Derivation, per element, with ``eps = torch.finfo(dtype).eps``:

    * Initial rounding. The masters start from the weights as stored in
      ``dtype`` (as Gemini, DeepSpeed and Megatron build them), up to
      ``eps/2`` of ``|w0|`` away from the reference's (and up to half the
      subnormal spacing, ``finfo.tiny * eps/2``, below ``finfo.tiny``).
      Since ``|w0| <= |expected| + M``, with ``M`` the most one element can
      move in ``steps`` steps, this gives ``rtol = eps/2`` and
      ``eps/2 * (M + finfo.tiny)`` of atol.
    * Adam (AdamW, HybridAdam): ``M = lr * sum(B_t)``, ``B_t`` the largest
      bias-corrected step (1 at t=1, 1.028 at t=8 with the default betas),
      and ``atol = 2 M`` plus the rounding term, since a gradient at the
      rounding level can flip an update's sign. Strict: no machine or
      summation order can exceed it; so an element-wise comparison of Adam
      in low precision cannot see a learning rate or gradient scale wrong by
      less than about 2x; SGD shows them.
    * SGD with ``momentum`` (no dampening, no Nesterov):
      ``M = lr * max_grad * sum_t sum_{j<t} momentum**j`` and
      ``atol = eps * sqrt(depth) * M`` plus the rounding term, a first-order
      model tight enough that a 2x gradient or a missed step fail it many
      times over.

    Args:
        dtype: torch.float16 or torch.bfloat16, the dtype the run computes in.
        steps: optimizer steps taken, >= 0 (0: the initial weights).
        lr: the learning rate, > 0.
        optimizer: "adam" (Adam, AdamW, HybridAdam) or "sgd". Default "adam".
        betas: Adam's ``(beta1, beta2)``, each in [0, 1). Default (0.9, 0.999).
        momentum: SGD's momentum, in [0, 1). Default 0.0.
        max_grad: SGD: a bound on every gradient element, >= 0 (after
            clipping). Required for "sgd", unused for "adam".
        depth: roundings in ``dtype`` in sequence between a parameter and
            its gradient (forward and backward, about two per layer), >= 1.
            Default 1.

    Returns:
        ``(rtol, atol)``; an element passes when
        ``|actual - expected| <= atol + rtol * |expected|``. With lr=1e-3,
        8 steps, Adam: bfloat16 ``(3.91e-3, 1.621e-2)``, float16
        ``(4.88e-4, 1.618e-2)``.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``.
        ValueError: ``dtype`` is not float16 or bfloat16 (fp32 paths match to
            about 1e-6: use :func:`tolerance`), or another argument is out of
            range, or "sgd" without ``max_grad``.
    """
    eps = _low_precision_eps("training_tolerance", dtype)
    tiny = torch.finfo(dtype).tiny
    api = "training_tolerance"
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"{api}: steps must be an int >= 0 (got {steps!r}); pass the steps taken")
    _check_depth(api, depth)
    if not lr > 0:
        raise ValueError(f"{api}: lr must be > 0 (got {lr!r}); pass the learning rate")
    if optimizer not in _OPTIMIZERS:
        raise ValueError(
            f"{api}: optimizer must be 'adam' or 'sgd' (got {optimizer!r}); "
            "AdamW and HybridAdam are 'adam'"
        )
    if optimizer == "adam":
        return eps / 2, _adam_atol(api, steps, lr, betas, eps, tiny)
    return eps / 2, _sgd_atol(api, steps, lr, momentum, max_grad, depth, eps, tiny)


def _adam_atol(
    api: str, steps: int, lr: float, betas: tuple[float, float], eps: float, tiny: float
) -> float:
    """training_tolerance's atol for Adam.

    Adam (AdamW, HybridAdam). One step moves an element by
    ``lr * |m_hat| / (sqrt(v_hat) + eps_adam) <= lr * B_t``, where by
    Cauchy-Schwarz over the bias-corrected averages
    ``B_t = sqrt(sum_i a_i**2 / b_i)``, ``a_i = (1-b1) b1**(t-i) / (1-b1**t)``,
    ``b_i = (1-b2) b2**(t-i) / (1-b2**t)``: 1 at t=1, 1.028 at t=8 with the
    default betas (2.2 at t=100). The update is normalised per element, so
    a gradient that is itself at the rounding level (some always are, e.g.
    a token seen once) can change sign between the runs, and the two
    updates then differ by up to ``2 lr B_t``; a correct bf16 Gemini run
    was seen at 97% of that by step 2. So ``M = lr * sum(B_t)`` and
    ``atol = 2 M`` plus the rounding term. This bound is strict: no machine or
    summation order can exceed it. Decoupled weight decay only shrinks
    differences, and L2 decay is part of the gradient. The flip side: an
    element-wise comparison of Adam in low precision cannot see a learning
    rate or gradient scale wrong by less than about 2x; SGD shows them.
    """
    beta1, beta2 = betas
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"{api}: betas must each be in [0, 1) (got {betas!r})")
    movement = lr * sum(_adam_step_bound(t, beta1, beta2) for t in range(1, steps + 1))
    return 2.0 * movement + eps / 2 * (movement + tiny)


def _sgd_atol(
    api: str,
    steps: int,
    lr: float,
    momentum: float,
    max_grad: float | None,
    depth: int,
    eps: float,
    tiny: float,
) -> float:
    """training_tolerance's atol for SGD.

    SGD with ``momentum`` (no dampening, no Nesterov). A step moves an
    element by ``lr * |buf_t|``, ``|buf_t| <= G * sum_{j<t} momentum**j``,
    where ``G = max_grad`` bounds every gradient element so far (the clip
    ``max_norm`` always does; the largest element the fp32 reference saw
    is tighter). A gradient computed through ``depth`` roundings in
    sequence, each of relative size up to ``eps``, independent and so
    adding in quadrature, is off by ``delta = eps * sqrt(depth)`` of its
    scale ``G`` -- the error a loss computed in ``dtype`` carries too
    (:func:`loss_tolerance`). SGD is linear in the gradient, so each step
    adds at most ``delta`` of its own size: with
    ``M = lr * G * sum_t sum_{j<t} momentum**j``, ``atol = delta * M`` plus
    the rounding term.
    This is a first-order model (differences do not grow through the
    curvature over a few steps), tight enough that a 2x gradient or a
    missed step, which differ by whole updates, fail it many times over.
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"{api}: momentum must be in [0, 1) (got {momentum!r})")
    if max_grad is None or not max_grad >= 0:
        raise ValueError(
            f"{api}: optimizer 'sgd' needs max_grad >= 0, a bound on every gradient element "
            f"(got {max_grad!r}); pass the clip max_norm or the fp32 reference's largest gradient"
        )
    velocity = sum(sum(momentum**j for j in range(t)) for t in range(1, steps + 1))
    movement = lr * max_grad * velocity
    return eps * math.sqrt(depth) * movement + eps / 2 * (movement + tiny)


def loss_tolerance(dtype: torch.dtype, *, depth: int = 1) -> tuple[float, float]:
    """``(rtol, atol)`` for a loss computed in ``dtype`` against an fp32 one.

    Each of the ``depth`` roundings in sequence from the parameters to the
    loss adds up to ``eps`` (``torch.finfo(dtype).eps``) relative error;
    independent errors add in quadrature: ``rtol = eps * sqrt(depth)``,
    ``atol = 0``. After training steps the parameters differ too (see
    :func:`training_tolerance`), but only where the gradient is at rounding
    level (Adam) or by ``eps * sqrt(depth)`` of each update (SGD), which
    moves the loss by that share of how far it has fallen: well inside.

    Args:
        dtype: torch.float16 or torch.bfloat16.
        depth: roundings in sequence between the parameters and the loss, >= 1.
            Default 1.

    Returns:
        ``(rtol, atol)``, as :func:`tolerance`.

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``.
        ValueError: ``dtype`` is not float16 or bfloat16, or ``depth`` < 1.
    """
    eps = _low_precision_eps("loss_tolerance", dtype)
    _check_depth("loss_tolerance", depth)
    return eps * math.sqrt(depth), 0.0


def _low_precision_eps(api: str, dtype: torch.dtype) -> float:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"{api}: dtype must be a torch.dtype (got {type(dtype).__name__}); "
            "pass torch.bfloat16 or torch.float16"
        )
    if dtype not in _LOW_PRECISION:
        raise ValueError(
            f"{api}: dtype must be torch.float16 or torch.bfloat16 (got {dtype}); "
            "fp32 paths match to about 1e-6: use tolerance(torch.float32)"
        )
    return torch.finfo(dtype).eps


def _check_depth(api: str, depth: int) -> None:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(
            f"{api}: depth must be an int >= 1 (got {depth!r}); "
            "count the roundings in sequence, about two per layer"
        )


def _adam_step_bound(t: int, beta1: float, beta2: float) -> float:
    """Largest ``|m_hat / sqrt(v_hat)|`` at step ``t`` over all gradient histories."""
    total = 0.0
    for i in range(1, t + 1):
        a = (1 - beta1) * beta1 ** (t - i) / (1 - beta1**t)
        b = (1 - beta2) * beta2 ** (t - i) / (1 - beta2**t)
        total += a * a / b
    return math.sqrt(total)


def assert_close(
    actual: Any,
    expected: Any,
    *,
    dtype: torch.dtype | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    msg: str = "",
) -> None:
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` element-wise.

    Both sides are cast to float64 on the CPU before comparing, so a bf16 result
    can be checked against an fp32 reference. NaN never matches (not even NaN);
    infinities match only themselves. Complex tensors are refused: compare
    ``torch.view_as_real`` of each.

    Args:
        actual: a tensor, number or nested list.
        expected: the same shape as ``actual``.
        dtype: picks the default tolerance (see :func:`tolerance`). Default None:
            ``actual``'s dtype, float64 for Python numbers.
        rtol: overrides the default relative tolerance. Default None.
        atol: overrides the default absolute tolerance. Default None.
        msg: put first in the failure message. Default "".

    Raises:
        TypeError: a side is complex.
        AssertionError: shapes differ, or some element is out of tolerance; the
            message gives the count of mismatches, the greatest absolute and
            relative errors with their indices and values, and ``msg``.
    """
    a = _as_tensor(actual)
    e = _as_tensor(expected)
    if a.is_complex() or e.is_complex():
        raise TypeError(
            f"assert_close: complex tensors are not supported (got {a.dtype} and {e.dtype}); "
            "compare torch.view_as_real(actual) with torch.view_as_real(expected)"
        )
    default_rtol, default_atol = tolerance(a.dtype if dtype is None else dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    prefix = f"{msg}\n" if msg else ""
    if a.shape != e.shape:
        raise AssertionError(
            f"{prefix}assert_close: shapes differ (got actual {tuple(a.shape)}, "
            f"expected {tuple(e.shape)})"
        )
    a64 = a.detach().to(device="cpu", dtype=torch.float64)
    e64 = e.detach().to(device="cpu", dtype=torch.float64)
    abs_err = (a64 - e64).abs()
    # An infinite expected value is matched only by itself (its bound is infinite).
    ok = torch.where(e64.isfinite(), abs_err <= atol + rtol * e64.abs(), a64 == e64)
    if bool(ok.all()):
        return
    num_bad = int((~ok).sum())
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    abs_err = torch.where(ok, 0.0, torch.where(abs_err.isnan(), inf, abs_err))
    rel_err = abs_err / e64.abs()
    rel_err = torch.where(ok, 0.0, torch.where(rel_err.isnan(), inf, rel_err))
    worst_abs = _unravel(int(abs_err.argmax()), a64.shape)
    worst_rel = _unravel(int(rel_err.argmax()), a64.shape)
    raise AssertionError(
        f"{prefix}assert_close: {num_bad} of {a64.numel()} elements differ beyond "
        f"rtol={rtol:g}, atol={atol:g}\n"
        f"  max abs error {float(abs_err[worst_abs]):.6g} at index {worst_abs} "
        f"(actual {float(a64[worst_abs]):.10g}, expected {float(e64[worst_abs]):.10g})\n"
        f"  max rel error {float(rel_err[worst_rel]):.6g} at index {worst_rel} "
        f"(actual {float(a64[worst_rel]):.10g}, expected {float(e64[worst_rel]):.10g})"
    )


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.as_tensor(value, dtype=torch.float64)


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))
