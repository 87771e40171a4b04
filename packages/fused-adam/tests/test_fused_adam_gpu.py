"""FusedAdam and HybridAdam on a CUDA device (the device machine's `gpu` session)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DTYPES, HYPER, SIZES, make_grads, make_params, run_parity, set_grad

from zerostack.fused_adam import CPUAdam, FusedAdam, HybridAdam, cuda_kernel_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_kernel_is_built():
    assert cuda_kernel_available()


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "l2"])
@pytest.mark.parametrize("gdt", DTYPES, ids=str)
@pytest.mark.parametrize("pdt", DTYPES, ids=str)
def test_parity_every_dtype(pdt, gdt, adamw_mode):
    run_parity(pdt, gdt, adamw_mode, sizes=SIZES, div_scale=4.0, opt_cls=FusedAdam, device="cuda")


@pytest.mark.parametrize("div_scale", [-1.0, 1024.0])
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16], ids=str)
def test_large_and_odd_sizes(pdt, div_scale):
    sizes = [2**20 + 3, 65536 * 3 + 1, 33, 4]
    run_parity(pdt, pdt, False, sizes=sizes, div_scale=div_scale, opt_cls=FusedAdam, device="cuda")


def test_many_tensors_span_several_launches():
    # More tensors than one launch's metadata holds.
    run_parity(
        torch.float32,
        torch.bfloat16,
        True,
        sizes=[(i * 37) % 300 + 1 for i in range(500)],
        div_scale=2.0,
        opt_cls=FusedAdam,
        device="cuda",
    )


def test_misaligned_views_use_the_scalar_path():
    # Parameters that are views at odd offsets into one buffer.
    buf = torch.randn(10_001, device="cuda")
    params = [buf[1:4001], buf[4001:8003], buf[8003:]]
    ref = [p.detach().clone() for p in params]
    opt = FusedAdam(params, **HYPER)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HYPER)
    for step in range(5):
        grads = [g.cuda() for g in make_grads(params, torch.float32, step)]
        for p, r, g in zip(params, ref, grads, strict=True):
            p.grad, r.grad = g, g.clone()
        opt.step()
        ref_opt.step()
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_copy_out(out_dtype):
    master = torch.randn(70_001, device="cuda")
    out = torch.zeros(70_001, device="cuda", dtype=out_dtype)
    opt = FusedAdam([master], lr=0.1)
    opt.set_copy_out(master, out)
    for _ in range(3):
        set_grad(master, torch.randn(70_001, device="cuda").bfloat16())
        opt.step()
        assert torch.equal(out, master.to(out_dtype))


def test_hybrid_adam_steps_both_devices_like_cpu_adam_and_fused_adam():
    cpu_params = make_params([4097, 7], torch.float32)
    gpu_params = [p.cuda() for p in make_params([4097, 9], torch.bfloat16, seed=1)]
    sep_cpu = [p.clone() for p in cpu_params]
    sep_gpu = [p.clone() for p in gpu_params]
    hybrid = HybridAdam(cpu_params + gpu_params, **HYPER)
    cpu_opt, gpu_opt = CPUAdam(sep_cpu, **HYPER), FusedAdam(sep_gpu, **HYPER)
    for step in range(4):
        for params in (cpu_params, sep_cpu):
            for p, g in zip(params, make_grads(params, torch.float32, step), strict=True):
                p.grad = g
        for params in (gpu_params, sep_gpu):
            for p, g in zip(params, make_grads(params, torch.bfloat16, step), strict=True):
                p.grad = g.cuda()
        hybrid.step(div_scale=2.0)
        cpu_opt.step(div_scale=2.0)
        gpu_opt.step(div_scale=2.0)
    for a, b in zip(cpu_params + gpu_params, sep_cpu + sep_gpu, strict=True):
        assert torch.equal(a, b)


def test_runs_on_the_current_stream():
    p = torch.randn(1 << 20, device="cuda")
    p.grad = torch.randn_like(p)
    ref = p.detach().clone()
    ref.grad = p.grad.clone()
    opt, ref_opt = FusedAdam([p]), torch.optim.AdamW([ref], foreach=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()
        ref_opt.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_with_torch_fused_adamw():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).cuda()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), fused=True, **HYPER)
    x = torch.randn(16, 64, device="cuda")
    for _ in range(2):
        ref_opt.zero_grad()
        ref_model(x).square().mean().backward()
        ref_opt.step()
    model.load_state_dict(ref_model.state_dict())
    opt = FusedAdam(model.parameters(), **HYPER)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for m, o in ((model, opt), (ref_model, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_cpu_param_is_rejected():
    with pytest.raises(ValueError, match=r"FusedAdam: param 0.0 .* is on cpu"):
        FusedAdam([torch.nn.Parameter(torch.zeros(3))])


def test_cuda_param_is_rejected_by_cpu_adam():
    with pytest.raises(ValueError, match=r"CPUAdam: param 0.0 .* is on cuda"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3, device="cuda"))])
