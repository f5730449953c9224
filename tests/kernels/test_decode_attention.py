"""Decode attention: reference vs HF's eager_attention_forward and SDPA (CPU), kernel vs reference (GPU)."""

from __future__ import annotations

import types

import pytest
import torch
from kernel_cases import case_id, poisoned, ulps
from ulptrace.kernels import decode_attention, decode_attention_reference
from ulptrace.kernels.decode_attention import tree_specs

CASES = [(1, 3, 1, 5, 40), (2, 6, 2, 37, 40), (3, 8, 2, 64, 256), (2, 5, 5, 9, 123)]


def case(c: tuple[int, ...]) -> str:
    b, hq, hkv, length, d = c
    return case_id(torch.bfloat16, B=b, Hq=hq, Hkv=hkv, L=length, D=d)


def qkv(b: int, hq: int, hkv: int, length: int, d: int, dtype=torch.bfloat16, device="cpu"):
    q = torch.randn(b, hq, d).to(dtype).to(device)
    k = torch.randn(b, hkv, length, d).to(dtype).to(device)
    v = torch.randn(b, hkv, length, d).to(dtype).to(device)
    return q, k, v


def padded(b: int, length: int, device="cpu") -> torch.Tensor:
    """Left padding on row 1, unused tail slots on the last row (a static cache), all valid elsewhere."""
    valid = torch.ones(b, length, dtype=torch.bool, device=device)
    if b > 1:
        valid[1, : length // 3] = False
        valid[-1, length - length // 4:] = False
    return valid


def magnitude(q, k, v, valid, scale) -> torch.Tensor:
    """``sum_j p_j |v_j|`` in float64 per output element: the scale of attention's rounding errors.

    Outputs are sums of mixed-sign terms, so near-cancelling elements have tiny values and huge ULP
    distances for honest differences; tolerances are relative to this magnitude instead.
    """
    groups = q.shape[1] // k.shape[1]
    kd, vd = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    s = torch.einsum("bhd,bhld->bhl", q.double(), kd) * scale
    if valid is not None:
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhl,bhld->bhd", torch.softmax(s, -1), vd.abs())


def close(a: torch.Tensor, b: torch.Tensor, mag: torch.Tensor, rel: float) -> bool:
    """``|a - b| <= rel * magnitude + one BF16 step of |b|`` everywhere."""
    diff = (a.double() - b.double()).abs().cpu()
    return bool((diff <= rel * mag.cpu() + b.double().abs().cpu() * 2.0**-7).all())


def hf_eager(q, k, v, valid, scale):
    from transformers.models.qwen3_5.modeling_qwen3_5 import eager_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    mask = None
    if valid is not None:  # HF's eager mask: 0 where attended, the dtype's minimum elsewhere
        mask = torch.where(valid, torch.tensor(0.0, dtype=q.dtype), torch.finfo(q.dtype).min)[:, None, None, :]
    out, _ = eager_attention_forward(module, q.unsqueeze(2), k, v, mask, scaling=scale)
    return out[:, 0]


@pytest.mark.parametrize("masked", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("shape", CASES, ids=case)
def test_faithful_eager_reference_is_bitwise_hf(shape, masked):
    q, k, v = qkv(*shape)
    valid = padded(shape[0], shape[3]) if masked else None
    scale = shape[-1] ** -0.5
    got = decode_attention_reference(q, k, v, scale=scale, valid=valid)
    assert torch.equal(got, hf_eager(q, k, v, valid, scale))


@pytest.mark.parametrize("shape", CASES, ids=case)
def test_sdpa_semantics_is_the_fp32_math_definition(shape):
    q, k, v = qkv(*shape)
    valid = padded(shape[0], shape[3])
    scale = shape[-1] ** -0.5
    got = decode_attention_reference(q, k, v, scale=scale, valid=valid, semantics="sdpa")
    groups = shape[1] // shape[2]
    kd = k.double().repeat_interleave(groups, 1)
    vd = v.double().repeat_interleave(groups, 1)
    s = torch.einsum("bhd,bhld->bhl", q.double(), kd) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    exact = torch.einsum("bhl,bhld->bhd", torch.softmax(s, -1), vd)
    mag = magnitude(q, k, v, valid, scale)
    # one final rounding after FP32 arithmetic: half a BF16 step of the value plus FP32-level error
    assert bool(((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + mag * 2.0**-16).all())
    sdpa = torch.nn.functional.scaled_dot_product_attention(  # HF's sdpa path: a backend's own order
        q.unsqueeze(2), k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
        attn_mask=valid[:, None, None, :], scale=scale)[:, :, 0]
    assert close(got, sdpa, mag, 2.0**-7)


@pytest.mark.parametrize("shape", CASES[1:], ids=case)
def test_fused_differs_from_faithful_eager_and_rounds_once(shape):
    q, k, v = qkv(*shape)
    scale = shape[-1] ** -0.5
    faithful = decode_attention_reference(q, k, v, scale=scale)
    fused = decode_attention_reference(q, k, v, scale=scale, mode="fused")
    mag = magnitude(q, k, v, None, scale)
    assert int((ulps(fused, faithful) > 0).sum()) > 0
    # eager rounds the scores to BF16 (a relative error of the probabilities of about |s| * 2^-8)
    # and the probabilities themselves
    assert close(fused, faithful, mag, 0.05)
    sdpa = decode_attention_reference(q, k, v, scale=scale, semantics="sdpa")
    assert close(fused, sdpa, mag, 2.0**-16)  # same rounding points: normalised before vs after P @ V


@pytest.mark.parametrize("semantics", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["faithful", "fused"])
def test_kernel_order_differs_from_hf_order_only_by_ties(semantics, mode):
    shape = (4, 8, 2, 50, 256)
    q, k, v = qkv(*shape)
    valid = padded(shape[0], shape[3])
    kw = {"scale": shape[-1] ** -0.5, "valid": valid, "semantics": semantics, "mode": mode}
    kernel = decode_attention_reference(q, k, v, order="kernel", **kw)
    hf = decode_attention_reference(q, k, v, **kw)
    eager = (semantics, mode) == ("eager", "faithful")
    assert close(kernel, hf, magnitude(q, k, v, valid, kw["scale"]), 0.03 if eager else 2.0**-16)
    assert float((ulps(kernel, hf) > 0).float().mean()) < 0.05


def test_lengths_and_valid_mask_combine():
    q, k, v = qkv(3, 4, 2, 20, 40)
    lengths = torch.tensor([20, 11, 3])
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[2, 0] = False
    by_length = decode_attention_reference(q, k, v, scale=0.2, lengths=lengths, valid=valid)
    explicit = valid & (torch.arange(20)[None] < lengths[:, None])
    assert torch.equal(by_length, decode_attention_reference(q, k, v, scale=0.2, valid=explicit))
    # the cache beyond a row's length is never read: garbage there changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 11:], v2[1, :, 11:] = float("nan"), float("inf")
    assert torch.equal(by_length[1], decode_attention_reference(q, k2, v2, scale=0.2, lengths=lengths,
                                                                order="kernel", valid=valid)[1])


def test_row_without_valid_positions_is_zero():
    q, k, v = qkv(2, 2, 1, 6, 40)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0] = False
    for order in ("hf", "kernel"):
        out = decode_attention_reference(q, k, v, scale=0.1, valid=valid, order=order)
        assert bool((out[0] == 0).all()) and bool((out[1] != 0).any())


def test_declared_trees():
    assert tree_specs(256, torch.bfloat16) == {"qk": "blocked:t32:v8", "softmax_sum": "blocked:t256:v1",
                                              "pv": "sequential"}
    assert tree_specs(123, torch.bfloat16)["qk"] == "blocked:t32:v1"
    assert tree_specs(64, torch.float32)["qk"] == "blocked:t32:v4"


def test_out_buffer_receives_hf_result_in_place():
    """``out=`` on the CPU: the caller's NaN-filled buffer itself holds HF's eager attention output."""
    q, k, v = qkv(2, 6, 2, 9, 40)
    out = poisoned(q.shape, q.dtype)
    pointer = out.data_ptr()
    assert decode_attention(q, k, v, scale=0.15, backend="reference", out=out) is out
    assert out.data_ptr() == pointer and bool(torch.isfinite(out).all())
    assert torch.equal(out, hf_eager(q, k, v, None, 0.15))


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"query": torch.zeros(2, 5, 40, dtype=torch.bfloat16)}, ValueError, "multiple of key/value heads"),
        ({"key": torch.zeros(2, 2, 9, 41, dtype=torch.bfloat16)}, ValueError, "same shape"),
        ({"valid": torch.ones(2, 8, dtype=torch.bool)}, ValueError, "valid must have shape"),
        ({"valid": torch.ones(2, 9)}, TypeError, "valid must have dtype"),
        ({"lengths": torch.ones(3, dtype=torch.int32)}, ValueError, "lengths must have shape"),
        ({"semantics": "flash"}, ValueError, "semantics must be one of"),
        ({"scale": "0.1"}, TypeError, "scale must be a float"),
    ],
    ids=["heads", "key-shape", "valid-shape", "valid-dtype", "lengths-shape", "semantics", "scale"],
)
def test_bad_inputs_raise_clear_errors(change, error, message):
    q, k, v = qkv(2, 6, 2, 9, 40)
    args = {"query": q, "key": k, "value": v, "scale": 0.1}
    args.update(change)
    with pytest.raises(error, match=message):
        decode_attention(args.pop("query"), args.pop("key"), args.pop("value"), backend="reference", **args)


