"""Capturing reference semantics: the op list, its dtypes and rounding points, constant naming, and the
clear errors for formulas the replay cannot follow."""

from __future__ import annotations

import pytest
import torch
from oracle_modules import make_gated_norm, make_qwen_norm
from ulptrace.oracle import UnsupportedOpError, capture_semantics, enumerate_hypotheses, judge, supported_ops

BF16 = torch.bfloat16


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(BF16)


def test_gated_norm_listing_shows_the_bf16_rounding_after_normalisation():
    gated_norm = make_gated_norm()
    x, gate = randn(4, 64), randn(4, 64)
    program = capture_semantics(lambda x, gate: gated_norm(x, gate), {"x": x, "gate": gate},
                                constant_names=gated_norm, name="layers.0.linear_attn.norm")
    # HF's Qwen3_5RMSNormGated (read from its source): upcast, square, mean, + eps, rsqrt, scale (all FP32),
    # .to(bf16), bf16 weight * (bf16), upcast gate, silu (FP32), product (FP32), .to(bf16)
    assert [program.result_dtype(op.index) for op in program.ops] == [
        torch.float32] * 6 + [BF16, BF16, torch.float32, torch.float32, torch.float32, BF16]
    text = str(program)
    lines = text.splitlines()
    assert lines[0].startswith("Program layers.0.linear_attn.norm: 2 inputs, 1 constants, 12 ops")
    assert "  constant weight: bf16 [64]" in lines
    normalised = next(line for line in lines if line.lstrip().startswith("6  "))
    assert "bf16(mul(f32(x), rsqrt(%3))) -> bf16 [4, 64]" in normalised and "[rounds to BF16]" in normalised
    assert "[reduction n=64, FP32 accumulation in any order, FP32 rounding]" in text
    assert lines[-1].lstrip().startswith("11  bf16(") and lines[-1].endswith("<- output")
    assert [op.index for op in program.ops if program.is_rounding_point(op.index)] == [1, 2, 3, 4, 5, 6, 7, 9, 10, 11]


def test_views_and_upcasts_are_not_rounding_points():
    def fn(x):
        return (x.float().t().reshape(8, 4).unsqueeze(0) * 2.0).to(BF16)

    program = capture_semantics(fn, {"x": randn(4, 8)})
    notes = [(op.name, program._note(op.index)) for op in program.ops]
    assert notes[0] == ("_to_copy", "exact conversion to FP32") and ("t", "view, no rounding") in notes
    assert notes[-1] == ("_to_copy", "rounds to BF16")
    rounding = [op.name for op in program.ops if program.is_rounding_point(op.index)]
    assert rounding == ["mul", "_to_copy"]


def test_constants_are_named_from_a_module_a_dict_or_anonymously():
    qwen_norm = make_qwen_norm()
    x = randn(2, 64)
    by_module = capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names=qwen_norm)
    by_dict = capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names={"scale": qwen_norm.weight})
    anonymous = capture_semantics(lambda x: qwen_norm(x), {"x": x})
    assert list(by_module.constants) == ["weight"]
    assert list(by_dict.constants) == ["scale"]
    assert list(anonymous.constants) == ["const0"]
    for program in (by_module, by_dict, anonymous):
        stored = next(iter(program.constants.values()))
        assert torch.equal(stored, qwen_norm.weight.detach())
        assert stored.data_ptr() != qwen_norm.weight.data_ptr()  # a copy: later changes do not leak in


def test_constants_come_from_the_reference_not_the_judged_path():
    qwen_norm = make_qwen_norm()
    x = randn(4, 64)
    program = capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names=qwen_norm)
    reference = qwen_norm(x)
    with torch.no_grad():
        qwen_norm.weight.add_(0.5)  # the module changes after capture
    assert judge(program, {"x": x}, reference).inside


def test_in_place_ops_on_program_values_are_recorded_out_of_place():
    def fn(x):
        return x.float().mul_(3.0).add_(1.0).to(BF16)

    x = randn(4, 8)
    program = capture_semantics(fn, {"x": x})
    assert [op.name for op in program.ops] == ["_to_copy", "mul", "add", "_to_copy"]
    assert judge(program, {"x": x}, fn(x)).inside


