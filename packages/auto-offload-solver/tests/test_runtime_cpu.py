"""The runtime on a CPU device: the same ops, hooks and optimizer as on a GPU
(streams aside), checked against plain training and for their effect."""

from __future__ import annotations

import pytest
import torch
from offload_helpers import (
    batch,
    fake_profile,
    gpt2_2,
    halfway_budget,
    lm_loss,
    offload_losses,
    ref_batch,
    reference_losses,
    tiny_gpt2,
    tiny_llama,
    tiny_ref_gpt,
)

from zerostack.auto_offload import AMPOptimizer, memory_optimize
from zerostack.testing import training_tolerance

HYPER = dict(lr=1e-2, weight_decay=0.1, clip=0.5)
SGD = dict(lr=0.5, weight_decay=0.01, clip=0.3)


@pytest.mark.parametrize(
    ("build", "solver"), [(gpt2_2, "syn"), (gpt2_2, "asyn"), (tiny_llama, "asyn")],
    ids=["gpt2-syn", "gpt2-asyn", "llama-asyn"],
)  # fmt: skip
def test_parity_and_effect_bf16(build, solver):
    inputs = batch(2, 8)
    torch.manual_seed(0)
    model = build()
    ref_losses, ref_masters = reference_losses(
        model, inputs, steps=4, dtype=torch.bfloat16, device="cpu", **HYPER
    )
    seen = {"forward": 0, "backward": 0}

    def check(phase, om):
        seen[phase] += 1
        for r in om.regions:
            if phase == "forward" and r.params:
                # offloaded regions were freed after their forward, the others kept
                assert r.is_resident == (not r.need_offload), r
            if phase == "backward":
                assert not r.is_resident, r  # every buffer freed after the downloads
        if phase == "forward":
            assert any(r.need_offload for r in om.regions), "the budget forces an offload"

    budget = halfway_budget(build, solver)
    losses, masters, om, opt = offload_losses(
        model, inputs, steps=4, precision="bf16", device="cpu", solver=solver, budget=budget,
        profile=fake_profile(), check=check, **HYPER,
    )  # fmt: skip
    assert seen == {"forward": 4, "backward": 4}
    assert om.region_manager.solver.best_ts.peak_mem <= budget * 0.95
    assert opt.grad_scaler is None and opt.last_grad_norm > HYPER["clip"]  # clipping was active
    # the same bf16 ops on the same values: the losses agree closely
    # bf16 rounding of slightly different updates: observed within 3e-4 relative
    torch.testing.assert_close(losses, ref_losses, rtol=2e-3, atol=1e-3)
    for m, r in zip(masters, ref_masters, strict=True):
        # Adam moves a parameter by ~lr whatever its gradient, so a near-zero bf16
        # gradient whose sign rounds the other way can differ by two steps' worth.
        torch.testing.assert_close(m.detach(), r, rtol=0, atol=2 * HYPER["lr"])
        assert (m.detach() - r).abs().gt(2e-3).float().mean() < 1e-2
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("solver", ["syn", "asyn"])
def test_parity_sgd_sees_the_gradient_scale(solver):
    """SGD's update is linear in the gradient: a wrong scale or clip shows."""
    inputs = batch(2, 8)
    torch.manual_seed(1)
    model = gpt2_2()
    hyper = SGD
    ref_losses, ref_masters = reference_losses(
        model, inputs, steps=3, dtype=torch.bfloat16, device="cpu", sgd=True, **hyper
    )
    losses, masters, _, opt = offload_losses(
        model, inputs, steps=3, precision="bf16", device="cpu", solver=solver,
        budget=halfway_budget(gpt2_2, solver), profile=fake_profile(), sgd=True,
        **hyper,
    )  # fmt: skip
    assert opt.last_grad_norm > hyper["clip"]
    torch.testing.assert_close(losses, ref_losses, rtol=1e-3, atol=1e-3)
    for m, r in zip(masters, ref_masters, strict=True):
        torch.testing.assert_close(m.detach(), r, rtol=1e-2, atol=1e-4)


