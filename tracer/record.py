"""Recording: observe a model's sites with hooks and taps, step by step, into a sink.

``Recorder`` is a context manager. On entry it installs forward (pre-)hooks on the modules the
selected sites observe, and observers on the function taps that carry non-module sites (GDN gates
and core, attention core); on exit it removes every one of them, also when the forward raised.
Each call of the model's root module is one *step* (0 = prefill, t = t-th decode forward), so it
works for a plain forward and for ``generate``. A module called more than once in a step gives
sites numbered ``name#1``, ``name#2``.

Sinks decide what is kept:

- ``MemorySink`` keeps every record (the trace in memory; simplest, costs all activations);
- ``ulptrace.trace.TraceWriter`` writes a shard per step to disk (memory: one step);
- ``ulptrace.comparison.StreamingComparator`` compares each record against a reference on the fly
  and keeps only statistics (memory: one step of the reference and the current step's inputs).

Observation never changes numerics: hooks only read (tensors are cloned), and
``check_observation`` re-runs the model untraced to prove the final logits are bitwise equal.

torch.compile: when the model is compiled in place (``model.compile()``), hooks run inside the compiled
graph, so they do nothing there but copy the values the selected sites need (each copy a graph output) into
one list; the recorder calls the compiled model through a wrapper of its own that counts the step before the
call and, after it, turns that list into records and hands them to the sink — outside the graph, so a sink
(a streaming comparison, the oracle) is never traced into it and no Python state that changes per step is
read inside it. Which sites can be observed without changing what Inductor computes is the path's business
(``ulptrace.thirdparty.compile_observable_sites``).

CUDA graphs: hooks fire while a graph is captured, never when it replays. Between
``begin_capture()`` and ``end_capture()`` (``ulptrace.run.Session`` calls them) the recorder copies
what it observes into tensors allocated inside the capture — buffers that belong to the graph and are
rewritten by every replay — and emits nothing; ``replayed()`` then counts one step and emits that
step's records from the buffers. Nothing in a capture talks to the host: sinks run after replay.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from ulptrace.families import is_gated_deltanet
from ulptrace.sdpa import pinned
from ulptrace.sites import CONV_FUNCTIONS, GDN_FUNCTIONS, Obs, Site, attention_lookup, site_table, submodule
from ulptrace.taps import tap
from ulptrace.trace import Record, Trace, dtype_name, library_versions

_INPUT_NAMES = ("hidden_states", "x", "input", "hidden")
RECORDING_GC_THRESHOLD = 100_000  # allocations between the garbage collector's young passes while recording
RECORDERS_ATTR = "__ulptrace_recorders__"  # the model's active recorders, for ulptrace.run
_FROM_INPUT = object()  # compiled mode: a norm's residual is its own input (resolved after the graph ran)


class _Owned(NamedTuple):
    """An observed value that already is the recorder's own copy (a norm's residual read back from its buffered
    input): kept as it is, not copied again."""

    copy: torch.Tensor


class Sink(Protocol):
    """Receives records in execution order; may also define ``set_metadata(dict)``, called on entry, and
    ``live_bytes`` (an int): then a record's tensors of at least that many bytes may be the model's own values, not
    copies — valid only while ``add`` runs, so the sink reads them there (a kernel enqueued on the stream counts) or
    copies what it keeps. A value that large, whose readers are all served by records emitted where it is observed
    (the logits), then is never copied on the device (``LIVE_BYTES``). A sink may define ``copy_value(tensor)``
    too: the recorder's copies of observed values are then made by it (into memory it ships as it is,
    ``ulptrace.processes.Arenas``), except inside a CUDA-graph capture; None from it: the recorder copies as usual."""

    def add(self, record: Record) -> None: ...


# a copy of at most this many bytes is held to the step's end, for the value's or its views' later observations
# (Recorder._copy_once): a decode step's values (0.8B, batch 8: 16-128 KiB), not a long prefill's
HOLD_BYTES = 256 << 10
LIVE_BYTES = 64 << 20  # values of this size and more go uncopied to sinks that take them (Sink.live_bytes)


class Outgrowth(NamedTuple):
    """A forecast past a GPU's room (``MemorySink``'s ``on_outgrow``): the bytes kept there so far, the run's
    forecast total, the room, and what the forecast was made from (``RecordForecast.basis``)."""

    kept_bytes: int
    forecast_bytes: int
    room_bytes: int
    basis: str


class RecordForecast:
    """What a run's records will have taken by its end, forecast as they arrive, so that a reference that cannot fit
    its room is known at its first layers instead of once the room is full (a long prompt's prefill filled half an
    H200, 67 GiB at layer 14 of 24, before the onset switched to ``--concurrent``).

    ``layers`` maps each layer the run records to its kind (the site kinds recorded there: a hybrid model's layers
    record different amounts); ``steps`` is the run's number of forward steps. In step 0 (the prompt), at each new
    layer: the bytes seen so far, plus, for each layer not yet passed, the mean of the passed layers of its kind (of
    all passed layers while its kind has none). At the start of each step after the first decode step: the bytes seen
    so far plus the decode step just ended's bytes for each step left. What it has not seen is left out (decode steps
    while in the prompt, records after the last layer, a decode step's attention inputs growing with the cache), so
    apart from a kind not yet passed it reads low."""

    def __init__(self, layers: dict[int, Any], steps: int) -> None:
        self._kinds = dict(sorted(layers.items()))
        self._order = {layer: i for i, layer in enumerate(self._kinds)}
        self._steps = steps
        self._step = 0
        self._before = 0  # bytes of the steps before this one
        self._this = 0  # bytes of this step so far
        self._by_layer: dict[int, int] = {}  # step 0: bytes of each layer so far
        self._at = -1  # step 0: the position (in ``layers``' order) of the last layer seen
        self.basis = ""  # what the last forecast was made from, in words

    def add(self, step: int, layer: int | None, size: int) -> int | None:
        """Count a record of ``size`` bytes; the forecast total when this record starts a layer of the prompt or a
        later step (None otherwise)."""
        forecast = None
        if step != self._step:
            ended, left, decoded = self._this, self._steps - step, self._step > 0
            self._before, self._step, self._this = self._before + ended, step, 0
            if decoded:  # (the prompt's step is no measure of a decode step's)
                forecast = self._before + ended * left
                self.basis = f"step {step - 1}'s records for each of the {left} steps left"
        position = self._order.get(layer) if step == 0 and layer is not None else None
        if position is not None and position > self._at:
            if self._at >= 0:
                forecast = self._prompt(position)
            self._at = position
        self._this += size
        if position is not None:
            self._by_layer[layer] = self._by_layer.get(layer, 0) + size
        return forecast

    def _prompt(self, position: int) -> int:
        """Step 0's forecast at the start of the layer at ``position``: the layers before it passed."""
        passed = {layer: self._by_layer.get(layer, 0) for layer in list(self._kinds)[:position]}
        by_kind: dict[Any, list[int]] = {}
        for layer, size in passed.items():
            by_kind.setdefault(self._kinds[layer], []).append(size)
        overall = sum(passed.values()) / len(passed)
        ahead = sum(sum(by_kind[kind]) / len(by_kind[kind]) if kind in by_kind else overall
                    for layer, kind in self._kinds.items() if layer not in passed)
        self.basis = f"the prompt's first {position} of {len(self._kinds)} layers"
        return int(self._this + ahead)


