"""What tracing costs: the performance goals of issue 11 as ratios against baselines measured in the same run.

- P1: ``onset`` without the oracle (record the reference, stream the candidate against it) — wall time
  less model building — over the two untraced generations of the same work;
- P2: ULP statistics (distance + histogram + differing count + max) of two large BF16 tensors that differ,
  as a share of a plain copy's bandwidth on the same device;
- P3: ``onset`` with the oracle over its two untraced generations (2 x 32 tokens, 4 steps, the GPU goal's work; the
  issue's CPU figure with the oracle is P1's work: ``--oracle-prompts 8 --oracle-prompt-len 128 --oracle-new-tokens 16``);
- P5: peak memory of the traced onset over the untraced pair (GPU: allocator peak; CPU: not measured).

P1 is measured cold (the first traced run pays one-time costs such as Triton's compilation of the statistics
kernel, cached on disk for later processes) and warm: the least of ``--warm-repeats`` later runs of the same work
(default 3), each followed by an untraced run of the pair on prebuilt models, whose least (of those and two before)
is the base: interleaved, so that a host slowing for a while slows both sides (before the eighth round the untraced
pair was the least of 3 runs made before any traced one; before 2026-12-02 the warm figure was a single run);
``--profile FILE`` writes cProfile's top functions of a third run (profiled runs are not timed: the profiler
slows Python-heavy code). ``bench/bench_p1_parts.py`` splits P1 into its layers. ``--goals`` measures some goals
only (P5 reads P1's first traced run); ``--reference-memory`` is onset's (where the reference's records wait: P5 at
a long prompt is measured with ``host``, as ``auto`` keeps them on the GPU while half of it is free);
``--concurrent`` runs the traced onsets with ``onset --concurrent`` (the reference in a process of its own, kept
between onsets: the warm runs reuse it), timed from when both sides were ready, and says how long this process waited
for the other's start-up beyond its own build; ``--concurrent auto`` as the command's default does (the reference kept
here, the onset started again that way once its records are forecast to outgrow half the GPU, or have): P5 is then
the larger of the peak before the switch and this process's peak after it plus the reference process's.

``--reports DIR`` also writes the JSON report of each onset (volatile fields — versions, devices,
timings — removed), so two commits can be checked for identical verdicts, statistics and onsets
(``--reports-only``: just those two onsets, e.g. run with an older commit's package on ``PYTHONPATH``, see
``bench/gpu_p1.sh``):

    python bench/bench_trace.py --device cpu --model tiny-qwen3.5 --prompts 8 --prompt-len 128 --new-tokens 16
    python bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

# what says when, where and how the run went rather than what it found (a mode's own run info included: the reference's
# process, judging processes, a reference spilled to host memory or switched to its own process)
VOLATILE = ("versions", "device", "path_info", "observation", "reference_process", "judging_processes",
            "reference_spilled", "switched_to_concurrent", "timeline", "concurrent_from_start")
GOALS = ("P1", "P2", "P3", "P5")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _clean(data: object) -> object:
    if isinstance(data, dict):
        return {k: _clean(v) for k, v in data.items() if k not in VOLATILE}
    if isinstance(data, list):
        return [_clean(v) for v in data]
    return data


def differences(a, b, path: str = "", out: list[str] | None = None, limit: int = 12) -> list[str]:
    """The first ``limit`` fields in which two reports (``_clean``ed JSON) differ, by path; [] when equal (a NaN
    equals itself here, as in the report's text)."""
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'first' if k in a else 'second'}")
            else:
                differences(a[k], b[k], f"{path}.{k}", out, limit)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            differences(x, y, f"{path}[{i}]", out, limit)
    elif json.dumps(a) != json.dumps(b):
        out.append(f"{path}: {str(a)[:160]} != {str(b)[:160]}")
    return out


