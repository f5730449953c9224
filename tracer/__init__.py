"""ulptrace: where does a kernel-injected model start to diverge from HF, by how many ULPs, and why.

The public surface is re-exported here lazily: ``import ulptrace`` imports neither torch-heavy
optional parts (transformers, matplotlib) nor any submodule until a name is used, and has no side
effects. ``__all__`` is pinned by ``tests/tracer/test_public_api.py``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    # ULP arithmetic
    "FORMATS": "ulp",
    "FloatFormat": "ulp",
    "HISTOGRAM_BUCKETS": "ulp",
    "ulp_distance": "ulp",
    "spacing": "ulp",
    "next_up": "ulp",
    "next_down": "ulp",
    "round_to": "ulp",
    "ulp_histogram": "ulp",
    # assertions
    "assert_ulp_close": "assertions",
    "UlpAssertionError": "assertions",
    # models and paths
    "build_model": "models",
    "list_models": "models",
    "apply_path": "paths",
    "list_paths": "paths",
    "register_path": "paths",
    # recording, traces, comparison
    "Site": "sites",
    "site_table": "sites",
    "Recorder": "record",
    "Record": "trace",
    "Trace": "trace",
    "TraceWriter": "trace",
    "TraceError": "trace",
    "LazyTrace": "trace",
    "load_trace": "trace",
    "inject_fault": "faults",
    "compare": "comparison",
    "first_difference": "comparison",
    "onset": "comparison",
    "Comparison": "comparison",
    "SiteDiff": "comparison",
    "StreamingComparator": "comparison",
    # the run layer
    "RunConfig": "run",
    "Session": "run",
    "DecodeState": "run",
    "MODES": "run",
    "make_prompts": "run",
    "greedy": "run",
    # oracle and reduction trees
    "capture_semantics": "oracle",
    "judge": "oracle",
    "admissible": "oracle",
    "emulate": "oracle",
    "OracleJudge": "verdicts",
    "Tree": "trees",
    "DEFAULT_TREES": "trees",
    "reduce_fp32": "trees",
    "matching_trees": "trees",
    "trees_by_row": "trees",
    # one record, element by element
    "explain": "elements",
    "Explanation": "elements",
    # plots (matplotlib imported on first use)
    "plot_verdict_map": "plot",
    "plot_ulp_histograms": "plot",
    "plot_error_growth": "plot",
    "plot_midpoint_distance": "plot",
    "plot_tree_findings": "plot",
    "plot_norm_rounding": "plot",
    "plot_report": "plot",
    "plot_matrix": "plot",
    "plot_lockstep": "plot",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ulptrace' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ulptrace.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if __name__ == "tracer":  # this folder reached as a top-level package from the checkout's root
    from ulptrace._toplevel import step_aside

    step_aside(__name__, __file__, globals())
