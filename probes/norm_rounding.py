"""``trace_norm_rounding``: are a candidate's norm differences honest rounding, a missing boundary, or a bug?

Runs the reference and a candidate path (default ``kernels:fused``) on the embedded default model
over a prefill and a few decode steps, records every norm-kind site (input/post-attention norms,
q/k norms, the GatedDeltaNet gated norm, the final norm), and for each (site, step) reports the
differing elements, the ULP histogram, the oracle's verdict counts and the named boundary. For
rows whose differences are ties, it also says which explicit FP32 reduction orders
(``ulptrace.trees``) reproduce the reference's row and the candidate's row bit for bit. It ends
with a paragraph a reviewer can paste into a PR, and exits non-zero unless the comparison is at
parity (``Comparison.parity``, the decision the ``ulptrace`` exit codes and the pytest fixture use:
no ``boundary``/``error``/``nonfinite`` verdict, no record the oracle could not judge unless
``--allow-could-not-judge``, none missing; ``--report-only`` keeps it zero).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch

NORM_KINDS = ("norm", "gated_norm")


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def tree_findings(judge: Any, ref: Any, cand: Any, trees: Sequence[Any], max_rows: int = 8) -> dict[str, Any] | None:
    """For up to ``max_rows`` rows where the two outputs differ only by ties: which trees reproduce each side.

    Returns ``{"rows": [{"row": r, "reference": [specs], "candidate": [specs]}], "summary": {...}}``
    or None when the site has no semantics or no differing rows.
    """
    from ulptrace.oracle import emulate
    from ulptrace.trees import reduce_fp32
    from ulptrace.ulp import bits

    site = judge.site(ref.site)
    if site is None or site.formula is None or not ref.inputs:
        return None
    differ = (bits(_rows(ref.out)) != bits(_rows(cand.out))).any(-1)
    rows = differ.nonzero().flatten()[:max_rows]
    if rows.numel() == 0:
        return None

    def subset(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: _rows(v)[rows] for k, v in inputs.items()}

    program = judge.program(site, subset(ref.inputs))
    ref_in, cand_in = subset(ref.inputs), subset(cand.inputs)
    ref_out, cand_out = _rows(ref.out)[rows], _rows(cand.out)[rows]
    found: dict[str, list[list[str]]] = {"reference": [[] for _ in rows], "candidate": [[] for _ in rows]}
    for tree in trees:
        reducer = lambda x, dim, tree=tree: reduce_fp32(x, tree, dim)
        for side, inputs, target in (("reference", ref_in, ref_out), ("candidate", cand_in, cand_out)):
            try:
                emulated = emulate(program, inputs, reducer=reducer)
            except (NotImplementedError, ValueError, TypeError):
                return None
            same = (bits(emulated) == bits(target)).all(-1)
            for i in same.nonzero().flatten().tolist():
                found[side][i].append(str(tree))
    entries = [{"row": int(r), "reference": found["reference"][i], "candidate": found["candidate"][i]}
               for i, r in enumerate(rows.tolist())]
    return {"rows": entries, "summary": _common(entries)}


def rounding_example(comparison: Any, ref_trace: Any, cand_trace: Any, judge: Any) -> dict[str, Any] | None:
    """One judged norm record's differing elements against the rounding midpoints (``rounding`` in the JSON,
    drawn by ``--plot``): the first record with a boundary or error, else the first whose inputs are bitwise
    equal, else the first that differs; None without verdicts. See ``ulptrace.explain``."""
    from ulptrace.elements import explain

    judged = [d for d in comparison.sites if not d.bitwise_equal and d.verdicts] if judge is not None else []
    pick = next((d for d in judged if d.own_error), None) or next((d for d in judged if d.inputs_equal), None) \
        or next(iter(judged), None)
    if pick is None:
        return None
    try:
        return explain(ref_trace, cand_trace, judge, site=pick).midpoint_histogram()
    except (NotImplementedError, ValueError, TypeError) as exc:  # the oracle could not replay it: say so
        return {"site": pick.site, "step": pick.step, "elements": 0, "note": f"{type(exc).__name__}: {exc}"}


_KIND_RANK = {"torch_cpu": 0, "sequential": 1, "pairwise": 2, "numpy": 3, "blocked": 4}


def _order_key(spec: str) -> tuple[int, int, str]:
    """Simple, familiar orders first: torch CPU, sequential, pairwise, numpy, then CUDA blocks."""
    return (_KIND_RANK.get(spec.split(":")[0], 9), len(spec), spec)


def _common(entries: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Trees that reproduce *every* examined row, per side (simplest first)."""
    out = {}
    for side in ("reference", "candidate"):
        sets = [set(e[side]) for e in entries]
        out[side] = sorted(set.intersection(*sets), key=_order_key) if sets else []
    return out


