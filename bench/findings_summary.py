"""Summarise `ulptrace onset --json` reports for bench/FINDINGS.md: one markdown block per report with the
first difference, the onset (verdict, named boundary), verdict totals, token parity, the observation check
and what each side's path reported (path_info). Every figure is read from the report; nothing is computed
beyond sums and counts.

    python bench/findings_summary.py REPORT.json [REPORT.json ...] > summary.md
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

VERDICTS = ("exact", "tie", "boundary", "error", "nonfinite")


def _site(data: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any] | None:
    if not ref:
        return None
    return next((s for s in data["sites"] if s["site"] == ref["site"] and s["step"] == ref["step"]), None)


def _at(ref: dict[str, Any] | None) -> str:
    return "none" if not ref else f"step {ref['step']}, `{ref['site']}`"


def _info(info: dict[str, Any] | None) -> str:
    if not info:
        return "-"
    keep = {k: v for k, v in info.items() if k not in ("observed", "module_level", "versions", "hf_bound_at_import")}
    if "functions" in keep:
        keep["functions"] = {k: f"{v['ran']} x{v['calls']}" for k, v in keep["functions"].items()}
    if "module_level" in info:
        keep["module_level_patched"] = len(info["module_level"])
    if "hf_bound_at_import" in info:
        keep["hf_bound_at_import"] = sorted(set(info["hf_bound_at_import"].values()))
    return json.dumps(keep, sort_keys=True)


def _share(x: float) -> str:
    """A share as a percentage: whole when exactly 0 or 1, else to a thousandth of a percent (never rounded to 100%)."""
    return f"{x:.0%}" if x in (0, 1) else f"{x:.3%}"


def summarise(path: str) -> str:
    data = json.loads(Path(path).read_text())
    ref, cand = data["reference"], data["candidate"]
    title = (f"### `{cand.get('path')}` against `{ref.get('path')}` ({ref.get('model')}, {ref.get('device')}, "
             f"prompts {ref.get('prompts')}, {ref.get('new_tokens')} steps) — `{Path(path).name}`")
    lines = [title, ""]
    totals: Counter[str] = Counter()
    judged = unjudged = 0
    boundaries: Counter[str] = Counter()
    for s in data["sites"]:
        if s.get("verdicts"):
            judged += 1
            totals.update({k: s["verdicts"].get(k, 0) for k in VERDICTS})
        else:
            unjudged += 1
        if s.get("boundary"):
            boundaries[f"{s['kind']}: {s['boundary']}"] += 1
    differ = sum(not s["bitwise_equal"] for s in data["sites"])
    onset = data.get("onset")
    onset_site = _site(data, onset)
    lines.append(f"- records: {len(data['sites'])} ({differ} differ), judged {judged}, without verdicts {unjudged}, "
                 f"could not judge {len(data.get('could_not_judge') or [])}; complete: {data.get('complete')}")
    lines.append(f"- first difference: {_at(data.get('first_difference'))}")
    if onset:
        verdicts = (onset_site or {}).get("verdicts") or {}
        worst = next((v for v in reversed(VERDICTS) if verdicts.get(v)), None)
        boundary = (onset_site or {}).get("boundary")
        explained = (onset_site or {}).get("explained")
        lines.append(f"- onset: {_at(onset)}, reason `{onset.get('reason')}`, verdict `{worst}` "
                     f"({', '.join(f'{k} {verdicts[k]}' for k in VERDICTS if verdicts.get(k))})"
                     + (f", boundary: {boundary}" + (f" ({_share(explained)} of out-of-set elements)"
                                                      if isinstance(explained, (int, float)) else "") if boundary else ""))
    else:
        lines.append("- onset: none")
    lines.append("- verdict totals (elements, judged records): " + ", ".join(f"{k} {totals[k]:,}" for k in VERDICTS))
    for name, n in boundaries.most_common():
        lines.append(f"  - boundary in {n} record(s) — {name}")
    errors = [s for s in data["sites"] if (s.get("verdicts") or {}).get("error")]
    if errors:
        lines.append(f"  - error in {len(errors)} record(s): " + "; ".join(
            f"step {s['step']} `{s['site']}` {s['verdicts']['error']} element(s), up to {s.get('max_error_ulp')} ULP "
            "outside the admissible set" for s in errors[:6]) + ("; ..." if len(errors) > 6 else ""))
    checked = [s for s in data["sites"] if s.get("reference_outside") is not None]
    if checked:
        outside = [s for s in checked if s["reference_outside"]]
        lines.append("- reference's own admissibility (`--check-reference`): " + (
            f"{sum(s['reference_outside'] for s in outside):,} element(s) of the reference outside its admissible "
            f"set, in {len(outside)} of {len(checked)} checked record(s)" if outside else
            f"the reference's outputs inside their admissible sets in all {len(checked)} checked record(s) "
            "(0 elements outside)"))
    run = data.get("run") or {}
    flip = run.get("first_token_flip")
    if run.get("reference_tokens") is not None:
        rows = sum(a == b for a, b in zip(run["reference_tokens"], run["candidate_tokens"]))
        where = "none" if flip is None else f"step {flip['step']} row {flip['row']}"
        lines.append(f"- token parity: {rows}/{len(run['reference_tokens'])} rows keep the reference's greedy tokens; "
                     f"first flip: {where}")
    obs = data.get("observation")
    if obs:
        cand_obs = obs.get("candidate") or {}
        lines.append(f"- observation check (traced vs untraced logits, every step): reference "
                     f"{'bitwise equal' if obs.get('bitwise_equal') or not cand_obs else 'see candidate'}"
                     + (f", candidate {'bitwise equal' if cand_obs.get('bitwise_equal') else 'DIFFERENT at ' + str(cand_obs.get('differing_steps'))}"
                        if cand_obs else ""))
    parity = data.get("parity") or {}
    lines.append(f"- parity: {'ok' if parity.get('ok') else 'not at parity: ' + ', '.join(sorted({f['kind'] for f in parity.get('failures', [])}))}")
    lines.append(f"- reference path_info: {_info(ref.get('path_info'))}")
    lines.append(f"- candidate path_info: {_info(cand.get('path_info'))}")
    observed = (cand.get("selection") or {}).get("observed")
    if observed:
        lines.append(f"- observed: {observed}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("reports", nargs="+")
    args = p.parse_args()
    for report in args.reports:
        print(summarise(report))


if __name__ == "__main__":
    main()
