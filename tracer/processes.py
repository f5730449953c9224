"""What ulptrace's helper processes share: queues that fail instead of waiting for ever, errors carried across, and
records moved between processes as a few byte arenas.

Two kinds of helper process exist — an onset's reference side (``ulptrace.concurrent``) and the oracle's judging
workers (``ulptrace.judging``) — and each needs the same plumbing: a ``multiprocessing`` queue pickles in a thread of
its own and drops what fails to pickle (printing it), so a side that waits on it must note such failures and raise
them; a helper whose parent has died must stop instead of blocking on a full queue; an exception raised there is
raised here as itself (a bad input's one-line error), with the helper's traceback as its cause; and records cross as
byte arenas (one device copy for many small tensors, shared through CUDA IPC or shared memory: sharing each tensor
costs more than small records), each tensor an (arena, offset, dtype, shape) spec into them. How a helper is started
(the start method, its environment) is ``ulptrace.spawning``'s, which imports no torch.

What is sent is put into shared memory on the sending thread (``byte_arena``, ``shipped_twin``), never left to the
queue's feeder thread: sharing a CPU tensor there copies it with one of torch's parallel loops, and a thread that has
run one keeps an OpenMP team of its own while it lives — libgomp then counts more threads than cores and stops
spin-waiting in every parallel region of the process (a kept reference process made this process's untraced CPU
generations 1.5-1.6x slower until it was shut down: ``bench/idle_helper.py``).
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import pickle
import queue as queue_module
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from ulptrace.trace import Record, dtype_name

POLL_S = 1.0  # how often a wait on another process checks that it (or the parent) is still alive
ALIGN = 16  # byte alignment of each tensor in an arena (any dtype's view of it is aligned)

GUARD = ("if a script started it, its entry point must be guarded by `if __name__ == '__main__':`, as Python's "
         "multiprocessing requires (the new process imports the script)")
"""What a helper process that ended without a word may mean: said with its exit code."""

Spec = tuple[int, int, str, tuple[int, ...]]  # a tensor in arenas: (arena index, byte offset, dtype name, shape)
RecordMeta = tuple[str, int, str, "int | None", Spec, dict[str, Spec]]  # a record as specs: site, step, kind, layer


class Orphaned(SystemExit):
    """The process that started this one is gone: nobody will read or send anything again."""


def parent_gone() -> bool:
    parent = multiprocessing.parent_process()
    return parent is not None and not parent.is_alive()


def note_unsent(queue: Any, errors: list[BaseException]) -> None:
    """Have ``queue`` note in ``errors`` what it could not send: a ``multiprocessing`` queue pickles in a thread of
    its own and, when that fails, prints the error and drops the item — the other side would then wait for ever."""
    queue._on_queue_feeder_error = lambda exc, _obj: errors.append(exc)


def check_sent(errors: list[BaseException]) -> None:
    """Raise what a queue watched by :func:`note_unsent` could not send."""
    if errors:
        raise RuntimeError(f"a message could not be sent between this process and the other: {errors[0]!r}")


def child_get(queue: Any, unsent: list[BaseException]) -> Any:
    """In a helper process: the next item of ``queue``, or ``Orphaned`` once the parent is gone (killed, it cannot
    say so); raises what this process's own outgoing queue could not send (``unsent``) meanwhile."""
    while True:
        try:
            return queue.get(timeout=POLL_S)
        except queue_module.Empty:
            if parent_gone():
                raise Orphaned(0) from None
            check_sent(unsent)


def child_put(queue: Any, item: Any) -> None:
    """In a helper process: ``queue.put`` that gives up once the parent is gone (a full queue nobody reads would
    block for ever)."""
    while True:
        try:
            return queue.put(item, timeout=POLL_S)
        except queue_module.Full:
            if parent_gone():
                raise Orphaned(0) from None


def end_helper(out: Any) -> None:
    """End a helper process at once, its outgoing queue ``out`` flushed (``os._exit``: the interpreter's teardown of
    torch and CUDA would take a second or more of the parent's exit). The caller drops what it holds of memory the
    parent shared first; collected here, so that the parent's CUDA IPC counts are released (a producer whose consumer
    ended without releasing them warns at its own exit that it "has been terminated before all shared CUDA tensors
    released")."""
    gc.collect()
    out.close()
    out.join_thread()
    os._exit(0)


