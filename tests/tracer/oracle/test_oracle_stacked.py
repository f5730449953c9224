"""Several records judged in one replay (``judge_stacked``, ``ulptrace.oracle.members``): each record's judgement is
the one ``judge`` gives it alone — counts, hypotheses, boundary, largest error, the admissible set bit for bit — and a
stack whose records would take different paths in the replay raises ``MixedDecision`` instead of judging them by one
record's path."""

from __future__ import annotations

import pytest
import torch
from oracle_modules import make_gated_norm, make_qwen_norm
from transformers.activations import ACT2FN
from ulptrace.oracle import capture_semantics, judge, judge_stacked
from ulptrace.oracle.intervals import Layout, MixedDecision
from ulptrace.oracle.judge import verdict_histogram, verdict_histograms
from ulptrace.oracle.members import signature, stacks

BF16 = torch.bfloat16


def _same(alone, stacked) -> None:
    assert stacked.counts == alone.counts
    assert stacked.boundary == alone.boundary and stacked.explained == alone.explained
    assert stacked.max_error_ulp == alone.max_error_ulp
    assert [(h.kind, h.op, h.explained) for h in stacked.hypotheses] == \
        [(h.kind, h.op, h.explained) for h in alone.hypotheses]
    for name in ("verdicts", "lo", "hi", "point", "distance"):
        a, b = getattr(alone, name), getattr(stacked, name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                                                  b.view(torch.uint8) if b.is_floating_point() else b), name


def _cat(dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([d[k] for d in dicts]) for k in dicts[0]}


def _norm_records(norm, count: int, rows: int = 3, width: int = 64):
    """``count`` records of a norm: the reference's output, and in turn a candidate's that is equal, one that rounds the
    normalised value to BF16 before the weight (an extra rounding: a boundary), the same with planted errors, the same
    with a NaN."""
    torch.manual_seed(0)
    records = []
    for k in range(count):
        x = (torch.randn(rows, width) * (1 + k)).to(BF16)
        ref = norm(x)
        variance = x.float().pow(2).mean(-1, keepdim=True)
        normed = (x.float() * torch.rsqrt(variance + norm.eps)).to(BF16).float()
        fused = (normed * (1.0 + norm.weight.float())).to(BF16)
        cand = [ref.clone(), fused, fused.clone(), fused.clone()][k % 4]
        if k % 4 == 2:
            cand[0, :5] = (cand[0, :5].float() * 1.5).to(BF16)  # errors: far outside any set
        if k % 4 == 3:
            cand[1, 3] = float("nan")
        records.append(({"x": x}, cand, ref))
    return records


@pytest.mark.parametrize("count", [2, 5, 8])
def test_stacked_norm_records_are_judged_as_alone(count) -> None:
    norm = make_qwen_norm()
    records = _norm_records(norm, count)
    one = capture_semantics(lambda x: norm(x), records[0][0], constant_names=norm, name="norm")
    many = capture_semantics(lambda x: norm(x), _cat([r[0] for r in records]), constant_names=norm, name="norm")
    assert stacks(one, many, count)
    alone = [judge(one, inputs, cand, ref) for inputs, cand, ref in records]
    together = judge_stacked(many, _cat([r[0] for r in records]), torch.cat([r[1] for r in records]),
                             torch.cat([r[2] for r in records]), [f"r{k}" for k in range(count)])
    assert [j.site for j in together] == [f"r{k}" for k in range(count)]
    for a, b in zip(alone, together, strict=True):
        _same(a, b)
    kinds = {j.worst for j in alone}
    assert {"exact", "boundary"} <= kinds or count < 4  # the mix the records were made to have
    if count >= 4:
        assert {"error", "nonfinite"} <= kinds
    histograms = verdict_histograms(torch.cat([j.verdicts for j in together]), torch.cat([r[1] for r in records]),
                                    torch.cat([r[2] for r in records]), Layout.of(count))
    assert histograms == [verdict_histogram(j.verdicts, r[1], r[2]) for j, r in zip(alone, records, strict=True)]


