"""Verdicts on real HF modules (transformers 5.17): honest outputs are admissible, each known class of
kernel mismatch is a ``boundary`` named after the right op, and real bugs are ``error``/``nonfinite``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle_modules import make_attention_module, make_gated_norm, make_gates, make_llama_norm, make_qwen_norm
from transformers.activations import ACT2FN
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, eager_attention_forward
from ulptrace.oracle import VERDICTS, admissible, capture_semantics, judge
from ulptrace.oracle.replay import emulate

BF16 = torch.bfloat16


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(BF16)


def assert_admissible(program, inputs, output):
    """``output`` lies in its own admissible set everywhere, and is all ``exact`` against itself."""
    alone = judge(program, inputs, output)
    assert alone.inside, str(alone)
    assert alone.counts["exact"] == output.numel() and not alone.against_reference
    lo, hi = admissible(program, inputs)
    assert lo.dtype == hi.dtype == program.output_value.dtype and lo.shape == output.shape
    assert bool(((lo.double() <= output.double()) & (output.double() <= hi.double())).all())
    against_itself = judge(program, inputs, output, output)
    assert against_itself.counts == {"exact": output.numel(), "tie": 0, "boundary": 0, "error": 0, "nonfinite": 0}


def best(judgement):
    """The hypothesis the judgement names (most explained, first of equals)."""
    return max(judgement.hypotheses, key=lambda h: h.explained or 0)


# ---------------------------------------------------------------------------------------------- HF is admissible


def test_qwen_norm_output_is_admissible():
    qwen_norm = make_qwen_norm()
    x = randn(16, 64, scale=3.0)
    program = capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names=qwen_norm)
    assert_admissible(program, {"x": x}, qwen_norm(x))


def test_gated_norm_output_is_admissible():
    gated_norm = make_gated_norm()
    x, gate = randn(16, 64), randn(16, 64, scale=2.0)
    program = capture_semantics(lambda x, gate: gated_norm(x, gate), {"x": x, "gate": gate}, constant_names=gated_norm)
    assert_admissible(program, {"x": x, "gate": gate}, gated_norm(x, gate))


def test_llama_norm_output_is_admissible():
    llama_norm = make_llama_norm()
    x = randn(16, 64)
    program = capture_semantics(lambda x: llama_norm(x), {"x": x}, constant_names=llama_norm)
    assert_admissible(program, {"x": x}, llama_norm(x))


def test_glu_output_is_admissible():
    act = ACT2FN["silu"]
    gate, up = randn(8, 96, scale=3.0), randn(8, 96)
    program = capture_semantics(lambda gate, up: act(gate) * up, {"gate": gate, "up": up})
    assert_admissible(program, {"gate": gate, "up": up}, act(gate) * up)


def test_gdn_gates_are_admissible():
    gates = make_gates()
    a, b = randn(4, 8, scale=3.0), randn(4, 8, scale=3.0)

    def g_formula(a):
        return -gates.A_log.float().exp() * F.softplus(a.float() + gates.dt_bias)

    program = capture_semantics(g_formula, {"a": a}, constant_names=gates)
    assert program.output_value.dtype == torch.float32
    assert_admissible(program, {"a": a}, g_formula(a))
    beta = capture_semantics(lambda b: b.sigmoid(), {"b": b})
    assert_admissible(beta, {"b": b}, b.sigmoid())


def test_eager_and_sdpa_attention_are_admissible():
    attention_module = make_attention_module()
    q, k, v = randn(1, 4, 12, 32), randn(1, 2, 12, 32), randn(1, 2, 12, 32)
    mask = torch.zeros(1, 1, 12, 12).masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf")).to(BF16)
    inputs = {"query": q, "key": k, "value": v}

    def eager(query, key, value):
        return eager_attention_forward(attention_module, query, key, value, mask, scaling=32**-0.5)[0]

    def sdpa(query, key, value):  # no mask: HF uses is_causal and enable_gqa
        return sdpa_attention_forward(attention_module, query, key, value, None, scaling=32**-0.5)[0]

    assert_admissible(capture_semantics(eager, inputs, constant_names={"mask": mask}), inputs, eager(**inputs))
    program = capture_semantics(sdpa, inputs)
    assert any(op.name.startswith("_scaled_dot_product") for op in program.ops)
    assert_admissible(program, inputs, sdpa(**inputs))


def test_linear_outputs_are_admissible():
    with_bias, without = torch.nn.Linear(64, 48).to(BF16), torch.nn.Linear(64, 40, bias=False).to(BF16)
    x = randn(3, 7, 64)
    for lin in (with_bias, without):
        program = capture_semantics(lin, {"input": x}, constant_names=lin)
        assert_admissible(program, {"input": x}, lin(x))


# ---------------------------------------------------------------------------------------------- ties


def _qwen_norm_in_order(x, weight, eps, order):
    """Qwen3.5 RMSNorm math with the sum of squares accumulated in FP32 in an explicit order."""
    xf = x.float()
    sq = xf * xf
    n = xf.shape[-1]
    if order == "reversed":
        acc = torch.zeros(xf.shape[0])
        for j in reversed(range(n)):
            acc = acc + sq[:, j]
    else:  # blocked: 8 threads sum contiguous chunks sequentially, then the partials are added in order
        acc = torch.zeros(xf.shape[0])
        chunk = n // 8
        for start in range(0, n, chunk):
            part = torch.zeros(xf.shape[0])
            for j in range(start, start + chunk):
                part = part + sq[:, j]
            acc = acc + part
    var = acc / n
    normed = xf * torch.rsqrt(var + eps)[:, None]
    return (normed * (1.0 + weight.float())).to(BF16)


@pytest.mark.parametrize("order", ["reversed", "blocked"])
def test_other_summation_order_is_a_tie(order):
    norm = Qwen3_5RMSNorm(1024, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 0.0, 0.1)
    norm = norm.to(BF16)
    x = randn(256, 1024)
    reference = norm(x)
    candidate = _qwen_norm_in_order(x, norm.weight, 1e-6, order)
    differing = int((candidate != reference).sum())
    assert differing >= 1, "the test needs rows where the order changes the BF16 result"
    program = capture_semantics(lambda x: norm(x), {"x": x}, constant_names=norm)
    j = judge(program, {"x": x}, candidate, reference)
    assert j.counts["tie"] == differing
    assert j.counts["boundary"] == j.counts["error"] == j.counts["nonfinite"] == 0
    assert j.counts["exact"] == x.numel() - differing
    assert j.boundary is None and j.max_error_ulp is None


# ---------------------------------------------------------------------------------------------- boundaries


def test_residual_add_not_rounded_before_norm_is_a_boundary():
    qwen_norm = make_qwen_norm()
    residual, delta = randn(16, 64, scale=4.0), randn(16, 64)
    program = capture_semantics(lambda residual, delta: qwen_norm(residual + delta),
                                {"residual": residual, "delta": delta}, constant_names=qwen_norm)
    reference = qwen_norm(residual + delta)
    candidate = qwen_norm(residual.float() + delta.float()).to(BF16)  # normalises the FP32 sum
    j = judge(program, {"residual": residual, "delta": delta}, candidate, reference)
    assert j.counts["boundary"] > 0 and j.counts["error"] == 0
    assert j.boundary == "the BF16 rounding of `add(residual, delta)` (op 0) is missing"
    assert best(j).op == 0 and best(j).kind == "missing" and j.explained == 1.0


def test_one_plus_weight_formed_in_bf16_is_a_boundary():
    qwen_norm = make_qwen_norm()
    x = randn(32, 64, scale=2.0)
    program = capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names=qwen_norm)
    assert not torch.equal((1 + qwen_norm.weight).float(), 1.0 + qwen_norm.weight.float()), "weights must matter"
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    candidate = (normed * (1 + qwen_norm.weight).float()).to(BF16)  # (1 + w) rounded to BF16 first
    j = judge(program, {"x": x}, candidate, qwen_norm(x))
    add_w = next(op.index for op in program.ops if op.name == "add" and "weight" in program.op_label(op.index))
    assert j.counts["boundary"] > 0 and j.counts["error"] == 0
    assert best(j).op == add_w and best(j).kind == "added" and j.explained == 1.0
    assert j.boundary == f"`add(f32(weight), 1.0)` (op {add_w}) rounded to BF16"


def test_glu_rounded_once_is_a_boundary():
    act = ACT2FN["silu"]
    gate, up = randn(32, 64, scale=3.0), randn(32, 64)
    program = capture_semantics(lambda gate, up: act(gate) * up, {"gate": gate, "up": up})
    candidate = (F.silu(gate.float()) * up.float()).to(BF16)  # fused epilogue, one rounding
    j = judge(program, {"gate": gate, "up": up}, candidate, act(gate) * up)
    assert j.counts["boundary"] > 0 and j.counts["error"] == 0
    assert j.boundary == "the BF16 rounding of `silu(gate)` (op 0) is missing" and j.explained == 1.0


def test_gated_norm_fully_fused_is_a_boundary():
    gated_norm = make_gated_norm()
    x, gate = randn(32, 64), randn(32, 64, scale=2.0)
    program = capture_semantics(lambda x, gate: gated_norm(x, gate), {"x": x, "gate": gate}, constant_names=gated_norm)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    candidate = (normed * gated_norm.weight.float() * F.silu(gate.float())).to(BF16)
    j = judge(program, {"x": x, "gate": gate}, candidate, gated_norm(x, gate))
    assert j.counts["error"] == 0 and j.counts["boundary"] > 0
    assert j.boundary == "all intermediates fused into one final rounding" and j.explained == 1.0


def test_gdn_g_emitted_in_bf16_is_a_boundary():
    gates = make_gates()
    a = randn(64, 8, scale=3.0)

    def g_formula(a):
        return -gates.A_log.float().exp() * F.softplus(a.float() + gates.dt_bias)

    program = capture_semantics(g_formula, {"a": a}, constant_names=gates)
    reference = g_formula(a)
    candidate = reference.to(BF16)
    j = judge(program, {"a": a}, candidate, reference)
    assert j.counts["boundary"] > 0 and j.counts["error"] == 0
    assert program.output_op() == 6
    assert best(j).op == 6 and best(j).kind == "added" and j.explained == 1.0
    assert j.boundary == "`mul(neg(exp(f32(A_log))), softplus(add(f32(a), dt_bias)))` (op 6) rounded to BF16"


def _integer_attention(attention_module):
    """q, k in {-1, 0, 1}, head_dim 16, scale 1/4: every score is exact in BF16, so eager attention
    differs from a once-rounded softmax(QK^T)V only by rounding the probabilities before P @ V."""
    q = torch.randint(-1, 2, (1, 4, 16, 16)).to(BF16)
    k = torch.randint(-1, 2, (1, 2, 16, 16)).to(BF16)
    v = randn(1, 2, 16, 16)
    eager = eager_attention_forward(attention_module, q, k, v, None, scaling=0.25)[0]
    return {"query": q, "key": k, "value": v}, eager


def _sdpa(query, key, value):
    return F.scaled_dot_product_attention(query, key, value, scale=0.25, enable_gqa=True).transpose(1, 2)


def test_eager_attention_against_strict_sdpa_is_the_probability_rounding():
    attention_module = make_attention_module()
    inputs, eager = _integer_attention(attention_module)
    program = capture_semantics(_sdpa, inputs, attention="fp32")
    j = judge(program, inputs, eager, _sdpa(**inputs))
    assert j.counts["boundary"] > 0 and j.counts["error"] == 0
    assert best(j).kind == "attention" and j.explained == 1.0
    assert j.boundary == (
        "attention probabilities rounded to BF16 before P @ V inside "
        "`_scaled_dot_product_flash_attention_for_cpu(query, key, value, scale=0.25)` (op 0)"
    )


def test_eager_attention_against_flash_sdpa_is_a_tie():
    attention_module = make_attention_module()
    inputs, eager = _integer_attention(attention_module)
    j = judge(capture_semantics(_sdpa, inputs), inputs, eager, _sdpa(**inputs))
    assert j.counts["tie"] > 0
    assert j.counts["boundary"] == j.counts["error"] == j.counts["nonfinite"] == 0


def test_eager_scores_against_flash_sdpa_are_named():
    attention_module = make_attention_module()
    # |scores| of a few units: rounding them to BF16 (HF's eager matmul output) moves the softmax by more
    # than the FP32 summation orders can, in about a third of the elements
    q, k, v = randn(1, 4, 24, 32, scale=2.0), randn(1, 2, 40, 32, scale=2.0), randn(1, 2, 40, 32)
    inputs = {"query": q, "key": k, "value": v}
    eager = eager_attention_forward(attention_module, q, k, v, None, scaling=32**-0.5)[0]

    def sdpa(query, key, value):
        return F.scaled_dot_product_attention(query, key, value, enable_gqa=True).transpose(1, 2)

    j = judge(capture_semantics(sdpa, inputs), inputs, eager, sdpa(**inputs))
    assert j.counts["error"] == 0 and j.counts["nonfinite"] == 0
    assert j.counts["boundary"] > 0, "the planted defect (BF16 scores) must leave the admissible set"
    assert best(j).kind == "attention" and best(j).op == 0 and j.explained == 1.0
    assert j.boundary == ("attention scores rounded to BF16 before the softmax inside "
                          "`_scaled_dot_product_flash_attention_for_cpu(query, key, value)` (op 0), "
                          "as HF's eager path does")


def _narrow_scores_attention(narrow_at: str):
    """A kernel that stores its scores in BF16 once — ``"qk"``: the product ``q @ k^T`` (a BF16 matmul), then the
    scale in FP32; ``"scaled"``: the scale folded into the FP32 product, the scaled scores rounded — softmax and
    ``P @ V`` in FP32, the output rounded once. Written in torch from the definition, not from the oracle."""
    q, k, v = randn(1, 4, 24, 32, scale=2.0), randn(1, 2, 40, 32, scale=2.0), randn(1, 2, 40, 32)
    kf, vf = (t.float().repeat_interleave(2, dim=1) for t in (k, v))
    scale = torch.tensor(32**-0.5, dtype=torch.float32)
    scores = q.float() @ kf.transpose(-2, -1)
    scores = (scores.to(BF16).float() * scale) if narrow_at == "qk" else (scores * scale).to(BF16).float()
    out = (torch.softmax(scores, -1) @ vf).to(BF16).transpose(1, 2)
    return {"query": q, "key": k, "value": v}, out


@pytest.mark.parametrize("narrow_at, named", [
    ("qk", "attention scores `q @ k^T` rounded to BF16 before the scale"),
    ("scaled", "attention scores rounded to BF16 once, scaled, before the softmax")])
def test_scores_stored_narrow_once_are_named_not_errors(narrow_at, named):
    """One rounding of the scores (a kernel folding the scale into its product, or a BF16 matmul) is a boundary of
    its own, not HF's eager three: before these hypotheses, its elements outside the ties read ``error``."""
    inputs, candidate = _narrow_scores_attention(narrow_at)

    def sdpa(query, key, value):
        return F.scaled_dot_product_attention(query, key, value, enable_gqa=True).transpose(1, 2)

    j = judge(capture_semantics(sdpa, inputs), inputs, candidate, sdpa(**inputs))
    assert j.counts["error"] == 0 and j.counts["nonfinite"] == 0
    assert j.counts["boundary"] > 0, "one BF16 rounding of scores of a few units must leave the ties"
    assert best(j).kind == "attention" and j.explained == 1.0
    assert j.boundary == f"{named} inside `_scaled_dot_product_flash_attention_for_cpu(query, key, value)` (op 0)"


