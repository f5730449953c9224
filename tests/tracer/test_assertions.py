"""assert_ulp_close: budgets, the fixed failure layout, NaN/Inf rules, bad input, the failure log.

Tensors are built from hand-derived bit patterns (bfloat16 1.0 is 0x3F80, each +1 on the pattern is one
ULP = 2**-7 in [1, 2)) so the expected distances and printed values do not come from ulptrace itself.
"""

from __future__ import annotations

import math

import pytest
import torch
from ulptrace.assertions import UlpAssertionError, assert_ulp_close, drain_failures

ONE_BF16 = 0x3F80


def bf16_from_bits(bits: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16)


@pytest.fixture(autouse=True)
def _empty_log() -> None:
    drain_failures()


def test_passes_within_budget_and_on_signed_zeros() -> None:
    expected = bf16_from_bits([ONE_BF16] * 4)
    actual = bf16_from_bits([ONE_BF16, ONE_BF16 + 1, ONE_BF16 - 1, ONE_BF16 + 2])
    assert_ulp_close(actual, expected, max_ulp=2)
    assert_ulp_close(expected, expected)
    zeros = torch.tensor([0.0, -0.0], dtype=torch.bfloat16)
    assert_ulp_close(zeros, zeros.flip(0))
    assert_ulp_close(torch.empty(0, 3, dtype=torch.float16), torch.empty(0, 3, dtype=torch.float16))
    assert drain_failures() == []


def test_budget_boundary_is_inclusive() -> None:
    expected = bf16_from_bits([ONE_BF16])
    actual = bf16_from_bits([ONE_BF16 + 3])
    assert_ulp_close(actual, expected, 3)
    with pytest.raises(UlpAssertionError):
        assert_ulp_close(actual, expected, 2)


def test_failure_message_has_the_fixed_layout() -> None:
    # 4 x 30 of 1.0; three offenders at 2, 4 and 3 ULPs (one below 1.0, where the ULP is 2**-8)
    bits = [[ONE_BF16] * 30 for _ in range(4)]
    bits[0][3] = ONE_BF16 + 2  # 1 + 2 * 2**-7
    bits[1][7] = ONE_BF16 + 4  # 1 + 4 * 2**-7
    bits[2][1] = ONE_BF16 - 3  # 1 - 3 * 2**-8
    bits[3][0] = ONE_BF16 + 1  # within budget
    actual, expected = bf16_from_bits(bits), bf16_from_bits([[ONE_BF16] * 30] * 4)
    with pytest.raises(UlpAssertionError) as info:
        assert_ulp_close(actual, expected, max_ulp=1)
    assert (
        str(info.value)
        == "ULP budget exceeded: max_ulp=1 (bfloat16)\nMismatched elements: 3 / 120 (2.5%)\nGreatest ULP distance: 4 at index (1, 7) (actual=1.03125, expected=1.0)\nULP histogram: 0: 116 | 1: 1 | 2: 1 | 3-4: 2 | 5-8: 0 | 9-16: 0 | >16: 0 | nonfinite: 0\nFirst offenders:\n  (0, 3): actual=1.015625, expected=1.0, ulp=2\n  (1, 7): actual=1.03125, expected=1.0, ulp=4\n  (2, 1): actual=0.98828125, expected=1.0, ulp=3"
    )
    error = info.value
    assert (error.max_ulp, error.dtype, error.mismatched, error.total) == (1, torch.bfloat16, 3, 120)
    assert (error.greatest, error.index) == (4, (1, 7))
    assert error.histogram["3-4"] == 2 and sum(error.histogram.values()) == 120
    assert error.header == "ULP budget exceeded: max_ulp=1 (bfloat16)"
    assert isinstance(error, AssertionError)


def test_msg_and_offender_limit() -> None:
    expected = torch.ones(10, dtype=torch.float16)
    actual = torch.full((10,), float.fromhex("0x1.01p0"), dtype=torch.float16)  # 4 float16 ULPs (2**-10)
    with pytest.raises(UlpAssertionError) as info:
        assert_ulp_close(actual, expected, msg="layers.3.mlp.glu", max_offenders=2)
    lines = str(info.value).splitlines()
    assert lines[0] == "layers.3.mlp.glu"
    assert lines[1] == "ULP budget exceeded: max_ulp=0 (float16)"
    assert lines[-3:] == [
        "  (0,): actual=1.00390625, expected=1.0, ulp=4",
        "  (1,): actual=1.00390625, expected=1.0, ulp=4",
        "  ... and 8 more",
    ]
    with pytest.raises(UlpAssertionError) as info:
        assert_ulp_close(actual, expected, max_offenders=0)
    assert "First offenders" not in str(info.value)


