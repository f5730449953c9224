"""Onset: where does a candidate path first diverge from the reference, over prefill and decode?

Records the reference path over a greedy generation (prefill + N decode steps) into a trace on
disk, then runs the candidate on a second copy of the same model, *forced to the reference's
tokens* so every step sees the same inputs, and compares each record on the fly against the
reference (statistics only; memory bounded). The oracle judges every site on each path's own
inputs. The candidate's own greedy choice is kept too, so the report says at which step its
tokens would have flipped.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ulptrace.comparison import Comparison, StreamingComparator, _bitwise_equal
from ulptrace.models import DEFAULT_MODEL, build_model
from ulptrace.paths import apply_path, resolve_path
from ulptrace.record import Recorder
from ulptrace.sites import parse_range, select, site_table
from ulptrace.trace import LazyTrace, TraceWriter


@dataclass
class RunConfig:
    """What to run: model, paths, prompts and which sites/steps to record."""

    model: str = DEFAULT_MODEL
    reference: str = "hf"
    candidate: str = "hf"
    prompts: int = 2
    prompt_len: int = 16
    new_tokens: int = 4
    seed: int = 0
    device: str = "cpu"
    dtype: str = "bfloat16"
    sites: Sequence[str] | None = None  # glob patterns
    kinds: Sequence[str] | None = None
    layers: str | None = None  # "2:5"
    steps: str | None = None
    oracle: bool = True
    check_observation: bool = False
    check_reference: bool = False  # also judge the reference against its own semantics
    max_ulp: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def make_prompts(vocab_size: int, prompts: int, prompt_len: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Seeded random token ids ``[prompts, prompt_len]`` (no padding, so rows are independent)."""
    if prompts < 1 or prompt_len < 1:
        raise ValueError(f"prompts and prompt_len must be >= 1, but got {prompts} and {prompt_len}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (prompts, prompt_len), generator=gen).to(device)


@torch.no_grad()
def greedy(model: Any, input_ids: torch.Tensor, new_tokens: int, forced: torch.Tensor | None = None,
           on_logits: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Greedy decoding, EOS disabled: one prefill forward then ``new_tokens - 1`` decode forwards.

    Returns the model's own argmax choice at every step ``[batch, new_tokens]``. With ``forced``
    (``[batch, >= new_tokens]``), the *forced* token is fed back instead, so two paths see the
    same inputs at every step.
    """
    cache_kwarg = _cache_kwarg(model)
    out = model(input_ids, use_cache=True)
    chosen = []
    for step in range(new_tokens):
        logits = out.logits[:, -1]
        if on_logits is not None:
            on_logits(step, logits)
        token = logits.argmax(-1, keepdim=True)
        chosen.append(token)
        if step + 1 == new_tokens:
            break
        feed = forced[:, step : step + 1] if forced is not None else token
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        out = model(feed, use_cache=True, **{cache_kwarg: cache})
    return torch.cat(chosen, dim=1)


def _cache_kwarg(model: Any) -> str:
    """The name under which the model's forward takes its cache (``cache`` in newer transformers)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: expected e.g. bfloat16, float16, float32")
    return value


def _selected_sites(model: Any, cfg: RunConfig) -> list:
    return select(site_table(model), cfg.sites, cfg.kinds, parse_range(cfg.layers))


def _setup(cfg: RunConfig) -> tuple[Any, Any, torch.Tensor, range | None, dict[str, Any]]:
    """Two copies of the model (same seed: same weights), the prompts, the step range, run metadata.

    Unknown path names and bad ranges fail here, before any model is built.
    """
    resolve_path(cfg.reference), resolve_path(cfg.candidate)
    dtype = _dtype(cfg.dtype)
    steps = parse_range(cfg.steps)
    ref_model = build_model(cfg.model, dtype=dtype, device=cfg.device, seed=cfg.seed)
    cand_model = build_model(cfg.model, dtype=dtype, device=cfg.device, seed=cfg.seed)
    prompts = make_prompts(ref_model.config.vocab_size, cfg.prompts, cfg.prompt_len, cfg.seed, cfg.device)
    meta = {"prompts": list(prompts.shape), "new_tokens": cfg.new_tokens, "seed": cfg.seed}
    return ref_model, cand_model, prompts, steps, meta


def _first_flip(ref_tokens: torch.Tensor, cand_tokens: torch.Tensor) -> dict[str, int] | None:
    """The earliest step at which the candidate's own greedy choice differs (and a row where it does)."""
    flips = (ref_tokens != cand_tokens).nonzero().tolist()
    if not flips:
        return None
    step = min(f[1] for f in flips)
    return {"row": next(r for r, t in flips if t == step), "step": step}


def run_onset(cfg: RunConfig, *, reference_dir: str | Path | None = None,
              progress: Callable[[str], None] | None = None) -> tuple[Comparison, dict[str, Any]]:
    """Record the reference to disk, stream the candidate against it; returns (comparison, run info)."""
    say = progress or (lambda msg: None)
    ref_model, cand_model, prompts, steps, meta = _setup(cfg)
    tmp = None
    if reference_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="ulptrace-onset-")
        reference_dir = Path(tmp.name) / "reference"
    info: dict[str, Any] = {"model": cfg.model, "reference": cfg.reference, "candidate": cfg.candidate}
    try:
        with apply_path(ref_model, cfg.reference) as ref_applied:
            say(f"recording reference {cfg.reference!r} on {cfg.model} ({cfg.prompts}x{cfg.prompt_len}, "
                f"{cfg.new_tokens} steps)")
            writer = TraceWriter(reference_dir)
            final_ref: dict[int, torch.Tensor] = {}
            with Recorder(ref_model, sites=_selected_sites(ref_model, cfg), steps=steps, sink=writer,
                          path=cfg.reference, metadata={**meta, "path_info": ref_applied.info}) as rec:
                ref_tokens = greedy(ref_model, prompts, cfg.new_tokens,
                                    on_logits=lambda s, l: final_ref.__setitem__(s, l.clone()))
            writer.close(rec.metadata)
            if cfg.check_observation:
                info["observation"] = _check_observation(ref_model, prompts, cfg.new_tokens, ref_tokens, final_ref)
            judge = None
            if cfg.oracle:
                from ulptrace.verdicts import OracleJudge

                judge = OracleJudge(ref_model, judge_reference=cfg.check_reference)
            with apply_path(cand_model, cfg.candidate) as cand_applied:
                say(f"streaming candidate {cfg.candidate!r} against it")
                reference = LazyTrace(reference_dir)
                sink = StreamingComparator(reference, judge=judge, max_ulp=cfg.max_ulp)
                with Recorder(cand_model, sites=_selected_sites(cand_model, cfg), steps=steps, sink=sink,
                              path=cfg.candidate, metadata={**meta, "path_info": cand_applied.info}) as crec:
                    cand_tokens = greedy(cand_model, prompts, cfg.new_tokens, forced=ref_tokens)
                sink.result.candidate = {**crec.metadata, "path_info": cand_applied.info}
                comparison = sink.finish()
        comparison.observation = info.get("observation")
        info["reference_tokens"] = ref_tokens.tolist()
        info["candidate_tokens"] = cand_tokens.tolist()
        info["first_token_flip"] = _first_flip(ref_tokens, cand_tokens)
        return comparison, info
    finally:
        if tmp is not None:
            tmp.cleanup()


@torch.no_grad()
def _check_observation(model: Any, prompts: torch.Tensor, new_tokens: int, tokens: torch.Tensor,
                       traced: dict[int, torch.Tensor]) -> dict[str, Any]:
    """Re-run untraced with the same tokens; the last-position logits must be bitwise equal at every step."""
    untraced: dict[int, torch.Tensor] = {}
    greedy(model, prompts, new_tokens, forced=tokens, on_logits=lambda s, l: untraced.__setitem__(s, l.clone()))
    differing = [s for s in traced if not _bitwise_equal(traced[s], untraced[s])]
    return {
        "checked": True,
        "bitwise_equal": not differing,
        "steps": len(traced),
        "differing_steps": differing,
        "what": "final-position logits of a traced vs an untraced run, every step",
    }


def record_pair(cfg: RunConfig) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Record both paths into memory (forced to the reference's tokens).

    Returns ``(reference_trace, candidate_trace, reference_model, info)``; the reference model
    keeps its path applied (it is a private copy), so its modules define the semantics to judge by.
    Memory: every selected record of both runs — select sites (e.g. norm kinds) for long runs.
    """
    ref_model, cand_model, prompts, steps, meta = _setup(cfg)
    ref_applied = apply_path(ref_model, cfg.reference)
    with Recorder(ref_model, sites=_selected_sites(ref_model, cfg), steps=steps, path=cfg.reference,
                  metadata={**meta, "path_info": ref_applied.info}) as ref_rec:
        ref_tokens = greedy(ref_model, prompts, cfg.new_tokens)
    with apply_path(cand_model, cfg.candidate) as cand_applied:
        with Recorder(cand_model, sites=_selected_sites(cand_model, cfg), steps=steps, path=cfg.candidate,
                      metadata={**meta, "path_info": cand_applied.info}) as cand_rec:
            cand_tokens = greedy(cand_model, prompts, cfg.new_tokens, forced=ref_tokens)
        cand_rec.trace.metadata["path_info"] = cand_applied.info
    info = {"model": cfg.model, "reference": cfg.reference, "candidate": cfg.candidate,
            "first_token_flip": _first_flip(ref_tokens, cand_tokens)}
    return ref_rec.trace, cand_rec.trace, ref_model, info
