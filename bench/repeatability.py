"""Whether each side of an onset repeats its bits run after run (twenty-first round's open finding: on the H200, at
8 x 512 and 8 x 4,096 tokens, reports of different modes differed from decode step 4 on, starting at a
full-attention output). Each side's untraced generation runs twice on one model (the candidate fed the reference's
tokens): its final-position logits at every step are compared bitwise, and the first step that differs is named.
``--onsets N`` also runs the onset N times in one mode (the reference kept on the device) and names the first
differing report fields; ``--sdpa`` pins torch's scaled-dot-product attention to one backend on both models
(``ulptrace.sdpa``: tells the attention backends apart); under ``CUDA_LAUNCH_BLOCKING=1`` a difference that goes away is a race, not a kernel.

    python bench/repeatability.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 512 --new-tokens 16
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_trace import _clean, check_workload, differences, workload_arguments, workload_config


def _logits(model, prompts, new_tokens, forced=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from ulptrace.run import greedy

    steps: list[torch.Tensor] = []
    tokens = greedy(model, prompts, new_tokens, forced=forced,
                    on_logits=lambda step, logits: steps.append(logits[:, -1].clone()))
    return tokens, steps


def _first_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict | None:
    """The first step whose logits are not bitwise equal (how many elements differ, by how much), or None."""
    from ulptrace.comparison import bitwise_equal
    from ulptrace.ulp import same_bits

    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        if not bitwise_equal(x, y):
            return {"step": step, "elements": int((~same_bits(x, y)).sum()),
                    "max_abs": float((x.double() - y.double()).abs().nan_to_num(0.0).max())}
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_arguments(p, prompts=2, prompt_len=16, new_tokens=8)
    p.add_argument("--repeats", type=int, default=2, help="untraced runs of each side (default 2)")
    p.add_argument("--onsets", type=int, default=0, help="onsets in one mode to compare (0: none)")
    p.add_argument("--json")
    args = p.parse_args()
    check_workload(p, args)
    if args.repeats < 2 or args.onsets < 0:
        p.error(f"--repeats must be >= 2 and --onsets >= 0, but got {args.repeats} and {args.onsets}")
    from ulptrace.paths import apply_path
    from ulptrace.run import build_pair

    cfg = workload_config(args, oracle=False, reference_memory="device")
    out: dict = {"workload": vars(args), "torch": torch.__version__}
    with torch.no_grad():
        ref, cand, prompts = build_pair(cfg)
        with apply_path(ref, cfg.reference):
            runs = [_logits(ref, prompts, args.new_tokens) for _ in range(args.repeats)]
        tokens = runs[0][0]
        out["reference"] = [_first_difference(runs[0][1], r[1]) for r in runs[1:]]
        out["reference_tokens_repeat"] = all(torch.equal(tokens, r[0]) for r in runs[1:])
        del runs
        with apply_path(cand, cfg.candidate):
            runs = [_logits(cand, prompts, args.new_tokens, forced=tokens) for _ in range(args.repeats)]
        out["candidate"] = [_first_difference(runs[0][1], r[1]) for r in runs[1:]]
        del runs, ref, cand
        print(f"untraced, {args.repeats} runs each (SDPA {args.sdpa}): reference {out['reference']} (tokens repeat: "
              f"{out['reference_tokens_repeat']}); candidate {out['candidate']} (None: bitwise the first run's)",
              flush=True)
        if args.onsets:
            from ulptrace.probes.onset import run_onset

            reports = []
            for _ in range(args.onsets):
                comparison, info = run_onset(cfg)
                reports.append(_clean(dict(comparison.to_json(), run=info)))
            out["onsets"] = [differences(reports[0], r) for r in reports[1:]]
            for i, diff in enumerate(out["onsets"], 2):
                print(f"onset {i} vs 1: equal {not diff}" + "".join(f"\n  {d}" for d in diff), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
