"""Onset under tensor parallelism: a model sharded over N processes, judged against the same model unsharded.

Run by every rank of a ``torchrun --nproc_per_node N`` job (``ulptrace onset --tp N``). The candidate is the
checkpoint loaded by transformers with its own TP plan (DTensor weights), sharded over the job; the reference
is the same checkpoint unsharded, built and recorded by rank 0 alone (see ``ulptrace.tp`` for why), its
records kept in memory (or written to ``reference_dir``). The candidate is then run on every rank, forced to the reference's tokens; each record is
gathered to rank 0 in its logical shape (``ulptrace.tp.ShardGatherer``) and compared and judged there on
the fly, exactly as ``ulptrace.probes.onset`` does for one process: the oracle judges each site on the TP
run's own inputs, with the parameters the run splits along a reduction offered as the ``sharded``
hypothesis (partial sums rounded before the all-reduce). Each rank's parameter shards are checked against
the reference's slices, so a stale shard is named with its rank. Only rank 0 returns a comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from ulptrace import tp as TP
from ulptrace.comparison import Comparison, StreamingComparator
from ulptrace.paths import apply_path, resolve_path
from ulptrace.record import Recorder, recording_collector
from ulptrace.run import (
    RunConfig,
    check_observation,
    first_flip,
    greedy,
    run_metadata,
    selected_sites,
    selection_metadata,
    torch_dtype,
)
from ulptrace.sides import SideNames, apply_candidate
from ulptrace.sites import parse_range
from ulptrace.trace import LazyTrace, TraceWriter


@recording_collector()  # every recorder of the run and what is made between them
def run_onset_tp(cfg: RunConfig, tp: int, *, reference_dir: str | Path | None = None,
                 progress: Callable[[str], None] | None = None) -> tuple[Comparison | None, dict[str, Any]]:
    """Every rank calls this; returns ``(comparison, info)`` on rank 0 and ``(None, info)`` on the others.

    ``info`` is ``ulptrace.probes.onset.run_onset``'s (tokens, first token flip) plus ``tp``: the shard count,
    backend, TP plan, each recorded tensor's placement, parameter shards that differ from the reference (with
    rank and slice) and replicated records whose copies differ between ranks.

    Raises:
        ulptrace.tp.TPError: the run cannot be made (see ``ulptrace.tp.preflight``), or ranks disagree. On
            ranks other than 0, a preflight error raises ``SystemExit(2)`` instead: rank 0 reports it once.
        Any error of one rank carries ``rank R of N`` in its message.
    """
    try:
        TP.preflight(cfg.model, tp, cfg.device)
        cfg.validate()
        cfg.refuse_onset_only(f"a tensor-parallel onset runs one process per rank ({tp})")
        resolve_path(cfg.reference), resolve_path(cfg.candidate)
        if cfg.candidate_mode != "eager":
            raise TP.TPError(f"--candidate-mode {cfg.candidate_mode}: a tensor-parallel candidate runs eager (HF's "
                             "dynamic cache); static caches and CUDA graphs are not sharded by transformers' TP plans")
    except (ValueError, KeyError):
        if TP.env_rank() != 0:
            raise SystemExit(2) from None  # rank 0 reports it, once
        raise
    group = TP.init(tp, cfg.device)
    try:
        return _run(cfg, group, reference_dir, progress if group.main else None)
    except BaseException as exc:
        tagged = TP.tag(exc, group)
        if tagged is exc:
            raise
        raise tagged from None
    finally:
        TP.close(group)


def _run(cfg: RunConfig, group: TP.Group, reference_dir: str | Path | None,
         progress: Callable[[str], None] | None) -> tuple[Comparison | None, dict[str, Any]]:
    say = progress or (lambda msg: None)
    dtype = torch_dtype(cfg.dtype)
    device = str(group.device)
    steps = parse_range(cfg.steps)
    info: dict[str, Any] = {"model": cfg.model, "reference": cfg.reference, "candidate": cfg.candidate,
                            "reference_mode": cfg.reference_mode, "candidate_mode": cfg.candidate_mode}
    with ExitStack() as stack:
        path = stack.enter_context(TP.checkpoint_dir(cfg.model, group, dtype=dtype, seed=cfg.seed))
        say(f"loading {cfg.model} sharded over {group.size} ranks ({group.backend}) with transformers' TP plan")
        from ulptrace.catalog import MODELS
        from ulptrace.models import build_model

        label = cfg.model if cfg.model in MODELS else None  # a checkpoint directory is named by its path
        cand = TP.load_sharded(path, group, dtype=dtype, name=label, seed=cfg.seed, sdpa=cfg.sdpa)
        ref_model, reference, error, observed, before = None, None, None, None, None
        run: dict[str, Any] | None = None
        if group.main:  # the reference: unsharded, this rank only
            try:
                ref_model = build_model(path, dtype=dtype, device=device, seed=cfg.seed, sdpa=cfg.sdpa)
                if label is not None:
                    ref_model.ulptrace_model_name = label
                prompts = _prompts(ref_model, cfg, device)
                before = SideNames(ref_model)  # the candidate's path is applied over these (ulptrace.sides)
                # the reference's path stays applied while its modules define the semantics (until the stack closes)
                run = _record_reference(cfg, ref_model, prompts, steps, reference_dir, say, stack)
                observed, reference = run.pop("observation", None), run.pop("trace")
            except Exception as exc:  # noqa: BLE001 - held: the other ranks wait for rank 0's broadcast
                error = exc
        run = TP.broadcast(group, None if run is None else {"prompts": run["prompts"].tolist(),
                                                            "tokens": run["tokens"].tolist()}, error)
        if error is not None:
            raise error
        prompts = torch.tensor(run["prompts"], dtype=torch.long, device=group.device)
        ref_tokens = torch.tensor(run["tokens"], dtype=torch.long, device=group.device)

        with apply_candidate(before, cand, cfg.candidate) as (applied, _):
            say(f"streaming the {group.size}-way sharded candidate {cfg.candidate!r} against it")
            report = TP.parameter_report(cand, group, ref_model)
            sites = selected_sites(cand, cfg)
            sink, judge = None, None
            if group.main:
                if cfg.oracle:
                    from ulptrace.verdicts import OracleJudge

                    assert report is not None
                    judge = OracleJudge(ref_model, judge_reference=cfg.check_reference,
                                        shards=TP.split_parameters(report))
                sink = StreamingComparator(reference, judge=judge, max_ulp=cfg.max_ulp, release=True)
            gatherer = TP.ShardGatherer(group, cand, sites, sink,
                                        TP.logical_shapes(reference) if group.main else None)
            meta = {**run_metadata(cfg, prompts, cfg.candidate_mode), "selection": selection_metadata(cfg),
                    "path_info": applied.info}
            if report is not None:
                meta["parameters"] = report.checksums
            final: dict[int, torch.Tensor] = {}
            with Recorder(cand, sites=sites, steps=steps, sink=gatherer, path=cfg.candidate, metadata=meta) as rec:
                cand_tokens = greedy(cand, prompts, cfg.new_tokens, forced=ref_tokens,
                                     on_logits=lambda s, l: final.__setitem__(s, l.clone()))
            cand_observed = None
            if cfg.check_observation:
                say("re-running the sharded candidate untraced (observation check)")
                cand_observed = check_observation(cand, prompts, cfg.new_tokens, ref_tokens, final)
        if not group.main:
            return None, info
        gatherer.raise_held()
        assert sink is not None and report is not None
        sink.result.candidate = {**rec.metadata, "path_info": applied.info,
                                 "tp": {"size": group.size, "backend": group.backend}}
        comparison = sink.finish()
        notes = TP.stale_notes(report, sites)
        for d in comparison.sites:
            note = notes.get(d.site.split("#")[0])
            if note:
                d.note = f"{d.note}; {note}" if d.note else note
        if observed is not None:
            comparison.observation = {**observed, "candidate": cand_observed,
                                      "bitwise_equal": observed["bitwise_equal"] and bool(
                                          cand_observed and cand_observed["bitwise_equal"])}
        info["reference_tokens"] = ref_tokens.tolist()
        info["candidate_tokens"] = cand_tokens.tolist()
        info["first_token_flip"] = first_flip(ref_tokens, cand_tokens)
        info["tp"] = {
            "size": group.size, "backend": group.backend, "plan": dict(getattr(cand, "tp_plan", None) or {}),
            "placements": {f"{site}:{role}": p for (site, role), p in gatherer.placements.items()},
            "stale_parameters": report.stale, "replicas_differ": gatherer.replicas_differ,
            "split_parameters": {k: list(v.sizes) for k, v in TP.split_parameters(report).items()},
        }
        return comparison, info


def _prompts(model: Any, cfg: RunConfig, device: str) -> torch.Tensor:
    from ulptrace.run import make_prompts

    return make_prompts(model.config.vocab_size, cfg.prompts, cfg.prompt_len, cfg.seed, device)


def _record_reference(cfg: RunConfig, model: Any, prompts: torch.Tensor, steps: Any, directory: str | Path | None,
                      say: Callable[[str], None], stack: ExitStack) -> dict[str, Any]:
    """Record the unsharded reference (rank 0), in memory or to ``directory``; returns its trace, prompts, tokens
    and the observation check. The reference's path stays applied until ``stack`` closes."""
    out: dict[str, Any] = {"prompts": prompts}
    applied = stack.enter_context(apply_path(model, cfg.reference))
    say(f"recording the unsharded reference {cfg.reference!r} ({cfg.reference_mode}) on rank 0 "
        f"({cfg.prompts}x{cfg.prompt_len}, {cfg.new_tokens} steps)")
    writer = TraceWriter(directory) if directory is not None else None
    final: dict[int, torch.Tensor] = {}
    meta = {**run_metadata(cfg, prompts, cfg.reference_mode), "selection": selection_metadata(cfg), "path_info": applied.info}
    try:
        with Recorder(model, sites=selected_sites(model, cfg), steps=steps, sink=writer, path=cfg.reference,
                      metadata=meta) as rec:
            out["tokens"] = greedy(model, prompts, cfg.new_tokens, mode=cfg.reference_mode, cache_len=cfg.cache_len,
                                   on_logits=lambda s, l: final.__setitem__(s, l.clone()))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close(rec.metadata)
    out["trace"] = LazyTrace(directory) if directory is not None else rec.trace
    if cfg.check_observation:
        out["observation"] = check_observation(model, prompts, cfg.new_tokens, out["tokens"], final,
                                               mode=cfg.reference_mode, cache_len=cfg.cache_len)
    return out
