"""The public surface of ``ulptrace`` is pinned: adding or removing a name is a deliberate change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
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
    """Outside the checkout none of the folders is a top-level name (another package of that name may be installed:
    transformers 5.25 requires PyPI's ``kernels``)."""
    root = str(Path(ulptrace.__file__).resolve().parent.parent)
    code = (
        "import importlib.util as u; "
        "import os; "
        "print([n for n in ('tracer', 'probes', 'kernels') "
        f"if (s := u.find_spec(n)) and os.path.dirname(os.path.dirname(s.origin)) == {root!r}])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["tracer", "probes", "kernels"])
def test_in_the_checkouts_root_a_folder_steps_aside_for_the_package_of_its_bare_name(name, tmp_path) -> None:
    """``python -c`` run in the checkout's root has the folders on ``sys.path`` under their bare names: importing one
    gives the installed package of that name (transformers 5.25 imports PyPI's ``kernels``); with none installed, an
    empty module (no ``__version__``: transformers, which imports an unregistered ``kernels`` to read it, then leaves
    it alone) whose every name says what the folder is."""
    root = Path(ulptrace.__file__).resolve().parent.parent
    fake = tmp_path / "site" / name
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("WHO = 'installed'\n")
    env = {**os.environ, "PYTHONPATH": ""}
    code = f"import {name}; print({name}.WHO)"
    # the checkout's root first (the current directory), the installed package right after it
    there = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(1, {str(fake.parent)!r}); {code}"],
                           capture_output=True, text=True, check=False, cwd=root, env=env)
    assert there.returncode == 0 and there.stdout.strip() == "installed", there.stderr
    code = (f"import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; import {name}; "
            f"print(getattr({name}, '__version__', 'N/A'), bool({name}.__file__)); {name}.glu")
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=root, env=env)
    real = "ulptrace" if name == "tracer" else f"ulptrace.{name}"
    assert alone.stdout.split() == ["N/A", "True"], alone.stderr
    assert f"AttributeError: module {name!r} has no attribute 'glu': this checkout's {name}/ folder is imported as " \
           f"{real!r}" in alone.stderr


def test_transformers_models_load_when_run_from_the_checkouts_root() -> None:
    root = Path(ulptrace.__file__).resolve().parent.parent
    code = "from ulptrace.models import build_model; print(type(build_model('tiny-llama')).__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=root,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "LlamaForCausalLM", done.stderr


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
