"""GatedDeltaNet gates ``g`` and ``beta`` from the projections ``a`` and ``b``: kernel and reference.

Shapes: ``a`` and ``b`` are ``[..., heads]`` (the ``in_proj_a`` / ``in_proj_b`` outputs), ``A_log``
and ``dt_bias`` are ``[heads]`` parameters. HF (``Qwen3_5GatedDeltaNet.forward``) computes inline

    beta = b.sigmoid()                                              # input dtype (one rounding)
    g    = -A_log.float().exp() * softplus(a.float() + dt_bias)     # FP32, kept FP32 into the scan

- ``faithful``: exactly that; ``g`` is float32.
- ``fused``: the same FP32 arithmetic, with ``g`` emitted in the activations' dtype (one final
  rounding), the way a kernel writing all its outputs in the model dtype does — the BF16-gate
  defect. The GDN scan upcasts ``g`` again, so the rounding is the only difference.

No reduction. ``order="hf"`` uses ``torch.sigmoid``/``F.softplus``; ``order="kernel"`` the explicit
formulas the kernel and torch's CUDA kernels use (``1 / (1 + exp(-x))``,
``x > 20 ? x : log1p(exp(x))``), bitwise the kernel on a CUDA device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ulptrace.kernels import _common as c


def _check(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, mode: str) -> None:
    c.check_tensor("a", a, dtype=c.FLOAT_DTYPES, min_ndim=1)
    c.check_tensor("b", b, dtype=c.FLOAT_DTYPES, min_ndim=1)
    c.check_tensor("A_log", A_log, dtype=c.FLOAT_DTYPES, ndim=1)
    c.check_tensor("dt_bias", dt_bias, dtype=c.FLOAT_DTYPES, ndim=1)
    c.check_same("a", a, "b", b)
    c.check_same("a", a, "b", b, what="dtype")
    for name, t in (("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        c.check_same("a", a, name, t, what="device")
    heads = a.shape[-1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape[0] != heads:
            raise ValueError(f"{name} must have a's last dimension {heads} (heads), but got shape {tuple(t.shape)}")
    c.check_choice("mode", mode, c.MODES)


def gdn_gates_reference(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
                        mode: str = "faithful", order: str = "hf") -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch ``(g, beta)`` (any device); see the module docstring.

    Returns:
        ``g`` (float32 in faithful mode, ``a.dtype`` in fused mode) and ``beta`` (``b.dtype``), both
        of ``a``'s shape.

    Raises:
        TypeError, ValueError: bad shapes, dtypes, devices, mode or order.
    """
    _check(a, b, A_log, dt_bias, mode)
    c.check_choice("order", order, c.ORDERS)
    x = a.float() + dt_bias
    if order == "hf":
        beta = b.sigmoid()
        softplus = F.softplus(x)
    else:
        beta = (1.0 / (1.0 + torch.exp(-b.float()))).to(b.dtype)
        softplus = torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
    g = -A_log.float().exp() * softplus
    return (g if mode == "faithful" else g.to(a.dtype)), beta


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, *,
              mode: str = "faithful", backend: str = "auto", g_out: torch.Tensor | None = None,
              beta_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` on the CUDA kernel or the reference (``backend`` as in ``add_rms_norm``).

    Args:
        a, b: ``[..., heads]`` projections of one float dtype; A_log, dt_bias: ``[heads]`` (any float
            dtype; used as FP32, which is exact).
        mode: ``"faithful"`` or ``"fused"``.
        g_out, beta_out: optional preallocated contiguous outputs (``g_out`` float32 in faithful mode,
            ``a.dtype`` in fused mode; ``beta_out`` ``b.dtype``).

    Raises:
        TypeError, ValueError: bad inputs or outputs.
        RuntimeError: ``backend="cuda"`` and the kernels cannot be built.
    """
    _check(a, b, A_log, dt_bias, mode)
    chosen = c.resolve_backend(backend, a, b)
    shape = tuple(a.shape)
    g_dtype = torch.float32 if mode == "faithful" else a.dtype
    c.check_no_overlap({"g_out": g_out, "beta_out": beta_out}, {"a": a, "b": b})
    if chosen == "reference":
        g, beta = gdn_gates_reference(a, b, A_log, dt_bias, mode=mode)
        if g_out is not None:
            c.check_out("g_out", g_out, shape, g_dtype, a.device)
            g = g_out.copy_(g)
        if beta_out is not None:
            c.check_out("beta_out", beta_out, shape, b.dtype, b.device)
            beta = beta_out.copy_(beta)
        return g, beta
    g = c.output(g_out, shape, g_dtype, a.device, "g_out")
    beta = c.output(beta_out, shape, b.dtype, a.device, "beta_out")
    from ulptrace.kernels import _build

    _build.extension().gdn_gates(
        g, beta, a.contiguous(), b.contiguous(), A_log.float().contiguous(), dt_bias.float().contiguous(),
        c.mode_code(mode),
    )
    return g, beta