def untraced_runner(cfg):
    """A function timing one run of the reference generation and the forced candidate generation, untraced, on
    models built once here (prebuilt: the builds are not timed), with a whole warm-up run done first (a first run
    of a shape pays one-time costs — allocator growth, library handles — that a traced run measured later in the
    process no longer pays). Timing its runs between the traced ones (interleaved) lets both sides see the same
    state of the host: a host that slows for a while slows both, not only the one measured then."""
    from ulptrace.paths import apply_path
    from ulptrace.run import build_pair, greedy

    ref, cand, prompts = build_pair(cfg)

    def run() -> float:
        with apply_path(ref, cfg.reference), apply_path(cand, cfg.candidate):
            _sync(cfg.device)
            t0 = time.perf_counter()
            tokens = greedy(ref, prompts, cfg.new_tokens)
            greedy(cand, prompts, cfg.new_tokens, forced=tokens)
            _sync(cfg.device)
            return time.perf_counter() - t0

    run()
    return run


def untraced_side_by_side_peak(cfg) -> int:
    """Peak bytes of the untraced pair run as ``--concurrent`` runs it, each side in a process of its own, summed as
    the concurrent onset's peaks are: both models, plus each side's run's own peak above them (measured one run
    at a time here: the two processes' peaks, summed)."""
    from ulptrace.paths import apply_path
    from ulptrace.run import build_pair, greedy

    ref, cand, prompts = build_pair(cfg)
    with apply_path(ref, cfg.reference), apply_path(cand, cfg.candidate):
        tokens = greedy(ref, prompts, cfg.new_tokens)  # warm-up, as untraced_runner's
        greedy(cand, prompts, cfg.new_tokens, forced=tokens)
        _sync(cfg.device)
        base = torch.cuda.memory_allocated()  # both models (and the prompts)
        above = []
        for run in (lambda: greedy(ref, prompts, cfg.new_tokens),
                    lambda: greedy(cand, prompts, cfg.new_tokens, forced=tokens)):
            torch.cuda.reset_peak_memory_stats()
            run()
            _sync(cfg.device)
            above.append(torch.cuda.max_memory_allocated() - base)
    return base + sum(above)


def untraced_pair(cfg, repeats: int = 3) -> float:
    """Seconds for the untraced pair (:func:`untraced_runner`): the least of ``repeats`` runs after the warm-up."""
    run = untraced_runner(cfg)
    return min(run() for _ in range(repeats))


def message_timeline(messages: dict) -> str:
    """A concurrent onset's ``messages`` (``RemoteTrace.finish``) in one line: for each step, seconds from the
    reference's run start when the reference handed its last message of the step on, when this side asked for the
    step's token (its step done) and when it had it."""
    nan = float("nan")
    sent = {step: handed for step, _, handed in messages["sent"]}  # a step's last part: its last message
    asked = {step: (at, had) for step, at, had in messages["asked"]}
    last = messages["received"][-1][2] if messages["received"] else nan
    steps = " ".join(f"{s}:{sent.get(s, nan):.3f}/{asked.get(s, (nan, nan))[0]:.3f}/{asked.get(s, (nan, nan))[1]:.3f}"
                     for s in sorted(sent.keys() | asked.keys()))
    return (f"this side built at {messages['candidate_built']:.3f}, the onset ended at {messages['ended']:.3f}; "
            f"steps (reference sent / candidate asked / had): {steps}; reference done at {last:.3f}")