# ---------------------------------------------------------------------------------------------- errors


def test_wrong_eps_is_an_error():
    qwen_norm = make_qwen_norm()
    x = randn(16, 64, scale=0.01)  # variance ~1e-4, so eps=1e-2 dominates
    program = capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names=qwen_norm)
    wrong = Qwen3_5RMSNorm(64, eps=1e-2).to(BF16)
    wrong.weight.data.copy_(qwen_norm.weight.data)
    j = judge(program, {"x": x}, wrong(x), qwen_norm(x))
    assert j.counts["error"] > x.numel() // 2 and j.max_error_ulp > 16
    errors = j.mask("error")
    assert bool((j.distance[errors] > 0).all())


def test_wrong_weight_is_an_error():
    qwen_norm = make_qwen_norm()
    x = randn(16, 64)
    program = capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names=qwen_norm)
    stale = Qwen3_5RMSNorm(64).to(BF16)
    stale.weight.data.copy_(qwen_norm.weight.data + randn(64, scale=0.05))
    j = judge(program, {"x": x}, stale(x), qwen_norm(x))
    assert j.counts["error"] > 0 and j.max_error_ulp > 1


def test_transposed_weight_stride_is_an_error():
    lin = torch.nn.Linear(32, 32).to(BF16)
    x = randn(8, 32)
    program = capture_semantics(lambda x: lin(x), {"x": x}, constant_names=lin)
    buggy = (x.float() @ lin.weight.float() + lin.bias.float()).to(BF16)  # reads W with the wrong stride
    j = judge(program, {"x": x}, buggy, lin(x))
    assert j.counts["error"] > x.numel() // 2 and j.max_error_ulp > 16


