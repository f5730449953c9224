"""What P1 could be if an onset's two sides ran at the same time, each in its own process (issue 11, P1).

The streaming onset runs the reference, then the candidate, in one process: P1's floor in that design (hook dispatch
and a copy per observed value on both sides, ``bench/RESULTS.md``, ninth round) is above the must's 1.5x on the H200's
host. Running the two sides in one process at the same time is not sound (a path may patch process-wide state, and
two threads share the interpreter's lock), two processes are. Before building that, this measures what it could buy:

1. ``sequential``: the untraced pair in this process, one side after the other (P1's base, as ``bench_trace.py``);
2. ``concurrent untraced``: each side untraced in its own process, both started together (a barrier) — what the host
   and the GPU give two processes at once (time-slicing between two CUDA contexts, the host's shared caches);
3. ``concurrent traced``: in the same two processes, the reference recorded and kept as ``run_onset`` keeps it, and the
   candidate recorded and compared by ``run_onset``'s streaming comparison against a reference that its process
   recorded before (untimed) — each side's traced work, both at once. What it leaves out: moving the reference's
   records from one process to the other (one arena per step through CUDA IPC, to be measured when built) and the
   candidate waiting for the reference's next token (it runs one step behind);
4. ``one at a time``: the same untraced and traced work of each side with the other side waiting (what running at once
   costs each side, in the same processes: two CUDA contexts time-sliced on one GPU, the host's shared caches).

Each figure is the median over ``--repeats`` rounds of the round's wall time (both sides start at a barrier; a round
ends when the slower one does) over the sequential pair; the processes build their own models (the same seeds).

    python bench/bench_concurrent.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


PHASES = ("untraced", "traced", "untraced_alone", "traced_alone")  # the last two: one side at a time, the other waiting


def _side(role: str, cfg, repeats: int, barrier, results) -> None:
    """One process's side: build, warm up, then per round wait at the barrier and time its work (untraced rounds, then
    traced ones); ``results`` gets (role, untraced seconds, traced seconds) or (role, error)."""
    try:
        from ulptrace.comparison import StreamingComparator
        from ulptrace.paths import apply_path
        from ulptrace.record import MemorySink, Recorder, recording_collector
        from ulptrace.run import build_pair, greedy, selected_sites

        ref, cand, prompts = build_pair(cfg)
        with apply_path(ref, cfg.reference), apply_path(cand, cfg.candidate):
            tokens = greedy(ref, prompts, cfg.new_tokens)

            def reference_trace():
                with Recorder(ref, sites=selected_sites(ref, cfg), sink=MemorySink(device="auto")) as rec:
                    greedy(ref, prompts, cfg.new_tokens)
                return rec.trace

            prepared: list = []  # the candidate's reference for its next traced round, recorded before it (untimed)
            if role == "reference":
                untraced = lambda: greedy(ref, prompts, cfg.new_tokens)
                prepare = lambda: None

                def traced() -> None:
                    with recording_collector():
                        reference_trace()
            else:
                untraced = lambda: greedy(cand, prompts, cfg.new_tokens, forced=tokens)
                prepare = lambda: prepared.append(reference_trace())

                def traced() -> None:
                    with recording_collector():
                        sink = StreamingComparator(prepared.pop(), release=True)
                        with Recorder(cand, sites=selected_sites(cand, cfg), sink=sink):
                            greedy(cand, prompts, cfg.new_tokens, forced=tokens)
                        sink.finish()

            untraced()  # warm-up
            prepare()
            traced()
            _sync(cfg.device)
            times: dict[str, list[float]] = {name: [] for name in PHASES}
            for name in PHASES:
                run = traced if name.startswith("traced") else untraced
                alone = name.endswith("alone")
                for _ in range(repeats):
                    if run is traced:
                        prepare()
                        _sync(cfg.device)
                    barrier.wait()
                    if alone and role == "candidate":  # the reference's turn first
                        barrier.wait()
                    t0 = time.perf_counter()
                    run()
                    _sync(cfg.device)
                    times[name].append(time.perf_counter() - t0)
                    if alone and role == "reference":
                        barrier.wait()
            results.put((role, *(times[name] for name in PHASES)))
    except BaseException as exc:  # noqa: BLE001 — reported to the parent, which fails with it
        barrier.abort()
        results.put((role, f"{type(exc).__name__}: {exc}"))


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
    p.add_argument("--json", default=None)
    args = p.parse_args()
    check_workload(p, args)

    cfg = workload_config(args, oracle=False)
    run_pair = untraced_runner(cfg)
    sequential = [run_pair() for _ in range(args.repeats)]
    context = torch.multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_side, args=(role, cfg, args.repeats, barrier, results))
               for role in ("reference", "candidate")]
    for w in workers:
        w.start()
    got: dict[str, tuple] = {}
    for _ in workers:
        item = results.get()
        got[item[0]] = item[1:]
    for w in workers:
        w.join()
    errors = {role: v[0] for role, v in got.items() if len(v) == 1}
    if errors:
        raise SystemExit(f"a side failed: {errors}")
    base = statistics.median(sequential)
    out = {"workload": vars(args), "sequential": sequential, "sides": got, "rounds": {}, "ratios": {},
           "versions": {"torch": torch.__version__}}
    print(f"sequential untraced pair (this process): median {base:.3f} s of {args.repeats}")
    for k, name in enumerate(("concurrent untraced", "concurrent traced")):
        ref, cand = got["reference"][k], got["candidate"][k]
        rounds = [max(a, b) for a, b in zip(ref, cand)]  # both start at the barrier; the slower ends the round
        out["rounds"][name], out["ratios"][name] = rounds, statistics.median(rounds) / base
        print(f"{name:20s} median {statistics.median(rounds):.3f} s = {out['ratios'][name]:.2f}x the sequential pair "
              f"(reference {statistics.median(ref):.3f} s, candidate {statistics.median(cand):.3f} s)")
    for k, name in ((2, "untraced"), (3, "traced")):  # what running at once costs each side: its time alone against it
        ref, cand = got["reference"][k], got["candidate"][k]
        print(f"{name + ', one at a time':20s} reference {statistics.median(ref):.3f} s, candidate "
              f"{statistics.median(cand):.3f} s (the other side waiting)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
