"""What judging records of one program together buys (issue 11, P3): P3's record pairs judged one by one
(``OracleJudge.replayed``) against judged in stacks (``OracleJudge.replayed_many``), in one process, after a warm-up
pass of each (programs captured). Prints ops dispatched per pair (counted with a dispatch mode, an untimed pass),
seconds (least of ``--repeats``), how the plan stacked them, and whether every answer is the same.

    python bench/bench_stacked.py --device cuda --model qwen3.5-0.8b --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from contextlib import ExitStack

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    from bench_trace import check_workload, workload_arguments, workload_config  # this folder (bench/)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(p, prompts=2, prompt_len=32, new_tokens=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    from ulptrace.probes.onset import record_pair
    from ulptrace.verdicts import OracleJudge

    check_workload(p, args)
    cfg = workload_config(args)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    with ExitStack() as stack:
        try:
            ref, cand, ref_model, _ = record_pair(cfg, stack)
        except KeyError as exc:  # a path that names nothing in this model (a fault's site)
            p.error(str(exc.args[0] if exc.args else exc))
        judge = OracleJudge(ref_model)
        pairs = [(r, cand.get(r.key)) for r in ref]
        pairs = [(judge.on_device(r), judge.on_device(c)) for r, c in pairs if c is not None]
        pairs = [(r, c) for r, c in pairs if judge.without_replay(r, c) is None]
        ways = {"alone": lambda: [judge.replayed(r, c) for r, c in pairs], "stacked": lambda: judge.replayed_many(pairs)}
        out: dict = {"device": args.device, "model": args.model, "candidate": args.candidate, "pairs": len(pairs),
                     "torch": torch.__version__}
        answers = {}
        for name, run in ways.items():
            answers[name] = run()  # warm: programs captured
            counter = _Count()
            with counter:
                run()
            seconds = []
            for _ in range(args.repeats):
                sync()
                start = time.perf_counter()
                run()
                sync()
                seconds.append(time.perf_counter() - start)
            out[name] = {"ops_per_pair": counter.ops / max(len(pairs), 1), "seconds": min(seconds)}
        sizes = collections.Counter(len(s) for s in judge.stacks(pairs))
        out["stack_sizes"] = {str(k): v for k, v in sorted(sizes.items())}
        out["same_answers"] = answers["alone"] == answers["stacked"]
    a, s = out["alone"], out["stacked"]
    print(f"{len(pairs)} pairs on {args.device} ({args.model}): alone {a['ops_per_pair']:.0f} ops/pair "
          f"{a['seconds']:.3f} s; stacked {s['ops_per_pair']:.0f} ops/pair {s['seconds']:.3f} s = "
          f"{a['seconds'] / s['seconds']:.2f}x; stacks {out['stack_sizes']}; same answers: {out['same_answers']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