def test_nan_is_nonfinite():
    qwen_norm = make_qwen_norm()
    x = randn(4, 64)
    program = capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names=qwen_norm)
    reference = qwen_norm(x)
    candidate = reference.clone()
    candidate[1, 5] = float("nan")
    candidate[2, 7] = float("inf")
    j = judge(program, {"x": x}, candidate, reference)
    assert j.counts["nonfinite"] == 2 and j.counts["exact"] == x.numel() - 2
    assert j.verdicts[1, 5] == VERDICTS.index("nonfinite") and int(j.distance[1, 5]) == -1
    assert j.worst == "nonfinite"


def test_judgement_fields():
    qwen_norm = make_qwen_norm()
    x = randn(4, 64)
    program = capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names=qwen_norm)
    j = judge(program, {"x": x}, qwen_norm(x), hypotheses=False)
    assert j.verdicts.dtype == torch.uint8 and j.verdicts.shape == x.shape
    assert set(j.counts) == set(VERDICTS) and sum(j.counts.values()) == x.numel()
    assert j.hypotheses == [] and j.boundary is None and j.explained == 0.0
    assert j.point.dtype == j.lo.dtype == j.hi.dtype == BF16
    assert bool(((j.lo.double() <= j.point.double()) & (j.point.double() <= j.hi.double())).all())
    assert "admissible 256" in str(j)


