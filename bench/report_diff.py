"""Compare two folders of the benchmark's JSON reports (``bench_trace.py --reports``) field by field.

Why: issue 11 asks that speed never come from judging less — reports of a tree must equal a frozen earlier tree's, apart
from fields another change deliberately added. This prints, per report, every differing field (run info that says
when/where the run went left out, as ``bench_trace._clean`` does) and sorts them into the fields named with
``--allowed`` (a key of its path) and the rest; it exits 1 when any report is missing or differs outside them. The
allowed ones are counted as added (the first report had no value there) or changed, the changed ones printed: a field
another change began to fill is not one whose values it changed.

    python bench/report_diff.py BASE_REPORTS REPORTS --new-sites output --allowed input_shapes g
"""
import argparse
import json
import sys
from pathlib import Path

from bench_trace import _clean, differences


def _keys(path: str) -> list[str]:
    """The keys of a field's path as ``differences`` writes it (``.sites[5].input_delta.g`` -> sites, input_delta, g)."""
    return [k.split("[")[0] for k in path.split(".") if k]


def _added(diff: str) -> bool:
    """Whether a difference (as ``differences`` writes it) is a value the first report did not have: a field only in
    the second, or null there and set here — a field another change began to fill, not a value it changed."""
    return diff.endswith(": only in second") or ": None != " in diff


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--allowed", nargs="*", default=[], metavar="KEY",
                   help="a field (a key anywhere in its path) whose differences are deliberate")
    p.add_argument("--new-sites", nargs="*", default=[], metavar="SITE",
                   help="sites only the later tree records: left out of its reports before comparing")
    args = p.parse_args()
    missing = [str(d) for d in (args.before, args.after) if not d.is_dir()]
    if missing:
        print(f"not a folder of reports: {', '.join(missing)}")
        return 1
    bad = 0
    names = sorted({f.name for f in args.before.glob("*.json")} | {f.name for f in args.after.glob("*.json")})
    if not names:
        print(f"no reports in {args.before} or {args.after}")
        return 1
    for name in names:
        a, b = args.before / name, args.after / name
        if not (a.exists() and b.exists()):
            print(f"{name}: only in {'before' if a.exists() else 'after'}")
            bad += 1
            continue
        after = json.loads(b.read_text())
        new = [s for s in after.get("sites", []) if s.get("site") in args.new_sites]
        if args.new_sites:
            after = {**after, **{key: [s for s in after.get(key, []) if s.get("site") not in args.new_sites]
                                 for key in ("sites", "could_not_judge")}}
            print(f"{name}: {len(new)} record(s) of the new sites left out "
                  f"({sum(not s['bitwise_equal'] for s in new)} differ)")
        diffs = differences(_clean(json.loads(a.read_text())), _clean(after), limit=10**6)
        allowed = [d for d in diffs if set(_keys(d.split(":")[0])) & set(args.allowed)]
        other = [d for d in diffs if d not in allowed]
        changed = [d for d in allowed if not _added(d)]
        print(f"{name}: {len(diffs)} differing fields, {len(allowed)} in {args.allowed or 'no allowed field'} "
              f"({len(allowed) - len(changed)} added where the first had none, {len(changed)} changed), "
              f"{len(other)} elsewhere")
        for d in changed[:20]:
            print("    changed:", d)
        for d in (other or allowed)[:20]:
            print("   ", d)
        bad += bool(other)
    print("EQUAL apart from the allowed fields" if not bad else "DIFFERENT")
    return int(bool(bad))


if __name__ == "__main__":
    sys.exit(main())
