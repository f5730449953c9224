"""One home per concept: verdict names, bit-pattern equality, the model-family tables, GatedDeltaNet
detection, the norm kernels' reduction tree, the attention-function lookup; and no module imports
another module's private names.

Read from the source (ast), so a second copy added anywhere in the packages fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ulptrace
from ulptrace import families
from ulptrace.oracle.judge import VERDICTS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"tracer": "ulptrace", "probes": "ulptrace.probes", "kernels": "ulptrace.kernels"}


def modules() -> dict[str, ast.Module]:
    """Every source file of the three packages, by path relative to the repository."""
    out = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            out[str(path.relative_to(ROOT))] = ast.parse(path.read_text())
    return out


def strings(tree: ast.Module) -> list[str]:
    """String constants that are code, not docstrings."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def test_verdict_names_are_spelled_in_the_oracle_only() -> None:
    spelled = []
    for path, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)} & set(VERDICTS)
                if len(names) >= 3:
                    spelled.append(path)
    assert spelled == ["tracer/oracle/judge.py"]


def test_bit_patterns_have_one_home() -> None:
    defined = sorted((path, node.name) for path, tree in modules().items() for node in tree.body
                     if isinstance(node, ast.FunctionDef) and ("bits" in node.name or "bitwise" in node.name)
                     and not node.name.startswith(("_unsigned", "_from_unsigned")))
    assert defined == [("tracer/comparison.py", "bitwise_equal"), ("tracer/ulp.py", "bits"),
                       ("tracer/ulp.py", "same_bits")]


def test_hf_class_names_are_written_in_the_family_table_only() -> None:
    known = (set(families.DECODER_LAYERS) | set(families.NORM_SCALES) | set(families.GATED_NORMS)
             | {a for archs in families.ARCHITECTURES.values() for a in archs})
    where = sorted({path for path, tree in modules().items() for s in strings(tree) if s in known})
    assert where == ["tracer/families.py"]


def test_gated_deltanet_is_detected_in_one_place() -> None:
    checks = []
    for path, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "hasattr":
                if any(isinstance(a, ast.Constant) and a.value in ("A_log", "dt_bias") for a in node.args):
                    checks.append(path)
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "linear_attention"
                                                     for c in node.comparators):
                checks.append(path)
    assert sorted(set(checks)) == ["tracer/families.py"]
    model = ulptrace.build_model("tiny-qwen3.5")
    found = [name for name, m in model.named_modules() if families.is_gated_deltanet(m)]
    assert found == [f"model.layers.{i}.linear_attn" for i, layer in enumerate(model.model.layers)
                     if getattr(layer, "linear_attn", None) is not None]
    assert found and not any(families.is_gated_deltanet(m) for m in ulptrace.build_model("tiny-llama").modules())


def test_the_tables_are_read_from_the_family_table() -> None:
    import importlib

    from ulptrace.sites import TABLES

    _patches = importlib.import_module("ulptrace.kernels._patches")
    rms_norm = importlib.import_module("ulptrace.kernels.rms_norm")

    assert {name: t.architectures for name, t in TABLES.items()} == families.ARCHITECTURES
    assert _patches.LAYER_FAMILIES is families.DECODER_LAYERS
    assert rms_norm.VARIANTS == {name: "zero_centred" if scale == "one_plus_weight" else "llama"
                                 for name, scale in families.NORM_SCALES.items()}
    assert families.family_of(ulptrace.build_model("tiny-llama")) == "llama"


def test_the_norm_kernels_declare_one_tree() -> None:
    import importlib

    gated = importlib.import_module("ulptrace.kernels.gated_rms_norm")
    plain = importlib.import_module("ulptrace.kernels.rms_norm")
    assert gated.tree_spec is plain.tree_spec


def test_the_attention_registry_is_looked_up_in_one_place() -> None:
    users = sorted({path for path, tree in modules().items() for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and any(a.name == "ALL_ATTENTION_FUNCTIONS" for a in node.names)})
    assert users == ["tracer/sites.py"]


def test_no_module_imports_another_modules_private_names() -> None:
    """``from ulptrace.x import _name`` across modules; a package's own private submodules (``ulptrace.kernels
    ._common`` for the kernels) are the package's business and allowed inside it."""
    offenders = []
    for path, tree in modules().items():
        package = PACKAGES[path.split("/")[0]]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("ulptrace"):
                continue
            for alias in node.names:
                if not alias.name.startswith("_"):
                    continue
                submodule = ROOT / path.split("/")[0] / f"{alias.name}.py"
                if node.module == package and submodule.exists():
                    continue
                offenders.append(f"{path}: from {node.module} import {alias.name}")
    assert offenders == []