# ---------------------------------------------------------------------------------------------- bad input


def test_mismatched_inputs_and_outputs_are_rejected():
    qwen_norm = make_qwen_norm()
    x = randn(4, 64)
    program = capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names=qwen_norm)
    with pytest.raises(ValueError, match=r"shape \(4, 64\) as captured, but got \(5, 64\)"):
        judge(program, {"x": randn(5, 64)}, qwen_norm(x))
    with pytest.raises(TypeError, match="dtype torch.bfloat16 as captured, but got torch.int32"):
        judge(program, {"x": x.to(torch.int32)}, qwen_norm(x))
    # a float input of another float dtype is replayed at its own values (a value handed on unrounded); running the
    # program in its own dtypes still needs the captured ones
    same = judge(program, {"x": x.float()}, qwen_norm(x))
    assert same.counts == judge(program, {"x": x}, qwen_norm(x)).counts and same.counts["exact"] == x.numel()
    with pytest.raises(TypeError, match="dtype torch.bfloat16 as captured, but got torch.float32"):
        emulate(program, {"x": x.float()})
    with pytest.raises(ValueError, match=r"named \['x'\], but got \['hidden'\]"):
        judge(program, {"hidden": x}, qwen_norm(x))
    with pytest.raises(ValueError, match=r"output shape \(4, 64\), but got \(4, 32\)"):
        judge(program, {"x": x}, qwen_norm(x)[:, :32])
    with pytest.raises(TypeError, match="must be a tensor"):
        judge(program, {"x": x}, [1.0])


