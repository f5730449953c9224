"""Benchmark: GDN gates kernel vs HF's inline ``b.sigmoid()`` and ``-exp(A_log) * softplus(a + dt_bias)``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from bench_common import markdown, row
from ulptrace.kernels import gdn_gates

HEADS = 16


def _case(batch: int, tokens: int, A_log: torch.Tensor, dt_bias: torch.Tensor) -> list[dict[str, Any]]:
    a = torch.randn(batch, tokens, HEADS, device="cuda").bfloat16()
    b = torch.randn(batch, tokens, HEADS, device="cuda").bfloat16()
    nbytes = a.numel() * (2 + 2 + 4 + 2)
    case = f"B{batch}-T{tokens}-H{HEADS}-bf16"

    def hf() -> Any:
        return b.sigmoid(), -A_log.float().exp() * F.softplus(a.float() + dt_bias)

    rows = [row("gdn_gates", case, "HF inline gates", hf, nbytes)]
    for mode in ("faithful", "fused"):
        rows.append(row("gdn_gates", case, f"kernel {mode}",
                        lambda m=mode: gdn_gates(a, b, A_log, dt_bias, mode=m, backend="cuda"), nbytes))
    return rows


def bench() -> list[dict[str, Any]]:
    A_log = torch.empty(HEADS, device="cuda").uniform_(0.01, 16).log().bfloat16()
    dt_bias = (torch.randn(HEADS, device="cuda") * 0.5 + 1.0).bfloat16()
    return [r for batch, tokens in ((1, 1), (2, 1), (4, 1), (8, 1), (8, 128)) for r in _case(batch, tokens, A_log, dt_bias)]


if __name__ == "__main__":
    print(markdown(bench()))