GPU_CASES = [(b, 8, 2, length, 256) for b in (1, 2, 4, 8) for length in (1, 37, 512)] + [
    (3, 6, 2, 129, 123), (2, 5, 5, 9, 40), (8, 8, 2, 4000, 256)]


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("semantics,mode", [("eager", "faithful"), ("sdpa", "faithful"), ("eager", "fused")],
                         ids=["eager-faithful", "sdpa-faithful", "fused"])
@pytest.mark.parametrize("shape", GPU_CASES, ids=case)
def test_kernel_is_bitwise_its_kernel_order_reference(shape, semantics, mode):
    q, k, v = qkv(*shape, device="cuda")
    valid = padded(shape[0], shape[3], "cuda") if shape[3] > 3 else None
    out = poisoned(q.shape, q.dtype, "cuda")
    kw = {"scale": shape[-1] ** -0.5, "valid": valid, "semantics": semantics, "mode": mode}
    decode_attention(q, k, v, backend="cuda", out=out, **kw)
    assert not bool(torch.isnan(out).any())
    assert torch.equal(out, decode_attention_reference(q, k, v, order="kernel", **kw))


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("mode", ["faithful", "fused"])
def test_kernel_never_reads_masked_or_out_of_length_positions(mode):
    q, k, v = qkv(4, 8, 2, 77, 256, device="cuda")
    valid = padded(4, 77, "cuda")
    lengths = torch.tensor([77, 77, 50, 77], dtype=torch.int32, device="cuda")
    kw = {"scale": 0.0625, "valid": valid, "lengths": lengths, "mode": mode, "backend": "cuda"}
    clean = decode_attention(q, k, v, **kw)
    unread = ~(valid & (torch.arange(77, device="cuda")[None] < lengths[:, None]))  # [B, L]
    k2, v2 = k.clone(), v.clone()
    k2.masked_fill_(unread[:, None, :, None], float("nan"))
    v2.masked_fill_(unread[:, None, :, None], float("inf"))
    assert torch.equal(decode_attention(q, k2, v2, **kw), clean)


@pytest.mark.gpu
@pytest.mark.usefixtures("cuda_kernels")
@pytest.mark.parametrize("shape", [(b, 8, 2, 300, 256) for b in (1, 8)], ids=case)
def test_faithful_eager_kernel_agrees_with_hf_on_gpu_to_the_tie_level(shape):
    q, k, v = qkv(*shape, device="cuda")
    valid = padded(shape[0], shape[3], "cuda")
    scale = shape[-1] ** -0.5
    hf = hf_eager(q.cpu(), k.cpu(), v.cpu(), valid.cpu(), scale)  # HF's eager ops, CPU order
    got = decode_attention(q, k, v, scale=scale, valid=valid, backend="cuda")
    assert close(got, hf.cuda(), magnitude(q, k, v, valid, scale), 0.03)
    assert float((ulps(got, hf) > 0).float().mean()) < 0.05
