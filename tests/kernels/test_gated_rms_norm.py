"""Gated RMSNorm: reference vs Qwen3_5RMSNormGated (CPU), fused vs faithful, kernel vs reference (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import case_id, faithfully_rounded, poisoned, simulate_blocked, ulps
from ulptrace.kernels import gated_rms_norm, gated_rms_norm_reference
from ulptrace.kernels._common import blocked_launch
from ulptrace.kernels.gated_rms_norm import tree_spec


def hf_gated(n: int, dtype: torch.dtype, eps: float = 1e-6) -> torch.nn.Module:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    module = Qwen3_5RMSNormGated(n, eps=eps)
    with torch.no_grad():
        module.weight.copy_(torch.randn(n) * 0.1 + 1.0)
    return module.to(dtype)


def inputs(rows: int, n: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    x = (torch.randn(rows, n) * 0.5).to(dtype).to(device)
    gate = (torch.randn(rows, n) * 2.0).to(dtype).to(device)
    return x, gate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: case_id(d))
@pytest.mark.parametrize(("rows", "n"), [(1, 128), (2 * 5 * 4, 128), (7, 123), (3, 40)],
                         ids=lambda v: str(v))
def test_faithful_reference_is_bitwise_hf(rows, n, dtype):
    module = hf_gated(n, dtype)
    x, gate = inputs(rows, n, dtype)
    with torch.no_grad():
        assert torch.equal(gated_rms_norm_reference(x, gate, module.weight, module.variance_epsilon),
                           module(x, gate))


def test_fused_differs_from_faithful_within_two_ulps_and_is_faithfully_rounded():
    x, gate = inputs(64, 128)
    w = (torch.randn(128) * 0.1 + 1.0).bfloat16()
    faithful = gated_rms_norm_reference(x, gate, w, 1e-6)
    fused = gated_rms_norm_reference(x, gate, w, 1e-6, mode="fused")
    dist = ulps(fused, faithful)
    assert int((dist > 0).sum()) > 0 and int(dist.max()) <= 2
    h = x.double()
    normed = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    g = gate.double()
    exact = normed * w.double() * (g / (1.0 + torch.exp(-g)))
    assert bool(faithfully_rounded(fused, exact).all())


def test_faithful_matches_float64_replay_of_hf_rounding_points():
    x, gate = inputs(64, 128)
    w = (torch.randn(128) * 0.1 + 1.0).bfloat16()
    h = x.double()
    normed = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).double()
    weighted = (normed * w.double()).to(torch.bfloat16).double()
    g = gate.double()
    replay = (weighted * (g / (1.0 + torch.exp(-g)))).to(torch.bfloat16)
    assert int(ulps(gated_rms_norm_reference(x, gate, w, 1e-6), replay).max()) <= 1


@pytest.mark.parametrize("mode", ["faithful", "fused"])
def test_kernel_order_differs_from_hf_order_only_by_ties(mode):
    x, gate = inputs(512, 128)
    w = (torch.randn(128) * 0.1 + 1.0).bfloat16()
    dist = ulps(gated_rms_norm_reference(x, gate, w, 1e-6, mode=mode, order="kernel"),
                gated_rms_norm_reference(x, gate, w, 1e-6, mode=mode))
    assert int(dist.max()) <= 1
    assert float((dist > 0).float().mean()) < 0.01


def test_out_buffer_receives_hf_result_in_place():
    """``out=`` on the CPU: the caller's NaN-filled buffer itself holds ``Qwen3_5RMSNormGated``'s output."""
    module = hf_gated(123, torch.bfloat16)
    x, gate = inputs(5, 123)
    out = poisoned(x.shape, x.dtype)
    pointer = out.data_ptr()
    got = gated_rms_norm(x, gate, module.weight, module.variance_epsilon, backend="reference", out=out)
    assert got is out and out.data_ptr() == pointer
    assert bool(torch.isfinite(out).all())
    with torch.no_grad():
        assert torch.equal(out, module(x, gate))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"gate": torch.zeros(2, 64, dtype=torch.bfloat16)}, ValueError, "same shape"),
        ({"weight": torch.ones(7, dtype=torch.bfloat16)}, ValueError, "weight must have"),
        ({"eps": float("nan")}, ValueError, "eps must be"),
        ({"mode": "none"}, ValueError, "mode must be one of"),
        ({"sumsq_out": torch.zeros(3)}, ValueError, "CUDA kernel only"),
    ],
    ids=["gate-shape", "weight-shape", "nan-eps", "mode", "sumsq-on-reference"],
)
def test_bad_inputs_raise_clear_errors(kwargs, error, message):
    args = {"x": torch.zeros(3, 128, dtype=torch.bfloat16), "gate": torch.zeros(3, 128, dtype=torch.bfloat16),
                "weight": torch.ones(128, dtype=torch.bfloat16), "eps": 1e-6}
    args.update(kwargs)
    with pytest.raises(error, match=message):
        gated_rms_norm(args.pop("x"), args.pop("gate"), args.pop("weight"), args.pop("eps"), backend="reference",
                       **args)


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("mode", ["faithful", "fused"])
@pytest.mark.parametrize(("batch", "tokens", "n"), [(1, 1, 128), (2, 1, 128), (4, 1, 128), (8, 1, 128),
                                                    (8, 128, 128), (5, 3, 123), (2, 7, 40)],
                         ids=lambda v: str(v))
def test_kernel_is_bitwise_its_kernel_order_reference(batch, tokens, n, mode):
    from ulptrace.trees import reduce_fp32

    rows = batch * tokens * 16  # 16 GDN value heads per token
    x, gate = inputs(rows, n, device="cuda")
    w = (torch.randn(n) * 0.1 + 1.0).bfloat16().cuda()
    out, sumsq = poisoned(x.shape, x.dtype, "cuda"), poisoned((rows,), torch.float32, "cuda")
    gated_rms_norm(x, gate, w, 1e-6, mode=mode, backend="cuda", out=out, sumsq_out=sumsq)
    assert not bool(torch.isnan(out).any())
    assert torch.equal(out, gated_rms_norm_reference(x, gate, w, 1e-6, mode=mode, order="kernel"))
    xf = x.float()
    assert torch.equal(sumsq, reduce_fp32(xf * xf, tree_spec(n, x.dtype)))
    threads, vector = blocked_launch(n, x.dtype)
    row0 = simulate_blocked((xf[0] * xf[0]).cpu().numpy(), threads, vector)
    assert np.float32(sumsq[0].item()).view(np.int32) == row0.view(np.int32)


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
def test_faithful_kernel_agrees_with_hf_module_on_gpu_to_the_tie_level():
    module = hf_gated(128, torch.bfloat16).cuda()
    x, gate = inputs(8 * 64 * 16, 128, device="cuda")
    with torch.no_grad():
        hf = module(x, gate)
    dist = ulps(gated_rms_norm(x, gate, module.weight, module.variance_epsilon, backend="cuda"), hf)
    assert int(dist.max()) <= 2
    assert float((dist > 0).float().mean()) < 0.01
