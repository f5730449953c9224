"""Where P1's time goes: the streaming onset split into layers, each timed without a profiler on the same prebuilt
models (issue 11: "where a goal is not reached, say what bounds it — measure it").

1. ``untraced``: the reference generation and the candidate's forced generation, no recorder;
1a. ``dispatch``: both runs with recorders whose observations are dropped as they arrive (hook dispatch and the
   hooks' reading of arguments only: no copy, no record);
1b. ``clones``: the same, each needed observed value copied as the recorder copies it (once per tensor while it is
   unchanged) and dropped: the copies without records or buffers — the floor of a design that copies observations;
2. ``hooks-no-copy``: both runs with recorders whose sink drops every record, observed tensors not copied (hook
   dispatch, the recorder's own work, records made) — a diagnostic layer, not a usable mode;
3. ``hooks``: the same with the copies (one per observed tensor while it is unchanged);
3a. ``reference``: the reference recorded and kept as ``run_onset`` keeps it (``MemorySink(device="auto")``, the
   recording collector held), the candidate's generation untraced: ``onset`` less this is what the candidate's side
   costs (its recorder and the streaming comparison);
4. ``bookkeeping``: ``run_onset`` without the oracle, with the statistics replaced by a constant (reference kept,
   records aligned, comparisons started and finished, no statistics computed);
5. ``onset``: ``run_onset`` as it is.

``--layers`` times some of them (with ``untraced``, the base); ``--flush-every N ...`` adds the onset with its
statistics read back every N records (``onset/N``: each read-back waits for the device, so it measures what those
waits cost). Each is the minimum of ``--repeats`` runs, interleaved (and, beside it, the median over the rounds of
each round's ratio to its own untraced run); the garbage collector's time in each layer's runs (and how
many of its collections were full ones) is reported too. The differences between the layers are what each adds.

    python bench/bench_p1_parts.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Drop:
    def add(self, record) -> None:
        pass


LAYERS = ("untraced", "dispatch", "clones", "hooks-no-copy", "hooks", "reference", "bookkeeping", "onset")


def timed(run, device: str) -> float:
    """Seconds of one ``run()`` (the device synchronised before and after). Its own function, so that a sampling
    profiler's stacks tell the timed runs from the warm-up: ``bench/spy_summary.py --root timed``."""
    _sync(device)
    t0 = time.perf_counter()
    run()
    _sync(device)
    return time.perf_counter() - t0


