"""tolerance(), training_tolerance(), loss_tolerance() and assert_close()."""

from __future__ import annotations

import math

import pytest
import torch

from zerostack.testing import (
    GPTConfig,
    TinyGPT,
    assert_close,
    loss_tolerance,
    make_batch,
    tolerance,
    training_tolerance,
)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float64, (1e-12, 1e-12)),
        (torch.float32, (1.3e-6, 1e-6)),
        (torch.bfloat16, (1.6e-2, 1e-5)),
        (torch.float16, (1e-3, 1e-5)),
        (torch.int64, (0.0, 0.0)),
        (torch.bool, (0.0, 0.0)),
    ],
)
def test_tolerance_table(dtype, expected) -> None:
    assert tolerance(dtype) == expected


def test_tolerance_refuses_unknown_dtypes() -> None:
    with pytest.raises(ValueError, match=r"tolerance: no default tolerance for this dtype"):
        tolerance(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"tolerance: dtype must be a torch.dtype \(got str\)"):
        tolerance("float32")  # type: ignore[arg-type]


def test_passes_within_the_dtype_tolerance() -> None:
    expected = torch.linspace(-2, 2, 101, dtype=torch.float32)
    assert_close(expected * (1 + 1e-6), expected)
    assert_close(expected.bfloat16(), expected)  # bf16 tolerance, from actual's dtype
    assert_close(expected.double() + 1e-13, expected.double())
    assert_close([1.0, 2.0], [1.0, 2.0 + 1e-13])  # Python numbers: float64 tolerance
    assert_close(torch.arange(5), torch.arange(5))


def test_fails_outside_the_tolerance_with_the_errors_and_index() -> None:
    expected = torch.zeros(3, 4)
    actual = expected.clone()
    actual[2, 1] = 0.5
    actual[0, 3] = 1e-7  # within atol: not counted
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, msg="step 3, param blocks.0.attn.qkv.weight")
    message = str(info.value)
    assert message.startswith("step 3, param blocks.0.attn.qkv.weight\n")
    assert "1 of 12 elements differ beyond rtol=1.3e-06, atol=1e-06" in message
    assert "max abs error 0.5 at index (2, 1) (actual 0.5, expected 0)" in message
    assert "max rel error inf at index (2, 1)" in message


def test_reports_the_worst_absolute_and_relative_elements() -> None:
    expected = torch.tensor([100.0, 1.0, 5.0], dtype=torch.float64)
    actual = torch.tensor([101.0, 1.5, 5.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"2 of 3 elements") as info:
        assert_close(actual, expected)
    message = str(info.value)
    assert "max abs error 1 at index (0,) (actual 101, expected 100)" in message
    assert "max rel error 0.5 at index (1,) (actual 1.5, expected 1)" in message


def test_the_dtype_argument_picks_the_tolerance() -> None:
    expected = torch.ones(10)
    actual = expected + 1e-3  # fine for bf16, not for fp32
    assert_close(actual, expected, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match=r"max abs error 0\.001"):
        assert_close(actual, expected)


def test_rtol_and_atol_override_the_defaults_one_at_a_time() -> None:
    expected = torch.full((4,), 10.0)
    actual = expected + 0.01
    assert_close(actual, expected, rtol=1e-3)
    assert_close(actual, expected, atol=0.02)
    with pytest.raises(AssertionError, match=r"rtol=0\.0001, atol=1e-06"):
        assert_close(actual, expected, rtol=1e-4)


def test_nan_never_matches_and_infinities_match_themselves() -> None:
    inf = float("inf")
    assert_close(torch.tensor([inf, -inf, 1.0]), torch.tensor([inf, -inf, 1.0]))
    with pytest.raises(AssertionError, match=r"max abs error inf at index \(0,\)"):
        assert_close(torch.tensor([inf]), torch.tensor([-inf]))
    with pytest.raises(
        AssertionError, match=r"1 of 2 elements .*\n.*max abs error inf at index \(1,\)"
    ):
        assert_close(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]))


def test_shape_mismatch_fails() -> None:
    with pytest.raises(
        AssertionError,
        match=r"assert_close: shapes differ \(got actual \(3,\), expected \(1, 3\)\)",
    ):
        assert_close(torch.zeros(3), torch.zeros(1, 3))


def test_complex_is_refused() -> None:
    with pytest.raises(TypeError, match=r"assert_close: complex tensors are not supported"):
        assert_close(torch.zeros(2, dtype=torch.complex64), torch.zeros(2))


def test_grad_tracking_tensors_and_scalars_work() -> None:
    weight = torch.ones(2, requires_grad=True)
    assert_close(weight * 2, torch.full((2,), 2.0))
    with pytest.raises(
        AssertionError, match=r"1 of 1 elements .*\n  max abs error 1 at index \(\)"
    ):
        assert_close(torch.tensor(2.0), torch.tensor(1.0))


