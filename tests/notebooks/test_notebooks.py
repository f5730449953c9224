"""Every notebook under notebooks/ runs headless from top to bottom; its last cell asserts its claims.

Notebooks run with matplotlib's inline backend (headless: it renders PNGs into the outputs), so the test also
sees what a reader sees: every notebook draws at least one figure, and no cell shows the same figure twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "notebooks/ has no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.get("outputs") for cell in code), f"{path.name} is committed with outputs; clear them"
    assert notebook.cells[0].cell_type == "markdown" and "2 CPU cores" in notebook.cells[0].source, \
        f"{path.name}: the first cell says what the notebook shows and how long it takes on 2 CPU cores"
    assert "parameters" in code[0].metadata.get("tags", []), f"{path.name}: the first code cell holds the parameters"
    assert code[-1].source.lstrip().startswith("# The claims of this notebook"), \
        f"{path.name}: the last cell asserts the notebook's claims"
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    figures = 0
    for k, cell in enumerate(c for c in notebook.cells if c.cell_type == "code"):
        images = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        assert len(images) == len(set(images)), f"{path.name}, code cell {k}: a figure is shown twice"
        figures += len(images)
    assert figures, f"{path.name} draws no figure"
