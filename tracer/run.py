"""The run layer: how ulptrace makes a run — configuration, prompts, greedy decoding in three modes,
and snapshot/restore of the whole decoding state.

Every diagnostic (onset, ``trace_norm_rounding``, the parity matrix, lockstep, batch invariance)
needs the same things, so they live here once, in the core, and probes build on them:

- ``RunConfig`` and ``make_prompts``: what to run (model, paths, modes, prompts, selection).
- ``Session``: one model decoding one batch, step by step, in a *mode* independent of the path:

  - ``eager``  — HF's dynamic cache (what ``model(ids, use_cache=True)`` does);
  - ``static`` — transformers' ``StaticCache`` sized for the run, positions passed explicitly
    (keys/values padded to the cache length and masked);
  - ``graph``  — ``static``, with the decode step captured once into a CUDA graph and replayed.
    Forward hooks do not fire on replay: active ``Recorder``\\ s are told to copy what they observe
    into buffers owned by the graph during capture, and emit them after every replay. Warm-up runs
    on a snapshot that is restored, so capturing changes nothing that is then decoded.

- ``greedy``: greedy decoding (EOS disabled) with optional *forced* tokens, so two paths see the
  same inputs at every step.
- ``snapshot`` / ``restore``: the complete decoding state — every tensor and flag of the cache
  (KV caches static or dynamic, GatedDeltaNet conv and recurrent states, lengths) plus the
  position and the next tokens. Restoring writes into the existing tensors where shapes agree, so a
  captured graph keeps reading the right memory; round trips are bitwise. A state moves between the
  dynamic and static layouts (``adapt_state``), and one row can be put into a batch (``splice_row``).
- ``step_from``: one decode step traced from a restored state (how a divergence is re-run from the
  reference's state); ``batch_row`` / ``record_row`` / ``RowSink``: records restricted to one batch row.

Only this module knows the transformers-version differences of the cache API (``cache`` vs
``past_key_values``).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from ulptrace.catalog import DEFAULT_MODEL, DTYPES, MODES


@dataclass
class RunConfig:
    """What to run: model, paths and their modes, prompts, and which sites/steps to record."""

    model: str = DEFAULT_MODEL
    reference: str = "hf"
    candidate: str = "hf"
    reference_mode: str = "eager"
    candidate_mode: str = "eager"
    prompts: int = 2
    prompt_len: int = 16
    new_tokens: int = 4
    cache_len: int | None = None  # static/graph cache length; default prompt_len + new_tokens
    seed: int = 0
    device: str = "cpu"
    dtype: str = "bfloat16"
    sdpa: str = "default"  # torch's attention backend pinned on both models (ulptrace.sdpa); default: torch's choice
    sites: Sequence[str] | None = None  # glob patterns
    kinds: Sequence[str] | None = None
    layers: str | None = None  # "2:5"
    steps: str | None = None
    oracle: bool = True
    check_observation: bool = False
    check_reference: bool = False  # also judge the reference against its own semantics
    max_ulp: int = 0
    reference_memory: str = "auto"  # where onset keeps the reference's records: device, host or auto
    # run_onset only: True, the reference runs in a process of its own while the candidate runs; "auto" (the CLI's
    # default), it does so only once its records, kept in this process (reference_memory auto), have outgrown their
    # share of the GPU's memory (the onset then starts again that way); False, never; "split", both sides run in
    # processes of their own and this one only compares (issue 11: bench_trace.py --concurrent split measures it)
    concurrent: bool | str = False
    judge_workers: int = 0  # run_onset only: the oracle judges in this many processes of its own (0: in this one)
    extra: dict[str, Any] = field(default_factory=dict)

    def refuse_onset_only(self, caller: str) -> None:
        """Raise ``ValueError`` when a field only ``run_onset`` reads is set (``concurrent``, ``judge_workers``):
        ``caller`` (what is running, and how) would ignore it."""
        given = [f"{name}={getattr(self, name)!r}" for name in ("concurrent", "judge_workers") if getattr(self, name)]
        if given:
            raise ValueError(f"{caller}; {' and '.join(given)} is run_onset's (helper processes beside an onset): "
                             "use run_onset, or leave it at its default")

    def path_and_mode(self, side: str) -> tuple[str, str]:
        """The path and the mode ``side`` (``"reference"`` or ``"candidate"``) runs with."""
        return (self.reference, self.reference_mode) if side == "reference" else (self.candidate, self.candidate_mode)

    def validate(self) -> None:
        """Check what can be checked before any model is built; raises ``ValueError`` naming the field."""
        for name in ("reference_mode", "candidate_mode"):
            check_mode(getattr(self, name), self.device, what=name.replace("_", "-"))
        torch_dtype(self.dtype)
        check_device(self.device)
        from ulptrace.sdpa import check_sdpa, refuse_unreached

        check_sdpa(self.sdpa, self.device)
        refuse_unreached(self.sdpa, (self.reference, self.candidate))
        if self.prompts < 1 or self.prompt_len < 1:
            raise ValueError(f"--prompts and --prompt-len must be >= 1, but got {self.prompts} and {self.prompt_len}")
        if self.new_tokens < 1:
            raise ValueError(f"--new-tokens must be >= 1 (1 = the prefill only), but got {self.new_tokens}")
        from ulptrace.models import check_model

        check_model(self.model)
        check_selection(self)
        if self.judge_workers < 0 or (self.judge_workers and not self.oracle):
            raise ValueError(f"--judge-workers is the number of processes the oracle judges in (0: this one), but got "
                             f"{self.judge_workers}" + ("" if self.oracle else " with the oracle off (--no-oracle)"))
        if self.reference_memory not in ("auto", "device", "host"):
            raise ValueError(f"--reference-memory must be one of auto, device, host, but got {self.reference_memory!r}")
        if self.concurrent not in (True, False, "auto", "split"):
            raise ValueError(f"concurrent must be True, False, 'auto' or 'split', but got {self.concurrent!r}")
        if self.concurrent in (True, "split") and self.reference_memory != "auto":
            raise ValueError(f"--reference-memory {self.reference_memory} says where this process keeps the reference's "
                             "records, but --concurrent records them in a process of its own (they arrive in parts "
                             "and go once compared): drop one of them")
        if self.cache_len is not None and self.reference_mode == self.candidate_mode == "eager":
            raise ValueError(f"--cache-len sizes the static cache of the static and graph modes, but both sides run "
                             f"eager (dynamic cache); got --cache-len {self.cache_len} with no static or graph mode")
        if self.cache_len is not None and self.cache_len < self.prompt_len + self.new_tokens:
            raise ValueError(f"--cache-len must hold the prompt and the new tokens (>= {self.prompt_len + self.new_tokens}),"
                             f" but got {self.cache_len}")


def check_mode(mode: str, device: str | torch.device, *, what: str = "mode") -> str:
    """``mode`` if it is a known run mode usable on ``device``; else ``ValueError`` saying why."""
    if mode not in MODES:
        raise ValueError(f"--{what} must be one of {', '.join(MODES)}, but got {mode!r}")
    if mode == "graph" and torch.device(device).type != "cuda":
        raise ValueError(f"--{what} graph replays CUDA graphs and needs a CUDA device, but the device is "
                         f"{str(device)!r}" + ("" if torch.cuda.is_available() else " (and no CUDA device is present)"))
    return mode


def check_device(device: str) -> torch.device:
    """The torch device named ``device`` when it exists here; else ``ValueError`` saying what exists."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device must be a torch device such as cpu or cuda:0, but got {device!r}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device}: no CUDA device is available on this machine (use --device cpu)")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    elif dev.type not in ("cpu", "meta"):
        raise ValueError(f"--device must be cpu or cuda[:N], but got {device!r}")
    return dev