class MemorySink:
    """Keeps every record (a ``Trace`` in memory); with ``device`` (e.g. ``"cpu"``) records are moved
    there as they arrive — a GPU run's reference kept in host memory instead of GPU memory. A move from a
    GPU to the host is an asynchronous copy into pinned memory (the run does not wait for it); reading
    ``trace`` waits for the copies made so far.

    ``device="auto"``: a record stays on the GPU that produced it while the memory allocated there (when the
    first record arrived) plus the records kept stays within ``AUTO_SHARE`` of the GPU's memory, and goes to
    the host after (so a short run keeps its reference where comparing it costs nothing, and a long one cannot
    run the GPU out of memory). Counted here, not asked of the allocator per record (its statistics cost
    0.3 ms a call; ``room`` is the bound). What went to the host is counted (``spilled``: records and bytes) and,
    the first time, ``on_spill(record, kept_bytes)`` is called with the record sent there and what its GPU kept: a
    long run's reference outgrowing its GPU share is slow (its copies into page-locked host memory, then each
    record's way back to be compared), and the caller should say so or do otherwise (``onset``). With a
    ``forecast`` (a :class:`RecordForecast` of the run), ``on_outgrow(record, Outgrowth)`` is called once, at
    the first forecast past the room of the GPU the records are kept on — for a caller that does
    otherwise, before the room is full (only while every record kept came from one GPU).
    """

    AUTO_SHARE = 0.5

    def __init__(self, metadata: dict[str, Any] | None = None, device: str | torch.device | None = None,
                 on_spill: Callable[[Record, int], None] | None = None, forecast: RecordForecast | None = None,
                 on_outgrow: Callable[[Record, Outgrowth], None] | None = None) -> None:
        self._trace = Trace(metadata)
        self.auto = device == "auto"
        self.device = torch.device("cpu") if self.auto else None if device is None else torch.device(device)
        # into host memory, a large value is copied there straight from the model's own tensor (no device copy
        # first: a long prompt's logits are gigabytes); one already in host memory is copied here (Sink.live_bytes)
        self.live_bytes = LIVE_BYTES if self.device is not None and self.device.type == "cpu" and not self.auto \
            else None
        self._copying: set[torch.device] = set()  # GPUs with asynchronous copies not yet waited for
        self._budget: dict[torch.device, int | None] = {}  # auto: bytes this sink may still keep on each device
        self.kept_bytes: dict[torch.device, int] = {}  # auto: bytes kept on each GPU (each bounded device)
        self.spilled = {"records": 0, "bytes": 0}  # auto: what went to the host past a GPU's share
        self._on_spill = on_spill
        self._forecast, self._on_outgrow = forecast, on_outgrow

    @property
    def trace(self) -> Trace:
        for device in self._copying:
            torch.cuda.synchronize(device)
        self._copying.clear()
        return self._trace

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Called by the recorder on entry: the run's metadata becomes the trace's."""
        self._trace.metadata = {**metadata, **self._trace.metadata}

    @classmethod
    def room(cls, device: torch.device) -> int | None:
        """``auto``: the bytes of records this sink may keep on ``device``, from the first record there on —
        ``AUTO_SHARE`` of a GPU's memory less what is allocated there then; None (no bound) elsewhere: a CPU run's
        records stay in place."""
        if device.type != "cuda":
            return None
        return int(cls.AUTO_SHARE * torch.cuda.get_device_properties(device).total_memory) \
            - torch.cuda.memory_allocated(device)

    def _fits(self, record: Record) -> bool:
        """``auto``: whether ``record`` may stay where it was produced (see the class doc); counts it where it goes."""
        where = record.out.device
        if where not in self._budget:
            self._budget[where] = self.room(where)
        if self._budget[where] is None:
            return True
        size, seen = record.out.nbytes, {id(record.out)}
        for t in record.inputs.values():  # a tensor in several roles counts once
            if id(t) not in seen:
                seen.add(id(t))
                size += t.nbytes
        if self._forecast is not None:
            self._foresee(record, size, where)
        if size <= self._budget[where]:
            self._budget[where] -= size
            self.kept_bytes[where] = self.kept_bytes.get(where, 0) + size
            return True
        if not self.spilled["records"] and self._on_spill is not None:
            self._on_spill(record, self.kept_bytes.get(where, 0))
        self.spilled["records"] += 1
        self.spilled["bytes"] += size
        return False

    def _foresee(self, record: Record, size: int, where: torch.device) -> None:
        """Count ``record`` in the forecast; past the room, say so once (``on_outgrow``)."""
        if sum(budget is not None for budget in self._budget.values()) > 1:  # records on several GPUs: each has its
            self._forecast = None  # own room, the forecast is the run's
            return
        forecast, kept = self._forecast, self.kept_bytes.get(where, 0)
        room = self._budget[where] + kept  # as it was when the first record came (spilled ones never counted)
        total = forecast.add(record.step, record.layer, size)
        if total is not None and total > room:
            self._forecast = None
            if self._on_outgrow is not None:
                self._on_outgrow(record, Outgrowth(kept, total, room, forecast.basis))

    def add(self, record: Record) -> None:
        if self.auto and self._fits(record):
            self._trace.add(record)
            return
        if self.device is not None and record.out.device != self.device:
            moved: dict[int, torch.Tensor] = {}  # tensors shared between a record's roles move once

            def move(t: torch.Tensor) -> torch.Tensor:
                if id(t) not in moved:
                    later = t.is_cuda and self.device.type == "cpu"  # into pinned memory, waited for by .trace
                    moved[id(t)] = t.to(self.device, non_blocking=later)
                    if later:
                        self._copying.add(t.device)
                return moved[id(t)]

            record = Record(record.site, record.step, record.kind, record.layer, move(record.out),
                            {role: move(t) for role, t in record.inputs.items()})
        elif self.live_bytes is not None:  # already in host memory: a large tensor may be the model's own
            record = _owned_record(record, self.live_bytes)
        self._trace.add(record)


def _owned_record(record: Record, live_bytes: int) -> Record:
    """``record`` with each tensor of ``live_bytes`` or more replaced by a copy (one per tensor), for a sink that keeps
    records it may have been handed uncopied (``Sink.live_bytes``)."""
    big = [t for t in (record.out, *record.inputs.values()) if t.nbytes >= live_bytes]
    if not big:
        return record
    copies = {id(t): _copy(t) for t in big}
    own = lambda t: copies.get(id(t), t)
    return Record(record.site, record.step, record.kind, record.layer, own(record.out),
                  {role: own(t) for role, t in record.inputs.items()})


def _first_tensor(value: Any, index: int = 0) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if index == 0 else None
    if isinstance(value, (tuple, list)):
        tensors = [v for v in value if isinstance(v, torch.Tensor)]
        return tensors[index] if len(tensors) > index else None
    if hasattr(value, "to_tuple"):  # HF ModelOutput: a causal LM's logits, whether or not a loss comes first
        logits = value.get("logits") if index == 0 and hasattr(value, "get") else None
        return logits if isinstance(logits, torch.Tensor) else _first_tensor(value.to_tuple(), index)
    return None


def _arg(args: tuple, kwargs: dict, index: int) -> torch.Tensor | None:
    positional = [a for a in args if isinstance(a, torch.Tensor)]
    if len(positional) > index:
        return positional[index]
    named = [kwargs[n] for n in _INPUT_NAMES if isinstance(kwargs.get(n), torch.Tensor)]
    named += [v for k, v in kwargs.items() if k not in _INPUT_NAMES and isinstance(v, torch.Tensor)]
    rest = index - len(positional)
    return named[rest] if 0 <= rest < len(named) else None


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor of torch's own type: its size in bytes and its storage can be asked (a DTensor's storage cannot,
    a sparse tensor has no ``nbytes``) — what the recorder's reuse of copies and its uncopied large values need."""
    return type(t) is torch.Tensor and t.layout is torch.strided