def test_torch_adam_steps_the_bf16_gradients_unclipped():
    """AMPOptimizer steps any torch optimizer: torch's Adam, which refuses a
    bf16 gradient on an fp32 master, steps as HybridAdam does when no clip
    or loss scale divides the gradients (their division cast them)."""
    inputs = batch(2, 8)
    hyper = dict(HYPER, clip=0.0)
    runs = []
    for torch_adam in (False, True):
        torch.manual_seed(0)
        runs.append(offload_losses(
            gpt2_2(), inputs, steps=3, precision="bf16", device="cpu", solver="syn", budget=-1,
            profile=fake_profile(), torch_adam=torch_adam, **hyper,
        ))  # fmt: skip
    (hybrid_losses, hybrid_masters, _, _), (losses, masters, _, opt) = runs
    assert isinstance(opt.optim, torch.optim.Adam)
    assert all(m.grad is None and len(opt.optim.state[m]) for m in masters)  # stepped
    torch.testing.assert_close(losses, hybrid_losses, rtol=1e-3, atol=1e-3)
    # Two fp32 Adam kernels whose roundings differ: where two masters round to
    # different bf16 copies the next gradients differ, and a gradient at the
    # rounding level can flip an Adam update: training_tolerance's bound (a
    # bound observed on one machine, 1e-5, failed on another at 8.8e-5).
    rtol, atol = training_tolerance(torch.bfloat16, steps=3, lr=hyper["lr"])
    for m, h in zip(masters, hybrid_masters, strict=True):
        torch.testing.assert_close(m.detach(), h.detach(), rtol=rtol, atol=atol)
    assert losses[-1] < losses[0]


def test_parity_tied_head_and_unused_parameter():
    """zerostack.testing's TinyGPT: tied head, a parameter forward never reads."""
    torch.manual_seed(2)
    model = tiny_ref_gpt(2)
    inputs = ref_batch(2, 8)
    ref, ref_masters = reference_losses(
        model, inputs, steps=3, dtype=torch.bfloat16, device="cpu", sgd=True, **SGD
    )
    budget = halfway_budget(tiny_ref_gpt, "asyn", ref_batch)
    losses, masters, om, _ = offload_losses(
        model, inputs, steps=3, precision="bf16", device="cpu", solver="asyn", budget=budget,
        profile=fake_profile(), sgd=True, **SGD,
    )  # fmt: skip
    assert om.region_manager.get_region(model.tok_emb.weight).shared
    assert any(r.need_offload for r in om.regions)
    torch.testing.assert_close(losses, ref, rtol=1e-3, atol=1e-3)
    for m, r in zip(masters, ref_masters, strict=True):
        torch.testing.assert_close(m.detach(), r, rtol=1e-2, atol=1e-4)
    unused = om.master_of(model.unused.weight)
    assert unused.grad is None and not opt_state(om, unused)


def opt_state(om, master):
    return any(master is p for r in om.regions for p in r.grad_params)


def test_fp16_uses_the_loss_scaler_and_model_params_are_swapped():
    inputs = batch(2, 8)
    torch.manual_seed(0)
    model = tiny_gpt2(2)
    losses, masters, om, opt = offload_losses(
        model, inputs, steps=2, precision="fp16", device="cpu", solver="syn", budget=-1,
        profile=fake_profile(), on_model_params=True, **HYPER,
    )  # fmt: skip
    assert opt.grad_scaler is not None and opt.loss_scale == 2.0**16
    assert om.dtype == torch.float16 and all(p.dtype == torch.float16 for p in om.parameters())
    held = [p for g in opt.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(m) for m in masters}  # the masters, not the model's
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in held)
    assert all(len(opt.optim.state[m]) for m in masters)  # they were stepped
    assert losses[1] < losses[0]


def test_errors_of_amp_optimizer():
    from zerostack.auto_offload import AMPOptimizer

    om = memory_optimize(
        tiny_gpt2(1), batch(), precision="bf16", device="cpu", profile=fake_profile()
    )
    with pytest.raises(ValueError, match="not a parameter of the offloaded module"):
        AMPOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=1.0), om)
    with pytest.raises(NotImplementedError, match=r"norm_type must be 2\.0"):
        AMPOptimizer(torch.optim.SGD(om.master_parameters(), lr=1.0), om, norm_type=1.0)
    with pytest.warns(UserWarning, match="no effect without fp16"):
        AMPOptimizer(torch.optim.SGD(om.master_parameters(), lr=1.0), om, initial_scale=8.0)
    with pytest.raises(TypeError, match=r"unknown \['input_id'\], missing \['input_ids'\]"):
        om(input_id=batch()["input_ids"], attention_mask=batch()["attention_mask"])
    with pytest.raises(
        ValueError, match=r"input .input_ids. has shape \(2, 4\) but the module was traced"
    ):
        om(**batch(2, 4))
    opt = AMPOptimizer(torch.optim.SGD(om.master_parameters(), lr=1.0), om)
    with pytest.raises(RuntimeError, match=r"no gradients since the last step"):
        opt.step()
    opt.backward(om(**batch()).float().mean())
    with pytest.raises(RuntimeError, match="no gradient accumulation"):
        opt.backward(om(**batch()).float().mean())
    opt.step()
    with pytest.raises(RuntimeError, match=r"no gradients since the last step"):
        opt.step()  # the same gradients are never applied twice


