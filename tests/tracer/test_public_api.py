"""The public surface of ``ulptrace`` is pinned: adding or removing a name is a deliberate change."""

from __future__ import annotations

import subprocess
import sys

import ulptrace

PUBLIC = {
    "DEFAULT_TREES", "FORMATS", "FloatFormat", "HISTOGRAM_BUCKETS", "LazyTrace", "OracleJudge", "Record",
    "Recorder", "Site", "SiteDiff", "StreamingComparator", "Trace", "TraceError", "TraceWriter", "Tree",
    "UlpAssertionError", "Comparison", "__version__", "admissible", "apply_path", "assert_ulp_close",
    "build_model", "capture_semantics", "compare", "emulate", "first_difference", "inject_fault", "judge",
    "list_models", "list_paths", "load_trace", "matching_trees", "next_down", "next_up", "onset", "plot_verdict_map",
    "reduce_fp32", "register_path", "round_to", "site_table", "spacing", "trees_by_row", "ulp_distance",
    "ulp_histogram", "RunConfig", "Session", "DecodeState", "MODES", "make_prompts", "greedy",
    "explain", "Explanation", "plot_ulp_histograms", "plot_error_growth", "plot_midpoint_distance",
    "plot_tree_findings", "plot_norm_rounding", "plot_report", "plot_matrix", "plot_lockstep",
}


def test_all_is_pinned() -> None:
    assert set(ulptrace.__all__) == PUBLIC


def test_every_public_name_resolves() -> None:
    for name in ulptrace.__all__:
        assert getattr(ulptrace, name) is not None, name


def test_import_is_light_and_has_no_side_effects() -> None:
    code = (
        "import sys, ulptrace; "
        "heavy = [m for m in ('torch', 'transformers', 'matplotlib', 'ulptrace.kernels') if m in sys.modules]; "
        "print(heavy)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    assert done.stderr == ""


def test_no_top_level_tracer_probes_or_kernels_package() -> None:
    code = (
        "import importlib.util as u; "
        "print([n for n in ('tracer', 'probes', 'kernels') if u.find_spec(n) is not None])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert done.stdout.strip() == "[]"


def test_public_names_are_not_shadowed_by_submodules() -> None:
    """Importing every submodule must not replace a public function by a module of the same name."""
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(ulptrace.__path__, "ulptrace."):
        if info.name.startswith("ulptrace.kernels") or info.name == "ulptrace.__main__":
            continue
        importlib.import_module(info.name)
    import types

    for name in ulptrace.__all__:
        assert not isinstance(getattr(ulptrace, name), types.ModuleType), name


def test_core_never_imports_probes() -> None:
    """Layers point down: only the CLI (which wires probes) may import ``ulptrace.probes``."""
    import ast
    from pathlib import Path

    core = Path(ulptrace.__file__).parent
    offenders = []
    for path in sorted(core.rglob("*.py")):
        if path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("ulptrace.probes")]
    assert offenders == []
