"""The diagnostic figures, tested for structure (axes, labels, artists, the onset marker), not pixels."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
import ulptrace
from ulptrace.plot import VERDICT_COLORS, own_histogram, plot_input_delta, plot_ulp_histogram
from ulptrace.ulp import HISTOGRAM_BUCKETS

ZERO = dict.fromkeys(HISTOGRAM_BUCKETS, 0)
V = lambda **k: {**dict.fromkeys(("exact", "tie", "boundary", "error", "nonfinite"), 0), **k}


def hist(**k):
    return {**ZERO, **{b.replace("_", "-"): n for b, n in k.items()}}


def entry(site, step, kind, layer, *, equal=True, verdicts=None, vh=None, histogram=None, max_ulp=0, delta=None):
    return {"site": site, "step": step, "kind": kind, "layer": layer, "bitwise_equal": equal, "verdicts": verdicts,
            "verdict_histogram": vh, "histogram": histogram or hist(**{"0": 1}), "max_ulp": max_ulp,
            "max_row_ulp": float(max_ulp) / 2, "input_delta": delta if delta is not None else {"x": 0}}


def report():
    vh_norm = {"tie": hist(**{"1": 5, "2": 1}), "boundary": hist(**{"1": 2, "3_4": 3}), "error": ZERO, "nonfinite": ZERO}
    return {
        "sites": [
            entry("layers.0.input_layernorm", 0, "norm", 0, equal=False, verdicts=V(exact=10, tie=6, boundary=5),
                  vh=vh_norm, delta={"x": 0}),
            entry("layers.0.residual_attn", 0, "residual", 0, equal=False, histogram=hist(**{"0": 3, "1": 4}),
                  max_ulp=1, delta={"residual": 0, "delta": 2}),
            entry("layers.0.output", 0, "residual", 0, max_ulp=0),
            entry("layers.1.input_layernorm", 0, "norm", 1, equal=False, verdicts=V(exact=20, tie=1),
                  vh={"tie": hist(**{"9_16": 1}), "boundary": ZERO, "error": ZERO, "nonfinite": ZERO},
                  delta={"x": 12}),
            entry("layers.1.residual_attn", 0, "residual", 1, equal=False, max_ulp=40, delta={"residual": 3}),
            entry("layers.1.output", 0, "residual", 1, equal=False, max_ulp=90, delta={"residual": 40}),
            entry("layers.0.residual_attn", 1, "residual", 0, max_ulp=0),
            entry("layers.0.output", 1, "residual", 0, equal=False, max_ulp=2),
            entry("layers.1.residual_attn", 1, "residual", 1, equal=False, max_ulp=7),
            entry("layers.1.output", 1, "residual", 1, equal=False, max_ulp=8),
        ],
        "onset": {"site": "layers.0.input_layernorm", "step": 0, "kind": "norm", "layer": 0, "reason": "verdict"},
        "reference": {"path": "hf", "model": "m"}, "candidate": {"path": "c"},
    }


def bars(ax) -> dict[str, list[float]]:
    """Bar heights per legend label (one BarContainer per stacked class)."""
    return {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}


def test_own_error_histogram_stacks_verdicts_and_unjudged() -> None:
    data = report()
    summed = own_histogram(data["sites"])
    assert summed["tie"]["1"] == 5 and summed["tie"]["9-16"] == 1 and summed["boundary"]["3-4"] == 3
    assert summed["unjudged"]["1"] == 4 and summed["unjudged"]["0"] == 0  # residual: no verdicts
    fig = plot_ulp_histogram(data["sites"][:1], title="norm")
    ax = fig.axes[0]
    assert ax.get_title() == "norm" and ax.get_xlabel().startswith("ULPs from the reference")
    assert [t.get_text() for t in ax.get_xticklabels()] == list(HISTOGRAM_BUCKETS[1:])  # no element at 0 ULPs
    heights = bars(ax)
    assert heights == {"tie": [5, 1, 0, 0, 0, 0, 0], "boundary": [2, 0, 3, 0, 0, 0, 0]}
    tie, boundary = ax.containers
    assert [p.get_y() for p in boundary.patches][:3] == [5, 1, 0]  # stacked on the ties
    assert tie.patches[0].get_facecolor()[:3] == matplotlib.colors.to_rgb(VERDICT_COLORS["tie"])
    plt.close(fig)


def test_input_delta_panel_counts_records_by_their_inherited_delta() -> None:
    fig = plot_input_delta(report()["sites"])
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == [*HISTOGRAM_BUCKETS[:-1], "n/a"]
    h = bars(ax)
    # differing records: norm L0 (delta 0, boundary), residual L0 (2, unjudged), norm L1 (12, tie),
    # residual L1 attn (3) and output (40), step 1 outputs (0, unjudged)
    assert h["boundary"][labels.index("0")] == 1 and h["tie"][labels.index("9-16")] == 1
    assert h["unjudged"][labels.index("2")] == 1 and h["unjudged"][labels.index(">16")] == 1
    assert sum(sum(v) for v in h.values()) == 8
    plt.close(fig)


def test_histograms_per_kind_and_per_layer() -> None:
    fig = ulptrace.plot_ulp_histograms(report())
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["norm: own error (elements by verdict)", "norm: inherited (records by input delta)",
                      "residual: own error (elements by verdict)", "residual: inherited (records by input delta)"]
    plt.close(fig)
    fig = ulptrace.plot_ulp_histograms(report(), by="layer")
    assert [ax.get_title().split(":")[0] for ax in fig.axes[::2]] == ["layer 0", "layer 1"]
    plt.close(fig)
    with pytest.raises(ValueError, match="by must be"):
        ulptrace.plot_ulp_histograms(report(), by="step")


def test_error_growth_lines_per_step_and_the_onset_marker() -> None:
    fig = ulptrace.plot_error_growth(report())
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.attn", "0.out", "1.attn", "1.out"]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["prefill"].get_xdata()) == [0, 1, 2, 3] and list(lines["prefill"].get_ydata()) == [1, 0, 40, 90]
    assert list(lines["decode 1"].get_ydata()) == [0, 2, 7, 8]
    onset = [line for label, line in lines.items() if label.startswith("onset:")]
    assert len(onset) == 1 and list(onset[0].get_xdata()) == [-0.5, -0.5]  # layer 0's norm: before 0.attn
    assert onset[0].get_linestyle() == "--"
    assert ax.get_yscale() == "symlog" and ax.get_ylim()[0] == 0
    assert "onset: layers.0.input_layernorm @ step 0" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)
    # an onset at a residual site sits on that site's position; the row-magnitude metric
    data = report()
    data["onset"] = {"site": "layers.1.output", "step": 0, "kind": "residual", "layer": 1, "reason": "unobserved"}
    fig = ulptrace.plot_error_growth(data, metric="max_row_ulp")
    ax = fig.axes[0]
    assert [list(line.get_xdata()) for line in ax.get_lines() if line.get_label().startswith("onset")] == [[3, 3]]
    assert list(next(line for line in ax.get_lines() if line.get_label() == "prefill").get_ydata()) == [0.5, 0, 20, 45]
    plt.close(fig)
    with pytest.raises(ValueError, match="residual-stream"):
        ulptrace.plot_error_growth({"sites": report()["sites"][:1]})


def midpoints():
    edges = [0.0, 1e-4, 1e-2, 0.5]
    return {"site": "layers.0.input_layernorm", "step": 0, "inputs_equal": True, "edges": edges,
            "counts": {"tie": [7, 1, 0], "boundary": [0, 3, 9], "error": [0, 0, 1], "nonfinite": [0, 0, 0]},
            "band": 5e-4, "elements": 21}


def test_midpoint_distance_panel() -> None:
    fig = ulptrace.plot_midpoint_distance(midpoints())
    ax = fig.axes[0]
    assert bars(ax) == {"tie": [7, 1, 0], "boundary": [0, 3, 9], "error": [0, 0, 1]}
    assert [t.get_text() for t in ax.get_xticklabels()] == ["<0.0001", "0.0001-0.01", "0.01-0.5"]
    band = [p for p in ax.patches if p.get_label().startswith("honest FP32 band")]
    assert len(band) == 1  # shaded from the first bin into the second (5e-4 lies between 1e-4 and 1e-2)
    x0, x1 = band[0].get_x(), band[0].get_x() + band[0].get_width()
    assert x0 == -0.5 and 0.5 < x1 < 1.5
    assert "inputs equal" in ax.get_title() and ax.get_xlabel().startswith("distance of the exact value")
    plt.close(fig)
    with pytest.raises(ValueError, match="no differing element"):
        ulptrace.plot_midpoint_distance({**midpoints(), "elements": 0})


def test_tree_findings_grid() -> None:
    findings = {"site": "s", "step": 2, "findings": {"rows": [
        {"row": 3, "reference": ["torch_cpu:w8", "sequential"], "candidate": ["blocked:t32:v4", "sequential"]},
        {"row": 9, "reference": ["torch_cpu:w8"], "candidate": ["blocked:t32:v4"]}]}}
    fig = ulptrace.plot_tree_findings(findings)
    ax = fig.axes[0]
    trees = [t.get_text() for t in ax.get_xticklabels()]
    assert trees == ["torch_cpu:w8", "blocked:t32:v4", "sequential"]  # the ones telling the sides apart first
    assert [t.get_text() for t in ax.get_yticklabels()] == ["row 3", "row 9"]
    # 1 reference only, 2 candidate only, 3 both, 0 neither
    assert ax.get_images()[0].get_array().tolist() == [[1, 2, 3], [1, 2, 0]]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {
        "reproduces reference", "reproduces candidate", "reproduces both", "reproduces neither"}
    assert ax.get_title().startswith("s @ step 2")
    assert "1 for the reference, 1 for the candidate" in ax.get_xlabel()
    plt.close(fig)
    many = {"rows": [{"row": r, "reference": ["sequential"], "candidate": []} for r in range(40)]}
    ax = ulptrace.plot_tree_findings(many, max_rows=5).axes[0]
    assert len(ax.get_yticklabels()) == 5 and ax.get_ylabel() == "first 5 of 40 rows"
    assert "1 for the reference, 0 for the candidate" in ax.get_xlabel()
    plt.close(ax.figure)
    fig = ulptrace.plot_norm_rounding(midpoints(), findings)
    assert len(fig.axes) == 2
    plt.close(fig)


def test_report_figure_has_every_panel_and_never_shows(monkeypatch) -> None:
    monkeypatch.setattr(plt, "show", lambda *a, **k: pytest.fail("plt.show() called"))
    fig = ulptrace.plot_report(report())
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0] == "c vs hf on m" and titles[1].startswith("error growth")
    assert len(fig.axes) == 2 + 4  # map, growth, two kinds x (own, inherited)
    plt.close(fig)
    data = {**report(), "rounding": midpoints(), "trees": [{"site": "layers.0.input_layernorm", "step": 0,
                                                            "findings": {"rows": [{"row": 0, "reference": ["sequential"],
                                                                                   "candidate": []}]}}]}
    fig = ulptrace.plot_report(data)
    assert len(fig.axes) == 4 + 4
    assert any(ax.get_xlabel().startswith("distance of the exact value") for ax in fig.axes)
    plt.close(fig)
