"""P1 in both modes against one base: the sequential onset and ``--concurrent`` (the reference process kept between
runs) alternating in one process, each followed by an untraced run of the pair on prebuilt models — so both modes are
divided by the same untraced runs, taken after each mode alike (``bench_trace.py`` measures one mode a process, each
against its own base: a base that the mode's own after-effects slow would flatter it; issue 11, ``bench/idle_helper.py``).

    python bench/modes_ab.py --device cuda --model qwen3.5-0.8b --rounds 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace


def main() -> None:
    from bench_trace import (  # this folder
        check_workload,
        traced,
        untraced_runner,
        workload_arguments,
        workload_config,
    )

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_arguments(p)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    check_workload(p, args)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, but got {args.rounds}")
    from ulptrace import concurrent

    cfg = workload_config(args, oracle=False)
    modes = {"sequential": cfg, "concurrent": replace(cfg, concurrent=True)}
    for mode in modes.values():  # cold runs: compilation, the reference process started and kept
        traced(mode, None, "cold")
    run = untraced_runner(cfg)
    onsets: dict[str, list[float]] = {name: [] for name in modes}
    after: dict[str, list[float]] = {name: [] for name in modes}  # the untraced run right after each onset
    for _ in range(args.rounds):
        for name, mode in modes.items():
            onsets[name].append(traced(mode, None, name)[0])
            after[name].append(run())
    concurrent.shutdown()
    base = min(t for times in after.values() for t in times)
    out = {"workload": vars(args), "onset_s": onsets, "untraced_after_s": after, "base_s": base}
    print(f"base (least untraced run of all): {base:.3f} s", flush=True)
    for name in modes:
        paired = statistics.median(o / u for o, u in zip(onsets[name], after[name], strict=True))
        out[name] = {"least_s": min(onsets[name]), "ratio": min(onsets[name]) / base, "paired_median": paired,
                     "untraced_after_median_s": statistics.median(after[name])}
        print(f"{name:>10}: least {min(onsets[name]):.3f} s = {min(onsets[name]) / base:.2f}x the base; paired median "
              f"{paired:.2f}x; untraced runs after it: median {statistics.median(after[name]):.3f} s "
              f"({', '.join(f'{t:.3f}' for t in after[name])})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