def test_an_input_handed_on_unrounded_is_judged_at_its_own_values():
    """A residual add captured on BF16 inputs, given the delta in FP32 (a GEMM's result kept unrounded): the set is
    the add of those exact values — the sum of the FP32 delta rounded once is inside, and the set is not the one of
    the delta's BF16 rounding."""
    residual, delta = randn(8, 64, scale=4.0), randn(8, 64, scale=1e-2)
    program = capture_semantics(lambda residual, delta: residual + delta, {"residual": residual, "delta": delta})
    delta32 = delta.float() + torch.rand(8, 64) * 2.0 ** -16  # not BF16 values
    assert not torch.equal(delta32.bfloat16().float(), delta32)
    once = (residual.double() + delta32.double()).bfloat16()  # correctly rounded from the exact sum
    lo, hi = admissible(program, {"residual": residual, "delta": delta32})
    assert bool(((once.double() >= lo.double()) & (once.double() <= hi.double())).all())
    lo_r, hi_r = admissible(program, {"residual": residual, "delta": delta32.bfloat16()})  # the rounded delta's set
    assert not (torch.equal(lo, lo_r) and torch.equal(hi, hi_r))
    assert judge(program, {"residual": residual, "delta": delta32}, once).counts["error"] == 0


@pytest.mark.slow
def test_judging_a_large_site_with_every_hypothesis_is_fast():
    import time

    norm = make_gated_norm()
    residual, delta, gate = randn(2048, 64, scale=4.0), randn(2048, 64), randn(2048, 64)  # 131k elements
    inputs = {"residual": residual, "delta": delta, "gate": gate}
    program = capture_semantics(lambda residual, delta, gate: norm(residual + delta, gate), inputs,
                                constant_names=norm)
    hf = norm(residual + delta, gate)
    s = residual.float() + delta.float()
    fused = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()
             * F.silu(gate.float())).to(BF16)
    start = time.perf_counter()
    j = judge(program, inputs, fused, hf)
    elapsed = time.perf_counter() - start
    assert len(j.hypotheses) >= 10 and j.counts["boundary"] > 0
    assert elapsed < 3.0, f"{elapsed:.2f} s for {hf.numel()} elements and {len(j.hypotheses)} hypotheses"


