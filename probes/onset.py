"""Onset: where does a candidate path first diverge from the reference, over prefill and decode?

Records the reference path over a greedy generation (prefill + N decode steps) into memory on the
device that produced it (or into a trace on disk when a directory is given), then runs the candidate
on a second copy of the same model, *forced to the reference's tokens* so every step sees the same
inputs, and compares each record on the fly against the reference where the data is (statistics
only; each reference record is released once compared). The oracle judges every site on each path's own
inputs. The candidate's own greedy choice is kept too, so the report says at which step its
tokens would have flipped. Each side runs in its own mode (``eager``, ``static``, ``graph``; see
``ulptrace.run``), so a static cache or CUDA-graph replay can be traced against HF's default.

With ``RunConfig.concurrent`` the reference runs in a process of its own while the candidate runs
(``ulptrace.concurrent``): ``True`` always; ``"split"``, the candidate too, in a process of its own, this one only
comparing; ``"auto"`` (the CLI's default) as ``"split"`` from the start for a model large enough on a CUDA device
(``ulptrace.concurrent.from_start``: the run info's ``concurrent_from_start`` says why), else only
once the reference, kept in this process, is forecast to outgrow its share of the GPU's memory (``MemorySink``'s
``auto``, ``RecordForecast``: from the prompt's first layer, or from a decode step) or has outgrown it: a long
prompt's reference would go to host memory, which is slow and large, so the onset stops and starts again streaming
it — said, and in the run info.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from ulptrace.comparison import Comparison, StreamingComparator
from ulptrace.concurrent import ReferenceProcess, from_start
from ulptrace.judging import JudgePool
from ulptrace.paths import apply_path
from ulptrace.progress import Progress
from ulptrace.record import MemorySink, Outgrowth, RecordForecast, recording_collector
from ulptrace.run import (
    RunConfig,
    build_pair,
    check_observation,
    check_run,
    first_flip,
    record_generation,
    selected_sites,
)
from ulptrace.sides import SideNames, apply_candidate
from ulptrace.spawning import drop_reference
from ulptrace.trace import LazyTrace, TraceWriter

JUDGING = "oracle judging the held record pairs"  # the progress bar's phase after the candidate's run


def run_onset(cfg: RunConfig, *, reference_dir: str | Path | None = None,
              progress: Callable[[str], None] | None = None, bar: Progress | None = None
              ) -> tuple[Comparison, dict[str, Any]]:
    """Record the reference (in memory, or to ``reference_dir``), stream the candidate against it; returns
    (comparison, run info). ``bar`` (``ulptrace.progress.Progress``) shows each side's steps as they run."""
    say = progress or (lambda msg: None)
    bar = bar or Progress(enabled=False)
    try:
        return _run_onset(cfg, reference_dir, say, bar)
    finally:
        bar.close()