def conclusion(data: dict[str, Any]) -> str:
    """One paragraph, from the measured data, that a reviewer can paste into a PR."""
    from ulptrace.oracle.judge import explained_share

    sites = data["sites"]
    ref, cand = data["reference"].get("path", "?"), data["candidate"].get("path", "?")
    head = f"{cand} vs {ref} on {data['reference'].get('model', '?')} ({len(sites)} norm records)"
    differing = [s for s in sites if not s["bitwise_equal"]]
    if not differing:
        return f"{head}: every norm output is bitwise identical."
    unjudgeable = [s for s in sites if s.get("could_not_judge")]
    unjudged = [s for s in differing if s["verdicts"] is None and not s.get("could_not_judge")]
    count = lambda key: sum((s["verdicts"] or {}).get(key, 0) for s in differing)
    ties, boundary, error, nonfinite = count("tie"), count("boundary"), count("error"), count("nonfinite")
    total = sum(s["differing"] for s in differing)
    parts = []
    own = [s for s in differing if all(v == 0 for v in s["input_delta"].values())]
    inherited = len(differing) - len(own)
    if all(s["verdicts"] is None and not s.get("could_not_judge") for s in differing):
        max_ulp = max((s["max_ulp"] or 0) for s in differing)
        parts.append(f"{total:,} norm elements differ in {len(differing)} records, at most {max_ulp} ULP; not judged "
                     f"(--no-oracle), {len(own)} of the records on bitwise-equal inputs")
    elif boundary == error == nonfinite == 0:
        if own:
            own_total = sum(s["differing"] for s in own)
            max_ulp = max((s["max_ulp"] or 0) for s in own)
            parts.append(f"all {total:,} differing norm elements in {len(differing)} records are inside the "
                         f"admissible set of the reference's semantics (ties); in the {len(own)} records whose "
                         f"inputs are bitwise equal, {own_total:,} elements differ by rounding order alone, at most "
                         f"{max_ulp} ULP")
        else:
            parts.append(f"all {total:,} differing norm elements in {len(differing)} records are inside the "
                         f"admissible set of the reference's semantics (ties)")
        if inherited:
            delta = max((v or 0) for s in differing for v in s["input_delta"].values())
            parts.append(f"{inherited} of those records differ because their inputs already differ, by up to "
                         f"{delta:,} ULP (inherited from upstream: where that began is outside the norms — "
                         "`ulptrace onset` looks at every site)")
        trees = _tree_sentence(data)
        if trees:
            parts.append(trees)
    else:
        parts.append(f"{total:,} norm elements differ: {ties:,} ties, {boundary:,} boundary, {error:,} error"
                     + (f", {nonfinite:,} nonfinite" if nonfinite else ""))
        named: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for s in differing:
            if s["boundary"] and (s["verdicts"] or {}).get("boundary"):
                named.setdefault((s["site"], s["boundary"]), []).append(s)
        for (site, boundary_name), group in list(named.items())[:3]:
            out_of_set = sum(g["verdicts"]["boundary"] + g["verdicts"]["error"] for g in group)
            share = sum((g["explained"] or 0) * (g["verdicts"]["boundary"] + g["verdicts"]["error"]) for g in group)
            pct = explained_share(share / out_of_set if out_of_set else 0.0)
            parts.append(f"{site}: {boundary_name} explains {pct} of {out_of_set:,} out-of-set elements"
                         f" over {len(group)} step(s)")
        if len(named) > 3:
            parts.append(f"{len(named) - 3} more site(s) with a named boundary")
        errors = [s for s in differing if (s["verdicts"] or {}).get("error")]
        if errors:
            e = errors[0]
            parts.append(f"first error at step {e['step']} {e['site']}: {e['verdicts']['error']:,} elements no "
                         f"hypothesis explains, up to {e['max_error_ulp']} ULP outside the admissible set")
        if data.get("onset"):
            parts.append(f"the first norm record with a boundary or error is step {data['onset']['step']}, "
                         f"{data['onset']['site']} (`ulptrace onset` looks at every site)")
    if unjudgeable:
        parts.append(f"the oracle could not judge {len(unjudgeable)} record(s) (first: step {unjudgeable[0]['step']} "
                     f"{unjudgeable[0]['site']}: {unjudgeable[0]['could_not_judge']})")
    if unjudged and len(unjudged) < len(differing):
        parts.append(f"{len(unjudged)} differing record(s) have no verdicts ({unjudged[0].get('note')})")
    return f"{head}: " + "; ".join(parts) + "."


