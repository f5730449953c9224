"""``ulptrace.explain``: every element's numbers checked against values computed here independently
(float64 formulas, hand-derived BF16 grids), and the per-verdict histograms of the comparison."""

from __future__ import annotations

import math

import pytest
import torch
import ulptrace
from ulptrace.elements import midpoint_distance
from ulptrace.oracle.judge import VERDICTS, empty_verdict_histogram, verdict_histogram
from ulptrace.ulp import HISTOGRAM_BUCKETS


def bf16_midpoint_distance(e: float) -> float:
    """Hand-derived: BF16 has 8 significant bits, so in the binade [2**k, 2**(k+1)) the grid step is
    2**(k-7); the distance to the nearest midpoint is |frac(e / step) - 1/2| (division by a power of two
    is exact in float64)."""
    a = abs(e)
    step = 2.0 ** (math.floor(math.log2(a)) - 7)
    m = a / step
    return abs((m - math.floor(m)) - 0.5)


def test_midpoint_distance_on_hand_derived_values() -> None:
    values = torch.tensor([1.0, 1.00390625, 1.001953125, -1.00390625, 1.99609375, 0.75 + 2**-10, 3.0 + 2**-8],
                          dtype=torch.float64)
    got = midpoint_distance(values, torch.bfloat16).tolist()
    # 1.0 is representable (0.5); 1 + 2**-8 halves 1 and 1 + 2**-7 (0); 1 + 2**-9 is a quarter step (0.25);
    # 2 - 2**-8 halves 2 - 2**-7 and 2; 0.75 + 2**-10 is a quarter step of 2**-8 above 0.75; 3 + 2**-8 a quarter
    # of 2**-6 above 3
    assert got == [0.5, 0.0, 0.25, 0.0, 0.0, 0.25, 0.25]
    rng = torch.Generator().manual_seed(3)
    random = (torch.rand(200, generator=rng, dtype=torch.float64) - 0.5) * 2.0 ** torch.randint(-20, 20, (200,),
                                                                                                  generator=rng)
    want = [bf16_midpoint_distance(v) for v in random.tolist()]
    assert midpoint_distance(random, torch.bfloat16).tolist() == pytest.approx(want, abs=1e-12)
    assert math.isnan(midpoint_distance(torch.tensor([math.inf], dtype=torch.float64), torch.bfloat16).item())


# -- one RMSNorm site, records built here ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def norm_case(qwen):
    """The first input_layernorm on many random rows: the reference is HF's module; the candidate sums the
    squares in a CUDA-style blocked order (honest), rounds the other way where the exact value is within 1e-4
    ULP of a midpoint (honest: ties), has three elements replaced by a boundary (the normalised value rounded
    to BF16 before the weight: an added rounding) and one by an error."""
    norm = qwen.model.layers[0].input_layernorm
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 16, 128, generator=gen) * 2).to(torch.bfloat16)
    with torch.no_grad():
        ref = norm(x)
    xf = x.float()
    ms = ulptrace.reduce_fp32(xf * xf, "blocked:t32:v4") / xf.shape[-1]
    normed = xf * torch.rsqrt(ms.unsqueeze(-1) + norm.eps)
    weight = 1.0 + norm.weight.float()
    cand = (normed * weight).to(torch.bfloat16)
    added = (normed.to(torch.bfloat16).float() * weight).to(torch.bfloat16)  # an extra BF16 rounding
    moved = (added != cand).reshape(-1).nonzero().flatten()[:3]
    flat = cand.reshape(-1)
    flat[moved] = added.reshape(-1)[moved]
    # honest ties, placed by hand: where the exact value lies within 1e-4 ULP of a BF16 midpoint, the FP32 error
    # of any summation order can round it either way; take the other neighbour there
    xd = x.double()
    exact = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight.double())).reshape(-1)
    step = torch.exp2(torch.floor(torch.log2(exact.abs())) - 7)
    m = exact.abs() / step
    near = ((m - m.floor() - 0.5).abs() < 1e-4) & (flat == ref.reshape(-1))
    near[moved] = False
    up, down = ulptrace.next_up(flat), ulptrace.next_down(flat)
    flat[near] = torch.where(exact > flat.double(), up, down)[near]
    same = (flat == ref.reshape(-1)) & (flat != 0)
    same[moved] = False
    err = int(same.nonzero()[0])
    flat[err] = ulptrace.next_up(ulptrace.next_up(ulptrace.next_up(flat[err:err + 1])))[0]  # 3 ULPs off: an error
    judge = ulptrace.OracleJudge(qwen)
    rec = lambda out: ulptrace.Record("layers.0.input_layernorm", 0, "norm", 0, out, {"x": x})
    explanation = ulptrace.explain(rec(ref), rec(cand), judge)
    return x, ref, cand, norm, explanation, set(moved.tolist()), err


