"""Residual add + RMSNorm: the CUDA kernel and its plain-torch reference, both modes, both variants.

Shapes: ``x`` and ``residual`` are ``[..., n]``, ``weight`` is ``[n]``; the outputs have ``x``'s
shape and dtype. With ``residual`` the op first forms the updated residual ``residual + x`` (always
stored rounded to ``x.dtype``, as HF's decoder layer does) and normalises that.

Variants (HF's modules; the data table :data:`VARIANTS` maps classes to them):

- ``llama`` (``LlamaRMSNorm``, ``Qwen3RMSNorm``, ...): ``w * round(x * rsqrt(mean(x^2) + eps))`` —
  the normalised value is rounded to the input dtype *before* the weight multiplies it (and that
  product rounds again).
- ``zero_centred`` (``Qwen3_5RMSNorm``): ``round(x * rsqrt(mean(x^2) + eps) * (1 + w))`` with
  ``1 + w`` formed in FP32 from the weight — one rounding at the end.

Modes:

- ``faithful``: HF's rounding points. With a residual, the sum is rounded to the input dtype first
  (HF's BF16 add), and that rounded value is normalised.
- ``fused``: FP32 inside, one final rounding: the residual sum is normalised in FP32 (the classic
  fused add+norm defect), and the llama variant skips its intermediate rounding. For the
  zero-centred variant *without* residual the two modes coincide (HF already rounds once).

Evaluation order (``order=`` of the reference): ``"hf"`` uses the torch ops HF calls
(``x.pow(2).mean(-1)``, ``torch.rsqrt``), so it is bitwise equal to HF's module on the same device;
``"kernel"`` spells out the CUDA kernel's arithmetic — the sum of squares in the declared tree
(:func:`tree_spec`), ``mean = sum / n`` and ``rstd = 1 / sqrt(mean + eps)`` with IEEE division and
square root — and reproduces the kernel bit for bit on any device.
"""

from __future__ import annotations

import torch
from ulptrace.families import NORM_SCALES
from ulptrace.kernels import _common as c

VARIANTS_NAMES = ("llama", "zero_centred")
# HF norm class name -> variant, from the core's one table of HF classes (ulptrace.families.NORM_SCALES):
# scaled by weight -> "llama", by 1 + weight -> "zero_centred"
VARIANTS: dict[str, str] = {name: "zero_centred" if scale == "one_plus_weight" else "llama"
                            for name, scale in NORM_SCALES.items()}
_VARIANT_CODE = {"llama": 0, "zero_centred": 1}


def tree_spec(n: int, dtype: torch.dtype) -> str:
    """The FP32 reduction tree of the kernel's sum of squares over rows of ``n`` elements."""
    return c.blocked_tree(n, dtype)


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
           variant: str, mode: str) -> None:
    c.check_tensor("x", x, dtype=c.FLOAT_DTYPES, min_ndim=1)
    c.check_tensor("weight", weight, dtype=c.FLOAT_DTYPES, ndim=1)
    c.check_choice("variant", variant, VARIANTS_NAMES)
    c.check_choice("mode", mode, c.MODES)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have x's last dimension {x.shape[-1]}, but got shape {tuple(weight.shape)}")
    if x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, but got shape {tuple(x.shape)}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, but got {eps!r}")
    c.check_same("x", x, "weight", weight, what="device")
    if residual is not None:
        c.check_tensor("residual", residual)
        c.check_same("x", x, "residual", residual)
        c.check_same("x", x, "residual", residual, what="dtype")
        c.check_same("x", x, "residual", residual, what="device")


def mean_sq_fp32(h: torch.Tensor, order: str, dtype: torch.dtype) -> torch.Tensor:
    """``mean(h^2)`` over the last dim (keepdim, FP32) in torch's order or the kernel's tree.

    ``dtype`` is the storage dtype ``h`` was read from: the kernel's tree depends on it.
    """
    if order == "hf":
        return h.pow(2).mean(-1, keepdim=True)
    total = c.reduce_fp32(h * h, tree_spec(h.shape[-1], dtype))
    # a tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal instead
    return (total / torch.full_like(total, h.shape[-1])).unsqueeze(-1)


