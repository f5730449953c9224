"""What a new helper process's start-up costs, stage by stage (``onset --concurrent``'s reference process, the
oracle's judging processes): each stage timed in a fresh interpreter, in the order a helper takes them
(``ulptrace.processes.prepare_imports``) and with the CUDA context first, so the part that a parent's model build
cannot overlap is known by stage (issue 11: the concurrent onset's single command waits for it). ``--build`` then
builds the model as an onset's side does, by part: what a command spends before its first run.

    python bench/bench_startup.py --device cuda --model qwen3.5-0.8b --repeats 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_STAGES = r"""
import json, sys, time
t0 = time.perf_counter()
marks = {}
def mark(name):
    marks[name] = round(time.perf_counter() - t0, 3)
import torch
mark("import torch")
def context():
    if torch.device(sys.argv[2]).type == "cuda":
        torch.empty(0, device=sys.argv[2])
        mark("CUDA context")
if sys.argv[3] == "context-first":
    context()
import ulptrace.concurrent, ulptrace.paths, ulptrace.run
mark("import ulptrace (run, paths, concurrent)")
import transformers
mark("import transformers")
from ulptrace.models import prepare
prepare(sys.argv[1])
mark("prepare (the model's modules, built on the meta device)")
if sys.argv[3] != "context-first":
    context()
if sys.argv[4] == "build":  # then the model built as an onset's side builds it, by part
    import ulptrace.models as models
    redraw = models.realistic_init_
    def timed(model, seed):
        mark("build: HF's init (from_config, on the device)")
        redraw(model, seed)
        mark("build: the trained-like redraw (realistic_init_, on the host)")
    models.realistic_init_ = timed
    model = models.build_model(sys.argv[1], device=sys.argv[2])
    if torch.device(sys.argv[2]).type == "cuda":
        torch.cuda.synchronize()
    mark("build: the cast to bfloat16, done")
    models.twin(model)
    if torch.device(sys.argv[2]).type == "cuda":
        torch.cuda.synchronize()
    mark("twin (the second side's model)")
print(json.dumps(marks))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3.5-0.8b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--build", action="store_true",
                   help="then build the model as an onset's side does (HF's init, the redraw, the cast) and its twin")
    p.add_argument("--json")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, but got {args.repeats}")
    runs: dict[str, list[dict[str, float]]] = {"helper order": [], "context-first": []}
    for _ in range(args.repeats):
        for order, marks in runs.items():
            done = subprocess.run([sys.executable, "-c", _STAGES, args.model, args.device, order,
                                   "build" if args.build else "-"],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                sys.exit(f"a fresh interpreter's start-up failed ({order}):\n{done.stderr[-2000:]}")
            marks.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for order, marks in runs.items():
        print(f"{order} (cumulative seconds from the interpreter's first line; min over {args.repeats}):")
        for stage in marks[0]:
            print(f"  {min(m[stage] for m in marks):7.3f}  {stage}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