def test_without_cuda_memory_optimize_says_what_to_do():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only error")
    with pytest.raises(RuntimeError, match="pass device='cpu' to exercise the plan on the CPU"):
        memory_optimize(tiny_gpt2(1), batch())
    with pytest.raises(ValueError, match="precision must be one of"):
        memory_optimize(
            tiny_gpt2(1), batch(), precision="fp8", device="cpu", profile=fake_profile()
        )


def test_on_the_cpu_without_a_profile_it_measures_plans_and_trains():
    from zerostack.auto_offload import HardwareProfile

    inputs = batch(2, 8)
    budget = halfway_budget(gpt2_2, "asyn")  # the peaks do not depend on the rates
    torch.manual_seed(0)
    losses, _, om, _ = offload_losses(
        gpt2_2(), inputs, steps=3, precision="bf16", device="cpu", solver="asyn",
        budget=budget, profile=None, **HYPER,
    )  # fmt: skip
    assert om.region_manager.profile is HardwareProfile.measure("cpu")  # measured, then cached
    assert any(r.need_offload for r in om.regions)
    assert om.region_manager.solver.best_ts.peak_mem <= budget * 0.95
    assert losses[-1] < losses[0]


def test_state_dict_round_trip():
    torch.manual_seed(0)
    model = tiny_gpt2(1)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    om = memory_optimize(model, batch(), precision="bf16", device="cpu", profile=fake_profile())
    sd = om.state_dict()
    assert set(sd) >= {k for k in original if not k.endswith("attn.bias")}
    for k, v in sd.items():  # fp32 masters: the original values, not bf16-rounded
        if k in original:
            assert v.dtype == torch.float32 and torch.equal(v, original[k].float()), k
    out = om(**batch()).float()  # no backward follows: regions stay on the device
    changed = {k: v + 0.5 if v.is_floating_point() else v for k, v in sd.items()}
    om.load_state_dict(changed)
    assert torch.equal(om.state_dict()["model.lm_head.weight"], changed["model.lm_head.weight"])
    loaded = om(**batch()).float()
    assert not torch.allclose(loaded, out)
    torch.manual_seed(0)  # the next forward uploads them all: a fresh module's output
    fresh = memory_optimize(tiny_gpt2(1), batch(), precision="bf16", device="cpu",
                            profile=fake_profile())  # fmt: skip
    fresh.load_state_dict(changed)
    assert torch.equal(loaded, fresh(**batch()).float())
    with pytest.raises(KeyError, match="unknown \\['nope'\\]"):
        om.load_state_dict({**changed, "nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape"):
        om.load_state_dict({**changed, "model.lm_head.weight": torch.zeros(2)})


@pytest.mark.parametrize("solver", ["syn", "asyn"])
def test_an_evaluation_between_backward_and_step_changes_nothing(solver):
    """A forward under torch.no_grad() after the backward leaves the regions
    it uploaded on the device (no backward frees them); the step rewrites
    the half copies, and the next forward must upload those, not run the
    values from before the step."""

    def losses(evaluate: bool) -> list[float]:
        budget = halfway_budget(gpt2_2, solver)  # some regions offloaded, some kept
        torch.manual_seed(0)  # after it: it builds a model on its first call only
        om = memory_optimize(
            gpt2_2(), batch(), budget, solver, precision="bf16", device="cpu",
            profile=fake_profile(),
        )  # fmt: skip
        assert any(r.need_offload for r in om.regions) and not all(
            r.need_offload for r in om.regions if r.params
        )
        opt = AMPOptimizer(torch.optim.SGD(om.master_parameters(), lr=0.5), om)
        out = []
        for _ in range(3):
            loss = lm_loss(om(**batch()), batch()["input_ids"])
            opt.backward(loss)
            if evaluate:
                with torch.no_grad():
                    om(**batch(seed=1))
            opt.step()
            out.append(loss.item())
        return out

    plain = losses(False)
    assert plain[-1] < plain[0]
    assert losses(True) == plain


class _HeadFirst(torch.nn.Module):
    """Registers its head first and runs it last: region order is not
    registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(32, 32)
        self.body = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def test_master_parameters_come_in_the_models_order_so_states_load_either_way():
    """torch's optimizers number their states by position: an optimizer
    built on ``master_parameters()`` (the guide's way) and one built on
    ``parameters()`` (or a plain torch run's) must number them alike, or a
    loaded state lands on other parameters."""
    import copy

    x = torch.randn(4, 32)

    def build(on_masters: bool):
        torch.manual_seed(0)
        om = memory_optimize(_HeadFirst(), (x,), precision="bf16", device="cpu",
                             profile=fake_profile())  # fmt: skip
        params = om.master_parameters() if on_masters else list(om.parameters())
        return om, AMPOptimizer(torch.optim.AdamW(params, lr=1e-2), om)

    om, opt = build(True)
    assert [id(m) for m in om.master_parameters()] == [id(om.master_of(p)) for p in om.parameters()]
    for _ in range(2):
        opt.backward(om(x).float().square().mean())
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    other, other_opt = build(False)
    other_opt.load_state_dict(saved)
    for (name, p), q in zip(om.named_parameters(), other.parameters(), strict=True):
        mine = opt.optim.state[om.master_of(p)]["exp_avg"]
        theirs = other_opt.optim.state[other.master_of(q)]["exp_avg"]
        assert torch.equal(mine, theirs), name


def test_a_step_post_hook_that_writes_the_masters_reaches_the_next_upload():
    """HybridAdam writes the half copies in its kernel (copy-out); a step
    post-hook of the user's that scaled the masters (the parameters of the
    optimizer they built) changed the masters only, and the next forward
    uploaded the kernel's values: 1.5e-2 off the masters after one step."""
    from zerostack.fused_adam import HybridAdam

    inputs = batch(2, 8)
    torch.manual_seed(0)
    model = gpt2_2()
    budget = halfway_budget(gpt2_2, "asyn")
    om = memory_optimize(model, inputs, budget, "asyn", precision="bf16", profile=fake_profile(),
                         device="cpu")  # fmt: skip
    inner = HybridAdam(om.master_parameters(), lr=1e-2)

    def shrink(optimizer, args, kwargs):
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.mul_(0.9)

    inner.register_step_post_hook(shrink)
    opt = AMPOptimizer(inner, om)
    for _ in range(2):
        opt.zero_grad()
        out = om(**inputs)
        opt.backward(lm_loss(out, inputs["input_ids"]))
        opt.step()
        for master, _, half in opt._views:
            assert torch.equal(half, master.detach().to(half.dtype))


@pytest.mark.parametrize("kind", ["hybrid-adam", "torch-sgd"])
def test_masters_written_between_steps_reach_the_next_forward(kind):
    """A master written between steps (a weight constraint on the optimizer's
    params, ``master_parameters()``) stayed out of the forwards: the next
    forward uploaded the half copy from before the edit, with the loss of
    the unedited model, until the next step overwrote it."""
    from zerostack.fused_adam import HybridAdam

    inputs = batch(2, 8)

    def build():
        torch.manual_seed(0)
        return memory_optimize(gpt2_2(), inputs, halfway_budget(gpt2_2, "asyn"), "asyn",
                               precision="bf16", profile=fake_profile(), device="cpu")  # fmt: skip

    om = build()
    inner = (
        HybridAdam(om.master_parameters(), lr=1e-2)
        if kind == "hybrid-adam"
        else torch.optim.SGD(om.master_parameters(), lr=1e-2)
    )
    opt = AMPOptimizer(inner, om)
    opt.backward(lm_loss(om(**inputs), inputs["input_ids"]))
    opt.step()
    before = lm_loss(om(**inputs), inputs["input_ids"]).item()
    with torch.no_grad():
        for group in inner.param_groups:
            for p in group["params"]:
                p.mul_(0.5)
    edited = lm_loss(om(**inputs), inputs["input_ids"]).item()
    for master, _, half in opt._views:
        assert torch.equal(half, master.detach().to(half.dtype))
    other = build()  # the edited weights through load_state_dict, which refreshes the copies
    other.load_state_dict(om.state_dict())
    assert edited == lm_loss(other(**inputs), inputs["input_ids"]).item()
    assert edited != before


class _DataSGD(torch.optim.Optimizer):
    """An older-style optimizer that writes through ``p.data`` (many
    third-party ones do): its writes move no version counter."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.to(p.dtype), alpha=-group["lr"])


def test_an_optimizer_that_writes_through_data_reaches_the_half_copies():
    """The step's refresh of the half copies once followed the masters'
    version counters only: an optimizer writing through ``p.data`` trained
    nothing (the loss stayed at its first value)."""
    inputs = batch(2, 8)
    torch.manual_seed(0)
    om = memory_optimize(gpt2_2(), inputs, halfway_budget(gpt2_2, "asyn"), "asyn",
                         precision="bf16", profile=fake_profile(), device="cpu")  # fmt: skip
    opt = AMPOptimizer(_DataSGD(om.master_parameters(), lr=1e-1), om)
    losses = []
    for _ in range(3):
        loss = lm_loss(om(**inputs), inputs["input_ids"])
        losses.append(loss.item())
        opt.backward(loss)
        opt.step()
    for master, _, half in opt._views:
        assert torch.equal(half, master.detach().to(half.dtype))
    assert losses[2] < losses[1] < losses[0], losses


def test_a_submodule_assigned_after_memory_optimize_raises():
    """The traced graph holds the parameters it was traced with: a head put
    in place of the model's after memory_optimize was never used, silently
    (zero-shard's [Note: the structure is fixed once wrapped])."""
    inputs = batch(2, 8)
    torch.manual_seed(0)
    model = gpt2_2()
    om = memory_optimize(model, inputs, halfway_budget(gpt2_2, "asyn"), "asyn", precision="bf16",
                         profile=fake_profile(), device="cpu")  # fmt: skip
    head = model.model.lm_head
    with pytest.raises(RuntimeError, match=r"^memory_optimize: model.lm_head was assigned a submodule "
                       r"after the model was wrapped \(got a new Linear\); the traced graph"):  # fmt: skip
        model.model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False)
    assert model.model.lm_head is head
    with pytest.raises(RuntimeError, match=r"was assigned a parameter"):
        next(m for m in om.model.modules() if m._parameters).register_parameter(
            "extra", torch.nn.Parameter(torch.zeros(1))
        )
    model.model.transformer.drop = torch.nn.Identity()  # no parameters in place of none


@pytest.mark.parametrize("frozen_at_plan", [False, True])
def test_requires_grad_changed_after_memory_optimize_raises_at_forward(frozen_at_plan):
    """The plan fixes which parameters train (the regions' gradient buffers,
    the masters): a parameter frozen later made the backward raise that the
    loss did not use a trained parameter; one unfrozen later never trained,
    silently. The next forward raises, naming it; changing it back goes on."""
    inputs = batch(2, 8)
    torch.manual_seed(0)
    model = gpt2_2()
    first = next(model.parameters())
    first.requires_grad_(not frozen_at_plan)
    om = memory_optimize(model, inputs, halfway_budget(gpt2_2, "asyn"), "asyn",
                         precision="bf16", profile=fake_profile(), device="cpu")  # fmt: skip
    opt = AMPOptimizer(torch.optim.AdamW(om.master_parameters(), lr=1e-2), om)
    opt.backward(lm_loss(om(**inputs), inputs["input_ids"]))
    opt.step()
    name, param = next(om.model.named_parameters())
    param.requires_grad_(frozen_at_plan)
    with pytest.raises(NotImplementedError, match=(
        rf"^BaseOffloadModule\.forward: requires_grad changed after memory_optimize .* \(got "
        rf"{name} requires_grad={frozen_at_plan}\); set requires_grad before memory_optimize"
    )):  # fmt: skip
        om(**inputs)
    param.requires_grad_(not frozen_at_plan)
    opt.backward(lm_loss(om(**inputs), inputs["input_ids"]))
    opt.step()
