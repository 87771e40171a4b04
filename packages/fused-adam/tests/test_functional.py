"""``adam_update``: the optimizers' kernels without an optimizer object,
bitwise equal to ``CPUAdam.step`` over the same tensors (and, on CUDA, to
``FusedAdam.step``), the CUDA kernel bitwise equal to the CPU kernel, and
refusing what the kernels cannot take."""

from __future__ import annotations

import pytest
import torch

from zerostack.fused_adam import CPUAdam, FusedAdam, adam_update, cuda_kernel_available

HYPER = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)


def _tensors(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(device, dtype) for n in (37, 1000)]
    grads = [
        [torch.randn(p.numel(), generator=g).to(device, dtype) for p in params] for _ in range(3)
    ]
    return params, grads


def _against_optimizer(kind, device, dtype, adamw_mode):
    params, grads = _tensors(device, dtype)
    mine = [p.clone() for p in params]
    m = [torch.zeros(p.numel(), device=device) for p in params]
    v = [torch.zeros(p.numel(), device=device) for p in params]
    outs = [torch.empty(p.numel(), device=device, dtype=torch.bfloat16) for p in params]
    ref_outs = [o.clone() for o in outs]
    opt = kind(params, adamw_mode=adamw_mode, **HYPER)
    for p, o in zip(params, ref_outs, strict=True):
        opt.set_copy_out(p, o)
    for step, gs in enumerate(grads, start=1):
        for p, g in zip(params, gs, strict=True):
            p.grad = g
        opt.step(div_scale=4.0)
        adam_update(mine, gs, m, v, step=step, adamw_mode=adamw_mode, div_scale=4.0, outs=outs,
                    **HYPER)  # fmt: skip
    for i, p in enumerate(params):
        assert torch.equal(p, mine[i]) and torch.equal(outs[i], ref_outs[i])
        assert torch.equal(opt.state[p]["exp_avg"], m[i])
        assert torch.equal(opt.state[p]["exp_avg_sq"], v[i])


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_cpu_adam_bitwise(dtype, adamw_mode):
    _against_optimizer(CPUAdam, "cpu", dtype, adamw_mode)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not cuda_kernel_available(), reason="needs the CUDA kernel"
)
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "l2"])
def test_matches_fused_adam_bitwise_on_cuda(adamw_mode):
    _against_optimizer(FusedAdam, "cuda", torch.float32, adamw_mode)


def _spread(n, dtype, g):
    """n values over twelve decades, signs mixed, some exactly zero: the
    operations' rounding shows everywhere, small moments included."""
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-8, 4, (n,), generator=g)
    x[torch.rand(n, generator=g) < 0.01] = 0.0
    return x.to(dtype)


def _steps_on(device, pdt, gdt, odt, adamw_mode, sizes):
    g = torch.Generator().manual_seed(1)
    params = [_spread(n, pdt, g).to(device) for n in sizes]
    start = params[-1].cpu().clone()
    m = [torch.zeros(n, device=device) for n in sizes]
    v = [torch.zeros(n, device=device) for n in sizes]
    outs = None if odt is None else [torch.empty(n, device=device, dtype=odt) for n in sizes]
    for step, lr in enumerate((3e-3, 1e-2, 7e-4, 2e-2), start=1):
        grads = [_spread(n, gdt, g).to(device) for n in sizes]
        adam_update(
            params, grads, m, v, step=step, lr=lr, betas=(0.9, 0.999), eps=1e-8,
            weight_decay=0.05, adamw_mode=adamw_mode, div_scale=3.0, outs=outs,
        )  # fmt: skip
    return start, [t.cpu() for t in (*params, *m, *v, *(outs or []))]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not cuda_kernel_available(), reason="needs the CUDA kernel"
)
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize(
    ("pdt", "gdt", "odt"),
    [
        (torch.float32, torch.float32, None),
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16, None),
        (torch.float16, torch.float32, torch.float32),
    ],
)
def test_the_cuda_kernel_gives_the_cpu_kernels_bits(pdt, gdt, odt, adamw_mode):
    # The same operations in the same order on both devices (adam_math.h), so
    # a share of the updates can move to the GPU (gpu_update_fraction) without
    # changing the result: parameters, moments and copy-outs equal bit for bit
    # over four steps, sizes that take both kernels' vector bodies and tails.
    sizes = (1, 37, 1000, 3 * 2**16 + 5)
    start, cpu = _steps_on("cpu", pdt, gdt, odt, adamw_mode, sizes)
    _, cuda = _steps_on("cuda", pdt, gdt, odt, adamw_mode, sizes)
    assert (cpu[len(sizes) - 1] != start).float().mean() > 0.5  # the steps moved the parameters
    for i, (a, b) in enumerate(zip(cpu, cuda, strict=True)):
        assert torch.equal(a, b), f"tensor {i}: {(a != b).sum().item()} elements differ"


def _call(**change):
    p = [torch.zeros(4)]
    args = dict(params=p, grads=[torch.zeros(4)], exp_avgs=[torch.zeros(4)],
                exp_avg_sqs=[torch.zeros(4)], step=1)  # fmt: skip
    args.update(change)
    adam_update(**args)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(params=[]), ValueError, r"params is empty"),
        (dict(grads=[]), ValueError, r"grads holds 0 tensors, params 1"),
        (dict(grads=[torch.zeros(3)]), ValueError, r"grads\[0\] must be a contiguous tensor of 4"),
        (dict(exp_avgs=[torch.zeros(4, dtype=torch.bfloat16)]), TypeError, r"exp_avgs must share"),
        (dict(grads=[torch.zeros(4, dtype=torch.int32)]), TypeError, r"grads must share one dtype"),
        (dict(step=0), ValueError, r"step must be a number >= 1 \(got 0\)"),
        (dict(lr=-1.0), ValueError, r"lr must be >= 0"),
        (dict(adamw_mode=1), TypeError, r"adamw_mode must be a bool"),
        (dict(div_scale="2"), TypeError, r"div_scale must be a number"),
        (dict(outs=[torch.zeros(5)]), ValueError, r"outs\[0\] must be a contiguous tensor of 4"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_inputs_raise_before_anything_changes(change, error, match):
    with pytest.raises(error, match=match):
        _call(**change)
