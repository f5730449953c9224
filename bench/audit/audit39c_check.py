"""Audit 39c: independent check (HF forward hooks, no ulptrace recorder/oracle) of a candidate over N steps and B
prompts: per step, the first modules whose outputs differ from HF's (fed HF's greedy tokens).
Usage: PYTHONPATH=bench/audit python bench/audit/audit39c_check.py MODEL CANDIDATE [--steps N] [--prompts B]"""
import argparse
import importlib

import torch
from audit39_check import ordered, record
from ulptrace.models import build_model
from ulptrace.run import make_prompts

ap = argparse.ArgumentParser()
ap.add_argument("model"); ap.add_argument("candidate")
ap.add_argument("--steps", type=int, default=6); ap.add_argument("--prompts", type=int, default=2)
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
mod, fn = a.candidate.split(":")
cand = getattr(importlib.import_module(mod), fn)
ref_m, cand_m = build_model(a.model, seed=a.seed), build_model(a.model, seed=a.seed)
prompts = make_prompts(ref_m.config.vocab_size, a.prompts, 16, a.seed)
with torch.no_grad():
    out = ref_m(prompts, use_cache=True)
    cache = out.past_key_values if getattr(out, "past_key_values", None) is not None else out.cache
    toks = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(a.steps - 2):
        out = ref_m(toks[-1], use_cache=True, cache=cache)
        toks.append(out.logits[:, -1].argmax(-1, keepdim=True))
feed = torch.cat(toks, 1)
ref, _ = record(ref_m, prompts, feed)
cand(cand_m)
got, _ = record(cand_m, prompts, feed)
for step in sorted(ref):
    shown = 0
    for (n, x), (m, y) in zip(ref[step], got.get(step, [])):
        if n != m or x.shape != y.shape:
            continue
        same = (x == y) | (torch.isnan(x) & torch.isnan(y))
        if (~same).any():
            d = (ordered(x) - ordered(y)).abs()[~same]
            rows = sorted({int(i) for i in (~same).nonzero()[:, 0].tolist()})
            print(f"step {step} {n}: {int((~same).sum())}/{x.numel()} differ, max ulp {int(d.max())}, rows {rows}")
            shown += 1
            if shown >= 3:
                break
    if not shown:
        print(f"step {step}: all bitwise equal")
