"""Differences in ULPs of the row's magnitude, beside the per-element ULPs, checked against hand-derived values.

A BF16 value x (normal) has the ULP 2**(floor(log2 |x|) - 7); the row-magnitude ULP distance of an element
is |a - b| divided by the ULP of the largest |reference| in its row (the last dimension).
"""

from __future__ import annotations

import math

import torch
from ulptrace.comparison import diff_records
from ulptrace.report import to_markdown, to_table
from ulptrace.trace import Record
from ulptrace.ulp import ROW_HISTOGRAM_BUCKETS, row_histogram, row_ulp_distance


def bf16_ulp(x: float) -> float:
    """The BF16 ULP of ``x`` by hand: frexp gives x = m * 2**e with 0.5 <= m < 1, so floor(log2 x) = e - 1."""
    if x == 0:
        return 2.0 ** -133  # BF16's smallest subnormal: below the normal range the ULP stays the subnormal step
    return 2.0 ** (math.frexp(abs(x))[1] - 1 - 7)


REFERENCE = [[4.0, 2.0 ** -7, -1.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]
CANDIDATE = [[4.0, 2.0 ** -6, -1.0 - 2.0 ** -7], [1.0, 2.0, 3.5], [0.0, 2.0 ** -133, 0.0]]


def expected_row_ulps() -> list[list[float]]:
    out = []
    for ref, cand in zip(REFERENCE, CANDIDATE):
        unit = bf16_ulp(max(abs(v) for v in ref))
        out.append([abs(a - b) / unit for a, b in zip(ref, cand)])
    return out


def test_hand_derived_values() -> None:
    # row 0: unit 2**-5; the near-zero element moved 2**-7 (128 of its own ULPs) = 0.25 row ULP
    assert expected_row_ulps() == [[0.0, 0.25, 0.25], [0.0, 0.0, 32.0], [0.0, 1.0, 0.0]]


def test_row_ulp_distance_matches_float64() -> None:
    ref = torch.tensor(REFERENCE, dtype=torch.bfloat16)
    cand = torch.tensor(CANDIDATE, dtype=torch.bfloat16)
    assert ref.double().tolist() == REFERENCE and cand.double().tolist() == CANDIDATE  # exactly representable
    dist = row_ulp_distance(ref, cand)
    assert dist.distance.tolist() == expected_row_ulps()
    assert not dist.nonfinite.any()
    assert row_histogram(dist) == {"0": 5, "<1": 2, "1": 1, "2": 0, "3-4": 0, "5-8": 0, "9-16": 0, ">16": 1,
                                   "nonfinite": 0}
    assert tuple(row_histogram(dist)) == ROW_HISTOGRAM_BUCKETS


def test_nonfinite_and_fractions_above_one() -> None:
    ref = torch.tensor([[1.0, 1.0, 1.0, float("nan")]], dtype=torch.bfloat16)
    cand = torch.tensor([[1.0 + 3 * 2.0 ** -7, float("inf"), 1.0, float("nan")]], dtype=torch.bfloat16)
    dist = row_ulp_distance(ref, cand)
    # 1 + 3/128: 3 row ULPs (unit 2**-7); inf on one side: nonfinite; NaN on both with the same bits: equal
    assert dist.distance.tolist() == [[3.0, -1.0, 0.0, 0.0]]
    assert dist.nonfinite.tolist() == [[False, True, False, False]]
    assert row_histogram(dist)["3-4"] == 1 and row_histogram(dist)["nonfinite"] == 1
    half = row_ulp_distance(torch.tensor([4.0], dtype=torch.bfloat16), torch.tensor([4.0 + 2 ** -5], dtype=torch.bfloat16))
    assert half.distance.tolist() == [1.0]
    # a fraction above one counts in the bucket of the next integer: 1.5 row ULPs -> "2"
    frac = row_ulp_distance(torch.tensor([[8.0, 0.0]], dtype=torch.bfloat16),
                            torch.tensor([[8.0, 1.5 * 2 ** -4]], dtype=torch.bfloat16))
    assert frac.distance.tolist() == [[0.0, 1.5]] and row_histogram(frac)["2"] == 1


def test_site_diff_json_and_reports_carry_the_row_measure() -> None:
    ref = Record("layers.0.mlp.down_proj", 0, "linear", 0, torch.tensor(REFERENCE, dtype=torch.bfloat16), {})
    cand = Record("layers.0.mlp.down_proj", 0, "linear", 0, torch.tensor(CANDIDATE, dtype=torch.bfloat16), {})
    diff = diff_records(ref, cand)
    assert diff.max_ulp == 128  # the per-element measure is kept: 2**-7 -> 2**-6 is 128 of the element's ULPs
    assert diff.max_row_ulp == 32.0
    assert diff.row_histogram["<1"] == 2 and diff.row_histogram[">16"] == 1
    data = {"sites": [diff.to_json()], "reference": {}, "candidate": {}, "missing": [], "extra": [],
            "mismatched": [], "first_difference": None, "onset": None}
    assert data["sites"][0]["max_row_ulp"] == 32.0 and data["sites"][0]["row_histogram"]["1"] == 1
    table = to_table(data, width=200)
    header = next(line for line in table.splitlines() if line.startswith("step"))
    assert "max ulp" in header and "row ulp" in header
    row = next(line for line in table.splitlines() if line.startswith("0 "))
    assert row.split()[3:7] == ["9", "4", "128", "32"]  # elements, differing, max ulp, row ulp
    assert "| row ulp | ulp histogram | row-ulp histogram |" in to_markdown(data)
    assert "| 128 | 32 | 0:5 1:2 >16:2 | 0:5 <1:2 1:1 >16:1 |" in to_markdown(data)


def test_integer_records_have_no_row_measure() -> None:
    ref = Record("ids", 0, "other", None, torch.tensor([[1, 2]]), {})
    diff = diff_records(ref, Record("ids", 0, "other", None, torch.tensor([[1, 3]]), {}))
    assert diff.max_row_ulp is None and diff.row_histogram == {}
