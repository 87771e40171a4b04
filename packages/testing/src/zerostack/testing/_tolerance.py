"""Default comparison tolerances per dtype, and a float64 ``assert_close``."""

from __future__ import annotations

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
