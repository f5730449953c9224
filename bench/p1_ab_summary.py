"""One table from a device call of ``gpu_round31.sh``: each variant's P1 runs (``p1_<variant>_<round>.json``, written by
``bench_trace.py --goals P1 --concurrent auto``) and side splits (``side_<variant>_<round>.json``, written by
``bench_side_parts.py``), so that trees alternated in one call are read side by side.

    python bench/p1_ab_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def _runs(folder: Path, prefix: str) -> dict[str, list[tuple[int, dict]]]:
    found = defaultdict(list)
    for path in sorted(folder.glob(f"{prefix}_*.json")):
        match = re.fullmatch(rf"{prefix}_(.+)_(\d+)\.json", path.name)
        if match:
            found[match[1]].append((int(match[2]), json.loads(path.read_text())))
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(f"usage: p1_ab_summary.py OUT_DIR (a folder; found {argv!r})", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    p1, side = _runs(folder, "p1"), _runs(folder, "side")
    if not p1 and not side:
        print(f"no p1_*.json or side_*.json in {folder}", file=sys.stderr)
        return 1
    if p1:
        print("P1 (--concurrent auto): variant round | warm least | paired median | untraced pair | "
              "reference warm run_s (median) | put_s (median)")
    for variant, runs in p1.items():
        for number, report in sorted(runs, key=lambda run: run[0]):
            goal = report["P1"]
            warm = goal.get("concurrent_seconds", [])[1:]
            run_s = statistics.median(entry["run_s"] for entry in warm) if warm else float("nan")
            put_s = statistics.median(entry["put_s"] for entry in warm) if warm else float("nan")
            print(f"  {variant:<12} r{number} | {goal['warm_ratio']:.2f}x | {goal.get('warm_ratio_paired', float('nan')):.2f}x"
                  f" | {goal['untraced_pair_s']:.3f} s | {run_s:.3f} s | {put_s:.3f} s")
    if side:
        print("side parts (in one process, least of the repeats): variant round | side: untraced, keep (ratio, "
              "median ratio), in hooks, outside")
    for variant, runs in side.items():
        for number, report in sorted(runs, key=lambda run: run[0]):
            for name, numbers in report["sides"].items():
                keep = numbers["layers"]["keep"]
                print(f"  {variant:<12} r{number} {name:<9} | {numbers['untraced_s']:.3f} s, {keep['wall_s']:.3f} s "
                      f"({keep['ratio']:.2f}x, {keep['median_ratio']:.2f}x) | {keep['in_hooks_s']:.3f} s | "
                      f"{keep['outside_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