def test_every_row_matches_an_independent_float64_evaluation(norm_case) -> None:
    x, ref, cand, norm, e = norm_case[:5]
    xd = x.double()
    exact = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight.double())
    assert e.inputs_equal and e.rows
    differing = int((ref.view(torch.int16) != cand.view(torch.int16)).sum())
    assert len(e.rows) == differing == sum(n for k, n in e.counts.items() if k != "exact")
    for r in e.rows:
        assert r.reference == ref[r.index].item() and r.candidate == cand[r.index].item()
        assert r.exact == pytest.approx(exact[r.index].item(), rel=1e-12, abs=1e-300)
        # a single-rounding norm: the deciding point is the output's rounding, of the unrounded value
        assert r.midpoint == pytest.approx(bf16_midpoint_distance(exact[r.index].item()), abs=1e-9)
        # ULPs between two BF16 values of the same sign: the difference of their bit patterns
        if (r.reference > 0) == (r.candidate > 0) and r.reference != 0:
            assert r.ulp == abs(int(ref[r.index].view(torch.int16)) - int(cand[r.index].view(torch.int16)))
        assert r.lo <= r.reference <= r.hi  # HF is inside its own semantics (equal inputs)
        inside = r.lo <= r.candidate <= r.hi
        assert inside == (r.verdict == "tie")


def test_verdicts_hypotheses_and_the_midpoint_claim(norm_case) -> None:
    e, moved, err = norm_case[4:]
    flat_index = lambda r: (r.index[0] * 16 + r.index[1]) * 128 + r.index[2]
    errors = e.where("error")
    assert [flat_index(r) for r in errors] == [err] and errors[0].ulp == 3 and errors[0].distance >= 1
    assert errors[0].hypothesis is None
    boundary = e.where("boundary")
    assert boundary and {flat_index(r) for r in boundary} <= moved
    assert all("rounded to BF16" in r.hypothesis for r in boundary)
    assert all(r.hypothesis == e.boundary for r in boundary)  # the site's named boundary holds each of them
    ties = e.where("tie")
    assert len(ties) >= 10, "ties must be present, or the test proves nothing"
    # an honest reordering moves the value by a fraction of the FP32 band: it flips only near a midpoint
    assert all(r.midpoint <= 2 * r.band for r in ties)
    assert max(r.midpoint for r in ties) < 1e-3 < min(r.midpoint for r in boundary + errors)
    h = e.midpoint_histogram()
    assert sum(h["counts"]["tie"]) == len(ties) and h["elements"] == len(e.rows)


def test_str_and_json(norm_case) -> None:
    e = norm_case[4]
    text = str(e)
    assert text.splitlines()[0].startswith("step 0, layers.0.input_layernorm (norm, bfloat16 [64, 16, 128]):")
    assert "inputs bitwise equal" in text and "error +" in text.splitlines()[5]  # worst first: the error
    assert len([line for line in text.splitlines() if line.startswith("[")]) == e.limit
    data = e.to_json()
    assert data["counts"] == e.counts and len(data["rows"]) == len(e.rows)
    assert set(data["rows"][0]) == {"index", "reference", "candidate", "ulp", "verdict", "exact", "point", "lo",
                                    "hi", "distance", "hypothesis", "midpoint", "band", "rounding_op"}


def test_explain_refuses_what_it_cannot_explain(qwen) -> None:
    judge = ulptrace.OracleJudge(qwen)
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    a = ulptrace.Record("embed", 0, "other", None, t, {})
    with pytest.raises(ValueError, match="no oracle semantics"):
        ulptrace.explain(a, a, judge)
    a = ulptrace.Record("layers.0.output", 0, "residual", 0, t, {})
    with pytest.raises(ValueError, match="lacks oracle input"):
        ulptrace.explain(a, a, judge)
    b = ulptrace.Record("layers.0.input_layernorm", 1, "norm", 0, t, {"x": t})
    with pytest.raises(ValueError, match="same \\(site, step\\)"):
        ulptrace.explain(ulptrace.Record("layers.0.input_layernorm", 0, "norm", 0, t, {"x": t}), b, judge)
    with pytest.raises(ValueError, match="site="):
        ulptrace.explain(ulptrace.Trace(), ulptrace.Trace(), judge)