# -- training_tolerance / loss_tolerance ------------------------------------------

LOW = [torch.bfloat16, torch.float16]
# TinyGPT's roundings in sequence, forward and backward: about six per block
# (two norms, qkv, attention, proj, mlp) plus embedding, final norm and head.
CONFIG = GPTConfig(bias=False)
DEPTH = 2 * (6 * CONFIG.num_layers + 3)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.bfloat16, (2.0**-8, 1.62062e-2)), (torch.float16, (2.0**-11, 1.61785e-2))],
)
def test_adam_tolerance_after_8_steps(dtype, expected) -> None:
    rtol, atol = training_tolerance(dtype, steps=8, lr=1e-3)
    assert rtol == expected[0]
    assert atol == pytest.approx(expected[1], rel=1e-5)
    # One step: each run moves at most lr, so they differ by at most 2 lr.
    eps = torch.finfo(dtype).eps
    one = training_tolerance(dtype, steps=1, lr=1e-3)[1]
    assert one == pytest.approx(2e-3 + eps / 2 * (1e-3 + torch.finfo(dtype).tiny), rel=1e-9)
    # No step: only the initial rounding, all in rtol.
    assert training_tolerance(dtype, steps=0, lr=1e-3) == (
        eps / 2,
        eps / 2 * torch.finfo(dtype).tiny,
    )


def test_adam_step_bound_is_the_largest_update_adam_can_make() -> None:
    # The atol grows by (2 + eps/2) * lr * B_t at step t: read B_t back and
    # check it against torch's Adam, run on histories that probe the bound.
    eps = torch.finfo(torch.bfloat16).eps
    steps, beta1, beta2 = 8, 0.9, 0.999

    def atol(k):
        return training_tolerance(torch.bfloat16, steps=k, lr=1.0, betas=(beta1, beta2))[1]

    bound = [(atol(t) - atol(t - 1)) / (2 + eps / 2) for t in range(1, steps + 1)]
    assert bound[0] == pytest.approx(1.0)
    assert bound[-1] == pytest.approx(1.0278, abs=1e-4)
    gen = torch.Generator().manual_seed(0)
    # Random signs and scales, many near zero.
    histories = torch.randn(steps, 4096, generator=gen, dtype=torch.float64)
    histories *= torch.rand(steps, 4096, generator=gen, dtype=torch.float64) ** 8
    # Element 0: the history that attains the bound at the last step,
    # g_i proportional to a_i / b_i.
    t = steps
    for i in range(1, t + 1):
        a = (1 - beta1) * beta1 ** (t - i) / (1 - beta1**t)
        b = (1 - beta2) * beta2 ** (t - i) / (1 - beta2**t)
        histories[i - 1, 0] = a / b
    param = torch.zeros(4096, dtype=torch.float64, requires_grad=True)
    adam = torch.optim.Adam([param], lr=1.0, betas=(beta1, beta2), eps=0.0)
    for step in range(steps):
        before = param.detach().clone()
        param.grad = histories[step].clone()
        adam.step()
        moved = (param.detach() - before).abs()
        assert float(moved.max()) <= bound[step] * (1 + 1e-9), f"step {step + 1}"
    assert float(moved[0]) == pytest.approx(bound[-1], rel=1e-9)


def test_sgd_tolerance_is_delta_of_the_largest_movement() -> None:
    lr, momentum, max_grad, steps = 0.5, 0.9, 1e-3, 8
    # Constant gradients of the bound move an element the most: M.
    param = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    sgd = torch.optim.SGD([param], lr=lr, momentum=momentum)
    for _ in range(steps):
        param.grad = torch.full((1,), max_grad, dtype=torch.float64)
        sgd.step()
    movement = float(param.detach().abs())
    for dtype in LOW:
        eps = torch.finfo(dtype).eps
        rtol, atol = training_tolerance(
            dtype,
            steps=steps,
            lr=lr,
            optimizer="sgd",
            momentum=momentum,
            max_grad=max_grad,
            depth=DEPTH,
        )
        assert rtol == eps / 2
        expected = eps * math.sqrt(DEPTH) * movement + eps / 2 * (
            movement + torch.finfo(dtype).tiny
        )
        assert atol == pytest.approx(expected, rel=1e-9)
        # Without momentum, linear in the step count past the constant term.
        base, *flat = (
            training_tolerance(dtype, steps=k, lr=lr, optimizer="sgd", max_grad=max_grad)[1]
            for k in (0, 1, 2, 4)
        )
        assert base == eps / 2 * torch.finfo(dtype).tiny
        step = flat[0] - base
        assert [f - base for f in flat] == pytest.approx([step, 2 * step, 4 * step])


