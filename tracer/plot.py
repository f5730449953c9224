"""Plots: where divergence begins, as a site x step map of verdicts.

One picture answers the question ulptrace exists for: rows are sites in execution order, columns
are steps (0 = prefill), and each cell is the worst verdict at that (site, step) — exact, tie,
boundary, error, nonfinite — or grey where the site's kind has no oracle semantics, and magenta
where the oracle could not judge a site that has semantics (never drawn as "no semantics"). The onset is
ringed. Functions take a report (``Comparison.to_json()`` or the JSON file's contents) and an
optional ``ax``, return the Figure and never call ``plt.show()``; matplotlib is imported here only.
"""

from __future__ import annotations

from typing import Any

from ulptrace.oracle.judge import VERDICTS

VERDICT_COLORS = {
    "equal": "#f2f2f2",  # bitwise equal
    "exact": "#f2f2f2",
    "tie": "#9ecae1",
    "boundary": "#fdae6b",
    "error": "#de2d26",
    "nonfinite": "#54278f",
    "unjudged": "#bdbdbd",  # differs, no oracle semantics for the kind
    "could not judge": "#e7298a",  # the oracle failed on a site that has semantics
}
_ORDER = ("equal", *VERDICTS, "unjudged", "could not judge")


def worst_class(entry: dict[str, Any]) -> str:
    """The class a cell is drawn in: the worst verdict present, 'equal', 'unjudged' or 'could not judge'."""
    if entry.get("could_not_judge"):
        return "could not judge"
    if entry["bitwise_equal"]:
        return "equal"
    verdicts = entry.get("verdicts")
    if not verdicts:
        return "unjudged"
    return next((name for name in reversed(VERDICTS) if verdicts.get(name)), "exact")


def plot_verdict_map(data: dict[str, Any], ax: Any = None, *, max_sites: int | None = None,
                     title: str | None = None) -> Any:
    """A site x step map of the worst verdict per cell, onset ringed; returns the Figure.

    Args:
        data: a comparison report (``Comparison.to_json()``, ``ulptrace onset --json`` contents).
        ax: a matplotlib Axes to draw into (default: a new figure sized to the data).
        max_sites: keep only the first N sites in execution order.
    Raises:
        ValueError: the report has no site entries.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    entries = data.get("sites") or []
    if not entries:
        raise ValueError("the report has no site entries to plot (expected a comparison with 'sites')")
    sites = list(dict.fromkeys(e["site"] for e in entries))[:max_sites]
    steps = sorted({e["step"] for e in entries})
    row, col = {s: i for i, s in enumerate(sites)}, {t: j for j, t in enumerate(steps)}
    grid = [[_ORDER.index("equal")] * len(steps) for _ in sites]
    for e in entries:
        if e["site"] in row:
            grid[row[e["site"]]][col[e["step"]]] = _ORDER.index(worst_class(e))
    if ax is None:
        fig, ax = plt.subplots(figsize=(5.5 + 0.7 * len(steps), 1.2 + 0.18 * len(sites)))
    else:
        fig = ax.figure
    cmap = ListedColormap([VERDICT_COLORS[c] for c in _ORDER])
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(_ORDER) - 0.5, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(sites)), sites, fontsize=6)
    ax.set_xticks(range(len(steps)), [("prefill" if t == 0 else f"decode {t}") for t in steps], fontsize=7)
    onset = data.get("onset")
    if onset and onset["site"] in row:
        ax.scatter([col[onset["step"]]], [row[onset["site"]]], s=120, facecolors="none", edgecolors="black",
                   linewidths=1.5, label=f"onset: {onset['site']} @ step {onset['step']}")
    present = sorted({_ORDER[v] for r in grid for v in r}, key=_ORDER.index)
    handles = [Patch(color=VERDICT_COLORS[c], label=c) for c in present]
    ax.legend(handles=handles + ax.get_legend_handles_labels()[0], fontsize=6, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    ref = data.get("reference", {})
    cand = data.get("candidate", {})
    ax.set_title(title or f"{cand.get('path', '?')} vs {ref.get('path', '?')} on {ref.get('model', '?')}",
                 fontsize=8)
    fig.tight_layout()
    return fig