def _storage_key(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage begins, when ``t`` is a dense tensor of torch's own type (``_plain``) whose values are its
    memory read in order — contiguous, no lazy conjugation or negation (a ``conj()`` view shares its base's memory but
    not its values), so a view of a copy of that memory holds them; else None. The recorder keeps and finds copies by
    it (``Recorder._copy_once``)."""
    if _plain(t) and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t.untyped_storage().data_ptr()
    return None


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.detach().clone() if t.requires_grad else t.clone()  # detach only where it does something


def model_metadata(model: Any, path: str) -> dict[str, Any]:
    from ulptrace.models import model_name

    param = next(model.parameters(), None)
    return {
        "model": model_name(model),
        "architecture": type(model).__name__,
        "path": path,
        "dtype": dtype_name(param.dtype) if param is not None else None,
        "device": str(param.device) if param is not None else None,
        "seed": getattr(model, "ulptrace_seed", None),
        "attn_implementation": getattr(getattr(model, "config", None), "_attn_implementation", None),
        **({"sdpa": pinned(model)} if pinned(model) != "default" else {}),
        "versions": library_versions(),
        "parameters": parameter_checksums(model),
    }


@torch.no_grad()
def parameter_checksums(model: torch.nn.Module) -> dict[str, str]:
    """A cheap bitwise fingerprint of every parameter (``dtype:shape:sum of bit patterns``).

    Two paths of the same model must hold the same parameters; a kernel that caches a converted or
    stale copy shows up as a differing checksum (``Comparison.parameters``). Computed on the
    parameters' device, one reduction each, read back together (one synchronisation per device). A
    tensor-parallel parameter (a DTensor) is fingerprinted whole, so it compares with the unsharded model's:
    gathering it is a collective, so every rank of the model's process group must call this (``ulptrace.tp``
    checks each rank's shard on its own).
    """
    from ulptrace.ulp import bits

    shapes, sums = [], []
    for name, p in model.named_parameters(remove_duplicate=True):
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        shapes.append((name, f"{dtype_name(p.dtype)}:{'x'.join(map(str, p.shape))}"))
        # exact in int64 in any order, without an int64 copy of the parameter
        sums.append(bits(p.detach()).sum(dtype=torch.int64) if p.numel() else None)
    totals: dict[int, int] = {}
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, total in enumerate(sums):
        if total is not None:
            by_device[total.device].append(i)
    for indices in by_device.values():
        totals.update(zip(indices, torch.stack([sums[i] for i in indices]).tolist()))
    return {name: f"{head}:{totals.get(i, 0)}" for i, (name, head) in enumerate(shapes)}


class _RecordingCollector:
    """Python's cyclic garbage collector while any recorder is active (entered by each, restored by the last to exit).

    A traced run allocates many small containers (records, statistics). With the collector's default threshold it ran
    hundreds of young collections during one onset (0.27-0.29 s of 2.5 s on the H200's host); now once per
    ``RECORDING_GC_THRESHOLD`` allocations (still collecting, so cycles cannot pile up; a caller's higher threshold is
    kept). And the objects that exist when recording starts (the libraries, the models: hundreds of thousands) are
    frozen out of the collector's view (``gc.freeze``) until it ends: a full collection, which lands in some runs
    and not others, scanned them all — 0.2-0.25 s of the CPU proxy's onset, 2 ms frozen. Left alone when someone
    else has frozen objects (unfreezing would release theirs too).
    """

    active = 0
    threshold: tuple[int, ...] | None = None
    froze = False

    @classmethod
    def enter(cls) -> None:
        cls.active += 1
        if cls.active > 1:
            return
        threshold = gc.get_threshold()
        if threshold[0] < RECORDING_GC_THRESHOLD:
            cls.threshold = threshold
            gc.set_threshold(RECORDING_GC_THRESHOLD, *threshold[1:])
        if gc.get_freeze_count() == 0:
            gc.freeze()
            cls.froze = True

    @classmethod
    def exit(cls) -> None:
        cls.active = max(0, cls.active - 1)
        if cls.active:
            return
        if cls.threshold is not None:
            gc.set_threshold(*cls.threshold)
            cls.threshold = None
        if cls.froze:
            gc.unfreeze()
            cls.froze = False


@contextlib.contextmanager
def recording_collector() -> Iterator[None]:
    """The garbage collector as while recording (``_RecordingCollector``), for a whole run that records more than once:
    a probe that builds recorders one after another (an onset's reference and candidate, a matrix's runs) holds it
    around them all — ``with recording_collector():`` or, on its entry point, ``@recording_collector()`` — so the
    objects made between them (a recorder's own construction, the reference kept for the candidate) are not where a
    full collection of the unfrozen heap lands (measured: 0.25-0.3 s of an onset on the H200's host)."""
    _RecordingCollector.enter()
    try:
        yield
    finally:
        _RecordingCollector.exit()


class _Emitter:
    """What a site's record is made of, resolved once per recorder: its name, kind and layer, the buffer keys of
    its kept inputs (role, key), and the keys of every observation it reads."""

    __slots__ = ("inputs", "kind", "layer", "name", "reads")

    def __init__(self, site: Site, keep_inputs: bool) -> None:
        self.name, self.kind, self.layer = site.name, site.kind, site.layer
        self.inputs = tuple((role, o.key) for role, o in site.inputs.items()) if keep_inputs else ()
        self.reads = tuple(sorted({site.out.key, *(key for _, key in self.inputs)}))


class _Entry(NamedTuple):
    """One needed observation: its buffer key, how many readers it has (sites; and a module's post-hook that reads
    its own first argument back as the residual), the sites whose output it is."""

    key: str
    uses: int
    emitters: tuple[_Emitter, ...]


def _observation_plan(sites: Sequence[Site], needed: set[Obs], keep_inputs: bool) -> dict[str, dict[str, _Entry]]:
    """module path -> what is observed there -> its ``_Entry``: the recorder's hooks look each value up once.

    A copy leaves the buffer once every reader has read it, so the recorder holds only what a later site still
    needs, not a whole step. The first argument of a module whose residual is observed has one reader more: the
    module's post-hook, which may read it back as the residual (HF's norms return one tensor)."""
    emitters = [(site, _Emitter(site, keep_inputs)) for site in sites]
    uses: dict[str, int] = defaultdict(int)
    for _, emitter in emitters:
        for key in emitter.reads:
            uses[key] += 1
    for obs in needed:
        if obs.at == "residual":
            uses[f"{obs.module}:in0"] += 1
    by_out: dict[str, list[_Emitter]] = defaultdict(list)
    for site, emitter in emitters:
        by_out[site.out.key].append(emitter)
    plan: dict[str, dict[str, _Entry]] = defaultdict(dict)
    for obs in needed:
        plan[obs.module][obs.at] = _Entry(obs.key, uses[obs.key], tuple(by_out.get(obs.key, ())))
    return dict(plan)


class Recorder:
    """Record ``sites`` of ``model`` into ``sink`` while the context is open.

    Args:
        model: an HF causal LM (or any module; models without a site table get the fallback).
        sites: the sites to record (default: the model's whole site table).
        steps: which steps to keep (a range or sequence; default all).
        sink: where records go (default a ``MemorySink``; ``recorder.trace`` then holds them).
        path: the path name recorded in metadata.
        keep_inputs: store each site's oracle inputs (needed for verdicts).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        sites: Sequence[Site] | None = None,
        steps: Iterable[int] | None = None,
        sink: Sink | None = None,
        path: str = "hf",
        keep_inputs: bool = True,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.sites = list(site_table(model) if sites is None else sites)
        self.steps = None if steps is None else steps if isinstance(steps, range) else set(steps)  # (2:, to 2**30)
        self.metadata = {**model_metadata(model, path), **(metadata or {})}
        self.sink: Sink = sink if sink is not None else MemorySink(self.metadata)
        self.keep_inputs = keep_inputs
        self.step = -1
        self._handles: list[Any] = []
        self._buffer: dict[str, torch.Tensor] = {}
        # id(observed) -> (it, its version, its copy, the observing call's serial, the module whose call left it when
        # it was observed as one's result, else None), the first and third weakly
        self._copies: dict[int, tuple[Any, int, Any, int, str | None]] = {}
        # storage -> (the _copies entry, its copy) of small contiguous observed tensors in it, the copy held to the
        # step's end (HOLD_BYTES); a later view inside one is served by a view of its copy
        self._bases: dict[int, list[tuple[tuple[Any, int, Any, int, str | None], torch.Tensor]]] = {}
        self._serial = 0  # counts _observe calls
        self._calls: dict[str, int] = defaultdict(int)
        self._gdn_stack: list[str] = []
        self._needed: set[Obs] = {s.out for s in self.sites}
        if keep_inputs:
            self._needed |= {o for s in self.sites for o in s.inputs.values()}
        # a post-attention norm's residual falls back to its input when it returns one tensor
        self._needed |= {Obs(o.module, "in0") for o in self._needed if o.at == "residual"}
        self._plan = _observation_plan(self.sites, self._needed, keep_inputs)
        self._left: dict[str, int] = {}
        self._tapped: set[tuple[int, str]] = set()
        self._paths: dict[int, str] | None = None
        self._active = False
        self._paused = 0
        self._capturing = False
        self._templates: list[Record] = []  # records of a captured graph step (their tensors are graph buffers)
        self._compiled = False  # the model is compiled in place: hooks queue copies, records are made after the call
        self._queue: list[tuple[str, str, Any]] = []  # compiled mode: ("obs", path, values) / ("call", path, None)
        self._live: int | None = getattr(self.sink, "live_bytes", None)  # Sink.live_bytes
        self._sink_copy: Callable[[torch.Tensor], torch.Tensor | None] | None = \
            getattr(self.sink, "copy_value", None)  # Sink.copy_value

    # -- results -------------------------------------------------------------------------------
    @property
    def trace(self) -> Trace:
        if not isinstance(self.sink, MemorySink):
            raise TypeError("recorder.trace exists only with the default in-memory sink")
        return self.sink.trace

    # -- installation --------------------------------------------------------------------------
    def __enter__(self) -> Recorder:
        if self._active:
            raise RuntimeError("this Recorder is already active; create a new one to record again")
        self._active = True
        set_metadata = getattr(self.sink, "set_metadata", None)
        if set_metadata is not None:
            set_metadata(self.metadata)
        try:
            self._install()
        except BaseException:
            self._remove()
            raise
        # the run layer finds active recorders here (CUDA-graph capture and replay, warm-up pauses)
        self.model.__dict__.setdefault(RECORDERS_ATTR, []).append(self)
        _RecordingCollector.enter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()
        _RecordingCollector.exit()

    def _remove(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        self._copies, self._bases = {}, {}
        self._active = False
        active = self.model.__dict__.get(RECORDERS_ATTR, [])
        if self in active:
            active.remove(self)
        if not active:
            self.model.__dict__.pop(RECORDERS_ATTR, None)

    # -- run-layer protocol: warm-up pauses, CUDA-graph capture and replay -----------------------
    def pause(self) -> None:
        """Stop observing (nestable) — forwards that are not part of the run, such as graph warm-up."""
        self._paused += 1

    def resume(self) -> None:
        self._paused = max(0, self._paused - 1)

    def begin_capture(self) -> None:
        """The next root forward is being captured into a CUDA graph: observe into graph buffers."""
        self._capturing, self._templates = True, []

    def end_capture(self) -> None:
        self._capturing = False

    def replayed(self) -> None:
        """The captured step was replayed: count one step and emit its records from the graph buffers."""
        self.step += 1
        if not self._recording():
            return
        copies: dict[int, torch.Tensor] = {}  # buffers shared between records are copied once

        def own(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in copies:
                copies[id(t)] = t.clone()
            return copies[id(t)]

        for r in self._templates:
            self.sink.add(Record(r.site, self.step, r.kind, r.layer, own(r.out),
                                 {k: own(v) for k, v in r.inputs.items()}))

    def _install(self) -> None:
        model = self.model
        compiled = model.__dict__.get("_compiled_call_impl")
        if compiled is not None:
            self._install_compiled(compiled)
        else:
            self._handles.append(model.register_forward_pre_hook(self._on_step))
        per_module: dict[str, set[str]] = defaultdict(set)
        for obs in self._needed:
            per_module[obs.module].add(obs.at)
        for path, ats in per_module.items():
            module = submodule(model, path) if path else model
            self._install_module(path, module, ats)

    def _install_module(self, path: str, module: torch.nn.Module, ats: set[str]) -> None:
        if ats & {"in0", "in1", "residual", "cos", "sin"}:
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(path, ats), with_kwargs=True))
        if ats & {"out", "out1", "residual", "state.conv", "state.recurrent"}:
            self._handles.append(module.register_forward_hook(self._post_hook(path, ats), with_kwargs=True))
        taps = {at for at in ats if at.startswith("tap.")}
        if taps and is_gated_deltanet(module):  # its gates go to module-level functions
            self._handles.append(module.register_forward_pre_hook(self._gdn_enter(path)))
            self._handles.append(module.register_forward_hook(self._gdn_exit))
            namespace = sys.modules[type(module).__module__]
            for name in GDN_FUNCTIONS + CONV_FUNCTIONS:
                if hasattr(namespace, name) and not self._has_tap(namespace, name):
                    the_tap = tap(namespace, name)
                    # what a call receives is read before it runs (the one-token conv update writes its state in
                    # place; a recurrent kernel may write the state it was given), what it returns after
                    if name in CONV_FUNCTIONS:
                        update = name == CONV_FUNCTIONS[1]
                        self._handles.append(the_tap.add_pre_observer(self._conv_inputs(update)))
                        self._handles.append(the_tap.add_observer(self._on_conv))
                    else:
                        self._handles.append(the_tap.add_pre_observer(self._gdn_inputs))
                        self._handles.append(the_tap.add_observer(self._on_gdn))
                    self._tapped.add((id(namespace), name))
        elif taps:  # an attention module: the core runs through the attention interface
            self._install_attention_tap()

    def _install_compiled(self, compiled: Callable[..., Any]) -> None:
        """Call the compiled model through a wrapper: the step is counted before the call and the queued
        copies become records after it, both outside the compiled graph."""
        from ulptrace.thirdparty import compile_observable_sites

        model = self.model
        self._compiled = True
        self._module_paths()  # built now, not inside the graph
        fused = [s.name for s in self.sites if s not in compile_observable_sites(model, [s])]
        if fused:
            import warnings

            warnings.warn(f"recording {len(fused)} site(s) of a compiled model that Inductor fuses (e.g. {fused[0]}): "
                          "observing them makes them graph outputs, which changes what the compiled model computes; "
                          "ulptrace.thirdparty.compile_observable_sites(model, sites) keeps the sites that do not",
                          stacklevel=3)

        def call(*args: Any, **kwargs: Any) -> Any:
            self._on_step(model, args)
            del self._queue[:]
            try:
                return compiled(*args, **kwargs)
            finally:
                self._drain()

        model.__dict__["_compiled_call_impl"] = call

        class _Unwrap:
            def remove(self) -> None:
                if model.__dict__.get("_compiled_call_impl") is call:
                    model.__dict__["_compiled_call_impl"] = compiled

        self._handles.append(_Unwrap())

    def _drain(self) -> None:
        """Compiled mode: make records of what the graph's hooks queued, in order, as the hooks would have."""
        queued, self._queue[:] = list(self._queue), []
        self._compiled = False  # _observe and _emit work as in eager mode while the queue is replayed
        try:
            if self._paused or self.step < 0 or (self.steps is not None and self.step not in self.steps):
                return
            for kind, path, values in queued:
                if kind == "call":
                    self._calls[path] += 1
                    continue
                if values.get("residual", None) is _FROM_INPUT:
                    values["residual"] = self._input_copy(path)
                # the graph's copies are the recorder's own: kept as they are
                self._observe(path, {at: _Owned(v) if isinstance(v, torch.Tensor) else v for at, v in values.items()})
                if "residual" in values:
                    self._input_read(path)
        finally:
            self._compiled = True

    def _has_tap(self, namespace: Any, name: str) -> bool:
        return (id(namespace), name) in self._tapped

    def _install_attention_tap(self) -> None:
        namespace, name = attention_lookup(self.model)
        if not self._has_tap(namespace, name):
            the_tap = tap(namespace, name)
            self._handles.append(the_tap.add_pre_observer(self._attention_inputs))
            self._handles.append(the_tap.add_observer(self._on_attention))
            self._tapped.add((id(namespace), name))

    # -- hooks ---------------------------------------------------------------------------------
    def _on_step(self, module: Any, args: Any) -> None:
        if self._paused:
            return
        if not self._capturing:  # a captured step counts when it is replayed
            self.step += 1
        self._buffer, self._left = {}, {}
        self._copies, self._bases = {}, {}
        self._calls = defaultdict(int)

    def _recording(self) -> bool:
        if self._paused:
            return False
        if self._compiled:  # the step filter applies when the queue is drained (no per-step state in the graph)
            return True
        if self._capturing:  # every step a replay may stand for; replayed() applies the step filter
            return True
        return self.step >= 0 and (self.steps is None or self.step in self.steps)

    def _pre_hook(self, path: str, ats: set[str]) -> Callable:
        in1, tables_read = "in1" in ats, bool(ats & {"cos", "sin"})  # what it reads: decided once, not at every call

        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            if not self._recording():
                return
            values = {"in0": _arg(args, kwargs, 0)}
            if in1:
                values["in1"] = _arg(args, kwargs, 1)
            if tables_read:
                tables = kwargs.get("position_embeddings")
                if tables is None and len(args) > 1 and isinstance(args[1], (tuple, list)):
                    tables = args[1]
                if isinstance(tables, (tuple, list)) and len(tables) == 2:
                    values["cos"], values["sin"] = tables
            self._observe(path, values)

        return hook

    def _post_hook(self, path: str, ats: set[str]) -> Callable:
        # what it reads: decided once, not at every call
        out, out1, residual = "out" in ats, "out1" in ats, "residual" in ats
        states = bool(ats & {"state.conv", "state.recurrent"})

        def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
            if not self._recording():
                return
            values: dict[str, Any] = {}  # tensors, None, or _Owned
            if out:
                values["out"] = _first_tensor(output)
            if out1:
                values["out1"] = _first_tensor(output, 1)
            if residual:
                # fused add+norm returns (normed, residual); HF's norm input already is the residual
                second = _first_tensor(output, 1) if isinstance(output, (tuple, list)) else None
                if second is not None:
                    values["residual"] = second
                else:
                    values["residual"] = _FROM_INPUT if self._compiled else self._input_copy(path)
            if states:
                values.update(self._gdn_states(module, kwargs))
            self._observe(path, values, outputs=True)
            if residual and not self._compiled:  # compiled: when the queue is drained
                self._input_read(path)
            if self._compiled:
                self._queue.append(("call", path, None))
            else:
                self._calls[path] += 1

        return hook

    def _input_copy(self, path: str) -> _Owned | None:
        """The copy the pre-hook of module ``path`` made of its first argument, read back as its residual."""
        held = self._buffer.get(f"{path}:in0")
        return None if held is None else _Owned(held)

    def _input_read(self, path: str) -> None:
        """Module ``path``'s post-hook is done with its first argument (read back as the residual, or not needed):
        one reader less (none while a graph is captured, where nothing is released)."""
        if not self._capturing:
            self._release((f"{path}:in0",))

    def _gdn_enter(self, path: str) -> Callable:
        def hook(module: Any, args: tuple) -> None:
            self._gdn_stack.append(path)

        return hook

    def _gdn_exit(self, module: Any, args: tuple, output: Any) -> None:
        self._gdn_stack.pop()

    def _gdn_states(self, module: Any, kwargs: dict) -> dict[str, torch.Tensor | None]:
        # transformers <= 5.2x passes the cache as ``cache_params``, later versions as ``cache``
        cache = next((kwargs[k] for k in ("cache", "cache_params") if kwargs.get(k) is not None), None)
        layer = getattr(cache, "layers", None)
        if layer is None:
            return {}
        entry = layer[module.layer_idx]
        get = lambda states: states.get(0) if isinstance(states, dict) else None
        return {
            "state.conv": get(getattr(entry, "conv_states", None)),
            "state.recurrent": get(getattr(entry, "recurrent_states", None)),
        }

    def _conv_inputs(self, update: bool) -> Callable:
        def observe(args: tuple, kwargs: dict) -> None:
            if not self._recording() or not self._gdn_stack:
                return
            state = (args[1] if len(args) > 1 else kwargs.get("conv_state")) if update else None
            x = args[0] if args else kwargs.get("hidden_states")
            self._observe(self._gdn_stack[-1], {"tap.conv_state": state, "tap.conv_x": x})

        return observe

    def _on_conv(self, args: tuple, kwargs: dict, result: Any) -> None:
        if self._recording() and self._gdn_stack:
            self._observe(self._gdn_stack[-1], {"tap.conv": _first_tensor(result)}, outputs=True)

    def _gdn_inputs(self, args: tuple, kwargs: dict) -> None:
        if not self._recording() or not self._gdn_stack:
            return
        named = dict(zip(("query", "key", "value", "g", "beta", "initial_state"), args)) | kwargs
        self._observe(self._gdn_stack[-1], {
            "tap.query": named.get("query"), "tap.key": named.get("key"), "tap.value": named.get("value"),
            "tap.g": named.get("g"), "tap.beta": named.get("beta"), "tap.state": named.get("initial_state"),
        })

    def _on_gdn(self, args: tuple, kwargs: dict, result: Any) -> None:
        if self._recording() and self._gdn_stack:
            self._observe(self._gdn_stack[-1], {"tap.core": _first_tensor(result)}, outputs=True)

    def _attention_path(self, args: tuple) -> str | None:
        return self._module_paths().get(id(args[0])) if args and self._recording() else None

    def _attention_inputs(self, args: tuple, kwargs: dict) -> None:
        path = self._attention_path(args)
        if path is None:
            return
        q, k, v, mask = (list(args[1:5]) + [kwargs.get(n) for n in ("query", "key", "value", "attention_mask")])[:4]
        self._observe(path, {
            "tap.query": q, "tap.key": k, "tap.value": v,
            "tap.mask": mask if isinstance(mask, torch.Tensor) else None,
        })

    def _on_attention(self, args: tuple, kwargs: dict, result: Any) -> None:
        path = self._attention_path(args)
        if path is not None:
            self._observe(path, {"tap.core": _first_tensor(result)}, outputs=True)

    def _module_paths(self) -> dict[int, str]:
        if self._paths is None:
            self._paths = {id(m): name for name, m in self.model.named_modules()}
        return self._paths

    def _observe(self, path: str, values: dict[str, Any], outputs: bool = False) -> None:
        """Buffer (copy) what the sites need of ``values`` observed at module ``path`` and emit the records they
        complete; ``outputs``: values a module call left (a post-hook), see ``_copy_once``."""
        self._serial += 1
        if self._compiled:  # inside the graph: copy what is needed, make records after the call (_drain)
            needed = {at: (v if v is None or v is _FROM_INPUT else _copy(v)) for at, v in values.items()
                      if Obs(path, at) in self._needed}
            self._queue.append(("obs", path, needed))
            return
        plan = self._plan.get(path)
        if plan is None:
            return
        buffer, left = self._buffer, self._left
        live_bytes = None if self._capturing else self._live
        fired, live = [], []
        for at, value in values.items():
            entry = plan.get(at)  # None: nobody reads this observation
            if entry is None:
                continue
            key = entry.key
            if value is None:
                buffer.pop(key, None)
                continue
            if type(value) is _Owned:
                buffer[key] = value.copy
            elif live_bytes is not None and _plain(value) and value.nbytes >= live_bytes:  # read in add (Sink.live_bytes)
                buffer[key] = value
                live.append((key, value))
            else:
                buffer[key] = self._copy_once(value, path if outputs else None)
            left[key] = entry.uses
            if entry.emitters:
                fired.append(entry)
        for entry in fired:
            out = buffer[entry.key]
            for emitter in entry.emitters:
                self._emit(emitter, out, path)
        for key, value in live:  # still needed by a later reader: copied now, unchanged since it was observed
            if buffer.get(key) is value:
                buffer[key] = self._copy_once(value, path if outputs else None)

    def _copy_once(self, value: torch.Tensor, outputs: str | None = None) -> torch.Tensor:
        """A copy of ``value``: the one made earlier in this step when the same tensor, unchanged since (its version
        counter) and its copy still held, was observed under another name — a layer's output is the next layer's
        input — or a view of such a copy when ``value`` is a view inside such a tensor (``_view_of_copy``); else a
        new one. A copy is held by the records and the buffer, and one of at most ``HOLD_BYTES`` by the recorder to
        the step's end, so whether a decode step's value is copied again does not depend on what the sink keeps.
        Shared copies also let a comparison compare such a pair once (``ulptrace.comparison.KnownPairs``).

        ``outputs`` (the path of the module whose call left ``value``: its post-hook, a tap's result): only a copy
        made in the same observation, or of a result of a module called inside that one (an MLP returns its
        ``down_proj``'s output), is reused. A module may write a tensor in place behind the version counter — a
        kernel registered with ``Tensor(a!)`` writes through its pointer and no counter moves, as vLLM's fused add +
        RMSNorm does to its residual, which it returns — so a copy of its input made before the call would be shown
        as its output; a copy made after a call inside it is as late as any input's (the code between two
        observations is trusted to move the counter when it writes)."""
        if value.is_inference():  # no version counter: always a new copy
            return self._new_copy(value)
        entry = self._copies.get(id(value))
        if entry is not None and entry[0]() is value and entry[1] == value._version \
                and (outputs is None or self._after_call(entry, outputs)):
            copy = entry[2]()
            if copy is not None:
                return copy
        storage = _storage_key(value)  # the storage an earlier copy is looked up (and this one kept) by
        bases = None if storage is None else self._bases.get(storage)
        copy = None if bases is None else self._view_of_copy(value, bases, outputs)
        fresh = copy is None
        if fresh:
            copy = self._new_copy(value)
        entry = (weakref.ref(value), value._version, weakref.ref(copy), self._serial, outputs)
        self._copies[id(value)] = entry
        if fresh and storage is not None and value.nbytes <= HOLD_BYTES:
            # a small copy is held to the step's end: the same tensor, or a view of it, is often observed again
            self._bases.setdefault(storage, []).append((entry, copy))
        return copy

    def _new_copy(self, value: torch.Tensor) -> torch.Tensor:
        """A new copy of ``value``: the sink's (``Sink.copy_value``) where it makes one, outside a graph capture
        (whose copies are the graph's buffers), else the recorder's own."""
        if self._sink_copy is not None and not self._capturing:
            copy = self._sink_copy(value)
            if copy is not None:
                return copy
        return _copy(value)

    def _after_call(self, entry: tuple, path: str) -> bool:
        """Whether the copy of ``entry`` may stand for a result of module ``path``'s call (``_copy_once``): made in
        this observation, or when a module inside it returned."""
        inside = entry[4] is not None and (not path or entry[4].startswith(path + "."))  # every module is the root's
        return entry[3] == self._serial or inside

    def _view_of_copy(self, value: torch.Tensor, bases: list, outputs: str | None) -> torch.Tensor | None:
        """A contiguous ``value`` that lies inside a contiguous tensor copied earlier in this step in the same storage
        (``bases``: those copies, from ``_bases``; a view of one: HF splits a projection into query, key and value and
        reshapes them), under the rules of ``_copy_once`` (the version counter, which a view shares with its base,
        unchanged; ``outputs``: copied after the call began): the same view of that copy, since the copy holds the
        bytes the view reads — no second copy. A view that is not contiguous, or conjugated or negated lazily
        (no ``_storage_key``), is copied as it is (the caller does not ask)."""
        for entry, copy in reversed(bases):  # the latest first
            base = entry[0]()
            if base is None or entry[1] != value._version or entry[1] != base._version \
                    or base.dtype != value.dtype or (outputs is not None and not self._after_call(entry, outputs)):
                continue
            start = value.storage_offset() - base.storage_offset()
            if 0 <= start and start + value.numel() <= base.numel():
                # one op (three before: a flat view, a slice, a reshape): the copy is contiguous, so the view's
                # elements lie at ``start`` on in the copy's order, laid out as ``value`` (contiguous) lays them
                return copy.as_strided(value.shape, value.stride(), copy.storage_offset() + start)
        return None

    def _emit(self, site: _Emitter, out: torch.Tensor, path: str) -> None:
        call = self._calls.get(path, 0)
        buffer = self._buffer
        inputs: dict[str, torch.Tensor] = {}
        for role, key in site.inputs:
            value = buffer.get(key)
            if value is not None:
                inputs[role] = value
        record = Record(site.name if call == 0 else f"{site.name}#{call}", self.step, site.kind, site.layer, out,
                        inputs)
        if self._capturing:  # graph buffers: kept for the replays
            self._templates.append(record)
            return
        self.sink.add(record)
        self._release(site.reads)

    def _release(self, keys: Iterable[str]) -> None:
        """One reader of each observation in ``keys`` is done with it: the last one drops the recorder's copy."""
        left, buffer = self._left, self._buffer
        for key in keys:
            count = left.get(key)
            if count is None:
                continue
            if count <= 1:
                del left[key]
                buffer.pop(key, None)
            else:
                left[key] = count - 1

    def held(self) -> list[str]:
        """The observations (``module:at``) the recorder still holds a copy of: those a reader that has not read
        them yet in this step needs (a site to emit, a post-hook to read its input back as the residual)."""
        return sorted(self._buffer)