@recording_collector()  # both recorders and what is made between them
def _run_onset(cfg: RunConfig, reference_dir: str | Path | None, say: Callable[[str], None], bar: Progress
               ) -> tuple[Comparison, dict[str, Any]]:
    started = time.perf_counter()  # the run info's timeline counts from here
    if cfg.concurrent == "split":
        if reference_dir is not None:
            raise ValueError("concurrent='split' records both sides in processes of their own and keeps no reference "
                             f"trace, but a reference directory was given ({str(reference_dir)!r}): drop one of them")
        return _run_split(cfg, say, bar, started)  # (its reference takes a process the command line started)
    if cfg.concurrent is True:
        if reference_dir is not None:
            raise ValueError("--concurrent streams the reference's records from its own process and keeps no "
                             f"reference trace, but a reference directory was given ({str(reference_dir)!r}): "
                             "drop one of them")
        return _run_concurrent(cfg, say, bar, started)
    why = from_start(cfg) if reference_dir is None else None
    if why is not None:
        say(why)
        comparison, info = _run_split(replace(cfg, concurrent="split"), say, bar, started)
        info["concurrent_from_start"] = why
        return comparison, info
    drop_reference()  # a reference process started for this run (ulptrace.spawning) that it does not take
    # "auto": switch once the reference is forecast to outgrow its GPU share or has (only where its records are kept
    # here by auto)
    switch = cfg.concurrent == "auto" and cfg.reference_memory == "auto" and reference_dir is None
    try:
        with ExitStack() as stack:
            check_run(cfg)  # before any process is started
            pool = _judge_pool(cfg, stack)  # its processes import while this one builds
            ref_model, cand_model, prompts = build_pair(cfg)
            if pool is not None:
                pool.start(ref_model)  # a twin of the reference model as built, before its path is applied
            comparison, info = _run_sequential(cfg, reference_dir, say, bar, ref_model, cand_model, prompts, pool,
                                               started, switch)
            _judging_info(info, pool)
            return comparison, info
    except _Outgrown as exc:
        outgrown = exc.where
    # out of the except block: the traceback, and the reference's records its frames held, are gone. The models as
    # built are kept for the new start (the candidate's was not run yet; the reference's, whose run stopped, only
    # where the oracle judges by it here): rebuilding them would draw their weights again beside the reference
    # process's start-up, on the same cores
    built = (ref_model if cfg.oracle else None, cand_model, prompts)
    del ref_model, cand_model, prompts, pool, stack
    gc.collect()
    torch.cuda.empty_cache()  # the memory they took goes back to the device, for the reference's own process
    gib = lambda key: f"{outgrown[key] / 2**30:.2f} GiB"
    why = (f"outgrew their share of {outgrown['device']}'s memory ({gib('kept_on_device_bytes')} kept there)"
           if "forecast_bytes" not in outgrown else
           f"would outgrow their share of {outgrown['device']}'s memory ({gib('forecast_bytes')} forecast from "
           f"{outgrown['forecast_from']}, {gib('room_bytes')} of room; {gib('kept_on_device_bytes')} kept so far)")
    say(f"the reference's records {why} at step {outgrown['step']}; starting again with the reference in a process "
        "of its own, its records streamed as the candidate runs (--no-concurrent: keep them here, the rest in host "
        "memory)")
    comparison, info = _run_concurrent(replace(cfg, concurrent=True), say, bar, started, built)
    info["switched_to_concurrent"] = outgrown
    return comparison, info


def _forecast(cfg: RunConfig, sites: list[Any]) -> RecordForecast:
    """The forecast of the reference's records in ``cfg``'s run, whose ``sites`` are recorded: each recorded layer's
    kind is the site kinds recorded there (a hybrid model's kinds of layer record different amounts)."""
    kinds: dict[int, set[str]] = {}
    for site in sites:
        if site.layer is not None:
            kinds.setdefault(site.layer, set()).add(site.kind)
    return RecordForecast({layer: frozenset(k) for layer, k in kinds.items()}, cfg.new_tokens)


class _Outgrown(Exception):
    """The sequential onset's reference outgrew its GPU share or is forecast to (``RunConfig.concurrent == "auto"``):
    raised from its sink's spill or forecast, inside the reference's run, so that the onset starts again with
    ``--concurrent``."""

    def __init__(self, where: dict[str, Any]) -> None:
        super().__init__(f"the reference's records outgrew their GPU share: {where}")
        self.where = where


def _judging_info(info: dict[str, Any], pool: JudgePool | None) -> None:
    """Where the oracle judged: the run info says how many processes judged how many pairs (the rest needed no
    replay and were answered here)."""
    if pool is not None:
        info["judging_processes"] = {"processes": pool.count, "pairs_judged_there": pool.judged}


def _judge_pool(cfg: RunConfig, stack: ExitStack) -> JudgePool | None:
    """The oracle's judging processes of ``cfg.judge_workers`` (None: judged in this process), entered on ``stack``."""
    if not (cfg.oracle and cfg.judge_workers):
        return None
    return stack.enter_context(JudgePool(cfg, cfg.judge_workers))


def _oracle(cfg: RunConfig, ref_model: Any, pool: JudgePool | None) -> Any:
    """The judge of ``cfg``'s onset, built on ``ref_model`` with the reference path applied (None without the oracle);
    with ``pool`` the pairs that need a replay are judged in its processes."""
    if not cfg.oracle:
        return None
    from ulptrace.verdicts import OracleJudge

    judge = OracleJudge(ref_model, judge_reference=cfg.check_reference)
    return judge if pool is None else pool.judge(judge)


