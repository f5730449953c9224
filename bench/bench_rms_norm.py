"""Benchmark: residual add + RMSNorm kernel vs HF's ``residual + x`` and norm module (Qwen3.5-0.8B shapes)."""

from __future__ import annotations

from typing import Any

import torch
from bench_common import markdown, row
from ulptrace.kernels import add_rms_norm

HIDDEN = 1024


def _case(tokens: int, norm: torch.nn.Module, variant: str) -> list[dict[str, Any]]:
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    res = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    nbytes = 4 * x.numel() * 2  # read x, residual; write normed, residual
    case = f"T{tokens}-D{HIDDEN}-bf16"

    def hf() -> Any:
        summed = res + x
        return norm(summed), summed

    rows = [row("add_rms_norm", case, f"HF {type(norm).__name__} + add", hf, nbytes)]
    for mode in ("faithful", "fused"):
        def kernel(mode: str = mode) -> Any:
            return add_rms_norm(x, norm.weight, 1e-6, res, variant=variant, mode=mode, backend="cuda")

        rows.append(row("add_rms_norm", case, f"kernel {variant} {mode}", kernel, nbytes))
    return rows


def bench() -> list[dict[str, Any]]:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    rows = []
    with torch.no_grad():
        for cls, variant in ((Qwen3_5RMSNorm, "zero_centred"), (LlamaRMSNorm, "llama")):
            norm = cls(HIDDEN, eps=1e-6).cuda().bfloat16()
            norm.weight.normal_(0.0 if variant == "zero_centred" else 1.0, 0.1)
            for tokens in (1, 2, 4, 8, 8 * 128):
                rows += _case(tokens, norm, variant)
    return rows


if __name__ == "__main__":
    print(markdown(bench()))
