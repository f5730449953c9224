"""Shared helpers of the kernel tests: readable ids, tiny HF models, ULP checks, a kernel-loop simulation.

Kept out of ``conftest.py`` so tests import it by a name no other module shadows.
The blocked-tree simulation below is written from the CUDA source's loop structure, not from
``ulptrace.trees``, so comparing the two checks that the declared spec describes the kernel.
"""

from __future__ import annotations

import numpy as np
import torch
from ulptrace.ulp import next_down, next_up, round_to, ulp_distance

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def case_id(dtype: torch.dtype | None = None, **dims: int) -> str:
    """``B2-T123-D123-bf16`` style ids."""
    parts = [f"{k}{v}" for k, v in dims.items()]
    if dtype is not None:
        parts.append(DTYPE_NAMES[dtype])
    return "-".join(parts)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise ULP distance in the tensors' own format (NaN anywhere fails the test)."""
    dist = ulp_distance(a.cpu(), b.cpu())
    assert not bool(dist.nan.any()), "NaN in compared outputs"
    return dist.distance


def faithfully_rounded(result: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Whether each element of ``result`` is one of the two values of its dtype bracketing ``exact`` (float64)."""
    exact = exact.double().cpu()
    nearest = round_to(exact, result.dtype)
    above = nearest.double() > exact
    lower = torch.where(above, next_down(nearest), nearest)
    upper = torch.where(above, nearest, torch.where(nearest.double() < exact, next_up(nearest), nearest))
    r = result.cpu()
    return (r.double() >= lower.double()) & (r.double() <= upper.double())


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A NaN-filled output buffer: any element a kernel fails to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def simulate_blocked(row: np.ndarray, threads: int, vector: int) -> np.float32:
    """The FP32 sum a blocked row kernel computes, simulated from its loops (numpy float32 adds).

    Thread ``t`` runs ``for base = t*V; base < n; base += threads*V: for j < V: acc += x[base+j]``,
    each warp adds ``acc += shfl_xor(acc, off)`` for off = 16..1, lane totals of the warps go to a
    zero-padded 32-lane vector reduced by the same butterfly.
    """
    row = np.asarray(row, dtype=np.float32)
    n = row.shape[0]
    acc = np.zeros(threads, dtype=np.float32)
    for t in range(threads):
        base = t * vector
        while base < n:
            for j in range(vector):
                acc[t] = np.float32(acc[t] + row[base + j])
            base += threads * vector
    lanes = acc.reshape(threads // 32, 32)
    partner = np.arange(32)
    for off in (16, 8, 4, 2, 1):
        lanes = (lanes + lanes[:, partner ^ off]).astype(np.float32)
    totals = lanes[:, 0]
    if totals.shape[0] == 1:
        return totals[0]
    w = np.zeros(32, dtype=np.float32)
    w[: totals.shape[0]] = totals
    for off in (16, 8, 4, 2, 1):
        w = (w + w[partner ^ off]).astype(np.float32)
    return w[0]


# --------------------------------------------------------------------------------------------- models
QWEN35_TINY = {
    "vocab_size": 128, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 4, "full_attention_interval": 2,
    "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 40, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 24, "linear_value_head_dim": 40, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}
LLAMA_TINY = {
    "vocab_size": 128, "hidden_size": 123, "intermediate_size": 200, "num_hidden_layers": 2, "num_attention_heads": 3,
    "num_key_value_heads": 1, "head_dim": 42, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}


def realistic_norms_(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Redraw every norm weight as normal(init, 0.1) (zero-centred norms around 0, others around 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            name = type(module).__name__
            if "RMSNorm" in name and isinstance(getattr(module, "weight", None), torch.Tensor):
                centre = 0.0 if name == "Qwen3_5RMSNorm" else 1.0
                w = torch.randn(module.weight.shape, generator=gen) * 0.1 + centre
                module.weight.copy_(w.to(module.weight.dtype))
    return model


def tiny_qwen35(attn: str = "eager", dtype: torch.dtype = torch.bfloat16, **overrides: int) -> torch.nn.Module:
    """A 4-layer hybrid Qwen3.5 (2 GDN + 2 attention layers), odd head counts, realistic norms."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    config = Qwen3_5TextConfig(**{**QWEN35_TINY, **overrides})
    config._attn_implementation = attn
    torch.manual_seed(0)
    return realistic_norms_(Qwen3_5ForCausalLM(config).to(dtype).eval())


def tiny_llama(attn: str = "eager", dtype: torch.dtype = torch.bfloat16, family: str = "llama") -> torch.nn.Module:
    """A 2-layer Llama (or Qwen3) with hidden 123, 3 query heads of 42, realistic norms."""
    import transformers

    cls, cfg = {"llama": ("LlamaForCausalLM", "LlamaConfig"), "qwen3": ("Qwen3ForCausalLM", "Qwen3Config")}[family]
    config = getattr(transformers, cfg)(**LLAMA_TINY)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return realistic_norms_(getattr(transformers, cls)(config).to(dtype).eval())


def run_steps(model: torch.nn.Module, ids: torch.Tensor, steps: int = 2) -> list[torch.Tensor]:
    """Logits of a prefill and ``steps`` greedy decode steps with a DynamicCache."""
    from transformers.cache_utils import DynamicCache
    from ulptrace.run import cache_kwarg

    cache = DynamicCache(config=model.config)
    kwarg = cache_kwarg(model)  # `cache` in newer transformers; the old name warns
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, **{kwarg: cache}, use_cache=True)
        logits.append(out.logits)
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=nxt, **{kwarg: cache}, use_cache=True)
            logits.append(out.logits)
    return logits