def end_processes(processes: list[Any], queues: list[Any], *, ask: list[Any] | None = None) -> None:
    """In the parent: end helper ``processes`` and close their ``queues``. With ``ask`` (their command queues, in the
    same order) each one still alive is sent None — it leaves its loop and ends as a helper does
    (:func:`end_helper`) — and given a few polls to; any still alive then (busy, failed, or not asked) is killed. What the
    queues still hold for them is dropped."""
    if ask is not None:
        for process, queue in zip(processes, ask):
            if process.is_alive():
                queue.put(None)
        for process in processes:
            process.join(timeout=5 * POLL_S)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    for queue in queues:
        # what is still buffered for a process that is gone will never be read: this process's exit must not wait to
        # send it (a share of pairs larger than the pipe holds, sent to a killed worker, kept the exit waiting forever)
        queue.cancel_join_thread()
        queue.close()


def parent_get(queue: Any, unsent: list[BaseException], alive: Callable[[], str | None]) -> Any:
    """In the parent: the next item a helper sent on ``queue``, raising what the parent's queues to it could not
    send (``unsent``) and, once ``alive()`` returns a reason (the helper is gone), that reason."""
    while True:
        try:
            return queue.get(timeout=POLL_S)
        except queue_module.Empty:
            check_sent(unsent)
            why = alive()
            if why is not None:
                raise RuntimeError(why) from None


def pickled_error(exc: BaseException) -> bytes | None:
    """``exc`` pickled for the parent to raise as it is (a bad input's ``ValueError``, a user path's ``PathError``
    with its frames), or None where it cannot be (checked here: a message the queue fails to pickle is lost)."""
    try:
        return pickle.dumps(exc)
    except Exception:  # noqa: BLE001 — any failure to pickle: the parent raises the traceback's text instead
        return None


def remote_error(text: str, pickled: bytes | None, where: str) -> BaseException:
    """What a helper process raised, to raise here: the exception itself where it came across (so bad input is the
    same one-line error as in one process), caused by its traceback there (``text``); else that traceback as a
    ``RuntimeError`` saying ``where`` it failed."""
    cause = RuntimeError(f"{where} failed in its process:\n{text}")
    try:
        exc = pickle.loads(pickled) if pickled is not None else None
    except Exception:  # noqa: BLE001 — an exception type this process cannot rebuild: its text serves
        exc = None
    if not isinstance(exc, Exception):
        return cause
    exc.__cause__ = cause
    return exc


def model_key(cfg: Any) -> tuple:
    """What a helper's model is built from (a ``RunConfig``'s): a later run of the same reuses the model the helper
    holds. A local checkpoint counts with its files' modification times (rewritten weights are not served from the
    model built before)."""
    files: tuple = ()
    if os.path.isdir(cfg.model):
        files = tuple(sorted((e.name, e.stat().st_mtime_ns) for e in os.scandir(cfg.model) if e.is_file()))
    return cfg.model, files, cfg.dtype, cfg.device, cfg.seed, cfg.sdpa


def prepare_imports(cfg: Any) -> None:
    """In a new helper process, what a run of ``cfg`` (anything with ``model`` and ``device``: a ``RunConfig``, or what
    ``ulptrace.spawning`` sends before one exists) needs before its model comes: the modules a run imports, the
    model's own (built on the meta device: ``models.prepare``), the CUDA context — done while the parent builds the
    model it will send. A failure here is left for the run to meet and report."""
    try:
        import ulptrace.paths
        import ulptrace.run  # noqa: F401
        from ulptrace.models import prepare

        prepare(cfg.model)
        if torch.device(cfg.device).type == "cuda":
            torch.empty(0, device=cfg.device)
    except Exception:  # noqa: BLE001, S110 — the run does the same again and ships what fails
        pass


def byte_arena(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """``nbytes`` uninitialised bytes on ``device`` to be sent to another process: on the CPU made in shared memory
    here (a queue then sends its file descriptor, no copy; module docstring), on CUDA an ordinary tensor (CUDA IPC
    shares it as it is)."""
    if torch.device(device).type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))


def shipped_twin(model: Any) -> Any:
    """A twin of ``model`` (``ulptrace.models.twin``) to send to helper processes: its CPU tensors moved into shared
    memory here, on the sending thread (module docstring); CUDA tensors are shared through CUDA IPC as they are."""
    from ulptrace.models import twin

    return twin(model).share_memory()


def _attribute(path: str) -> tuple[Callable[[], Any], Callable[[Any], None]] | None:
    """Getter and setter of the torch attribute ``path`` ("backends.cudnn.deterministic"), None where this torch has
    none."""
    *owner_path, name = path.split(".")
    owner: Any = torch
    for part in owner_path:
        owner = getattr(owner, part, None)
    if owner is None or not hasattr(owner, name):
        return None
    return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))