def test_stacked_gated_norm_and_glu_with_hypotheses_tried_per_record() -> None:
    """Two inputs each; a record whose out-of-set elements an early hypothesis explains beside one that needs a later
    one: each record's list of hypotheses (tried, not tried) is its own."""
    gated = make_gated_norm()
    torch.manual_seed(1)
    recs = []
    for k in range(4):
        x, gate = torch.randn(4, 64).to(BF16), (torch.randn(4, 64) * 2).to(BF16)
        ref = gated(x, gate)
        v = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + gated.variance_epsilon)
        fused = (gated.weight.float() * v * torch.nn.functional.silu(gate.float())).to(BF16)
        recs.append(({"x": x, "gate": gate}, fused if k % 2 else ref, ref))
    one = capture_semantics(lambda x, gate: gated(x, gate), recs[0][0], constant_names=gated)
    inputs = _cat([r[0] for r in recs])
    many = capture_semantics(lambda x, gate: gated(x, gate), inputs, constant_names=gated)
    assert stacks(one, many, 4)
    together = judge_stacked(many, inputs, torch.cat([r[1] for r in recs]), torch.cat([r[2] for r in recs]),
                             [None] * 4)
    for (rec_inputs, cand, ref), b in zip(recs, together, strict=True):
        _same(judge(one, rec_inputs, cand, ref), b)

    act = ACT2FN["silu"]
    pairs = [{"gate": (torch.randn(2, 96) * 3).to(BF16), "up": torch.randn(2, 96).to(BF16)} for _ in range(3)]
    outs = [(act(p["gate"].float()) * p["up"].float()).to(BF16) for p in pairs]  # silu not rounded: a boundary
    refs = [act(p["gate"]) * p["up"] for p in pairs]
    one = capture_semantics(lambda gate, up: act(gate) * up, pairs[0])
    many = capture_semantics(lambda gate, up: act(gate) * up, _cat(pairs))
    together = judge_stacked(many, _cat(pairs), torch.cat(outs), torch.cat(refs), [None] * 3)
    for p, o, r, b in zip(pairs, outs, refs, together, strict=True):
        alone = judge(one, p, o, r)
        _same(alone, b)
    assert any(j.boundary for j in together)


def test_records_that_decide_differently_raise_mixed_decision() -> None:
    """An FP32 product is rounded to BF16: where both factors have short significands the product is an FP32 value
    (the exact point path), elsewhere it is not — per record, so a stack of one of each cannot be judged as one."""
    def formula(x, y):
        return (x * y).to(BF16)

    short = {"x": torch.randn(2, 32).to(BF16).float(), "y": torch.randn(2, 32).to(BF16).float()}
    long_ = {"x": torch.randn(2, 32), "y": torch.randn(2, 32)}
    one = capture_semantics(formula, short)
    both = _cat([short, long_])
    many = capture_semantics(formula, both)
    assert stacks(one, many, 2)
    outs = torch.cat([formula(**short), formula(**long_)])
    with pytest.raises(MixedDecision) as raised:
        judge_stacked(many, both, outs, outs, [None, None])
    assert raised.value.equal == [True, False]
    same_way = _cat([short, short])
    together = judge_stacked(many, same_way, torch.cat([formula(**short)] * 2), torch.cat([formula(**short)] * 2),
                             [None, None])
    _same(judge(one, short, formula(**short), formula(**short)), together[1])


def test_a_program_that_mixes_records_does_not_stack() -> None:
    """A formula that reduces over dimension 0 (each record would see the others) captured for a stack is not the
    record's program stacked; nor is a program with other ops."""
    x = torch.randn(2, 16).to(BF16)
    centred = capture_semantics(lambda x: x - x.mean(0, keepdim=True), {"x": x})
    centred_many = capture_semantics(lambda x: x - x.mean(0, keepdim=True), {"x": torch.cat([x, x])})
    assert not stacks(centred, centred_many, 2)
    plain_many = capture_semantics(lambda x: x * 2, {"x": torch.cat([x, x])})
    assert not stacks(centred, plain_many, 2)
    assert not stacks(capture_semantics(lambda x: x * 2, {"x": x}), plain_many, 3)  # the wrong count


def test_signature_equal_for_equal_formulas_only() -> None:
    a, b = make_qwen_norm(), make_qwen_norm()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 64).to(BF16)
    pa = capture_semantics(lambda x: a(x), {"x": x}, constant_names=a)
    pb = capture_semantics(lambda x: b(x), {"x": x}, constant_names=b)
    assert signature(pa) == signature(pb)  # two layers' norms with equal weights: one program
    with torch.no_grad():
        b.weight[3] += 0.25
    pc = capture_semantics(lambda x: b(x), {"x": x}, constant_names=b)
    assert signature(pc) != signature(pa)  # another weight: another program
    pd = capture_semantics(lambda x: a(x), {"x": torch.randn(3, 64).to(BF16)}, constant_names=a)
    assert signature(pd) != signature(pa)  # another shape


