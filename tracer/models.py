"""Embedded models: HF causal LMs that ulptrace can build without any download.

Tracing needs a model, and CI has no network. Each entry is a transformers config (data, in
``ulptrace.catalog``'s ``MODELS``) plus a seeded random initialisation, made here. HF initialises
zero-centred norm weights to 0 and standard ones to 1, which hides exactly the scale-precision
defects ulptrace exists to find (a ``(1 + w)`` formed in BF16 is invisible when ``w == 0``), so
after HF's init every norm weight, GatedDeltaNet ``A_log``/``dt_bias`` and the embeddings are
redrawn around their init with a spread typical of trained checkpoints. A path to a local HF
checkpoint directory loads that instead.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch
from ulptrace.catalog import DEFAULT_MODEL, MODELS, ModelSpec
from ulptrace.families import is_gated_deltanet, norm_scale

# Spread of redrawn parameters, as (parameter-name suffix, rule). Norm offsets and scales get a
# trained-like spread; the GDN decay parameters are drawn around HF's init ranges.
_NORM_SPREAD = 0.15


def _std_of(model: torch.nn.Module) -> float:
    return float(getattr(model.config, "initializer_range", 0.02))


@torch.no_grad()
def realistic_init_(model: torch.nn.Module, seed: int) -> None:
    """Redraw norm weights, GDN gate parameters and embeddings with trained-like spreads (in place)."""
    gen = torch.Generator().manual_seed(seed + 1)

    def draw(shape: torch.Size, mean: float, std: float) -> torch.Tensor:
        # in place: the same two roundings as ``randn * std + mean``, without two more temporaries of the size (the
        # 0.8B shape's embeddings are 254M values: ~1 s each on a host core)
        return torch.randn(shape, generator=gen, dtype=torch.float32).mul_(std).add_(mean)

    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if "RMSNorm" in type(module).__name__ and isinstance(weight, torch.Tensor):
            mean = 0.0 if norm_scale(module) == "one_plus_weight" else 1.0  # Qwen3.5, Gemma: 1 + weight
            weight.copy_(draw(weight.shape, mean, _NORM_SPREAD))
        if is_gated_deltanet(module):
            heads = module.A_log.shape
            a = torch.rand(heads, generator=gen) * 15.99 + 0.01  # HF's range for A
            module.A_log.copy_(a.log())
            module.dt_bias.copy_(draw(module.dt_bias.shape, 0.0, 1.0))
    std = _std_of(model)
    embeddings = [emb.weight for emb in (model.get_input_embeddings(), model.get_output_embeddings())
                  if emb is not None and emb.weight is not None]
    for i, weight in enumerate(embeddings):
        if any(weight is later for later in embeddings[i + 1:]):
            # tied: the output embedding's draw overwrites this one, which only advances the generator (as it always
            # did: the weights stay what they were)
            torch.randn(weight.shape, generator=gen, dtype=torch.float32)
            continue
        # Wider than HF's initializer_range so greedy decoding of a tiny model is not degenerate.
        weight.copy_(draw(weight.shape, 0.0, 4 * std))


def _config(spec: ModelSpec) -> Any:
    import transformers

    cls = getattr(transformers, spec.config_class)
    return cls(**spec.config)


def build_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    sdpa: str = "default",
) -> Any:
    """Build an embedded model by name, or load a local HF checkpoint directory.

    Returns an HF ``PreTrainedModel`` in eval mode with ``dtype`` parameters on ``device``. The same
    ``(name, seed)`` always gives bitwise the same weights. Raises ``KeyError`` listing the known
    names when ``name_or_path`` is neither a known name nor an existing directory. ``sdpa`` pins torch's attention
    backend for every forward of the model (``ulptrace.sdpa``; ``default``: torch's choice per call).
    """
    import transformers

    from ulptrace.sdpa import check_sdpa, pin_sdpa

    check_sdpa(sdpa, device)

    if name_or_path in MODELS:
        spec = MODELS[name_or_path]
        config = _config(spec)
        config._attn_implementation = attn_implementation
        torch.manual_seed(seed)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation=attn_implementation
            )
        realistic_init_(model, seed)
        # Parameters only: buffers such as RoPE's inv_freq stay FP32, as when HF loads a checkpoint.
        for param in model.parameters():
            param.data = param.data.to(dtype)
        model.ulptrace_model_name = spec.name  # type: ignore[attr-defined]
    elif os.path.isdir(name_or_path):
        check_model(name_or_path)
        attn_implementation = _attention_for(name_or_path, attn_implementation)
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=dtype, attn_implementation=attn_implementation
            ).to(device)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            first = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc).strip().splitlines()
            raise ValueError(f"checkpoint directory {name_or_path} cannot be loaded by transformers: "
                             f"{first[0] if first else type(exc).__name__}") from None
        model.ulptrace_model_name = os.path.abspath(name_or_path)  # type: ignore[attr-defined]
    else:
        check_model(name_or_path)
    model.ulptrace_seed = seed  # type: ignore[attr-defined]
    model.requires_grad_(False)
    return pin_sdpa(model.eval(), sdpa)


def _attention_for(path: str, asked: str) -> str:
    """The attention to load checkpoint ``path`` with: ``asked``, except that an architecture transformers gives no
    SDPA attention (Gemma 2 in transformers 5) is built with eager attention — what HF itself picks for it — and a
    warning says so, rather than the checkpoint refusing to load."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if asked != "sdpa":
        return asked
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(transformers.AutoConfig.from_pretrained(path))]
    except (KeyError, OSError, ValueError):
        return asked  # loading says what is wrong
    if getattr(cls, "_supports_sdpa", True):
        return asked
    warnings.warn(f"{cls.__name__} has no SDPA attention in transformers {transformers.__version__}: {path} is built "
                  "with eager attention (HF's own choice for it); paths that switch to SDPA cannot run on it",
                  stacklevel=3)
    return "eager"


