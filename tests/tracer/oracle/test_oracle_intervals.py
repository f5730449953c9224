"""The rounding model of the interval replay, checked against hand-derived values and against real FP32
evaluations in other orders."""

from __future__ import annotations

import math

import pytest
import torch
from ulptrace.oracle import intervals as I
from ulptrace.oracle.intervals import Iv
from ulptrace.ulp import round_to

F64 = torch.float64


@pytest.fixture(params=["compiled", "torch"])
def rounding(request, monkeypatch) -> str:
    """Each rounding test on both CPU paths: the compiled loop (``ulptrace._ulp_cpu.to_fp32``; CI has a C compiler)
    and the torch operations it stands in for."""
    from ulptrace import _ulp_cpu

    if request.param == "compiled":
        assert _ulp_cpu.library() is not None, _ulp_cpu.unavailable_reason()
    else:
        monkeypatch.setattr(I, "_compiled", lambda x: False)
    return request.param


def iv(values, lo=None, hi=None) -> Iv:
    x = torch.tensor(values, dtype=F64)
    return Iv(x if lo is None else torch.tensor(lo, dtype=F64), x if hi is None else torch.tensor(hi, dtype=F64), x)


def test_bf16_rounding_admits_the_double_rounding_through_fp32(rounding):
    # 1 + 2**-8 is the midpoint between BF16's 1.0 and 1 + 2**-7. Just above it, a single RNE gives 1 + 2**-7,
    # but an FP32 opmath result rounds onto the midpoint first and then ties to even, 1.0.
    x = 1 + 2.0**-8 + 2.0**-30
    r = I.round_iv(iv([x]), torch.bfloat16)
    assert r.lo.item() == 1.0 and r.hi.item() == 1 + 2.0**-7
    assert r.pt.item() == 1 + 2.0**-7
    # away from a midpoint, the set is one value
    r = I.round_iv(iv([1 + 2.0**-9]), torch.bfloat16)
    assert r.lo.item() == r.hi.item() == 1.0


def test_fp32_rounding_is_outward(rounding):
    exact = I.round_iv(iv([1.5]), torch.float32)
    assert exact.lo.item() == exact.hi.item() == 1.5 and exact.is_point
    r = I.round_iv(iv([1 / 3]), torch.float32)
    assert r.lo.item() == float.fromhex("0x1.555554p-2") and r.hi.item() == float.fromhex("0x1.555556p-2")
    assert r.pt.item() == float.fromhex("0x1.555556p-2")  # RNE of 0x1.5555555...p-2


