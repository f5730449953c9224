"""Where a warm P3 onset's time goes (issue 11): ``run_onset`` with the oracle on P3's workload, run once to warm up,
then timed, then under cProfile; prints the wall time and the functions of ulptrace with the largest cumulative time.

    python bench/profile_p3.py --device cuda --model qwen3.5-0.8b --out profile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main() -> None:
    from bench_trace import check_workload, workload_arguments  # this folder (bench/)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(p, prompts=2, prompt_len=32, new_tokens=4)
    p.add_argument("--top", type=int, default=60)
    p.add_argument("--out")
    args = p.parse_args()
    from bench_trace import workload_config
    from ulptrace.probes.onset import run_onset

    check_workload(p, args)
    if args.top < 1:
        p.error(f"--top must be >= 1, but got {args.top}")
    cfg = workload_config(args)
    try:
        run_onset(cfg)
    except KeyError as exc:  # a path that names nothing in this model (a fault's site)
        p.error(str(exc.args[0] if exc.args else exc))
    start = time.perf_counter()
    run_onset(cfg)
    warm = time.perf_counter() - start
    profile = cProfile.Profile()
    profile.enable()
    run_onset(cfg)
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(r"ulptrace|tracer|probes", args.top)
    stats.sort_stats("tottime").print_stats(25)
    report = f"warm P3 onset (builds included) {warm:.2f} s on {args.device} ({args.model})\n{text.getvalue()}"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
