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


# -- ULP histograms, error growth, norm rounding (issue 15) ------------------------------------------------------

_DIFFERING = VERDICTS[1:]  # every verdict of a differing element: tie, boundary, error, nonfinite
_RESIDUAL_SUFFIXES = ("residual_attn", "output")


def _new_axes(ax: Any, size: tuple[float, float]) -> tuple[Any, Any]:
    """``(figure, axes)``: ``ax`` and its figure, or a new figure of ``size`` laid out by matplotlib's
    constrained layout (a panel drawn into a caller's axes leaves the caller's layout alone)."""
    import matplotlib.pyplot as plt

    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=size, layout="constrained")
    return fig, ax


def _buckets() -> tuple[str, ...]:
    from ulptrace.ulp import HISTOGRAM_BUCKETS

    return HISTOGRAM_BUCKETS


def _bucket_of(ulp: int | None) -> str | None:
    """The histogram bucket of one ULP distance (None: not measurable)."""
    if ulp is None:
        return None
    for bucket, bound in zip(_buckets(), (0, 1, 2, 4, 8, 16)):
        if ulp <= bound:
            return bucket
    return ">16"


def own_histogram(entries: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Summed ``{class: {bucket: count}}`` of the differing elements of report ``entries``: per verdict from
    ``verdict_histogram``, and ``unjudged`` (the site's ``histogram`` without bucket ``0``) where a record that
    differs has no verdicts."""
    buckets = _buckets()
    out = {c: dict.fromkeys(buckets, 0) for c in (*_DIFFERING, "unjudged")}
    for e in entries:
        if e.get("bitwise_equal"):
            continue
        per_verdict = e.get("verdict_histogram")
        if per_verdict:
            for verdict, hist in per_verdict.items():
                for b, n in hist.items():
                    out[verdict][b] += n
        elif not e.get("verdicts") and e.get("histogram"):
            for b, n in e["histogram"].items():
                if b != "0":
                    out["unjudged"][b] += n
    return out


def _stacked_bars(ax: Any, x: list[float], stacks: dict[str, list[int]], width: float, **kw: Any) -> None:
    bottom = [0] * len(x)
    for name, heights in stacks.items():
        if not any(heights):
            continue
        ax.bar(x, heights, width, bottom=bottom, color=VERDICT_COLORS[name], label=name, edgecolor="white",
               linewidth=0.3, **kw)
        bottom = [b + h for b, h in zip(bottom, heights)]


def plot_ulp_histogram(entries: list[dict[str, Any]], ax: Any = None, *, title: str | None = None,
                       log: bool = False) -> Any:
    """One panel: the ULP distances of the differing elements of ``entries`` (report site entries), stacked by
    verdict (``tie``, ``boundary``, ``error``, ``nonfinite``; ``unjudged`` where a site has no verdicts).
    ``log``: counts on a log axis (stacked segments are then not to scale). Returns the Figure."""
    fig, ax = _new_axes(ax, (4.0, 2.6))
    buckets = [b for b in _buckets() if b != "0"] if not any(
        h["0"] for h in own_histogram(entries).values()) else list(_buckets())
    hist = own_histogram(entries)
    x = list(range(len(buckets)))
    _stacked_bars(ax, x, {c: [hist[c][b] for b in buckets] for c in hist}, 0.8)
    ax.set_xticks(x, buckets, fontsize=7)
    ax.set_xlabel("ULPs from the reference (output)", fontsize=7)
    ax.set_ylabel("differing elements", fontsize=7)
    if any(p.get_height() > 0 for p in ax.patches):
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=6, loc="upper right")
    ax.tick_params(labelsize=7)
    ax.set_title(title or "own error: differing elements by verdict", fontsize=8)
    return fig


def plot_input_delta(entries: list[dict[str, Any]], ax: Any = None, *, title: str | None = None) -> Any:
    """One panel beside :func:`plot_ulp_histogram`: the differing records of ``entries`` by the ULP delta of
    their recorded inputs (the greatest over inputs: error inherited from upstream; ``0`` = the difference is
    the site's own), stacked by the record's worst verdict. Returns the Figure."""
    fig, ax = _new_axes(ax, (4.0, 2.6))
    buckets = list(_buckets()[:-1]) + ["n/a"]
    classes = (*_DIFFERING, "unjudged", "could not judge", "exact")
    stacks = {c: [0] * len(buckets) for c in classes if c in VERDICT_COLORS}
    for e in entries:
        if e.get("bitwise_equal"):
            continue
        deltas = [v for v in (e.get("input_delta") or {}).values() if v is not None]
        bucket = _bucket_of(max(deltas)) if deltas else "n/a"
        cls = worst_class(e)
        stacks.setdefault(cls, [0] * len(buckets))[buckets.index(bucket)] += 1
    x = list(range(len(buckets)))
    _stacked_bars(ax, x, stacks, 0.8)
    ax.set_xticks(x, buckets, fontsize=7)
    ax.set_xlabel("input delta: greatest ULPs over recorded inputs", fontsize=7)
    ax.set_ylabel("differing records", fontsize=7)
    if ax.patches:
        ax.legend(fontsize=6, loc="upper right")
    ax.tick_params(labelsize=7)
    ax.set_title(title or "inherited: records by input delta", fontsize=8)
    return fig


def group_entries(data: dict[str, Any], by: str = "kind") -> dict[str, list[dict[str, Any]]]:
    """Report site entries grouped by ``kind`` or ``layer`` (``layer N``, ``other`` for sites outside layers),
    in order of first appearance.

    Raises:
        ValueError: ``by`` is neither, or the report has no site entries.
    """
    if by not in ("kind", "layer"):
        raise ValueError(f"by must be 'kind' or 'layer', but got {by!r}")
    entries = data.get("sites") or []
    if not entries:
        raise ValueError("the report has no site entries to plot (expected a comparison with 'sites')")
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        key = e["kind"] if by == "kind" else ("other" if e.get("layer") is None else f"layer {e['layer']}")
        groups.setdefault(key, []).append(e)
    return groups


def plot_ulp_histograms(data: dict[str, Any], *, by: str = "kind", groups: list[str] | None = None,
                        max_groups: int = 8, fig: Any = None) -> Any:
    """Per site kind (or layer): the site's own error — ULP histogram of its differing elements stacked by
    verdict — beside the error it inherited — its differing records by input delta. One row per group that
    has a differing record (``groups`` picks them), at most ``max_groups``; returns the Figure.

    Raises:
        ValueError: ``by`` is not ``kind``/``layer``, or the report has no site entries.
    """
    import matplotlib.pyplot as plt

    grouped = group_entries(data, by)
    names = [g for g in (groups or grouped) if any(not e["bitwise_equal"] for e in grouped.get(g, []))][:max_groups]
    rows = max(len(names), 1)
    if fig is None:
        fig = plt.figure(figsize=(8.5, 2.3 * rows), layout="constrained")
    axes = fig.subplots(rows, 2, squeeze=False)
    if not names:
        axes[0][0].text(0.5, 0.5, "every record is bitwise equal", ha="center", va="center")
        axes[0][1].set_axis_off()
    for row, name in zip(axes, names):
        plot_ulp_histogram(grouped[name], row[0], title=f"{name}: own error (elements by verdict)")
        plot_input_delta(grouped[name], row[1], title=f"{name}: inherited (records by input delta)")
    return fig


def _residual_position(site: str, layer: int | None, layers: int) -> float | None:
    """x position on the residual stream: layer L's attention residual at 2L, its output at 2L+1."""
    if layer is None:
        return -0.5 if site in ("embed_tokens", "embedding") else (2 * layers - 0.5 if site in ("norm", "logits")
                                                                   else None)
    if site.endswith(".residual_attn"):
        return 2 * layer
    if site.endswith(".output"):
        return 2 * layer + 1
    return 2 * layer - 0.5  # anything else in layer L happens before its attention residual


def plot_error_growth(data: dict[str, Any], ax: Any = None, *, metric: str = "max_ulp",
                      title: str | None = None) -> Any:
    """The residual stream's worst ULP distance from the reference, per step (one line each) and layer
    (``layers.N.residual_attn``, ``layers.N.output``), onset marked with a dashed line (at its layer when the
    onset is not itself a residual site). Symmetric-log y axis (0 = bitwise equal); returns the Figure.

    Args:
        metric: ``max_ulp`` (ULPs of each element's own magnitude) or ``max_row_ulp`` (ULPs of its row's
            magnitude, which a near-zero element cannot inflate).
    Raises:
        ValueError: an unknown metric, or the report has no residual-stream sites (``--kinds residual``).
    """
    if metric not in ("max_ulp", "max_row_ulp"):
        raise ValueError(f"metric must be 'max_ulp' or 'max_row_ulp', but got {metric!r}")
    entries = [e for e in data.get("sites") or [] if e.get("layer") is not None
               and e["site"].rsplit(".", 1)[-1] in _RESIDUAL_SUFFIXES and e.get(metric) is not None]
    if not entries:
        raise ValueError("the report has no residual-stream sites (layers.N.residual_attn / layers.N.output) "
                         "with ULP statistics to plot")
    fig, ax = _new_axes(ax, (6.0, 3.0))
    layers = max(e["layer"] for e in entries) + 1
    for step in sorted({e["step"] for e in entries}):
        points = sorted((_residual_position(e["site"], e["layer"], layers), e[metric])
                        for e in entries if e["step"] == step)
        ax.plot([p for p, _ in points], [u for _, u in points], marker="o", markersize=3, linewidth=1,
                label="prefill" if step == 0 else f"decode {step}")
    ticks = sorted({_residual_position(e["site"], e["layer"], layers) for e in entries})
    names = {_residual_position(e["site"], e["layer"], layers): f"{e['layer']}.{e['site'].rsplit('.', 1)[-1]}"
             for e in entries}
    ax.set_xticks(ticks, [names[t].replace("residual_attn", "attn").replace("output", "out") for t in ticks],
                  fontsize=6, rotation=90)
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("residual stream (layer.site)", fontsize=7)
    ax.set_ylabel("worst ULPs from reference" + (" (of the row's magnitude)" if metric == "max_row_ulp" else ""),
                  fontsize=7)
    onset = data.get("onset")
    if onset:
        x = _residual_position(onset["site"], onset.get("layer"), layers)
        if x is not None:
            ax.axvline(x, color="black", linestyle="--", linewidth=1,
                       label=f"onset: {onset['site']} @ step {onset['step']}")
    ax.legend(fontsize=6, loc="lower right")
    ax.tick_params(labelsize=7)
    ref, cand = data.get("reference", {}), data.get("candidate", {})
    ax.set_title(title or f"error growth on the residual stream: {cand.get('path', '?')} vs {ref.get('path', '?')}",
                 fontsize=8)
    return fig


def _midpoint_data(source: Any) -> dict[str, Any]:
    return source.midpoint_histogram() if hasattr(source, "midpoint_histogram") else source


def plot_midpoint_distance(source: Any, ax: Any = None, *, title: str | None = None) -> Any:
    """For one record: its differing elements placed by the distance of their exact (FP64) value to the
    nearest rounding midpoint (ULPs of the rounded dtype, 0 = on the midpoint), stacked by verdict, with the
    band of honest FP32 results shaded. Ties on bitwise-equal inputs cluster inside the band; boundary
    mismatches spread over the whole range.

    Args:
        source: an :class:`ulptrace.elements.Explanation`, or its ``midpoint_histogram()`` (``trace_norm_rounding``'s
            ``rounding`` JSON key).
    Raises:
        ValueError: nothing to place (no differing element with a rounding point).
    """
    h = _midpoint_data(source)
    if not h or not h.get("elements"):
        raise ValueError("no differing element with a rounding point to place against the midpoints")
    fig, ax = _new_axes(ax, (5.0, 2.8))
    edges = h["edges"]
    x = list(range(len(edges) - 1))
    _stacked_bars(ax, x, {v: h["counts"].get(v, [0] * len(x)) for v in _DIFFERING}, 0.85)
    band = h.get("band")
    if band:
        import math

        k = next((i for i in range(len(edges) - 1) if band < edges[i + 1]), len(edges) - 2)
        lo, hi = edges[k], edges[k + 1]
        frac = (math.log(band / lo) / math.log(hi / lo)) if lo > 0 else band / hi
        ax.axvspan(-0.5, k - 0.5 + frac, color="#cccccc", alpha=0.5, zorder=0,
                   label=f"honest FP32 band (median {band:.1e} ULP)")
    labels = [f"<{edges[1]:g}" if i == 0 and edges[0] == 0 else f"{edges[i]:g}-{edges[i + 1]:g}" for i in x]
    ax.set_xticks(x, labels, fontsize=6, rotation=45, ha="right")
    ax.set_xlabel("distance of the exact value to the nearest rounding midpoint (ULPs)", fontsize=7)
    ax.set_ylabel("differing elements", fontsize=7)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.tick_params(labelsize=7)
    inputs = "inputs equal: own differences" if h.get("inputs_equal") else "inputs differ: ties inherited"
    ax.set_title(title or f"{h.get('site', '?')} @ step {h.get('step', '?')} ({inputs})", fontsize=8)
    return fig


_TREE_CLASSES = ("neither", "reference", "candidate", "both")
_TREE_COLORS = ("#f2f2f2", "#6baed6", "#fd8d3c", "#756bb1")


def plot_tree_findings(findings: dict[str, Any], ax: Any = None, *, max_trees: int = 24, max_rows: int = 16,
                       title: str | None = None) -> Any:
    """Which FP32 reduction trees reproduce each side bit for bit: examined rows x trees, each cell
    reference only, candidate only, both or neither. Trees that reproduce a row on either side are shown,
    those telling the sides apart first, at most ``max_trees``; the first ``max_rows`` rows (the trees are
    ordered over all of them).

    Args:
        findings: ``{"rows": [{"row", "reference": [specs], "candidate": [specs]}]}`` (``trace_norm_rounding``'s
            ``trees[i]["findings"]``; an entry with a ``findings`` key is accepted too).
    Raises:
        ValueError: no examined rows.
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    entry = findings.get("findings", findings) if isinstance(findings, dict) else None
    rows = (entry or {}).get("rows") or []
    if not rows:
        raise ValueError("no examined rows in the tree findings (expected {'rows': [{'row', 'reference', "
                         "'candidate'}]})")
    counts: dict[str, list[int]] = {}
    for r in rows:
        for side, k in (("reference", 0), ("candidate", 1)):
            for spec in r[side]:
                counts.setdefault(spec, [0, 0])[k] += 1
    family = ("torch_cpu", "sequential", "pairwise", "numpy", "blocked")  # familiar orders first
    rank = lambda s: family.index(s.split(":")[0]) if s.split(":")[0] in family else len(family)
    order = sorted(counts, key=lambda s: (-abs(counts[s][0] - counts[s][1]), -sum(counts[s]), rank(s), len(s), s))
    shown = order[:max_trees]
    every = [sum(1 for s in counts if counts[s][k] == len(rows)) for k in (0, 1)]
    hidden_rows, rows = len(rows) - min(len(rows), max_rows), rows[:max_rows]
    grid = [[(spec in r["reference"]) + 2 * (spec in r["candidate"]) for spec in shown] for r in rows]
    fig, ax = _new_axes(ax, (1.5 + 0.22 * max(len(shown), 1), 1.2 + 0.22 * len(rows)))
    ax.imshow(grid if shown else [[0] for _ in rows], cmap=ListedColormap(_TREE_COLORS), vmin=-0.5, vmax=3.5,
              aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(rows)), [f"row {r['row']}" for r in rows], fontsize=6)
    ax.set_xticks(range(len(shown)), shown, fontsize=6, rotation=90)
    more = len(order) - len(shown)
    ax.set_xlabel("FP32 summation order" + (f" (+{more} more)" if more > 0 else "") + f"; reproducing every row: "
                  f"{every[0]} for the reference, {every[1]} for the candidate", fontsize=7)
    if hidden_rows:
        ax.set_ylabel(f"first {len(rows)} of {len(rows) + hidden_rows} rows", fontsize=7)
    present = sorted({v for g in grid for v in g}) if shown else [0]
    ax.legend(handles=[Patch(color=_TREE_COLORS[v], label=f"reproduces {_TREE_CLASSES[v]}") for v in present],
              fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    site = findings.get("site") if isinstance(findings, dict) else None
    where = f"{site} @ step {findings.get('step')}: " if site else ""
    ax.set_title(title or f"{where}which FP32 trees reproduce each side bit for bit", fontsize=8)
    return fig


def plot_norm_rounding(source: Any, trees: dict[str, Any] | None = None, *, fig: Any = None) -> Any:
    """One norm site's rounding story: :func:`plot_midpoint_distance` beside :func:`plot_tree_findings`
    (when ``trees`` is given); returns the Figure."""
    import matplotlib.pyplot as plt

    panels = 2 if trees else 1
    if fig is None:
        fig = plt.figure(figsize=(5.0 * panels + 1.0, 3.2), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    plot_midpoint_distance(source, axes[0])
    if trees:
        plot_tree_findings(trees, axes[1])
    return fig


def _tree_entry(data: dict[str, Any], site: str | None, step: int | None) -> dict[str, Any] | None:
    entries = [t for t in data.get("trees") or [] if t.get("findings")]
    return next((t for t in entries if (t["site"], t["step"]) == (site, step)), entries[0] if entries else None)


def plot_report(data: dict[str, Any], *, by: str = "kind", max_groups: int = 6, max_sites: int | None = 80) -> Any:
    """The figure ``--plot FILE.png`` writes: every diagnostic of one report in one figure — the verdict map;
    the error growth on the residual stream (when recorded); for ``trace_norm_rounding``'s report, the
    midpoint placement of one norm site (``rounding``) and its reduction-tree findings (``trees``); and the ULP
    histograms per kind with the inherited input delta beside them. Returns the Figure.

    Raises:
        ValueError: the report has no site entries.
    """
    import matplotlib.pyplot as plt

    grouped = group_entries(data, by)
    names = [g for g, es in grouped.items() if any(not e["bitwise_equal"] for e in es)][:max_groups]
    growth = any(e.get("layer") is not None and e["site"].rsplit(".", 1)[-1] in _RESIDUAL_SUFFIXES
                 for e in data["sites"])
    rounding = data.get("rounding") if (data.get("rounding") or {}).get("elements") else None
    side = [p for p, on in (("growth", growth), ("rounding", rounding), ("trees", rounding)) if on]
    sites = min(len({e["site"] for e in data["sites"]}), max_sites or 10**9)
    top = max(3.0, 0.11 * sites, 2.8 * len(side))
    fig = plt.figure(figsize=(13.0, top + 2.4 * max(len(names), 1)))  # constrained layout once drawn
    outer = fig.add_gridspec(2, 1, height_ratios=[top, 2.4 * max(len(names), 1)])
    upper = outer[0].subgridspec(max(len(side), 1), 2, width_ratios=[1.0, 1.25])
    plot_verdict_map(data, fig.add_subplot(upper[:, 0]), max_sites=max_sites)
    for k, panel in enumerate(side):
        ax = fig.add_subplot(upper[k, 1])
        if panel == "growth":
            plot_error_growth(data, ax)
        elif panel == "rounding":
            plot_midpoint_distance(rounding, ax)
        else:
            tree = _tree_entry(data, rounding.get("site"), rounding.get("step"))
            if tree:
                plot_tree_findings(tree, ax)
            else:
                ax.set_axis_off()
    lower = outer[1].subgridspec(max(len(names), 1), 2)
    for k, name in enumerate(names):
        plot_ulp_histogram(grouped[name], fig.add_subplot(lower[k, 0]), title=f"{name}: own error (elements by verdict)")
        plot_input_delta(grouped[name], fig.add_subplot(lower[k, 1]),
                         title=f"{name}: inherited (records by input delta)")
    fig.set_layout_engine("constrained")
    return fig


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def check_plot_file(path: str) -> str:
    """A figure file we will write, checked before any work: a ``.png``/``.pdf``/``.svg`` name that is not a
    directory, in an existing writable directory, and matplotlib installed. Returns ``path``.

    Raises:
        ValueError: the rule and the value (messages name the path, not the option).
    """
    import importlib.util
    import os
    from pathlib import Path

    target = Path(path)
    if target.suffix.lower() not in PLOT_SUFFIXES or target.is_dir():
        raise ValueError(f"{path}: expected a file name ending in {', '.join(PLOT_SUFFIXES)}")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{path}: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{path}: not writable")
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("drawing figures needs matplotlib, which is not installed: pip install 'ulptrace[plot]'")
    return path


def save_report(data: dict[str, Any], path: str, *, dpi: int = 110) -> Any:
    """Draw :func:`plot_report` into ``path`` (format from its suffix) and close the figure; returns the path."""
    import matplotlib.pyplot as plt

    fig = plot_report(data)
    try:
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    return path


# -- generation diagnostics: the token-parity matrix and lockstep (issue 12) -------------------------------------

def _row_color(row: dict[str, Any]) -> str:
    """A divergent row's colour: the verdict where it began (onset, else first difference); grey when not located."""
    point = row.get("onset") or row.get("first_difference")
    if not point:
        return VERDICT_COLORS["unjudged"]
    verdict = point.get("verdict")
    if verdict in VERDICT_COLORS and verdict != "exact":
        return VERDICT_COLORS[verdict]
    return VERDICT_COLORS["unjudged"] if not verdict else VERDICT_COLORS["tie"]


def plot_matrix(report: dict[str, Any], ax: Any = None, *, title: str | None = None) -> Any:
    """The token-parity matrix: every row of every check at its first divergent step; returns the Figure.

    Checks run along x, grouped by candidate path then mode (seed, batch, attempt within), the rows of a check
    side by side; y is the first divergent step (0 = the prefill's token), token-exact rows sit on the top
    line. Near-tie flips are hollow circles, the others filled crosses, coloured by the verdict where the
    row's divergence began (its onset, else its first difference).

    Args:
        report: a matrix report (``ulptrace matrix --json`` contents) or a batch-invariance report (same rows).
        ax: a matplotlib Axes to draw into (default: a new figure).
    Raises:
        ValueError: the report has no rows.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = report.get("rows") or []
    if not rows:
        raise ValueError("the report has no rows to plot (expected a matrix report with 'rows')")
    paths = list(dict.fromkeys(r["path"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    key = lambda r: (paths.index(r["path"]), modes.index(r["mode"]), r["seed"], r["batch"], r["attempt"])
    checks = sorted({key(r) for r in rows})
    index = {c: i for i, c in enumerate(checks)}
    new_tokens = (report.get("grid") or {}).get("new_tokens") or report.get("new_tokens") or \
        1 + max((r["first_divergent_step"] or 0) for r in rows)
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(18.0, 4.0 + 0.22 * len(checks)), 4.2))
    else:
        fig = ax.figure
    for r in rows:
        c = key(r)
        width = 0.8 / max(r["batch"], 1)
        x = index[c] - 0.4 + width * (r.get("row_in_batch", r["row"]) + 0.5)
        if r["token_exact"]:
            ax.plot([x], [new_tokens], marker=".", color="#bdbdbd", markersize=3, linestyle="none")
        elif r.get("near_tie"):
            ax.plot([x], [r["first_divergent_step"]], marker="o", markerfacecolor="none", markeredgecolor=_row_color(r),
                    markersize=6, linestyle="none")
        else:
            ax.plot([x], [r["first_divergent_step"]], marker="X", color=_row_color(r), markersize=7, linestyle="none")
    # path and mode groups
    for p, path in enumerate(paths):
        members = [i for c, i in index.items() if c[0] == p]
        if not members:
            continue
        lo, hi = min(members) - 0.5, max(members) + 0.5
        if p:
            ax.axvline(lo, color="black", linewidth=0.8)
        ax.text((lo + hi) / 2, new_tokens + 0.9, path, ha="center", va="bottom", fontsize=7)
        for m, mode in enumerate(modes):
            inner = [i for c, i in index.items() if c[0] == p and c[1] == m]
            if inner:
                ax.text((min(inner) + max(inner)) / 2, -0.9, mode, ha="center", va="top", fontsize=6)
                if m and min(inner) - 0.5 > lo:
                    ax.axvline(min(inner) - 0.5, color="#bdbdbd", linewidth=0.5, linestyle=":")
    ax.set_xlim(-0.6, len(checks) - 0.4)
    ax.set_ylim(-1.5, new_tokens + 1.6)
    ax.set_yticks(list(range(new_tokens)) + [new_tokens],
                  ["prefill"] + [str(t) for t in range(1, new_tokens)] + ["exact"], fontsize=6)
    ax.set_xticks([])
    ax.set_xlabel("checks (path, mode; seed, batch, attempt within), the rows of each side by side", fontsize=7)
    ax.set_ylabel("first divergent step", fontsize=7)
    handles = [Line2D([], [], marker="o", markerfacecolor="none", markeredgecolor="black", linestyle="none",
                      label="near-tie flip"),
               Line2D([], [], marker="X", color="black", linestyle="none", label="not a near-tie"),
               Line2D([], [], marker=".", color="#bdbdbd", linestyle="none", label="token-exact row")]
    handles += [Line2D([], [], marker="s", color=VERDICT_COLORS[v], linestyle="none", label=f"began: {v}")
                for v in VERDICTS[1:]]
    handles.append(Line2D([], [], marker="s", color=VERDICT_COLORS["unjudged"], linestyle="none",
                          label="began: no verdict / not located"))
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ref = report.get("reference") or {}
    ax.set_title(title or (f"token parity against {ref.get('path', report.get('path', '?'))} "
                           f"({ref.get('mode', report.get('mode', '?'))}) on {report.get('model', '?')}"), fontsize=8)
    fig.tight_layout()
    return fig


def plot_lockstep(report: dict[str, Any], ax: Any = None, *, title: str | None = None) -> Any:
    """A lockstep report per step: the logits' and the worst state tensor's max ULP (0 where bitwise equal), and
    the steps with an onset marked; returns the Figure.

    Args:
        report: a lockstep report (``ulptrace lockstep --json`` contents).
        ax: a matplotlib Axes to draw into (default: a new figure).
    Raises:
        ValueError: the report has no steps.
    """
    import matplotlib.pyplot as plt

    entries = ([report["prefill"]] if report.get("prefill") else []) + list(report.get("steps") or [])
    if not entries:
        raise ValueError("the report has no steps to plot (expected a lockstep report with 'prefill' and 'steps')")
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.5, 3.4))
    else:
        fig = ax.figure
    steps = [e["step"] for e in entries]

    def worst_state(e: dict[str, Any]) -> float:
        values = [v for k, v in e["max_ulp"].items() if k != "logits" and v is not None]
        return float(max(values, default=0))

    logits = [1.0 + float(e["max_ulp"].get("logits") or 0) for e in entries]
    states = [1.0 + worst_state(e) for e in entries]
    ax.plot(steps, logits, marker="o", label="logits")
    ax.plot(steps, states, marker="s", label="state tensors (the worst)")
    onsets = [e for e in entries if e.get("onset")]
    if onsets:
        ax.scatter([e["step"] for e in onsets], [logits[steps.index(e["step"])] for e in onsets], s=140,
                   facecolors="none", edgecolors=VERDICT_COLORS["error"], linewidths=1.5, zorder=3,
                   label="step with an onset")
        for e in onsets[:6]:
            ax.annotate(e["onset"]["site"], (e["step"], logits[steps.index(e["step"])]), fontsize=6,
                        xytext=(4, -10), textcoords="offset points")
    bitwise = [e["step"] for e in entries if e["logits_bitwise_equal"] and e["states_bitwise_equal"]]
    if bitwise:
        ax.scatter(bitwise, [1.0] * len(bitwise), marker="|", s=200, color="black", label="bitwise identical step")
    ax.set_yscale("log")
    ax.set_ylim(0.8, 4.0 * max(logits + states))
    ax.set_xticks(steps, ["prefill" if s == 0 else str(s) for s in steps], fontsize=7)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("step", fontsize=7)
    ax.set_ylabel("1 + max ULP difference (log)", fontsize=7)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ref, cand = report.get("reference") or {}, report.get("candidate") or {}
    how = "restored before every step" if report.get("restored", True) else "free-running"
    ax.set_title(title or (f"lockstep: {cand.get('path', '?')} ({cand.get('mode', '?')}) vs {ref.get('path', '?')} "
                           f"({ref.get('mode', '?')}), {how}"), fontsize=8)
    fig.tight_layout()
    return fig
