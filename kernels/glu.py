"""GLU epilogue ``silu(gate) * up``: the CUDA kernel and its plain-torch reference.

Shapes: ``gate`` and ``up`` are the two projections' outputs, same shape ``[..., intermediate]``
and dtype; the output has that shape and dtype. HF's MLP computes
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; this op is the part between the projections.

- ``faithful``: ``round(round(silu(gate)) * up)`` — HF's SiLU returns a tensor of the input dtype
  (rounded), and the product of two such tensors rounds again.
- ``fused``: ``round(silu(gate) * up)`` in FP32, one rounding (typically 1–2 ULP from HF).

No reduction. ``order="hf"`` evaluates SiLU with ``torch.nn.functional.silu`` (bitwise HF on the
same device); ``order="kernel"`` with the formula ``x / (1 + exp(-x))`` in FP32, which is what
both torch's CUDA SiLU and the kernel compute, so on a CUDA device it is bitwise the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ulptrace.kernels import _common as c


def silu_fp32(x: torch.Tensor, order: str = "hf") -> torch.Tensor:
    """SiLU of an FP32 tensor: ``F.silu`` (``"hf"``) or the explicit ``x / (1 + exp(-x))`` (``"kernel"``)."""
    if order == "hf":
        return F.silu(x)
    return x / (1.0 + torch.exp(-x))


def _check(gate: torch.Tensor, up: torch.Tensor, mode: str) -> None:
    c.check_tensor("gate", gate, dtype=c.FLOAT_DTYPES)
    c.check_tensor("up", up, dtype=c.FLOAT_DTYPES)
    c.check_same("gate", gate, "up", up)
    c.check_same("gate", gate, "up", up, what="dtype")
    c.check_same("gate", gate, "up", up, what="device")
    c.check_choice("mode", mode, c.MODES)


def glu_reference(gate: torch.Tensor, up: torch.Tensor, *, mode: str = "faithful", order: str = "hf") -> torch.Tensor:
    """Plain-torch ``silu(gate) * up`` (any device); see the module docstring for the rounding points.

    Raises:
        TypeError, ValueError: mismatched shapes/dtypes/devices, unknown mode or order.
    """
    _check(gate, up, mode)
    c.check_choice("order", order, c.ORDERS)
    if mode == "faithful":
        if order == "hf":
            return F.silu(gate) * up
        return silu_fp32(gate.float(), order).to(gate.dtype) * up
    return (silu_fp32(gate.float(), order) * up.float()).to(gate.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, *, mode: str = "faithful", backend: str = "auto",
        out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` on the CUDA kernel or the reference (``backend`` as in ``add_rms_norm``).

    Args:
        gate, up: ``[...]`` tensors of one float dtype and shape.
        mode: ``"faithful"`` or ``"fused"``.
        backend: ``"auto"``, ``"cuda"`` or ``"reference"``.
        out: optional preallocated contiguous output of ``gate``'s shape and dtype.

    Raises:
        TypeError, ValueError: bad inputs or ``out``; ``out`` overlapping an input.
        RuntimeError: ``backend="cuda"`` and the kernels cannot be built.
    """
    _check(gate, up, mode)
    chosen = c.resolve_backend(backend, gate, up)
    c.check_no_overlap({"out": out}, {"gate": gate, "up": up})
    if chosen == "reference":
        result = glu_reference(gate, up, mode=mode)
        if out is None:
            return result
        c.check_out("out", out, tuple(gate.shape), gate.dtype, gate.device)
        return out.copy_(result)
    numel = gate.numel()
    vector = c.vector_width(numel, gate.dtype)
    result = c.output(out, tuple(gate.shape), gate.dtype, gate.device)
    from ulptrace.kernels import _build

    _build.extension().glu(result, c.aligned(gate, vector), c.aligned(up, vector), vector, c.mode_code(mode))
    return result