def test_a_value_the_records_share_is_decided_whole() -> None:
    """``1 + w`` of a constant ``w`` is an FP32 value in some elements and not in others: the same for every record,
    it is decided once for all of them (its dimension 0 is no length of the records' values), not split as if its
    halves were two records' — which would raise ``MixedDecision`` for records that decide alike."""
    w = torch.tensor([0.5, 0.25, 2.0**-30, 2.0**-31], dtype=torch.float64)

    def formula(x):
        return (x.float() * (1.0 + w).float()).to(BF16)

    x1, x2 = torch.randn(1, 4).to(BF16), torch.randn(1, 4).to(BF16)
    one = capture_semantics(formula, {"x": x1})
    many = capture_semantics(formula, {"x": torch.cat([x1, x2])})
    assert stacks(one, many, 2)
    outs = [formula(x1), formula(x2)]
    together = judge_stacked(many, {"x": torch.cat([x1, x2])}, torch.cat(outs), torch.cat(outs), [None, None])
    for x, out, b in zip((x1, x2), outs, together, strict=True):
        _same(judge(one, {"x": x}, out, out), b)


def test_records_of_different_lengths_stack_as_rows() -> None:
    """Records of 3, 1 and 5 rows, each row a unit of the stack (its program captured for one row), padded to 16 rows
    with copies of the first record's: each record's judgement is its own alone (its program captured for its own
    shape), the padding is judged for none, and its verdict histograms are its own."""
    norm = make_qwen_norm()
    lengths = [3, 1, 5]
    records = []
    for k, n in enumerate(lengths):  # equal, a boundary, a boundary with errors
        rec = _norm_records(norm, 3, rows=n)[k]
        records.append(rec)
    pad = 16 - sum(lengths)
    first = records[0]
    padding = [{"x": first[0]["x"].repeat(3, 1)[:pad]}, first[1].repeat(3, 1)[:pad], first[2].repeat(3, 1)[:pad]]
    stacked = [_cat([r[0] for r in records] + [padding[0]]), torch.cat([r[1] for r in records] + [padding[1]]),
               torch.cat([r[2] for r in records] + [padding[2]])]
    unit = capture_semantics(lambda x: norm(x), {"x": first[0]["x"][:1]}, constant_names=norm, name="norm")
    many = capture_semantics(lambda x: norm(x), stacked[0], constant_names=norm, name="norm")
    assert stacks(unit, many, 16) and not stacks(unit, many, 9)
    layout = Layout(lengths, 16)
    together = judge_stacked(many, *stacked, ["a", "b", "c"], layout=layout)
    assert [j.site for j in together] == ["a", "b", "c"]
    alone = []
    for (inputs, cand, ref), b in zip(records, together, strict=True):
        own = capture_semantics(lambda x: norm(x), inputs, constant_names=norm, name="norm")
        alone.append(judge(own, inputs, cand, ref))
        _same(alone[-1], b)
    assert [j.worst for j in alone] == ["exact", "boundary", "error"]  # the mix the records were made to have
    histograms = verdict_histograms(torch.cat([j.verdicts for j in together]), torch.cat([r[1] for r in records]),
                                    torch.cat([r[2] for r in records]), Layout(lengths))
    assert histograms == [verdict_histogram(j.verdicts, r[1], r[2]) for j, r in zip(alone, records, strict=True)]


