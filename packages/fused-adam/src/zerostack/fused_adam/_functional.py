"""``adam_update``: one Adam/AdamW update of given tensors, without an
optimizer object (as torch's functional ``torch.optim.adamw.adamw``), on the
kernel of their device: the CPU kernel that CPUAdam runs, or the CUDA
multi-tensor kernel that FusedAdam runs.

For a wrapper that keeps the states itself and steps a copy of them
elsewhere (ZeroOptimizer's ``gpu_update_fraction`` streams host-held masters
and states to the GPU and steps them there), with the same math, argument
checks and kernels as the optimizers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerostack.fused_adam._adam import _SUPPORTED_DTYPES, _check_flags, _check_hyper, _launcher

_API = "adam_update"


def _check_tensors(
    params: Sequence[torch.Tensor], others: dict[str, Sequence[torch.Tensor]]
) -> None:
    if not params:
        raise ValueError(f"{_API}: params is empty (got {params!r}); pass at least one tensor")
    device, n = params[0].device, len(params)
    for name, tensors in {"params": params, **others}.items():
        if len(tensors) != n:
            raise ValueError(
                f"{_API}: {name} holds {len(tensors)} tensors, params {n}; pass one per parameter"
            )
        dtypes = {t.dtype for t in tensors}
        fp32_only = name in ("exp_avgs", "exp_avg_sqs")
        allowed = (torch.float32,) if fp32_only else _SUPPORTED_DTYPES
        if len(dtypes) != 1 or not dtypes <= set(allowed):
            raise TypeError(
                f"{_API}: {name} must share one dtype among {[str(d) for d in allowed]} (got "
                f"{sorted(map(str, dtypes))}); call it once per dtype"
            )
        for i, (p, t) in enumerate(zip(params, tensors, strict=True)):
            if t.device != device or t.numel() != p.numel() or not t.is_contiguous():
                raise ValueError(
                    f"{_API}: {name}[{i}] must be a contiguous tensor of {p.numel()} elements "
                    f"on {device} (got {t.numel()} elements on {t.device}, contiguous="
                    f"{t.is_contiguous()})"
                )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{_API}: tensors on {device} (got {device.type}); use the CPU or CUDA")


def adam_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: float,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    div_scale: float = -1.0,
    outs: Sequence[torch.Tensor] | None = None,
) -> None:
    """Update ``params``, ``exp_avgs`` and ``exp_avg_sqs`` in place, as one
    ``CPUAdam.step`` (CPU tensors) or ``FusedAdam.step`` (CUDA tensors, on the
    current stream) would at Adam step ``step``, with the same results.

    Args:
        params: the parameters, one device and one dtype (fp32, fp16, bf16).
        grads: their gradients, one dtype.
        exp_avgs, exp_avg_sqs: their fp32 moments.
        step: the step count after this update (``state["step"]`` of the
            optimizers once bumped), >= 1.
        lr, betas, eps, weight_decay, adamw_mode, bias_correction: as the
            optimizers take them. Defaults 1e-3, (0.9, 0.999), 1e-8, 0.0,
            True, True.
        div_scale: when > 0, gradients are divided by it first. Default -1.0.
        outs: where the updated parameters are also written (a fused
            copy-out, e.g. in fp16/bf16), one dtype; None for none. Default None.

    Raises:
        ValueError: tensors of other sizes, devices or layouts, a step < 1, or
            a bad hyperparameter.
        TypeError: an unsupported or mixed dtype, a non-number.
        RuntimeError: CUDA tensors with no CUDA kernel in this install.
    """
    others = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if outs is not None:
        others["outs"] = outs
    _check_tensors(params, others)
    _check_hyper(_API, lr, betas, eps, weight_decay)
    _check_flags(_API, adamw_mode=adamw_mode, bias_correction=bias_correction)
    if isinstance(step, bool) or not isinstance(step, int | float) or not step >= 1:
        raise ValueError(f"{_API}: step must be a number >= 1 (got {step!r}); count from 1")
    if isinstance(div_scale, bool) or not isinstance(div_scale, int | float):
        raise TypeError(f"{_API}: div_scale must be a number (got {div_scale!r})")
    group = dict(
        lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
        bias_correction=bias_correction,
    )  # fmt: skip
    launch = _launcher(group, 1.0 / div_scale if div_scale > 0 else 1.0)
    no_outs: list[torch.Tensor | None] = [None] * len(params)
    items = list(zip(params, grads, exp_avgs, exp_avg_sqs, outs or no_outs, strict=True))
    launch(items, float(step))