def test_loss_tolerance() -> None:
    assert loss_tolerance(torch.bfloat16, depth=4) == (2 * 2.0**-7, 0.0)
    assert loss_tolerance(torch.float16, depth=1) == (2.0**-10, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            dict(dtype=torch.float32),
            ValueError,
            r"dtype must be torch.float16 or torch.bfloat16 \(got torch.float32\); fp32 paths match to about 1e-6",
        ),
        (dict(dtype="bf16"), TypeError, r"dtype must be a torch.dtype \(got str\)"),
        (dict(steps=-1), ValueError, r"steps must be an int >= 0 \(got -1\)"),
        (dict(steps=2.0), ValueError, r"steps must be an int >= 0 \(got 2.0\)"),
        (dict(lr=0.0), ValueError, r"lr must be > 0 \(got 0.0\)"),
        (
            dict(optimizer="adamw"),
            ValueError,
            r"optimizer must be 'adam' or 'sgd' \(got 'adamw'\); AdamW and HybridAdam are 'adam'",
        ),
        (
            dict(betas=(0.9, 1.0)),
            ValueError,
            r"betas must each be in \[0, 1\) \(got \(0.9, 1.0\)\)",
        ),
        (
            dict(optimizer="sgd"),
            ValueError,
            r"optimizer 'sgd' needs max_grad >= 0, .* \(got None\)",
        ),
        (
            dict(optimizer="sgd", max_grad=1.0, momentum=1.0),
            ValueError,
            r"momentum must be in \[0, 1\) \(got 1.0\)",
        ),
        (dict(depth=0), ValueError, r"depth must be an int >= 1 \(got 0\)"),
    ],
)
def test_training_tolerance_refuses_bad_arguments(kwargs, error, match) -> None:
    args = dict(dtype=torch.bfloat16, steps=8, lr=1e-3) | kwargs
    dtype = args.pop("dtype")
    with pytest.raises(error, match=r"training_tolerance: " + match):
        training_tolerance(dtype, **args)
    with pytest.raises(ValueError, match=r"loss_tolerance: depth must be an int >= 1 \(got 0\)"):
        loss_tolerance(torch.float16, depth=0)


# An fp32-master, low-precision-compute training loop (what Gemini, DeepSpeed
# and Megatron do) against the fp32 reference, compared under the derived
# tolerance: the correct reference passes every step, wrong ones fail.
STEPS = 8
SGD_LR, ADAM_LR = 0.5, 1e-3


def _train(dtype, kind, lr, *, skip=None):
    """Masters and the largest gradient element after each step."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG).to(dtype)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    if kind == "sgd":
        opt = torch.optim.SGD(masters, lr=lr, momentum=0.9)
    else:  # Adam in L2 mode: weight decay goes through the gradient
        opt = torch.optim.Adam(masters, lr=lr, weight_decay=0.1)
    out = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        model(*make_batch(CONFIG, 4, 32, seed=step)).float().backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(masters, 0.05)
        max_grad = max(float(m.grad.abs().max()) for m in masters)
        if step != skip:
            opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)
        out.append(([m.detach().clone() for m in masters], max_grad))
    return out


def _compare(dtype, kind, actual, expected, reference):
    """Raise at the first step where ``actual`` leaves the tolerance around ``expected``;
    ``reference`` (the correct fp32 run) gives the gradient bound."""
    lr = SGD_LR if kind == "sgd" else ADAM_LR
    for step in range(STEPS):
        max_grad = max(g for _, g in reference[: step + 1])
        rtol, atol = training_tolerance(
            dtype,
            steps=step + 1,
            lr=lr,
            optimizer=kind,
            momentum=0.9,
            max_grad=max_grad,
            depth=DEPTH,
        )
        for a, e in zip(actual[step][0], expected[step][0], strict=True):
            assert_close(a, e, rtol=rtol, atol=atol, msg=f"step {step + 1}")


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_training_passes_and_wrong_references_fail(dtype) -> None:
    for kind, lr in (("sgd", SGD_LR), ("adam", ADAM_LR)):
        run = _train(dtype, kind, lr)
        ref = _train(torch.float32, kind, lr)
        _compare(dtype, kind, run, ref, ref)
        # SGD shows the gradient's scale: twice the lr, or a missed step, fail
        # at once; Adam hides it up to 2x, but not a 4x learning rate.
        wrong = [("lr x2", dict(lr=2 * lr)), ("missed first step", dict(lr=lr, skip=0))]
        if kind == "adam":
            wrong = [("lr x4", dict(lr=4 * lr))]
        for what, kwargs in wrong:
            bad = _train(torch.float32, kind, **kwargs)
            with pytest.raises(AssertionError, match=r"^step 1\n") as info:
                _compare(dtype, kind, run, bad, ref)
            assert "elements differ beyond" in str(info.value), f"{kind} {what}"
