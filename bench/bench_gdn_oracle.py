"""What judging a GatedDeltaNet scan costs, against HF's own torch scan on the same inputs and device.

For each shape: HF's ``torch_chunk_gated_delta_rule`` (the reference's prefill scan) on BF16 inputs, then
``DeltaRuleSemantics("core").judge`` of its output (the float64 scan with its bound, verdicts; the
hypotheses run only where elements fall outside, as in real use) and of a BF16-rounded state (which
runs the hypotheses too). Prints the ratios and checks they grow linearly, not quadratically, with the
sequence length.

    python bench/bench_gdn_oracle.py --device cpu
    python bench/bench_gdn_oracle.py --device cuda --json $OUT/gdn_oracle.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from ulptrace.oracle.gdn import DeltaRuleSemantics

SHAPES = {  # name: (batch, key heads, value heads, head dim)
    "tiny-qwen3.5": (2, 2, 4, 32),
    "qwen3.5-0.8b": (8, 16, 16, 128),
}


def _inputs(b, t, hk, hv, d, device):
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    # key heads repeated over value heads up front, as HF's GatedDeltaNet does before older scan fallbacks
    return {
        "query": F.silu(randn(b, t, hk, d)).bfloat16().repeat_interleave(hv // hk, 2).to(device),
        "key": F.silu(randn(b, t, hk, d)).bfloat16().repeat_interleave(hv // hk, 2).to(device),
        "value": F.silu(randn(b, t, hv, d)).bfloat16().to(device),
        "g": (-torch.empty(hv).uniform_(0.01, 4.0, generator=gen) * F.softplus(randn(b, t, hv))).to(device),
        "beta": randn(b, t, hv).bfloat16().sigmoid().to(device),
    }


def _time(fn, device, repeat):
    best = float("inf")
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for shape in args.shapes:
        b, hk, hv, d = SHAPES[shape]
        for t in args.lengths:
            x = _inputs(b, t, hk, hv, d, args.device)
            def run(x=x):
                return hf.torch_chunk_gated_delta_rule(x["query"], x["key"], x["value"], g=x["g"], beta=x["beta"],
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)

            core, state = run()
            t_hf = _time(run, args.device, args.repeat)
            core_sem, state_sem = DeltaRuleSemantics("core"), DeltaRuleSemantics("state")
            t_core = _time(lambda sem=core_sem, x=x, out=core: sem.judge(x, out), args.device, args.repeat)
            rounded = state.bfloat16().float()
            t_state = _time(lambda sem=state_sem, x=x, out=rounded, ref=state: sem.judge(x, out, ref), args.device, 1)
            row = {"shape": shape, "batch": b, "tokens": t, "device": args.device, "hf_scan_s": t_hf,
                   "judge_core_s": t_core, "judge_state_with_hypotheses_s": t_state,
                   "ratio_core": t_core / t_hf, "ratio_state_hypotheses": t_state / t_hf}
            rows.append(row)
            print(f"{shape:13} B={b} T={t:5}: HF scan {t_hf * 1e3:8.1f} ms | judge core {t_core * 1e3:8.1f} ms "
                  f"({row['ratio_core']:.1f}x) | judge BF16 state + hypotheses {t_state * 1e3:8.1f} ms "
                  f"({row['ratio_state_hypotheses']:.1f}x)", flush=True)
    for shape in args.shapes:
        mine = [r for r in rows if r["shape"] == shape]
        if len(mine) > 1:
            a, z = mine[0], mine[-1]
            print(f"{shape}: {z['tokens'] / a['tokens']:.0f}x the tokens -> judge time x"
                  f"{z['judge_core_s'] / a['judge_core_s']:.1f} (linear would be x{z['tokens'] / a['tokens']:.0f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