def _run_sequential(cfg: RunConfig, reference_dir: str | Path | None, say: Callable[[str], None], bar: Progress,
                    ref_model: Any, cand_model: Any, prompts: torch.Tensor, pool: JudgePool | None, started: float,
                    switch: bool = False) -> tuple[Comparison, dict[str, Any]]:
    """The onset in this process: the reference recorded and kept, then the candidate streamed against it.
    ``switch``: a reference forecast to outgrow its GPU share, or outgrowing it, raises ``_Outgrown`` instead of going
    on in host memory. ``started``: when the onset began (``time.perf_counter()``), its models built since."""
    info = _run_info(cfg, started)
    _mark(info, "built_s")
    before = SideNames(ref_model)  # the names the models' code looks up, before either path (ulptrace.sides)
    with apply_path(ref_model, cfg.reference) as ref_applied:
        say(f"recording reference {cfg.reference!r} ({cfg.reference_mode}) on {cfg.model} "
            f"({cfg.prompts}x{cfg.prompt_len}, {cfg.new_tokens} steps)")
        # the reference's records stay in memory where they were produced (no disk round trip) unless a
        # directory is asked for; each is released as soon as the candidate's record is compared
        # --reference-memory: on the GPU (device), in host memory (host), or on the GPU while it has room and in
        # host memory after (auto; MemorySink's "auto"), so a long prompt's records still fit beside two models
        keep = {"host": "cpu", "device": None, "auto": "auto"}[cfg.reference_memory]

        def at(record: Any, kept: int) -> dict[str, Any]:  # where the reference outgrew its share, or will
            return {"device": str(record.out.device), "kept_on_device_bytes": kept, "share": MemorySink.AUTO_SHARE,
                    "site": record.site, "step": record.step}

        def spilling(record: Any, kept: int) -> None:
            where = at(record, kept)
            if switch:
                raise _Outgrown(where)
            say(f"the reference's records have filled their share of {where['device']}'s memory ({kept / 2**30:.2f} "
                f"GiB kept there) at step {record.step}; the rest go to host memory, which is slower (`--concurrent` "
                "streams them instead)")

        def outgrowing(record: Any, outgrowth: Outgrowth) -> None:  # the switch, before the room is full
            raise _Outgrown({**at(record, outgrowth.kept_bytes), "forecast_bytes": outgrowth.forecast_bytes,
                             "room_bytes": outgrowth.room_bytes, "forecast_from": outgrowth.basis})

        sites = selected_sites(ref_model, cfg)
        ref_sink = TraceWriter(reference_dir) if reference_dir is not None else MemorySink(
            device=keep, on_spill=spilling, forecast=_forecast(cfg, sites) if switch else None,
            on_outgrow=outgrowing)
        try:
            ref_tokens, final_ref, rec = _record_side(cfg, "reference", ref_model, prompts, ref_sink, None,
                                                      ref_applied, bar, f"reference {cfg.reference}", sites)
        except BaseException:
            if isinstance(ref_sink, TraceWriter):
                ref_sink.abort()
            raise
        _mark(info, "reference_s")
        rec.metadata["path_info"] = ref_applied.info  # read after the run: a path may report what ran
        if isinstance(ref_sink, TraceWriter):
            ref_sink.close(rec.metadata)
        elif ref_sink.spilled["records"]:  # --reference-memory auto outgrew the GPU's share: said in the run info
            info["reference_spilled"] = {**ref_sink.spilled, "kept_on_device_bytes": sum(ref_sink.kept_bytes.values()),
                                         "share": MemorySink.AUTO_SHARE}
        reference = LazyTrace(reference_dir) if isinstance(ref_sink, TraceWriter) else rec.trace
        reference.metadata["path_info"] = rec.metadata["path_info"]
        if cfg.check_observation:
            info["observation"] = check_observation(ref_model, prompts, cfg.new_tokens, ref_tokens, final_ref,
                                                    mode=cfg.reference_mode, cache_len=cfg.cache_len)
        judge = _oracle(cfg, ref_model, pool)
        with apply_candidate(before, cand_model, cfg.candidate) as (cand_applied, _):
            say(f"streaming candidate {cfg.candidate!r} ({cfg.candidate_mode}) against it")
            sink = StreamingComparator(reference, judge=judge, max_ulp=cfg.max_ulp, release=True,
                                       judging=bar.counter(JUDGING, "stack"))
            cand_tokens, final_cand, cand_rec = _record_side(cfg, "candidate", cand_model, prompts, sink, ref_tokens,
                                                             cand_applied, bar,
                                                             f"candidate {cfg.candidate}, compared as it runs")
            _mark(info, "candidate_s")
            if cfg.check_observation:  # the candidate too: observing a compiled graph can change what it computes
                info["observation"] = _both_observed(cfg, info["observation"], cand_model, prompts, ref_tokens,
                                                     final_cand, say)
            sink.result.candidate = {**cand_rec.metadata, "path_info": cand_applied.info}
            comparison = sink.finish()
            _mark(info, "finished_s")
    return _finished(comparison, info, ref_tokens, cand_tokens)