def test_a_layout_decides_per_record_and_the_padding_with_the_first() -> None:
    """Rows of an FP32-exact product beside rows of an inexact one: records of such rows decide by all their rows (a
    record with one inexact row goes the inexact way, as alone), records that differ raise ``MixedDecision`` naming
    each record's way, and padding copied from the first record never makes a stack mixed."""
    def formula(x, y):
        return (x * y).to(BF16)

    torch.manual_seed(1)
    short = {"x": torch.randn(4, 32).to(BF16).float(), "y": torch.randn(4, 32).to(BF16).float()}
    long_ = {"x": torch.randn(4, 32), "y": torch.randn(4, 32)}
    unit = capture_semantics(formula, {k: v[:1] for k, v in short.items()})

    def run(inputs: dict[str, torch.Tensor], lengths: list[int], units: int):
        many = capture_semantics(formula, inputs)
        assert stacks(unit, many, units)
        out = formula(**inputs)
        return judge_stacked(many, inputs, out, out, [None] * len(lengths), layout=Layout(lengths, units))

    # record 0: three short rows then one long row (inexact as a whole); record 1: four short rows
    mixed0 = {k: torch.cat([short[k][:3], long_[k][:1]]) for k in short}
    with pytest.raises(MixedDecision) as raised:
        run(_cat([mixed0, short]), [4, 4], 8)
    assert raised.value.equal == [False, True]
    # padding copied from record 0's first (short) row decides with record 0, which goes the inexact way with record 1:
    # not mixed, though the padding's rows alone would go the exact way
    long2 = {k: v[:2] for k, v in long_.items()}
    padded = _cat([mixed0, long2, {k: v[:1].repeat(2, 1) for k, v in mixed0.items()}])
    together = run(padded, [4, 2], 8)
    for inputs, judged in zip((mixed0, long2), together, strict=True):
        _same(judge(capture_semantics(formula, inputs), inputs, formula(**inputs), formula(**inputs)), judged)
    with pytest.raises(ValueError, match="at least one unit"):
        Layout([2, 0], 4)
    with pytest.raises(ValueError, match="at least one unit"):
        Layout([3, 3], 4)


def _weighted_norm(weight: torch.Tensor):
    def formula(x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * (1.0 + weight.float())).to(BF16)
    return formula


def test_per_unit_parameters_stack_two_layers_norms() -> None:
    """Two layers' norms with their own weights: captured with the weight per unit (dimension 0 of one, each unit's
    own layer's values in the stack) they are one program (``signature`` leaves the per-unit values out), the stack is
    theirs (``stacks`` checks what is made of the weight as it checks the inputs), and each record's judgement is the
    one its own layer's program gives it alone."""
    torch.manual_seed(2)
    w_a, w_b = torch.randn(64) * 0.1, torch.randn(64) * 0.1
    x_a, x_b = torch.randn(3, 64).to(BF16), (torch.randn(2, 64) * 3).to(BF16)
    refs = [_weighted_norm(w)(x) for w, x in ((w_a, x_a), (w_b, x_b))]
    cands = [r.clone() for r in refs]
    cands[1][1, :4] = (cands[1][1, :4].float() * 1.5).to(BF16)  # errors in the second layer's record
    per_unit = frozenset({"weight"})

    def unit(w, x):
        lifted = w.reshape(1, -1)
        return capture_semantics(_weighted_norm(lifted), {"x": x[:1]}, constant_names={"weight": lifted})

    one_a, one_b = unit(w_a, x_a), unit(w_b, x_b)
    assert signature(one_a, per_unit) == signature(one_b, per_unit)
    assert signature(one_a) != signature(one_b)
    lifted = torch.cat([w_a.reshape(1, -1).expand(3, -1), w_b.reshape(1, -1).expand(2, -1),
                        w_a.reshape(1, -1).expand(3, -1)])  # padded to 8 units with the first record's
    x = torch.cat([x_a, x_b, x_a])
    many = capture_semantics(_weighted_norm(lifted), {"x": x}, constant_names={"weight": lifted})
    assert stacks(one_a, many, 8, per_unit)
    assert not stacks(one_a, many, 8)  # without per-unit constants, a weight of another shape: not the program
    outs, ref_outs = torch.cat([*cands, cands[0]]), torch.cat([*refs, refs[0]])
    together = judge_stacked(many, {"x": x}, outs, ref_outs, ["a", "b"], layout=Layout([3, 2], 8), per_unit=per_unit)
    for w, xx, cand, ref, judged in zip((w_a, w_b), (x_a, x_b), cands, refs, together, strict=True):
        own = capture_semantics(_weighted_norm(w), {"x": xx}, constant_names={"weight": w})
        _same(judge(own, {"x": xx}, cand, ref), judged)
    assert together[0].worst == "exact" and together[1].worst == "error"
    # a program with another layer's values: the same ops, its constant replaced (shapes and dtypes checked)
    assert torch.equal(one_a.with_constants({"weight": one_b.constants["weight"]}).constants["weight"],
                       one_b.constants["weight"])
    with pytest.raises(ValueError, match="constant 'weight'"):
        one_a.with_constants({"weight": torch.zeros(2, 64)})


