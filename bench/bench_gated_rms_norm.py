"""Benchmark: gated RMSNorm kernel vs HF's ``Qwen3_5RMSNormGated`` (16 GDN heads x 128)."""

from __future__ import annotations

from typing import Any

import torch
from bench_common import markdown, row
from ulptrace.kernels import gated_rms_norm

HEADS, HEAD_DIM = 16, 128


def _case(tokens: int, norm: torch.nn.Module) -> list[dict[str, Any]]:
    x = torch.randn(tokens * HEADS, HEAD_DIM, device="cuda").bfloat16()
    z = torch.randn(tokens * HEADS, HEAD_DIM, device="cuda").bfloat16()
    nbytes = 3 * x.numel() * 2
    case = f"T{tokens}-H{HEADS}-D{HEAD_DIM}-bf16"
    rows = [row("gated_rms_norm", case, "HF Qwen3_5RMSNormGated", lambda: norm(x, z), nbytes)]
    for mode in ("faithful", "fused"):
        rows.append(row("gated_rms_norm", case, f"kernel {mode}",
                        lambda m=mode: gated_rms_norm(x, z, norm.weight, 1e-6, mode=m, backend="cuda"), nbytes))
    return rows


def bench() -> list[dict[str, Any]]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    with torch.no_grad():
        norm = Qwen3_5RMSNormGated(HEAD_DIM, eps=1e-6).cuda().bfloat16()
        norm.weight.normal_(1.0, 0.1)
        return [r for tokens in (1, 2, 4, 8, 8 * 128) for r in _case(tokens, norm)]


if __name__ == "__main__":
    print(markdown(bench()))
