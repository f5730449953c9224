"""Residual add + RMSNorm: reference vs HF's modules (CPU), fused vs faithful, kernel vs reference (GPU)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from kernel_cases import case_id, faithfully_rounded, poisoned, simulate_blocked, ulps
from ulptrace.kernels import add_rms_norm, rms_norm_reference
from ulptrace.kernels._common import blocked_launch
from ulptrace.kernels.rms_norm import VARIANTS, tree_spec

# (module path, class) of every HF norm the variant table names
HF_NORMS = {
    "LlamaRMSNorm": "transformers.models.llama.modeling_llama",
    "Qwen3RMSNorm": "transformers.models.qwen3.modeling_qwen3",
    "Qwen2RMSNorm": "transformers.models.qwen2.modeling_qwen2",
    "MistralRMSNorm": "transformers.models.mistral.modeling_mistral",
    "Qwen3_5RMSNorm": "transformers.models.qwen3_5.modeling_qwen3_5",
}
SHAPES = [(1, 1, 64), (2, 5, 123), (3, 4, 1024)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def hf_norm(cls_name: str, n: int, dtype: torch.dtype, eps: float = 1e-6) -> torch.nn.Module:
    cls = getattr(importlib.import_module(HF_NORMS[cls_name]), cls_name)
    module = cls(n, eps=eps)
    centre = 0.0 if VARIANTS[cls_name] == "zero_centred" else 1.0
    with torch.no_grad():
        module.weight.copy_(torch.randn(n) * 0.1 + centre)
    return module.to(dtype)


def inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    x = (torch.randn(shape) * 2.0).to(dtype).to(device)
    residual = (torch.randn(shape) * 4.0).to(dtype).to(device)
    return x, residual


def test_variant_table_covers_the_classes_tested():
    assert set(VARIANTS) >= set(HF_NORMS)
    assert VARIANTS["Qwen3_5RMSNorm"] == "zero_centred" and VARIANTS["LlamaRMSNorm"] == "llama"


@pytest.mark.parametrize("cls_name", sorted(HF_NORMS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: case_id(d))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: case_id(B=s[0], T=s[1], D=s[2]))
def test_faithful_reference_is_bitwise_hf(cls_name, dtype, shape):
    module = hf_norm(cls_name, shape[-1], dtype)
    x, residual = inputs(shape, dtype)
    variant = VARIANTS[cls_name]
    with torch.no_grad():
        plain = rms_norm_reference(x, module.weight, module_eps(module), variant=variant)
        normed, new_res = rms_norm_reference(x, module.weight, module_eps(module), residual, variant=variant)
        assert torch.equal(plain, module(x))
        summed = residual + x  # HF's decoder layer: a rounded add, then the norm
        assert torch.equal(new_res, summed)
        assert torch.equal(normed, module(summed))


def module_eps(module: torch.nn.Module) -> float:
    return float(getattr(module, "eps", getattr(module, "variance_epsilon", None)))


@pytest.mark.parametrize("variant", ["llama", "zero_centred"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
def test_fused_differs_from_faithful_by_at_most_two_ulps(variant, with_residual):
    shape = (8, 16, 256)
    x, residual = inputs(shape, torch.bfloat16)
    w = (torch.randn(256) * 0.1 + (0.0 if variant == "zero_centred" else 1.0)).bfloat16()
    res = residual if with_residual else None
    faithful = rms_norm_reference(x, w, 1e-6, res, variant=variant)
    fused = rms_norm_reference(x, w, 1e-6, res, variant=variant, mode="fused")
    if with_residual:
        assert torch.equal(faithful[1], fused[1])  # the stored residual is rounded in both modes
        faithful, fused = faithful[0], fused[0]
    dist = ulps(fused, faithful)
    if variant == "zero_centred" and not with_residual:
        assert int(dist.max()) == 0  # HF already rounds once: the modes coincide
    else:
        assert int((dist > 0).sum()) > 0, "fused mode must differ from faithful somewhere"
        assert int(dist.max()) <= 2


@pytest.mark.parametrize("variant", ["llama", "zero_centred"])
def test_fused_is_faithfully_rounded_exact_value(variant):
    x, residual = inputs((6, 123), torch.bfloat16)
    w = (torch.randn(123) * 0.1 + (0.0 if variant == "zero_centred" else 1.0)).bfloat16()
    fused, _ = rms_norm_reference(x, w, 1e-6, residual, variant=variant, mode="fused")
    h = residual.double() + x.double()  # FP32 add of two BF16s is exact here in float64
    normed = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    exact = normed * ((1.0 + w.double()) if variant == "zero_centred" else w.double())
    assert bool(faithfully_rounded(fused, exact).all())


@pytest.mark.parametrize("variant", ["llama", "zero_centred"])
def test_faithful_matches_float64_replay_of_hf_rounding_points(variant):
    x, residual = inputs((6, 123), torch.bfloat16)
    w = (torch.randn(123) * 0.1 + (0.0 if variant == "zero_centred" else 1.0)).bfloat16()
    got, _ = rms_norm_reference(x, w, 1e-6, residual, variant=variant)
    h = (residual.double() + x.double()).to(torch.bfloat16).double()  # the BF16 residual add
    normed = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    if variant == "zero_centred":
        replay = (normed * (1.0 + w.double())).to(torch.bfloat16)
    else:
        replay = (normed.to(torch.bfloat16).double() * w.double()).to(torch.bfloat16)
    assert int(ulps(got, replay).max()) <= 1


@pytest.mark.parametrize(
    ("n", "dtype", "expected"),
    [
        (1024, torch.bfloat16, (128, 8)),
        (256, torch.bfloat16, (32, 8)),
        (128, torch.bfloat16, (32, 8)),
        (123, torch.bfloat16, (128, 1)),
        (5, torch.bfloat16, (32, 1)),
        (1024, torch.float32, (256, 4)),
        (8192, torch.bfloat16, (1024, 8)),
        (16384, torch.bfloat16, (1024, 8)),
        (3000, torch.float32, (1024, 4)),
        (3001, torch.float32, (1024, 1)),
    ],
    ids=lambda v: str(v) if not isinstance(v, torch.dtype) else case_id(v),
)
def test_launch_shape_and_declared_tree(n, dtype, expected):
    assert blocked_launch(n, dtype) == expected
    assert tree_spec(n, dtype) == f"blocked:t{expected[0]}:v{expected[1]}"


@pytest.mark.parametrize(("n", "dtype"), [(1024, torch.bfloat16), (123, torch.bfloat16), (256, torch.float16),
                                          (5, torch.float32), (4096, torch.bfloat16)],
                         ids=lambda v: str(v) if not isinstance(v, torch.dtype) else case_id(v))
def test_kernel_order_sums_squares_as_the_kernel_loops_do(n, dtype):
    from ulptrace.trees import reduce_fp32

    x = torch.randn(3, n).to(dtype).float()
    threads, vector = blocked_launch(n, dtype)
    declared = reduce_fp32(x * x, tree_spec(n, dtype))
    simulated = np.array([simulate_blocked((x[i] * x[i]).numpy(), threads, vector) for i in range(3)])
    assert np.array_equal(declared.numpy().view(np.int32), simulated.view(np.int32))


@pytest.mark.parametrize("variant", ["llama", "zero_centred"])
@pytest.mark.parametrize("mode", ["faithful", "fused"])
def test_kernel_order_differs_from_hf_order_only_by_ties(variant, mode):
    x, residual = inputs((16, 32, 123), torch.bfloat16)
    w = (torch.randn(123) * 0.1 + (0.0 if variant == "zero_centred" else 1.0)).bfloat16()
    hf = rms_norm_reference(x, w, 1e-6, residual, variant=variant, mode=mode)[0]
    kernel = rms_norm_reference(x, w, 1e-6, residual, variant=variant, mode=mode, order="kernel")[0]
    dist = ulps(kernel, hf)
    assert int(dist.max()) <= 1
    assert float((dist > 0).float().mean()) < 0.01


def test_out_buffers_receive_hf_results_in_place():
    """``out=``/``residual_out=`` on the CPU: the caller's NaN-filled buffers themselves hold HF's values."""
    module = hf_norm("Qwen3_5RMSNorm", 123, torch.bfloat16)
    x, residual = inputs((2, 3, 123), torch.bfloat16)
    out, res_out = poisoned(x.shape, x.dtype), poisoned(x.shape, x.dtype)
    pointers = (out.data_ptr(), res_out.data_ptr())
    normed, new_res = add_rms_norm(x, module.weight, module_eps(module), residual, variant="zero_centred",
                                   backend="reference", out=out, residual_out=res_out)
    assert normed is out and new_res is res_out and (out.data_ptr(), res_out.data_ptr()) == pointers
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(res_out).all())
    with torch.no_grad():
        summed = residual + x  # HF's decoder layer: the BF16 residual add, then the norm
        assert torch.equal(res_out, summed) and torch.equal(out, module(summed))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"weight": torch.ones(5)}, ValueError, "last dimension 123"),
        ({"residual": torch.zeros(2, 123)}, TypeError, "same dtype"),
        ({"residual": torch.zeros(3, 123, dtype=torch.bfloat16)}, ValueError, "same shape"),
        ({"variant": "gemma"}, ValueError, "variant must be one of"),
        ({"mode": "fast"}, ValueError, "mode must be one of"),
        ({"eps": -1.0}, ValueError, "eps must be a non-negative"),
        ({"x": torch.zeros(2, 123, dtype=torch.int32)}, TypeError, "x must have dtype"),
        ({"backend": "cuda"}, ValueError, "needs CUDA tensors"),
        ({"backend": "triton"}, ValueError, "backend must be one of"),
    ],
    ids=["weight-shape", "residual-dtype", "residual-shape", "variant", "mode", "eps", "int-x", "cuda-on-cpu",
         "backend"],
)
def test_bad_inputs_raise_clear_errors(kwargs, error, message):
    args = {"x": torch.zeros(2, 123, dtype=torch.bfloat16), "weight": torch.ones(123, dtype=torch.bfloat16),
                "eps": 1e-6, "residual": None}
    args.update(kwargs)
    with pytest.raises(error, match=message):
        add_rms_norm(args.pop("x"), args.pop("weight"), args.pop("eps"), args.pop("residual"), **args)


def test_output_overlapping_input_is_rejected():
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError, match="must not overlap"):
        add_rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6, backend="reference", out=x)


# ---------------------------------------------------------------------------------------------- GPU
GPU_SHAPES = [(1, 1, 1024), (2, 7, 1024), (4, 1, 1024), (8, 33, 1024), (8, 1, 1024), (5, 1, 123), (64, 8, 123),
              (2, 3, 256), (16, 8, 256), (3, 5, 4096), (2, 1, 5)]


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("variant", ["llama", "zero_centred"])
@pytest.mark.parametrize("mode", ["faithful", "fused"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: case_id(torch.bfloat16, B=s[0], T=s[1], D=s[2]))
def test_kernel_is_bitwise_its_kernel_order_reference(shape, with_residual, mode, variant):
    from ulptrace.trees import reduce_fp32

    x, residual = inputs(shape, torch.bfloat16, "cuda")
    w = (torch.randn(shape[-1]) * 0.1 + (0.0 if variant == "zero_centred" else 1.0)).bfloat16().cuda()
    res = residual if with_residual else None
    rows = x.numel() // shape[-1]
    out, res_out = poisoned(shape, x.dtype, "cuda"), poisoned(shape, x.dtype, "cuda")
    sumsq = poisoned((rows,), torch.float32, "cuda")
    got = add_rms_norm(x, w, 1e-6, res, variant=variant, mode=mode, backend="cuda", out=out,
                       residual_out=res_out if with_residual else None, sumsq_out=sumsq)
    want = rms_norm_reference(x, w, 1e-6, res, variant=variant, mode=mode, order="kernel")
    if res is not None:
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    assert not bool(torch.isnan(out).any())
    assert torch.equal(got, want)
    # the raw reduction, checked against the tree emulation and the loop simulation
    if res is None:
        h = x.float()
    else:
        h = (res + x).float() if mode == "faithful" else res.float() + x.float()
    h = h.reshape(rows, shape[-1])
    emulated = reduce_fp32(h * h, tree_spec(shape[-1], x.dtype))
    assert torch.equal(sumsq, emulated)
    threads, vector = blocked_launch(shape[-1], x.dtype)
    row0 = simulate_blocked((h[0] * h[0]).cpu().numpy(), threads, vector)
    assert np.float32(sumsq[0].item()).view(np.int32) == row0.view(np.int32)


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("cls_name", ["LlamaRMSNorm", "Qwen3_5RMSNorm"])
@pytest.mark.parametrize("shape", [(1, 1, 1024), (8, 1, 1024), (4, 64, 1024), (5, 1, 123), (16, 8, 256)],
                         ids=lambda s: case_id(torch.bfloat16, B=s[0], T=s[1], D=s[2]))
def test_faithful_kernel_agrees_with_hf_module_on_gpu_to_the_tie_level(cls_name, shape):
    module = hf_norm(cls_name, shape[-1], torch.bfloat16).cuda()
    x, residual = inputs(shape, torch.bfloat16, "cuda")
    with torch.no_grad():
        hf = module(residual + x)
    got, _ = add_rms_norm(x, module.weight, module_eps(module), residual, variant=VARIANTS[cls_name],
                          backend="cuda")
    dist = ulps(got, hf)
    assert int(dist.max()) <= (1 if VARIANTS[cls_name] == "zero_centred" else 2)
    assert float((dist > 0).float().mean()) < 0.01
