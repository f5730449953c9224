"""Reports: a comparison as a terminal table, markdown, or JSON (the documented contract).

Every renderer works from ``Comparison.to_json()``, so the three forms always agree. Rows that are
bitwise equal are summarised in one line unless ``all_rows`` is set; the header states what was
compared, on which device, with which versions; the footer names the first difference and the
onset.
"""

from __future__ import annotations

import json
from typing import Any

from ulptrace.ulp import HISTOGRAM_BUCKETS

VERDICT_ORDER = ("exact", "tie", "boundary", "error", "nonfinite")


def _hist(h: dict[str, int]) -> str:
    return " ".join(f"{b}:{h[b]}" for b in HISTOGRAM_BUCKETS if h.get(b)) or "-"


def _verdicts(v: dict[str, int] | None) -> str:
    if v is None:
        return "n/a (no oracle)"
    return " ".join(f"{k}:{v[k]}" for k in VERDICT_ORDER if v.get(k)) or "-"


_REASONS = {
    "verdict": "its own verdict is worse than tie",
    "unjudged": "no oracle semantics; it differs on bitwise-equal inputs",
    "unobserved": "its inputs already differ while every earlier record is equal: the divergence began in "
                  "code between observed sites",
}


def _point(p: dict[str, Any] | None) -> str:
    if p is None:
        return "none"
    reason = _REASONS.get(p.get("reason", ""), "")
    return f"step {p['step']}, {p['site']} ({p['kind']})" + (f" — {reason}" if reason else "")


def _describe(meta: dict[str, Any]) -> str:
    versions = meta.get("versions", {})
    vs = ", ".join(f"{k} {v}" for k, v in versions.items() if k in ("torch", "transformers", "cuda"))
    impl = (meta.get("path_info") or {}).get("implementation")
    ran = f"; kernels ran as {'/'.join(sorted(set(impl.values())))}" if isinstance(impl, dict) and impl else ""
    return (f"{meta.get('path', '?')} on {meta.get('model', '?')} [{meta.get('dtype', '?')}, "
            f"{meta.get('device', '?')}, attn={meta.get('attn_implementation', '?')}; {vs}{ran}]")


def rows(data: dict[str, Any], all_rows: bool = False) -> list[dict[str, Any]]:
    return [s for s in data["sites"] if all_rows or not s["bitwise_equal"]]


def _summary(data: dict[str, Any]) -> list[str]:
    sites = data["sites"]
    equal = sum(s["bitwise_equal"] for s in sites)
    lines = [
        f"reference: {_describe(data['reference'])}",
        f"candidate: {_describe(data['candidate'])}",
        f"records compared: {len(sites)} ({equal} bitwise equal, {len(sites) - equal} differ)",
    ]
    obs = data.get("observation")
    if obs:
        verdict = "bitwise equal" if obs["bitwise_equal"] else f"DIFFERENT at steps {obs['differing_steps']}"
        lines.append(f"observation check: traced vs untraced {obs['what'].split(' of ')[0]}: {verdict}")
    checked = [s for s in sites if s.get("reference_outside") is not None]
    if checked:
        outside = [s for s in checked if s["reference_outside"]]
        lines.append(f"reference against its own semantics: {len(checked)} records checked, "
                     + ("all admissible" if not outside else
                        f"{sum(s['reference_outside'] for s in outside)} elements outside in {len(outside)} records "
                        f"(first: step {outside[0]['step']} {outside[0]['site']})"))
    params = data.get("parameters")
    if params and any(params.values()):
        for key, label in (("differing", "parameters that differ"), ("only_reference", "parameters only in the reference"),
                           ("only_candidate", "parameters only in the candidate")):
            if params[key]:
                more = f" (+{len(params[key]) - 5} more)" if len(params[key]) > 5 else ""
                lines.append(f"{label}: {len(params[key])}: {', '.join(params[key][:5])}{more}")
    elif params is not None:
        lines.append("parameters: bitwise the same on both paths")
    for key, label in (("missing", "missing in candidate"), ("extra", "extra in candidate"),
                       ("mismatched", "shape/dtype mismatch")):
        if data[key]:
            shown = ", ".join(f"{m['site']}@{m['step']}" + (f" ({m['reason']})" if "reason" in m else "")
                              for m in data[key][:5])
            more = f" (+{len(data[key]) - 5} more)" if len(data[key]) > 5 else ""
            lines.append(f"{label}: {len(data[key])}: {shown}{more}")
    return lines


def _cells(s: dict[str, Any]) -> list[str]:
    inherited = ",".join(f"{k}:{v}" for k, v in s["input_delta"].items() if v) or "-"
    return [str(s["step"]), s["site"], s["kind"], str(s["elements"]), str(s["differing"]),
            "-" if s["max_ulp"] is None else str(s["max_ulp"]), _hist(s["histogram"]),
            _verdicts(s["verdicts"]), inherited, _boundary(s)]


def _boundary(s: dict[str, Any]) -> str:
    """The named boundary with the share of out-of-set elements it explains (a name explaining 1% of a
    site whose other 99% are errors is a coincidence, and the reader must see that)."""
    if not s["boundary"] or not (s["verdicts"] or {}).get("boundary"):
        return ""
    share = s.get("explained")
    return s["boundary"] + (f" [explains {share:.0%}]" if share is not None else "")


_HEAD = ["step", "site", "kind", "elements", "differing", "max ulp", "ulp histogram", "verdicts",
         "input delta (ulp)", "boundary"]


def to_table(data: dict[str, Any], all_rows: bool = False, limit: int = 60) -> str:
    """A fixed-width table for the terminal."""
    body = [_cells(s) for s in rows(data, all_rows)]
    shown = body[:limit]
    widths = [max(len(r[i]) for r in [_HEAD] + shown) for i in range(len(_HEAD))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    lines = _summary(data) + [""]
    if shown:
        lines += [fmt(_HEAD), fmt(["-" * w for w in widths])] + [fmt(r) for r in shown]
        if len(body) > limit:
            lines.append(f"... {len(body) - limit} more rows (use --json for all)")
    else:
        lines.append("every compared record is bitwise equal")
    lines += ["", f"first difference: {_point(data['first_difference'])}", f"onset: {_point(data['onset'])}"]
    return "\n".join(lines)


def to_markdown(data: dict[str, Any], all_rows: bool = False) -> str:
    """A markdown report (for PR descriptions and CI artifacts)."""
    lines = ["## ulptrace comparison", ""] + [f"- {line}" for line in _summary(data)]
    lines += [f"- first difference: {_point(data['first_difference'])}", f"- onset: {_point(data['onset'])}", ""]
    body = [_cells(s) for s in rows(data, all_rows)]
    if body:
        lines += ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in body]
    else:
        lines.append("Every compared record is bitwise equal.")
    return "\n".join(lines) + "\n"


def to_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, default=str)
