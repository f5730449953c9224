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

A host whose speed drifts over minutes reads as a phase's effect in that order; ``--rounds N`` alternates instead:
each round times ``none`` (no reference process), starts one (a cold and a warm onset), times ``kept-idle`` and
shuts it down, and reports each round's ratio. It also reads, over each ``kept-idle`` phase, the CPU seconds the
helper processes used (``/proc``: a helper that works while idle takes the host from this one) and the threads this
process has (one left behind by an onset takes the GIL in turns with the run).

    python bench/idle_helper.py --device cuda --model qwen3.5-0.8b --repeats 5 [--rounds 3] [--json out.json]
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
    p.add_argument("--rounds", type=int, default=0, help="alternate none / kept-idle N times instead of the phases")
    p.add_argument("--json")
    args = p.parse_args()
    check_workload(p, args)
    if args.rounds < 0:
        p.error(f"--rounds must be >= 0 (0: the phases in order), but got {args.rounds}")
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

    if args.rounds > 0:
        alternate(args, run, onset, onsets)
        return
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


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used (``/proc``, Linux)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def alternate(args, run, onset, onsets: list[float]) -> None:
    """``--rounds``: none / kept-idle alternating, each round's ratio, what the helpers and this process ran
    meanwhile."""
    import multiprocessing
    import os
    import threading

    from ulptrace import concurrent

    rounds = []
    for index in range(args.rounds):
        none = [run() for _ in range(args.repeats)]
        threads_before = sorted(t.name for t in threading.enumerate())
        onset()
        onset()
        time.sleep(1.0)
        helpers = [child.pid for child in multiprocessing.active_children()]
        cpu0 = cpu_seconds(helpers)
        t0 = time.perf_counter()
        kept = [run() for _ in range(args.repeats)]
        wall = time.perf_counter() - t0
        helper_cpu = cpu_seconds(helpers) - cpu0
        threads = sorted(t.name for t in threading.enumerate())
        ratio = statistics.median(kept) / statistics.median(none)
        record = {"none_s": none, "kept_idle_s": kept, "ratio_of_medians": ratio,
                  "helper_pids": helpers, "helper_cpu_s_during_kept": helper_cpu, "kept_wall_s": wall,
                  "python_threads_before_onsets": threads_before, "python_threads_kept": threads,
                  "os_threads_kept": len(os.listdir("/proc/self/task"))}
        rounds.append(record)
        concurrent.shutdown()
        print(f"round {index}: none median {statistics.median(none):.3f} s, kept-idle median "
              f"{statistics.median(kept):.3f} s ({record['ratio_of_medians']:.2f}x); helpers {helpers} used "
              f"{helper_cpu:.2f} CPU s in {wall:.1f} s; python threads {len(threads_before)} -> {len(threads)} "
              f"({', '.join(t for t in threads if t not in threads_before) or 'none new'}), "
              f"OS threads {record['os_threads_kept']}", flush=True)
    ratios = [r["ratio_of_medians"] for r in rounds]
    print(f"kept-idle / none, per round: {', '.join(f'{r:.2f}x' for r in ratios)}; warm onsets median "
          f"{statistics.median(onsets[1::2]):.3f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": vars(args), "rounds": rounds, "onset_s": onsets}, f, indent=1)


if __name__ == "__main__":
    main()
