"""The matrix's cost: `ulptrace matrix` against bare greedy generation of the same checks.

Reads a matrix report (``ulptrace matrix --json``, also a partial one left by a stopped run), re-runs exactly
its checks' generations with nothing else — for every seed the model is built (not timed, as the matrix's
``build_seconds`` are left out; one copy, each path applied in turn, untimed), for every batch the reference
once, then every candidate check in a fresh ``Session`` (a fresh capture in graph mode), greedy, EOS disabled,
no snapshots, no logits kept — and compares the times:

- ``ratio``: the matrix without model builds (reference + candidates + locating every divergent row) over
  the bare generations;
- ``ratio_without_locating``: the matrix's own generations (reference with its per-step states, candidates
  with their logits) over the bare ones, i.e. what the matrix costs before any row is located.

Usage: ``python bench/bench_matrix.py --matrix-json matrix.json [--json out.json]`` on the machine that ran
the matrix (a GPU run must be timed on the same GPU). Prints one markdown table row for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from ulptrace.models import build_model
from ulptrace.paths import apply_path
from ulptrace.run import Session, greedy, make_prompts, torch_dtype


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bare_generation(report: dict) -> dict:
    """Time the report's generations (its ``checks``, also of a partial report) with nothing but greedy decoding."""
    grid = report["grid"]
    device, dtype = grid["device"], torch_dtype(grid["dtype"])
    ref_path, ref_mode = report["reference"]["path"], report["reference"]["mode"]
    cache_len = grid.get("cache_len") or grid["prompt_len"] + grid["new_tokens"]
    done = [(c["seed"], c["batch"], c["path"], c["mode"]) for c in report["checks"]]
    seconds = 0.0
    runs = 0
    for seed in dict.fromkeys(s for s, _, _, _ in done):
        model = build_model(report["model"], dtype=dtype, device=device, seed=seed)  # one copy; paths applied in turn
        prompts_all = make_prompts(model.config.vocab_size, max(grid["batches"]), grid["prompt_len"], seed, device)
        with torch.no_grad():
            for batch in dict.fromkeys(b for s, b, _, _ in done if s == seed):
                prompts = prompts_all[:batch]
                with apply_path(model, ref_path):
                    _sync(device)
                    start = time.perf_counter()
                    greedy(model, prompts, grid["new_tokens"], session=Session(model, ref_mode, max_len=cache_len))
                    _sync(device)
                    seconds += time.perf_counter() - start
                runs += 1
                for path in dict.fromkeys(p for s, b, p, _ in done if (s, b) == (seed, batch)):
                    with apply_path(model, path):
                        for mode in [m for s, b, p, m in done if (s, b, p) == (seed, batch, path)]:
                            start = time.perf_counter()
                            greedy(model, prompts, grid["new_tokens"], session=Session(model, mode, max_len=cache_len))
                            _sync(device)
                            seconds += time.perf_counter() - start
                            runs += 1
        del model
    return {"seconds": seconds, "generations": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix-json", required=True, help="the report of `ulptrace matrix --json`")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    report = json.loads(Path(args.matrix_json).read_text())
    bare = bare_generation(report)
    timing = report["timing"]
    matrix = timing["seconds"] - timing["build_seconds"]
    own = timing["reference_seconds"] + timing["generation_seconds"]
    divergent = sum(not r["token_exact"] for r in report["rows"])
    result = {
        "model": report["model"], "device": report["grid"]["device"], "checks": len(report["checks"]),
        "complete": report.get("complete", True),
        "generations": bare["generations"], "divergent_rows": divergent,
        "bare_seconds": bare["seconds"], "matrix_seconds": matrix, "matrix_generation_seconds": own,
        "locate_seconds": timing["locate_seconds"], "ratio": matrix / bare["seconds"],
        "ratio_without_locating": own / bare["seconds"],
    }
    print("| model | checks (generations) | divergent rows located | bare generation s | matrix s (generation + "
          "locating) | ratio | ratio without locating |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {result['model']} | {result['checks']} ({result['generations']}) | {divergent} | {bare['seconds']:.1f} | "
          f"{matrix:.1f} ({own:.1f} + {timing['locate_seconds']:.1f}) | {result['ratio']:.2f}x | "
          f"{result['ratio_without_locating']:.2f}x |")
    if not result["complete"]:
        print(f"(a partial matrix report: the {result['checks']} checks run before it stopped)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