def _run_concurrent(cfg: RunConfig, say: Callable[[str], None], bar: Progress, started: float,
                    built: tuple[Any, Any, torch.Tensor] | None = None) -> tuple[Comparison, dict[str, Any]]:
    """``_run_onset`` with the reference recorded in a process of its own while the candidate runs
    (``ulptrace.concurrent``): the same records compared the same way, the candidate fed the reference's tokens as
    they come. This process builds the candidate (and, for the oracle, the reference model it judges by) while the
    other starts (its imports), then sends it a twin of the candidate's model as built (a kept process has it).
    ``built``: (the reference model or None without the oracle, the candidate model, the prompts) as ``build_pair``
    made them, no path applied to the candidate yet — the switch's, not built again. ``started``: when the onset
    began (``time.perf_counter()``)."""
    check_run(cfg)  # before a process is started
    info = _run_info(cfg, started)
    with ExitStack() as stack:
        remote = stack.enter_context(ReferenceProcess(cfg))
        pool = _judge_pool(cfg, stack)
        say(f"recording reference {cfg.reference!r} ({cfg.reference_mode}) on {cfg.model} in a process of its own "
            f"({cfg.prompts}x{cfg.prompt_len}, {cfg.new_tokens} steps)")
        ref_model, cand_model, prompts = built if built is not None else build_pair(cfg, reference=cfg.oracle)
        remote.start(cand_model)  # a new process gets a twin of it (no second drawing of the weights)
        judge, before = _judge_beside(cfg, stack, ref_model, pool)
        _mark(info, "built_s")
        with apply_candidate(before, cand_model, cfg.candidate) as (cand_applied, _):
            say(f"streaming candidate {cfg.candidate!r} ({cfg.candidate_mode}) against it while both run")
            sink = StreamingComparator(remote.trace, judge=judge, max_ulp=cfg.max_ulp, release=True,
                                       judging=bar.counter(JUDGING, "stack"))
            cand_tokens, final_cand, cand_rec = _record_side(cfg, "candidate", cand_model, prompts, sink,
                                                             remote.trace.forced_token, cand_applied, bar,
                                                             f"candidate {cfg.candidate}, compared as both run")
            _mark(info, "candidate_s")
            ref_tokens, ref_path_info, ref_observed, process = remote.trace.finish()
            ref_tokens = ref_tokens.to(cand_tokens.device)  # shipped through host memory
            sink.result.reference["path_info"] = ref_path_info  # as the reference's process read it after its run
            if cfg.check_observation:
                info["observation"] = _both_observed(cfg, ref_observed, cand_model, prompts, ref_tokens, final_cand,
                                                     say)
            sink.result.candidate = {**cand_rec.metadata, "path_info": cand_applied.info}
            comparison = sink.finish()
            _mark(info, "finished_s")
            del sink  # what held the reference's records goes before its process may free their memory
    info["reference_process"] = process
    _judging_info(info, pool)
    return _finished(comparison, info, ref_tokens, cand_tokens)


