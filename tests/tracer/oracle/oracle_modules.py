"""Shared pieces for the oracle tests: real HF modules with realistic (non-init) parameters.

Plain factories (no conftest: ``tests/conftest.py`` is imported by name elsewhere).
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

BF16 = torch.bfloat16


def make_qwen_norm() -> Qwen3_5RMSNorm:
    """Zero-centred Qwen3.5 norm, weight ~ normal(0, 0.1) (the init would be all zeros)."""
    norm = Qwen3_5RMSNorm(64, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 0.0, 0.1)
    return norm.to(BF16)


def make_gated_norm() -> Qwen3_5RMSNormGated:
    norm = Qwen3_5RMSNormGated(64, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    return norm.to(BF16)


def make_llama_norm() -> LlamaRMSNorm:
    norm = LlamaRMSNorm(64, eps=1e-5)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    return norm.to(BF16)


class GDNGates(torch.nn.Module):
    """The two GatedDeltaNet gate parameters, as a BF16 Qwen3.5 model holds them."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.empty(heads).uniform_(0.01, 16).log())
        self.dt_bias = torch.nn.Parameter(torch.randn(heads) * 0.5 + 1.0)


def make_gates() -> GDNGates:
    return GDNGates(8).to(BF16)


class AttentionHolder(torch.nn.Module):
    """What HF's attention functions read from their module: GQA group count and training flag."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def make_attention_module() -> AttentionHolder:
    """An attention stand-in with two query heads per key/value head, in eval mode."""
    return AttentionHolder(2).eval()