def traced(cfg, reports: Path | None, name: str, profile: str | None = None) -> tuple[float, int, dict]:
    """(seconds of run_onset less its two model builds, peak allocated bytes on CUDA or 0, about a concurrent run).

    The builds are timed where run_onset makes them (its ``build_pair``, wrapped here, the device synchronised
    after it), not estimated from other builds: drawing the weights takes longer than the run itself and varies
    by seconds from build to build. ``cfg.concurrent`` (the reference in a process of its own, built there while
    this process builds the candidate): the run is timed from when both sides were ready (the later of the two
    builds' ends; ``time.perf_counter`` is one clock for all processes on Linux) to its end; the third value says
    how long this process waited for the other beyond its own build (its start-up: imports and build), the other's
    peak GPU memory, and the peak is both processes' peaks summed (an upper bound of what they held at once)."""
    import ulptrace.probes.onset as onset_module

    run_onset = onset_module.run_onset
    build_pair = onset_module.build_pair
    builds: list[float] = []
    built_at: list[float] = []

    def timed_build_pair(c, **kw):
        t = time.perf_counter()
        built = build_pair(c, **kw)
        _sync(cfg.device)
        built_at.append(time.perf_counter())
        builds.append(built_at[-1] - t)
        return built

    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before_switch: list[int] = []  # concurrent="auto": this process's peak when the onset started again
    run_concurrent = getattr(onset_module, "_run_concurrent", None)  # an older commit's package may lack it

    def switching(*a, **kw):
        if cfg.device.startswith("cuda"):
            before_switch.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        return run_concurrent(*a, **kw)

    if getattr(cfg, "concurrent", False) == "auto":  # (an older commit's package has no such field)
        onset_module._run_concurrent = switching
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    onset_module.build_pair = timed_build_pair
    try:
        t0 = time.perf_counter()
        comparison, info = run_onset(cfg)
        _sync(cfg.device)
        t1 = time.perf_counter()
        seconds = t1 - t0
    finally:
        onset_module.build_pair = build_pair
        if run_concurrent is not None:
            onset_module._run_concurrent = run_concurrent
    build = sum(builds)
    seconds -= build
    concurrent: dict = {}
    process = info.get("reference_process")
    if process is not None:
        # (a split run's candidate process too: the later of all builds' ends)
        ready = max(built_at[-1], process["built_at"], info.get("candidate_process", {}).get("built_at", 0.0))
        seconds = t1 - ready
        start = process["start_up"]  # the reference process's start-up, from when it was started (first run)
        concurrent = {"waited_for_reference_s": max(0.0, process["built_at"] - built_at[-1]),
                      "reference_peak_bytes": process["peak_gpu_bytes"] or 0,
                      # a split onset's candidate process (concurrent="split"): its peak counts too
                      "candidate_peak_bytes": (info.get("candidate_process") or {}).get("peak_gpu_bytes") or 0,
                      # the most bytes each side process had shipped and this one not let go (an older package: None)
                      "most_in_flight_bytes": {role: (info.get(f"{role}_process") or {}).get("most_in_flight_bytes")
                                               for role in ("reference", "candidate")},
                      "reference_start_up_s": {k.removesuffix("_at"): v - start["spawned_at"] for k, v in start.items()
                                               if k.endswith("_at") and k != "spawned_at"},
                      "reference_model_shipped": start.get("model_shipped"),
                      "candidate_built_s": built_at[-1] - start["spawned_at"],
                      "seconds": process.get("seconds"),
                      # the reference run's start, this side's build's end and the onset's end, on the messages' clock
                      "messages": process.get("messages") and {
                          **process["messages"], "candidate_built": built_at[-1] - process["messages"]["began_at"],
                          "ended": t1 - process["messages"]["began_at"]},
                      "switched_to_concurrent": info.get("switched_to_concurrent"),
                      "concurrent_from_start": info.get("concurrent_from_start"),
                      "peak_before_switch_bytes": before_switch[0] if before_switch else None}
    if prof is not None:
        import io
        import pstats
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        Path(profile).write_text(f"run_onset {seconds:.2f} s less builds {build:.2f} s\n" + text.getvalue())
    peak = torch.cuda.max_memory_allocated() if cfg.device.startswith("cuda") else 0
    peak += concurrent.get("reference_peak_bytes", 0) + concurrent.get("candidate_peak_bytes", 0)
    if before_switch:  # the stopped sequential run's peak came before the reference process's
        peak = max(peak, before_switch[0])
    if reports is not None:
        data = comparison.to_json()
        data["run"] = {k: v for k, v in info.items() if "tokens" in k or k == "first_token_flip"}
        (reports / f"{name}.json").write_text(json.dumps(_clean(data), indent=1, sort_keys=True))
    return seconds, peak, concurrent


