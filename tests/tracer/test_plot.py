"""The verdict map: classes per cell, onset ringed, no plt.show, clear error on an empty report."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from ulptrace.plot import plot_verdict_map, worst_class  # noqa: E402


def entry(site, step, equal=True, verdicts=None):
    return {"site": site, "step": step, "bitwise_equal": equal, "verdicts": verdicts}


V = lambda **k: {**dict.fromkeys(("exact", "tie", "boundary", "error", "nonfinite"), 0), **k}  # noqa: E731


def test_worst_class_orders_verdicts() -> None:
    assert worst_class(entry("a", 0)) == "equal"
    assert worst_class(entry("a", 0, False, None)) == "unjudged"
    assert worst_class(entry("a", 0, False, V(exact=3, tie=1))) == "tie"
    assert worst_class(entry("a", 0, False, V(tie=5, boundary=1))) == "boundary"
    assert worst_class(entry("a", 0, False, V(boundary=9, error=1))) == "error"
    assert worst_class(entry("a", 0, False, V(error=1, nonfinite=1))) == "nonfinite"


def test_map_draws_cells_and_rings_the_onset() -> None:
    data = {
        "sites": [entry("x", 0), entry("y", 0, False, V(boundary=2)), entry("x", 1), entry("y", 1, False, V(tie=1))],
        "onset": {"site": "y", "step": 0, "kind": "norm", "layer": 0},
        "reference": {"path": "hf", "model": "m"}, "candidate": {"path": "c"},
    }
    fig = plot_verdict_map(data)
    ax = fig.axes[0]
    assert ax.get_title() == "c vs hf on m"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["x", "y"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["prefill", "decode 1"]
    image = ax.get_images()[0].get_array()
    # rows x, y; columns step 0, 1 — classes as indices into the colour order
    from ulptrace.plot import _ORDER

    assert [[_ORDER[int(v)] for v in row] for row in image.tolist()] == [["equal", "equal"], ["boundary", "tie"]]
    ring = ax.collections[0].get_offsets().tolist()
    assert ring == [[0.0, 1.0]]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:3] == ["equal", "tie", "boundary"] and legend[-1].startswith("onset: y")


def test_empty_report_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no site entries"):
        plot_verdict_map({"sites": []})
