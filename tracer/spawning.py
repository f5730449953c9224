"""Helper processes started without torch: the start method, the environment a helper starts with, and an onset's
reference process itself — so that a command can start that process at its first line.

Why a module of its own, free of torch: ``onset``'s reference process, when the reference runs in a process of its
own (``ulptrace.concurrent``), spends most of its start-up importing — torch, transformers, the model's modules: 9-10
s on the H200's host — and can only then run. This process builds its candidate meanwhile. Started once this process
had imported torch and transformers itself (4-6 s into the command, ``bench/RESULTS.md``, twenty-fifth round), it was
ready after this side's build, which then waited for it. Nothing here imports torch, so an onset that runs its
reference in a process of its own from the start (``--concurrent``, or the default's rule: ``beside_from_start``) has
it started at the command's first line (``start_reference``: ready 2-7 s before this side's build ends on the H200)
and ``ulptrace.concurrent`` takes it (``take_reference``); an onset that does not stops it (``drop_reference``).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import types
from collections.abc import Iterable
from typing import Any

ROLES = ("reference", "candidate")  # what a side process serves: an onset's reference, or its candidate beside it
AHEAD = 4  # messages (a step's records, or a part of them) the reference may run ahead of the candidate
FLIGHT_WAIT_S = 0.0005  # how often a side process waiting for its shipped bytes to come down looks again (InFlight)
# a model whose weights take this much or more has the command's default (concurrent="auto") run its reference in a
# process of its own from the start on a CUDA device (beside_from_start)
FROM_START_BYTES = 512 << 20


def beside_from_start(model: str, device: str, dtype: str, concurrent: Any, reference_memory: str) -> int | None:
    """The weights' bytes of an onset whose sides run in processes of their own from the start under
    ``concurrent="auto"`` (the command's default: as ``concurrent="split"``, this process comparing only); None where
    they do not (its two sides then run one after the other here, switching only if the reference's records are
    forecast to outgrow their GPU share). Torch-free: the command asks it at its first line, to start those processes
    (:func:`start_reference`), and the onset asks it again.

    Where: a CUDA device, the reference's records kept as ``auto`` keeps them, and a model of ``FROM_START_BYTES`` of
    weights or more (``ulptrace.catalog.weight_bytes``). Measured on the H200 (``bench/RESULTS.md``, twenty-fifth and
    twenty-sixth rounds): a process started at the command's first line is ready 3-7 s before this side has built the
    0.8B shape, so its start-up costs a command nothing measurable (the CLI's default workload with the oracle, one
    command each: 24.6 s against 25.6 s one side after the other, four rounds), and the two sides then run at once
    (P1's workload 1.31x the untraced pair against 2.30x); with the candidate in a process of its own too, this one
    only comparing, 1.37-1.42x against 1.58x with the candidate here, on one H100 the same minutes (thirty-seventh
    round). A model built in a moment would wait for that start-up, and a CPU has no cores to spare for it."""
    from ulptrace.catalog import weight_bytes

    if concurrent != "auto" or reference_memory != "auto" or not device.startswith("cuda"):
        return None
    size = weight_bytes(model, dtype)
    return size if size is not None and size >= FROM_START_BYTES else None


def spawn_context() -> Any:
    """The start method of every helper process: spawned (a fork would copy CUDA state, which CUDA forbids). The same
    context as ``torch.multiprocessing``'s; torch's reductions, which share tensors through it, are registered when
    torch is imported — before any tensor is sent."""
    return multiprocessing.get_context("spawn")


def helper_environment(verbosity: str | None = None) -> dict[str, str]:
    """What a helper's environment gets that the user did not set there (spawned helpers read the environment as it
    is when they start): OpenMP's passive wait policy — a helper shares this machine's cores with this process, and
    OpenMP threads that spin between parallel regions keep cores from the other side's work (on 2 cores, a reference
    process spinning beside this one made its run 3-6x slower: ``bench/idle_helper.py``; how threads wait changes no
    result) — and this process's transformers verbosity (``verbosity`` where transformers is not imported yet), which
    a new process would otherwise start at ``warning``: the CLI keeps HF's fallback notices out of its output, and a
    helper printed them beside it."""
    chosen = {"OMP_WAIT_POLICY": "PASSIVE"}
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        names = {level: name for name, level in getattr(hf_logging, "log_levels", {}).items() if name != "detail"}
        verbosity = names.get(hf_logging.get_verbosity(), verbosity)
    if verbosity is not None:
        chosen["TRANSFORMERS_VERBOSITY"] = verbosity
    return {key: value for key, value in chosen.items() if key not in os.environ}


def start_processes(processes: Iterable[Any], verbosity: str | None = None) -> None:
    """Start helper processes (spawned) with :func:`helper_environment` added to this process's environment for their
    start only; this process's environment is left as it was."""
    added = helper_environment(verbosity)
    os.environ.update(added)
    try:
        for process in processes:
            process.start()
    finally:
        for key in added:
            del os.environ[key]


