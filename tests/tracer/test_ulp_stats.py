"""``ulp_stats`` (the fast statistics the comparison uses) equals the reference definition
``ulp_histogram(ulp_distance(a, b))`` on every format, with NaN, infinities, signed zeros, equal and
differing tensors, small and chunked sizes."""

from __future__ import annotations

import pytest
import torch
import ulptrace.ulp as U
from ulptrace.ulp import FORMATS, ulp_distance, ulp_histogram, ulp_stats


def _reference(a, b):
    d = ulp_distance(a, b)
    h = ulp_histogram(d)
    finite = d.distance[~d.nan]
    return a.numel() - h["0"], int(finite.max()) if finite.numel() else 0, h


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
@pytest.mark.parametrize("n", [1, 257, 70_000])
def test_equals_the_reference_definition(dtype, n, compiled, monkeypatch) -> None:
    monkeypatch.setattr(U, "_CPU_CHUNK", 4096)  # several chunks at n = 70,000
    if not compiled:  # the torch path (where no C compiler is found)
        monkeypatch.setattr(U, "_cpu_stats", lambda: None)
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, generator=gen).mul(4).to(dtype)
    for case in range(6):
        b = a.clone()
        if case >= 1:
            idx = torch.randint(0, n, (max(1, n // 50),), generator=gen)
            b[idx] = (a[idx].float() * (1 + 0.3 * torch.randn(idx.numel(), generator=gen))).to(dtype)
        if case >= 3 and n > 10:
            a2 = a.clone()
            a2[:3], b[1:4] = float("nan"), float("nan")
            a2[5], b[5] = 0.0, -0.0
            if dtype != torch.float8_e4m3fn:
                a2[7], b[9] = float("inf"), float("-inf")
        else:
            a2 = a
        if case == 5:
            b = a2.clone()  # bitwise equal, NaN included: the NaN still counts as nonfinite
        assert tuple(ulp_stats(a2, b)) == _reference(a2, b), (dtype, n, case)


def test_hand_derived_bf16_patterns() -> None:
    # 1.0 = 0x3F80; its neighbours 0x3F81 (+1 ULP) and 0x3F7F (-1 ULP); -0 vs +0 is 0 apart
    a = torch.tensor([0x3F80, 0x3F80, 0x0000, 0x3F80], dtype=torch.int16).view(torch.bfloat16)
    b = torch.tensor([0x3F81, 0x3F7F, -0x8000, 0x3F90], dtype=torch.int16).view(torch.bfloat16)
    stats = ulp_stats(a, b)
    assert stats.histogram == {"0": 1, "1": 2, "2": 0, "3-4": 0, "5-8": 0, "9-16": 1, ">16": 0, "nonfinite": 0}
    assert stats.max_ulp == 16 and stats.differing == 3


def test_bad_input_names_expected_and_found() -> None:
    with pytest.raises(TypeError, match="same dtype"):
        ulp_stats(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2))
    with pytest.raises(ValueError, match=r"same shape, but got \(2,\) and \(3,\)"):
        ulp_stats(torch.zeros(2), torch.zeros(3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_fused_cuda_statistics_equal_the_reference_definition(dtype) -> None:
    from ulptrace import _ulp_triton

    assert _ulp_triton.AVAILABLE, "Triton must be installed on the GPU machine (the fused path is what is tested)"

    gen = torch.Generator().manual_seed(1)
    n = 3 * 4096 + 77
    a = torch.randn(n, generator=gen).mul(4).to(dtype)
    b = a.clone()
    idx = torch.randint(0, n, (n // 7,), generator=gen)
    b[idx] = (a[idx].float() * (1 + 0.3 * torch.randn(idx.numel(), generator=gen))).to(dtype)
    a[:3], b[1:4], a[5], b[5] = float("nan"), float("nan"), 0.0, -0.0
    assert tuple(ulp_stats(a.cuda(), b.cuda())) == _reference(a, b)


def test_grouped_histograms_equal_one_histogram_per_group() -> None:
    from ulptrace.ulp import grouped_histograms

    gen = torch.Generator().manual_seed(3)
    a = torch.randn(5000, generator=gen).bfloat16()
    b = (a.float() * (1 + 0.05 * torch.randn(5000, generator=gen))).bfloat16()
    a[:5], b[3:9] = float("nan"), float("inf")
    groups = torch.randint(0, 4, (5000,), generator=gen, dtype=torch.uint8)
    d = ulp_distance(a, b)
    got = grouped_histograms(d, groups, 5)  # group 4 is empty
    for g in range(5):
        hit = groups == g
        assert got[g] == ulp_histogram(d.distance[hit], d.nan[hit]), g
    with pytest.raises(ValueError, match=r"groups must have the distances' shape \(5000,\), but got \(3,\)"):
        grouped_histograms(d, groups[:3], 5)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_grouped_ulp_histograms_equal_one_histogram_per_unit_and_code(dtype, compiled, monkeypatch) -> None:
    """Groups given per unit (a stack of records: each unit's first group, plus a code per element — a verdict) count
    each element once, in its group's histogram of the reference definition: every format, with NaN, infinities and
    signed zeros, distances in every bucket, codes up to 255, groups left empty, units of a few elements and many; the
    compiled pass, the torch operations, and the torch operations again where the compiled pass declines (it returns
    None)."""
    from ulptrace.ulp import grouped_ulp_histograms

    if not compiled:
        monkeypatch.setattr(U, "_cpu_stats", lambda: None)
    gen = torch.Generator().manual_seed(11)
    units, per_unit = 37, 1031  # a block's worth and more a unit, and a remainder beyond blocks of four
    n = units * per_unit
    a = torch.randn(n, generator=gen).mul(4).to(dtype)
    scale = torch.exp2(torch.randint(-12, 0, (n,), generator=gen).float())
    b = (a.float() * (1 + scale * torch.randn(n, generator=gen))).to(dtype)
    a[:3], b[1:4], a[5], b[5], b[6], a[7] = float("nan"), float("nan"), 0.0, -0.0, float("inf"), -float("inf")
    a, b = a.reshape(units, per_unit), b.reshape(units, per_unit)
    codes = torch.randint(0, 4, (units, per_unit), generator=gen, dtype=torch.uint8)
    codes[3, :9] = 255
    bases = torch.randint(0, 6, (units,), generator=gen) * 4
    n_groups = 255 + 21 + 2  # the last two never hit
    got = grouped_ulp_histograms(a, b, codes, bases, n_groups)
    groups = codes.long() + bases.unsqueeze(1)
    d = ulp_distance(a, b)
    assert len(got) == n_groups
    for g in range(n_groups):
        hit = groups == g
        assert got[g] == ulp_histogram(d.distance[hit], d.nan[hit]), g
    assert sum(h["nonfinite"] for h in got) >= 4 and sum(h[">16"] for h in got) > 0
    if compiled:  # where the compiled pass declines, the torch operations count
        from ulptrace import _ulp_cpu

        monkeypatch.setattr(_ulp_cpu, "grouped", lambda *args: None)
        assert grouped_ulp_histograms(a, b, codes, bases, n_groups) == got


def test_grouped_ulp_histograms_hand_derived_and_bad_input() -> None:
    """BF16 patterns by hand: 1.0 against its neighbours 1, 2, 3 and 17 steps up, -0 against +0, the smallest
    subnormals of both signs (2 apart), NaN; two units of three elements, groups 10 + code; then the errors."""
    from ulptrace.ulp import grouped_ulp_histograms

    one = 0x3F80
    a = torch.tensor([one, one, one, one, -0x8000, 0x0001], dtype=torch.int16).view(torch.bfloat16)
    b = torch.tensor([one + 1, one + 2, one + 3, one + 17, 0x0000, -0x7FFF], dtype=torch.int16).view(torch.bfloat16)
    codes = torch.tensor([0, 0, 1, 0, 1, 1], dtype=torch.uint8)
    got = grouped_ulp_histograms(a, b, codes, torch.tensor([10, 12]), 14)
    assert all(h == dict.fromkeys(U.HISTOGRAM_BUCKETS, 0) for g, h in enumerate(got) if g not in (10, 11, 12, 13))
    assert got[10] == {**dict.fromkeys(U.HISTOGRAM_BUCKETS, 0), "1": 1, "2": 1}
    assert got[11] == {**dict.fromkeys(U.HISTOGRAM_BUCKETS, 0), "3-4": 1}
    assert got[12] == {**dict.fromkeys(U.HISTOGRAM_BUCKETS, 0), ">16": 1}
    assert got[13] == {**dict.fromkeys(U.HISTOGRAM_BUCKETS, 0), "0": 1, "2": 1}
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16)
    assert grouped_ulp_histograms(nan, nan, codes[:1], torch.tensor([0]), 1)[0]["nonfinite"] == 1
    with pytest.raises(ValueError, match=r"groups must lie in 0 \.\. 11, but reach 13"):
        grouped_ulp_histograms(a, b, codes, torch.tensor([10, 12]), 12)
    with pytest.raises(ValueError, match=r"groups must lie in 0 \.\. 13, but reach -2"):
        grouped_ulp_histograms(a, b, codes, torch.tensor([-2, 0]), 14)
    with pytest.raises(ValueError, match=r"splits into the 4 units of bases \(1-D\), but got \(6,\), \(6,\), \(6,\)"):
        grouped_ulp_histograms(a, b, codes, torch.zeros(4, dtype=torch.int64), 14)
    with pytest.raises(ValueError, match=r"but got \(6,\), \(5,\), \(6,\)"):
        grouped_ulp_histograms(a, b[:5], codes, torch.tensor([0, 0]), 14)
    with pytest.raises(TypeError, match="same dtype, but got torch.bfloat16 and torch.float32"):
        grouped_ulp_histograms(a, b.float(), codes, torch.tensor([0, 0]), 14)
    with pytest.raises(TypeError, match="codes must be an integer tensor, but got torch.float32"):
        grouped_ulp_histograms(a, b, codes.float(), torch.tensor([0, 0]), 14)


def _grid_stride_case(dtype):
    gen = torch.Generator().manual_seed(3)
    from ulptrace._ulp_triton import BLOCK

    n = 4 * BLOCK + 77  # five blocks: with two programs, each walks two or three of them
    a = torch.randn(n, generator=gen).mul(4).to(dtype)
    b = a.clone()
    idx = torch.randint(0, n, (n // 5,), generator=gen)
    b[idx] = (a[idx].float() * (1 + 0.3 * torch.randn(idx.numel(), generator=gen))).to(dtype)
    a[:3], b[1:4], a[5], b[5] = float("nan"), float("nan"), 0.0, -0.0
    b[-1] = -a[-1].float() if a[-1].float() != 0 else 1.0  # the last (partial) block differs too
    return a, b


def _fused_ulp_stats(a, b, **kw):
    from ulptrace import _ulp_triton

    counts, top = _ulp_triton.stats(U.bits(a), U.bits(b), FORMATS[a.dtype], **kw)
    return a.numel() - counts[0], top, dict(zip(U.HISTOGRAM_BUCKETS, counts))


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1", reason="needs Triton with TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=str)
def test_grid_stride_kernel_in_the_triton_interpreter(dtype) -> None:
    """Each program of ulp_stats' kernel walks several blocks and adds its counts once: equal to the definition."""
    pytest.importorskip("triton")
    a, b = _grid_stride_case(dtype)
    assert _fused_ulp_stats(a, b, max_programs=2) == _reference(a, b)
    assert _fused_ulp_stats(a, b) == _reference(a, b)  # one block per program


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(FORMATS), ids=str)
def test_grid_stride_kernel_on_the_gpu(dtype) -> None:
    a, b = _grid_stride_case(dtype)
    expected = _reference(a, b)
    for programs in (1, 2, 3, None):
        assert _fused_ulp_stats(a.cuda(), b.cuda(), max_programs=programs) == expected, programs


def _distance_ladder():
    """BF16 pairs at every ordered-key distance 0..40 from 1.0, across zero (-2**-130 .. +), to NaN and to inf:
    each histogram bucket's edges (2/3, 4/5, 8/9, 16/17) are hit, with the counts derived by hand."""
    base = 0x3F80  # 1.0
    ks = list(range(41))
    a = [base] * len(ks) + [0x8001, 0x0000, 0x7F80, 0x7FC0, 0x3F80]
    b = [base + k for k in ks] + [0x0002, 0x8000, 0x7F7F, 0x3F80, 0xFFC1]
    # across zero: -1 subnormal ULP to +2 -> 3 ULPs; -0 vs +0 -> 0 ULPs apart but not the same bits; +inf vs the
    # largest finite -> 1; NaN against 1.0 and 1.0 against a negative NaN -> nonfinite
    to = lambda xs: torch.tensor(xs, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    counts = {"0": 1 + 1, "1": 1 + 1, "2": 1, "3-4": 2 + 1, "5-8": 4, "9-16": 8, ">16": 24, "nonfinite": 2}
    return to(a), to(b), counts, 40


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1", reason="needs Triton with TRITON_INTERPRET=1")
def test_fused_histogram_edges_in_the_triton_interpreter() -> None:
    pytest.importorskip("triton")
    a, b, counts, top = _distance_ladder()
    assert _fused_ulp_stats(a, b) == (a.numel() - counts["0"], top, counts)
    assert tuple(ulp_stats(a, b)) == (a.numel() - counts["0"], top, counts)  # the CPU pass agrees


@pytest.mark.gpu
def test_fused_histogram_edges_on_the_gpu() -> None:
    a, b, counts, top = _distance_ladder()
    assert tuple(ulp_stats(a.cuda(), b.cuda())) == (a.numel() - counts["0"], top, counts)


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1", reason="needs Triton with TRITON_INTERPRET=1")
def test_fused_counters_never_overflow_in_the_triton_interpreter(monkeypatch) -> None:
    """The kernel counts each lane's buckets in FIELD_BITS-bit fields; the launch takes enough programs that no lane
    passes a field's largest value, whatever ``max_programs`` asks: with 2-bit fields (3 a lane) and one program
    asked for, the five blocks' counts still equal the definition (one program would count 5 per lane and spill)."""
    pytest.importorskip("triton")
    from ulptrace import _ulp_triton

    a, b = _grid_stride_case(torch.bfloat16)  # five of the module's blocks
    monkeypatch.setattr(_ulp_triton, "FIELD_BITS", 2)
    assert _fused_ulp_stats(a, b, max_programs=1) == _reference(a, b)