def test_hypotheses_after_one_that_explains_everything_are_not_evaluated():
    """Once a hypothesis explains every out-of-set element no later one can change a verdict or be named (the
    first of equals is), so it is not evaluated (``explained`` None); one that explains part leaves the rest tried."""
    from ulptrace.oracle.judge import HypothesisResult, judge_sets

    lo = hi = pt = torch.zeros(4, dtype=torch.float64)
    out = torch.tensor([0.0, 1.0, 2.0, 0.0])  # two elements outside [0, 0]
    called = []

    def interval(name, top):
        def make():
            called.append(name)
            return torch.zeros(4, dtype=torch.float64), torch.full((4,), top, dtype=torch.float64)
        return make

    def options(*tops):
        return [(HypothesisResult(f"h{i}", f"hypothesis {i}", None, 0), interval(f"h{i}", t)) for i, t in enumerate(tops)]

    j = judge_sets(out, None, lo, hi, pt, options(1.0, 2.0, 2.0), torch.float32)
    assert called == ["h0", "h1"]  # h1 explains both: h2 is not evaluated
    assert [h.explained for h in j.hypotheses] == [1, 2, None]
    assert j.boundary == "hypothesis 1" and j.explained == 1.0 and j.counts["boundary"] == 2
    called.clear()
    j = judge_sets(out, None, lo, hi, pt, options(1.0, 1.0), torch.float32)
    assert called == ["h0", "h1"] and j.counts["error"] == 1 and j.boundary == "hypothesis 0"


def test_a_rival_design_that_fits_better_is_named_instead_of_the_first_that_explains():
    """Two designs (``rivals``) can both cover a kernel's values: the later one is still tried after the first
    explained everything, and is named only when its center is closer to the output."""
    from ulptrace.oracle.judge import HypothesisResult, judge_sets

    lo = hi = pt = torch.zeros(4, dtype=torch.float64)
    out = torch.tensor([0.0, 1.0, 2.0, 0.0])  # elements 1 and 2 outside [0, 0]
    called = []

    def option(name, center, rivals=()):
        def make():
            called.append(name)
            return (torch.full((4,), -5.0, dtype=torch.float64), torch.full((4,), 5.0, dtype=torch.float64),
                    torch.tensor(center, dtype=torch.float64))
        return (HypothesisResult(name, f"design {name}", None, 0), make, rivals)

    # "fuller" sits on the output's values (mean distance 0), "simple" 0.5 away: the fuller design is named
    j = judge_sets(out, None, lo, hi, pt, [option("simple", [0, 1.5, 1.5, 0]), option("other", [0, 1, 2, 0]),
                                           option("fuller", [0, 1, 2, 0], ("simple",))], torch.float32)
    assert called == ["simple", "fuller"]  # "other" has no rivals: skipped as before
    assert j.boundary == "design fuller" and j.explained == 1.0 and j.counts["boundary"] == 2
    # the fuller design fits worse: the simpler one keeps the name
    called.clear()
    j = judge_sets(out, None, lo, hi, pt, [option("simple", [0, 1, 2, 0]),
                                           option("fuller", [0, 0.5, 2.5, 0], ("simple",))], torch.float32)
    assert called == ["simple", "fuller"] and j.boundary == "design simple"