class InFlight:
    """The bytes a side process has shipped and its parent has not yet compared, and how often the parent has waited
    for a message: what bounds a run's records in flight in bytes, not only in messages (``AHEAD``) — a long prompt's
    prefill ships parts of hundreds of MiB, and each side of a split onset then held up to AHEAD of them waiting, one
    being written, those the parent was reading and those waiting for its device (P5, ``bench/RESULTS.md``,
    thirty-eighth round). Counters in shared memory, each written by one process only (no lock a killed process
    could leave held): the side process counts what it ships (:meth:`wait_to_ship`, then :meth:`shipped`), the parent
    what it is done with (:meth:`let_go`: a message whose records it has all compared — what it keeps after that is
    its own to hold) and each time it waits (:meth:`wants`). The side process ships when the bytes in
    flight stay within its budget, when nothing is in flight, or, once for each time the parent began to wait for a
    message, past its budget (the parent may hold what is in flight while it needs more: never a deadlock)."""

    SHIPPED, LET_GO, WANTS = range(3)

    def __init__(self, context: Any) -> None:
        self._counts = context.RawArray("q", 3)  # int64s, aligned: a read sees one write whole
        self._answered = 0  # the side process's: the parent's waits it has shipped past its budget for

    def reset(self) -> None:
        """The parent, before it sends a run (the process is idle: nothing of its last run is in flight). Its waits
        are counted on (the side process remembers those it answered)."""
        self._counts[self.SHIPPED] = self._counts[self.LET_GO] = 0

    @property
    def bytes(self) -> int:
        """Shipped and not yet compared."""
        return self._counts[self.SHIPPED] - self._counts[self.LET_GO]

    def wait_to_ship(self, nbytes: int, budget: int, gone: Any) -> float:
        """The side process, before shipping ``nbytes``: wait while something is in flight, these bytes would take
        it past ``budget`` and the parent has not begun a wait since the last one answered so; ``gone()``, called each
        second, raises if the parent is gone. Returns the seconds waited."""
        began = checked = now = time.perf_counter()
        counts = self._counts
        while counts[self.SHIPPED] > counts[self.LET_GO] and self.bytes + nbytes > budget:
            if counts[self.WANTS] > self._answered:
                self._answered = counts[self.WANTS]
                break
            time.sleep(FLIGHT_WAIT_S)
            now = time.perf_counter()
            if now - checked >= 1.0:
                checked = now
                gone()
        return now - began

    def shipped(self, nbytes: int) -> None:
        """The side process has handed ``nbytes`` more on."""
        self._counts[self.SHIPPED] += nbytes

    def let_go(self, nbytes: int) -> None:
        """The parent is done with ``nbytes`` it was shipped (their records all compared)."""
        self._counts[self.LET_GO] += nbytes

    def wants(self) -> None:
        """The parent begins to wait for a message (none has come)."""
        self._counts[self.WANTS] += 1


