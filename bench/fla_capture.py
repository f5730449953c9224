"""Capture flash-linear-attention's scan outputs on Qwen3.5-0.8B-shaped inputs, for judging offline.

Runs FLA's chunked scan (prefill) and fused recurrent scan (decode, from the prefill's state) on seeded
inputs distributed like Qwen3.5's, and saves inputs and outputs as safetensors, so that the GDN oracle's
verdicts on FLA can be examined on any machine:

    ULPTRACE_FLA_DIR=/tmp/fla python bench/fla_capture.py --out $OUT/fla_capture.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    sys.path.append(os.environ["ULPTRACE_FLA_DIR"])
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 2, args.tokens, 16, 128

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    a = torch.empty(h).uniform_(0.01, 4.0, generator=gen)
    x = {
        "query": F.silu(randn(b, t + 1, h, d)).bfloat16(),
        "key": F.silu(randn(b, t + 1, h, d)).bfloat16(),
        "value": F.silu(randn(b, t + 1, h, d)).bfloat16(),
        "g": -a * F.softplus(randn(b, t + 1, h)),
        "beta": randn(b, t + 1, h).bfloat16().sigmoid(),
    }
    x = {k: v.cuda() for k, v in x.items()}
    pre = {k: v[:, :t].contiguous() for k, v in x.items()}
    dec = {k: v[:, t:].contiguous() for k, v in x.items()}
    core, state = chunk_gated_delta_rule(pre["query"], pre["key"], pre["value"], g=pre["g"], beta=pre["beta"],
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    core1, state1 = fused_recurrent_gated_delta_rule(dec["query"], dec["key"], dec["value"], g=dec["g"],
                                                     beta=dec["beta"], initial_state=state.clone(),
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    out = {f"prefill.{k}": v for k, v in pre.items()} | {f"decode.{k}": v for k, v in dec.items()}
    out |= {"prefill.core": core, "prefill.final": state, "decode.state": state, "decode.core": core1,
            "decode.final": state1}
    save_file({k: v.detach().cpu().contiguous() for k, v in out.items()}, args.out)
    print("saved", {k: tuple(v.shape) for k, v in out.items()})


if __name__ == "__main__":
    main()
