"""GeminiDDP / GeminiOptimizer: clear errors for what is bad or not built yet."""

from __future__ import annotations

import pytest
import torch

from zerostack.fused_adam import HybridAdam
from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import GPTConfig, TinyGPT

CFG = {1: {"chunk_size": 4096, "keep_gathered": False}}


def _model():
    return TinyGPT(GPTConfig(num_layers=1, dim=16, num_heads=2))


@pytest.mark.parametrize("field", ["shard_param_frac", "offload_optim_frac", "offload_param_frac"])
def test_fractions_must_be_in_0_1(field):
    with pytest.raises(ValueError, match=rf"{field} must be in \[0, 1\] \(got 1.5\)"):
        GeminiDDP(_model(), **{field: 1.5}, chunk_config_dict=CFG, compute_device="cpu")


def test_auto_placement_needs_a_capacity_on_cpu_and_no_static_fractions():
    with pytest.raises(
        ValueError, match=r"'auto' on a cpu compute device needs gpu_capacity_bytes"
    ):
        GeminiDDP(_model(), placement_policy="auto", chunk_config_dict=CFG, compute_device="cpu")
    with pytest.raises(ValueError, match=r"are for placement_policy='static'"):
        GeminiDDP(
            _model(),
            placement_policy="auto",
            offload_optim_frac=0.5,
            gpu_capacity_bytes=1 << 20,
            compute_device="cpu",
        )


def test_unbuilt_options_say_so():
    with pytest.raises(NotImplementedError, match=r"master_weights=False"):
        GeminiDDP(_model(), master_weights=False, chunk_config_dict=CFG, compute_device="cpu")
    with pytest.raises(ValueError, match=r"max_prefetch must be >= 0"):
        GeminiDDP(_model(), max_prefetch=-1, chunk_config_dict=CFG, compute_device="cpu")
    with pytest.raises(ValueError, match=r"steady_cuda_cap_ratio must be in \[0, 1\]"):
        GeminiDDP(_model(), steady_cuda_cap_ratio=2.0, chunk_config_dict=CFG, compute_device="cpu")


def test_bad_dtype_and_policy():
    with pytest.raises(ValueError, match=r"mixed_precision must be float16, bfloat16 or float32"):
        GeminiDDP(
            _model(), mixed_precision=torch.float64, chunk_config_dict=CFG, compute_device="cpu"
        )
    with pytest.raises(
        ValueError, match=r"placement_policy must be 'static' or 'auto'.* \(got 'const'\)"
    ):
        GeminiDDP(_model(), placement_policy="const")
    with pytest.raises(ValueError, match=r"placement_policy='cpu' fixes shard_param_frac"):
        GeminiDDP(_model(), placement_policy="cpu", offload_optim_frac=0.5)


def test_optimizer_must_cover_the_module():
    model = GeminiDDP(
        _model(), mixed_precision=torch.float32, chunk_config_dict=CFG, compute_device="cpu"
    )
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"the optimizer lacks parameters of the module"):
        GeminiOptimizer(HybridAdam(params[:2]), model)
    with pytest.raises(NotImplementedError, match=r"2 parameter groups"):
        GeminiOptimizer(HybridAdam([{"params": params[:2]}, {"params": params[2:]}]), model)


def test_parameters_are_sharded_after_wrapping():
    model = GeminiDDP(
        _model(), mixed_precision=torch.bfloat16, chunk_config_dict=CFG, compute_device="cpu"
    )
    assert all(p.numel() == 0 for p in model.module.parameters())
    full = model.state_dict()
    assert (
        full["lm_head.weight"].shape == (256, 16) and full["lm_head.weight"].dtype == torch.float32
    )


def test_a_dropped_model_and_optimizer_are_freed():
    # Tensor hooks hold only weak references: nothing keeps chunks alive.
    import gc
    import weakref

    from zerostack.testing import make_batch

    model = GeminiDDP(
        _model(),
        mixed_precision=torch.float32,
        chunk_config_dict=CFG,
        compute_device="cpu",
        offload_optim_frac=1.0,
    )
    opt = GeminiOptimizer(HybridAdam(list(model.module.parameters())), model)
    idx, tgt = make_batch(model.module.config, 2, 8, seed=0)
    opt.backward(model(idx, tgt))
    opt.step()
    model.wait_updates()  # the CPU update runs on a worker thread, holding the optimizer meanwhile
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(model.chunk_manager.chunks()[0])]
    del model, opt
    gc.collect()
    assert all(r() is None for r in refs)