def _settings() -> dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]:
    """The torch settings a helper must share with this process (``torch_settings``), by name: getter and setter."""
    table: dict[str, Any] = {}
    # TF32 and the float32 matmul precision: through torch's fp32_precision settings where it has them (reading the
    # older flags raises once the newer were set), parents before leaves; else through the older ones
    new = ["backends.fp32_precision", *(f"backends.{b}.fp32_precision" for b in ("cuda", "cudnn", "mkldnn")),
           "backends.cuda.matmul.fp32_precision",
           *(f"backends.{b}.{leaf}.fp32_precision" for b in ("cudnn", "mkldnn") for leaf in ("conv", "rnn")),
           "backends.mkldnn.matmul.fp32_precision"]
    if _attribute("backends.cuda.matmul.fp32_precision") is not None:
        table.update((path, _attribute(path)) for path in new)
    else:
        table["float32_matmul_precision"] = (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision)
        table.update((path, _attribute(path)) for path in ("backends.cuda.matmul.allow_tf32",
                                                            "backends.cudnn.allow_tf32"))
    table.update((path, _attribute(path)) for path in (
        "backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        "backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        "backends.cudnn.enabled", "backends.cudnn.deterministic", "backends.cudnn.benchmark"))
    table["deterministic_algorithms"] = (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1]))
    for backend in ("flash", "mem_efficient", "math", "cudnn"):  # the SDPA backends enabled outside a pin
        get = getattr(torch.backends.cuda, f"{backend}_sdp_enabled", None)
        put = getattr(torch.backends.cuda, f"enable_{backend}_sdp", None)
        if get is not None and put is not None:
            table[f"sdp.{backend}"] = (get, put)
    table["default_dtype"] = (torch.get_default_dtype, torch.set_default_dtype)
    table["num_threads"] = (torch.get_num_threads, torch.set_num_threads)
    return {name: pair for name, pair in table.items() if pair is not None}


def torch_settings() -> dict[str, Any]:
    """This process's torch settings that decide what a model computes and that a new process does not inherit (it
    starts with torch's defaults): TF32 and the float32 matmul precision, cuBLAS's reduced-precision reductions,
    cuDNN's and the deterministic-algorithm switches, the SDPA backends enabled, the default dtype, the CPU thread
    count. A helper is sent them with each run and takes them (``apply_torch_settings``): a reference recorded in its
    own process then computes what it would here (a notebook's ``allow_bf16_reduced_precision_reduction = False``,
    say)."""
    return {name: get() for name, (get, _) in _settings().items()}


def apply_torch_settings(settings: dict[str, Any], *, keep: Iterable[str] = ()) -> None:
    """Take ``settings`` (``torch_settings`` of the sending process) here, in their order, each only where it differs
    (a setting torch has not changed is not touched); ``keep``: names this process keeps as they are (a judging
    process's one thread)."""
    table = _settings()
    for name, value in settings.items():
        if name in keep:
            continue
        if name not in table:
            raise ValueError(f"torch setting {name!r} was sent, but this process's torch has no such setting "
                             f"(known: {', '.join(table)})")
        get, put = table[name]
        if get() != value:
            put(value)


@dataclass(frozen=True)
class Setup:
    """What a helper takes of this process before each run, to run what this process would: the torch settings that
    decide what a model computes (``torch_settings``) and the registration here of the path it applies, which a new
    process does not have (``paths.registration_to_send``)."""

    settings: dict[str, Any]
    registration: Any

    @classmethod
    def of(cls, cfg: Any, path: str | None = None) -> Setup:
        """This process's, for a run of ``cfg`` applying ``path`` (default: its reference); raises for a registered
        path a helper cannot import."""
        from ulptrace.paths import registration_to_send

        return cls(torch_settings(), registration_to_send(cfg.reference if path is None else path))

    def take(self, *, keep: Iterable[str] = ()) -> None:
        """In the helper: the settings (less those it ``keep``s) and the registration made here."""
        from ulptrace.paths import register_path

        apply_torch_settings(self.settings, keep=keep)
        if self.registration is not None:
            register_path(self.registration.name, self.registration.target, self.registration.description)


