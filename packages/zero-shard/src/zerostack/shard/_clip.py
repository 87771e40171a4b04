"""Gradient norms and clipping over shards: accumulated in fp32, one
all-reduce, one host read.

[Note: gradient clipping] Every wrapper clips the way torch's
``clip_grad_norm_`` does on the whole gradients before the step: the
p-norm ``N`` of all gradients together, each multiplied by
``min(1, max_norm / (N + 1e-6))``. Here ``N`` comes from the pieces each
rank holds (ZeRO's reduced pieces, Gemini's chunk shards, on the device or
the host): per tensor its p-norm in fp32 (bf16/fp16 gradients are not
rounded to their dtype on the way, as ``torch._foreach_norm`` without a
dtype would), this rank's part (sum of p-th powers, or the max for inf)
summed over ranks in one all-reduce, read once. fp16 gradients are divided
by the loss scale first. ZeroOptimizer and GeminiOptimizer do not rewrite
the gradients when ``clip_grad_by_norm`` is called: they record the
coefficient, and the step divides by it together with the loss scale
(``div_scale``), so a clip costs no pass over the gradients. A second call
before the step sees the gradients as the first left them (its norm is the
first's times its coefficient) and the coefficients multiply, as two calls
of torch's would. The wrapper's own ``max_norm`` (clipping at step) then
clips what the explicit calls left: the step's factor is ``c * min(1,
max_norm / (c * N2 + 1e-6))`` for the recorded ``c`` and the 2-norm ``N2``
of the unclipped gradients, as if torch's clip ran once more at the step.
A non-finite norm clips nothing (see [Note: overflow policy]: fp16 skips
the step, bf16/fp32 apply the gradients as they are).
"""

from __future__ import annotations

import math

import torch

from zerostack.chunk import all_reduce_max, all_reduce_sum, set_collective_label


def grad_stats(
    shards: list[torch.Tensor], extra: torch.Tensor, group, norm_sq: torch.Tensor | None = None
) -> list[float]:
    """Sum over ranks of [squared L2 norm of ``shards``, *extra], read once.

    Per-shard norms stay on the device, in fp32 whatever the shards' dtype;
    they, and ``extra`` (e.g. per-parameter "had a gradient" flags), travel
    in one all-reduce, and the result reaches the host in one read. An inf
    or nan anywhere makes the norm non-finite on every rank, which is how
    overflow is detected. ``norm_sq``, when given, is this rank's squared
    norm already summed on the device (``shards`` unused).
    """
    if not isinstance(extra, torch.Tensor):
        raise TypeError(f"grad_stats: extra must be a tensor (got {type(extra).__name__})")
    if not all(isinstance(t, torch.Tensor) for t in shards):
        raise TypeError(
            f"grad_stats: shards must be tensors (got {[type(t).__name__ for t in shards][:4]})"
        )
    device = extra.device
    norm_sq = norm_sq.float().to(device) if norm_sq is not None else norm_part(shards, 2.0, device)
    packed = torch.cat([norm_sq.view(1), extra.float()])
    set_collective_label("the step's gradient norm and overflow check")
    all_reduce_sum(packed, group)
    return packed.tolist()


