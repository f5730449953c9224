"""Benchmark: GLU epilogue kernel vs HF's ``act_fn(gate) * up`` (Qwen3.5-0.8B intermediate 3584)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from bench_common import markdown, row
from ulptrace.kernels import glu

INTERMEDIATE = 3584


def _case(tokens: int) -> list[dict[str, Any]]:
    gate = torch.randn(tokens, INTERMEDIATE, device="cuda").bfloat16()
    up = torch.randn(tokens, INTERMEDIATE, device="cuda").bfloat16()
    nbytes = 3 * gate.numel() * 2
    case = f"T{tokens}-I{INTERMEDIATE}-bf16"
    rows = [row("glu", case, "HF silu(gate) * up", lambda: F.silu(gate) * up, nbytes)]
    for mode in ("faithful", "fused"):
        rows.append(row("glu", case, f"kernel {mode}", lambda m=mode: glu(gate, up, mode=m, backend="cuda"), nbytes))
    return rows


def bench() -> list[dict[str, Any]]:
    return [r for tokens in (1, 2, 4, 8, 8 * 128) for r in _case(tokens)]


if __name__ == "__main__":
    print(markdown(bench()))