def _tree_sentence(data: dict[str, Any]) -> str:
    """Which catalogued FP32 orders reproduce each side, over every examined tie row."""
    findings = [t["findings"] for t in data.get("trees", []) if t["findings"]]
    if not findings:
        return ""
    ref = set.intersection(*[set(f["summary"]["reference"]) for f in findings])
    cand = set.intersection(*[set(f["summary"]["candidate"]) for f in findings])
    rows = sum(len(f["rows"]) for f in findings)

    def fmt(trees: set[str]) -> str:
        shown = ", ".join(sorted(trees, key=_order_key)[:3])
        return f"{len(trees)} order(s) ({shown}{', ...' if len(trees) > 3 else ''})" if trees else "no catalogued order"

    only_cand = cand - ref
    text = (f"over {rows} examined tie rows, {fmt(ref)} reproduce the reference bit for bit and {fmt(cand)} the "
            "candidate")
    if only_cand:
        text += f"; the candidate's rows are explained by an order the reference does not use: {fmt(only_cand)}"
    return text


def norm_kinds(kinds: Sequence[str] | None) -> list[str]:
    """The norm kinds to record: ``kinds`` (``--kinds``) when given, which must be norm kinds; else all.
    ``--kinds`` given without a value is refused, not read as every norm kind."""
    if kinds is None:
        return list(NORM_KINDS)
    if not kinds:
        raise ValueError(f"--kinds needs at least one kind: expected some of {', '.join(NORM_KINDS)}")
    other = [k for k in kinds if k not in NORM_KINDS]
    if other:
        raise ValueError(f"trace_norm_rounding looks at norm kinds only: --kinds must be some of "
                         f"{', '.join(NORM_KINDS)}, but got {', '.join(other)}")
    return list(dict.fromkeys(kinds))


def allowed(args: argparse.Namespace) -> tuple[str, ...]:
    """What ``--allow-could-not-judge`` lets pass the parity decision."""
    from ulptrace.comparison import COULD_NOT_JUDGE

    return (COULD_NOT_JUDGE,) if getattr(args, "allow_could_not_judge", False) else ()