def received_model(model: Any) -> Any:
    """A model this helper was sent (unpickled here), made safe to hook: torch keys each module's hooks by a number it
    counts per process (``torch.utils.hooks.RemovableHandle.next_id``), so the hooks a model arrives with — its SDPA
    pin's (``ulptrace.sdpa``) — hold numbers this process has not handed out yet, and the next hook registered here
    would take one and replace them. The count is moved past every number the model holds. Found on the CPU: a fresh
    ``onset --concurrent --sdpa math`` recorded its reference with torch's default attention (the recorder's hooks had
    replaced the pin's), where a parent that had registered hooks before did not."""
    from torch.utils.hooks import RemovableHandle

    held = [key for module in model.modules() for name, hooks in vars(module).items()
            if name.endswith("_hooks") and isinstance(hooks, dict) for key in hooks if isinstance(key, int)]
    if held:
        RemovableHandle.next_id = max(RemovableHandle.next_id, max(held) + 1)
    return model


def pack(tensors: Iterable[torch.Tensor], alone_bytes: float = math.inf,
         written: Arenas | None = None, *, shared: bool = True) -> tuple[list[torch.Tensor], dict[int, Spec]]:
    """``tensors`` as byte arenas: arena 0 packs them (one device copy, no wait for the device), except a tensor
    inside one of the arenas ``written`` made (its copies, and views of them), which is read where it is (those arenas
    follow arena 0: taken from ``written``, which starts anew), and a CUDA tensor of ``alone_bytes`` or more, which is
    an arena of its own as it is (no copy; the last ones). Returns the arenas and each tensor's :data:`Spec` by ``id``
    (a tensor listed twice is packed once). Arenas on CUDA free, first, what another process has released of this
    one's earlier arenas (else kept until this process runs out of memory). ``shared``: arena 0 on the CPU is made in
    shared memory (``byte_arena``; False for a sender that ships host arenas as bytes)."""
    specs: dict[int, Spec] = {}
    alone: list[torch.Tensor] = []
    pieces: list[torch.Tensor] = []
    first_alone = 1 + (0 if written is None else len(written.arenas))  # arena 0 is the packed one
    size = 0
    for t in tensors:
        if id(t) in specs:
            continue
        dtype = dtype_name(t.dtype)
        spec = None if written is None else written.spec(t, dtype)
        if spec is not None:
            specs[id(t)] = spec
            continue
        flat = (t.detach() if t.requires_grad else t).contiguous().view(-1).view(torch.uint8)
        if flat.is_cuda and flat.numel() >= alone_bytes:
            specs[id(t)] = (first_alone + len(alone), 0, dtype, tuple(t.shape))
            alone.append(flat)
            continue
        pad = -size % ALIGN
        if pad:
            pieces.append(_zeros(flat.device)[:pad])
        specs[id(t)] = (0, size + pad, dtype, tuple(t.shape))
        pieces.append(flat)
        size += pad + flat.numel()
    own = [] if written is None else written.take()
    if any(p.is_cuda for p in (*pieces, *own, *alone)):
        torch.cuda.ipc_collect()
    packed = None
    if pieces:
        packed = torch.cat(pieces, out=byte_arena(size, pieces[0].device)) if shared else torch.cat(pieces)
    return [packed, *own, *alone], specs


