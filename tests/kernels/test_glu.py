"""GLU epilogue: reference vs HF's MLP (CPU), fused vs faithful, kernel vs reference (GPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import case_id, faithfully_rounded, poisoned, ulps
from ulptrace.kernels import glu, glu_reference


def projections(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    gate = (torch.randn(shape) * 3.0).to(dtype).to(device)
    up = (torch.randn(shape) * 2.0).to(dtype).to(device)
    return gate, up


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: case_id(d))
def test_faithful_reference_reproduces_hf_mlp_bitwise(family, dtype):
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP

        config = Qwen3_5TextConfig(hidden_size=123, intermediate_size=205)
        mlp = Qwen3_5MLP(config, config.intermediate_size)
    else:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP

        mlp = LlamaMLP(LlamaConfig(hidden_size=123, intermediate_size=205, num_attention_heads=3, num_key_value_heads=1, head_dim=42))
    mlp = mlp.to(dtype)
    x = torch.randn(2, 5, 123).to(dtype)
    with torch.no_grad():
        ours = mlp.down_proj(glu_reference(mlp.gate_proj(x), mlp.up_proj(x)))
        assert torch.equal(ours, mlp(x))


@pytest.mark.parametrize("shape", [(1, 1, 3584), (2, 5, 123), (7, 205)], ids=lambda s: "x".join(map(str, s)))
def test_fused_differs_from_faithful_within_two_ulps(shape):
    gate, up = projections(shape)
    faithful = glu_reference(gate, up)
    fused = glu_reference(gate, up, mode="fused")
    dist = ulps(fused, faithful)
    assert int((dist > 0).sum()) > 0
    assert int(dist.max()) <= 2


def test_fused_is_faithfully_rounded_and_faithful_replays_two_roundings():
    gate, up = projections((4, 1000))
    g64 = gate.double()
    silu64 = g64 / (1.0 + torch.exp(-g64))
    fused = glu_reference(gate, up, mode="fused")
    assert bool(faithfully_rounded(fused, silu64 * up.double()).all())
    replay = (silu64.to(torch.bfloat16).double() * up.double()).to(torch.bfloat16)
    assert int(ulps(glu_reference(gate, up), replay).max()) <= 1


@pytest.mark.parametrize("mode", ["faithful", "fused"])
def test_kernel_order_formula_agrees_with_torch_silu_to_the_tie_level(mode):
    gate, up = projections((8, 2048))
    dist = ulps(glu_reference(gate, up, mode=mode, order="kernel"), glu_reference(gate, up, mode=mode))
    assert int(dist.max()) <= 1
    assert float((dist > 0).float().mean()) < 0.01


def test_out_buffer_receives_hf_result_in_place():
    """``out=`` on the CPU: the caller's NaN-filled buffer itself holds HF's ``act_fn(gate) * up``."""
    from transformers.activations import ACT2FN

    gate, up = projections((3, 123))
    out = poisoned(gate.shape, gate.dtype)
    pointer = out.data_ptr()
    assert glu(gate, up, backend="reference", out=out) is out and out.data_ptr() == pointer
    assert bool(torch.isfinite(out).all())
    assert torch.equal(out, ACT2FN["silu"](gate) * up)  # Qwen3.5's and Llama's MLP epilogue


@pytest.mark.parametrize(
    ("gate", "up", "kwargs", "error", "message"),
    [
        (torch.zeros(2, 3), torch.zeros(2, 4), {}, ValueError, "same shape"),
        (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16), {}, TypeError, "same dtype"),
        (torch.zeros(2, 3), torch.zeros(2, 3), {"mode": "exact"}, ValueError, "mode must be one of"),
        (torch.zeros(2, 3), torch.zeros(2, 3), {"out": torch.zeros(3, 2)}, ValueError, "out must be"),
        ([1.0], torch.zeros(1), {}, TypeError, "gate must be a torch.Tensor"),
    ],
    ids=["shape", "dtype", "mode", "out-shape", "not-tensor"],
)
def test_bad_inputs_raise_clear_errors(gate, up, kwargs, error, message):
    with pytest.raises(error, match=message):
        glu(gate, up, backend="reference", **kwargs)


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("mode", ["faithful", "fused"])
@pytest.mark.parametrize("shape", [(1, 1, 3584), (2, 1, 3584), (4, 1, 3584), (8, 1, 3584), (8, 128, 3584),
                                   (5, 1, 123), (3, 7, 205)],
                         ids=lambda s: case_id(torch.bfloat16, B=s[0], T=s[1], D=s[2]))
def test_kernel_is_bitwise_its_reference_on_gpu(shape, mode):
    gate, up = projections(shape, device="cuda")
    out = poisoned(shape, gate.dtype, "cuda")
    glu(gate, up, mode=mode, backend="cuda", out=out)
    assert not bool(torch.isnan(out).any())
    assert torch.equal(out, glu_reference(gate, up, mode=mode, order="kernel"))
    if mode == "faithful":  # torch's own CUDA SiLU uses the same formula: HF on GPU, bitwise
        assert torch.equal(out, glu_reference(gate, up, mode=mode))
