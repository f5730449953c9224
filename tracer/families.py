"""Model families: the one table of the HF classes ulptrace knows, and what each of them is.

Several layers need the same facts about HF's classes: the site tables (which architectures have
sites), the embedded models (which norms scale by ``1 + weight``), the kernel injection (which
decoder layers it can fuse and how their token mixer is called, which norms and gated norms it
replaces), the recorder and fault injection (is this module a GatedDeltaNet?). Written once here,
they cannot drift apart: a class added to one place and forgotten in another was how a model got
sites but no kernels, or kernels that scaled a norm by the wrong weight. Plain data, no imports.
"""

from __future__ import annotations

from typing import Any

ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3NextForCausalLM"),
    "llama": ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "GemmaForCausalLM"),
    "gemma2": ("Gemma2ForCausalLM",),  # sandwich layers: a norm after the attention and after the MLP as well
}
"""Model classes per family (``type(model).__name__``); the family names the site table that applies."""

DECODER_LAYERS: dict[str, str] = {
    "Qwen3_5DecoderLayer": "hybrid",
    "Qwen3_5TextDecoderLayer": "hybrid",
    "LlamaDecoderLayer": "attention",
    "Qwen3DecoderLayer": "attention",
    "Qwen2DecoderLayer": "attention",
    "MistralDecoderLayer": "attention",
}
"""Decoder layers of the plain pre-norm shape (input norm, token mixer, post-attention norm, MLP) and how
their token mixer runs: ``hybrid`` (Qwen3.5: a GatedDeltaNet or full attention per layer) or
``attention``. Gemma's layers carry extra norms and are not listed."""

NORM_SCALES: dict[str, str] = {
    "LlamaRMSNorm": "weight",
    "Qwen3RMSNorm": "weight",
    "Qwen2RMSNorm": "weight",
    "MistralRMSNorm": "weight",
    "Qwen3_5RMSNorm": "one_plus_weight",
    "Qwen3_5TextRMSNorm": "one_plus_weight",
    "Qwen3NextRMSNorm": "one_plus_weight",
    "GemmaRMSNorm": "one_plus_weight",
    "Gemma2RMSNorm": "one_plus_weight",
    "Gemma3RMSNorm": "one_plus_weight",
}
"""RMSNorm classes and how they scale the normalised value: by ``weight`` or by ``1 + weight``
(zero-centred weights)."""

GATED_NORMS: tuple[str, ...] = ("Qwen3_5RMSNormGated",)
"""Gated RMSNorms (``norm(x) * silu(gate)``, the GatedDeltaNet output norm)."""

LIGER_PATCHES: dict[str, str] = {
    "Qwen3_5ForCausalLM": "apply_liger_kernel_to_qwen3_5",
    "Qwen3_5ForConditionalGeneration": "apply_liger_kernel_to_qwen3_5",
    "Qwen3NextForCausalLM": "apply_liger_kernel_to_qwen3_next",
    "LlamaForCausalLM": "apply_liger_kernel_to_llama",
    "Qwen2ForCausalLM": "apply_liger_kernel_to_qwen2",
    "Qwen3ForCausalLM": "apply_liger_kernel_to_qwen3",
    "MistralForCausalLM": "apply_liger_kernel_to_mistral",
    "GemmaForCausalLM": "apply_liger_kernel_to_gemma",
    "Gemma2ForCausalLM": "apply_liger_kernel_to_gemma2",
}
"""Liger-Kernel's patch function (in ``liger_kernel.transformers``) for each model class (the ``liger`` path)."""


def family_of(model: Any) -> str | None:
    """The family of ``model``'s architecture (a key of :data:`ARCHITECTURES`), or None."""
    arch = type(model).__name__
    return next((family for family, classes in ARCHITECTURES.items() if arch in classes), None)


def norm_scale(module: Any) -> str | None:
    """``"weight"`` or ``"one_plus_weight"`` for a known RMSNorm class, else None."""
    return NORM_SCALES.get(type(module).__name__)


def is_gated_deltanet(module: Any) -> bool:
    """Whether ``module`` is a GatedDeltaNet (Qwen3.5 / Qwen3-Next linear attention): it owns the decay
    parameters ``A_log`` and ``dt_bias`` that no other HF module has."""
    return module is not None and hasattr(module, "A_log") and hasattr(module, "dt_bias")
