"""The ``ulptrace`` command line: thin wrappers over the library.

``ulptrace models | paths | record | compare | onset | sites | semantics | clean``. Long work reports
progress on stderr; results go to stdout as a table, and to files with ``--json FILE`` /
``--markdown FILE``. Bad input (unknown model, path, site, an empty selection, a broken trace, an
unwritable output path, traces of different run inputs) exits with status 2 and one line saying
what was expected and what was found, never a traceback — checked before the first model is built
wherever possible. A user's path function that raises gets one line naming the path plus the
user's own frames; Ctrl-C exits 130 with one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any


class Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (exit 2) instead of the usage block."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_run_options(parser: argparse.ArgumentParser, *, paths: bool = True) -> None:
    """Options shared by every command that runs a model (also used by ``trace_norm_rounding``)."""
    from ulptrace.catalog import DEFAULT_MODEL
    from ulptrace.sdpa import SDPA_BACKENDS

    g = parser.add_argument_group("run")
    g.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name or local HF checkpoint dir "
                   f"(default {DEFAULT_MODEL}; `ulptrace models` lists them)")
    g.add_argument("--prompts", type=int, default=2, help="number of seeded random prompts (batch rows)")
    g.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt")
    g.add_argument("--new-tokens", type=int, default=4, help="greedy steps: prefill + new_tokens-1 decodes")
    g.add_argument("--cache-len", type=int, default=None, help="static-cache length for the static and graph modes "
                   "(default prompt length + new tokens)")
    g.add_argument("--seed", type=int, default=None, help="seed for weights and prompts (default 0)")
    g.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    g.add_argument("--dtype", default="bfloat16", help="model dtype: bfloat16 (default), float16 or float32")
    g.add_argument("--sdpa", default="default", choices=SDPA_BACKENDS,
                   help="torch's attention backend, pinned on every model of the run (default: torch's choice per "
                        "call; on CUDA that can be cuDNN's, which did not repeat its bits run after run on an H200 — "
                        "flash or math do)")
    s = parser.add_argument_group("selection")
    s.add_argument("--sites", nargs="*", default=None, metavar="GLOB", help="site name globs, e.g. 'layers.*.mlp.glu'")
    s.add_argument("--kinds", nargs="*", default=None, metavar="KIND",
                   help="site kinds (norm, gated_norm, glu, gates, attention, residual, state, logits, linear, other)")
    s.add_argument("--layers", default=None, help="layer range, e.g. 2:5")
    s.add_argument("--steps", default=None, help="step range, e.g. 0:3 (0 = prefill)")
    parser.add_argument("--quiet", action="store_true", help=QUIET_HELP)


def add_report_options(parser: argparse.ArgumentParser, *, check_reference: bool = True) -> None:
    """Report and judging options shared by ``compare``, ``onset`` and ``trace_norm_rounding``
    (``check_reference=False`` for a command that always judges the reference)."""
    g = parser.add_argument_group("report")
    g.add_argument("--json", metavar="FILE", help="write the JSON report to FILE ('-' for stdout)")
    g.add_argument("--markdown", metavar="FILE", help="write a markdown report to FILE")
    g.add_argument("--plot", metavar="FILE", type=plot_file, help="draw the report's figures into FILE (.png, .pdf "
                   "or .svg; needs matplotlib: pip install 'ulptrace[plot]')")
    g.add_argument("--all", action="store_true", help="show bitwise-equal rows too")
    g.add_argument("--max-ulp", type=non_negative_int, default=0, help="budget for sites without oracle semantics")
    g.add_argument("--no-oracle", action="store_true", help="skip verdicts (ULP statistics only)")
    if check_reference:
        g.add_argument("--check-reference", action="store_true",
                       help="also judge the reference against its own semantics (reference_outside per site)")
    g.add_argument("--allow-could-not-judge", action="store_true",
                   help="do not fail the parity decision on sites the oracle could not judge (they are then held "
                        "to --max-ulp like sites without semantics)")


def non_negative_int(text: str) -> int:
    """An option's integer that cannot be negative (a ULP budget), checked while the arguments are parsed."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, but got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, but got {value}")
    return value


def split_only(text: str) -> str:
    """``--concurrent``'s one value: ``split`` (the candidate in a process of its own too)."""
    if text != "split":
        raise argparse.ArgumentTypeError(f"expected no value or 'split', but got {text!r}")
    return text


def plot_file(path: str) -> str:
    """``--plot FILE``, checked while the arguments are parsed (before any model is built)."""
    from ulptrace.plot import check_plot_file

    try:
        return check_plot_file(path)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


FAIL_HELP = ("exit 1 unless the comparison is at parity: an onset (a verdict worse than tie, an unjudged or "
             "unobserved difference), a site the oracle could not judge (see --allow-could-not-judge), or a record "
             "missing, extra or of another shape")


def parity_allow(args: argparse.Namespace) -> tuple[str, ...]:
    """What the parity decision tolerates, from ``--allow-could-not-judge``."""
    from ulptrace.comparison import COULD_NOT_JUDGE

    return (COULD_NOT_JUDGE,) if getattr(args, "allow_could_not_judge", False) else ()