@pytest.mark.parametrize("stored", [BF16, torch.float32], ids=str)
def test_an_out_of_set_elements_distance_is_its_ulps_to_the_nearer_end(stored):
    """``judge_sets``' distance of an element outside ``[lo, hi]`` (BF16 ends) is the number of BF16 steps from the
    output — rounded to BF16 (ml_dtypes' RNE) when stored wider — to the nearer end, counted here on bit patterns with
    numpy: across zero, among subnormals, to an infinite end; NaN is ``-1``, inside is 0."""
    import ml_dtypes
    import numpy as np
    from ulptrace.oracle.judge import judge_sets

    lo = torch.tensor([1.0, -2.0, -(2.0 ** -130), 3.0, -float("inf"), 0.5, 1.0, 1.0], dtype=BF16)
    hi = torch.tensor([1.5, -1.0, 2.0 ** -131, 3.0, -100.0, 0.75, 1.0, 1.0], dtype=BF16)
    out = torch.tensor([1.5390625, -2.5, 2.0 ** -128, -3.0, -96.0, 0.625, float("nan"), 1.0000001],
                       dtype=torch.float32)
    out = out.to(stored)
    judged = judge_sets(out, None, lo.double(), hi.double(), hi.double(), [], BF16)

    def key(x):
        bits = x.view(np.uint16).astype(np.int64)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits & 0x7FFF)

    rounded = out.float().numpy().astype(ml_dtypes.bfloat16)  # an independent round-to-nearest-even
    k, k_lo, k_hi = key(rounded), key(lo.float().numpy().astype(ml_dtypes.bfloat16)), key(
        hi.float().numpy().astype(ml_dtypes.bfloat16))
    nearer = np.minimum(np.abs(k - k_lo), np.abs(k - k_hi))
    inside = (out.double() >= lo.double()) & (out.double() <= hi.double())
    expected = [(-1 if torch.isnan(out[i]) else 0 if inside[i] else max(1, int(nearer[i]))) for i in range(len(out))]
    assert judged.distance.tolist() == expected
    # by hand: 0.0390625 over 1.5 in steps of 2**-7; 0.5 below -2 in steps of 2**-6; subnormals 32 and 4 (units of
    # 2**-133); -3 and 3 are 2 x 0x4040 apart; -96 is 8 half-steps above -100; an FP32 1 + 2**-23 rounds to BF16 1,
    # outside [1, 1] only before its rounding: the least distance an out-of-set element gets, 1
    assert expected == [5, 32, 28, 32896, 8, 0, -1, 0 if stored == BF16 else 1]


