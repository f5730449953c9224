"""CUDA-graph replay, observed: are replayed records bitwise equal to eager records of the same state?

For each path, runs the same model twice on the GPU with a static cache: once eagerly (hooks fire every
step), once with every decode step replayed from a CUDA graph (the recorder copies its sites into graph
buffers during capture and emits them after each replay), forced to the eager run's tokens. Compares
the final logits of every step and every record (site, step) bitwise, on the device.

    python bench/graph_check.py --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 17 \
        --paths hf kernels:faithful kernels:fused --json out/graph_check.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from ulptrace.comparison import bitwise_equal
from ulptrace.models import build_model
from ulptrace.paths import apply_path
from ulptrace.record import Recorder
from ulptrace.run import Session, greedy, make_prompts


def check(model_name: str, path: str, prompts: int, prompt_len: int, new_tokens: int, attempts: int) -> dict:
    out: dict = {"path": path, "model": model_name, "prompts": prompts, "prompt_len": prompt_len,
                 "decode_steps": new_tokens - 1, "attempts": []}
    ref = build_model(model_name, device="cuda")
    ids = make_prompts(ref.config.vocab_size, prompts, prompt_len, seed=0, device="cuda")
    static_logits: list[torch.Tensor] = []
    t0 = time.perf_counter()
    with apply_path(ref, path) as applied, Recorder(ref) as eager:
        tokens = greedy(ref, ids, new_tokens, mode="static",
                        on_logits=lambda s, l: static_logits.append(l.clone()))
    out["path_info"] = applied.info
    out["static_seconds"] = round(time.perf_counter() - t0, 2)
    for attempt in range(attempts):  # each attempt is a fresh capture
        graph_logits: list[torch.Tensor] = []
        t0 = time.perf_counter()
        with apply_path(ref, path), Recorder(ref) as graph:
            session = Session(ref, "graph", max_len=prompt_len + new_tokens)
            greedy(ref, ids, new_tokens, forced=tokens, session=session,
                   on_logits=lambda s, l, out=graph_logits: out.append(l.clone()))
        seconds = time.perf_counter() - t0
        keys_e, keys_g = set(eager.trace.keys()), set(graph.trace.keys())
        differing = sorted(k for k in keys_e & keys_g
                           if not bitwise_equal(eager.trace[k].out, graph.trace[k].out)
                           or any(not bitwise_equal(t, graph.trace[k].inputs.get(r, t.new_empty(0)))
                                  for r, t in eager.trace[k].inputs.items()))
        out["attempts"].append({
            "attempt": attempt,
            "replays": session.replays,
            "seconds": round(seconds, 2),
            "records": len(keys_e),
            "missing_in_graph": sorted(map(list, keys_e - keys_g))[:10],
            "extra_in_graph": sorted(map(list, keys_g - keys_e))[:10],
            "records_differing": [list(k) for k in differing[:20]],
            "records_differing_count": len(differing),
            "logits_bitwise_equal": all(bitwise_equal(a, b) for a, b in zip(static_logits, graph_logits)),
            "steps": sorted({t for _, t in keys_g}),
        })
    del ref
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3.5-0.8b")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=17, help="prefill + new_tokens-1 decode steps")
    p.add_argument("--paths", nargs="+", default=["hf", "kernels:faithful", "kernels:fused"])
    p.add_argument("--attempts", type=int, default=1)
    p.add_argument("--json")
    args = p.parse_args()
    results = {"versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "device": torch.cuda.get_device_name()}, "checks": []}
    for path in args.paths:
        r = check(args.model, path, args.prompts, args.prompt_len, args.new_tokens, args.attempts)
        results["checks"].append(r)
        for a in r["attempts"]:
            print(f"{path:18} attempt {a['attempt']}: {a['replays']} replays, {a['records']} records, "
                  f"{a['records_differing_count']} differing, missing {len(a['missing_in_graph'])}, extra "
                  f"{len(a['extra_in_graph'])}, logits bitwise {a['logits_bitwise_equal']} ({a['seconds']} s)",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