def torch_dtype(name: str) -> torch.dtype:
    """The model dtype named ``name`` (one of ``DTYPES``); else ``ValueError`` listing them."""
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, but got {name!r}")
    return getattr(torch, name)


def check_range(text: str | None, what: str) -> range | None:
    """``--layers``/``--steps`` parsed (``ulptrace.sites.parse_range``); ``ValueError`` naming the option
    for text that is not a range or a range that is empty (``5:2``)."""
    from ulptrace.sites import parse_range

    try:
        selected = parse_range(text)
    except ValueError as exc:
        raise ValueError(f"--{what}: {exc}") from None
    if selected is not None and len(selected) == 0:
        raise ValueError(f"--{what} {text} is an empty range: expected START:STOP with START < STOP "
                         "(STOP excluded), e.g. 2:5, or a single number")
    return selected


def _open_ended(text: str | None) -> bool:
    """A range given as ``START:`` (to the end), which may run past what exists."""
    return bool(text) and text.strip().endswith(":")


def check_selection(cfg: RunConfig) -> None:
    """What can be said about ``cfg``'s selection without a model: ranges not empty, steps inside the
    run, ``--kinds``/``--sites`` given values, known kinds, a ``fault:`` path's step inside the run.
    (``selected_sites`` checks the rest against the model's site table.)"""
    from ulptrace.sites import KINDS

    check_range(cfg.layers, "layers")
    steps = check_range(cfg.steps, "steps")
    last = cfg.new_tokens - 1
    run_steps = f"steps 0..{last} (0 = the prefill, then {last} decode step(s); --new-tokens {cfg.new_tokens})"
    if steps is not None and (steps.start > last or steps.stop <= 0):
        raise ValueError(f"--steps {cfg.steps} selects no step: the run has {run_steps}")
    if steps is not None and steps.stop > cfg.new_tokens and not _open_ended(cfg.steps):  # (else dropped unsaid)
        raise ValueError(f"--steps {cfg.steps} runs past the run: it has {run_steps}")
    if cfg.kinds is not None:
        if not list(cfg.kinds):
            raise ValueError(f"--kinds needs at least one kind: expected some of {', '.join(KINDS)}")
        unknown = [k for k in cfg.kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"unknown site kind(s) {', '.join(map(repr, unknown))}: expected some of {', '.join(KINDS)}")
    if cfg.sites is not None and not list(cfg.sites):
        raise ValueError("--sites needs at least one GLOB, e.g. 'layers.*.mlp.glu' (omit it to select every site)")
    for name in (cfg.reference, cfg.candidate):
        if name.startswith("fault:"):
            from ulptrace.faults import parse_fault

            _, step, _ = parse_fault(name)
            if step > last:
                raise ValueError(f"path {name!r} perturbs step {step}, but the run has {run_steps}: "
                                 "the fault would never fire")


