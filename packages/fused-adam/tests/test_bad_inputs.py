"""The bad-input matrix of CPUAdam, FusedAdam and HybridAdam (issue 17).

One row per bad call: the error type, a regex that names the argument (or
the misused call) and the value got, and whether this table's work added the
check (``fixed``: before it the call gave an unclear error or was accepted).
Every row also checks that the failed call changed nothing (parameters and
``state_dict()`` equal before and after) and that the optimizer still steps.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from zerostack.fused_adam import CPUAdam, FusedAdam, HybridAdam, cuda_kernel_available
from zerostack.testing import BadInput, check_bad_input, check_unique_ids, one_torch_thread


def _step_with_hand_set_maximize(env: dict[str, Any]) -> None:
    """``maximize`` set on a group after construction (torch's optimizers
    honour it): the step refuses it rather than ignoring it."""
    group = env["opt"].param_groups[0]
    group["maximize"] = True
    try:
        env["opt"].step()
    finally:
        del group["maximize"]


def _env() -> dict[str, Any]:
    """Two parameters and a CPUAdam that has stepped once (so it has state)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    q = torch.nn.Parameter(torch.randn(2, 3))
    opt = CPUAdam([p, q], lr=0.1)
    p.grad, q.grad = torch.ones(4), torch.ones(2, 3)
    opt.step()
    return {"p": p, "q": q, "opt": opt, "new": torch.nn.Parameter(torch.zeros(3))}


def _snapshot(env: dict[str, Any]) -> Any:
    opt = env["opt"]
    return copy.deepcopy(
        {
            "params": [env["p"].detach().clone(), env["q"].detach().clone()],
            "state": opt.state_dict(),
            "groups": len(opt.param_groups),
        }
    )


def _grads(env, **over):
    env["p"].grad = over.get("p", torch.ones(4))
    env["q"].grad = over.get("q", torch.ones(2, 3))


def _set_grad(p, g):
    p.grad_dtype = None  # torch >= 2.10 pins the grad dtype unless told not to
    p.grad = g


def _noncontiguous():
    return torch.nn.Parameter(torch.zeros(4, 4).t())


def _meta():
    return torch.nn.Parameter(torch.zeros(3, device="meta"))


def _build(**kwargs):
    return lambda env: CPUAdam([env["new"]], **kwargs)


def _bad_grad(grad_of_p):
    """A step where the second parameter's gradient is bad: the first must not step either."""

    def call(env):
        env["p"].grad = torch.ones(4)
        _set_grad(env["q"], grad_of_p())
        env["opt"].step()

    return call


def _grad_of_another_shape(env):
    """q (2, 3) given a (3, 2) gradient: torch checks a gradient's shape only
    against the data it is assigned beside."""
    env["p"].grad = torch.ones(4)
    q, data = env["q"], env["q"].data
    q.data = torch.zeros(3, 2)
    q.grad = None
    q.grad = torch.ones(3, 2)
    q.data = data
    env["opt"].step()


def _sd(edit):
    def call(env):
        sd = copy.deepcopy(env["opt"].state_dict())
        edit(sd)
        env["opt"].load_state_dict(sd)

    return call