def test_gemini_adam_optimizer_builds_hybrid_adam_over_the_trainable_params():
    from zerostack.gemini import GeminiAdamOptimizer

    model = GeminiDDP(
        _model(), mixed_precision=torch.float32, chunk_config_dict=CFG, compute_device="cpu"
    )
    opt = GeminiAdamOptimizer(model, lr=2e-3, weight_decay=0.1, max_norm=1.0)
    assert type(opt.optimizer).__name__ == "HybridAdam" and opt.max_norm == 1.0
    assert opt.param_groups[0]["lr"] == 2e-3 and opt.param_groups[0]["weight_decay"] == 0.1


def _gemini_after_a_backward():
    torch.manual_seed(0)
    model = _model()
    ddp = GeminiDDP(
        model, chunk_config_dict=CFG, compute_device="cpu", mixed_precision=torch.float32
    )
    opt = GeminiOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
    opt.backward(ddp(torch.zeros(1, 4, dtype=torch.long)).float().sum())
    return model, ddp, opt


CHANGES = {
    "module-zero-grad": lambda model: model.zero_grad(),
    "grad-none": lambda model: setattr(model.lm_head.weight, "grad", None),
    "grad-replaced": lambda model: setattr(
        model.lm_head.weight, "grad", torch.ones_like(model.lm_head.weight)
    ),
    "grad-zeroed": lambda model: model.lm_head.weight.grad.zero_(),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_gradient_changed_after_the_backward_is_refused_before_the_step(change):
    """Gemini stepped with the reduced gradients whatever happened to
    ``.grad`` after the backward: ``model.zero_grad()`` changed nothing
    (1.1-2.9e-2 off torch), ``p.grad = g`` was ignored, silently."""
    model, ddp, opt = _gemini_after_a_backward()
    before = [p.detach().clone() for p in ddp.state_dict().values()]
    CHANGES[change](model)
    for call in (lambda: opt.clip_grad_by_norm(1.0), opt.step):
        with pytest.raises(
            RuntimeError, match=r"was dropped, zeroed or replaced after the backward"
        ):
            call()
    opt.zero_grad()  # what the error says: the batch is dropped, and training goes on
    after = list(ddp.state_dict().values())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    opt.backward(ddp(torch.zeros(1, 4, dtype=torch.long)).float().sum())
    assert opt.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adafactor(ps, lr=1e-2),  # 4e-3 to 1e-2 off torch at every step
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2),  # state_dict() raised KeyError
        lambda ps: torch.optim.Rprop(ps, lr=1e-2),  # 1e-2 off: step sizes zeroed for a late one
        lambda ps: torch.optim.ASGD(ps, lr=1e-2),  # averages 3e-3 off after skipped steps
    ],
    ids=["Adafactor", "Adagrad", "Rprop", "ASGD"],
)
def test_optimizers_that_cannot_step_chunk_shards_are_refused(make):
    """zero-shard's [Note: optimizers over flat pieces]: each gave other
    results than torch's over chunks, silently."""
    model = GeminiDDP(_model(), chunk_config_dict=CFG, compute_device="cpu")
    with pytest.raises(NotImplementedError, match=r"cannot step the chunk shards holding many"):
        GeminiOptimizer(make(list(model.parameters())), model)


def test_pickling_the_wrapped_module_says_how_to_save():
    """torch.save(module) of a GeminiDDP-wrapped module failed with torch's
    "cannot pickle 'weakref.ReferenceType' object"."""
    import io

    model = GeminiDDP(
        _model(), mixed_precision=torch.float32, chunk_config_dict=CFG, compute_device="cpu"
    )
    with pytest.raises(NotImplementedError, match=r"GeminiDDP: pickling a module wrapped by GeminiDDP is not supported .*booster\.save_model\(model, path\)"):  # fmt: skip
        torch.save(model.module, io.BytesIO())
