"""Reports: a comparison as a terminal table, markdown, or JSON (the documented contract).

Every renderer works from ``Comparison.to_json()``, so the three forms always agree. Rows that are
bitwise equal are summarised in one line unless ``all_rows`` is set; the header states what was
compared, on which device, with which versions; the footer names the first difference, the onset
and the parity decision with every reason it failed. A site the oracle could not judge says so in
its verdicts cell and in the summary, never reads as "no semantics".

The terminal table fits the terminal's width (``shutil.get_terminal_size``): the columns that do not
fit on a row's line are written beneath it, labelled, so nothing is cut off.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from typing import Any

from ulptrace.oracle.judge import VERDICTS, explained_share
from ulptrace.ulp import HISTOGRAM_BUCKETS, ROW_HISTOGRAM_BUCKETS


def _hist(h: dict[str, int], buckets: tuple[str, ...] = HISTOGRAM_BUCKETS) -> str:
    return " ".join(f"{b}:{h[b]}" for b in buckets if h.get(b)) or "-"


def _verdicts(s: dict[str, Any]) -> str:
    v = s["verdicts"]
    if v is None:
        return "COULD NOT JUDGE" if s.get("could_not_judge") else "n/a (no oracle)"
    return " ".join(f"{k}:{v[k]}" for k in VERDICTS if v.get(k)) or "-"


def _number(value: float | None) -> str:
    """Compact: integers below a million as they are, anything else with three significant digits."""
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}"


_REASONS = {
    "verdict": "its own verdict is worse than tie",
    "unjudged": "no verdicts (no oracle semantics, or the oracle could not judge it); it differs on bitwise-equal "
                "inputs (a record without inputs: while every record before it in the step is bitwise equal)",
    "unobserved": "its inputs already differ while every earlier record is equal: the divergence began in "
                  "code between observed sites",
    "unrecorded": "its inputs already differ while every earlier record is equal: the divergence began in code this "
                  "selection did not record (record every site to judge it)",
    "mask": "its attention mask lets other keys through than the reference's (built from positions, not values: "
            "no rounding upstream explains it)",
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
            f"{meta.get('device', '?')}, attn={meta.get('attn_implementation', '?')}"
            f"{'/' + meta['sdpa'] if meta.get('sdpa') else ''}; {vs}{ran}]")


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
    cast = [s for s in sites if s.get("candidate_dtype")]
    if cast:  # a wider or narrower candidate record: its "bitwise equal" is in the reference's dtype
        kinds = "; ".join(sorted({f"{s['candidate_dtype']} where the reference has {s['dtype']}" for s in cast}))
        where = ", ".join(f"{s['site']}@{s['step']}" for s in cast[:3]) + (
            f" (+{len(cast) - 3} more)" if len(cast) > 3 else "")
        lines.append(f"stored in another dtype: {len(cast)} candidate records ({kinds}: {where}), compared and "
                     f"judged in the reference's dtype; {sum(s['bitwise_equal'] for s in cast)} of them hold exactly "
                     "the reference's values")
    if data.get("complete") is False:
        lines.append("selection: some sites or steps were not recorded, so a difference that begins in one of them "
                     "cannot be located (a first difference on inputs that already differ is an 'unrecorded' onset "
                     "where the selection left sites out; no 'unobserved' onsets, none at records without inputs)")
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
    unjudgeable = [s for s in sites if s.get("could_not_judge")]
    if unjudgeable:
        shown = "; ".join(f"step {s['step']} {s['site']}: {s['could_not_judge']}" for s in unjudgeable[:3])
        more = f" (+{len(unjudgeable) - 3} more)" if len(unjudgeable) > 3 else ""
        lines.append(f"could not judge: {len(unjudgeable)} record(s) with oracle semantics: {shown}{more}")
    return lines


def _parity(data: dict[str, Any]) -> list[str]:
    """The parity decision (``Comparison.parity``) and every reason it failed, one per line."""
    parity = data.get("parity")
    if parity is None:
        return []
    if parity["ok"]:
        allowed = f" (allowed: {', '.join(parity['allowed'])})" if parity.get("allowed") else ""
        return [f"parity: at parity{allowed}"]
    return ["parity: NOT at parity"] + [f"  - {f['kind']}: {f['message']}" for f in parity["failures"]]


def _input_delta(s: dict[str, Any]) -> str:
    """Each recorded input that differs: its ULPs, or ``shape REFxREF/CANDxCAND`` where it is shaped otherwise."""
    shown = [f"{k}:{v}" for k, v in s["input_delta"].items() if v]
    shown += [f"{k}:shape {'x'.join(map(str, a))}/{'x'.join(map(str, b))}" for k, (a, b) in
              s.get("input_shapes", {}).items()]
    return ",".join(shown) or "-"


# (header, cell) of every column, in display order
_COLUMNS: list[tuple[str, Any]] = [
    ("step", lambda s: str(s["step"])),
    ("site", lambda s: s["site"]),
    ("kind", lambda s: s["kind"]),
    ("elements", lambda s: str(s["elements"])),
    ("differing", lambda s: str(s["differing"])),
    ("max ulp", lambda s: _number(s["max_ulp"])),
    ("row ulp", lambda s: _number(s.get("max_row_ulp"))),
    ("ulp histogram", lambda s: _hist(s["histogram"])),
    ("row-ulp histogram", lambda s: _hist(s.get("row_histogram") or {}, ROW_HISTOGRAM_BUCKETS)),
    ("verdicts", _verdicts),
    ("input delta (ulp)", _input_delta),
    ("boundary", lambda s: _boundary(s)),
    ("could not judge", lambda s: s.get("could_not_judge") or ""),
]
_HEAD = [h for h, _ in _COLUMNS]
# which columns stay on a row's line when the terminal is narrow: a prefix of this list
_PRIORITY = ["step", "site", "kind", "differing", "max ulp", "row ulp", "verdicts", "ulp histogram",
             "input delta (ulp)", "elements", "row-ulp histogram", "boundary", "could not judge"]


def _cells(s: dict[str, Any]) -> list[str]:
    return [cell(s) for _, cell in _COLUMNS]


def _boundary(s: dict[str, Any]) -> str:
    """The named boundary with the share of out-of-set elements it explains (a name explaining 1% of a
    site whose other 99% are errors is a coincidence, and the reader must see that)."""
    if not s["boundary"] or not (s["verdicts"] or {}).get("boundary"):
        return ""
    share = s.get("explained")
    return s["boundary"] + (f" [explains {explained_share(share)}]" if share is not None else "")


def _fit(body: list[list[str]], width: int) -> list[int]:
    """Indices of the columns that stay on each row's line within ``width``: the longest prefix of
    ``_PRIORITY`` that fits (step and site always); columns empty in every row are left out."""
    present = [i for i in range(len(_HEAD)) if i < 2 or any(r[i] not in ("", "-") for r in body)]
    widths = {i: max(len(r[i]) for r in [_HEAD] + body) for i in present}
    kept: list[int] = []
    for i in (_HEAD.index(name) for name in _PRIORITY):
        if i not in present:
            continue
        if i >= 2 and sum(widths[k] + 2 for k in kept) + widths[i] > width:
            break
        kept.append(i)
    return sorted(kept)


def to_table(data: dict[str, Any], all_rows: bool = False, limit: int = 60, width: int | None = None) -> str:
    """A table for a terminal ``width`` columns wide (default: this terminal's, ``shutil.get_terminal_size``).

    Columns that do not fit on a row's line follow it on labelled, wrapped lines.
    """
    width = width or shutil.get_terminal_size(fallback=(120, 24)).columns

    def wrap(text: str, first: str = "", rest: str = "  ") -> list[str]:
        return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest,
                             break_on_hyphens=False, break_long_words=True) or [""]

    body = [_cells(s) for s in rows(data, all_rows)]
    shown = body[:limit]
    lines = [part for line in _summary(data) for part in wrap(line)] + [""]
    if shown:
        kept = _fit(shown, width)
        widths = {i: max(len(r[i]) for r in [_HEAD] + shown) for i in kept}
        line = lambda cells: "  ".join(cells[i].ljust(widths[i]) for i in kept).rstrip()
        lines += [line(_HEAD), line(["-" * widths.get(i, 0) for i in range(len(_HEAD))])]
        for r in shown:
            lines.append(line(r))
            details = "; ".join(f"{_HEAD[i]}: {r[i]}" for i in range(len(_HEAD)) if i not in kept and r[i] not in ("", "-"))
            if details:
                lines += wrap(details, "      ", "      ")
        if len(body) > limit:
            lines.append(f"... {len(body) - limit} more rows (use --json for all)")
    else:
        lines.append("every compared record is bitwise equal")
    footer = [f"first difference: {_point(data['first_difference'])}", f"onset: {_point(data['onset'])}"]
    lines += [""] + [part for text in footer + _parity(data) for part in wrap(text, "", "    ")]
    return "\n".join(lines)


def to_markdown(data: dict[str, Any], all_rows: bool = False) -> str:
    """A markdown report (for PR descriptions and CI artifacts)."""
    lines = ["## ulptrace comparison", ""] + [f"- {line}" for line in _summary(data)]
    lines += [f"- first difference: {_point(data['first_difference'])}", f"- onset: {_point(data['onset'])}"]
    lines += [f"- {line.strip()}" if not line.startswith("  ") else f"  {line.strip()}" for line in _parity(data)]
    lines.append("")
    body = [_cells(s) for s in rows(data, all_rows)]
    if body:
        lines += ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in body]
    else:
        lines.append("Every compared record is bitwise equal.")
    return "\n".join(lines) + "\n"


def to_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, default=str)
