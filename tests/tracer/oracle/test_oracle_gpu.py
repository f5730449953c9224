"""On CUDA: HF's own outputs (cuBLAS GEMMs, every SDPA backend, norms, GLU, gates) lie inside the
admissible sets of the semantics captured on the GPU, and an FP32-softmax attention with one final
rounding is a named boundary against HF's eager path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle_modules import make_attention_module, make_gated_norm, make_gates, make_qwen_norm
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.activations import ACT2FN
from transformers.models.qwen3_5.modeling_qwen3_5 import eager_attention_forward
from ulptrace.oracle import capture_semantics, judge

BF16 = torch.bfloat16
pytestmark = pytest.mark.gpu
# torch's own eligibility checks, the ones its SDPA dispatcher uses (MATH runs everywhere)
CAN_USE = {SDPBackend.FLASH_ATTENTION: "can_use_flash_attention",
           SDPBackend.EFFICIENT_ATTENTION: "can_use_efficient_attention",
           SDPBackend.CUDNN_ATTENTION: "can_use_cudnn_attention"}


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(BF16)


def assert_inside(fn, inputs, constants=None, **kw):
    program = capture_semantics(fn, inputs, constant_names=constants, **kw)
    out = fn(**inputs)
    j = judge(program, inputs, out)
    assert j.inside, f"{j}\n{program}"
    return program


def test_cuda_norms_glu_gates_are_admissible():
    qwen, gated, gates = make_qwen_norm().cuda(), make_gated_norm().cuda(), make_gates().cuda()
    x, gate = randn(64, 64, scale=3.0), randn(64, 64)
    assert_inside(lambda x: qwen(x), {"x": x}, qwen)
    assert_inside(lambda x, gate: gated(x, gate), {"x": x, "gate": gate}, gated)
    act = ACT2FN["silu"]
    assert_inside(lambda gate, up: act(gate) * up, {"gate": randn(64, 256, scale=3.0), "up": randn(64, 256)})
    assert_inside(lambda a: -gates.A_log.float().exp() * F.softplus(a.float() + gates.dt_bias),
                  {"a": randn(64, 8, scale=3.0)}, gates)


@pytest.mark.parametrize("shape", [(7, 64, 48), (1, 3, 1024, 2048), (5, 4096, 512)])
def test_cuda_linear_is_admissible(shape):
    *lead, k, n = shape
    lin = torch.nn.Linear(k, n).to(device="cuda", dtype=BF16)
    assert_inside(lin, {"input": randn(*lead, k)}, lin)


@pytest.mark.parametrize("backend", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                     SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], ids=lambda b: b.name)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_sdpa_backends_are_admissible(backend, causal, capfd):
    # causal with as many keys as queries: torch's is_causal (top-left) and flash's (bottom-right) agree
    keys = 64 if causal else 80
    q, k, v = randn(2, 8, 64, 128), randn(2, 8, keys, 128), randn(2, 8, keys, 128)
    inputs = {"query": q, "key": k, "value": v}

    def sdpa(query, key, value):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(query, key, value, is_causal=causal)

    absent = unsupported_reason(backend, q, k, v, causal, capfd)
    if absent is not None:  # only a backend torch's own check rejects here skips; one that raises fails
        pytest.skip(f"{backend.name} cannot run these inputs with this torch build and device: {absent}")
    assert_inside(sdpa, inputs)


def unsupported_reason(backend, q, k, v, causal, capfd) -> str | None:
    """Why torch's SDPA eligibility check (the dispatcher's) rejects ``backend`` for these inputs here, or
    None when it accepts them. With ``debug=True`` torch writes its reasons to stderr as C++ warnings."""
    if backend not in CAN_USE:
        return None
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, False)
    capfd.readouterr()
    usable = getattr(torch.backends.cuda, CAN_USE[backend])(params, True)
    reasons = capfd.readouterr().err.strip()
    return None if usable else f"torch.backends.cuda.{CAN_USE[backend]} says no ({reasons or 'no reason given'})"


def test_cuda_eager_attention_is_admissible_and_fp32_softmax_is_named():
    module = make_attention_module()
    q, k, v = randn(1, 8, 1, 128), randn(1, 4, 300, 128), randn(1, 4, 300, 128)  # one decode step, GQA
    inputs = {"query": q, "key": k, "value": v}

    def eager(query, key, value):
        return eager_attention_forward(module, query, key, value, None, scaling=128**-0.5)[0]

    program = assert_inside(eager, inputs)
    # a decode kernel: FP32 scores, FP32 softmax, FP32 P @ V, one final rounding
    kr, vr = k.repeat_interleave(2, 1).float(), v.repeat_interleave(2, 1).float()
    p = torch.softmax((q.float() @ kr.transpose(-1, -2)) * 128**-0.5, -1)
    fused = (p @ vr).transpose(1, 2).to(BF16)
    j = judge(program, inputs, fused, eager(**inputs))
    assert j.counts["error"] == 0 and j.counts["boundary"] > 0, str(j)
    assert j.boundary == "all intermediates fused into one final rounding" and j.explained == 1.0
