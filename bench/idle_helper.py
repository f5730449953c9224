"""Does a kept reference process slow this process's untraced runs? P1 with ``--concurrent`` divides the onset by an
untraced pair timed in the same process, between the warm onsets, while the reference process is kept alive; if its
presence (or work it still finishes after an onset returns) slows those untraced runs, the ratio reads low (issue 11:
the base must be the same work as the untraced user's). Phases, each ``--repeats`` untraced pairs (the same prebuilt
models, ``bench_trace.untraced_runner``), in this order:

1. ``none``: no reference process;
2. ``after-onset``: each pair right after a concurrent onset (as ``bench_trace.py --concurrent`` interleaves them);
3. ``after-onset+2s``: the same, two seconds after the onset returned;
4. ``kept-idle``: the process kept, no onset in between;
5. ``none-again``: after ``ulptrace.concurrent.shutdown()``.

    python bench/idle_helper.py --device cuda --model qwen3.5-0.8b --repeats 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace


def main() -> None:
    from bench_trace import (  # this folder
        check_workload,
        untraced_runner,
        workload_arguments,
        workload_config,
    )

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_arguments(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    check_workload(p, args)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, but got {args.repeats}")
    from ulptrace import concurrent
    from ulptrace.probes.onset import run_onset

    cfg = workload_config(args, oracle=False)
    run = untraced_runner(cfg)
    onset_cfg = replace(cfg, concurrent=True)
    phases: dict[str, list[float]] = {}
    onsets: list[float] = []

    def onset() -> None:
        t0 = time.perf_counter()
        run_onset(onset_cfg)
        onsets.append(time.perf_counter() - t0)

    phases["none"] = [run() for _ in range(args.repeats)]
    onset()  # the reference process started (cold) and kept
    phases["after-onset"] = []
    phases["after-onset+2s"] = []
    for _ in range(args.repeats):
        onset()
        phases["after-onset"].append(run())
        onset()
        time.sleep(2.0)
        phases["after-onset+2s"].append(run())
    phases["kept-idle"] = [run() for _ in range(args.repeats)]
    concurrent.shutdown()
    phases["none-again"] = [run() for _ in range(args.repeats)]
    out = {"workload": vars(args), "untraced_pair_s": phases, "onset_s": onsets}
    for name, times in phases.items():
        print(f"{name:>15}: least {min(times):.3f} s, median {statistics.median(times):.3f} s "
              f"({', '.join(f'{t:.3f}' for t in times)})", flush=True)
    warm = onsets[1:]
    print(f"{'onsets (warm)':>15}: least {min(warm):.3f} s, median {statistics.median(warm):.3f} s; "
          f"cold {onsets[0]:.3f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
