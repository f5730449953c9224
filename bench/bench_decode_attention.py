"""Benchmark: decode attention kernel vs HF's eager and SDPA attention functions (8 q / 2 kv heads x 256)."""

from __future__ import annotations

import types
from typing import Any

import torch
from bench_common import markdown, row
from ulptrace.kernels import decode_attention

Q_HEADS, KV_HEADS, HEAD_DIM = 8, 2, 256
KERNEL_VARIANTS = (("eager faithful", "eager", "faithful"), ("sdpa faithful", "sdpa", "faithful"),
                   ("fused", "eager", "fused"))


def _case(batch: int, length: int) -> list[dict[str, Any]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen3_5.modeling_qwen3_5 import eager_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=Q_HEADS // KV_HEADS, training=False, is_causal=True)
    scale = HEAD_DIM ** -0.5
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device="cuda").bfloat16()
    k = torch.randn(batch, KV_HEADS, length, HEAD_DIM, device="cuda").bfloat16()
    v = torch.randn(batch, KV_HEADS, length, HEAD_DIM, device="cuda").bfloat16()
    valid = torch.ones(batch, length, dtype=torch.bool, device="cuda")
    valid[0, : length // 4] = False  # one left-padded row
    additive = torch.where(valid, 0.0, torch.finfo(torch.bfloat16).min).bfloat16()[:, None, None, :]
    nbytes = 2 * k.numel() * 2
    case = f"B{batch}-L{length}-Hq{Q_HEADS}-Hkv{KV_HEADS}-D{HEAD_DIM}-bf16"
    rows = [
        row("decode_attention", case, "HF eager_attention_forward",
            lambda: eager_attention_forward(module, q, k, v, additive, scaling=scale), nbytes),
        row("decode_attention", case, "HF sdpa_attention_forward",
            lambda: sdpa_attention_forward(module, q, k, v, valid[:, None, None, :], scaling=scale), nbytes),
    ]
    for label, semantics, mode in KERNEL_VARIANTS:
        def kernel(semantics: str = semantics, mode: str = mode) -> Any:
            return decode_attention(q[:, :, 0], k, v, scale=scale, valid=valid, semantics=semantics, mode=mode,
                                    backend="cuda")

        rows.append(row("decode_attention", case, f"kernel {label}", kernel, nbytes))
    return rows


def bench() -> list[dict[str, Any]]:
    return [r for batch in (1, 2, 4, 8) for length in (512, 4096) for r in _case(batch, length)]


if __name__ == "__main__":
    print(markdown(bench()))