def make_prompts(vocab_size: int, prompts: int, prompt_len: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Seeded random token ids ``[prompts, prompt_len]`` (no padding, so rows are independent)."""
    if prompts < 1 or prompt_len < 1:
        raise ValueError(f"prompts and prompt_len must be >= 1, but got {prompts} and {prompt_len}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (prompts, prompt_len), generator=gen).to(device)


CACHE_KWARGS = ("cache", "past_key_values", "cache_params")
"""Names transformers has used for a forward's cache argument, newest first (``cache_params``: the
GatedDeltaNet/Mamba modules of older versions)."""


def cache_kwarg(model: Any) -> str:
    """The name under which ``model``'s forward (a model, a decoder layer or a token mixer such as
    GatedDeltaNet) takes its cache: ``cache`` in newer transformers, ``past_key_values`` or
    ``cache_params`` in older ones. Passing the old name beside the new one makes transformers warn."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_KWARGS if name in params), "past_key_values")


def _output_cache(out: Any) -> Any:
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


# -- decoding state ------------------------------------------------------------------------------

def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, (torch.device, torch.dtype)):
        return value
    return copy.deepcopy(value)


def _write(current: Any, saved: Any) -> Any:
    """``saved`` written into ``current`` in place where a tensor of the same layout exists; else a copy."""
    if isinstance(saved, torch.Tensor):
        if (isinstance(current, torch.Tensor) and current.shape == saved.shape and current.dtype == saved.dtype
                and current.device == saved.device):
            current.copy_(saved)
            return current
        return saved.clone()
    if isinstance(saved, dict):
        base = current if isinstance(current, dict) else {}
        return {k: _write(base.get(k), v) for k, v in saved.items()}
    return _clone(saved)


def _objects(cache: Any) -> list[Any]:
    """The objects that hold a cache's state: the cache itself and each of its layers."""
    return [cache] + list(getattr(cache, "layers", None) or [])


