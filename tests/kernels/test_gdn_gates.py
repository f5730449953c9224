"""GatedDeltaNet gates: reference vs what HF's GDN forward computes inline (CPU), kernel vs reference (GPU)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import QWEN35_TINY, case_id, poisoned, ulps
from ulptrace.kernels import gdn_gates, gdn_gates_reference


def hf_gdn(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(**QWEN35_TINY)
    module = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():  # realistic: A in (0.01, 16) as HF's init, dt_bias around 1
        module.A_log.copy_(torch.empty(module.num_v_heads).uniform_(0.01, 16).log())
        module.dt_bias.copy_(torch.randn(module.num_v_heads) * 0.5 + 1.0)
    return module.to(dtype).eval()


def capture_hf_gates(module: torch.nn.Module, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run HF's GDN forward; return its a, b (projection outputs) and the g, beta it passed on."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling
    from ulptrace.taps import tap

    seen: dict[str, torch.Tensor] = {}
    handles = [module.in_proj_a.register_forward_hook(lambda m, i, o: seen.__setitem__("a", o)),
               module.in_proj_b.register_forward_hook(lambda m, i, o: seen.__setitem__("b", o))]
    observer = tap(modeling, "torch_chunk_gated_delta_rule").add_observer(
        lambda args, kwargs, result: seen.update(g=kwargs["g"], beta=kwargs["beta"]))
    try:
        with torch.no_grad():
            module(hidden)
    finally:
        observer.remove()
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: case_id(d))
def test_faithful_reference_is_bitwise_what_hf_passes_to_the_scan(dtype):
    module = hf_gdn(dtype)
    seen = capture_hf_gates(module, torch.randn(2, 5, QWEN35_TINY["hidden_size"]).to(dtype))
    g, beta = gdn_gates_reference(seen["a"], seen["b"], module.A_log, module.dt_bias)
    assert g.dtype == torch.float32 and seen["g"].dtype == torch.float32
    assert torch.equal(g, seen["g"]) and torch.equal(beta, seen["beta"])


def test_fused_rounds_g_once_to_the_activation_dtype():
    a, b = torch.randn(4, 9, 16).bfloat16() * 3, torch.randn(4, 9, 16).bfloat16() * 3
    A_log = torch.empty(16).uniform_(0.01, 16).log().bfloat16()
    dt_bias = (torch.randn(16) * 0.5 + 1.0).bfloat16()
    g, beta = gdn_gates_reference(a, b, A_log, dt_bias)
    g_fused, beta_fused = gdn_gates_reference(a, b, A_log, dt_bias, mode="fused")
    assert g_fused.dtype == torch.bfloat16 and torch.equal(beta_fused, beta)
    assert torch.equal(g_fused, g.to(torch.bfloat16))
    assert bool((g_fused.float() != g).any()), "the BF16 gate must lose bits somewhere"


def test_faithful_g_matches_float64_formula():
    a = torch.linspace(-30, 30, 16 * 50).reshape(50, 16).bfloat16()
    b = torch.randn(50, 16).bfloat16()
    A_log = torch.empty(16).uniform_(0.01, 16).log().bfloat16()
    dt_bias = (torch.randn(16) * 0.5 + 1.0).bfloat16()
    g, _ = gdn_gates_reference(a, b, A_log, dt_bias)
    x = a.double() + dt_bias.double()
    exact = -torch.exp(A_log.double()) * torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    assert int(ulps(g, exact.float()).max()) <= 4  # a few FP32 ULPs: exp, log1p, two products


@pytest.mark.parametrize("mode", ["faithful", "fused"])
def test_kernel_order_formulas_agree_with_torch_ops_to_the_tie_level(mode):
    a, b = torch.randn(64, 16).bfloat16() * 4, torch.randn(64, 16).bfloat16() * 4
    A_log = torch.empty(16).uniform_(0.01, 16).log()
    dt_bias = torch.randn(16) * 0.5 + 1.0
    g_k, beta_k = gdn_gates_reference(a, b, A_log, dt_bias, mode=mode, order="kernel")
    g_h, beta_h = gdn_gates_reference(a, b, A_log, dt_bias, mode=mode)
    assert int(ulps(g_k, g_h).max()) <= 2 and int(ulps(beta_k, beta_h).max()) <= 1


def test_out_buffers_receive_what_hf_passes_to_the_scan_in_place():
    """``g_out=``/``beta_out=`` on the CPU: the caller's NaN-filled buffers hold HF's g and beta."""
    module = hf_gdn()
    seen = capture_hf_gates(module, torch.randn(2, 5, QWEN35_TINY["hidden_size"]).bfloat16())
    a, b = seen["a"], seen["b"]
    g_out, beta_out = poisoned(a.shape, torch.float32), poisoned(b.shape, torch.bfloat16)
    pointers = (g_out.data_ptr(), beta_out.data_ptr())
    g, beta = gdn_gates(a, b, module.A_log, module.dt_bias, backend="reference", g_out=g_out,
                        beta_out=beta_out)
    assert g is g_out and beta is beta_out and (g_out.data_ptr(), beta_out.data_ptr()) == pointers
    assert bool(torch.isfinite(g_out).all()) and bool(torch.isfinite(beta_out).all())
    assert torch.equal(g_out, seen["g"]) and torch.equal(beta_out, seen["beta"])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"b": torch.zeros(3, 15)}, ValueError, "same shape"),
        ({"A_log": torch.zeros(15)}, ValueError, "A_log must have a's last dimension 16"),
        ({"dt_bias": torch.zeros(2, 16)}, ValueError, "dt_bias must have 1 dimensions"),
        ({"mode": "approx"}, ValueError, "mode must be one of"),
        ({"g_out": torch.zeros(3, 16, dtype=torch.bfloat16)}, ValueError, "g_out must be a torch.float32"),
    ],
    ids=["b-shape", "A_log-shape", "dt_bias-rank", "mode", "g_out-dtype"],
)
def test_bad_inputs_raise_clear_errors(kwargs, error, message):
    args = {"a": torch.zeros(3, 16), "b": torch.zeros(3, 16), "A_log": torch.zeros(16), "dt_bias": torch.zeros(16)}
    args.update(kwargs)
    with pytest.raises(error, match=message):
        gdn_gates(args.pop("a"), args.pop("b"), args.pop("A_log"), args.pop("dt_bias"), backend="reference",
                  **args)


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("mode", ["faithful", "fused"])
@pytest.mark.parametrize(("batch", "tokens", "heads"), [(1, 1, 16), (2, 1, 16), (4, 1, 16), (8, 1, 16),
                                                        (8, 128, 16), (5, 3, 7)],
                         ids=lambda v: str(v))
def test_kernel_is_bitwise_its_kernel_order_reference(batch, tokens, heads, mode):
    a = (torch.randn(batch, tokens, heads) * 4).bfloat16().cuda()
    b = (torch.randn(batch, tokens, heads) * 4).bfloat16().cuda()
    a[0, 0, 0] = 25.0  # softplus's linear branch
    A_log = torch.empty(heads).uniform_(0.01, 16).log().bfloat16().cuda()
    dt_bias = (torch.randn(heads) * 0.5 + 1.0).bfloat16().cuda()
    g_dtype = torch.float32 if mode == "faithful" else torch.bfloat16
    g_out, beta_out = poisoned(a.shape, g_dtype, "cuda"), poisoned(a.shape, torch.bfloat16, "cuda")
    gdn_gates(a, b, A_log, dt_bias, mode=mode, backend="cuda", g_out=g_out, beta_out=beta_out)
    assert not bool(torch.isnan(g_out).any() or torch.isnan(beta_out).any())
    g_ref, beta_ref = gdn_gates_reference(a, b, A_log, dt_bias, mode=mode, order="kernel")
    assert torch.equal(g_out, g_ref) and torch.equal(beta_out, beta_ref)
    g_hf, beta_hf = gdn_gates_reference(a, b, A_log, dt_bias, mode=mode)  # torch's CUDA ops, HF's formula
    assert int(ulps(g_out, g_hf).max()) <= 2 and int(ulps(beta_out, beta_hf).max()) <= 1