def _run_split(cfg: RunConfig, say: Callable[[str], None], bar: Progress, started: float
               ) -> tuple[Comparison, dict[str, Any]]:
    """``_run_onset`` with both sides recorded in processes of their own (``concurrent="split"``; the reference's as
    ``_run_concurrent`` runs it, the candidate's a kept process of role ``candidate``, fed the reference's tokens as
    they come) and this process comparing only: the same records compared the same way. Why: in
    ``_run_concurrent`` the candidate records and compares in this process, and on a GPU host that side is the wall
    (``bench/RESULTS.md``, thirty-third to thirty-fifth rounds; ``bench/bench_trace.py --concurrent split``)."""
    check_run(cfg)  # before a process is started
    info = _run_info(cfg, started)
    with ExitStack() as stack:
        remote = stack.enter_context(ReferenceProcess(cfg))
        side = stack.enter_context(ReferenceProcess(cfg, role="candidate"))
        pool = _judge_pool(cfg, stack)
        say(f"recording reference {cfg.reference!r} ({cfg.reference_mode}) and candidate {cfg.candidate!r} "
            f"({cfg.candidate_mode}) on {cfg.model} in processes of their own ({cfg.prompts}x{cfg.prompt_len}, "
            f"{cfg.new_tokens} steps)")
        ref_model, cand_model, _ = build_pair(cfg, reference=cfg.oracle)
        remote.start(cand_model)  # a new process gets a twin of it (no second drawing of the weights)
        side.start(cand_model, feed=remote.trace.forced_token)
        judge, _ = _judge_beside(cfg, stack, ref_model, pool)  # (no candidate's path is applied here)
        sites = len(selected_sites(cand_model, cfg))
        del cand_model  # its twins live in the processes (their memory is kept shared by the processes' workers)
        _mark(info, "built_s")
        sink = StreamingComparator(remote.trace, judge=judge, max_ulp=cfg.max_ulp, release=True,
                                   judging=bar.counter(JUDGING, "stack"))
        bar.start(f"candidate {cfg.candidate}, compared here as both run", cfg.new_tokens, sites)
        done = 0  # steps the candidate has finished: those before the step of the latest record
        for record in side.trace.arriving():
            sink.add(record)
            if record.step > done:
                done = record.step
                bar.step(done)
        bar.step(cfg.new_tokens)
        bar.close()
        _mark(info, "candidate_s")
        cand_tokens, cand_path_info, cand_observed, cand_process = side.trace.finish()
        ref_tokens, ref_path_info, ref_observed, process = remote.trace.finish()
        sink.result.reference["path_info"] = ref_path_info  # as the reference's process read it after its run
        if cfg.check_observation:
            info["observation"] = _merged_observation(ref_observed, cand_observed)
        sink.result.candidate = {**side.trace.metadata, "path_info": cand_path_info}
        comparison = sink.finish()
        _mark(info, "finished_s")
        del sink  # what held the two processes' records goes before they may free their memory
    info["reference_process"], info["candidate_process"] = process, cand_process
    _judging_info(info, pool)
    return _finished(comparison, info, ref_tokens, cand_tokens)


def _judge_beside(cfg: RunConfig, stack: ExitStack, ref_model: Any, pool: JudgePool | None
                  ) -> tuple[Any, SideNames | None]:
    """The judge of an onset whose reference runs in a process of its own (None without the oracle): built here on
    ``ref_model``, the reference's path applied to it until ``stack`` closes (its modules define the semantics to
    judge by, as in ``_run_sequential``); ``pool``'s judging processes are started on a twin of it first. With it,
    the names the models' code looks up before the reference's path was applied (``ulptrace.sides``: the candidate's
    path is applied over them), else None (no path applied here)."""
    if pool is not None:
        pool.start(ref_model)
    if not cfg.oracle:
        return None, None
    before = SideNames(ref_model)
    stack.enter_context(apply_path(ref_model, cfg.reference))
    return _oracle(cfg, ref_model, pool), before


def _run_info(cfg: RunConfig, started: float) -> dict[str, Any]:
    """What the onset's run info says of its configuration (tokens and checks are added as the run goes), and its
    timeline: ``started_at``, when the onset began (``time.perf_counter()``), and seconds from then as it goes."""
    return {"model": cfg.model, "reference": cfg.reference, "candidate": cfg.candidate,
            "reference_mode": cfg.reference_mode, "candidate_mode": cfg.candidate_mode,
            "timeline": {"started_at": started}}


def _mark(info: dict[str, Any], name: str) -> None:
    """The run info's timeline gains ``name``: seconds from the onset's start to now (where a command's time goes:
    the models' build, each side's run, the comparison's end — the oracle's judging of the pairs it held)."""
    timeline = info["timeline"]
    timeline[name] = round(time.perf_counter() - timeline["started_at"], 3)