def add_mode_option(group: Any, flag: str, what: str) -> None:
    """A run-mode option (``--mode``, ``--reference-mode``, ``--candidate-mode``)."""
    from ulptrace.catalog import MODES

    group.add_argument(flag, default="eager", choices=MODES,
                       help=f"how {what} runs: eager (dynamic cache), static (static cache), graph (static cache, "
                            "decode steps replayed from a CUDA graph; needs --device cuda)")


def seed_of(args: argparse.Namespace) -> int:
    """``--seed`` as given, else 0. Its default is None so that a command that does not take it (``matrix``: its
    ``--seeds``) can tell it was given, even as 0."""
    return 0 if args.seed is None else args.seed


def _config(args: argparse.Namespace, **overrides: Any) -> Any:
    from ulptrace.run import RunConfig

    fields = dict(model=args.model, prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                  cache_len=args.cache_len, seed=seed_of(args), device=args.device, dtype=args.dtype, sdpa=args.sdpa, sites=args.sites, kinds=args.kinds,
                  layers=args.layers, steps=args.steps)
    fields.update(overrides)
    from ulptrace.sdpa import default_note

    note = default_note(args.device, args.sdpa)
    if note:
        report_progress(note)
    return RunConfig(**fields)


QUIET = False  # --quiet: no progress lines, no progress bar (errors and warnings still go to stderr)
QUIET_HELP = "no progress lines or progress bar on stderr (the bar is drawn only on a terminal, never when CI is set)"


def report_progress(msg: str) -> None:
    """One progress line on stderr (every command, and ``trace_norm_rounding``, reports this way)."""
    if not QUIET:
        print(f"[ulptrace] {msg}", file=sys.stderr, flush=True)


def set_quiet(args: argparse.Namespace) -> None:
    """Apply ``--quiet`` (commands without it keep reporting)."""
    global QUIET
    QUIET = bool(getattr(args, "quiet", False))


def progress_bar() -> Any:
    """The progress bar of a long run (``ulptrace.progress.Progress``): drawn on a terminal, never in CI or
    with ``--quiet``."""
    from ulptrace.progress import Progress, bar_enabled

    return Progress(enabled=bar_enabled(quiet=QUIET))


PATH_HELP = ("a registered path (`ulptrace paths` lists them: hf, hf:attn=<impl>, kernels:faithful, kernels:fused, "
             "compile, compile:emulate, liger, hf:fla), "
             "fault:SITE@STEP[+ULPS], or your own package.module:function that patches the model in place")


def add_path_options(parser: argparse.ArgumentParser, candidate_default: str) -> None:
    """``--reference`` and ``--candidate`` (onset, ``trace_norm_rounding``)."""
    parser.add_argument("--reference", default="hf", metavar="PATH",
                        help="the path judged against (default hf, HF as configured): " + PATH_HELP)
    parser.add_argument("--candidate", default=candidate_default, metavar="PATH",
                        help=f"the path under test (default {candidate_default}): " + PATH_HELP)


def check_output_file(path: str | None, flag: str) -> None:
    """A report file we will write: not a directory, in an existing writable directory ('-' is stdout)."""
    if path is None or path == "-":
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a directory: expected a file name to write the report to")
    _check_parent(target, flag, path)
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{flag} {path} exists and is not writable")


def check_output_dir(path: str | None, flag: str) -> None:
    """A trace directory we will create: must not exist yet; its parent must exist and be writable."""
    if path is None:
        return
    target = Path(path)
    if target.exists() or target.is_symlink():
        kind = "a directory" if target.is_dir() else "a file"
        raise ValueError(f"{flag} {path} already exists ({kind}): expected a new trace directory name "
                         "(remove it or choose another)")
    _check_parent(target, flag, path)


def _check_parent(target: Path, flag: str, path: str) -> None:
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the directory {str(parent)!r} is not writable")


def check_outputs(args: argparse.Namespace) -> None:
    """Every output path of a command, checked before any work (a bad path must not cost a run)."""
    check_output_file(getattr(args, "json", None), "--json")
    check_output_file(getattr(args, "markdown", None), "--markdown")
    check_output_dir(getattr(args, "out", None), "--out")


