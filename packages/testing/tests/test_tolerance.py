"""tolerance() and assert_close()."""

from __future__ import annotations

import pytest
import torch

from zerostack.testing import assert_close, tolerance


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