def _sgd_state(env):
    copies = [torch.nn.Parameter(env[k].detach().clone()) for k in ("p", "q")]
    sgd = torch.optim.SGD(copies, lr=0.1, momentum=0.9)
    for t in sgd.param_groups[0]["params"]:
        t.grad = torch.ones_like(t)
    sgd.step()
    sd = sgd.state_dict()
    sd["param_groups"][0].update(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    env["opt"].load_state_dict(sd)


def _fused(env):
    return FusedAdam([env["new"]])


_FUSED = (
    (ValueError, r"FusedAdam: param 0\.0 .* is on cpu; use CPUAdam or HybridAdam")
    if cuda_kernel_available()
    else (RuntimeError, r"FusedAdam: the CUDA kernel is not part of this install")
)

CASES = [
    # -- constructor: wrong types ---------------------------------------------------
    BadInput("lr-str", _build(lr="0.1"), TypeError, r"CPUAdam: lr must be a number \(got '0\.1'\)", True),
    BadInput("lr-none", _build(lr=None), TypeError, r"lr must be a number \(got None\)", True),
    BadInput("eps-str", _build(eps="1e-8"), TypeError, r"eps must be a number \(got '1e-8'\)", True),
    BadInput("wd-none", _build(weight_decay=None), TypeError, r"weight_decay must be a number \(got None\)", True),
    BadInput("betas-float", _build(betas=0.9), TypeError, r"betas must be a pair of numbers \(got 0\.9\)", True),
    BadInput("betas-str", _build(betas=("a", "b")), TypeError, r"betas must be a pair of numbers \(got \('a', 'b'\)\)", True),
    BadInput("adamw_mode-str", _build(adamw_mode="false"), TypeError, r"adamw_mode must be a bool \(got 'false'\)", True),
    BadInput("bias_correction-int", _build(bias_correction=1), TypeError, r"bias_correction must be a bool \(got 1\)", True),
    BadInput("nvme-fraction-str", _build(nvme_offload_fraction="0.5"), TypeError, r"nvme_offload_fraction must be a number \(got '0\.5'\)", True),
    BadInput("nvme-dir-int", _build(nvme_offload_dir=3), TypeError, r"nvme_offload_dir must be a path or None \(got 3\)"),
    BadInput("nvme-backend-int", _build(nvme_backend=3), TypeError, r"nvme_backend must be .* \(got 3\)", True),
    BadInput("nvme-depth-0", _build(nvme_prefetch_depth=0), ValueError, r"nvme_prefetch_depth must be an int >= 1 \(got 0\)", True),
    BadInput("nvme-depth-float", _build(nvme_prefetch_depth=1.5), ValueError, r"nvme_prefetch_depth must be an int >= 1 \(got 1\.5\)", True),
    BadInput("params-tensor", lambda env: CPUAdam(env["new"]), TypeError, r"params argument given to the optimizer should be an iterable"),
    BadInput("params-empty", lambda env: CPUAdam([]), ValueError, r"optimizer got an empty parameter list"),
    BadInput("params-float", lambda env: CPUAdam([1.0]), TypeError, r"optimizer can only optimize Tensors, but one of the params is float"),
    # -- constructor: out of range --------------------------------------------------
    BadInput("lr-negative", _build(lr=-1e-3), ValueError, r"lr must be >= 0 \(got -0\.001\)"),
    BadInput("lr-inf", _build(lr=float("inf")), ValueError, r"lr must be finite \(got inf\)", True),
    BadInput("lr-nan", _build(lr=float("nan")), ValueError, r"lr must be >= 0 \(got nan\)"),
    BadInput("eps-negative", _build(eps=-1.0), ValueError, r"eps must be >= 0 \(got -1\.0\)"),
    BadInput("wd-negative", _build(weight_decay=-0.1), ValueError, r"weight_decay must be >= 0 \(got -0\.1\)"),
    BadInput("wd-inf", _build(weight_decay=float("inf")), ValueError, r"weight_decay must be finite \(got inf\)", True),
    BadInput("beta1-one", _build(betas=(1.0, 0.999)), ValueError, r"betas must be two values in \[0, 1\) \(got \(1\.0, 0\.999\)\)"),
    BadInput("beta2-negative", _build(betas=(0.9, -0.1)), ValueError, r"betas must be two values in \[0, 1\) \(got \(0\.9, -0\.1\)\)"),
    BadInput("betas-three", _build(betas=(0.9, 0.99, 0.999)), ValueError, r"betas must be two values in \[0, 1\) \(got \(0\.9, 0\.99, 0\.999\)\)"),
    BadInput("nvme-fraction-1.5", _build(nvme_offload_fraction=1.5), ValueError, r"nvme_offload_fraction must be in \[0, 1\] \(got 1\.5\)"),
    BadInput("nvme-fraction-negative", _build(nvme_offload_fraction=-0.1), ValueError, r"nvme_offload_fraction must be in \[0, 1\] \(got -0\.1\)"),
    BadInput("group-lr-negative", lambda env: CPUAdam([{"params": [env["new"]], "lr": -1}]), ValueError, r"lr must be >= 0 \(got -1\)"),
    # -- devices and dtypes -----------------------------------------------------------
    BadInput("param-float64", lambda env: CPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]), TypeError, r"param 0\.0 \(shape \(3,\), torch\.float64, cpu\) has unsupported dtype \(got torch\.float64\)"),
    BadInput("param-int64", lambda env: CPUAdam([torch.zeros(3, dtype=torch.int64)]), TypeError, r"param 0\.0 .* has unsupported dtype \(got torch\.int64\)"),
    BadInput("param-meta-cpuadam", lambda env: CPUAdam([_meta()]), ValueError, r"CPUAdam: param 0\.0 .* is on meta"),
    BadInput("param-meta-hybrid", lambda env: HybridAdam([_meta()]), ValueError, r"HybridAdam: param 0\.0 .* is on meta; move it to the CPU or a CUDA device"),
    BadInput("param-noncontiguous", lambda env: CPUAdam([_noncontiguous()]), ValueError, r"param 0\.0 \(shape \(4, 4\).*dense contiguous"),
    BadInput("fused-on-cpu", _fused, *_FUSED),
    # -- add_param_group: the same checks as the constructor --------------------------
    BadInput("add-group-lr-negative", lambda env: env["opt"].add_param_group({"params": [env["new"]], "lr": -1.0}), ValueError, r"lr must be >= 0 \(got -1\.0\)", True),
    BadInput("add-group-float64", lambda env: env["opt"].add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]}), TypeError, r"param 1\.0 .* has unsupported dtype \(got torch\.float64\)", True),
    BadInput("add-group-meta", lambda env: env["opt"].add_param_group({"params": [_meta()]}), ValueError, r"param 1\.0 .* is on meta", True),
    # -- torch.optim.AdamW's options in a group: the kernels would ignore them -----------
    BadInput("group-amsgrad", lambda env: CPUAdam([{"params": [env["new"]], "amsgrad": True}]), NotImplementedError, r"CPUAdam: amsgrad=True is an option of torch\.optim\.AdamW that is not implemented here .*use torch\.optim\.AdamW for it", True),
    BadInput("add-group-maximize", lambda env: env["opt"].add_param_group({"params": [env["new"]], "maximize": True}), NotImplementedError, r"maximize=True is an option of torch\.optim\.AdamW", True),
    BadInput("add-group-differentiable", lambda env: env["opt"].add_param_group({"params": [env["new"]], "differentiable": True}), NotImplementedError, r"differentiable=True is an option of torch\.optim\.AdamW", True),
    BadInput("group-decoupled-vs-adamw_mode", lambda env: CPUAdam([{"params": [env["new"]], "decoupled_weight_decay": False}]), ValueError, r"CPUAdam: decoupled_weight_decay=False contradicts adamw_mode=True; set adamw_mode", True),
    BadInput("load-amsgrad-state", _sd(lambda sd: sd["param_groups"][0].update(amsgrad=True)), NotImplementedError, r"load_state_dict: amsgrad=True is an option of torch\.optim\.AdamW", True),
    BadInput("add-group-adamw_mode-str", lambda env: env["opt"].add_param_group({"params": [env["new"]], "adamw_mode": "no"}), TypeError, r"adamw_mode must be a bool \(got 'no'\)", True),
    BadInput("step-maximize-set-by-hand", _step_with_hand_set_maximize, NotImplementedError, r"CPUAdam: maximize=True is an option of torch\.optim\.AdamW that is not implemented here", True),
    # -- step: gradients and arguments ------------------------------------------------
    BadInput("grad-float64", _bad_grad(lambda: torch.ones(2, 3, dtype=torch.float64)), TypeError, r"param 0\.1 .* gradient of unsupported dtype \(got torch\.float64\)", True),
    BadInput("grad-sparse", _bad_grad(lambda: torch.ones(2, 3).to_sparse()), ValueError, r"param 0\.1 .* sparse gradient", True),
    BadInput("grad-shape", _grad_of_another_shape, ValueError, r"param 0\.1 .* gradient of another shape \(got \(3, 2\)\)"),
    BadInput("grad-noncontiguous", _bad_grad(lambda: torch.ones(3, 2).t()), ValueError, r"param 0\.1 .* non-contiguous gradient", True),
    BadInput("div_scale-str", lambda env: (_grads(env), env["opt"].step(div_scale="2")), TypeError, r"step: div_scale must be a number, .* \(got '2'\)", True),
    BadInput("div_scale-nan", lambda env: (_grads(env), env["opt"].step(div_scale=float("nan"))), ValueError, r"step: div_scale must be a number, .* \(got nan\)", True),
    BadInput("closure-not-callable", lambda env: (_grads(env), env["opt"].step(closure=3)), TypeError, r"step: closure must be callable or None \(got int\)", True),
    # -- set_copy_out -------------------------------------------------------------------
    BadInput("copy-out-list", lambda env: env["opt"].set_copy_out(env["p"], [0.0] * 4), TypeError, r"set_copy_out: out must be a tensor or None \(got list\)", True),
    BadInput("copy-out-size", lambda env: env["opt"].set_copy_out(env["p"], torch.zeros(3)), ValueError, r"set_copy_out: out must be .* of 4 elements on cpu \(got 3 elements"),
    BadInput("copy-out-float64", lambda env: env["opt"].set_copy_out(env["p"], torch.zeros(4, dtype=torch.float64)), ValueError, r"set_copy_out: out must be .* \(got 4 elements, torch\.float64, cpu\)"),
    BadInput("copy-out-foreign-param", lambda env: env["opt"].set_copy_out(env["new"], torch.zeros(3)), ValueError, r"set_copy_out: the tensor is not a parameter of this optimizer"),
    # -- load_state_dict ----------------------------------------------------------------
    BadInput("load-list", lambda env: env["opt"].load_state_dict([]), TypeError, r"load_state_dict: state_dict must be a dict with 'state' and 'param_groups' \(got list\)", True),
    BadInput("load-no-groups", lambda env: env["opt"].load_state_dict({"state": {}}), TypeError, r"load_state_dict: state_dict must be a dict .* \(got \['state'\]\)", True),
    BadInput("load-exp_avg-shape", _sd(lambda sd: sd["state"][1].update(exp_avg=torch.zeros(6))), ValueError, r"load_state_dict: exp_avg of shape \(6,\) does not match its parameter's shape \(2, 3\)", True),
    BadInput("load-sgd-state", _sgd_state, ValueError, r"load_state_dict: state of a parameter of shape \(4,\) lacks \['exp_avg', 'exp_avg_sq', 'step'\]", True),
    BadInput("load-lr-negative", _sd(lambda sd: sd["param_groups"][0].update(lr=-1.0)), ValueError, r"load_state_dict: lr must be >= 0 \(got -1\.0\)", True),
    BadInput("load-group-size", _sd(lambda sd: sd["param_groups"][0]["params"].pop()), ValueError, r"load_state_dict: the state dict has groups of \[1\] parameters, this optimizer \[2\]", True),
]  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: BadInput) -> None:
    check_bad_input(case, _env(), _snapshot, _still_works)


def _still_works(env: dict[str, Any]) -> None:
    """A correct step moves both parameters."""
    for t in (env["p"], env["q"]):
        _set_grad(t, torch.ones_like(t))
    old = [env["p"].detach().clone(), env["q"].detach().clone()]
    env["opt"].step()
    assert not torch.equal(old[0], env["p"]) and not torch.equal(old[1], env["q"])


def test_the_table_names_every_case_once() -> None:
    check_unique_ids(CASES)


def test_nvme_fraction_without_the_package_names_the_pip_command():
    try:
        import zerostack.nvme  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'zerostack-fused-adam\[nvme\]'"):
            CPUAdam([torch.nn.Parameter(torch.zeros(3))], nvme_offload_fraction=0.5)
    else:
        pytest.skip("zerostack-nvme is installed")
