"""GeminiDDP in bf16/fp16 against DDP in fp32 with SGD, which shows a wrong
gradient scale (Adam hides it), under zerostack.testing.training_tolerance:
the correct reference passes every step and deliberately wrong ones (twice
the learning rate, a missed first step) fail every step (gloo, 2 ranks)."""

from __future__ import annotations

import copy

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.gemini import GeminiDDP, GeminiOptimizer
from zerostack.testing import (
    GPTConfig,
    TinyGPT,
    assert_close,
    loss_tolerance,
    make_batch,
    spawn,
    training_tolerance,
)

CONFIG = GPTConfig(bias=False)
STEPS = 8
LR, MOMENTUM = 0.5, 0.9
CHUNKS = {"chunk_size": 20_000, "keep_gathered": False}
# Roundings in sequence from a parameter to the loss and back: about six per
# block (two norms, qkv, attention, proj, mlp), plus embedding, norm and head.
DEPTH = 2 * (6 * CONFIG.num_layers + 3)
# (id, mixed_precision, max_norm, GeminiDDP arguments). fp16 without clipping:
# the loss scale's inverse, 2**-16, is exact in fp16.
CASES = [
    ("bf16-sgd-clip-offload", torch.bfloat16, 0.05, dict(offload_optim_frac=0.5)),
    ("fp16-sgd-offload", torch.float16, 0.0, dict(offload_optim_frac=0.5)),
]
# The reference's learning rate and the step it skips.
REFERENCES = {"right": (LR, None), "lr x2": (2 * LR, None), "missed first step": (LR, 0)}


def _run(rank, world, case, references):
    """Train the Gemini model and each reference; for each reference, the
    steps (1-based) at which the parameters leave the tolerance."""
    name, dtype, max_norm, kwargs = case
    torch.manual_seed(0)
    base = TinyGPT(CONFIG)
    refs = {}
    for what, (lr, skip) in references.items():
        module = DDP(copy.deepcopy(base))
        opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=MOMENTUM, foreach=False)
        refs[what] = (module, opt, skip)
    model = copy.deepcopy(base)
    ddp = GeminiDDP(
        model,
        mixed_precision=dtype,
        chunk_config_dict={world: CHUNKS},
        compute_device="cpu",
        **kwargs,
    )
    inner = torch.optim.SGD(list(model.parameters()), lr=LR, momentum=MOMENTUM, foreach=False)
    opt = GeminiOptimizer(inner, ddp, max_norm=max_norm)
    failed = {what: [] for what in references}
    max_grad = 0.0
    for step in range(1, STEPS + 1):
        idx, tgt = make_batch(CONFIG, 4, 32, seed=100 * step + rank)
        losses = {}
        for what, (module, ref_opt, skip) in refs.items():
            losses[what] = module(idx, tgt)
            losses[what].backward()
            if max_norm > 0:
                torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
            if what == "right":  # the largest gradient element so far bounds each update
                grads = [p.grad.abs().max() for p in module.parameters() if p.grad is not None]
                max_grad = max(max_grad, float(max(grads)))
            if step - 1 != skip:
                ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        loss = ddp(idx, tgt)
        opt.backward(loss.float())
        assert opt.step(), f"{name} step {step}: skipped"
        rtol, atol = loss_tolerance(dtype, depth=DEPTH)
        assert_close(loss, losses["right"], rtol=rtol, atol=atol, msg=f"{name} step {step} loss")
        rtol, atol = training_tolerance(
            dtype,
            steps=step,
            lr=LR,
            optimizer="sgd",
            momentum=MOMENTUM,
            max_grad=max_grad,
            depth=DEPTH,
        )
        full = ddp.state_dict()
        for what, (module, _, _) in refs.items():
            try:
                for pname, p in module.module.named_parameters():
                    assert_close(full[pname], p, rtol=rtol, atol=atol, msg=f"{name} {pname}")
            except AssertionError as e:
                failed[what].append(step)
                if what == "right":
                    raise AssertionError(f"{name} step {step} against the right reference") from e
    return failed


def _all(rank, world):
    for case in CASES:
        failed = _run(rank, world, case, REFERENCES)
        assert not failed["right"]
        for what in ("lr x2", "missed first step"):
            assert failed[what] == list(range(1, STEPS + 1)), f"{case[0]}, {what}: {failed[what]}"


def test_sgd_parity_in_low_precision_and_wrong_references_fail():
    spawn(_all, 2, backend="gloo", timeout_s=300)


def _fp16_clipped(rank, world):
    # The factor clip_coef / loss_scale: about 5e-7 at max_norm 0.05 (fp16
    # subnormals are 2**-24 apart), about 1e-8 at 1e-3 (below half of 2**-24).
    for max_norm in (0.05, 1e-3):
        case = (f"fp16-sgd-clip{max_norm}", torch.float16, max_norm, dict(offload_optim_frac=0.5))
        failed = _run(rank, world, case, {"right": (LR, None)})
        assert not failed["right"]


def test_fp16_sgd_with_clipping_applies_the_clip_coefficient():
    spawn(_fp16_clipped, 2, backend="gloo", timeout_s=300)