def emit(data: dict[str, Any], args: argparse.Namespace, table: str) -> None:
    """Print ``table`` (unless JSON goes to stdout) and write the requested report files."""
    from ulptrace.report import to_json, to_markdown

    if args.json == "-":
        print(to_json(data))
    else:
        print(table)
        if args.json:
            Path(args.json).write_text(to_json(data))
            report_progress(f"JSON report written to {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(to_markdown(data, all_rows=args.all))
        report_progress(f"markdown report written to {args.markdown}")
    if getattr(args, "plot", None):
        from ulptrace.plot import save_report

        save_report(data, args.plot)
        report_progress(f"figure written to {args.plot}")


def cmd_models(args: argparse.Namespace) -> int:
    from ulptrace.models import format_count, list_models

    for m in list_models():
        print(f"{m['name']:<14} {m['family']:<8} {format_count(m['parameters']):>7} params  {m['description']}")
    return 0


def cmd_paths(args: argparse.Namespace) -> int:
    from ulptrace.paths import list_paths, unavailable

    for name, description in list_paths().items():
        missing = unavailable(name)
        print(f"{name:<18} {description}" + (f" [not available here: {missing}]" if missing else ""))
    print(f"{'hf:attn=<impl>':<18} HF with another attention implementation")
    print(f"{'fault:SITE@STEP[+ULPS]':<18} HF with one element of SITE's output at STEP moved by ULPS (default 1) "
          "ULPs, e.g. fault:layers.1.mlp.glu@2+1: checks that a setup locates a difference exactly")
    print(f"{'pkg.module:fn':<18} your own function fn(model) that patches the model in place")
    return 0


def _recorded_model_name(model: str) -> str:
    """The model name a trace records for ``--model`` (embedded name, or the checkpoint's absolute path)."""
    from ulptrace.catalog import MODELS

    return model if model in MODELS else os.path.abspath(model)


def forced_tokens(trace: str, cfg: Any) -> Any:
    """The tokens ``trace`` was fed at its decode steps, checked against the run ``cfg`` will make."""
    import torch
    from ulptrace.run import fed_tokens, input_differences
    from ulptrace.trace import read_manifest

    meta = read_manifest(trace)["metadata"]
    planned = {"model": _recorded_model_name(cfg.model), "seed": cfg.seed, "prompts": [cfg.prompts, cfg.prompt_len],
               "new_tokens": cfg.new_tokens}
    differences = input_differences(meta, planned)
    if differences:
        raise ValueError(f"--forced-from {trace} was recorded with other run inputs than this run ("
                         f"{'; '.join(d.replace('reference', 'that trace').replace('candidate', 'this run') for d in differences)}"
                         "): use the same --model, --seed, --prompts, --prompt-len and --new-tokens")
    tokens = fed_tokens(meta)
    if tokens is None:
        raise ValueError(f"--forced-from {trace}: the trace records no tokens (expected a trace written by "
                         "`ulptrace record`, whose manifest has a 'tokens' key)")
    forced = torch.tensor(tokens, dtype=torch.long)
    if cfg.new_tokens > 1 and tuple(forced.shape) != (cfg.prompts, cfg.new_tokens - 1):
        raise ValueError(f"--forced-from {trace}: expected tokens of shape [{cfg.prompts}, {cfg.new_tokens - 1}] "
                         f"(prompts x decode steps), but the trace has {list(forced.shape)}")
    return forced


def cmd_record(args: argparse.Namespace) -> int:
    import torch
    from ulptrace.models import build_model
    from ulptrace.paths import apply_path, resolve_path
    from ulptrace.record import Recorder
    from ulptrace.run import greedy, make_prompts, run_metadata, selected_sites, selection_metadata, torch_dtype
    from ulptrace.sites import parse_range
    from ulptrace.trace import TraceWriter

    cfg = _config(args, reference=args.path, reference_mode=args.mode)
    cfg.validate()
    resolve_path(args.path)
    forced = forced_tokens(args.forced_from, cfg) if args.forced_from else None
    model = build_model(cfg.model, dtype=torch_dtype(cfg.dtype), device=cfg.device, seed=cfg.seed, sdpa=cfg.sdpa)
    prompts = make_prompts(model.config.vocab_size, cfg.prompts, cfg.prompt_len, cfg.seed, cfg.device)
    writer = None
    try:
        with apply_path(model, args.path) as applied:
            writer = TraceWriter(args.out)
            for stale in writer.removed_stale:
                report_progress(f"removed {stale.path}: a temporary trace directory of a writer that no longer runs "
                          f"(pid {stale.pid}, {stale.bytes:,} bytes)")
            meta = {**run_metadata(cfg, prompts, args.mode), "path_info": applied.info, "selection": selection_metadata(cfg),
                    "forced_from": str(Path(args.forced_from).resolve()) if args.forced_from else None}
            with Recorder(model, sites=selected_sites(model, cfg), steps=parse_range(cfg.steps), sink=writer,
                          path=args.path, metadata=meta) as rec, torch.no_grad():
                tokens = greedy(model, prompts, cfg.new_tokens, forced=forced, mode=args.mode)
            fed = forced if forced is not None else tokens[:, :-1]
            metadata = {**rec.metadata, "tokens": tokens.tolist(), "fed_tokens": fed.tolist()}
        writer.close(metadata)  # after the path is undone and verified (a fault that never fired raises)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if forced is not None:
        report_progress(f"trace written to {args.out}; decode steps were fed the tokens of {args.forced_from} (forced)")
    else:
        report_progress(f"trace written to {args.out}; decode steps were fed this path's own greedy tokens (not forced: "
                  "to compare it with a reference trace step for step, record it with --forced-from REFERENCE)")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from ulptrace.comparison import compare
    from ulptrace.report import to_table
    from ulptrace.trace import LazyTrace

    from ulptrace.run import input_differences

    reference, candidate = LazyTrace(args.reference), LazyTrace(args.candidate)
    differences = input_differences(reference.metadata, candidate.metadata)
    if differences and not args.allow_different_inputs:
        raise ValueError(f"the traces were recorded with different run inputs, so their records do not "
                         f"correspond: {'; '.join(differences)} (--allow-different-inputs compares them anyway)")
    shared = set(reference.keys()) & set(candidate.keys())
    if not shared:
        raise ValueError(f"the traces share no (site, step) record: the reference has {len(reference)} records "
                         f"(e.g. {_first_keys(reference)}), the candidate {len(candidate)} (e.g. {_first_keys(candidate)})")
    inputs = _inputs_note(reference.metadata, candidate.metadata, differences)
    for difference in differences:
        report_progress(f"warning: run inputs differ ({difference}); compared anyway (--allow-different-inputs)")
    with ExitStack() as stack:  # the rebuilt reference keeps its path applied while it judges, then undone
        judge = None
        if not args.no_oracle:
            from ulptrace.verdicts import judge_for_trace

            judge = judge_for_trace(reference.metadata, progress=report_progress, stack=stack,
                                    judge_reference=args.check_reference)
        comparison = compare(reference, candidate, judge=judge, max_ulp=args.max_ulp)
    data = comparison.to_json(allow=parity_allow(args))
    data["inputs"] = inputs
    emit(data, args, to_table(data, all_rows=args.all) + "\ninputs: " + inputs["note"])
    return 1 if args.fail_on_onset and not data["parity"]["ok"] else 0


def _first_keys(trace: Any) -> str:
    keys = trace.keys()[:2]
    return ", ".join(f"{site}@{step}" for site, step in keys) or "none"


def _inputs_note(reference: dict[str, Any], candidate: dict[str, Any], differences: list[str]) -> dict[str, Any]:
    """What the report says about the two runs' inputs (``inputs`` in the JSON)."""
    from ulptrace.run import fed_tokens

    forced_from = candidate.get("forced_from")
    ref_fed, cand_fed = fed_tokens(reference), fed_tokens(candidate)
    if differences:
        note = "the run inputs DIFFER (" + "; ".join(differences) + "): differences below may come from the inputs"
    elif ref_fed is None or cand_fed is None:
        note = ("unknown whether both runs were fed the same tokens (a trace records no tokens); the model, seed "
                "and prompt shape agree")
    elif forced_from:
        note = f"same model, seed and prompts; the candidate was fed the reference's tokens (forced from {forced_from})"
    else:
        note = ("same model, seed and prompts; the candidate was not forced (--forced-from), but its own greedy "
                "tokens equal the reference's, so both runs were fed the same tokens")
    return {"same": not differences, "differences": differences, "candidate_forced_from": forced_from, "note": note}


def start_onset_reference(args: argparse.Namespace) -> None:
    """At the command's first line, before torch is imported here: start the side processes of an onset that runs
    its reference in a process of its own (``--concurrent``) — and its candidate's too under ``--concurrent split``
    and by default, from the start for a large model on CUDA (``ulptrace.spawning.beside_from_start``) — so that their
    imports overlap this process's instead of following them (``ulptrace.spawning``)."""
    from ulptrace.spawning import ROLES, beside_from_start, start_reference

    if args.tp is not None or args.reference_memory != "auto":  # refused, or kept here (cmd_onset, RunConfig)
        return
    if args.concurrent == "split" or (args.concurrent is None and beside_from_start(
            args.model, args.device, args.dtype, "auto", args.reference_memory) is not None):
        start_reference(args.model, args.device, HF_VERBOSITY, ROLES)
    elif args.concurrent is True:
        start_reference(args.model, args.device, HF_VERBOSITY)


def cmd_onset(args: argparse.Namespace) -> int:
    from ulptrace.probes.onset import run_onset
    from ulptrace.report import to_table

    cfg = _config(args, reference=args.reference, candidate=args.candidate, reference_mode=args.reference_mode,
                  candidate_mode=args.candidate_mode, oracle=not args.no_oracle,
                  check_observation=args.check_observation, check_reference=args.check_reference,
                  max_ulp=args.max_ulp, reference_memory=args.reference_memory,
                  concurrent=("auto" if args.tp is None else False) if args.concurrent is None else args.concurrent,
                  judge_workers=args.judge_workers)
    if args.tp is not None and (args.concurrent or args.judge_workers):
        what = "--concurrent runs the reference" if args.concurrent else "--judge-workers runs the oracle"
        raise ValueError(f"{what} in processes beside this one, but --tp {args.tp} runs one process per rank "
                         "already: drop one of them")
    if args.tp is not None:  # one process per rank under torchrun; rank 0 reports
        from ulptrace.probes.tp_onset import run_onset_tp

        comparison, info = run_onset_tp(cfg, args.tp, progress=report_progress)
        if comparison is None:
            return 0
    else:
        comparison, info = run_onset(cfg, progress=report_progress, bar=progress_bar())
    data = comparison.to_json(allow=parity_allow(args))
    data["run"] = info
    flip = info["first_token_flip"]
    table = to_table(data, all_rows=args.all)
    table += "\ngreedy tokens: " + ("identical at every step" if flip is None else
                                    f"candidate's own choice first differs at step {flip['step']} (row {flip['row']})")
    emit(data, args, table)
    return 1 if args.fail_on_onset and not data["parity"]["ok"] else 0


def cmd_clean(args: argparse.Namespace) -> int:
    from ulptrace.trace import remove_stale

    directory = Path(args.directory)
    if not directory.is_dir():
        raise ValueError(f"{args.directory} is not a directory (expected the directory holding your traces)")
    removed = remove_stale(directory)
    for stale in removed:
        print(f"removed {stale.path} ({stale.bytes:,} bytes): its writer (pid {stale.pid}) no longer runs")
    if not removed:
        print(f"no stale temporary trace directories in {directory}")
    return 0


def cmd_sites(args: argparse.Namespace) -> int:
    from ulptrace.models import build_model
    from ulptrace.run import RunConfig, selected_sites
    from ulptrace.sites import format_sites

    # the selection every run makes (an empty one, or an empty range, is refused there, naming what exists)
    cfg = RunConfig(model=args.model, kinds=args.kinds, layers=args.layers)
    print(format_sites(selected_sites(build_model(args.model), cfg)))
    return 0


def cmd_semantics(args: argparse.Namespace) -> int:
    from ulptrace.verdicts import site_semantics

    print(site_semantics(args.model, args.site, path=args.path, seed=args.seed))
    return 0


# -- generation diagnostics: matrix, lockstep, batch-invariance (ulptrace.probes.matrix, .lockstep, .batch_invariance)

def _add_plot_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--plot FILE`` for a generation diagnostic (unless the report options already offer it)."""
    try:
        parser.add_argument("--plot", metavar="FILE", help=f"draw {what} into FILE (.png, .pdf or .svg; needs matplotlib)")
    except argparse.ArgumentError:  # add_report_options has --plot
        pass


def _refuse_unused(args: argparse.Namespace, command: str, options: dict[str, str]) -> None:
    """Options of the shared groups that ``command`` does not use: given, they exit 2 saying why."""
    for dest, why in options.items():
        value = getattr(args, dest, None)
        if value is not None and value is not False:  # (an explicit 0 is given too)
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{command} does not take {flag}: {why}")


_GENERATION_UNUSED = {
    "steps": "every step of the generation is checked (use --new-tokens to bound it)",
    "check_reference": "the reference is not judged against its own semantics here (use `ulptrace onset`)",
    "allow_could_not_judge": "no parity decision is made here (use `ulptrace onset --fail-on-onset`)",
}


def _write_generation_report(data: dict[str, Any], args: argparse.Namespace, table: str, markdown: Any,
                             figure: Any) -> None:
    """The table and JSON through ``emit``; the markdown and the figure of this report's own kind."""
    emit(data, argparse.Namespace(**{**vars(args), "markdown": None, "plot": None}), table)
    if args.markdown:
        Path(args.markdown).write_text(markdown(data))
        report_progress(f"markdown report written to {args.markdown}")
    if getattr(args, "plot", None):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = figure(data)
        try:
            fig.savefig(args.plot, dpi=110)
        finally:
            plt.close(fig)
        report_progress(f"figure written to {args.plot}")


def _check_plot(args: argparse.Namespace) -> None:
    """``--plot FILE``, checked before any work (``ulptrace.plot.check_plot_file``)."""
    if getattr(args, "plot", None):
        from ulptrace.plot import check_plot_file

        try:
            check_plot_file(args.plot)
        except ValueError as exc:
            raise ValueError(f"--plot {exc}") from None


def _partial_writer(args: argparse.Namespace) -> Any:
    """A callback rewriting ``--json FILE`` with the report so far, so a stopped run leaves what it did."""

    def write(partial: dict[str, Any]) -> None:
        if args.json and args.json != "-":
            from ulptrace.report import to_json

            Path(args.json).write_text(to_json(partial))

    return write


_PATHS = ("a path: hf, hf:attn=<impl>, kernels:faithful, kernels:fused, fault:SITE@STEP[+ULPS] or your own "
          "package.module:function (`ulptrace paths` lists them)")


def cmd_matrix(args: argparse.Namespace) -> int:
    import torch
    from ulptrace.plot import plot_matrix
    from ulptrace.probes.matrix import MatrixConfig, run_matrix, to_markdown, to_table

    _check_plot(args)
    _refuse_unused(args, "matrix", {**_GENERATION_UNUSED,
                                    "prompts": "each check's rows are the first B prompts for every B of --batches",
                                    "seed": "each seed of --seeds draws the weights and prompts"})
    modes = args.modes or (["eager", "graph"] if torch.device(args.device).type == "cuda" else ["eager", "static"])
    if args.graph_attempts is not None and args.graph_attempts >= 1 and "graph" not in modes:  # (< 1: validate's)
        raise ValueError(f"--graph-attempts {args.graph_attempts} counts the checks of graph mode, but the modes are "
                         f"{' '.join(modes)}: add graph to --modes or drop --graph-attempts")
    cfg = MatrixConfig(_config(args, prompts=1, reference=args.reference, reference_mode=args.reference_mode,
                               oracle=not args.no_oracle, max_ulp=args.max_ulp),
                       candidates=args.candidate, seeds=args.seeds, batches=args.batches, modes=modes,
                       graph_attempts=2 if args.graph_attempts is None else args.graph_attempts,
                       locate=not args.no_locate, locate_limit=args.locate_limit,
                       locate_seconds=args.locate_seconds, resume=_read_report(args.resume) if args.resume else None)
    report = run_matrix(cfg, progress=report_progress, on_check=_partial_writer(args))
    _write_generation_report(report, args, to_table(report, limit=None if args.all else 40), to_markdown, plot_matrix)
    return 0


def _read_report(name: str, command: str = "matrix") -> Any:
    """The ``--json`` report of ``ulptrace COMMAND`` in file ``name`` (``--resume``, ``matrix-merge``)."""
    import json

    expected = f"expected the --json file of `ulptrace {command}`"
    try:
        return json.loads(Path(name).read_text())
    except FileNotFoundError:
        raise ValueError(f"{name}: no such {command} report ({expected})") from None
    except IsADirectoryError:
        raise ValueError(f"{name}: a directory, not a {command} report ({expected})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not a JSON file ({exc.msg} at line {exc.lineno}); {expected}") from None


def cmd_matrix_merge(args: argparse.Namespace) -> int:
    from ulptrace.plot import plot_matrix
    from ulptrace.probes.matrix import merge_reports, to_markdown, to_table

    _check_plot(args)
    reports = [_read_report(name) for name in args.reports]
    report = merge_reports(reports, names=args.reports)
    _write_generation_report(report, args, to_table(report, limit=None if args.all else 40), to_markdown, plot_matrix)
    return 0


def cmd_lockstep(args: argparse.Namespace) -> int:
    from ulptrace.plot import plot_lockstep
    from ulptrace.probes.lockstep import run_lockstep, to_markdown, to_table

    _check_plot(args)
    _refuse_unused(args, "lockstep", {**_GENERATION_UNUSED, "all": "every step is listed"})
    cfg = _config(args, reference=args.reference, candidate=args.candidate, reference_mode=args.reference_mode,
                  candidate_mode=args.candidate_mode, oracle=not args.no_oracle, max_ulp=args.max_ulp)
    report = run_lockstep(cfg, free_running=args.free_running, progress=report_progress)
    _write_generation_report(report, args, to_table(report), to_markdown, plot_lockstep)
    return 0


def cmd_batch_invariance(args: argparse.Namespace) -> int:
    from ulptrace.plot import plot_matrix
    from ulptrace.probes.batch_invariance import (
        BatchInvarianceConfig,
        run_batch_invariance,
        to_markdown,
        to_table,
    )

    _check_plot(args)
    _refuse_unused(args, "batch-invariance", _GENERATION_UNUSED)
    cfg = BatchInvarianceConfig(_config(args, reference=args.path, reference_mode=args.mode,
                                        oracle=not args.no_oracle, max_ulp=args.max_ulp),
                                batches=args.batches, locate=not args.no_locate, locate_seconds=args.locate_seconds,
                                resume=_read_report(args.resume, "batch-invariance") if args.resume else None)
    report = run_batch_invariance(cfg, progress=report_progress, on_batch=_partial_writer(args))
    _write_generation_report(report, args, to_table(report, limit=None if args.all else 40), to_markdown, plot_matrix)
    return 0


def add_generation_commands(sub: Any) -> None:
    """The ``matrix``, ``lockstep`` and ``batch-invariance`` subcommands."""
    from ulptrace.catalog import MODES

    locate_help = "skip locating divergent rows (token parity, first divergent steps and near-ties only)"
    seconds_help = ("stop locating rows once locating has taken S seconds (the rest keep their first divergent "
                    "step and near-tie classification; default: no limit)")
    p = sub.add_parser("matrix", help="token-parity matrix: seeds x batches x modes x candidate paths, every "
                                      "divergent row classified (near-tie or not) and located")
    add_run_options(p)
    p.set_defaults(prompt_len=128, new_tokens=16, prompts=None)
    p.add_argument("--reference", default="hf", metavar="PATH", help="the path every check is compared with "
                   "(default hf): " + _PATHS)
    add_mode_option(p, "--reference-mode", "the reference")
    p.add_argument("--candidate", nargs="+", required=True, metavar="PATH", help="the candidate paths (one column "
                   "each): " + _PATHS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], metavar="SEED",
                   help="seeds for weights and prompts (default 0 1)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8], metavar="B",
                   help="batch sizes; a batch of B holds the first B prompts (default 1 2 4 8)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=None, metavar="MODE",
                   help="candidate run modes: eager, static, graph (default eager graph on CUDA, eager static "
                        "elsewhere: graph needs CUDA)")
    p.add_argument("--graph-attempts", type=int, default=None, metavar="N",
                   help="graph checks per configuration, each a fresh capture (default 2; needs graph in --modes)")
    p.add_argument("--no-locate", action="store_true", help=locate_help)
    p.add_argument("--locate-limit", type=int, default=None, metavar="N",
                   help="locate at most N divergent rows per candidate path and mode, earliest steps first (default: "
                        "every row; the others keep their first divergent step and near-tie classification)")
    p.add_argument("--locate-seconds", type=float, default=None, metavar="S", help=seconds_help)
    p.add_argument("--resume", metavar="REPORT.json", help="the --json report of an earlier run of this grid (e.g. "
                   "one stopped by a time limit: its partial report): its checks are taken as they are, the rest run")
    add_report_options(p)
    _add_plot_option(p, "the first divergent step of every row of every check (near-tie flips marked)")
    p.set_defaults(fn=cmd_matrix)

    p = sub.add_parser("matrix-merge", help="one matrix report from the --json reports of disjoint parts of one grid "
                                            "(e.g. --seeds 0 and --seeds 1 run apart)")
    p.add_argument("reports", nargs="+", metavar="REPORT.json", help="matrix reports (`ulptrace matrix --json`)")
    p.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    p.add_argument("--json", metavar="FILE", help="write the merged JSON report to FILE ('-' for stdout)")
    p.add_argument("--markdown", metavar="FILE", help="write the merged markdown report to FILE")
    p.add_argument("--all", action="store_true", help="list every divergent row (default: the first 40)")
    _add_plot_option(p, "the first divergent step of every row of every check (near-tie flips marked)")
    p.set_defaults(fn=cmd_matrix_merge)

    p = sub.add_parser("lockstep", help="two runs advanced step by step from the same restored state: logits, "
                                        "every cache/state tensor and the sites of each step compared")
    add_run_options(p)
    p.add_argument("--reference", default="hf", metavar="PATH", help="the reference (default hf): " + _PATHS)
    p.add_argument("--candidate", default="hf", metavar="PATH", help="the candidate (default hf): " + _PATHS)
    add_mode_option(p, "--reference-mode", "the reference")
    add_mode_option(p, "--candidate-mode", "the candidate")
    p.add_argument("--free-running", action="store_true", help="do not restore the candidate to the reference's "
                   "state before each step (shows how differences grow)")
    add_report_options(p)
    _add_plot_option(p, "the max ULP of the logits and states per step")
    p.set_defaults(fn=cmd_lockstep)

    p = sub.add_parser("batch-invariance", help="each prompt alone and inside batches: token-exact rows per batch "
                                                "size, divergent rows located")
    add_run_options(p)
    p.set_defaults(prompts=None)
    p.add_argument("--path", default="hf", metavar="PATH", help="the path to run (default hf): " + _PATHS)
    add_mode_option(p, "--mode", "the path")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8], metavar="B",
                   help="batch sizes (default 1 2 4 8); --prompts (default: the largest) must be a multiple of each")
    p.add_argument("--no-locate", action="store_true", help=locate_help)
    p.add_argument("--locate-seconds", type=float, default=None, metavar="S", help=seconds_help)
    p.add_argument("--resume", metavar="REPORT.json", help="the --json report of an earlier run of this command "
                   "(e.g. one stopped by a time limit): the batch sizes it completed are taken as they are")
    add_report_options(p)
    _add_plot_option(p, "the first divergent step of every row (near-tie flips marked)")
    p.set_defaults(fn=cmd_batch_invariance)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ulptrace", description="Trace where a kernel-injected HF model diverges "
                    "from HF, in ULPs, judged against an FP64 oracle.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("models", help="list the embedded models").set_defaults(fn=cmd_models)
    sub.add_parser("paths", help="list the registered paths").set_defaults(fn=cmd_paths)

    p = sub.add_parser("record", help="record one path's trace to a directory")
    add_run_options(p)
    p.add_argument("--path", default="hf", metavar="PATH", help="path to record (default hf): " + PATH_HELP)
    add_mode_option(p, "--mode", "the path")
    p.add_argument("--out", required=True, help="trace directory to create (must not exist)")
    p.add_argument("--forced-from", metavar="TRACE", default=None,
                   help="feed the decode steps the tokens recorded in TRACE (a reference recorded with the same "
                        "model, seed and prompts), so `compare TRACE OUT` aligns step for step as `onset` does")
    p.set_defaults(fn=cmd_record)

    p = sub.add_parser("compare", help="compare two recorded traces")
    p.add_argument("reference", help="the reference trace directory (judged against)")
    p.add_argument("candidate", help="the candidate trace directory (the path under test; record it with "
                                     "--forced-from REFERENCE so both were fed the same tokens)")
    p.add_argument("--allow-different-inputs", action="store_true",
                   help="compare traces recorded with different model, seed, prompts, steps or fed tokens "
                        "(refused by default: their records do not correspond)")
    p.add_argument("--fail-on-onset", action="store_true", help=FAIL_HELP)
    p.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    add_report_options(p)
    p.set_defaults(fn=cmd_compare)

    p = sub.add_parser("onset", help="record both paths (streaming) and report where divergence begins")
    add_run_options(p)
    add_path_options(p, "hf")
    add_mode_option(p, "--reference-mode", "the reference")
    add_mode_option(p, "--candidate-mode", "the candidate")
    p.add_argument("--check-observation", action="store_true", help="prove tracing did not change the logits")
    p.add_argument("--reference-memory", choices=("auto", "device", "host"), default="auto",
                   help="where the reference's records wait to be compared: device (fastest, GPU memory), host "
                        "(CPU memory, copied asynchronously), auto (on the GPU while the memory allocated there stays "
                        "within half of it, host memory after — unless the onset switches to --concurrent there, "
                        "as it does by default; CPU runs: in place)")
    p.add_argument("--concurrent", nargs="?", const=True, default=None, type=split_only, metavar="split",
                   help="record the reference in a process of its own while the candidate runs (its records streamed "
                        "as they are made, the candidate fed its tokens as they come): the same report, the two sides "
                        "at once; no gain on a CPU. --concurrent split: the candidate too is recorded in a process of "
                        "its own and this one only compares (three processes). Default: split from the start for a "
                        "model of 512 MiB of weights or more on CUDA (the processes start at the command's first "
                        "line, while this one builds the model), else the reference alone, only once its records, "
                        "kept in this process, are forecast to outgrow their share of the GPU's memory (a long "
                        "prompt's, from its first layer: the onset then starts again this way) (README)")
    p.add_argument("--no-concurrent", dest="concurrent", action="store_const", const=False,
                   help="never run the reference in a process of its own")
    p.add_argument("--judge-workers", type=int, default=0, metavar="N",
                   help="judge the differing records in N processes of their own while the run goes on (the oracle "
                        "is bound by one host core's op dispatch; the same verdicts). Default 0: in this process. "
                        "The processes are kept for the next onset of the same model in this Python process")
    p.add_argument("--fail-on-onset", action="store_true", help=FAIL_HELP)
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="the candidate is the model sharded over N processes with transformers' tensor-parallel "
                        "plan, judged against it unsharded; launch with `torchrun --nproc_per_node N -m ulptrace "
                        "onset --tp N ...` (needs `accelerate`: pip install 'ulptrace[tp]')")
    add_report_options(p)
    p.set_defaults(fn=cmd_onset, early=start_onset_reference)

    p = sub.add_parser("sites", help="list a model's sites: name, kind, layer, recorded inputs, oracle semantics")
    p.add_argument("--model", default="tiny-qwen3.5")
    p.add_argument("--kinds", nargs="+", metavar="KIND", help="only these site kinds")
    p.add_argument("--layers", metavar="A:B", help="only these decoder layers (a slice, e.g. 0:2)")
    p.set_defaults(fn=cmd_sites)

    p = sub.add_parser("semantics", help="print where the reference rounds at a site (the oracle's op list)")
    p.add_argument("--model", default="tiny-qwen3.5")
    p.add_argument("--site", required=True, help="a site name, e.g. layers.0.linear_attn.norm")
    p.add_argument("--path", default="hf", metavar="PATH", help="the path whose modules define the semantics "
                   "(default hf): " + PATH_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_semantics)

    p = sub.add_parser("clean", help="remove temporary trace directories left behind by killed `record` runs")
    p.add_argument("directory", nargs="?", default=".", help="where to look (default: the current directory)")
    p.set_defaults(fn=cmd_clean)
    add_generation_commands(sub)
    return parser