@pytest.mark.parametrize("stored", [BF16, torch.float32], ids=str)
def test_verdict_histograms_count_each_differing_elements_ulps_under_its_verdict(stored):
    """Per verdict, the BF16 ULPs between output and reference of the elements with that verdict (hand-derived: steps
    of 2**-7 at 1, 2**-6 at 2); exact elements are not counted; a wider output is rounded to BF16 first (2.048828125
    is 2.046875, 3 steps above 2, in BF16)."""
    from ulptrace.oracle.judge import verdict_histogram

    E, T, B, R, N = (VERDICTS.index(v) for v in ("exact", "tie", "boundary", "error", "nonfinite"))
    reference = torch.tensor([1.0, 1.0, 0.0, 2.0, 1.0, 1.0, 2.0], dtype=BF16)
    output = torch.tensor([1.0, 1.0078125, -0.0, 2.048828125, 1.09375, float("nan"), 2.0], dtype=torch.float32)
    verdicts = torch.tensor([E, T, T, B, R, N, E], dtype=torch.uint8)
    got = verdict_histogram(verdicts, output.to(stored), reference)
    zero = dict.fromkeys(("0", "1", "2", "3-4", "5-8", "9-16", ">16", "nonfinite"), 0)
    assert got == {"tie": {**zero, "0": 1, "1": 1}, "boundary": {**zero, "3-4": 1}, "error": {**zero, "9-16": 1},
                   "nonfinite": {**zero, "nonfinite": 1}}
    assert verdict_histogram(torch.zeros(7, dtype=torch.uint8), reference, reference) == {
        v: zero for v in ("tie", "boundary", "error", "nonfinite")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("against", ["reference", "semantics"])
def test_the_compiled_masks_give_the_torch_operations_judgements(dtype, against, monkeypatch) -> None:
    """``judge_sets_stacked`` with its masks from one compiled pass on the CPU (``ulptrace._ulp_cpu.classify``) and
    from the torch operations: the same judgement of every record of a stack (counts, codes, distances, hypotheses),
    over outputs inside, on and beyond the admissible set's ends, NaN and infinities in the output, the point and the
    ends, a reference or none; and a hand-derived element of each class."""
    from ulptrace import _ulp_cpu
    from ulptrace.oracle.intervals import Layout
    from ulptrace.oracle.judge import HypothesisResult, judge_sets_stacked

    assert _ulp_cpu.library() is not None, _ulp_cpu.unavailable_reason()
    g = torch.Generator().manual_seed(13)
    n = 3 * 4 * 257
    center = torch.randn(n, generator=g, dtype=torch.float64)
    width = torch.rand(n, generator=g, dtype=torch.float64) * 2.0**-7
    lo, hi = (center - width).to(dtype).double(), (center + width).to(dtype).double()
    pt = center.to(dtype).double()
    out = (center + width * 3 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
    out[::17] = lo.to(dtype)[::17]  # on an end
    nan, inf = float("nan"), float("inf")
    out[1::97], pt[2::89], lo[3::83], hi[4::79] = nan, nan, nan, nan
    out[5::101], pt[6::103], out[7::107], lo[7::107], hi[7::107] = inf, -inf, inf, -inf, inf
    reference = center.to(dtype)
    reference[8::61] = out[8::61]  # exact
    reference[9::71] = nan
    out[9::71] = nan  # NaN on both sides: bitwise equal only if the payloads are
    shape = (12, 257)
    args = [None if t is None else t.reshape(shape)
            for t in (out, reference if against == "reference" else None, lo, hi, pt)]
    explained = (lo - 2.0**-6, hi + 2.0**-6)  # a hypothesis that explains part of the out-of-set elements
    hypotheses = [(HypothesisResult("missing", "a wider set", 0, 0), lambda: tuple(t.reshape(shape) for t in explained))]
    layout = Layout([1, 2, 1], 4)  # three records of 3, 6 and 3 rows, stacked

    def judged() -> list:
        return judge_sets_stacked(args[0], args[1], args[2], args[3], args[4], hypotheses, dtype, ["a", "b", "c"],
                                  layout)

    compiled = judged()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_ulp_cpu, "classify", lambda *a: None)
        plain = judged()
    assert sum(j.counts[v] for j in compiled for v in ("tie", "boundary", "error", "nonfinite")) > 100
    classes = ("tie", "boundary", "error", "nonfinite") if against == "reference" else ("boundary", "error", "nonfinite")
    assert all(j.counts[v] for j in compiled for v in classes), [j.counts for j in compiled]  # (no tie: exact is in)
    for got, want in zip(compiled, plain, strict=True):
        assert got.counts == want.counts and got.boundary == want.boundary and got.max_error_ulp == want.max_error_ulp
        assert got.hypotheses == want.hypotheses and got.explained == want.explained
        assert torch.equal(got.verdicts, want.verdicts) and torch.equal(got.distance, want.distance)
    # by hand: inside the set, beyond it, NaN output with a finite set, NaN set with a finite output
    lo1, hi1 = torch.tensor([1.0, 1.0, 1.0, nan], dtype=torch.float64), torch.tensor([2.0, 2.0, 2.0, 2.0],
                                                                                       dtype=torch.float64)
    out1 = torch.tensor([1.5, 3.0, nan, 1.5], dtype=dtype)
    tie, bad, outside = _ulp_cpu.classify(out1, None, lo1, hi1, lo1.nan_to_num(1.0))
    assert (tie.tolist(), bad.tolist(), outside.tolist()) == ([False] * 4, [False, False, True, True],
                                                              [False, True, False, False])
    # with a reference equal to the first: exact there (no class), in the set elsewhere a tie
    tie, bad, outside = _ulp_cpu.classify(out1, torch.tensor([1.5, 1.0, 1.0, 1.0], dtype=dtype), lo1, hi1,
                                          lo1.nan_to_num(1.0))
    assert (tie.tolist(), bad.tolist(), outside.tolist()) == ([False] * 4, [False, False, True, True],
                                                              [False, True, False, False])
    assert _ulp_cpu.classify(out1.half(), None, lo1, hi1, lo1) is None  # FP16: the torch operations decide
