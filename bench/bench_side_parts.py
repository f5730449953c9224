"""One side of an onset, traced, split into the time spent inside the recorder's hooks and the time left outside them
(issue 11, P1: each side traced takes ~2-2.4x its untraced run; a sampling profile of the reference's process put
only ~30% of its samples in ulptrace's own frames — where is the rest?).

For each side (the reference on its path, the candidate on its own, forced to the reference's tokens), in one
process, on prebuilt models, interleaved over ``--repeats`` rounds:

- ``untraced``: the generation alone;
- ``dispatch``: a recorder whose per-observation work is dropped (hooks and taps fire, read their arguments);
- ``drop``: the recorder as it is, its records dropped by the sink;
- ``keep``: the recorder as it is, its records kept as the sequential onset keeps the reference's
  (``MemorySink(device="auto")``).

Every hook, tap observer and step hook of the recorder is wrapped with a timer, so each traced layer reports its wall
time, the seconds spent inside the recorder's functions (``in_hooks``) and the hooks' calls; ``outside`` = wall -
untraced - in_hooks is what tracing adds outside the recorder's own code (torch's hook dispatch, and the model's own
code running slower beside the recorder: caches, the allocator, waits on the device). The timers' own cost is
measured (an empty wrapped function) and reported. ``--syncs`` also runs each side once untraced and once ``keep``
under ``torch.cuda.set_sync_debug_mode("warn")`` and counts the host synchronisations by the innermost frame outside
torch (where the host waits for the device).

    python bench/bench_side_parts.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import traceback
import warnings
from collections import Counter

import torch

LAYERS = ("untraced", "dispatch", "drop", "keep")
_WRAPPED_FACTORIES = ("_pre_hook", "_post_hook", "_conv_inputs", "_gdn_enter")  # methods returning a hook
_WRAPPED_METHODS = ("_on_step", "_on_conv", "_gdn_inputs", "_on_gdn", "_attention_inputs", "_on_attention",
                    "_gdn_exit")


class _Drop:
    def add(self, record) -> None:
        pass


class HookTimer:
    """Seconds spent inside the recorder's hook functions and how many calls (the wrapped class is restored by
    ``close``)."""

    def __init__(self, recorder_class) -> None:
        self.seconds, self.calls = 0.0, 0
        self._class, self._saved = recorder_class, {}
        for name in _WRAPPED_FACTORIES:
            factory = self._saved[name] = getattr(recorder_class, name)
            setattr(recorder_class, name, self._factory(factory))
        for name in _WRAPPED_METHODS:
            method = self._saved[name] = getattr(recorder_class, name)
            setattr(recorder_class, name, self._timed(method))

    def _timed(self, f):
        perf = time.perf_counter

        @functools.wraps(f)
        def timed(*args, **kwargs):
            start = perf()
            try:
                return f(*args, **kwargs)
            finally:
                self.seconds += perf() - start
                self.calls += 1

        return timed

    def _factory(self, factory):
        return lambda recorder, *args: self._timed(factory(recorder, *args))

    def overhead_s(self, n: int = 200_000) -> float:
        """Seconds one wrapped call of an empty function costs beyond the call itself."""
        def empty() -> None:
            pass

        wrapped = self._timed(empty)
        seconds, calls = self.seconds, self.calls
        start = time.perf_counter()
        for _ in range(n):
            empty()
        bare = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(n):
            wrapped()
        timed = time.perf_counter() - start
        self.seconds, self.calls = seconds, calls
        return max(0.0, (timed - bare) / n)

    def close(self) -> None:
        for name, f in self._saved.items():
            setattr(self._class, name, f)


def _where(stack: list[traceback.FrameSummary], depth: int = 2) -> str:
    """The innermost ``depth`` frames outside torch's own files and the benchmarks' (and the warning capture): where a
    sync was asked, and by whom."""
    found = []
    for frame in reversed(stack):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and "/warnings.py" not in name and "/bench/" not in name \
                and not name.endswith(("bench_side_parts.py", "bench_trace.py")):
            found.append(f"{'/'.join(name.split('/')[-2:])}:{frame.lineno} {frame.name}")
            if len(found) == depth:
                break
    return " <- ".join(found) or "?"


def count_syncs(run) -> Counter:
    """Host synchronisations ``run()`` makes on the CUDA device, by where they were asked."""
    seen: Counter = Counter()
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():
            seen[_where(traceback.extract_stack())] += 1
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = original
    return seen


def main() -> None:
    from bench_p1_parts import timed as timed_run  # this folder
    from bench_trace import check_workload, workload_arguments, workload_config
    from ulptrace.paths import apply_path
    from ulptrace.record import MemorySink, Recorder, recording_collector
    from ulptrace.run import build_pair, greedy, selected_sites

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_arguments(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--syncs", action="store_true", help="count host synchronisations (CUDA only)")
    p.add_argument("--json")
    args = p.parse_args()
    check_workload(p, args)
    if args.syncs and not args.device.startswith("cuda"):
        p.error(f"--syncs counts CUDA synchronisations: it needs a CUDA --device, but got {args.device!r}")
    cfg = workload_config(args, oracle=False)
    ref, cand, prompts = build_pair(cfg)
    with apply_path(ref, cfg.reference):
        tokens = greedy(ref, prompts, cfg.new_tokens)
    sides = {"reference": (ref, cfg.reference, None), "candidate": (cand, cfg.candidate, tokens)}
    timer = HookTimer(Recorder)
    real_observe = Recorder._observe

    def generation(side: str, layer: str) -> None:
        model, path, forced = sides[side]
        with recording_collector(), apply_path(model, path):
            if layer == "untraced":
                greedy(model, prompts, cfg.new_tokens, forced=forced)
                return
            sink = MemorySink(device="auto") if layer == "keep" else _Drop()
            if layer == "dispatch":
                Recorder._observe = lambda self, path, values, outputs=False: None
            try:
                with Recorder(model, sites=selected_sites(model, cfg), sink=sink):
                    greedy(model, prompts, cfg.new_tokens, forced=forced)
            finally:
                Recorder._observe = real_observe

    def timed(side: str, layer: str) -> tuple[float, float, int]:
        timer.seconds, timer.calls = 0.0, 0
        wall = timed_run(functools.partial(generation, side, layer), args.device)
        return wall, timer.seconds, timer.calls

    try:
        for side in sides:  # warm-up
            for layer in LAYERS:
                timed(side, layer)
        runs = {(side, layer): [] for side in sides for layer in LAYERS}
        for _ in range(args.repeats):
            for key, times in runs.items():
                times.append(timed(*key))
        per_call = timer.overhead_s()
        syncs = {}
        if args.syncs:
            for side in sides:
                for layer in ("untraced", "keep"):
                    syncs[f"{side}/{layer}"] = dict(count_syncs(functools.partial(generation, side, layer)).most_common())
    finally:
        timer.close()
    result = {"workload": vars(args), "timer_overhead_us": per_call * 1e6, "sides": {}, "syncs": syncs}
    print(f"{cfg.model} on {args.device}, {args.prompts} x {args.prompt_len}, {args.new_tokens} steps; least of "
          f"{args.repeats}; the timer's own cost {per_call * 1e6:.2f} us a call (subtracted from in_hooks)")
    for side in sides:
        base = min(w for w, _, _ in runs[(side, "untraced")])
        rows = {}
        print(f"{side}: untraced {base:.3f} s")
        for layer in LAYERS[1:]:
            wall, inside, calls = min(runs[(side, layer)])
            inside = max(0.0, inside - calls * per_call)
            outside = wall - base - inside
            rows[layer] = {"wall_s": wall, "ratio": wall / base, "in_hooks_s": inside, "calls": calls,
                           "outside_s": outside, "median_ratio": statistics.median(w for w, _, _ in runs[(side, layer)]) / base}
            print(f"  {layer:9s} {wall:.3f} s ({wall / base:.2f}x)  in hooks {inside:.3f} s  outside {outside:.3f} s "
                  f"({outside / max(calls, 1) * 1e6:.1f} us a hook call, {calls} calls)")
        result["sides"][side] = {"untraced_s": base, "layers": rows}
    for key, where in syncs.items():
        print(f"syncs {key}: {sum(where.values())}")
        for place, n in list(where.items())[:12]:
            print(f"    {n:6d}  {place}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