# -- through a comparison of two runs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fault_run(qwen, prompts):
    from ulptrace.run import greedy

    cand = ulptrace.build_model("tiny-qwen3.5")
    with ulptrace.Recorder(qwen) as r:
        tokens = greedy(qwen, prompts, 2)
    judge = ulptrace.OracleJudge(qwen)
    with ulptrace.apply_path(cand, "fault:layers.1.mlp.glu@0+3"), ulptrace.Recorder(cand) as c:
        greedy(cand, prompts, 2, forced=tokens)
    return r.trace, c.trace, judge, ulptrace.compare(r.trace, c.trace, judge=judge)


def test_explain_a_site_of_a_comparison(fault_run) -> None:
    ref, cand, judge, comparison = fault_run
    onset = comparison.onset()
    assert (onset.site, onset.step) == ("layers.1.mlp.glu", 0)
    e = ulptrace.explain(ref, cand, judge, site=onset)
    assert [(r.verdict, r.ulp) for r in e.rows] == [("error", 3)] and e.inputs_equal
    r = e.rows[0]
    assert r.candidate != r.reference and not r.lo <= r.candidate <= r.hi
    # the same from the report entry, and a later site that inherits the fault
    assert ulptrace.explain(ref, cand, judge, site=comparison.to_json()["sites"][
        [d.site for d in comparison.sites].index("layers.1.mlp.glu")]).rows == e.rows
    down = ulptrace.explain(ref, cand, judge, site="layers.1.output", step=0)  # inherits the fault
    assert not down.inputs_equal and "inputs differ" in str(down)


def test_verdict_histograms_in_the_comparison(fault_run) -> None:
    *_, comparison = fault_run
    judged = [d for d in comparison.sites if d.verdicts]
    assert judged
    for d in judged:
        vh = d.verdict_histogram
        assert vh is not None and set(vh) == {"tie", "boundary", "error", "nonfinite"}
        for verdict, hist in vh.items():
            assert list(hist) == list(HISTOGRAM_BUCKETS) and sum(hist.values()) == d.verdicts[verdict]
        if d.bitwise_equal:
            assert vh == empty_verdict_histogram()
        else:  # every differing element is in one verdict's histogram, in the bucket of its own distance
            for b in HISTOGRAM_BUCKETS[1:]:
                assert sum(h[b] for h in vh.values()) == d.histogram[b]
    glu = next(d for d in comparison.sites if d.site == "layers.1.mlp.glu" and d.step == 0)
    assert glu.verdict_histogram["error"]["3-4"] == 1
    assert comparison.to_json()["sites"][comparison.sites.index(glu)]["verdict_histogram"] == glu.verdict_histogram
    unjudged = [d for d in comparison.sites if d.verdicts is None]
    assert all(d.verdict_histogram is None for d in unjudged)


def test_verdict_histogram_by_hand() -> None:
    ref = torch.tensor([1.0, 1.0, 1.0, 2.0, 0.0, 1.0], dtype=torch.bfloat16)
    out = torch.tensor([1.0, 1.0078125, 1.03125, 2.0, -0.0, float("nan")], dtype=torch.float32)  # FP32 candidate
    codes = torch.tensor([VERDICTS.index(v) for v in ("exact", "tie", "boundary", "exact", "tie", "nonfinite")],
                         dtype=torch.uint8)
    h = verdict_histogram(codes, out, ref)
    assert h["tie"] == {**dict.fromkeys(HISTOGRAM_BUCKETS, 0), "0": 1, "1": 1}  # -0 vs +0 is 0 ULPs apart
    assert h["boundary"] == {**dict.fromkeys(HISTOGRAM_BUCKETS, 0), "3-4": 1}  # 1 + 4 * 2**-7
    assert h["nonfinite"] == {**dict.fromkeys(HISTOGRAM_BUCKETS, 0), "nonfinite": 1}
    assert h["error"] == dict.fromkeys(HISTOGRAM_BUCKETS, 0)
    assert verdict_histogram(torch.zeros(6, dtype=torch.uint8), out, ref) == empty_verdict_histogram()
    assert verdict_histogram(codes[:3], out, ref) is None  # shapes differ: nothing to measure
