"""What a run can be asked for, as data: the embedded models (each one's name, family, transformers config and
parameter count) and the run modes — no torch.

Why apart from ``ulptrace.models`` (which builds the models) and ``ulptrace.run`` (which runs the modes), both with
torch: the command line builds its options from these before it imports torch, so that an onset can start its
helper process at the command's first line (``ulptrace.spawning``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

MODES = ("eager", "static", "graph")
"""Run modes: dynamic cache, static cache, static cache with CUDA-graph decode steps."""

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""The model dtypes a run can be asked for (``--dtype``: the dtypes HF checkpoints and ulptrace's ULP statistics
cover), and the bytes of one value in each."""
DTYPES = tuple(DTYPE_BYTES)

DEFAULT_MODEL = "tiny-qwen3.5"


@dataclass(frozen=True)
class ModelSpec:
    """One embedded model: a transformers config class name and its arguments."""

    name: str
    family: str  # which site table applies: "qwen3_5" or "llama"
    config_class: str
    config: dict[str, Any]
    description: str
    parameters: int  # its parameter count (tested against the model built on the meta device: count_parameters)


# Qwen3.5-0.8B's text backbone, copied from shared/models/qwen3.5-0.8b.json (weights are not
# available offline; seeded random init is used).
_QWEN35_08B = {
    "vocab_size": 248320,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "max_position_embeddings": 262144,
}

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="tiny-qwen3.5",
            family="qwen3_5",
            config_class="Qwen3_5TextConfig",
            config={
                "vocab_size": 512,
                "hidden_size": 128,
                "intermediate_size": 384,
                "num_hidden_layers": 4,
                "full_attention_interval": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 32,
                "linear_value_head_dim": 32,
                "linear_conv_kernel_dim": 4,
                "hidden_act": "silu",
                "rms_norm_eps": 1e-06,
                "partial_rotary_factor": 0.25,
                "tie_word_embeddings": False,
                "max_position_embeddings": 4096,
            },
            description="Qwen3.5 hybrid (GatedDeltaNet + gated full attention), 4 layers, hidden 128",
            parameters=988_496,
        ),
        ModelSpec(
            name="tiny-llama",
            family="llama",
            config_class="LlamaConfig",
            config={
                "vocab_size": 512,
                "hidden_size": 128,
                "intermediate_size": 384,
                "num_hidden_layers": 3,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "hidden_act": "silu",
                "rms_norm_eps": 1e-05,
                "tie_word_embeddings": False,
                "max_position_embeddings": 4096,
            },
            description="Llama family (RMSNorm with weight, SwiGLU, GQA), 3 layers, hidden 128",
            parameters=721_792,
        ),
        ModelSpec(
            name="qwen3.5-0.8b",
            family="qwen3_5",
            config_class="Qwen3_5TextConfig",
            config=_QWEN35_08B,
            description="Qwen3.5-0.8B text backbone shape, seeded random weights (for GPU runs)",
            parameters=752_393_024,
        ),
    )
}


def weight_bytes(name_or_path: str, dtype: str) -> int | None:
    """About how many bytes the weights of ``name_or_path`` take built in ``dtype`` (a name of ``DTYPES``), known
    before it is built and without torch: an embedded model's parameter count times the dtype's size; a checkpoint's
    weight files as stored (every ``*.safetensors`` and ``*.bin`` file in its directory). None for a name that is
    neither, or an unknown dtype: the run's own checks say what is wrong there (``ulptrace.models.check_model``)."""
    if name_or_path in MODELS and dtype in DTYPE_BYTES:
        return MODELS[name_or_path].parameters * DTYPE_BYTES[dtype]
    if name_or_path in MODELS or not os.path.isdir(name_or_path):
        return None
    return sum(entry.stat().st_size for entry in os.scandir(name_or_path)
               if entry.is_file() and entry.name.endswith((".safetensors", ".bin")))
