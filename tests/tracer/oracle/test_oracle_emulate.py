"""Emulation in the program's own dtypes: bit for bit with HF, and with an explicit FP32 summation order."""

from __future__ import annotations

import pytest
import torch
from oracle_modules import make_gated_norm, make_llama_norm, make_qwen_norm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
from ulptrace.oracle import capture_semantics, emulate
from ulptrace.trees import reduce_fp32

BF16 = torch.bfloat16


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(BF16)


def test_emulate_reproduces_hf_norms_bit_for_bit():
    qwen_norm = make_qwen_norm()
    gated_norm = make_gated_norm()
    llama_norm = make_llama_norm()
    x, gate = randn(8, 64), randn(8, 64)
    for module, fn, inputs in [
        (qwen_norm, lambda x: qwen_norm(x), {"x": x}),
        (llama_norm, lambda x: llama_norm(x), {"x": x}),
        (gated_norm, lambda x, gate: gated_norm(x, gate), {"x": x, "gate": gate}),
    ]:
        program = capture_semantics(fn, inputs, constant_names=module)
        out = emulate(program, inputs)
        expected = fn(**inputs)
        assert out.dtype == expected.dtype and torch.equal(out.view(torch.int16), expected.view(torch.int16))


def _reversed_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """FP32 sum over ``dim`` from the last element to the first, written out step by step."""
    x = x.movedim(dim, -1)
    acc = torch.zeros(x.shape[:-1], dtype=torch.float32)
    for j in range(x.shape[-1] - 1, -1, -1):
        acc = acc + x[..., j]
    return acc


def test_emulate_with_an_explicit_order_gives_that_order_result():
    norm = Qwen3_5RMSNorm(1024, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 0.0, 0.1)
    norm = norm.to(BF16)
    x = randn(256, 1024)
    program = capture_semantics(lambda x: norm(x), {"x": x}, constant_names=norm)
    out = emulate(program, {"x": x}, reducer=_reversed_sum)
    # the same math typed out independently, with the same reversed order
    xf = x.float()
    var = _reversed_sum(xf * xf, -1) / 1024
    expected = ((xf * torch.rsqrt(var + 1e-6)[:, None]) * (1.0 + norm.weight.float())).to(BF16)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(out, norm(x)), "the order must matter somewhere for the test to mean anything"


def test_emulate_with_a_declared_tree():
    norm = Qwen3_5RMSNorm(512, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 0.0, 0.1)
    norm = norm.to(BF16)
    x = randn(16, 512)
    program = capture_semantics(lambda x: norm(x), {"x": x}, constant_names=norm)
    tree = "blocked:t128:v4"
    out = emulate(program, {"x": x}, reducer=lambda t, d: reduce_fp32(t, tree, d))
    xf = x.float()
    var = reduce_fp32(xf * xf, tree, -1) / 512
    expected = ((xf * torch.rsqrt(var + 1e-6)[:, None]) * (1.0 + norm.weight.float())).to(BF16)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_reducer_contract_is_checked():
    qwen_norm = make_qwen_norm()
    x = randn(4, 64)
    program = capture_semantics(lambda x: qwen_norm(x), {"x": x}, constant_names=qwen_norm)
    keepdim = emulate(program, {"x": x}, reducer=lambda t, d: t.sum(d, keepdim=True))
    dropped = emulate(program, {"x": x}, reducer=lambda t, d: t.sum(d))
    assert torch.equal(keepdim, dropped)
    with pytest.raises(TypeError, match="reducer must return an FP32 tensor, but got torch.float64"):
        emulate(program, {"x": x}, reducer=lambda t, d: t.double().sum(d))
    with pytest.raises(ValueError, match=r"reducer must return shape \[4\] \(or \[4, 1\]\), but got \[4, 2\]"):
        emulate(program, {"x": x}, reducer=lambda t, d: t[:, :2])
    with pytest.raises(ValueError, match="shape"):
        emulate(program, {"x": randn(3, 64)})
