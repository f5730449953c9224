"""Where a traced run's host time goes, from a sampling profile: py-spy's raw output summarised per function.

cProfile slows Python-heavy code several times over and moves the balance between the recorder and the model;
a sampling profiler does not instrument anything. Record the timed runs of ``bench_p1_parts.py`` with py-spy
(``pip install py-spy``) and summarise the samples under a root function (each timed run is a call of
``timed``; ``--within full`` keeps the onset layer's runs only):

    py-spy record -r 400 -f raw -o spy.txt -- python bench/bench_p1_parts.py --device cuda --model qwen3.5-0.8b \\
        --layers onset --repeats 4
    python bench/spy_summary.py spy.txt --root timed --within full

Each line: the share of the kept samples in which a function is on the stack (inclusive) and on top (self),
functions named without line numbers; ``--lines`` lists the lines of ulptrace's own code instead (``tracer/``,
``probes/``, ``kernels/``: each sample counted at the deepest such frame).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

_OWN = ("tracer/", "probes/", "kernels/")


def _named(frame: str, name: str) -> bool:
    """Whether a py-spy frame ("qualified.name (file:line)") is a call of function ``name`` (nested ones included)."""
    qualified = frame.split(" ", 1)[0]
    return qualified == name or qualified.endswith("." + name)


def read(path: Path, root: str, within: str | None) -> tuple[list[tuple[list[str], int]], int]:
    """(stacks cut at their first ``root`` frame with their sample counts, samples kept)."""
    stacks, kept = [], 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise ValueError(f"{path}: expected py-spy raw lines ('frame;frame;... COUNT'), but found {line[:80]!r}")
        frames = stack.split(";")
        first = next((i for i, f in enumerate(frames) if _named(f, root)), None)
        if first is None:
            continue
        frames = frames[first:]
        if within is not None and not any(_named(f, within) for f in frames):
            continue
        stacks.append((frames, int(count)))
        kept += int(count)
    return stacks, kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("profile", type=Path, help="py-spy record -f raw output")
    p.add_argument("--root", default="timed", help="function whose calls are kept (default: timed)")
    p.add_argument("--within", help="keep only samples with this function below the root (e.g. full: the onset layer)")
    p.add_argument("--top", type=int, default=60)
    p.add_argument("--lines", action="store_true", help="per line of ulptrace's own code")
    args = p.parse_args()
    if args.top < 1:
        p.error(f"--top must be >= 1, but got {args.top}")
    if not args.profile.is_file():
        p.error(f"no such profile: {args.profile}")
    try:
        stacks, kept = read(args.profile, args.root, args.within)
    except ValueError as exc:
        p.error(str(exc))
    if not kept:
        sys.exit(f"no samples under {args.root!r}" + (f" with {args.within!r}" if args.within else "") +
                 f" in {args.profile}")
    inclusive, own = Counter(), Counter()
    for frames, count in stacks:
        if args.lines:
            mine = next((f for f in reversed(frames) if any(d in f for d in _OWN)), None)
            if mine is not None:
                inclusive[mine] += count
            continue
        names = [re.sub(r":\d+\)$", ")", f) for f in frames]
        for name in set(names):
            inclusive[name] += count
        own[names[-1]] += count
    print(f"{kept} samples under {args.root}" + (f" within {args.within}" if args.within else ""))
    for name, count in inclusive.most_common(args.top):
        self_share = "" if args.lines else f"{100 * own[name] / kept:5.1f}% self  "
        print(f"{100 * count / kept:5.1f}% {'' if args.lines else 'incl '}{self_share}{name[:150]}")


if __name__ == "__main__":
    main()