def main() -> None:
    from bench_trace import (  # this folder: run as python bench/bench_p1_parts.py
        check_workload,
        workload_arguments,
        workload_config,
    )
    from ulptrace import comparison
    from ulptrace.paths import apply_path
    from ulptrace.probes import onset
    from ulptrace.record import MemorySink, Recorder, recording_collector
    from ulptrace.run import build_pair, greedy, selected_sites
    from ulptrace.ulp import PendingStats, RecordStats

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_arguments(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", nargs="+", metavar="LAYER", default=list(LAYERS),
                   help=f"the layers to time (default: all; 'untraced' is always timed, the ratios' base): {', '.join(LAYERS)}")
    p.add_argument("--flush-every", type=int, nargs="+", default=[], metavar="N",
                   help="also time the onset with the streaming comparison reading its statistics back every N records "
                        "(StreamingComparator.BATCH; each read waits for the device), one layer 'onset/N' per value")
    p.add_argument("--json")
    args = p.parse_args()
    check_workload(p, args)
    unknown = [name for name in args.layers if name not in LAYERS]
    if unknown:
        p.error(f"--layers takes {', '.join(LAYERS)}, but got {', '.join(unknown)}")
    if any(n < 1 for n in args.flush_every):
        p.error(f"--flush-every takes record counts >= 1, but got {args.flush_every}")
    if set(args.layers) <= {"untraced"} and not args.flush_every:
        p.error(f"--layers names only the base 'untraced': name a layer to time against it ({', '.join(LAYERS[1:])})")
    cfg = workload_config(args, oracle=False)
    built = build_pair(cfg)
    ref, cand, prompts = built
    onset.build_pair = lambda c, **kw: built  # every layer runs on the same two models

    def untraced() -> None:
        with apply_path(ref, cfg.reference), apply_path(cand, cfg.candidate):
            tokens = greedy(ref, prompts, cfg.new_tokens)
            greedy(cand, prompts, cfg.new_tokens, forced=tokens)

    def hooks() -> None:
        with apply_path(ref, cfg.reference), apply_path(cand, cfg.candidate):
            with Recorder(ref, sites=selected_sites(ref, cfg), sink=_Drop()):
                tokens = greedy(ref, prompts, cfg.new_tokens)
            with Recorder(cand, sites=selected_sites(cand, cfg), sink=_Drop()):
                greedy(cand, prompts, cfg.new_tokens, forced=tokens)

    from ulptrace import record

    real_copy = record._copy
    real_observe = Recorder._observe

    def observing(observe) -> None:  # the bench swaps the recorder's per-observation work
        Recorder._observe = observe
        try:
            hooks()
        finally:
            Recorder._observe = real_observe

    def dispatch() -> None:
        observing(lambda self, path, values, outputs=False: None)

    def clone_needed(self, path, values, outputs=False) -> None:
        self._serial += 1
        plan = self._plan.get(path, {})
        for at, value in values.items():
            if isinstance(value, torch.Tensor) and at in plan:  # not a value the recorder already holds a copy of
                self._copy_once(value, path if outputs else None)

    def clones() -> None:
        observing(clone_needed)

    def hooks_no_copy() -> None:
        record._copy = lambda t: t
        try:
            hooks()
        finally:
            record._copy = real_copy

    def reference() -> None:
        with recording_collector(), apply_path(ref, cfg.reference), apply_path(cand, cfg.candidate):
            with Recorder(ref, sites=selected_sites(ref, cfg), sink=MemorySink(device="auto")):
                tokens = greedy(ref, prompts, cfg.new_tokens)
            greedy(cand, prompts, cfg.new_tokens, forced=tokens)

    constant = RecordStats(True, 0, 0, {}, 0.0, {})
    real_stats = comparison.pending_stats

    def bookkeeping() -> None:
        comparison.pending_stats = lambda a, b, **kw: PendingStats(constant)
        try:
            onset.run_onset(cfg)
        finally:
            comparison.pending_stats = real_stats

    def full() -> None:
        onset.run_onset(cfg)

    every = {"untraced": untraced, "dispatch": dispatch, "clones": clones, "hooks-no-copy": hooks_no_copy, "hooks": hooks,
             "reference": reference, "bookkeeping": bookkeeping, "onset": full}
    assert tuple(every) == LAYERS
    layers = {name: run for name, run in every.items() if name == "untraced" or name in args.layers}

    def flushing(n: int):
        def run() -> None:
            batch = comparison.StreamingComparator.BATCH
            comparison.StreamingComparator.BATCH = n
            try:
                onset.run_onset(cfg)
            finally:
                comparison.StreamingComparator.BATCH = batch
        return run

    layers.update({f"onset/{n}": flushing(n) for n in args.flush_every})
    for run in layers.values():  # warm-up: lazy initialisation, kernel compilation
        run()
    times: dict[str, list[float]] = {name: [] for name in layers}
    collected: dict[str, list[float]] = {name: [0.0, 0] for name in layers}  # seconds, full collections (all runs)
    current, started = [""], [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        collected[current[0]][0] += time.perf_counter() - started[0]
        collected[current[0]][1] += info["generation"] == 2

    gc.callbacks.append(on_gc)
    try:
        for _ in range(args.repeats):
            for name, run in layers.items():
                current[0] = name
                times[name].append(timed(run, args.device))
    finally:
        gc.callbacks.remove(on_gc)
    best = {name: min(t) for name, t in times.items()}
    base = best["untraced"]
    # each round runs every layer once, the untraced base first: a layer's time over its round's base, the median of
    # the rounds — robust to a host whose speed drifts over minutes, which the least of all runs is not
    per_round = {name: statistics.median(t / u for t, u in zip(times[name], times["untraced"])) for name in times}
    out = {"device": args.device, "model": args.model, "torch": torch.__version__, "repeats": args.repeats,
           "seconds": best, "ratio": {name: t / base for name, t in best.items()}, "ratio_per_round": per_round,
           "all_seconds": times,
           "gc_s": {name: c[0] for name, c in collected.items()},
           "full_collections": {name: c[1] for name, c in collected.items()}}
    for name, t in best.items():
        print(f"{name:14s} {t:7.3f} s  {t / base:5.2f}x  (median of rounds {per_round[name]:5.2f}x; garbage collection "
              f"in {args.repeats} runs: {collected[name][0]:.3f} s, {collected[name][1]} full)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