def test_nan_rules() -> None:
    nan = math.nan
    both = torch.tensor([nan, 1.0], dtype=torch.bfloat16)
    assert_ulp_close(both, both.clone(), 0)
    with pytest.raises(UlpAssertionError) as info:
        assert_ulp_close(both, both.clone(), 0, equal_nan=False)
    assert info.value.histogram["nonfinite"] == 1 and info.value.greatest is None
    one_side = torch.tensor([1.0, nan], dtype=torch.bfloat16)
    with pytest.raises(UlpAssertionError) as info:
        assert_ulp_close(one_side, torch.ones(2, dtype=torch.bfloat16), max_ulp=10**6)
    text = str(info.value)
    assert "Greatest ULP distance: nonfinite at index (1,) (actual=nan, expected=1.0)" in text
    assert "  (1,): actual=nan, expected=1.0, ulp=nonfinite" in text
    assert info.value.mismatched == 1 and info.value.histogram["nonfinite"] == 1


def test_infinity_against_finite_is_never_within_budget() -> None:
    max_bf16 = float.fromhex("0x1.fep127")
    actual = torch.tensor([math.inf, -math.inf, math.inf], dtype=torch.bfloat16)
    expected = torch.tensor([max_bf16, math.inf, math.inf], dtype=torch.bfloat16)
    with pytest.raises(UlpAssertionError) as info:
        assert_ulp_close(actual, expected, max_ulp=10**9)
    assert info.value.mismatched == 2 and info.value.histogram["nonfinite"] == 2
    assert info.value.histogram["0"] == 1 and info.value.index == (0,)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_every_format_counts_one_step(dtype: torch.dtype) -> None:
    # 1.0 and the next value up: 1 + 2**-mantissa_bits, by hand
    mantissa = {
        torch.float32: 23,
        torch.bfloat16: 7,
        torch.float16: 10,
        torch.float8_e4m3fn: 3,
        torch.float8_e5m2: 2,
    }
    expected = torch.ones(3, dtype=torch.float32).to(dtype)
    actual = torch.tensor([1.0, 1.0 + 2.0 ** -mantissa[dtype], 1.0]).to(dtype)
    assert_ulp_close(actual, expected, 1)
    with pytest.raises(UlpAssertionError, match=r"Greatest ULP distance: 1 at index \(1,\)"):
        assert_ulp_close(actual, expected)


def test_bad_input_says_what_was_got() -> None:
    a = torch.ones(2, 3, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="same dtype, but got torch.bfloat16 and torch.float32"):
        assert_ulp_close(a, a.float())
    with pytest.raises(TypeError, match="but got torch.float64"):
        assert_ulp_close(a.double(), a.double())
    with pytest.raises(ValueError, match=r"same shape, but got \(2, 3\) and \(3, 2\)"):
        assert_ulp_close(a, a.reshape(3, 2))
    with pytest.raises(TypeError, match="expected must be a torch.Tensor, but got list"):
        assert_ulp_close(a, [1.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_ulp must be a non-negative int, but got -1"):
        assert_ulp_close(a, a, -1)
    with pytest.raises(TypeError, match="max_ulp must be a non-negative int, but got float 1.5"):
        assert_ulp_close(a, a, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_offenders"):
        assert_ulp_close(a, a, max_offenders=True)
    assert drain_failures() == []  # bad input is not an assertion failure


def test_failures_are_logged_once_for_the_plugin() -> None:
    expected = bf16_from_bits([ONE_BF16])
    raised = []
    for budget in (0, 1):
        with pytest.raises(UlpAssertionError) as info:
            assert_ulp_close(bf16_from_bits([ONE_BF16 + 5]), expected, budget)
        raised.append(info.value)
    logged = drain_failures()
    assert [id(e) for e in logged] == [id(e) for e in raised]
    assert drain_failures() == []


def test_traceback_is_hidden() -> None:
    assert "__tracebackhide__" in assert_ulp_close.__code__.co_varnames