def test_multi_output_ops_and_unused_results():
    def fn(x):
        first, second = x.float().split(4, dim=-1)
        _ = first.exp()  # computed but unused
        return (second * 2.0).to(BF16)

    x = randn(3, 8)
    program = capture_semantics(fn, {"x": x})
    assert "(unused)" in str(program)
    assert judge(program, {"x": x}, fn(x)).inside


def test_unsupported_op_is_named_with_its_index():
    with pytest.raises(UnsupportedOpError, match=r"site 'scan', op 1 \(aten.cumsum.default\) is not supported"):
        capture_semantics(lambda x: torch.cumsum(x.float(), -1), {"x": randn(2, 4)}, name="scan")


def test_reading_a_value_into_python_is_rejected():
    with pytest.raises(UnsupportedOpError, match="reads a value"):
        capture_semantics(lambda x: x * float(x.abs().max()), {"x": randn(2, 4)})


def test_output_must_depend_on_the_inputs():
    w = randn(4)
    with pytest.raises(ValueError, match="not computed from its inputs"):
        capture_semantics(lambda x: w * 2, {"x": randn(4)})
    with pytest.raises(ValueError, match="not computed from its inputs"):
        capture_semantics(lambda x: x, {"x": randn(4)})


def test_bad_arguments_are_rejected():
    qwen_norm = make_qwen_norm()
    x = randn(2, 64)
    with pytest.raises(TypeError, match="inputs must be a non-empty dict of tensors, but got list"):
        capture_semantics(lambda x: qwen_norm(x), [x])
    with pytest.raises(TypeError, match=r"inputs\['x'\] must be a tensor, but got float"):
        capture_semantics(lambda x: qwen_norm(x), {"x": 1.0})
    with pytest.raises(ValueError, match=r"attention must be one of \('flash', 'fp32'\), but got 'fast'"):
        capture_semantics(lambda x: qwen_norm(x), {"x": x}, attention="fast")
    with pytest.raises(TypeError, match=r"constant_names\['w'\] must be a tensor, but got str"):
        capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names={"w": "weight"})
    with pytest.raises(TypeError, match="must return a tensor"):
        capture_semantics(lambda x: None, {"x": x})


def test_supported_ops_cover_the_hf_formulas():
    ops = supported_ops()
    for name, kind in [("_to_copy", "convert"), ("pow", "approx"), ("mean", "reduce"), ("rsqrt", "approx"),
                       ("mul", "exact"), ("silu", "approx"), ("softplus", "approx"), ("addmm", "matmul"),
                       ("bmm", "matmul"), ("_softmax", "softmax"), ("transpose", "view"),
                       ("_scaled_dot_product_flash_attention_for_cpu", "attention"),
                       ("_scaled_dot_product_efficient_attention", "attention")]:
        assert ops[name] == kind


def test_hypotheses_of_the_qwen_norm():
    qwen_norm = make_qwen_norm()
    program = capture_semantics(lambda x: qwen_norm(x), {"x": randn(2, 64)}, constant_names=qwen_norm)
    hypotheses = enumerate_hypotheses(program)
    # one FP32 result per op except the two upcasts and the final BF16 cast; HF rounds to BF16 only at the end,
    # so no intermediate rounding can be "missing" and there is nothing to fuse; the final rounding itself may be
    # skipped by a site that emits FP32 ("unrounded")
    assert [h.kind for h in hypotheses] == ["added"] * 7 + ["unrounded"]
    assert [h.op for h in hypotheses] == [1, 2, 3, 4, 5, 7, 8, 9]
    assert hypotheses[5].description == "`add(f32(weight), 1.0)` (op 7) rounded to BF16"


def test_an_output_assembled_from_two_roundings_keeps_both():
    def fn(x, y):
        return torch.cat([(x.float() * 3.0).to(BF16), y + y], dim=-1)

    x, y = randn(2, 4), randn(2, 4)
    program = capture_semantics(fn, {"x": x, "y": y})
    names = {program.ops[i].name for i in program.output_ops()}
    assert names == {"_to_copy", "add"}
    assert not [h for h in enumerate_hypotheses(program) if h.kind == "missing"]
    assert judge(program, {"x": x, "y": y}, fn(x, y)).inside