def test_a_formula_that_mixes_units_parameters_does_not_stack() -> None:
    """A formula that reduces a per-unit parameter over dimension 0 would mix the layers' values: not the stack."""
    def formula(weight):
        return lambda x: (x.float() * weight.float().sum(0)).to(BF16)

    w1, w8 = torch.randn(1, 16), torch.randn(8, 16)
    one = capture_semantics(formula(w1), {"x": torch.randn(1, 16)}, constant_names={"weight": w1})
    many = capture_semantics(formula(w8), {"x": torch.randn(8, 16)}, constant_names={"weight": w8})
    assert not stacks(one, many, 8, frozenset({"weight"}))


@pytest.mark.parametrize("bias", [False, True], ids=["mm", "addmm"])
def test_per_record_constants_stack_three_layers_linear_layers(bias) -> None:
    """Three layers' linear layers, each with its own weight matrix (and bias: its rounding decided inside the op),
    records of 3, 1 and 2 rows padded to 8 with the first's: one program (``signature`` leaves the per-record values
    out), the matmul evaluated record by record with each record's own weight (``judge_stacked(per_record=)``), the
    rest once — each record's judgement the one its own layer's program gives it alone."""
    torch.manual_seed(3)
    weights = [(torch.randn(16, 32) * 0.2).to(BF16) for _ in range(3)]
    biases = [(torch.randn(16) * 0.1).to(BF16) for _ in range(3)]
    xs = [(torch.randn(n, 32) * (1 + k)).to(BF16) for k, n in enumerate((3, 1, 2))]

    def linear(w, b):
        return lambda x: torch.nn.functional.linear(x, w, b if bias else None)

    refs = [linear(w, b)(x) for w, b, x in zip(weights, biases, xs, strict=True)]
    cands = [r.clone() for r in refs]
    cands[1] = torch.nn.functional.linear(xs[1].float(), weights[1].float(), biases[1].float() if bias else None
                                          ).to(BF16)  # FP32 accumulation, another order: ties or equal
    cands[2][1, :3] = (cands[2][1, :3].float() * 1.5).to(BF16)  # errors in the third layer's record
    names = {"weight": weights[0], "bias": biases[0]} if bias else {"weight": weights[0]}
    own = frozenset(names)

    def program(k, x):
        return capture_semantics(linear(weights[k], biases[k]), {"x": x}, constant_names=(
            {"weight": weights[k], "bias": biases[k]} if bias else {"weight": weights[k]}))

    units = [program(k, x[:1]) for k, x in enumerate(xs)]
    assert len({signature(u, per_record=own) for u in units}) == 1
    assert len({signature(u) for u in units}) == 3
    x = torch.cat([*xs, xs[0][:2]])
    many = capture_semantics(linear(weights[0], biases[0]), {"x": x}, constant_names=names)
    assert stacks(units[0], many, 8)
    per_record = {"weight": weights, "bias": biases} if bias else {"weight": weights}
    together = judge_stacked(many, {"x": x}, torch.cat([*cands, cands[0][:2]]), torch.cat([*refs, refs[0][:2]]),
                             ["a", "b", "c"], layout=Layout([3, 1, 2], 8), per_record=per_record)
    for k, judged in enumerate(together):
        _same(judge(program(k, xs[k]), {"x": xs[k]}, cands[k], refs[k]), judged)
    assert together[0].worst == "exact" and together[2].worst == "error"
    # the first layer's weight for every record: another answer (the others' own weights were used)
    wrong = judge_stacked(many, {"x": x}, torch.cat([*cands, cands[0][:2]]), torch.cat([*refs, refs[0][:2]]),
                          ["a", "b", "c"], layout=Layout([3, 1, 2], 8))
    assert torch.equal(wrong[0].lo, together[0].lo)
    assert not torch.equal(wrong[1].lo, together[1].lo) and not torch.equal(wrong[2].hi, together[2].hi)
    with pytest.raises(ValueError, match="per_record\\['weight'\\] must hold 3 tensors"):
        judge_stacked(many, {"x": x}, torch.cat([*cands, cands[0][:2]]), torch.cat([*refs, refs[0][:2]]),
                      ["a", "b", "c"], layout=Layout([3, 1, 2], 8), per_record={"weight": weights[:2]})
