"""Every bad input gets a clear error that names what is wrong."""

from __future__ import annotations

import pytest
import torch

from zerostack.fused_adam import CPUAdam, FusedAdam, HybridAdam, cuda_kernel_available


def _p(*shape, dtype=torch.float32):
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lr=-1e-3), r"lr must be >= 0 \(got -0.001\)"),
        (dict(eps=-1.0), r"eps must be >= 0 \(got -1.0\)"),
        (dict(betas=(1.0, 0.999)), r"betas must be two values in \[0, 1\) \(got \(1.0, 0.999\)\)"),
        (dict(betas=(0.9, -0.1)), r"betas must be two values in \[0, 1\)"),
        (dict(weight_decay=-0.1), r"weight_decay must be >= 0 \(got -0.1\)"),
        (dict(nvme_offload_fraction=1.5), r"nvme_offload_fraction must be in \[0, 1\] \(got 1.5\)"),
        (dict(nvme_offload_fraction=-0.1), r"nvme_offload_fraction must be in \[0, 1\]"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPUAdam([_p(3)], **kwargs)


def test_bad_hyperparameter_in_a_group():
    with pytest.raises(ValueError, match=r"lr must be >= 0 \(got -1\)"):
        CPUAdam([{"params": [_p(3)], "lr": -1}])


def test_nvme_fraction_without_the_package_names_the_pip_command():
    try:
        import zerostack.nvme  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'zerostack-fused-adam\[nvme\]'"):
            CPUAdam([_p(3)], nvme_offload_fraction=0.5)
    else:
        pytest.skip("zerostack-nvme is installed")


def test_nvme_dir_must_be_a_path():
    with pytest.raises(TypeError, match=r"nvme_offload_dir must be a path or None \(got 3\)"):
        CPUAdam([_p(3)], nvme_offload_dir=3)


def test_unsupported_param_dtype():
    with pytest.raises(
        TypeError, match=r"param 0.0 \(shape \(3,\), torch.float64, cpu\) has unsupported dtype"
    ):
        CPUAdam([_p(3, dtype=torch.float64)])


def test_non_contiguous_param():
    t = torch.zeros(4, 4).t()
    with pytest.raises(ValueError, match=r"param 0.0 \(shape \(4, 4\).*dense contiguous"):
        CPUAdam([t])


def test_sparse_grad():
    p = _p(4)
    opt = CPUAdam([p])
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(ValueError, match=r"param 0.0 .* sparse gradient"):
        opt.step()


def test_grad_shape_mismatch():
    p = _p(4)
    opt = CPUAdam([p])
    p.data = torch.zeros(2, 2)  # the grad below no longer matches
    p.grad = None
    p.grad = torch.zeros(2, 2)
    p.data = torch.zeros(4)
    with pytest.raises(ValueError, match=r"gradient of another shape \(got \(2, 2\)\)"):
        opt.step()


def test_non_contiguous_grad():
    p = _p(4, 4)
    opt = CPUAdam([p])
    p.grad = torch.zeros(4, 4).t()
    with pytest.raises(ValueError, match=r"non-contiguous gradient"):
        opt.step()


def test_unsupported_grad_dtype():
    p = _p(4)
    opt = CPUAdam([p])
    p.grad_dtype = None
    p.grad = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"gradient of unsupported dtype \(got torch.float64\)"):
        opt.step()


def test_non_cpu_param_to_cpu_adam():
    p = torch.nn.Parameter(torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match=r"CPUAdam: param 0.0 .* is on meta"):
        CPUAdam([p])


@pytest.mark.skipif(cuda_kernel_available(), reason="this install has the CUDA kernel")
def test_fused_adam_without_cuda_kernel_says_so():
    with pytest.raises(
        RuntimeError, match=r"FusedAdam: the CUDA kernel is not part of this install"
    ):
        FusedAdam([_p(3)])


@pytest.mark.skipif(not cuda_kernel_available(), reason="this install lacks the CUDA kernel")
def test_cpu_param_to_fused_adam():
    with pytest.raises(
        ValueError, match=r"FusedAdam: param 0.0 .* is on cpu; use CPUAdam or HybridAdam"
    ):
        FusedAdam([_p(3)])


def test_copy_out_checks_its_buffer():
    p = _p(4)
    opt = HybridAdam([p])
    with pytest.raises(
        ValueError, match=r"out must be a contiguous .* of 4 elements on cpu \(got 3 elements"
    ):
        opt.set_copy_out(p, torch.zeros(3))
    with pytest.raises(ValueError, match=r"not a parameter of this optimizer"):
        opt.set_copy_out(_p(4), torch.zeros(4))


def test_load_state_dict_from_other_optimizer():
    p = _p(4)
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(4)
    sgd.step()
    opt = CPUAdam([p])
    sd = sgd.state_dict()
    sd["param_groups"][0].update(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"lacks \['exp_avg', 'exp_avg_sq', 'step'\]"):
        opt.load_state_dict(sd)