def _reference_main(commands: Any, out: Any, acks: Any, flight: InFlight) -> None:
    """The reference process's entry point: its serving loop, imported there (torch with it)."""
    from ulptrace.concurrent import serve

    serve(commands, out, acks, flight)


class ReferenceStart:
    """A side process (``ulptrace.concurrent.serve``; ``role``, of ``ROLES``: the reference's, or a split onset's
    candidate's) just started, and its queues: configurations in (``commands``), a run's messages out (``messages``,
    at most ``AHEAD`` waiting), this side's reads of live values it waits on (``acks``), the bytes in flight
    (``flight``, :class:`InFlight`); ``spawned_at``
    (``time.perf_counter()``) and ``prepared``, the (model, device) it was told to import for (:meth:`prepare`)."""

    def __init__(self, verbosity: str | None = None, role: str = "reference") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, but got {role!r}")
        context = spawn_context()
        self.spawned_at = time.perf_counter()
        self.prepared: tuple[str, str] | None = None
        self.commands = context.Queue()
        self.messages = context.Queue(maxsize=AHEAD)
        self.acks = context.Queue()
        self.flight = InFlight(context)
        self.process = context.Process(target=_reference_main,
                                       args=(self.commands, self.messages, self.acks, self.flight),
                                       daemon=True, name=f"ulptrace-{role}")
        start_processes([self.process], verbosity)

    def prepare(self, model: str, device: str) -> None:
        """Have the process import what a run of ``model`` on ``device`` needs (``processes.prepare_imports``: the
        model's modules, its CUDA context) before its run comes — once per (model, device)."""
        if self.prepared != (model, device):
            self.commands.put(("prepare", types.SimpleNamespace(model=model, device=device)))
            self.prepared = (model, device)


# started by start_reference, not taken yet: by (role, model, device), one run's at most
_EARLY: dict[tuple[str, str, str], ReferenceStart] = {}


def start_reference(model: str, device: str, verbosity: str | None = None,
                    roles: tuple[str, ...] = ("reference",)) -> ReferenceStart:
    """Start, now, the side processes of an onset of ``model`` on ``device`` that this process is about to run — the
    reference's, and for a split onset (``RunConfig(concurrent="split")``) the candidate's too (``roles``) — and have
    each prepare its imports (``verbosity``: the transformers verbosity this process will set). The onset takes each
    (:func:`take_reference`); one it does not take is stopped by :func:`drop_reference` (and, as a daemon process, at
    this process's exit). Returns the first role's."""
    drop_reference()
    for role in roles:
        start = ReferenceStart(verbosity, role)
        start.prepare(model, device)
        _EARLY[role, model, device] = start
    return _EARLY[roles[0], model, device]


def take_reference(model: str, device: str, role: str = "reference") -> ReferenceStart | None:
    """The process of ``role`` that :func:`start_reference` started for ``model`` on ``device``, if it is still alive
    (it is then this caller's); any started for another model or device is stopped (the other role's of this run is
    left to its taker)."""
    start = _EARLY.pop((role, model, device), None)
    for key in [k for k in _EARLY if k[1:] != (model, device)]:
        _stop(_EARLY.pop(key))
    if start is not None and start.process.is_alive():
        return start
    if start is not None:
        _stop(start)
    return None


def drop_reference() -> None:
    """Stop the side processes :func:`start_reference` started that nobody took (the onset ran in this process
    alone, or took only one of them)."""
    while _EARLY:
        _stop(_EARLY.popitem()[1])


def _stop(start: ReferenceStart) -> None:
    from ulptrace.processes import end_processes  # torch: loaded by whoever ran since

    # killed, not asked: it may still be importing, and the caller's run does not wait for it
    end_processes([start.process], [start.commands, start.messages, start.acks])