def run(args: argparse.Namespace, progress: Any = None) -> tuple[Any, dict[str, Any]]:
    """Record both paths (norm sites only), judge, analyse trees; returns (comparison, the JSON report)."""
    from ulptrace.comparison import compare
    from ulptrace.probes.onset import record_pair
    from ulptrace.cli import seed_of
    from ulptrace.run import RunConfig
    from ulptrace.trees import DEFAULT_TREES, Tree
    from ulptrace.verdicts import OracleJudge

    say = progress or (lambda msg: None)
    cfg = RunConfig(model=args.model, reference=args.reference, candidate=args.candidate, prompts=args.prompts,
                    prompt_len=args.prompt_len, new_tokens=args.new_tokens, cache_len=args.cache_len,
                    seed=seed_of(args), device=args.device, dtype=args.dtype, sdpa=args.sdpa, sites=args.sites,
                    kinds=norm_kinds(args.kinds), layers=args.layers, steps=args.steps)
    from ulptrace.run import check_run
    from ulptrace.sdpa import default_note

    check_run(cfg)  # bad input refused before the run is announced
    note = default_note(cfg.device, cfg.sdpa)
    if note:
        say(note)
    say(f"recording {cfg.reference!r} and {cfg.candidate!r} on {cfg.model}: {cfg.prompts} prompts x "
        f"{cfg.prompt_len} tokens, {cfg.new_tokens} steps, {', '.join(cfg.kinds)} sites only")
    with ExitStack() as stack:  # the reference's path stays applied while its semantics judge, then is undone
        ref_trace, cand_trace, ref_model, info = record_pair(cfg, stack)
        judge = None
        if not args.no_oracle:
            # the reference is always judged against its own semantics here (reference_outside per record)
            judge = OracleJudge(ref_model, judge_reference=True)
            say("judging every norm record against the oracle")
        comparison = compare(ref_trace, cand_trace, judge=judge, max_ulp=args.max_ulp)
        data = comparison.to_json(allow=allowed(args))
        data["run"] = info
        trees = [Tree.parse(t) for t in args.trees] if args.trees else list(DEFAULT_TREES)
        data["trees"] = []
        for diff in comparison.sites if judge is not None else []:
            if diff.bitwise_equal or not diff.verdicts or diff.verdicts.get("tie", 0) == 0:
                continue
            findings = tree_findings(judge, ref_trace[diff.site, diff.step], cand_trace[diff.site, diff.step], trees)
            data["trees"].append({"site": diff.site, "step": diff.step, "findings": findings})
        data["rounding"] = rounding_example(comparison, ref_trace, cand_trace, judge)
    data["conclusion"] = conclusion(data)
    return comparison, data


def render(data: dict[str, Any], all_rows: bool = False) -> str:
    from ulptrace.report import to_table

    lines = [to_table(data, all_rows=all_rows)]
    if data["trees"]:
        lines += ["", "FP32 reduction orders reproducing each side of tie rows (bit for bit):"]
        for t in data["trees"][:12]:
            s = (t["findings"] or {}).get("summary")
            if s:
                ref, cand = (f"{len(s[k])} orders, e.g. {', '.join(s[k][:2])}" if s[k] else "none"
                             for k in ("reference", "candidate"))
                lines.append(f"  step {t['step']} {t['site']}: reference {ref} | candidate {cand}")
    lines += ["", "Conclusion: " + data["conclusion"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from ulptrace.cli import Parser, add_path_options, add_report_options, add_run_options

    parser = Parser(prog="trace_norm_rounding", description=__doc__.split("\n\n")[0])
    add_run_options(parser)
    add_path_options(parser, "kernels:fused")
    parser.add_argument("--trees", nargs="*", default=None, metavar="SPEC",
                        help="FP32 reduction orders to try (default: ulptrace.trees.DEFAULT_TREES)")
    parser.add_argument("--report-only", action="store_true",
                        help="exit 0 even when not at parity (boundary/error verdicts, records that could not be judged)")
    add_report_options(parser, check_reference=False)  # the reference is always judged against its semantics
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ulptrace.cli import cwd_on_path, emit, quiet_transformers, report_progress, run_cli, set_quiet

    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("trace_norm_rounding: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    set_quiet(args)
    cwd_on_path()
    quiet_transformers()

    def job(args: argparse.Namespace) -> int:
        comparison, data = run(args, progress=report_progress)
        emit(data, args, render(data, all_rows=args.all))
        at_parity = comparison.parity(allowed(args))
        return 0 if at_parity or args.report_only else 1

    return run_cli(job, args)


def console() -> None:
    """The ``trace_norm_rounding`` console script: :func:`main`, then the process ends without the interpreter's
    teardown (``ulptrace.exiting``); host memory freed by one op is kept for the next (``ulptrace.host_memory``)."""
    from ulptrace.exiting import exit_now
    from ulptrace.host_memory import keep_freed_memory

    keep_freed_memory()
    exit_now(main())


if __name__ == "__main__":  # pragma: no cover
    console()
