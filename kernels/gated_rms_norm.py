"""Gated RMSNorm of the GatedDeltaNet output (``Qwen3_5RMSNormGated``): kernel and reference.

Shapes: ``x`` (the GDN core output) and ``gate`` (``z``) are ``[..., n]`` with ``n = head_v_dim``,
``weight`` is ``[n]``; the output has ``x``'s shape and dtype.

- ``faithful`` (HF): normalise in FP32, **round to the input dtype**, multiply by the weight (a
  product of two stored tensors: rounds), multiply by ``silu(gate)`` computed in FP32 (the product
  is FP32), round once more: ``round(round(w * round(x * rstd)) * silu(gate))``.
- ``fused``: ``round(x * rstd * w * silu(gate))`` in FP32 with one rounding.

The sum of squares uses the kernel's tree ``blocked:t{threads}:v{vector}`` (:func:`tree_spec`)
with ``order="kernel"`` and torch's ``mean`` with ``order="hf"``, as in :mod:`.rms_norm`.
"""

from __future__ import annotations

import torch
from ulptrace.kernels import _common as c
from ulptrace.kernels.glu import silu_fp32
from ulptrace.kernels.rms_norm import mean_sq_fp32, rstd_fp32, tree_spec  # noqa: F401 (the norm's tree, re-exported)


def _check(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, mode: str) -> None:
    c.check_tensor("x", x, dtype=c.FLOAT_DTYPES, min_ndim=1)
    c.check_tensor("gate", gate, dtype=c.FLOAT_DTYPES)
    c.check_tensor("weight", weight, dtype=c.FLOAT_DTYPES, ndim=1)
    c.check_same("x", x, "gate", gate)
    c.check_same("x", x, "gate", gate, what="dtype")
    c.check_same("x", x, "gate", gate, what="device")
    c.check_same("x", x, "weight", weight, what="device")
    c.check_choice("mode", mode, c.MODES)
    if x.shape[-1] == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight must have x's non-empty last dimension {x.shape[-1]}, but got shape {tuple(weight.shape)}"
        )
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, but got {eps!r}")


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                             mode: str = "faithful", order: str = "hf") -> torch.Tensor:
    """Plain-torch gated RMSNorm (any device); ``order`` as in ``rms_norm_reference``.

    Raises:
        TypeError, ValueError: bad shapes, dtypes, devices, eps, mode or order.
    """
    _check(x, gate, weight, eps, mode)
    c.check_choice("order", order, c.ORDERS)
    dtype = x.dtype
    h = x.to(torch.float32)
    normed = h * rstd_fp32(mean_sq_fp32(h, order, dtype), eps, order)
    s = silu_fp32(gate.to(torch.float32), order)
    if mode == "faithful":
        return ((weight * normed.to(dtype)) * s).to(dtype)
    return (normed * weight.float() * s).to(dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   mode: str = "faithful", backend: str = "auto", out: torch.Tensor | None = None,
                   sumsq_out: torch.Tensor | None = None) -> torch.Tensor:
    """Gated RMSNorm on the CUDA kernel or the reference (``backend`` as in ``add_rms_norm``).

    Args:
        x, gate: ``[..., n]`` tensors of one float dtype; weight: ``[n]`` (``x``'s dtype for CUDA).
        eps: the norm's epsilon; mode: ``"faithful"`` or ``"fused"``.
        out: optional preallocated contiguous output; sumsq_out: optional float32 ``[rows]`` buffer
            for each row's raw FP32 sum of squares (CUDA backend only).

    Raises:
        TypeError, ValueError: bad inputs or outputs.
        RuntimeError: ``backend="cuda"`` and the kernels cannot be built.
    """
    _check(x, gate, weight, eps, mode)
    chosen = c.resolve_backend(backend, x, gate, weight)
    c.check_no_overlap({"out": out}, {"x": x, "gate": gate, "weight": weight})
    shape = tuple(x.shape)
    if chosen == "reference":
        if sumsq_out is not None:
            raise ValueError("sumsq_out is written by the CUDA kernel only; use backend='cuda'")
        result = gated_rms_norm_reference(x, gate, weight, eps, mode=mode)
        if out is None:
            return result
        c.check_out("out", out, tuple(result.shape), result.dtype, result.device)
        return out.copy_(result)
    if weight.dtype != x.dtype:
        raise TypeError(f"the CUDA kernel needs weight in x's dtype {x.dtype}, but got {weight.dtype}")
    n = shape[-1]
    threads, vector = c.blocked_launch(n, x.dtype)
    result = c.output(out, shape, x.dtype, x.device)
    if sumsq_out is not None:
        c.check_out("sumsq_out", sumsq_out, (x.numel() // n,), torch.float32, x.device)
    from ulptrace.kernels import _build

    _build.extension().gated_rms_norm(
        result, c.aligned(x, vector), c.aligned(gate, vector), c.aligned(weight, vector), float(eps),
        c.mode_code(mode), threads, vector, sumsq_out,
    )
    return result