USER_ERRORS = (KeyError, ValueError, OSError)
"""Exceptions that mean bad input (``TraceError`` is a ``ValueError``; ``FileExistsError``,
``PermissionError``, ``IsADirectoryError`` are ``OSError``s): one line, exit 2."""


def run_cli(fn: Any, args: argparse.Namespace) -> int:
    """Run a command; user errors become one line on stderr and exit status 2, Ctrl-C exit 130.

    Output paths are checked first. An exception raised in the user's own code (a path function,
    or a forward it patched in) is reported with the path's name and the user's frames only; any
    other exception is a bug in ulptrace and keeps its traceback.
    """
    from ulptrace.paths import PathError, format_user_error

    try:
        check_outputs(args)
        return int(fn(args) or 0)
    except KeyboardInterrupt:
        print("ulptrace: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except PathError as exc:
        _user_error(str(exc), exc.frames)
        return 2
    except Exception as exc:
        frames = format_user_error(exc)
        path = getattr(exc, "ulptrace_path", None)
        if frames:
            where = f"path {path!r}" if path else "your code"
            _user_error(f"{where} raised {type(exc).__name__} during the run: {_message(exc)}", frames)
            return 2
        if isinstance(exc, USER_ERRORS):
            print(f"ulptrace: error: {_message(exc)}", file=sys.stderr)
            return 2
        raise


def _message(exc: BaseException) -> str:
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return str(text) or type(exc).__name__


def _user_error(line: str, frames: str) -> None:
    print(f"ulptrace: error: {line}", file=sys.stderr)
    if frames:
        print("  in your code (most recent call last):\n" + frames, file=sys.stderr)


def cwd_on_path() -> None:
    """Put the working directory on ``sys.path`` as ``python -m`` does, so a ``module:function`` path
    in the current directory resolves from the console scripts too."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        set_quiet(args)
        cwd_on_path()  # before a helper process is started: it takes this process's import path
        early = getattr(args, "early", None)
        if early is not None:  # before anything heavy is imported here
            early(args)
        quiet_transformers()
        return run_cli(args.fn, args)
    except KeyboardInterrupt:
        print("ulptrace: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def console() -> None:
    """The ``ulptrace`` console script: :func:`main`, then the process ends without the interpreter's teardown
    (``ulptrace.exiting``); host memory freed by one op is kept for the next (``ulptrace.host_memory``)."""
    from ulptrace.exiting import exit_now
    from ulptrace.host_memory import keep_freed_memory

    keep_freed_memory()
    exit_now(main())


HF_VERBOSITY = "error"  # transformers' verbosity in the command (and in the helper processes it starts)


def quiet_transformers() -> None:
    """Keep HF's one-time fallback notices (no fla/causal-conv1d) out of reports; they go to the log."""
    try:
        from transformers.utils import logging

        logging.set_verbosity(logging.log_levels[HF_VERBOSITY])
    except ImportError:  # pragma: no cover
        pass


if __name__ == "__main__":  # pragma: no cover
    console()
