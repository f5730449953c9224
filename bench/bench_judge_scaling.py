"""Would the oracle's judging go faster in several processes at once? (issue 11, P3)

P3 (an onset with the oracle) is bound by the number of small ops the interval replay issues per judged record
(~420, a few microseconds of host dispatch each: ``bench/RESULTS.md``), not by the device. Host dispatch in one
process does not use the other host cores; judging records in N processes on one device could. Before building
that, this measures what it would buy: N processes (spawned together), each builds the model pair, records both
sides of P3's workload in memory (``record_pair``), judges every record pair once to warm up (programs captured),
then waits at a barrier and judges every pair again, timed. Each process judges *all* pairs (the same work each), so
the throughput of N processes is ``N x pairs / the slowest one's seconds``; the speed-up is that over N = 1.

    python bench/bench_judge_scaling.py --device cuda --model qwen3.5-0.8b --workers 1 2 4 8
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _judge_all(cfg, threads, barrier, results) -> None:
    try:
        if threads:
            torch.set_num_threads(threads)
        from contextlib import ExitStack

        from ulptrace.probes.onset import record_pair
        from ulptrace.verdicts import OracleJudge

        with ExitStack() as stack:
            ref_trace, cand_trace, ref_model, _ = record_pair(cfg, stack)
            judge = OracleJudge(ref_model)
            pairs = [(r, cand_trace.get(r.key)) for r in ref_trace]
            pairs = [(r, c) for r, c in pairs if c is not None]
            for r, c in pairs:  # warm: programs captured, kernels loaded
                judge(r, c)
            _sync(cfg.device)
            barrier.wait()
            start = time.perf_counter()
            for r, c in pairs:
                judge(r, c)
            _sync(cfg.device)
            seconds = time.perf_counter() - start
        differing = sum(not torch.equal(r.out, c.out) for r, c in pairs)
        results.put((seconds, len(pairs), differing))
    except BaseException as exc:
        import traceback

        results.put(("error", traceback.format_exc()))
        barrier.abort()
        raise SystemExit(1) from exc


def main() -> None:
    from bench_trace import check_workload, workload_arguments, workload_config  # this folder (bench/)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(p, prompts=2, prompt_len=32, new_tokens=4)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, default=0, help="torch's intra-op threads per process (0: its default)")
    p.add_argument("--json")
    args = p.parse_args()

    check_workload(p, args)  # an unknown model or path, a bad count: one line, before any process starts
    if min(args.workers) < 1 or args.threads < 0:
        p.error(f"--workers must be >= 1 and --threads >= 0, but got {args.workers} and {args.threads}")

    cfg = workload_config(args)
    context = torch.multiprocessing.get_context("spawn")
    out: dict[str, dict] = {}
    base = None
    for n in args.workers:
        barrier, results = context.Barrier(n), context.Queue()
        procs = [context.Process(target=_judge_all, args=(cfg, args.threads, barrier, results)) for _ in range(n)]
        for proc in procs:
            proc.start()
        got = [results.get() for _ in range(n)]
        for proc in procs:
            proc.join()
        errors = [g[1] for g in got if g[0] == "error"]
        if errors:
            raise SystemExit(f"a judging process failed:\n{errors[0]}")
        slowest = max(g[0] for g in got)
        pairs, differing = got[0][1], got[0][2]
        throughput = n * pairs / slowest
        base = base or throughput
        out[str(n)] = {"seconds": [g[0] for g in got], "pairs": pairs, "differing": differing,
                       "pairs_per_s": throughput, "speed_up": throughput / base}
        print(f"{n} process(es): {pairs} pairs ({differing} differing) each, slowest {slowest:.2f} s, "
              f"{throughput:.0f} pairs/s, {throughput / base:.2f}x of one process", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "model": args.model, "torch": torch.__version__, "workers": out}, f,
                      indent=1)


if __name__ == "__main__":
    main()
