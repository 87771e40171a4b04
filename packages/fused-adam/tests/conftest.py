from __future__ import annotations

import pytest
import torch

from zerostack.fused_adam import CPUAdam, available_simd_levels, backend_info, set_simd_level

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Per-step rounding of a low-precision parameter can land one ulp apart from
# the float64 reference; anything beyond that is a bug.
PARAM_TOL = {
    torch.float32: dict(rtol=2e-6, atol=2e-6),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}
# Gradients in the tests are ~30, so fp32 rounding of the moments is ~1e-5.
STATE_TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture(params=available_simd_levels())
def simd_level(request):
    before = backend_info()["cpu_simd"]
    set_simd_level(request.param)
    yield request.param
    set_simd_level(before)


class Reference:
    """torch.optim.AdamW (or Adam in L2 mode) in float64, with the parameter
    rounded to its storage dtype after every step, as the kernels store it."""

    def __init__(self, params, *, adamw_mode, bias_correction=True, **hyper):
        self.dtypes = [p.dtype for p in params]
        self.params = [p.detach().double().clone().requires_grad_() for p in params]
        if not bias_correction:
            raise NotImplementedError("torch has no switch for it; use reference_no_bias")
        cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        self.opt = cls(self.params, foreach=False, **hyper)

    def step(self, grads, div_scale=-1.0):
        for p, g in zip(self.params, grads, strict=True):
            g = g.double()
            p.grad = g / div_scale if div_scale > 0 else g
        self.opt.step()
        with torch.no_grad():
            for p, dt in zip(self.params, self.dtypes, strict=True):
                p.copy_(p.to(dt).double())


def adam_no_bias_correction(p, g, m, v, *, lr, betas, eps, weight_decay, adamw_mode):
    """One float64 step without bias correction (torch has no switch for it)."""
    b1, b2 = betas
    if not adamw_mode:
        g = g + weight_decay * p
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    if adamw_mode:
        p.mul_(1 - lr * weight_decay)
    p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)


def set_grad(p, g):
    """Attach a gradient whose dtype may differ from the parameter's."""
    if g.dtype != p.dtype and hasattr(p, "grad_dtype"):
        p.grad_dtype = None  # torch >= 2.10 pins grad dtype unless told not to
    p.grad = g


SIZES = [1, 7, 4097]
STEPS = 10
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)


def make_params(sizes, pdt, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(pdt) for n in sizes]


def make_grads(params, gdt, step):
    gen = torch.Generator().manual_seed(1000 + step)
    # Large gradients, so that an ignored div_scale cannot hide behind Adam's
    # scale invariance in L2 mode.
    return [(torch.randn(p.shape, generator=gen) * 30).to(gdt) for p in params]


def run_parity(
    pdt, gdt, adamw_mode, *, sizes, div_scale, opt_cls=CPUAdam, hyper=HYPER, device="cpu"
):
    """Step ``opt_cls`` and the float64 reference side by side for STEPS steps."""
    params = [p.to(device) for p in make_params(sizes, pdt)]
    ref = Reference([p.cpu() for p in params], adamw_mode=adamw_mode, **hyper)
    opt = opt_cls(params, adamw_mode=adamw_mode, **hyper)
    for step in range(STEPS):
        grads = [g.to(device) for g in make_grads(params, gdt, step)]
        for p, g in zip(params, grads, strict=True):
            set_grad(p, g)
        opt.step(div_scale=div_scale)
        ref.step([g.cpu() for g in grads], div_scale=div_scale)
        for i, (p, r) in enumerate(zip(params, ref.params, strict=True)):
            torch.testing.assert_close(
                p.cpu().double(),
                r.detach(),
                **PARAM_TOL[pdt],
                msg=lambda m, i=i, s=step: f"step {s} p{i}: {m}",
            )
    # Through state_dict(), which also brings back states kept on disk.
    packed = opt.state_dict()["state"]
    for idx, r in enumerate(ref.params):
        st, rst = packed[idx], ref.opt.state[r]
        assert float(st["step"]) == float(rst["step"]) == STEPS
        if pdt == torch.float32:
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(st[k].cpu().double(), rst[k], **STATE_TOL)


def small_model():
    """A seeded 16 -> 64 -> 8 MLP for state-dict and resume tests."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def train_steps(model, opt, steps, seed, skip=0):
    """``steps`` optimizer steps on a seeded data stream, after skipping
    ``skip`` batches of it (to resume where a run stopped); returns the losses."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(skip):
        torch.randn(32, 16, generator=gen)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