class Arenas:
    """Copies made straight into byte arenas of :func:`pack`'s format (each at an ``ALIGN``-aligned offset), so the
    tensors of a message need no second copy to be packed: a sink that ships what a recorder copies (the reference
    process's, ``ulptrace.concurrent``) hands the recorder :meth:`copy`, and :func:`pack` reads what lies in these
    arenas where it is. An arena is shipped once (:meth:`take`, then new ones): memory another process reads is never
    written again. A new arena holds what the last message held, an eighth more (a decode step's messages are alike),
    or the value that does not fit."""

    MIN_BYTES = 64 << 10

    def __init__(self) -> None:
        self.arenas: list[torch.Tensor] = []
        self._ranges: list[tuple[int, int, bool]] = []  # each arena's (first address, end, on CUDA)
        self._used = 0  # bytes used of the last arena
        self._total = 0  # bytes of the copies in this message's arenas
        self._next = self.MIN_BYTES
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the last arena read as each dtype

    def copy(self, value: torch.Tensor) -> torch.Tensor | None:
        """A copy of ``value`` in an arena (contiguous, its dtype and shape), or None for what is no dense tensor of
        torch's own type or lies on another device than this message's first value (the caller copies it as it
        does; :func:`pack` then copies it again)."""
        last = self.arenas[-1] if self.arenas else None
        if type(value) is not torch.Tensor or value.layout is not torch.strided \
                or (last is not None and last.device != value.device):  # one device a message (its first value's)
            return None
        nbytes = value.numel() * value.element_size()
        start = self._used + -self._used % ALIGN
        if last is None or start + nbytes > last.numel():
            last = byte_arena(max(self._next, nbytes + ALIGN), value.device)
            self.arenas.append(last)
            self._ranges.append((last.data_ptr(), last.data_ptr() + last.numel(), last.is_cuda))
            self._typed, start = {}, 0
        typed = self._typed.get(value.dtype)
        if typed is None:
            typed = self._typed[value.dtype] = _typed(last, value.dtype)
        copy = _contiguous_view(typed, value.shape, start)
        copy.copy_(value.detach() if value.requires_grad else value)
        self._used = start + nbytes
        self._total += nbytes
        return copy

    def spec(self, t: torch.Tensor, dtype: str) -> Spec | None:
        """``t``'s spec if it lies, contiguous, in one of the arenas (the arena's index counts from 1: they follow
        :func:`pack`'s arena 0), else None."""
        if not self._ranges or type(t) is not torch.Tensor or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return None
        ptr = t.data_ptr()
        end = ptr + t.numel() * t.element_size()
        for index, (first, last, cuda) in enumerate(self._ranges, start=1):
            if first <= ptr and end <= last and t.is_cuda == cuda:
                return (index, ptr - first, dtype, tuple(t.shape))
        return None

    def take(self) -> list[torch.Tensor]:
        """The arenas written so far (to ship), and new ones for what comes next, sized from what these held."""
        arenas = self.arenas
        if arenas:
            self._next = max(self.MIN_BYTES, self._total + self._total // 8)
        self.arenas, self._ranges, self._typed, self._used, self._total = [], [], {}, 0, 0
        return arenas


def _typed(arena: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A byte arena read as ``dtype`` (a tail that is no whole element left out). An arena shared as it is may begin
    inside its storage, at a multiple of its own dtype's size."""
    return arena[:arena.numel() - arena.numel() % dtype.itemsize].view(dtype)


def _contiguous_view(typed: torch.Tensor, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """The contiguous tensor of ``shape`` at byte ``offset`` (a multiple of ``ALIGN``) of ``typed`` (:func:`_typed`):
    one ``as_strided``."""
    strides, stride = [], 1
    for n in reversed(shape):
        strides.append(stride)
        stride *= n
    return typed.as_strided(shape, strides[::-1], typed.storage_offset() + offset // typed.element_size())


_ZEROS: dict[torch.device, torch.Tensor] = {}


def _zeros(device: torch.device) -> torch.Tensor:
    """``ALIGN`` zero bytes on ``device``, made once: a pad in an arena is a slice of them (not a new tensor each)."""
    zeros = _ZEROS.get(device)
    if zeros is None:
        zeros = _ZEROS[device] = torch.zeros(ALIGN, dtype=torch.uint8, device=device)
    return zeros


def record_metas(records: Iterable[Record], specs: dict[int, Spec]) -> list[RecordMeta]:
    """``records`` as specs into the arenas :func:`pack` made of their tensors."""
    return [(r.site, r.step, r.kind, r.layer, specs[id(r.out)], {role: specs[id(t)] for role, t in r.inputs.items()})
            for r in records]


class Unpacked:
    """Tensors of arenas :func:`pack` made, one view per spec: records that shared a tensor share it again (an empty
    tensor's offset is the next one's). Each view is one ``as_strided`` of the arena read as its dtype (made once per
    arena and dtype): a step of a decode has hundreds of small tensors, and slicing and viewing each took three ops."""

    def __init__(self, arenas: list[torch.Tensor | None]) -> None:
        self.arenas = arenas
        self._views: dict[Spec, torch.Tensor] = {}
        self._typed: dict[tuple[int, str], torch.Tensor] = {}

    def tensor(self, spec: Spec) -> torch.Tensor:
        view = self._views.get(spec)
        if view is None:
            arena, offset, dtype, shape = spec
            typed = self._typed.get((arena, dtype))
            if typed is None:
                typed = self._typed[(arena, dtype)] = _typed(self.arenas[arena], getattr(torch, dtype))
            view = self._views[spec] = _contiguous_view(typed, shape, offset)
        return view

    def record(self, meta: RecordMeta) -> Record:
        site, step, kind, layer, out, inputs = meta
        return Record(site, step, kind, layer, self.tensor(out), {role: self.tensor(s) for role, s in inputs.items()})