def test_outward_rounding_steps_from_zeros_subnormals_and_the_largest_finite_value(rounding):
    """Hand-derived FP32 neighbours (the rounding's stepping targets are made once per dtype and device)."""
    tiny = 2.0**-149  # FP32's smallest subnormal
    fmax = float.fromhex("0x1.fffffep127")
    x = torch.tensor([-1e-50, 1e-50, tiny * 1.5, -tiny * 1.5, fmax * (1 + 2.0**-30), 0.0, -0.0], dtype=F64)
    r = I.round_iv(Iv(x, x, None), torch.float32)
    assert r.lo.tolist()[:5] == [-tiny, 0.0, tiny, -2 * tiny, fmax]
    assert r.hi.tolist()[:5] == [-0.0, tiny, 2 * tiny, -tiny, math.inf]
    assert [math.copysign(1, v) for v in r.lo.tolist()[5:]] == [1, -1]  # exact zeros keep their signs
    assert math.copysign(1, r.hi[0].item()) == -1  # -1e-50 rounds up to -0.0, not +0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_point_of_fp32_values_rounds_to_a_point(dtype, rounding) -> None:
    """A point whose elements are all FP32 values stays a point: FP32 keeps it, BF16/FP16 round each value once
    (ground truth: numpy / ml_dtypes casts from float32); a point with one element that is not an FP32 value takes
    the outward path (FP32: a proper interval around it)."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(0)
    f32 = np.concatenate([
        rng.standard_normal(64).astype(np.float32) * np.float32(1e3),
        np.array([0.0, -0.0, 2.0**-149, -(2.0**-126), 3.4e38, -np.inf, np.inf, 1 + 2.0**-8, 65520.0], dtype=np.float32),
    ])
    x = torch.from_numpy(f32.astype(np.float64))
    r = I.round_iv(I.point(x), dtype)
    assert r.is_point and r.pt is not None
    with np.errstate(over="ignore"):  # 3.4e38 overflows FP16 to inf, as the cast must
        want = {torch.float32: f32, torch.bfloat16: f32.astype(ml_dtypes.bfloat16), torch.float16: f32.astype(np.float16)}
    expected = torch.from_numpy(np.asarray(want[dtype]).astype(np.float64))
    assert torch.equal(r.lo.view(torch.int64), expected.view(torch.int64))  # signed zeros and infinities included
    assert torch.equal(r.pt.view(torch.int64), expected.view(torch.int64))
    y = torch.cat([x, torch.tensor([1 / 3], dtype=F64)])  # 1/3 is no FP32 value
    r = I.round_iv(I.point(y), dtype)
    assert (r.lo[:-1] == expected).all() and (r.hi[:-1] == expected).all()
    if dtype == torch.float32:
        assert not r.is_point and r.lo[-1].item() < 1 / 3 < r.hi[-1].item()


def test_scalar_intervals_keep_the_sign_of_zero_and_their_device():
    like = torch.zeros(3, dtype=F64)
    neg, pos = I.scalar_iv(-0.0, like), I.scalar_iv(0.0, like)
    assert torch.signbit(neg.lo) and not torch.signbit(pos.lo) and neg.lo.dtype == F64 and neg.lo.dim() == 0
    assert I.scalar_iv(0.1, like).lo.item() == 0.1 and math.isnan(I.scalar_iv(math.nan, like).lo.item())


def test_gamma_matches_its_definition():
    u = 2.0**-24
    assert I.gamma(1) == u / (1 - u) + 2.0**-52
    assert I.gamma(0) == 0.0
    assert I.unit_roundoff(torch.bfloat16) == 2.0**-8


def test_any_fp32_summation_order_lies_inside_the_reduction_bound():
    torch.manual_seed(1)
    x = (torch.randn(64, 300) * torch.logspace(-3, 3, 300)).float()  # wide dynamic range: real rounding
    bound = I.reduce_sum(I.point(x), [1], False, 299)
    orders = [torch.arange(300), torch.arange(299, -1, -1)] + [torch.randperm(300) for _ in range(6)]
    for order in orders:
        acc = torch.zeros(64)
        for j in order.tolist():
            acc = acc + x[:, j]
        s = acc.double()
        assert bool(((bound.lo <= s) & (s <= bound.hi)).all())
    pairwise = x
    while pairwise.shape[1] > 1:
        if pairwise.shape[1] % 2:
            pairwise = torch.cat([pairwise, torch.zeros(64, 1)], 1)
        pairwise = pairwise[:, 0::2] + pairwise[:, 1::2]
    s = pairwise[:, 0].double()
    assert bool(((bound.lo <= s) & (s <= bound.hi)).all())
    assert bool((bound.lo < bound.hi).all())


def test_bf16_matmul_lies_inside_the_matmul_interval():
    a = torch.randn(16, 96).to(torch.bfloat16)
    b = torch.randn(96, 24).to(torch.bfloat16)
    m = I.round_iv(I.matmul(I.point(a), I.point(b), 96), torch.bfloat16)
    for result in (a @ b, (a.float() @ b.float()).to(torch.bfloat16)):
        r = result.double()
        assert bool(((m.lo <= r) & (r <= m.hi)).all())


@pytest.mark.parametrize("operands", ["points", "intervals"])
def test_products_with_a_prepared_right_operand_enclose_every_choice_of_values(operands) -> None:
    """``matmul`` and ``nonneg_matmul`` enclose the float64 product of any values inside their operands — sampled
    inside and at every end — when the right operand is prepared once (``matmul_right``, ``nonneg_right``, as the
    blocked attention replay does) and when it is not, with identical results."""
    gen = torch.Generator().manual_seed(11)
    a_mid, b_mid = torch.randn(6, 40, generator=gen, dtype=F64), torch.randn(40, 5, generator=gen, dtype=F64)
    p_mid = torch.rand(6, 40, generator=gen, dtype=F64)  # probabilities: >= 0
    width = 0.0 if operands == "points" else 0.25
    iv = lambda m, w: I.point(m) if w == 0 else Iv(m - w * torch.rand(m.shape, generator=gen, dtype=F64),
                                                    m + w * torch.rand(m.shape, generator=gen, dtype=F64), None)
    a, b, p = iv(a_mid, width), iv(b_mid, width), iv(p_mid, width / 4)
    p = Iv(p.lo.clamp(min=0), p.hi, None) if width else p
    products = {
        "matmul": (I.matmul(a, b, 40), I.matmul(a, b, 40, I.matmul_right(b, a.is_point)), a, b),
        "nonneg": (I.nonneg_matmul(p, b, 40), I.nonneg_matmul(p, b, 40, I.nonneg_right(b)), p, b),
    }
    for name, (plain, prepared, left, right) in products.items():
        assert torch.equal(plain.lo, prepared.lo) and torch.equal(plain.hi, prepared.hi), name
        choices = [(left.lo, right.lo), (left.lo, right.hi), (left.hi, right.lo), (left.hi, right.hi)]
        for _ in range(20):  # values inside both operands
            t, u = torch.rand(left.lo.shape, generator=gen, dtype=F64), torch.rand(right.lo.shape, generator=gen,
                                                                                   dtype=F64)
            choices.append((left.lo + t * (left.hi - left.lo), right.lo + u * (right.hi - right.lo)))
        for x, y in choices:
            r = x @ y
            assert bool(((prepared.lo <= r) & (r <= prepared.hi)).all()), name
        # the exact range: each term's extremes are at its operands' ends, the terms independent
        terms = torch.stack([x.unsqueeze(-1) * y.unsqueeze(0) for x in (left.lo, left.hi) for y in (right.lo, right.hi)])
        assert bool((prepared.lo <= terms.amin(0).sum(1)).all() and (terms.amax(0).sum(1) <= prepared.hi).all()), name


def test_silu_interval_reaches_the_minimum():
    x_min, f_min = I.minimum_of("silu-test", lambda t: t * torch.sigmoid(t), -4.0, 0.0)
    # silu'(x) = 0 means sigmoid(x) = 1 + 1/x, hence silu(x*) = x* + 1; x* = -1.2784645427610738 (W(e^-1) + 1)
    true_x = -1.2784645427610738
    assert abs(x_min - true_x) < 1e-6
    assert f_min <= true_x + 1 and (true_x + 1) - f_min < 1e-12
    r = I.single_minimum(iv([0.0], lo=[-2.0], hi=[0.5]), lambda t: t * torch.sigmoid(t), x_min, f_min)
    grid = torch.linspace(-2.0, 0.5, 100001, dtype=F64)
    values = grid * torch.sigmoid(grid)
    assert r.lo.item() <= values.min().item() and r.hi.item() >= values.max().item()
    assert r.lo.item() > values.min().item() - 1e-9


def test_fp32_transcendentals_lie_inside_their_slack():
    x = torch.linspace(-30, 30, 20001, dtype=torch.float32)
    checks = [
        (torch.exp, I.monotone(I.point(x), torch.exp)),
        (torch.sigmoid, I.monotone(I.point(x), torch.sigmoid)),
        (torch.tanh, I.monotone(I.point(x), torch.tanh)),
        (torch.nn.functional.silu, I.single_minimum(I.point(x), lambda t: t * torch.sigmoid(t),
                                                    *I.minimum_of("silu", lambda t: t * torch.sigmoid(t), -4.0, 0.0))),
        (torch.nn.functional.softplus, I.monotone(I.point(x), lambda t: torch.log1p(torch.exp(-t.abs())) + t.clamp(min=0))),
    ]
    for fn, exact in checks:
        r = I.round_iv(I.approx_slack(exact, torch.float32), torch.float32)
        y = fn(x).double()
        assert bool(((r.lo <= y) & (y <= r.hi)).all()), fn
    positive = torch.linspace(1e-6, 1e4, 20001, dtype=torch.float32)
    r = I.round_iv(I.approx_slack(I.monotone(I.point(positive), torch.rsqrt, increasing=False), torch.float32),
                   torch.float32)
    y = torch.rsqrt(positive).double()
    assert bool(((r.lo <= y) & (y <= r.hi)).all())


def test_softmax_interval_contains_fp32_softmax_of_perturbed_inputs():
    torch.manual_seed(2)
    scores = torch.randn(8, 50, dtype=F64) * 4
    width = torch.rand(8, 50, dtype=F64) * 1e-3
    s = I.softmax(Iv(scores - width, scores + width, scores), -1, torch.float32)
    for _ in range(20):
        inside = scores + (torch.rand(8, 50, dtype=F64) * 2 - 1) * width
        p = torch.softmax(inside.float(), -1).double()
        assert bool(((s.lo <= p) & (p <= s.hi)).all())
    masked = scores.clone()
    masked[:, :10] = -math.inf
    m = I.softmax(I.point(masked), -1, torch.float32)
    assert bool((m.lo[:, :10] == 0).all() and (m.hi[:, :10] == 0).all())


def test_interval_products_take_all_corners():
    a = Iv(torch.tensor([-2.0, 1.0], dtype=F64), torch.tensor([3.0, 2.0], dtype=F64), None)
    b = Iv(torch.tensor([-5.0, -1.0], dtype=F64), torch.tensor([4.0, 3.0], dtype=F64), None)
    p = I.mul(a, b)
    assert p.lo.tolist() == [-15.0, -2.0] and p.hi.tolist() == [12.0, 6.0]
    sq = I.square(a)
    assert sq.lo.tolist() == [0.0, 1.0] and sq.hi.tolist() == [9.0, 4.0]
    r = I.reciprocal(a)
    assert r.lo[0].item() == -math.inf and r.hi[0].item() == math.inf and r.lo[1].item() == 0.5


def test_rne_is_one_rounding_from_float64(rounding):
    torch.manual_seed(3)
    # random float64 bit patterns over a wide range, plus values just off BF16/FP16 midpoints
    x = torch.randn(200_000, dtype=F64) * torch.exp2(torch.randint(-140, 120, (200_000,)).to(F64))
    mid = torch.tensor([1 + 2.0**-8 + 2.0**-30, 1 + 2.0**-8 - 2.0**-30, 1 + 2.0**-11 + 2.0**-40, -(1 + 2.0**-8)],
                       dtype=F64)
    # and the ends of the range: infinities, NaN, signed zeros, beyond FP32's largest value, below its smallest
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e39, -1e39, 1e-50, -1e-50,
                            3.4028235677973366e38, 2.0**-149, 2.0**-150, 1.5 * 2.0**-149], dtype=F64)
    x = torch.cat([x, mid, special])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        expected = round_to(x, dtype).to(F64)
        got = I.rne(x, dtype)
        same = (got == expected) & (torch.signbit(got) == torch.signbit(expected)) | (torch.isnan(got) & torch.isnan(expected))
        assert bool(same.all()), dtype
    assert I.rne(mid[:1], torch.bfloat16).item() == 1 + 2.0**-7
    assert I.rne(mid[1:2], torch.bfloat16).item() == 1.0


def test_the_compiled_roundings_give_the_torch_operations_bits() -> None:
    """``_down32``, ``_up32`` and ``rne``'s round-to-odd on the CPU, compiled against the torch operations, bit for
    bit (NaN payloads and signed zeros included): the edges — zeros, subnormals, FP32's largest value and beyond, the
    infinities, NaNs of both signs — and random float64 bit patterns over the whole range, float64 values near FP32
    ones, and FP32 values themselves, in a strided view and a lazily negated one too."""
    from ulptrace import _ulp_cpu

    assert _ulp_cpu.library() is not None, _ulp_cpu.unavailable_reason()
    tiny, fmax = 2.0**-149, float.fromhex("0x1.fffffep127")
    edges = [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, tiny, -tiny, tiny / 2, -tiny / 2, tiny * 1.5,
             -tiny * 1.5, 1e-50, -1e-50, 2.0**-126, -(2.0**-126), fmax, -fmax, fmax * (1 + 2.0**-30),
             -fmax * (1 + 2.0**-30), float.fromhex("0x1.ffffffp127"), -float.fromhex("0x1.ffffffp127"), 1e300, -1e300,
             1 + 2.0**-24, -(1 + 2.0**-24), 1 + 2.0**-30, -(1 + 2.0**-30), 1 + 2.0**-8 + 2.0**-30]
    g = torch.Generator().manual_seed(5)
    patterns = torch.randint(-(2**63), 2**63 - 1, (50_000,), generator=g).view(F64)  # NaN payloads among them
    near = torch.randn(50_000, generator=g, dtype=F64).to(torch.float32).to(F64) * (1 + 2.0**-40)
    fp32 = torch.randn(50_000, generator=g, dtype=F64).to(torch.float32).to(F64)
    x = torch.cat([torch.tensor(edges, dtype=F64), patterns, near, fp32])

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)

    for view in (x, x[::2], torch._neg_view(-x)):  # and every other element (strided), and a lazily negated view
        compiled = [I._down32(view), I._up32(view), I.rne(view, torch.bfloat16), I.rne(view, torch.float16)]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(I, "_compiled", lambda t: False)
            plain = [I._down32(view), I._up32(view), I.rne(view, torch.bfloat16), I.rne(view, torch.float16)]
        for got, want in zip(compiled, plain, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            same = bits(got.to(torch.float32) if got.dtype == F64 else got) == bits(
                want.to(torch.float32) if want.dtype == F64 else want)
            assert bool(same.all()), view[~same][:5].tolist()
    # hand-derived: the neighbours of 1 + 2**-30 and of a value just below -0.0
    assert I._down32(torch.tensor([1 + 2.0**-30, -1e-50], dtype=F64)).view(torch.int32).tolist() == [0x3F800000,
                                                                                                     -0x7FFFFFFF]
    assert I._up32(torch.tensor([1 + 2.0**-30, -1e-50], dtype=F64)).view(torch.int32).tolist() == [0x3F800001,
                                                                                                   -0x80000000]


def test_the_compiled_rounding_refuses_what_it_does_not_round() -> None:
    from ulptrace import _ulp_cpu

    with pytest.raises(ValueError, match="float64 CPU tensor and a mode of .*but got torch.float32 on cpu and 'down'"):
        _ulp_cpu.to_fp32(torch.ones(2), "down")
    with pytest.raises(ValueError, match="but got torch.float64 on cpu and 'nearest'"):
        _ulp_cpu.to_fp32(torch.ones(2, dtype=F64), "nearest")


@pytest.mark.parametrize("case", ["causal", "float-mask", "bool-mask", "gqa-decode", "interval-inputs"])
def test_attention_replayed_in_blocks_of_query_rows_equals_the_whole(monkeypatch, case) -> None:
    """Bounded memory: the attention replay in blocks of query rows (a few rows at a time here) gives the same
    intervals, bit for bit, as replaying every row at once — causal masks offset per block, masks sliced, the keys'
    and values' derived operands made once for all blocks (``interval-inputs``: ends apart, so the products take
    their interval forms)."""
    from ulptrace.oracle import attention
    from ulptrace.oracle import intervals as I

    gen = torch.Generator().manual_seed(5)
    hq, hk, tq, tk = (4, 2, 1, 9) if case == "gqa-decode" else (2, 2, 11, 11)
    q, k, v = (torch.randn(2, h, t, 8, generator=gen).bfloat16() for h, t in ((hq, tq), (hk, tk), (hk, tk)))
    args = {"query": I.point(q), "key": I.point(k), "value": I.point(v), "is_causal": case == "causal"}
    if case == "interval-inputs":  # ends apart (values keep both signs)
        args.update({name: I.widen_rel(args[name], 2.0**-6, 2.0**-10) for name in ("query", "key", "value")})
        assert not any(args[name].is_point for name in ("query", "key", "value"))
    if case == "float-mask":
        args["attn_mask"] = I.point(torch.randn(2, 1, tq, tk, generator=gen).float())
    if case in ("bool-mask", "gqa-decode"):
        args["attn_mask"] = I.point(torch.rand(1, 1, tq, tk, generator=gen) > 0.3)
        args["attn_mask"].lo[..., 0] = True  # every row sees a key
    kw = {"input_dtype": torch.bfloat16, "compute": torch.float32, "semantics": "flash",
          "stages": frozenset({"scores"}), "outputs": 1, "where": "test"}
    whole = attention.replay_attention(args, **kw)[0]
    monkeypatch.setattr(attention, "BLOCK_SCORES", 2 * hq * tk + 1)  # two query rows per block (one for decode)
    blocked = attention.replay_attention(args, **kw)[0]
    for part in ("lo", "hi"):
        assert torch.equal(getattr(whole, part), getattr(blocked, part)), part
    assert (whole.pt is None) == (blocked.pt is None) and (whole.pt is None or torch.equal(whole.pt, blocked.pt))
