"""Write a local HF checkpoint directory of an embedded model with fewer layers.

    python bench/make_checkpoint.py --model qwen3.5-0.8b --layers 4 --out /tmp/q08-4L

The directory (``config.json`` and ``model.safetensors`` from ``save_pretrained``, plus
``ulptrace_checkpoint.json`` saying how it was made) is what ``ulptrace onset --model DIR`` loads. Every
width, head count and the vocabulary are the embedded model's; only ``num_hidden_layers`` changes, and
``layer_types`` (where the config has it) keeps its first N entries, so ``qwen3.5-0.8b --layers 4`` is three
GatedDeltaNet layers and one full-attention layer. The weights are built by ``ulptrace.models.build_model``
itself (HF's init under ``seed``, then the trained-like redraw of norms, GDN gates and embeddings, parameters
cast to ``--dtype``): the model is registered under a temporary name for the call and removed after. They
are seeded random weights of the smaller model, not the first N layers of the full one (the draws are
consumed in module order, so every draw after the last layer's comes out differently).

Used by bench/gpu_findings.sh (COMPILE_LAYERS) so that torch.compile of the whole model fits one device
call: Inductor's compile time grows with the number of layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
from ulptrace.catalog import MODELS
from ulptrace.models import _config, build_model


def derived_config(name: str, layers: int) -> dict:
    """The embedded model ``name``'s config arguments with ``layers`` hidden layers."""
    spec = MODELS[name]
    full = _config(spec)
    total = full.num_hidden_layers
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be between 1 and {total} (the layers of {name}), not {layers}")
    config = dict(spec.config, num_hidden_layers=layers)
    layer_types = getattr(full, "layer_types", None)
    if layer_types is not None:
        config["layer_types"] = list(layer_types[:layers])
    return config


def make_checkpoint(name: str, layers: int, out: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                    verify: bool = True) -> dict:
    """Build the ``layers``-layer variant of embedded model ``name`` and save it to ``out``; returns its record."""
    spec = MODELS[name]
    temp = f"{name}@{layers}L"
    MODELS[temp] = dataclasses.replace(spec, name=temp, config=derived_config(name, layers),
                                       description=f"{spec.description}; first {layers} layer(s)")
    try:
        model = build_model(temp, dtype=dtype, seed=seed)
    finally:
        del MODELS[temp]
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    record = {
        "made_by": "bench/make_checkpoint.py",
        "model": name,
        "layers": layers,
        "layer_types": getattr(model.config, "layer_types", None),
        "seed": seed,
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if verify:  # what ulptrace onset --model OUT will load: the same parameters, bitwise, in the same dtype
        loaded = dict(build_model(out, dtype=dtype).named_parameters())
        built = dict(model.named_parameters())
        if loaded.keys() != built.keys():
            raise RuntimeError(f"{out}: parameter names differ after loading: "
                               f"{sorted(loaded.keys() ^ built.keys())[:6]}")
        bad = [k for k, v in built.items()
               if loaded[k].dtype != v.dtype or loaded[k].shape != v.shape or not torch.equal(loaded[k], v)]
        if bad:
            raise RuntimeError(f"{out}: {len(bad)} parameter(s) differ after loading, first {bad[:3]}")
        record["verified"] = f"reloaded by ulptrace.models.build_model: {len(built)} parameters bitwise equal"
    with open(os.path.join(out, "ulptrace_checkpoint.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3.5-0.8b", help=f"embedded model: {', '.join(MODELS)}")
    p.add_argument("--layers", type=int, required=True, help="number of hidden layers to keep")
    p.add_argument("--out", required=True, help="checkpoint directory to write (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights (build_model's seed; default 0)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--no-verify", action="store_true", help="skip reloading the directory and comparing weights")
    args = p.parse_args()
    if args.model not in MODELS:
        p.error(f"unknown model {args.model!r}: expected one of {', '.join(MODELS)}")
    try:
        record = make_checkpoint(args.model, args.layers, args.out, seed=args.seed,
                                 dtype=getattr(torch, args.dtype), verify=not args.no_verify)
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
