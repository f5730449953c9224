"""Audit 39's check of its own candidates, independent of ulptrace's recorder and oracle: build the model twice (HF and
HF + candidate), run the same prefill (ulptrace's seeded prompts) and two decode steps fed the same tokens (HF's greedy
choice), record every module's first output tensor per step with forward hooks, and print, per step, the first modules
(in execution order) whose outputs differ, with the number of differing elements and the max BF16 ULP distance.
Usage: PYTHONPATH=bench/audit python bench/audit/audit39_check.py MODEL CANDIDATE [--seed N] [--all]"""
from __future__ import annotations

import argparse
import importlib

import torch
from ulptrace.models import build_model
from ulptrace.run import make_prompts


def ordered(t):
    """BF16/FP16/FP32 bits as integers ordered like the values (for ULP distances)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    i = t.float().view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def record(model, prompts, feed):
    """{step: [(module name, tensor)]} in execution order; ``feed``: tokens [b, steps-1] for the decode steps."""
    recs, cur = {}, {"step": 0}
    handles = []
    for name, mod in model.named_modules():
        def hook(m, a, out, name=name):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if hasattr(t, "logits"):
                t = t.logits
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                recs.setdefault(cur["step"], []).append((name or "<model>", t.detach().clone()))
        handles.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        out = model(prompts, use_cache=True)
        cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
        logits = [out.logits[:, -1]]
        for s in range(feed.shape[1]):
            cur["step"] = s + 1
            out = model(feed[:, s:s + 1], use_cache=True, cache=cache)
            logits.append(out.logits[:, -1])
    for h in handles:
        h.remove()
    return recs, logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("candidate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--all", action="store_true", help="every differing module, not the first 6 per step")
    args = ap.parse_args()
    mod, fn = args.candidate.split(":")
    cand = getattr(importlib.import_module(mod), fn)
    ref_model = build_model(args.model, seed=args.seed)
    cand_model = build_model(args.model, seed=args.seed)
    prompts = make_prompts(ref_model.config.vocab_size, 2, 16, args.seed)
    with torch.no_grad():
        # HF's greedy tokens for steps 1 and 2 (no hooks)
        out = ref_model(prompts, use_cache=True)
        cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
        t1 = out.logits[:, -1].argmax(-1, keepdim=True)
        out = ref_model(t1, use_cache=True, cache=cache)
        t2 = out.logits[:, -1].argmax(-1, keepdim=True)
    feed = torch.cat([t1, t2], 1)
    ref, _ = record(ref_model, prompts, feed)
    undo = cand(cand_model)
    got, _ = record(cand_model, prompts, feed)
    for step in sorted(ref):
        a, b = ref[step], got.get(step, [])
        names_a = [n for n, _ in a]
        names_b = [n for n, _ in b]
        if names_a != names_b:
            print(f"step {step}: module call sequence differs ({len(names_a)} vs {len(names_b)} calls)")
        shown = 0
        for (n, x), (m, y) in zip(a, b):
            if n != m:
                continue
            if x.shape != y.shape:
                print(f"step {step} {n}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
                shown += 1
                continue
            nan = (torch.isnan(x) != torch.isnan(y)).sum().item()
            same = (x == y) | (torch.isnan(x) & torch.isnan(y))
            diff = int((~same).sum())
            if diff:
                d = (ordered(x) - ordered(y)).abs()
                d = d[~same & ~torch.isnan(x) & ~torch.isnan(y)]
                mx = int(d.max()) if d.numel() else 0
                rows = sorted({int(i) for i in (~same).nonzero()[:, 0].tolist()}) if x.dim() > 1 else []
                print(f"step {step} {n}: {diff}/{x.numel()} differ, max ulp {mx}, nan-mismatch {nan}, "
                      f"batch rows {rows} {x.dtype}")
                shown += 1
                if shown >= 6 and not args.all:
                    break
        if shown == 0:
            print(f"step {step}: every module output bitwise equal ({len(a)} calls)")
    if callable(undo):
        undo()


if __name__ == "__main__":
    main()
