"""What the candidate's streaming comparison costs per record, apart from the run (issue 11, P1: on the H100 the
candidate recorded and compared took 2.1-2.2 s against the reference recorded 1.35-1.44 s, `bench_concurrent.py`).

Both sides are recorded once into memory (``MemorySink(device="auto")``, as the sequential onset keeps the reference);
then the candidate's records are fed to a ``StreamingComparator`` against the reference's, as the recorder would, and
timed (the device synchronised at the end): ``full``; ``python`` — the statistics replaced by a constant (what the
comparison's own Python costs); ``no-known`` — without the reuse of pairs already compared. A cProfile of one
``full`` pass follows (top functions by own time), and the records' make-up (how many, with inputs, stored in another
dtype). The reports of ``full`` passes are checked equal to each other.

    python bench/bench_compare_cost.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch


def main() -> None:
    from bench_trace import check_workload, progress_printer, workload_arguments, workload_config  # this folder
    from ulptrace import comparison as C
    from ulptrace.paths import apply_path
    from ulptrace.record import MemorySink, Recorder, recording_collector
    from ulptrace.run import build_pair, greedy, selected_sites
    from ulptrace.ulp import PendingStats, RecordStats

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_arguments(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    check_workload(p, args)
    cfg = workload_config(args, oracle=False)
    say = progress_printer()

    ref, cand, prompts = build_pair(cfg)
    say("built")
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def recorded(model, path, forced=None):
        with recording_collector(), apply_path(model, path):
            with Recorder(model, sites=selected_sites(model, cfg), sink=MemorySink(device="auto")) as rec:
                tokens = greedy(model, prompts, cfg.new_tokens, forced=forced)
        return rec.trace, tokens

    reference, tokens = recorded(ref, cfg.reference)
    candidate, _ = recorded(cand, cfg.candidate, tokens)
    records = list(candidate)
    sync()
    say(f"recorded both sides: {len(records)} candidate records")
    makeup = {"records": len(records), "inputs": sum(len(r.inputs) for r in records),
              "cast": sum(r.out.dtype != ref.out.dtype for r in records if (ref := reference.get(r.key)) is not None),
              "bytes": sum(r.out.nbytes for r in records)}
    real_stats, real_get = C._stats, C.KnownPairs.get
    constant = PendingStats(RecordStats(True, 0, 0, {}, 0.0, {}))

    def one() -> list:
        sink = C.StreamingComparator(reference)
        for record in records:
            sink.add(record)
        result = sink.finish()
        sync()
        return result

    variants = {"full": lambda: None,
                "python": lambda: setattr(C, "_stats", lambda a, b, rows=True, batch=None: constant),
                "no-known": lambda: setattr(C.KnownPairs, "get", lambda self, a, b, rows=False: None)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    reports = []
    for name, patch in variants.items():  # warm-up
        patch()
        try:
            one()
        finally:
            C._stats, C.KnownPairs.get = real_stats, real_get
        say(f"warmed up {name}")
    for _ in range(args.repeats):
        for name, patch in variants.items():
            patch()
            try:
                t0 = time.perf_counter()
                report = one()
                times[name].append(time.perf_counter() - t0)
            finally:
                C._stats, C.KnownPairs.get = real_stats, real_get
            if name == "full":
                reports.append(json.dumps(report.to_json(), sort_keys=True, default=str))  # (untimed)
            say(f"{name} {times[name][-1]:.3f} s")
    prof = cProfile.Profile()
    prof.enable()
    one()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    n = len(records)
    print(f"{cfg.model} on {args.device}, {args.prompts} x {args.prompt_len}, {args.new_tokens} steps: {makeup}")
    for name, ts in times.items():
        print(f"compare {name:9s} least {min(ts):.3f} s of {len(ts)} ({min(ts) / n * 1e6:.1f} us a record), "
              f"all {', '.join(f'{t:.3f}' for t in ts)}")
    print(f"full reports equal to each other: {len(set(reports)) == 1}")
    print(text.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": vars(args), "makeup": makeup, "times": times,
                       "reports_equal": len(set(reports)) == 1}, f, indent=1)


if __name__ == "__main__":
    main()
