"""The oracle on real CUDA kernels (``ulptrace.kernels``): faithful kernels are inside HF's semantics
(exact or tie), fused kernels are the named boundary. Checks the bounds against genuine FP32 GPU code
(FMA contraction, warp-shuffle trees, fast transcendentals) rather than torch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle_modules import make_attention_module, make_gated_norm, make_gates, make_qwen_norm
from transformers.activations import ACT2FN
from transformers.models.qwen3_5.modeling_qwen3_5 import eager_attention_forward
from ulptrace.oracle import capture_semantics, judge

BF16 = torch.bfloat16
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernels(cuda_kernels):
    """``ulptrace.kernels``, its extension built: a failed build errors (tests/conftest.py), never skips."""
    import ulptrace.kernels

    return ulptrace.kernels


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(BF16)


def honest(j) -> None:
    assert j.counts["boundary"] == j.counts["error"] == j.counts["nonfinite"] == 0, str(j)


def test_add_rms_norm_kernel(kernels):
    norm = make_qwen_norm().cuda()
    residual, delta = randn(256, 64, scale=4.0), randn(256, 64)
    inputs = {"residual": residual, "delta": delta}
    program = capture_semantics(lambda residual, delta: norm(residual + delta), inputs, constant_names=norm)
    reference = norm(residual + delta)
    for mode in ("faithful", "fused"):
        out, _ = kernels.add_rms_norm(delta, norm.weight, 1e-6, residual, variant="zero_centred", mode=mode,
                                      backend="cuda")
        j = judge(program, inputs, out, reference)
        if mode == "faithful":
            honest(j)
        else:
            assert j.counts["error"] == 0 and j.counts["boundary"] > 0
            assert j.boundary == "the BF16 rounding of `add(residual, delta)` (op 0) is missing"


def test_glu_and_gated_norm_kernels(kernels):
    act = ACT2FN["silu"]
    gate, up = randn(128, 256, scale=3.0), randn(128, 256)
    program = capture_semantics(lambda gate, up: act(gate) * up, {"gate": gate, "up": up})
    honest(judge(program, {"gate": gate, "up": up}, kernels.glu(gate, up, mode="faithful", backend="cuda")))
    j = judge(program, {"gate": gate, "up": up}, kernels.glu(gate, up, mode="fused", backend="cuda"), act(gate) * up)
    assert j.counts["error"] == 0 and j.boundary == "the BF16 rounding of `silu(gate)` (op 0) is missing"

    norm = make_gated_norm().cuda()
    x, g = randn(128, 64), randn(128, 64, scale=2.0)
    program = capture_semantics(lambda x, gate: norm(x, gate), {"x": x, "gate": g}, constant_names=norm)
    out = kernels.gated_rms_norm(x, g, norm.weight, 1e-6, mode="faithful", backend="cuda")
    honest(judge(program, {"x": x, "gate": g}, out, norm(x, g)))
    out = kernels.gated_rms_norm(x, g, norm.weight, 1e-6, mode="fused", backend="cuda")
    j = judge(program, {"x": x, "gate": g}, out, norm(x, g))
    assert j.counts["error"] == 0 and j.boundary == "all intermediates fused into one final rounding"


def test_gdn_gates_kernel(kernels):
    gates = make_gates().cuda()
    a, b = randn(64, 8, scale=3.0), randn(64, 8, scale=3.0)

    def g_formula(a):
        return -gates.A_log.float().exp() * F.softplus(a.float() + gates.dt_bias)

    program = capture_semantics(g_formula, {"a": a}, constant_names=gates)
    beta_program = capture_semantics(lambda b: b.sigmoid(), {"b": b})
    g, beta = kernels.gdn_gates(a, b, gates.A_log, gates.dt_bias, mode="faithful", backend="cuda")
    honest(judge(program, {"a": a}, g, g_formula(a)))
    honest(judge(beta_program, {"b": b}, beta, b.sigmoid()))
    g, _ = kernels.gdn_gates(a, b, gates.A_log, gates.dt_bias, mode="fused", backend="cuda")
    j = judge(program, {"a": a}, g, g_formula(a))
    assert j.counts["error"] == 0 and j.counts["boundary"] > 0 and program.output_op() == 6
    assert j.boundary == "`mul(neg(exp(f32(A_log))), softplus(add(f32(a), dt_bias)))` (op 6) rounded to BF16"


def test_decode_attention_kernel(kernels):
    module = make_attention_module()
    q, k, v = randn(2, 8, 1, 128), randn(2, 4, 200, 128), randn(2, 4, 200, 128)
    inputs = {"query": q, "key": k, "value": v}

    def eager(query, key, value):
        return eager_attention_forward(module, query, key, value, None, scaling=128**-0.5)[0]

    program = capture_semantics(eager, inputs)
    reference = eager(**inputs)
    for mode in ("faithful", "fused"):
        out = kernels.decode_attention(q[:, :, 0], k, v, scale=128**-0.5, semantics="eager", mode=mode,
                                       backend="cuda")
        j = judge(program, inputs, out[:, None], reference)  # [B, Hq, D] -> [B, 1, Hq, D]
        if mode == "faithful":
            honest(j)
        else:  # FP32 scores, softmax and P @ V, one final rounding
            assert j.counts["error"] == 0 and j.counts["boundary"] > 0, str(j)
            assert j.boundary == "all intermediates fused into one final rounding" and j.explained == 1.0