@dataclass
class DecodeState:
    """Everything a decode step depends on: the cache's state, the next position and tokens."""

    cache: list[dict[str, Any]]  # per state-holding object (cache, then its layers): attribute -> value
    position: int  # the cache position of the next token
    tokens: torch.Tensor | None  # the next tokens to feed ``[batch, 1]``

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every state tensor by a stable name (``layers.3.recurrent_states.0``), for comparisons."""
        out: dict[str, torch.Tensor] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, torch.Tensor):
                out[prefix] = value
            elif isinstance(value, dict):
                for k, v in value.items():
                    walk(f"{prefix}.{k}", v)

        for i, attrs in enumerate(self.cache):
            for name, value in attrs.items():
                walk(f"layers.{i - 1}.{name}" if i else name, value)
        return out


_SKIP = ("layers", "layer_class_to_replicate", "prefetch_stream")


def snapshot_cache(cache: Any) -> list[dict[str, Any]]:
    """A deep copy of every attribute of ``cache`` and its layers (tensors cloned)."""
    return [{k: _clone(v) for k, v in vars(obj).items() if k not in _SKIP} for obj in _objects(cache)]


def restore_cache(cache: Any, saved: list[dict[str, Any]]) -> None:
    """Write a ``snapshot_cache`` result back into ``cache`` (same structure), in place where possible."""
    objects = _objects(cache)
    if len(objects) != len(saved):
        raise ValueError(f"cannot restore a state of {len(saved) - 1} cache layers into a cache of "
                         f"{len(objects) - 1} layers")
    for obj, attrs in zip(objects, saved):
        for name, value in attrs.items():
            setattr(obj, name, _write(getattr(obj, name, None), value))


_STATIC_ONLY = ("max_cache_len", "cumulative_length", "batch_size", "num_heads", "k_head_dim", "v_head_dim")


def _is_static(attrs: dict[str, Any]) -> bool:
    return "max_cache_len" in attrs


def adapt_state(state: DecodeState, like: list[dict[str, Any]]) -> DecodeState:
    """``state`` in the cache layout of ``like`` (``DecodeState.cache`` of a session of the same model
    shape, or the live attributes of its cache objects): the same values, moved between transformers'
    dynamic and static KV layers where the two differ.

    Dynamic to static: the ``position`` cached keys/values fill the first positions of zero tensors shaped
    like ``like``'s (a static run leaves unused positions zero), ``cumulative_length`` becomes ``position``.
    Static to dynamic: the first ``position`` keys/values. Layers of the same kind (GatedDeltaNet states,
    two dynamic or two static layers) are taken as they are. Returns ``state`` itself when nothing differs.
    """
    if len(like) != len(state.cache):
        raise ValueError(f"cannot restore a state of {len(state.cache) - 1} cache layers into a cache of "
                         f"{len(like) - 1} layers")
    if all(_is_static(a) == _is_static(b) for a, b in zip(state.cache, like)):
        return state
    length = state.position
    converted = []
    for attrs, target in zip(state.cache, like):
        if _is_static(attrs) == _is_static(target) or not isinstance(attrs.get("keys"), torch.Tensor):
            converted.append(attrs)
            continue
        out = {k: v for k, v in attrs.items() if k not in ("keys", "values") + _STATIC_ONLY}
        for name in ("keys", "values"):
            saved = attrs[name]
            if _is_static(target):
                shaped = target[name]
                if shaped.shape[:2] != saved.shape[:2] or shaped.shape[-1] != saved.shape[-1] or shaped.shape[-2] < length:
                    raise ValueError(f"cannot write cached {name} {list(saved.shape)} ({length} positions) into a "
                                     f"static cache of {list(shaped.shape)}")
                full = torch.zeros(shaped.shape, dtype=saved.dtype, device=shaped.device)
                full[..., :length, :] = saved[..., :length, :]
                out[name] = full
            else:
                out[name] = saved[..., :length, :].clone()
        if _is_static(target):
            for key in _STATIC_ONLY:
                value = target.get(key)
                if key == "cumulative_length":
                    device = value.device if isinstance(value, torch.Tensor) else out[name].device
                    out[key] = torch.tensor(length, dtype=torch.int64, device=device)
                elif key in target:
                    out[key] = _clone(value)
        converted.append(out)
    return DecodeState(converted, state.position, state.tokens)


def splice_row(state: DecodeState, row: int, source: DecodeState, source_row: int = 0) -> DecodeState:
    """A copy of ``state`` whose batch row ``row`` holds batch row ``source_row`` of ``source``.

    Both states must have the same layout and position (e.g. one prompt decoded alone and a batch holding
    it, at the same step); every state tensor with at least one dimension is batch-first (KV caches,
    GatedDeltaNet conv and recurrent states, the next tokens). This is how a row of a batched run is put
    back on the path of the same prompt run alone, so one step can be re-run from the same state.
    """
    if state.position != source.position:
        raise ValueError(f"cannot splice a row at position {source.position} into a state at position {state.position}")
    if len(state.cache) != len(source.cache):
        raise ValueError(f"cannot splice between states of {len(source.cache) - 1} and {len(state.cache) - 1} cache layers")

    def put(target: Any, value: Any, name: str) -> Any:
        if isinstance(target, torch.Tensor):
            if not isinstance(value, torch.Tensor) or target.dim() != value.dim() or target.shape[1:] != value.shape[1:]:
                raise ValueError(f"cannot splice state tensor {name}: {list(getattr(value, 'shape', []))} into "
                                 f"{list(target.shape)} (expected the same layout)")
            if target.dim() == 0:  # a count of the cache's, not batch-first (transformers 5.25's cumulative_length_linear)
                if not torch.equal(target, value):
                    raise ValueError(f"cannot splice state tensor {name}: it is {value.item()} in the source and "
                                     f"{target.item()} in the state (expected the same: one count for the batch)")
                return target.clone()
            out = target.clone()
            out[row] = value[source_row]
            return out
        if isinstance(target, dict):
            return {k: put(v, value.get(k) if isinstance(value, dict) else None, f"{name}.{k}") for k, v in target.items()}
        return _clone(target)

    cache = [{k: put(v, attrs.get(k), f"layers.{i - 1}.{k}" if i else k) for k, v in mine.items()}
             for i, (mine, attrs) in enumerate(zip(state.cache, source.cache))]  # named as DecodeState.tensors names
    tokens = state.tokens
    if tokens is not None and source.tokens is not None:
        tokens = put(tokens, source.tokens, "tokens")
    return DecodeState(cache, state.position, tokens)


# -- sessions ------------------------------------------------------------------------------------

def _recorders(model: Any) -> list[Any]:
    from ulptrace.record import RECORDERS_ATTR

    return list(model.__dict__.get(RECORDERS_ATTR, ()))


class Session:
    """One model decoding one batch step by step, in ``mode`` (see the module docstring).

    ``prefill(ids)`` then ``step(tokens)`` repeatedly; each returns the last position's logits
    ``[batch, vocab]``. ``snapshot()`` / ``restore(state)`` save and reinstate the whole decoding
    state (also from another session of the same model shape, which is how lockstep works).

    Args:
        model: an HF causal LM.
        mode: one of ``MODES``.
        max_len: cache length for ``static``/``graph`` (prompt + new tokens; required there).
    """

    def __init__(self, model: Any, mode: str = "eager", *, max_len: int | None = None) -> None:
        param = next(model.parameters())
        check_mode(mode, param.device)
        if mode != "eager" and max_len is None:
            raise ValueError(f"mode {mode!r} needs max_len (prompt length + new tokens) to size its static cache")
        self.model, self.mode, self.max_len = model, mode, max_len
        self.device = param.device
        self._kwarg = cache_kwarg(model)
        self.cache: Any = None
        self.position = 0
        self.tokens: torch.Tensor | None = None
        self.prompt_len: int | None = None  # set by prefill(): decode step t feeds position prompt_len + t - 1
        self._graph: Any = None
        self._static_in: tuple[torch.Tensor, torch.Tensor] | None = None
        self._static_logits: torch.Tensor | None = None
        self.replays = 0

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor | None) -> Any:
        kwargs: dict[str, Any] = {"use_cache": True}
        if self.cache is not None:
            kwargs[self._kwarg] = self.cache
        if positions is not None:
            kwargs["cache_position"] = positions
        try:
            return self.model(ids, **kwargs)
        except RuntimeError as exc:
            from ulptrace.sdpa import no_kernel_error

            step = "prefill" if self.prompt_len is None else "decode"  # prompt_len: set once the prefill has run
            error = no_kernel_error(self.model, exc, f"{self.mode} mode's {step}")
            if error is None:
                raise
            raise error from None

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt ``[batch, len]``; returns the last position's logits."""
        if self.cache is not None:
            raise RuntimeError("this session has already run its prefill; create a new Session for a new batch")
        if self.mode != "eager":
            if ids.shape[1] >= self.max_len:
                raise ValueError(f"the prompt ({ids.shape[1]} tokens) must be shorter than the static cache "
                                 f"({self.max_len} positions)")
            from transformers import StaticCache

            self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
            out = self._forward(ids, torch.arange(ids.shape[1], device=self.device))
        else:
            out = self._forward(ids, None)
            self.cache = _output_cache(out)
        self.position = self.prompt_len = ids.shape[1]
        return out.logits[:, -1]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` ``[batch, 1]`` at the next position; returns that position's logits."""
        if self.cache is None:
            raise RuntimeError("call prefill() before step()")
        if self.mode != "eager" and self.position >= self.max_len:
            raise ValueError(f"the static cache holds {self.max_len} positions; position {self.position} "
                             "does not fit (raise max_len)")
        if self.mode == "graph":
            logits = self._replay(tokens)
        elif self.mode == "static":
            logits = self._forward(tokens, torch.tensor([self.position], device=self.device)).logits[:, -1]
        else:
            out = self._forward(tokens, None)
            self.cache = _output_cache(out) or self.cache
            logits = out.logits[:, -1]
        self.position += 1
        return logits

    # -- CUDA graphs ---------------------------------------------------------------------------
    def _replay(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._graph is None:
            self._capture(tokens)
        ids, pos = self._static_in  # type: ignore[misc]
        ids.copy_(tokens)
        pos.fill_(self.position)
        self._graph.replay()
        self.replays += 1
        for recorder in _recorders(self.model):
            recorder.replayed()
        return self._static_logits.clone()  # type: ignore[union-attr]

    def _capture(self, tokens: torch.Tensor) -> None:
        """Capture one decode step; warm-up runs on a snapshot that is restored afterwards."""
        ids = tokens.clone()
        pos = torch.tensor([self.position], device=self.device)
        saved = self.snapshot()
        recorders = _recorders(self.model)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), _paused(recorders):
            for _ in range(2):  # warm-up: lazy initialisation, cuBLAS handles, autotuning
                self._forward(ids, pos)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.restore(saved)
        graph = torch.cuda.CUDAGraph()
        for recorder in recorders:
            recorder.begin_capture()
        try:
            with torch.cuda.graph(graph):
                out = self._forward(ids, pos)
                logits = out.logits[:, -1]
        finally:
            for recorder in recorders:
                recorder.end_capture()
        torch.cuda.synchronize(self.device)
        self.restore(saved)  # capture does not run kernels, but keep the host-side state exact too
        self._graph, self._static_in, self._static_logits = graph, (ids, pos), logits

    # -- state ---------------------------------------------------------------------------------
    def snapshot(self) -> DecodeState:
        """The complete decoding state (cache tensors cloned, flags copied, position, next tokens)."""
        if self.cache is None:
            raise RuntimeError("nothing to snapshot before prefill()")
        tokens = None if self.tokens is None else self.tokens.clone()
        return DecodeState(snapshot_cache(self.cache), self.position, tokens)

    def restore(self, state: DecodeState) -> None:
        """Reinstate ``state`` (bitwise; in place where tensors keep their layout).

        ``state`` may come from a session of the same model shape in another mode: a dynamic cache's
        keys/values are written into this static cache's first positions (the rest zero, as a static run
        leaves them), or a static cache's live positions become this dynamic cache (``adapt_state``).
        """
        if self.cache is None:
            raise RuntimeError("restore() needs a session that has run its prefill (the cache must exist)")
        state = adapt_state(state, [vars(obj) for obj in _objects(self.cache)])
        restore_cache(self.cache, state.cache)
        self.position = state.position
        self.tokens = None if state.tokens is None else state.tokens.clone()


class _paused:
    """Pause recorders (warm-up forwards are not part of the run)."""

    def __init__(self, recorders: list[Any]) -> None:
        self.recorders = recorders

    def __enter__(self) -> None:
        for r in self.recorders:
            r.pause()

    def __exit__(self, *exc: object) -> None:
        for r in self.recorders:
            r.resume()


@torch.no_grad()
def step_from(model: Any, mode: str, prompts: torch.Tensor, state: DecodeState, tokens: torch.Tensor, *,
              cache_len: int | None = None, recorders: Sequence[Any] = ()) -> torch.Tensor:
    """Run one decode step of ``model`` in ``mode`` from a restored decoding ``state``, feeding ``tokens``.

    A fresh ``Session`` runs the prefill of ``prompts`` untraced (it only builds the cache), ``state`` is
    restored into it (from a session of either cache layout, see ``Session.restore``), then ``recorders``
    (``Recorder`` objects on ``model``, not yet entered) are entered and the step runs, its records numbered as
    the decode step it is (``state.position - prompt length + 1``), so they align with a whole run's. In
    ``graph`` mode the step is captured with the recorders active and replayed, as a traced graph run is.
    Returns the step's logits ``[batch, vocab]``.
    """
    from contextlib import ExitStack

    step = state.position - prompts.shape[1] + 1
    if step < 1:
        raise ValueError(f"a state at position {state.position} precedes no decode step of a {prompts.shape[1]}-token "
                         "prompt (the prefill is step 0: run it with greedy(..., 1))")
    session = Session(model, mode, max_len=cache_len or state.position + 1)
    session.prefill(prompts)
    session.restore(state)
    with ExitStack() as stack:
        for recorder in recorders:
            stack.enter_context(recorder)
            recorder.step = step - 1  # the next root forward (or replay) is this decode step
        return session.step(tokens)


@torch.no_grad()
def greedy(model: Any, input_ids: torch.Tensor, new_tokens: int,
           forced: torch.Tensor | Callable[[int], torch.Tensor] | None = None,
           on_logits: Callable[[int, torch.Tensor], None] | None = None, *, mode: str = "eager",
           cache_len: int | None = None, session: Session | None = None) -> torch.Tensor:
    """Greedy decoding, EOS disabled: one prefill forward then ``new_tokens - 1`` decode forwards.

    Returns the model's own argmax choice at every step ``[batch, new_tokens]``. With ``forced``
    (``[batch, >= new_tokens - 1]``), the *forced* token is fed back instead, so two paths see the
    same inputs at every step; a function of the step (``[batch, 1]``: the token to feed after that step) serves
    tokens that arrive as the run goes (``ulptrace.concurrent``). ``mode`` picks the cache and graph mode
    (``MODES``); ``cache_len`` sizes a static cache (default: prompt + new tokens); pass a ``session`` to keep the
    decoding state afterwards.
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1 (1 = the prefill only), but got {new_tokens}")
    if isinstance(forced, torch.Tensor) and forced.shape[-1] < new_tokens - 1:
        raise ValueError(f"forced tokens must cover {new_tokens - 1} decode steps, but got {forced.shape[-1]}")
    if session is None:
        session = Session(model, mode, max_len=cache_len or input_ids.shape[1] + new_tokens)
    logits = session.prefill(input_ids)
    chosen = []
    for step in range(new_tokens):
        if on_logits is not None:
            on_logits(step, logits)
        token = logits.argmax(-1, keepdim=True)
        chosen.append(token)
        if forced is None or step + 1 == new_tokens:
            feed = token
        else:
            feed = (forced(step) if callable(forced) else forced[:, step : step + 1]).to(token.device)
        session.tokens = feed
        if step + 1 == new_tokens:
            break
        logits = session.step(feed)
    return torch.cat(chosen, dim=1)


# -- runs of a configuration ---------------------------------------------------------------------

def selection_metadata(cfg: RunConfig, candidates: Sequence[str] | None = None, *, steps: bool = True
                       ) -> dict[str, Any]:
    """The site selection a run records with, kept in its traces' metadata (``selection``): sites, kinds, layers,
    steps (``steps=False``: every step) and ``observed`` (:func:`observation_note`: what the paths let be
    observed, when one limits it). With any of them set the comparison is not ``complete``, so the onset rules
    that need every earlier record (``unobserved``, records without inputs) do not apply. ``candidates`` as
    :func:`observation_limits`."""
    return {"sites": list(cfg.sites) if cfg.sites else None, "kinds": list(cfg.kinds) if cfg.kinds else None,
            "layers": cfg.layers, "steps": cfg.steps if steps else None,
            "observed": observation_note(cfg, candidates)}


def selected_sites(model: Any, cfg: RunConfig, candidates: Sequence[str] | None = None) -> list:
    """The sites of ``model`` that ``cfg`` selects (globs, kinds, layer range), limited to those every path of the
    run can be observed at (:func:`observation_limits`; ``candidates`` as there).

    Raises ``ValueError`` naming what exists (layers, kinds, some site names) when a ``--sites``
    glob matches no site of the model, or the selection as a whole is empty.
    """
    import fnmatch

    from ulptrace.models import model_name
    from ulptrace.sites import select, site_table

    table = site_table(model)
    layer_range = check_range(cfg.layers, "layers")
    layers = sorted({s.layer for s in table if s.layer is not None})

    def has() -> str:  # what the model has, for a refusal's message (made only then)
        kinds = ", ".join(dict.fromkeys(s.kind for s in table))
        examples = ", ".join(s.name for s in table[:4])
        return (f"{model_name(model)} has {len(table)} sites in layers {layers[0]}..{layers[-1]}" if layers else
                f"{model_name(model)} has {len(table)} sites") + f", of kinds {kinds} (e.g. {examples})"

    # every part of a selection must select something: a glob with a typo beside one that matches, or a layer range
    # running past the model, was dropped without a word (a defect at the misspelt site read as parity)
    for pattern in cfg.sites or ():
        if not any(fnmatch.fnmatchcase(s.name, pattern) for s in table):
            raise ValueError(f"--sites {pattern!r} matches no site: {has()}")
    if layer_range is not None and layers and layer_range.start <= layers[-1] and (
            layer_range.stop > layers[-1] + 1 and not _open_ended(cfg.layers)):
        raise ValueError(f"--layers {cfg.layers} runs past the model's layers: {has()}")
    chosen = select(table, cfg.sites, cfg.kinds, layer_range)
    limited = observation_limits(cfg, candidates)
    if chosen and limited:  # a path observable only at some sites (torch.compile): both sides record those
        observable = chosen
        for _, restrict in limited:
            observable = restrict(model, observable)
        if not observable:
            raise ValueError(f"the selection has no site that can be observed without changing the numerics of "
                             f"{observation_note(cfg, candidates)} (e.g. --sites 'layers.*.mlp.glu' logits)")
        return observable
    if chosen:
        return chosen
    given = [f"{flag} {value}" for flag, value in (("--sites", " ".join(cfg.sites or ())),
                                                  ("--kinds", " ".join(cfg.kinds or ())),
                                                  ("--layers", cfg.layers or "")) if value]
    raise ValueError(f"the selection {', '.join(given) or '(everything)'} matches no site: {has()}")


def observation_limits(cfg: RunConfig, candidates: Sequence[str] | None = None
                       ) -> list[tuple[str, Callable[[Any, list], list]]]:
    """The paths of ``cfg`` that can be observed without changing their numerics only at some sites, each with
    the function that keeps those sites (a path function's ``observable_sites`` attribute; ``compile`` and
    ``compile:emulate`` have one, see ``ulptrace.thirdparty``). Both sides of a comparison record the same
    sites, so a limit of either path applies to both. ``candidates``: the paths compared against the reference
    when there are several (a matrix; ``()`` for none), instead of ``cfg.candidate``."""
    from ulptrace.paths import resolve_path

    out = []
    for name in dict.fromkeys((cfg.reference, *((cfg.candidate,) if candidates is None else candidates))):
        restrict = getattr(resolve_path(name), "observable_sites", None)
        if callable(restrict):
            out.append((name, restrict))
    return out


def observation_note(cfg: RunConfig, candidates: Sequence[str] | None = None) -> str | None:
    """What the run could observe when a path limits it (the ``observed`` entry of a trace's ``selection``:
    with one, the comparison is not ``complete``); None when nothing limits it. ``candidates`` as
    :func:`observation_limits`."""
    from ulptrace.paths import resolve_path

    limited = observation_limits(cfg, candidates)
    if not limited:
        return None
    return "; ".join(f"{name}: {getattr(resolve_path(name), 'observed', 'some sites')}" for name, _ in limited)


def paired_reference(reference: str, candidate: str) -> str:
    """The path to run as the reference of ``candidate``: ``reference`` itself, unless it is ``hf`` and the
    candidate's path declares the HF reference it must be judged against (its function's ``reference``
    attribute: ``hf:fla`` is judged against ``hf:scan=torch``, HF's torch scan even where HF bound
    flash-linear-attention at import)."""
    from ulptrace.paths import resolve_path

    paired = getattr(resolve_path(candidate), "reference", None)
    return paired if reference == "hf" and isinstance(paired, str) else reference


def build_pair(cfg: RunConfig, *, reference: bool = True) -> tuple[Any, Any, torch.Tensor]:
    """Two copies of ``cfg.model`` (built once, the reference its ``twin``: the same weights as a second build, for a
    device copy instead of seconds of drawing them) and the seeded prompts; ``reference=False``: the candidate's
    only (the first is None: ``ulptrace.concurrent`` runs the reference elsewhere).

    Everything that can be checked without a model (paths, modes, dtype, device, ranges) is
    checked first (``check_run``), so bad input fails before minutes of model building.
    """
    from ulptrace.models import build_model, twin

    check_run(cfg)
    cand_model = build_model(cfg.model, dtype=torch_dtype(cfg.dtype), device=cfg.device, seed=cfg.seed, sdpa=cfg.sdpa)
    ref_model = twin(cand_model) if reference else None
    prompts = make_prompts(cand_model.config.vocab_size, cfg.prompts, cfg.prompt_len, cfg.seed, cfg.device)
    return ref_model, cand_model, prompts


def check_run(cfg: RunConfig) -> None:
    """Check what can be checked without a model (fields, paths, ranges); a reference of ``hf`` becomes the
    candidate's paired reference where it declares one (``paired_reference``; ``cfg.reference`` is updated)."""
    from ulptrace.paths import resolve_path
    from ulptrace.sites import parse_range

    cfg.validate()
    resolve_path(cfg.reference), resolve_path(cfg.candidate)
    cfg.reference = paired_reference(cfg.reference, cfg.candidate)
    parse_range(cfg.steps), parse_range(cfg.layers)


def run_metadata(cfg: RunConfig, prompts: torch.Tensor, mode: str) -> dict[str, Any]:
    """What a trace records about the run's inputs (compared before two traces are aligned)."""
    meta = {"prompts": list(prompts.shape), "new_tokens": cfg.new_tokens, "seed": cfg.seed, "mode": mode}
    if mode != "eager":
        meta["cache_len"] = cfg.cache_len or cfg.prompt_len + cfg.new_tokens
    return meta


def record_generation(model: Any, cfg: RunConfig, side: str, prompts: torch.Tensor, path_info: Any, *,
                      sink: Any = None, sites: Sequence[Any] | None = None,
                      forced: torch.Tensor | Callable[[int], torch.Tensor] | None = None,
                      on_logits: Callable[[int, torch.Tensor], None] | None = None) -> tuple[torch.Tensor, Any]:
    """``side``'s (``"reference"`` or ``"candidate"``: its path and mode) greedy generation of ``cfg`` recorded into
    ``sink`` (default: in memory) — the selected sites (or ``sites``) at the selected steps, the run's metadata with
    the path's report ``path_info`` — fed ``forced`` if given (``greedy``). Returns (the model's own greedy tokens,
    the recorder, closed: its ``metadata``, its ``trace`` for the default sink). Every onset-style run records a side
    this way (``ulptrace.probes.onset``, ``ulptrace.concurrent``)."""
    from ulptrace.record import Recorder
    from ulptrace.sites import parse_range

    path, mode = cfg.path_and_mode(side)
    metadata = {**run_metadata(cfg, prompts, mode), "selection": selection_metadata(cfg), "path_info": path_info}
    with Recorder(model, sites=selected_sites(model, cfg) if sites is None else sites, steps=parse_range(cfg.steps),
                  sink=sink, path=path, metadata=metadata) as recorder:
        tokens = greedy(model, prompts, cfg.new_tokens, forced=forced, mode=mode, cache_len=cfg.cache_len,
                        on_logits=on_logits)
    return tokens, recorder


RUN_INPUTS = ("model", "seed", "prompts", "new_tokens")
"""Trace metadata that decides what a run was fed (with the tokens fed, ``fed_tokens``): two traces
are comparable only when these agree. Path, mode, dtype and device are what a comparison compares."""


def fed_tokens(metadata: dict[str, Any]) -> list[list[int]] | None:
    """The tokens a recorded run fed at decode steps 1.. (``[batch, new_tokens - 1]``), or None if unknown.

    ``fed_tokens`` when recorded; otherwise, for a run that was not forced, its own greedy choices."""
    if metadata.get("fed_tokens") is not None:
        return metadata["fed_tokens"]
    tokens = metadata.get("tokens")
    if tokens is not None and not metadata.get("forced_from"):
        return [row[:-1] for row in tokens]
    return None


def input_differences(reference: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """How two traces' run inputs differ (``RUN_INPUTS`` and the tokens fed), one phrase per field;
    empty when they agree. Fields a trace does not record are not compared."""
    found = []
    for name in RUN_INPUTS:
        a, b = reference.get(name), candidate.get(name)
        if a is not None and b is not None and a != b:
            found.append(f"{name}: reference {a!r}, candidate {b!r}")
    ref_fed, cand_fed = fed_tokens(reference), fed_tokens(candidate)
    if not found and ref_fed is not None and cand_fed is not None and ref_fed != cand_fed:
        how = ("" if candidate.get("forced_from") else
               " (the candidate was not forced to the reference's tokens: record it with --forced-from REFERENCE)")
        differ = sorted((s, r) for r, (ra, ca) in enumerate(zip(ref_fed, cand_fed))
                        for s, (x, y) in enumerate(zip(ra, ca)) if x != y)
        if differ:
            step, row = differ[0]
            found.append(f"tokens fed: at step {step + 1} row {row} the reference was fed {ref_fed[row][step]}, "
                         f"the candidate {cand_fed[row][step]}{how}")
        else:
            found.append(f"tokens fed: shapes differ{how}")
    return found


def first_flip(ref_tokens: torch.Tensor, cand_tokens: torch.Tensor) -> dict[str, int] | None:
    """The earliest step at which the candidate's own greedy choice differs (and a row where it does)."""
    flips = (ref_tokens != cand_tokens).nonzero().tolist()
    if not flips:
        return None
    step = min(f[1] for f in flips)
    return {"row": next(r for r, t in flips if t == step), "step": step}


@torch.no_grad()
def check_observation(model: Any, prompts: torch.Tensor, new_tokens: int, tokens: torch.Tensor,
                      traced: dict[int, torch.Tensor], *, mode: str = "eager",
                      cache_len: int | None = None) -> dict[str, Any]:
    """Re-run untraced with the same tokens; the last-position logits must be bitwise equal at every step."""
    from ulptrace.comparison import bitwise_equal

    untraced: dict[int, torch.Tensor] = {}
    greedy(model, prompts, new_tokens, forced=tokens, mode=mode, cache_len=cache_len,
           on_logits=lambda s, l: untraced.__setitem__(s, l.clone()))
    differing = [s for s in traced if not bitwise_equal(traced[s], untraced[s])]
    return {
        "checked": True,
        "bitwise_equal": not differing,
        "steps": len(traced),
        "differing_steps": differing,
        "what": f"final-position logits of a traced vs an untraced run ({mode} mode), every step",
    }


# -- batch rows ----------------------------------------------------------------------------------

def batch_row(tensor: torch.Tensor, row: int, batch: int) -> torch.Tensor:
    """Batch row ``row`` of a tensor recorded in a run of ``batch`` rows, keeping the batch dimension (a copy
    where it is a part of the tensor).

    Records are batch-first: ``[batch, ...]`` gives ``[1, ...]``; a leading dimension of 1 is shared by
    every row (rotary tables, a broadcast mask) and is kept; a leading dimension of ``batch * k`` is a
    batch-major flattening (HF's GatedDeltaNet norm sees ``[batch * tokens * heads, dim]``) and gives the
    row's ``k``. Raises ``ValueError`` for a leading dimension that is none of these.
    """
    if not 0 <= row < batch:
        raise ValueError(f"row {row} is outside a batch of {batch} rows")
    if batch == 1 or tensor.dim() == 0 or tensor.shape[0] == 1:
        return tensor
    first = tensor.shape[0]
    if first % batch:
        raise ValueError(f"cannot take batch row {row} of a tensor of shape {list(tensor.shape)}: expected a leading "
                         f"dimension of {batch} (the batch), 1 (shared) or a multiple of {batch} (batch-major)")
    size = first // batch
    return tensor[row * size:(row + 1) * size].clone()


def record_row(record: Any, row: int, batch: int) -> Any:
    """``record`` (``ulptrace.trace.Record``) restricted to batch row ``row``: its output and inputs (``batch_row``)."""
    from ulptrace.trace import Record

    return Record(record.site, record.step, record.kind, record.layer, batch_row(record.out, row, batch),
                  {k: batch_row(v, row, batch) for k, v in record.inputs.items()})


class RowSink:
    """A recorder sink that hands each record, restricted to one batch row, to that row's sink.

    ``RowSink(batch, {row: sink, ...})``: e.g. a ``MemorySink`` per row of the reference and a
    ``StreamingComparator`` per row of the candidate, so a batched run is compared row by row and only the
    rows asked for are kept. Inner sinks receive the recorder's metadata with ``row`` and ``batch`` added.
    """

    def __init__(self, batch: int, sinks: dict[int, Any]) -> None:
        for row in sinks:
            if not 0 <= row < batch:
                raise ValueError(f"row {row} is outside a batch of {batch} rows")
        self.batch, self.sinks = batch, dict(sinks)

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        for row, sink in self.sinks.items():
            meta = {**metadata, "row": row, "batch": self.batch}
            if hasattr(sink, "set_metadata"):
                sink.set_metadata(meta)
            elif hasattr(sink, "trace"):  # a MemorySink keeps its trace's metadata
                sink.trace.metadata.update(meta)

    def add(self, record: Any) -> None:
        for row, sink in self.sinks.items():
            sink.add(record_row(record, row, self.batch))