def rstd_fp32(var: torch.Tensor, eps: float, order: str) -> torch.Tensor:
    """``rsqrt(var + eps)``: torch's ``rsqrt`` (``order="hf"``) or the kernel's IEEE ``1 / sqrt``."""
    if order == "hf":
        return torch.rsqrt(var + eps)
    return 1.0 / torch.sqrt(var + eps)


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    variant: str = "llama",
    mode: str = "faithful",
    order: str = "hf",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch residual add + RMSNorm (any device). See the module docstring for the formulas.

    Args:
        x: ``[..., n]`` float tensor (the attention output when ``residual`` is given).
        weight: ``[n]`` norm weight (HF's parameter, used as stored).
        eps: the norm's epsilon (added in FP32).
        residual: optional ``[..., n]`` tensor of ``x``'s dtype; when given the result is a tuple.
        variant: ``"llama"`` or ``"zero_centred"``.
        mode: ``"faithful"`` or ``"fused"``.
        order: ``"hf"`` (torch's ops, bitwise HF) or ``"kernel"`` (the CUDA kernel's tree and IEEE
            ``1/sqrt``, bitwise the kernel).

    Returns:
        ``normed`` (``x``'s shape; the llama variant's dtype is ``promote(weight, x)`` like HF's),
        or ``(normed, new_residual)`` when ``residual`` is given.

    Raises:
        TypeError, ValueError: bad dtypes, shapes, devices, variant, mode or order.
    """
    _check(x, weight, eps, residual, variant, mode)
    c.check_choice("order", order, c.ORDERS)
    dtype = x.dtype
    new_residual = None
    if residual is not None:
        new_residual = residual + x
        h = new_residual.to(torch.float32) if mode == "faithful" else residual.float() + x.float()
    else:
        h = x.to(torch.float32)
    normed = h * rstd_fp32(mean_sq_fp32(h, order, dtype), eps, order)
    if variant == "zero_centred":
        out = (normed * (1.0 + weight.float())).to(dtype)
    elif mode == "faithful":
        out = weight * normed.to(dtype)
    else:
        out = (normed * weight.float()).to(torch.promote_types(weight.dtype, dtype))
    return out if residual is None else (out, new_residual)


def add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    variant: str = "llama",
    mode: str = "faithful",
    backend: str = "auto",
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    sumsq_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm on the CUDA kernel or the reference (``backend``).

    Args are those of :func:`rms_norm_reference` plus:
        backend: ``"auto"`` (CUDA kernel for CUDA tensors when it builds, else the reference),
            ``"cuda"`` or ``"reference"``.
        out, residual_out: optional preallocated contiguous outputs (``x``'s shape and dtype).
        sumsq_out: optional float32 ``[rows]`` buffer receiving each row's raw FP32 sum of squares
            as the kernel reduced it (CUDA backend only; for checking the declared tree).

    The CUDA kernel needs ``weight`` in ``x``'s dtype; the reference takes any float weight.

    Raises:
        TypeError, ValueError: bad inputs or outputs (see :func:`rms_norm_reference`); outputs
            overlapping inputs.
        RuntimeError: ``backend="cuda"`` and the kernels cannot be built.
    """
    _check(x, weight, eps, residual, variant, mode)
    chosen = c.resolve_backend(backend, x, weight)
    shape = tuple(x.shape)
    c.check_no_overlap({"out": out, "residual_out": residual_out}, {"x": x, "residual": residual, "weight": weight})
    if chosen == "reference":
        if sumsq_out is not None:
            raise ValueError("sumsq_out is written by the CUDA kernel only; use backend='cuda'")
        result = rms_norm_reference(x, weight, eps, residual, variant=variant, mode=mode)
        normed = result if residual is None else result[0]
        if out is not None:
            c.check_out("out", out, tuple(normed.shape), normed.dtype, normed.device)
            out.copy_(normed)
            normed = out
        if residual is None:
            return normed
        new_res = result[1]
        if residual_out is not None:
            c.check_out("residual_out", residual_out, shape, x.dtype, x.device)
            residual_out.copy_(new_res)
            new_res = residual_out
        return normed, new_res
    if weight.dtype != x.dtype:
        raise TypeError(f"the CUDA kernel needs weight in x's dtype {x.dtype}, but got {weight.dtype}")
    n = shape[-1]
    threads, vector = c.blocked_launch(n, x.dtype)
    xs = c.aligned(x, vector)
    res = c.aligned(residual, vector) if residual is not None else None
    normed = c.output(out, shape, x.dtype, x.device)
    new_res = c.output(residual_out, shape, x.dtype, x.device, "residual_out") if residual is not None else None
    if sumsq_out is not None:
        c.check_out("sumsq_out", sumsq_out, (xs.numel() // n,), torch.float32, x.device)
    from ulptrace.kernels import _build

    _build.extension().rms_norm(
        normed, new_res, xs, res, c.aligned(weight, vector), float(eps), _VARIANT_CODE[variant],
        c.mode_code(mode), threads, vector, sumsq_out,
    )
    return normed if residual is None else (normed, new_res)  # type: ignore[return-value]