def prepare(name_or_path: str, attn_implementation: str = "sdpa") -> None:
    """Import what building ``name_or_path`` needs — transformers and the model's own modules, most of a first
    build's seconds (3 s of 3.1 for tiny-qwen3.5 on a CPU) — by constructing it on the meta device: no weights are
    drawn or read, no memory is taken. For a process that will be handed the model (``ulptrace.concurrent``):
    those imports then overlap the build of the process sending it. Raises what building it would."""
    import transformers

    if name_or_path in MODELS:
        config = _config(MODELS[name_or_path])
    else:
        check_model(name_or_path)
        config = transformers.AutoConfig.from_pretrained(name_or_path)
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def twin(model: Any) -> Any:
    """A second model bitwise equal to ``model`` (a fresh one from :func:`build_model`, before any path is applied):
    its parameters and buffers copied, not drawn again. The same as building it twice with the same arguments —
    the same seed gives the same weights — at a fraction of the cost: drawing the embedded models' weights on the
    host takes seconds (the 0.8B shape's embeddings are 254M values each), a device copy milliseconds."""
    import copy

    return copy.deepcopy(model)


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_model(name_or_path: str) -> str:
    """``name_or_path`` when it names an embedded model or a plausible local checkpoint directory.

    Cheap (no weights are read), so a run can fail before building anything. Raises ``KeyError``
    for a name that is neither an embedded model nor a directory, and ``ValueError`` for a
    directory without a readable ``config.json`` (a JSON object with ``model_type``) or without
    weights (``model.safetensors``, ``pytorch_model.bin`` or their sharded index).
    """
    import json

    if name_or_path in MODELS:
        return name_or_path
    if not os.path.isdir(name_or_path):
        known = ", ".join(MODELS)
        raise KeyError(
            f"unknown model {name_or_path!r}: expected one of the embedded models ({known}) "
            "or a path to a local HF checkpoint directory"
        )
    config = os.path.join(name_or_path, "config.json")
    if not os.path.isfile(config):
        raise ValueError(f"checkpoint directory {name_or_path} has no config.json: expected an HF checkpoint "
                         "(config.json plus model.safetensors or pytorch_model.bin)")
    try:
        with open(config, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config} is not a valid JSON file: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        found = sorted(data)[:6] if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{config} is not an HF model config: expected a JSON object with a 'model_type' "
                         f"string, but found {found}")
    entries = set(os.listdir(name_or_path))
    if not entries & set(WEIGHT_FILES):
        raise ValueError(f"checkpoint directory {name_or_path} has no weights: expected one of "
                         f"{', '.join(WEIGHT_FILES)}, but found {', '.join(sorted(entries)) or 'nothing'}")
    return name_or_path


def count_parameters(name: str) -> int:
    """Parameter count of an embedded model, computed on the meta device (no memory, no init)."""
    import transformers

    spec = MODELS[name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(spec))
    return sum(p.numel() for p in model.parameters())


def list_models() -> list[dict[str, Any]]:
    """The embedded models: name, family, parameter count and description."""
    return [
        {
            "name": spec.name,
            "family": spec.family,
            "parameters": spec.parameters,
            "description": spec.description,
        }
        for spec in MODELS.values()
    ]


def model_name(model: Any) -> str:
    """The name a trace records for ``model`` (embedded name, checkpoint path, or class name)."""
    return getattr(model, "ulptrace_model_name", type(model).__name__)


def format_count(n: int) -> str:
    """``1234567 -> '1.23M'``, for tables."""
    if n < 1000:
        return str(n)
    exp = min(int(math.log10(n) // 3), 3)
    return f"{n / 10 ** (3 * exp):.3g}{' KMB'[exp]}"