def norm_part(tensors: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's part of the p-norm of ``tensors`` as a 0-dim fp32 tensor
    on ``device``: the sum of ``|g|**p`` (so parts add up over ranks), or the
    largest ``|g|`` for ``inf``. Tensors may sit on several devices (some
    offloaded to the host): each norm comes to ``device`` before they are
    combined. No host read. See [Note: gradient clipping]."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:  # one foreach call per device keeps its fast path
        by_device.setdefault(t.device, []).append(t)
    norms = [
        n.to(device)
        for group in by_device.values()
        for n in torch._foreach_norm(group, norm_type, dtype=torch.float32)
    ]
    stacked = torch.stack(norms)
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum()


def reduce_norm(part: torch.Tensor, norm_type: float, group, *, sharded: bool = True) -> float:
    """The p-norm from this rank's :func:`norm_part` and, when ``sharded``,
    the other ranks' (one all-reduce: a sum, or a max for inf); without
    ``sharded`` every rank holds the same whole gradients (DDP). One host
    read."""
    if sharded:
        set_collective_label("the gradient norm of clip_grad_by_norm")
        if math.isinf(norm_type):
            all_reduce_max(part, group)
        else:
            all_reduce_sum(part, group)
    value = part.item()
    if math.isinf(norm_type) or not math.isfinite(value):
        return value
    return value ** (1.0 / norm_type)


def check_max_norm(api: str, max_norm: object, name: str = "max_norm") -> None:
    """The check of a wrapper's or plugin's ``max_norm`` setting, where 0
    turns clipping off (``name``: the argument's name there, e.g.
    AMPOptimizer's ``clipping_norm``).

    Raises:
        TypeError: not a number.
        ValueError: negative or nan.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float):
        raise TypeError(f"{api}: {name} must be a number (got {max_norm!r}); 0 turns clipping off")
    if not max_norm >= 0:
        raise ValueError(f"{api}: {name} must be >= 0 (got {max_norm}); 0 turns clipping off")


def check_clip_args(
    api: str, max_norm: object, norm_type: object, error_if_nonfinite: object = False
) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats, as torch's ``clip_grad_norm_``
    takes them (``norm_type`` may be ``"inf"``).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``max_norm`` not > 0 (0 would zero every gradient in
            torch's clip), ``norm_type`` not > 0, or nan.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, int | float):
        raise TypeError(f"{api}: max_norm must be a number (got {max_norm!r}); e.g. max_norm=1.0")
    if not max_norm > 0:
        raise ValueError(
            f"{api}: max_norm must be > 0 (got {max_norm}); torch's clip_grad_norm_ would zero "
            "every gradient at 0; pass float('inf') to read the norm without clipping"
        )
    if isinstance(norm_type, str) and norm_type.lower() == "inf":
        norm_type = math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, int | float):
        raise TypeError(
            f"{api}: norm_type must be a number or 'inf' (got {norm_type!r}); e.g. norm_type=2.0"
        )
    if not norm_type > 0:
        raise ValueError(
            f"{api}: norm_type must be > 0 or inf (got {norm_type}); 2.0 is the Euclidean norm"
        )
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"{api}: error_if_nonfinite must be a bool (got {error_if_nonfinite!r})")
    return float(max_norm), float(norm_type)


def check_finite(api: str, total_norm: float, norm_type: float) -> None:
    """torch's ``error_if_nonfinite=True``: a non-finite norm is an error."""
    if not math.isfinite(total_norm):
        raise RuntimeError(
            f"{api}: the total norm of order {norm_type} of the gradients is non-finite (got "
            f"{total_norm}), so it cannot be clipped; pass error_if_nonfinite=False to step "
            "anyway (fp16: the step is skipped and the loss scale backs off)"
        )


def clip_grads_(
    api: str,
    grads: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    device: torch.device,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` on whole gradients that every rank holds
    alike (DDP's all-reduced ``.grad``), in place, the norm accumulated in
    fp32 (see [Note: gradient clipping]). Returns the total norm (fp32)."""
    total = reduce_norm(norm_part(grads, norm_type, device), norm_type, None, sharded=False)
    if error_if_nonfinite:
        check_finite(api, total, norm_type)
    coef = clip_coefficient(total, max_norm)
    if coef < 1.0 and grads:
        torch._foreach_mul_(grads, coef)  # a Python scalar: applied in fp32 to bf16/fp16 grads
    return torch.tensor(total, dtype=torch.float32, device=device)


def record_clip(
    api: str,
    part: torch.Tensor,
    *,
    max_norm: float,
    norm_type: float,
    group,
    scale: float = 1.0,
    applied: float = 1.0,
    error_if_nonfinite: bool = False,
) -> tuple[torch.Tensor, float]:
    """``clip_grad_by_norm`` of a sharded wrapper, without touching the
    gradients: their norm as torch would return it, and the coefficient the
    step must apply. ``part`` is this rank's :func:`norm_part` of its
    pieces (multiplied by the loss ``scale``), ``applied`` what earlier
    calls since the last step recorded. See [Note: gradient clipping].

    Returns:
        (the total norm of the gradients as the earlier calls left them, a
        0-dim fp32 tensor on ``part``'s device; the coefficient to record).
    """
    device = part.device
    total = reduce_norm(part, norm_type, group) / scale
    if math.isfinite(total):
        total *= applied
    if error_if_nonfinite:
        check_finite(api, total, norm_type)
    coef = applied * clip_coefficient(total, max_norm)
    return torch.tensor(total, dtype=torch.float32, device=device), coef


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor that brings ``total_norm`` down to ``max_norm`` (1 when
    clipping is off or not needed).

    Raises:
        TypeError: an argument is not a number.
        ValueError: ``max_norm`` < 0 or nan, or ``total_norm`` < 0.
    """
    if isinstance(total_norm, bool) or not isinstance(total_norm, int | float):
        raise TypeError(f"clip_coefficient: total_norm must be a number (got {total_norm!r})")
    check_max_norm("clip_coefficient", max_norm)
    if total_norm < 0:
        raise ValueError(f"clip_coefficient: total_norm is a norm, >= 0 (got {total_norm})")
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