def as_the_commands() -> str:
    """This process's host memory kept for reuse as the console scripts keep theirs (``ulptrace.host_memory``), so that
    what a benchmark times in one process is what a command does; one line saying what holds (an older commit's
    package, run for its reports, may lack the module)."""
    try:
        from ulptrace.host_memory import keep_freed_memory
    except ImportError:
        return "as the process started (ulptrace.host_memory not in this package)"
    return keep_freed_memory()


def where_kept(concurrent: str | None, process: dict) -> str:
    """Where P5's onset kept the reference's records, in words."""
    if not process:
        return "kept in this process" + (" (the command's default: no switch)" if concurrent == "auto" else "")
    switched = process.get("switched_to_concurrent")
    if switched is None:
        if process.get("candidate_peak_bytes"):
            return "in its own process, the candidate in another (the three processes' peaks summed)"
        return "in its own process" + (" (the command's default: from the start)" if process.get(
            "concurrent_from_start") else "") + " (both peaks summed)"
    before = process["peak_before_switch_bytes"] or 0
    return (f"the command's default: switched at step {switched['step']}, {switched['site']}, with "
            f"{switched['kept_on_device_bytes'] / 2**30:.2f} GiB kept; peak {before / 2**30:.2f} GiB before the "
            "switch, after it both processes' peaks summed")


def stats_bandwidth(device: str, mib: int) -> dict[str, float]:
    """GB/s of the ULP statistics on two differing BF16 tensors vs a plain copy of the same bytes (each the least of
    10 calls: a single call of a millisecond varied by 1.5x between device calls)."""
    from ulptrace.ulp import ulp_stats

    n = mib * 2**20 // 2
    a = torch.randn(n, device=device).bfloat16()
    b = (a.float() * (1 + 2**-7 * torch.randn(n, device=device))).bfloat16()

    def best(fn) -> float:  # the least of 10 timed calls after one untimed (a call is ~1 ms on a GPU)
        fn()
        _sync(device)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return min(times)

    t_stats = best(lambda: ulp_stats(a, b))
    t_copy = best(a.clone)
    read = 2 * a.numel() * a.element_size() / 1e9
    return {"stats_GBps": read / t_stats, "copy_GBps": 2 * a.numel() * a.element_size() / 1e9 / t_copy,
            "share_of_copy": (read / t_stats) / (2 * a.numel() * a.element_size() / 1e9 / t_copy)}


def workload_arguments(p: argparse.ArgumentParser, prompts: int = 8, prompt_len: int = 128, new_tokens: int = 16
                       ) -> None:
    """The traced work the benchmarks of tracing take (P1's by default; the oracle's and the diagnostic scripts'
    smaller): device, model, candidate path, prompts, prompt length, decode steps — checked by ``check_workload``."""
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny-qwen3.5")
    p.add_argument("--candidate", default="kernels:fused")
    p.add_argument("--prompts", type=int, default=prompts)
    p.add_argument("--prompt-len", type=int, default=prompt_len)
    p.add_argument("--new-tokens", type=int, default=new_tokens)
    p.add_argument("--sdpa", default="default", help="torch's attention backend pinned on both models (ulptrace.sdpa)")