def _record_side(cfg: RunConfig, side: str, model: Any, prompts: torch.Tensor, sink: Any, forced: Any,
                 applied: Any, bar: Progress, label: str, sites: list[Any] | None = None
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor], Any]:
    """One side's traced generation into ``sink`` with the progress bar (``label``), fed ``forced`` (the
    reference's tokens, or a function of the step serving them as they come; None: its own): (its own greedy
    tokens, its final logits per step — the observation check's —, its recorder). ``sites``: the model's selected
    sites, where the caller has them already."""
    final: dict[int, torch.Tensor] = {}
    sites = selected_sites(model, cfg) if sites is None else sites
    bar.start(label, cfg.new_tokens, len(sites))

    def on_logits(s: int, logits: torch.Tensor) -> None:
        final[s] = logits.clone()
        bar.step(s + 1)

    tokens, rec = record_generation(model, cfg, side, prompts, applied.info, sink=sink, sites=sites, forced=forced,
                                    on_logits=on_logits)
    bar.close()
    return tokens, final, rec


def _finished(comparison: Comparison, info: dict[str, Any], ref_tokens: torch.Tensor, cand_tokens: torch.Tensor
              ) -> tuple[Comparison, dict[str, Any]]:
    """The onset's result: the comparison with the observation check, the run info with both sides' tokens."""
    comparison.observation = info.get("observation")
    info["reference_tokens"] = ref_tokens.tolist()
    info["candidate_tokens"] = cand_tokens.tolist()
    info["first_token_flip"] = first_flip(ref_tokens, cand_tokens)
    return comparison, info


def _both_observed(cfg: RunConfig, ref_observed: dict[str, Any], model: Any, prompts: torch.Tensor,
                   ref_tokens: torch.Tensor, final: dict[int, torch.Tensor], say: Callable[[str], None]
                   ) -> dict[str, Any]:
    """The candidate's observation check (re-run untraced, fed the reference's tokens, against its traced final
    logits ``final``) and the reference's ``ref_observed`` as one."""
    say("re-running the candidate untraced (observation check)")
    cand_observed = check_observation(model, prompts, cfg.new_tokens, ref_tokens, final, mode=cfg.candidate_mode,
                                      cache_len=cfg.cache_len)
    return _merged_observation(ref_observed, cand_observed)


def _merged_observation(ref_observed: dict[str, Any], cand_observed: dict[str, Any]) -> dict[str, Any]:
    """Both sides' observation checks as one (the candidate's under ``candidate``)."""
    return {**ref_observed, "candidate": cand_observed,
            "bitwise_equal": ref_observed["bitwise_equal"] and cand_observed["bitwise_equal"],
            "differing_steps": sorted(set(ref_observed["differing_steps"]) | set(cand_observed["differing_steps"])),
            "what": "final-position logits of a traced vs an untraced run of each side, every step"}


@recording_collector()  # every recorder of the run and what is made between them
def record_pair(cfg: RunConfig, stack: ExitStack) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Record both paths into memory (the candidate forced to the reference's tokens).

    Returns ``(reference_trace, candidate_trace, reference_model, info)``. The reference model keeps
    its path applied until ``stack`` (the caller's ``ExitStack``) closes, so its modules define the
    semantics to judge by for as long as the caller judges; closing the stack undoes it (a ``kernels:``
    path patches process-wide state). The candidate's path is undone before this returns.
    Memory: every selected record of both runs — select sites (e.g. norm kinds) for long runs.
    """
    cfg.refuse_onset_only("record_pair keeps both traces in this process (its caller judges them)")
    ref_model, cand_model, prompts = build_pair(cfg)
    before = SideNames(ref_model)  # the candidate's path applied over these (ulptrace.sides)
    ref_applied = stack.enter_context(apply_path(ref_model, cfg.reference))
    ref_tokens, ref_rec = record_generation(ref_model, cfg, "reference", prompts, ref_applied.info)
    with apply_candidate(before, cand_model, cfg.candidate) as (cand_applied, _):
        cand_tokens, cand_rec = record_generation(cand_model, cfg, "candidate", prompts, cand_applied.info,
                                                  forced=ref_tokens)
        cand_rec.trace.metadata["path_info"] = cand_applied.info
    info = {"model": cfg.model, "reference": cfg.reference, "candidate": cfg.candidate,
            "first_token_flip": first_flip(ref_tokens, cand_tokens)}
    return ref_rec.trace, cand_rec.trace, ref_model, info