def check_workload(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a workload that names nothing or cannot run, with one line (``p.error``), before any model is built:
    an unknown model or path, a device or count the run layer rejects, a script's ``--repeats`` below 1. Then this
    process keeps host memory as the commands do (:func:`as_the_commands`): what the script times is theirs."""
    from ulptrace.models import check_model
    from ulptrace.paths import resolve_path

    try:
        check_model(args.model)
        resolve_path(args.candidate)
        workload_config(args).validate()
    except (KeyError, ValueError) as exc:
        p.error(str(exc.args[0] if exc.args else exc))
    if getattr(args, "repeats", 1) < 1:
        p.error(f"--repeats must be >= 1, but got {args.repeats}")
    as_the_commands()


def progress_printer() -> Any:
    """A function printing a message with the seconds since it was made, flushed at once: a benchmark cut off by a
    device call's time limit still says how far it came."""
    began = time.perf_counter()

    def say(what: str) -> None:
        print(f"[{time.perf_counter() - began:7.1f} s] {what}", flush=True)

    return say


def workload_config(args: argparse.Namespace, **fields: Any) -> Any:
    """The ``RunConfig`` of the workload ``args`` name (``workload_arguments``), with ``fields`` set too. ``--sdpa``
    is passed only when it names a backend: an older commit's package (run for its reports) lacks the field."""
    from ulptrace.run import RunConfig

    return RunConfig(model=args.model, candidate=args.candidate, device=args.device, prompts=args.prompts,
                     prompt_len=args.prompt_len, new_tokens=args.new_tokens, **sdpa_field(args), **fields)


def sdpa_field(args: argparse.Namespace) -> dict[str, str]:
    """``{"sdpa": ...}`` when ``--sdpa`` names a backend, else nothing (torch's choice, the field's default)."""
    return {} if args.sdpa == "default" else {"sdpa": args.sdpa}


def run_configs(args: argparse.Namespace) -> tuple[Any, Any]:
    """The ``RunConfig`` of P1's onsets (no oracle) and of P3's (the oracle's workload), every run option of ``args``
    in both. Fields left at their defaults are not passed: an older commit's package (``--reports-only``) lacks the
    newer ones."""
    run = {"reference_memory": args.reference_memory,
           **({"concurrent": {"on": True}.get(args.concurrent, args.concurrent)} if args.concurrent else {})}
    cfg = workload_config(args, oracle=False, **run)
    cfg3 = workload_config(args, **run, **({"judge_workers": args.judge_workers} if args.judge_workers else {}))
    return cfg, replace(cfg3, prompts=args.oracle_prompts, prompt_len=args.oracle_prompt_len,
                        new_tokens=args.oracle_new_tokens)


def arguments() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_arguments(p)
    p.add_argument("--oracle-prompts", type=int, default=2,
                   help="P3's prompts (with --oracle-prompt-len 128 --oracle-new-tokens 16 and 8 of them: the "
                        "issue's CPU figure with the oracle, on P1's workload)")
    p.add_argument("--oracle-prompt-len", type=int, default=32)
    p.add_argument("--oracle-new-tokens", type=int, default=4)
    p.add_argument("--stats-mib", type=int, default=64)
    p.add_argument("--reports", type=Path)
    p.add_argument("--reports-only", action="store_true",
                   help="only write the two onsets' reports (no timing): e.g. for a baseline commit's package")
    p.add_argument("--json")
    p.add_argument("--warm-repeats", type=int, default=3, help="warm traced P1 runs; the least is reported")
    p.add_argument("--profile", help="write cProfile's top functions of the warm P1 run to this file")
    p.add_argument("--goals", nargs="+", default=list(GOALS), metavar="GOAL",
                   help=f"the goals to measure (default all: {' '.join(GOALS)}); P5 reads P1's traced run")
    p.add_argument("--reference-memory", choices=("auto", "device", "host"), default="auto",
                   help="where the traced onsets keep the reference's records (onset's --reference-memory)")
    p.add_argument("--concurrent", nargs="?", const="on", choices=("on", "auto", "split"),
                   help="the traced onsets record the reference in a process of its own while the candidate runs "
                        "(onset's --concurrent; 'auto': as the command's default, switching to it once the "
                        "reference's records are forecast to outgrow their GPU share; 'split': both sides in "
                        "processes of their own, this one comparing only); the untraced base still runs "
                        "the pair one after the other, between concurrent onsets (on the H200 such runs were slower "
                        "in two of three calls, which idle_helper.py --rounds then traced to the host's drift, not "
                        "the kept process; modes_ab.py divides both modes by one base)")
    p.add_argument("--judge-workers", type=int, default=0, metavar="N",
                   help="P3's onsets judge in N processes of their own (onset's --judge-workers), kept between its runs")
    p.add_argument("--part-mib", type=int, metavar="MIB",
                   help="with --concurrent: the reference ships a step's records in parts of this size "
                        "(ulptrace.concurrent.PART_BYTES, default its own)")
    p.add_argument("--flight-mib", type=int, metavar="MIB",
                   help="with --concurrent: each side process ships more only while what it has in flight (shipped, "
                        "not let go here) stays within this (ulptrace.concurrent.FLIGHT_BYTES, default its own)")
    p.add_argument("--compare-nothing", action="store_true",
                   help="an experiment, not a measure of the tool: this side's streaming comparison only takes the "
                        "reference's records and drops them with its own (no statistics, an empty report) — what the "
                        "onset's wall would be if this side's comparison cost nothing (the reports are not written)")
    p.add_argument("--syncs", action="store_true",
                   help="after P1's timed runs, one more warm onset with this process's host synchronisations on the "
                        "CUDA device counted by where they were asked (torch.cuda.set_sync_debug_mode; not timed)")
    return p


def main() -> None:
    p = arguments()
    args = p.parse_args()
    check_workload(p, args)
    if args.syncs and (not args.device.startswith("cuda") or "P1" not in args.goals):
        p.error(f"--syncs counts CUDA synchronisations of a P1 onset: it needs a CUDA --device and --goals P1, but got "
                f"--device {args.device} --goals {' '.join(args.goals)}")
    if args.warm_repeats < 1:
        p.error(f"--warm-repeats must be >= 1, but got {args.warm_repeats}")
    if min(args.oracle_prompts, args.oracle_prompt_len, args.oracle_new_tokens) < 1:
        p.error(f"--oracle-prompts, --oracle-prompt-len and --oracle-new-tokens take counts >= 1, but got "
                f"{args.oracle_prompts}, {args.oracle_prompt_len} and {args.oracle_new_tokens}")
    if args.judge_workers < 0:
        p.error(f"--judge-workers must be >= 0 (0: judged in this process), but got {args.judge_workers}")
    for option, constant in (("part_mib", "PART_BYTES"), ("flight_mib", "FLIGHT_BYTES")):
        mib = getattr(args, option)
        if mib is None:
            continue
        flag = "--" + option.replace("_", "-")
        if mib < 1 or not args.concurrent:
            p.error(f"{flag} takes a size >= 1 with --concurrent, but got {mib}"
                    f"{'' if args.concurrent else ' without --concurrent'}")
        from ulptrace import concurrent

        setattr(concurrent, constant, mib << 20)  # read by ReferenceProcess.start, sent with each run
    if args.compare_nothing:
        if args.reports or args.reports_only:
            p.error("--compare-nothing makes empty reports: it takes no --reports")
        if args.goals != ["P1"]:  # P3 would judge nothing, P5 and P2 do not read the comparison
            p.error(f"--compare-nothing times P1's onsets only: it takes --goals P1, but got --goals "
                    f"{' '.join(args.goals)}")
        from ulptrace.comparison import StreamingComparator

        def add(self, record) -> None:  # the reference's record taken (its arenas let go) and dropped, as this one
            self._seen.add(record.key)
            if self.release:
                self.reference.pop(record.key)
            else:  # (a streamed reference waits for the record's step here, as the comparison does)
                self.reference.get(record.key)

        StreamingComparator.add = add
        print("experiment: this side's comparison replaced by dropping both records (--compare-nothing)", flush=True)
    unknown = [g for g in args.goals if g not in GOALS]
    if unknown:
        p.error(f"--goals takes {', '.join(GOALS)}, but got {', '.join(unknown)}")
    if args.reports:
        args.reports.mkdir(parents=True, exist_ok=True)
    host_malloc = as_the_commands()
    out: dict[str, object] = {"device": args.device, "model": args.model, "torch": torch.__version__,
                              "sdpa": args.sdpa, "host_malloc": host_malloc,
                              "reference_memory": args.reference_memory, "concurrent": args.concurrent,
                              "part_mib": args.part_mib, "flight_mib": args.flight_mib,
                              "compare_nothing": args.compare_nothing,
                              "judge_workers": args.judge_workers,
                              "workload": {"prompts": args.prompts, "prompt_len": args.prompt_len,
                                           "new_tokens": args.new_tokens},
                              "oracle_workload": {"prompts": args.oracle_prompts, "prompt_len": args.oracle_prompt_len,
                                                  "new_tokens": args.oracle_new_tokens}}
    print(f"host malloc: {host_malloc}", flush=True)
    cfg, cfg3 = run_configs(args)
    if args.reports_only:
        if not args.reports:
            p.error("--reports-only needs --reports DIR")
        traced(cfg, args.reports, "P1-no-oracle")
        traced(cfg3, args.reports, "P3-oracle")
        return
    goals = set(args.goals)
    pair = None
    if goals & {"P1", "P5"}:
        untraced_pair(cfg, repeats=1)  # the process warmed up as the traced run will find it (models freed after)
        gc.collect()
        seconds, peak, process = traced(cfg, args.reports, "P1-no-oracle")  # the first traced run: cold, P5's peak
    if "P1" in goals:
        run_untraced = untraced_runner(cfg)  # built after the cold run, so that its models are not in P5's peak
        pair_all = [run_untraced() for _ in range(2)]
        warm_all, waits, parts, timelines = [], [], [], []
        for _ in range(args.warm_repeats):  # interleaved with untraced runs: both sides see the host's same moods
            warm_s, _, warm_process = traced(cfg, None, "P1-warm")
            warm_all.append(warm_s)
            waits.append(warm_process.get("waited_for_reference_s"))
            parts.append(warm_process.get("seconds"))
            if warm_process.get("messages"):
                timelines.append(warm_process["messages"])
                print("P1 warm, " + message_timeline(warm_process["messages"]), flush=True)
            pair_all.append(run_untraced())
        warm, pair = min(warm_all), min(pair_all)
        # each warm run over the untraced run right after it, the median: robust to a host whose speed drifts over the
        # minutes of the benchmark (call 3 of RESULTS.md's ninth round: 0.94 -> 1.78 s untraced), which least-of is not
        paired = statistics.median(w / u for w, u in zip(warm_all, pair_all[2:]))
        del run_untraced
        if args.syncs:  # untimed: the warnings' stacks slow every synchronising call
            from bench_side_parts import count_syncs  # this folder

            where = count_syncs(lambda: traced(cfg, None, "P1-syncs"))
            out["P1_syncs"] = dict(where.most_common())
            print(f"P1 syncs of this process in one warm onset: {sum(where.values())}", flush=True)
            for place, n in where.most_common(15):
                print(f"P1 syncs {n:6d}  {place}", flush=True)
        if args.profile:  # a third run: the profiler slows Python-heavy code, so the warm figure is not taken from it
            traced(cfg, None, "P1-profiled", args.profile)
        out["P1"] = {"untraced_pair_s": pair, "onset_s": seconds, "ratio": seconds / pair, "peak_bytes": peak,
                     "warm_onset_s": warm, "warm_ratio": warm / pair, "warm_ratio_paired": paired,
                     "warm_onset_all_s": warm_all, "untraced_pair_all_s": pair_all,
                     "waited_for_reference_s": [process.get("waited_for_reference_s"), *waits],
                     "reference_start_up_s": process.get("reference_start_up_s"),
                     "candidate_built_s": process.get("candidate_built_s"),
                     "concurrent_seconds": [process.get("seconds"), *parts], "message_timelines": timelines}
        print(f"P1 onset without oracle {args.prompts}x{args.prompt_len}, {args.new_tokens} steps: {seconds:.2f} s vs "
              f"untraced pair {pair:.2f} s = {seconds / pair:.2f}x cold, {warm:.2f} s = {warm / pair:.2f}x warm "
              f"(least of {args.warm_repeats}; untraced: least of {len(pair_all)}, interleaved; median of each warm run "
              f"over the untraced run after it {paired:.2f}x)" + (
                  "" if not process else f"; concurrent: timed from when both sides were ready, this process "
                  f"waited {process['waited_for_reference_s']:.2f} s (cold) / "
                  f"{max(waits):.2f} s (warm, at most) for the reference's beyond its own build; from the reference "
                  f"process's start: this side's candidate built at {process['candidate_built_s']:.2f} s, the "
                  f"reference process's " + ", ".join(f"{k} {v:.2f} s" for k, v in
                                                        process["reference_start_up_s"].items())),
              flush=True)
        if process and parts[0]:  # where each side's time went (RemoteTrace.finish), the median of warm runs
            print("P1 concurrent, warm, medians: " + ", ".join(
                f"{k} {statistics.median(p[k] for p in parts):.3f} s" for k in parts[0]), flush=True)
    if "P2" in goals:
        st = stats_bandwidth(args.device, args.stats_mib)
        out["P2"] = st
        print(f"P2 ULP statistics {args.stats_mib} MiB x2: {st['stats_GBps']:.1f} GB/s vs copy "
              f"{st['copy_GBps']:.1f} GB/s = {100 * st['share_of_copy']:.1f}% of copy", flush=True)
    if "P3" in goals:
        pair3 = untraced_pair(cfg3)
        seconds3 = traced(cfg3, args.reports, "P3-oracle")[0]
        # then warm runs (a kept pool of judging processes is warm only from the second run on)
        warm3 = [traced(cfg3, None, "P3-warm")[0] for _ in range(args.warm_repeats)]
        out["P3"] = {"untraced_pair_s": pair3, "onset_s": seconds3, "ratio": seconds3 / pair3,
                     "warm_onset_all_s": warm3, "warm_ratio": min(warm3) / pair3}
        print(f"P3 onset with oracle {args.oracle_prompts}x{args.oracle_prompt_len}, {args.oracle_new_tokens} steps"
              f"{f', judged in {args.judge_workers} processes' if args.judge_workers else ''}: {seconds3:.2f} s vs "
              f"untraced pair {pair3:.2f} s = {seconds3 / pair3:.1f}x cold, {min(warm3):.2f} s = "
              f"{min(warm3) / pair3:.1f}x warm (least of {len(warm3)})", flush=True)
    if "P5" in goals and args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        untraced_pair(cfg)
        untraced_peak = torch.cuda.max_memory_allocated()
        out["P5"] = {"untraced_peak_bytes": untraced_peak, "onset_peak_bytes": peak,
                     "ratio": peak / untraced_peak}
        side = ""
        if process:  # the same two runs side by side, untraced: what running at once costs before any tracing
            torch.cuda.empty_cache()
            both = untraced_side_by_side_peak(cfg)
            out["P5"].update(untraced_side_by_side_peak_bytes=both, ratio_side_by_side=peak / both,
                             reference_process_peak_bytes=process["reference_peak_bytes"],  # the rest: this process's
                             candidate_process_peak_bytes=process["candidate_peak_bytes"],  # (split; else 0)
                             most_in_flight_bytes=process["most_in_flight_bytes"],
                             switched_to_concurrent=process["switched_to_concurrent"],
                             peak_before_switch_bytes=process["peak_before_switch_bytes"])
            side = f"; untraced side by side {both / 2**30:.2f} GiB: {peak / both:.2f}x"
        print(f"P5 peak memory ({args.prompts}x{args.prompt_len}, reference "
              f"{where_kept(args.concurrent, process)}): onset "
              f"{peak / 2**30:.2f} GiB vs untraced {untraced_peak / 2**30:.2f} GiB = {peak / untraced_peak:.2f}x{side} "
              f"(onset {seconds:.2f} s" + ("" if pair is None else f" vs untraced pair {pair:.2f} s") + ")", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
