"""Tensor parallelism: trace a model sharded over processes and judge it against the same model unsharded.

Why this module exists: a model that needs several GPUs is exactly where kernel ports diverge — row-parallel
matmuls all-reduce partial sums, norms and fused kernels run per rank — while the rest of ulptrace assumes
that one process holds the whole model and every record. This module is the one place that knows about
ranks, process groups, DTensor placements and transformers' tensor-parallel plans; recorder, comparison and
oracle stay single-process and see whole (logical) records, named as always.

It uses the distributed engine users already run HF models on, never a sharding of its own:

- :func:`preflight` / :func:`init`: a job launched by ``torchrun --nproc_per_node N`` (gloo on CPU, NCCL on
  CUDA, one process per rank); bad setups (no ``accelerate``, a model without a TP plan, a world size that
  is not ``N``) fail before anything is built, with one line.
- :func:`load_sharded`: the candidate, loaded by transformers from a checkpoint with the model's own TP plan
  (``DistributedConfig(tp_size=N, tp_plan="auto")``): DTensor weights, transformers' own forward wrappers.
  transformers shards while it loads, so an embedded model is first saved to a temporary checkpoint
  (:func:`checkpoint_dir`); the reference loads the same checkpoint unsharded.
- :class:`ShardGatherer`: a recorder sink on every rank. Each record's tensors are gathered (as raw bytes,
  bit for bit) to rank 0 and assembled to their logical shape there; nothing the model computes is touched,
  so a traced run stays bitwise equal to an untraced one. The placement of each tensor comes from

  1. the DTensor itself, when the model hands one to a hook;
  2. the TP plan entry of the module it is observed at — column-parallel outputs and row-parallel inputs
     are plain local tensors (``q_proj`` gives ``[2, 6, 64]`` on each rank), so only the plan says they are
     shards (``ColwiseParallel.output_layouts``, ``RowwiseParallel.input_layouts``, read from transformers'
     own style objects);
  3. for activations downstream of a column-parallel layer that no plan entry covers (q/k norms, RoPE, the
     attention core: each rank holds its heads), the one dim along which the ranks' local shapes differ from
     the unsharded reference's record, concatenated in rank order. Replicated records are checked to be
     bitwise equal on every rank (a rank whose copy differs is reported).

- :func:`parameter_report`: each rank's shard of every parameter checksummed against the same slice of the
  reference's parameter, so a stale shard is named with its rank and slice; and :func:`split_parameters`:
  which parameters the run splits along a dim (DTensor ``Shard`` placements), so the oracle can offer the
  ``sharded`` hypothesis (:mod:`ulptrace.oracle.sharding`) to any matmul that contracts over one — the
  partial sums a row-parallel layer rounds to BF16 before its all-reduce.

The reference runs on rank 0 only (``ulptrace.probes.tp_onset``): only rank 0 compares and reports, so only
it needs the reference's records; building it on every rank would cost N unsharded copies of a model that is
sharded because it is large, and N identical reference runs; and on one rank the reference involves no
process group at all, so it is bitwise the single-process run. The other ranks wait for its tokens.

A failure carries its rank: errors raised on one rank say ``rank R of N``, and an error in rank 0's
comparison is held until every rank has finished the run's collectives (so no rank is left waiting).
Single node only (``torchrun --nproc_per_node N``): the temporary checkpoint of an embedded model is written
by rank 0 to local disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from ulptrace.trace import Record, dtype_name

DEFAULT_TIMEOUT_S = 1800
"""Collective timeout (seconds) of a process group ulptrace initialises (``ULPTRACE_TP_TIMEOUT`` overrides):
ranks other than 0 wait in a collective while rank 0 runs the reference."""


class TPError(ValueError):
    """A tensor-parallel run cannot be made as asked (missing ``accelerate``, no TP plan, a wrong world size,
    records that disagree between ranks): bad input, one line, exit status 2 on the command line."""


class PeerFailed(TPError):
    """Another rank failed; its own error is reported by that rank."""


# -- the job -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Group:
    """This process's place in the tensor-parallel job."""

    rank: int
    size: int
    backend: str
    device: torch.device
    owns: bool = False  # ulptrace initialised the process group (and destroys it in ``close``)

    @property
    def main(self) -> bool:
        """Rank 0: builds the reference, compares, writes reports and traces."""
        return self.rank == 0

    def where(self) -> str:
        return f"rank {self.rank} of {self.size}"


def env_rank() -> int:
    """This process's rank as the launcher set it (``RANK``), 0 outside a distributed launch."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def has_accelerate() -> bool:
    """transformers loads a model with a TP plan only when ``accelerate`` is installed."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


def tp_plan(name_or_path: str) -> dict[str, str]:
    """The model's tensor-parallel plan (``base_model_tp_plan`` of its config), read without loading weights;
    empty when the architecture has none."""
    import transformers
    from ulptrace.catalog import MODELS

    if name_or_path in MODELS:
        spec = MODELS[name_or_path]
        config = getattr(transformers, spec.config_class)(**spec.config)
    elif not os.path.isdir(name_or_path):
        raise KeyError(f"unknown model {name_or_path!r}: expected one of the embedded models ({', '.join(MODELS)}) "
                       "or a path to a local HF checkpoint directory")
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(name_or_path)
        except (OSError, ValueError, KeyError) as exc:
            raise TPError(f"checkpoint directory {name_or_path}: transformers cannot read its config ({exc})") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(getattr(text, "base_model_tp_plan", None) or {})


def preflight(model: str, tp: int, device: str = "cpu") -> None:
    """Everything about a ``--tp N`` run that can be checked before a process group or a model exists.

    Raises:
        TPError: ``tp < 2``; ``accelerate`` is missing; the model has no TP plan; the process was not
            launched by torchrun with ``N`` processes; a CUDA run with more ranks than GPUs.
    """
    if tp < 2:
        raise TPError(f"--tp must be >= 2 (the number of processes the model is sharded over), but got {tp}")
    if not has_accelerate():
        raise TPError("--tp needs the `accelerate` package (transformers loads a model with a tensor-parallel plan "
                      "only with it): pip install 'ulptrace[tp]'")
    plan = tp_plan(model)
    if not plan:
        raise TPError(f"model {model} has no tensor-parallel plan (its config defines no base_model_tp_plan), so "
                      "transformers cannot shard it: --tp needs an architecture with a TP plan (e.g. Llama, "
                      "Qwen2/3, Qwen3.5)")
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise TPError(f"--tp {tp} runs one process per rank: launch it with torchrun, e.g. "
                      f"`torchrun --nproc_per_node {tp} -m ulptrace onset --tp {tp} ...`")
    if world != str(tp):
        raise TPError(f"--tp {tp} needs {tp} processes, but torchrun started {world} "
                      f"(use --nproc_per_node {tp})")
    if torch.device(device).type == "cuda" and torch.cuda.device_count() < tp:
        raise TPError(f"--tp {tp} on CUDA needs {tp} GPUs (one per rank), but {torch.cuda.device_count()} are visible")


def init(tp: int, device: str = "cpu", *, timeout_s: float | None = None) -> Group:
    """Join (or initialise) the default process group: gloo on CPU, NCCL on CUDA (each rank on
    ``cuda:LOCAL_RANK``). Raises ``TPError`` when the group's size is not ``tp``."""
    import torch.distributed as dist

    if not dist.is_available():
        raise TPError("this torch build has no torch.distributed; --tp needs it")
    dev = torch.device(device)
    owns = False
    if not dist.is_initialized():
        if dev.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dev = torch.device("cuda", local)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        seconds = timeout_s or float(os.environ.get("ULPTRACE_TP_TIMEOUT", DEFAULT_TIMEOUT_S))
        dist.init_process_group(backend, timeout=timedelta(seconds=seconds),
                                device_id=dev if backend == "nccl" else None)
        owns = True
    elif dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    size = dist.get_world_size()
    if size != tp:
        raise TPError(f"--tp {tp}, but the process group has {size} ranks")
    return Group(dist.get_rank(), size, dist.get_backend(), dev, owns)


def close(group: Group) -> None:
    """Destroy the process group if ulptrace created it."""
    import torch.distributed as dist

    if group.owns and dist.is_initialized():
        dist.destroy_process_group()


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def tag(exc: BaseException, group: Group) -> BaseException:
    """``exc`` with its rank in the message (``rank 1 of 2: ...``), or as a note where the message is not text.
    A collective that failed because another rank went away becomes ``PeerFailed`` (that rank reports why)."""
    if isinstance(exc, PeerFailed) or getattr(exc, "ulptrace_rank", None) is not None:
        return exc
    gone = next((s for s in _PEER_GONE if s in str(exc)), None) if isinstance(exc, RuntimeError) else None
    if gone is not None:
        return PeerFailed(f"{group.where()}: a collective failed because another rank stopped ({gone}); that rank "
                          "reports its own error")
    exc.ulptrace_rank = group.rank  # type: ignore[attr-defined]
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{group.where()}: {exc.args[0]}",) + exc.args[1:]
    elif hasattr(exc, "add_note"):
        exc.add_note(f"(on {group.where()})")
    return exc


def broadcast(group: Group, value: Any = None, error: BaseException | None = None) -> Any:
    """Rank 0's ``value`` on every rank; with ``error`` (rank 0 failed), the other ranks raise ``PeerFailed``."""
    import torch.distributed as dist

    box = [("error", f"{type(error).__name__}: {error}") if error is not None else ("ok", value)]
    dist.broadcast_object_list(box, src=0)
    status, payload = box[0]
    if status == "error" and not group.main:
        raise PeerFailed(f"{group.where()}: rank 0 failed ({payload}); its error is reported there")
    return payload


# -- the models --------------------------------------------------------------------------------------------

@contextmanager
def checkpoint_dir(model: str, group: Group, *, dtype: torch.dtype, seed: int) -> Iterator[str]:
    """A local checkpoint directory of ``model`` every rank can load: the directory itself, or for an embedded
    model one that rank 0 writes with ``save_pretrained`` (removed on exit, after every rank is done)."""
    import torch.distributed as dist
    from ulptrace.catalog import MODELS
    from ulptrace.models import build_model

    if model not in MODELS:
        yield os.path.abspath(model)
        return
    path, error = None, None
    if group.main:
        try:
            path = tempfile.mkdtemp(prefix="ulptrace-tp-")
            build_model(model, dtype=dtype, seed=seed).save_pretrained(path)
        except Exception as exc:  # noqa: BLE001 - held: the other ranks wait for the path
            error = exc
    path = broadcast(group, path, error)
    if error is not None:
        raise error
    try:
        yield path
    except BaseException:  # no barrier: the other ranks may never get there
        if group.main:
            shutil.rmtree(path, ignore_errors=True)
        raise
    dist.barrier()  # every rank has loaded it
    if group.main:
        shutil.rmtree(path, ignore_errors=True)


def load_sharded(path: str, group: Group, *, dtype: torch.dtype, attn_implementation: str = "sdpa",
                 name: str | None = None, seed: int = 0, sdpa: str = "default") -> Any:
    """The checkpoint at ``path`` loaded by transformers with its own TP plan over ``group`` (every rank calls
    this): DTensor parameters, eval mode, no gradients, torch's attention backend pinned to ``sdpa``
    (``ulptrace.sdpa``). ``name`` is what traces record as the model."""
    import transformers
    from transformers.distributed import DistributedConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation,
        distributed_config=DistributedConfig(tp_size=group.size, tp_plan="auto"))
    model.ulptrace_model_name = name or os.path.abspath(path)  # type: ignore[attr-defined]
    model.ulptrace_seed = seed  # type: ignore[attr-defined]
    model.requires_grad_(False)
    from ulptrace.sdpa import pin_sdpa

    return pin_sdpa(model.eval(), sdpa)


def plan_style(model: Any, module_path: str) -> Any | None:
    """transformers' style object (``ColwiseParallel``, ``RowwiseParallel``, ...) that ``model``'s TP plan applies
    to the module at ``module_path``, or None."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard

    plan = getattr(model, "tp_plan", None) or {}
    name = plan.get(module_path) or plan.get(replace_layer_number_by_wildcard(module_path))
    if name is None or name not in ALL_PARALLEL_STYLES:
        return None
    return ALL_PARALLEL_STYLES[name]


# -- placements ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """How a record's tensor is laid out over the ranks: ``replicate`` or ``shard`` along ``dim``; ``source``
    says what decided it (``dtensor``, ``plan``, ``shapes``)."""

    kind: str
    dim: int | None = None
    source: str = "shapes"

    def __str__(self) -> str:
        return f"Shard({self.dim})" if self.kind == "shard" else "Replicate()"


def _layout(layout: Any) -> Placement | None:
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(layout, (tuple, list)):
        layout = layout[0] if len(layout) == 1 else None
    if isinstance(layout, Shard):
        return Placement("shard", layout.dim, "plan")
    if isinstance(layout, Replicate):
        return Placement("replicate", None, "plan")
    return None


def planned_placement(style: Any, at: str) -> Placement | None:
    """The placement a TP style gives the local tensor a forward hook sees at ``at`` of its module: the
    module's input before the style redistributes it (``input_layouts``), its output after (``output_layouts``,
    when the style hands hooks a plain local tensor). None when the style does not say."""
    if style is None:
        return None
    if at == "in0":
        return _layout(getattr(style, "input_layouts", None))
    if at == "out" and getattr(style, "use_local_output", False):
        return _layout(getattr(style, "output_layouts", None))
    return None


def infer_placement(shapes: list[tuple[int, ...]], logical: tuple[int, ...] | None) -> Placement | None:
    """The placement that assembles the ranks' local ``shapes`` into ``logical`` (the unsharded record's
    shape): replicated when every rank holds it whole, else the one dim along which they differ, whose sizes
    add up. Without ``logical``: replicated when all ranks' shapes agree, else the one dim that differs.
    None when no placement fits."""
    first = shapes[0]
    if any(len(s) != len(first) for s in shapes):
        return None
    if logical is None:
        if all(s == first for s in shapes):
            return Placement("replicate")
        dims = [d for d in range(len(first)) if len({s[d] for s in shapes}) > 1]
        return Placement("shard", dims[0]) if len(dims) == 1 else None
    if len(logical) != len(first):
        return None
    if all(s == tuple(logical) for s in shapes):
        return Placement("replicate")
    dims = [d for d in range(len(first)) if any(s[d] != logical[d] for s in shapes)]
    if len(dims) != 1:
        return None
    d = dims[0]
    return Placement("shard", d) if sum(s[d] for s in shapes) == logical[d] else None


def fits(placement: Placement, shapes: list[tuple[int, ...]], logical: tuple[int, ...] | None) -> bool:
    """Whether ``placement`` assembles ``shapes`` into ``logical`` (anything fits an unknown logical shape)."""
    if placement.kind == "replicate":
        return all(s == shapes[0] for s in shapes) and (logical is None or shapes[0] == tuple(logical))
    d = placement.dim if placement.dim is None or placement.dim >= 0 else placement.dim + len(shapes[0])
    if d is None or any(len(s) != len(shapes[0]) or s[:d] + s[d + 1:] != shapes[0][:d] + shapes[0][d + 1:]
                        for s in shapes):
        return False
    if logical is None:
        return True
    total = list(shapes[0])
    total[d] = sum(s[d] for s in shapes)
    return tuple(total) == tuple(logical)


# -- gathering records ----------------------------------------------------------------------------------------

def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _tensor(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return raw.view(dtype).reshape(shape).clone()


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _materialize(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A DTensor handed to a hook becomes its whole tensor (a collective every rank makes for the same record)."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor(), True
    return t, False


class ShardGatherer:
    """A recorder sink for a tensor-parallel model: on every rank, each record is gathered to rank 0 and
    assembled to its logical shape (see the module docstring), then handed to ``sink`` there.

    Every rank of ``group`` records the same sites in the same order (SPMD); the gatherer checks that (site,
    step and tensor roles) and raises ``TPError`` on every rank when ranks disagree.

    Args:
        group: the job.
        model: the sharded model (its TP plan gives placements).
        sites: the recorder's sites (where each record's tensors are observed).
        sink: rank 0's sink (e.g. a ``StreamingComparator``); ignored elsewhere.
        logical: ``(site, step, role) -> shape`` of the unsharded record (``role`` is ``out`` or an input
            role), or None where unknown; rank 0 only.
    """

    def __init__(self, group: Group, model: Any, sites: list[Any], sink: Any | None,
                 logical: Callable[[str, int, str], tuple[int, ...] | None] | None = None) -> None:
        import re

        self.group, self.model = group, model
        self.sink = sink if group.main else None
        self.logical = logical or (lambda site, step, role: None)
        self._obs = {s.name: s for s in sites}
        self._call = re.compile(r"#\d+$")
        self.placements: dict[tuple[str, str], str] = {}  # (site, role) -> placement, for the report
        self.replicas_differ: list[dict[str, Any]] = []
        self.records = 0
        self.error: BaseException | None = None  # rank 0's sink failed: held until the run's collectives end

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        setter = getattr(self.sink, "set_metadata", None)
        if setter is not None:
            setter(metadata)

    def _planned(self, site: str, role: str) -> Placement | None:
        s = self._obs.get(self._call.sub("", site))
        if s is None:
            return None
        obs = s.out if role == "out" else s.inputs.get(role)
        if obs is None:
            return None
        return planned_placement(plan_style(self.model, obs.module), obs.at)

    def add(self, record: Record) -> None:
        import torch.distributed as dist

        tensors: dict[str, torch.Tensor] = {"out": record.out, **record.inputs}
        whole: dict[str, bool] = {}
        for role, t in list(tensors.items()):
            tensors[role], whole[role] = _materialize(t)
        meta = (record.site, record.step, record.kind, record.layer,
                [(role, tuple(t.shape), dtype_name(t.dtype), t.numel() * t.element_size())
                 for role, t in tensors.items()])
        metas: list[Any] = [None] * self.group.size
        dist.all_gather_object(metas, meta)
        self._check(metas)
        nbytes = [sum(n for *_, n in m[4]) for m in metas]
        size = max(max(nbytes), 1)
        device = self.group.device
        buf = torch.zeros(size, dtype=torch.uint8, device=device)
        if tensors and nbytes[self.group.rank]:
            flat = torch.cat([_bytes(t).to(device) for t in tensors.values()])
            buf[: flat.numel()] = flat
        bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(self.group.size)] \
            if self.group.main else None
        dist.gather(buf, bufs, dst=0)
        self.records += 1
        if not self.group.main or self.error is not None:
            return
        try:
            assert bufs is not None
            self.sink.add(self._assemble(record, metas, bufs, whole))
        except Exception as exc:  # noqa: BLE001 - held to keep the collectives matched (``raise_held``)
            self.error = exc

    def raise_held(self) -> None:
        """Raise the error rank 0's sink hit during the run, if any (call after the run, on rank 0)."""
        if self.error is not None:
            raise self.error

    def _check(self, metas: list[Any]) -> None:
        first = metas[0]
        for rank, m in enumerate(metas[1:], 1):
            if m[:2] != first[:2] or [r[0] for r in m[4]] != [r[0] for r in first[4]]:
                raise TPError(f"ranks recorded different things: rank 0 recorded {first[0]!r} step {first[1]} "
                              f"({[r[0] for r in first[4]]}), rank {rank} recorded {m[0]!r} step {m[1]} "
                              f"({[r[0] for r in m[4]]}); every rank must run the same forward")

    def _assemble(self, record: Record, metas: list[Any], bufs: list[torch.Tensor], whole: dict[str, bool]
                  ) -> Record:
        per_rank: list[dict[str, torch.Tensor]] = []
        for m, buf in zip(metas, bufs):
            out, offset = {}, 0
            for role, shape, dtype, n in m[4]:
                out[role] = _tensor(buf[offset: offset + n], _dtype(dtype), shape)
                offset += n
            per_rank.append(out)
        assembled = {}
        for role in per_rank[0]:
            locals_ = [r[role] for r in per_rank]
            assembled[role] = self._join(record, role, locals_, whole[role])
        out = assembled.pop("out")
        return Record(record.site, record.step, record.kind, record.layer, out, assembled)

    def _join(self, record: Record, role: str, locals_: list[torch.Tensor], was_dtensor: bool) -> torch.Tensor:
        shapes = [tuple(t.shape) for t in locals_]
        logical = self.logical(record.site, record.step, role)
        if was_dtensor:
            placement: Placement | None = Placement("replicate", None, "dtensor")
        else:
            placement = self._planned(record.site, role)
            if placement is not None and not fits(placement, shapes, logical):
                raise TPError(f"{record.site} step {record.step} ({role}): the TP plan says {placement}, but the "
                              f"ranks hold shapes {[list(s) for s in shapes]}" +
                              (f" for a record of shape {list(logical)}" if logical is not None else ""))
            if placement is None:
                placement = infer_placement(shapes, logical)
        if placement is None:
            raise TPError(f"{record.site} step {record.step} ({role}): cannot assemble the ranks' shapes "
                          f"{[list(s) for s in shapes]} into the reference's {list(logical) if logical else '?'} "
                          "(no DTensor placement, no TP plan entry, no single sharded dim)")
        self.placements.setdefault((self._call.sub("", record.site), role), f"{placement} ({placement.source})")
        if placement.kind == "shard":
            return torch.cat(locals_, dim=placement.dim)  # type: ignore[arg-type]
        from ulptrace.ulp import bits

        differ = [r for r, t in enumerate(locals_[1:], 1) if not torch.equal(bits(t), bits(locals_[0]))]
        if differ:
            self.replicas_differ.append({"site": record.site, "step": record.step, "role": role, "ranks": differ})
        return locals_[0]


def logical_shapes(reference: Any) -> Callable[[str, int, str], tuple[int, ...] | None]:
    """``(site, step, role) -> shape`` of the reference's records: from a ``LazyTrace``'s manifest (nothing
    read from disk) or any trace with ``get``."""
    manifest = getattr(reference, "manifest", None)
    if isinstance(manifest, Mapping):
        entries = {(e["site"], e["step"]): e for e in manifest.get("records", [])}

        def lookup(site: str, step: int, role: str) -> tuple[int, ...] | None:
            e = entries.get((site, step))
            if e is None:
                return None
            shape = e.get("shape") if role == "out" else (e.get("inputs", {}).get(role) or {}).get("shape")
            return tuple(shape) if shape is not None else None

        return lookup

    def from_records(site: str, step: int, role: str) -> tuple[int, ...] | None:
        r = reference.get((site, step))
        if r is None:
            return None
        t = r.out if role == "out" else r.inputs.get(role)
        return None if t is None else tuple(t.shape)

    return from_records


# -- parameters ------------------------------------------------------------------------------------------------

def _checksum(t: torch.Tensor) -> int:
    from ulptrace.ulp import bits

    return int(bits(t.detach()).to(torch.int64).sum()) if t.numel() else 0


@dataclass
class ParameterReport:
    """Each rank's piece of every parameter, checked against the reference (rank 0 only).

    Attributes:
        layout: ``{name: {"placement", "dim", "sizes"}}``: the DTensor placement (``Shard(dim=1)``,
            ``Replicate()``, or ``local`` for a plain tensor every rank holds whole), the sharded dim (or
            None) and each rank's length along it.
        stale: one entry per rank whose shard or copy differs from the same slice of the reference:
            ``{"parameter", "rank", "placement", "slice"}`` (``slice`` is ``[dim, start, stop]``, or None for a
            whole copy).
        checksums: the candidate's parameter checksums (``ulptrace.record.parameter_checksums``: whole tensors,
            so they compare with the reference's), where a replicated copy that differs on a rank other than 0
            is marked so that it cannot equal the reference's.
    """

    layout: dict[str, dict[str, Any]] = field(default_factory=dict)
    stale: list[dict[str, Any]] = field(default_factory=list)
    checksums: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"stale": self.stale, "layout": self.layout}


def parameter_report(model: Any, group: Group, reference: Any | None = None) -> ParameterReport | None:
    """Checksum every rank's shard (or replicated copy) of every parameter and, on rank 0, compare each with the
    same slice of ``reference``'s parameter (without a reference, replicated copies with rank 0's). Every rank
    calls this (collectives); rank 0 gets the report, the other ranks None."""
    import torch.distributed as dist
    from ulptrace.record import parameter_checksums

    local: dict[str, tuple[str, int | None, tuple[int, ...], int]] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        placements = getattr(p, "placements", None)
        if placements is not None and len(placements) == 1:
            pl = placements[0]
            dim = pl.dim if type(pl).__name__ == "Shard" else None
            t = p.to_local()
            local[name] = (f"Shard(dim={dim})" if dim is not None else f"{type(pl).__name__}()", dim,
                           tuple(t.shape), _checksum(t))
        else:
            local[name] = ("local", None, tuple(p.shape), _checksum(p))
    everyone: list[Any] = [None] * group.size
    dist.all_gather_object(everyone, local)
    checksums = parameter_checksums(model)  # whole tensors (a collective per DTensor parameter)
    if not group.main:
        return None
    report = ParameterReport(checksums=dict(checksums))
    ref_params = dict(reference.named_parameters(remove_duplicate=True)) if reference is not None else {}
    for name, (placement, dim, _, _) in local.items():
        sizes = [everyone[r][name][2][dim] for r in range(group.size)] if dim is not None else []
        report.layout[name] = {"placement": placement, "dim": dim, "sizes": sizes}
        ref = ref_params.get(name)
        start = 0
        for r in range(group.size):
            got = everyone[r][name][3]
            if dim is not None:
                size = everyone[r][name][2][dim]
                expected = _checksum(ref.narrow(dim, start, size)) if ref is not None else None
                where: list[int] | None = [dim, start, start + size]
                start += size
            else:
                expected = _checksum(ref) if ref is not None else everyone[0][name][3]
                where = None
            if expected is None or got == expected:
                continue
            report.stale.append({"parameter": name, "rank": r, "placement": placement, "slice": where})
            if dim is None and r > 0:  # the whole-tensor checksum shows rank 0's copy only
                report.checksums[name] = f"{report.checksums.get(name, '')};rank{r}:{got}"
    return report


def split_parameters(report: ParameterReport) -> dict[str, Any]:
    """``{parameter name: ShardedReduction}`` for every parameter the run holds split along a dim (shards in
    rank order): the oracle offers the ``sharded`` hypothesis to each matmul that contracts over such a dim
    (a row-parallel weight's input features), and to nothing else."""
    from ulptrace.oracle.sharding import ShardedReduction

    return {name: ShardedReduction(name, entry["dim"], tuple(entry["sizes"]))
            for name, entry in report.layout.items() if entry["dim"] is not None}


def stale_notes(report: ParameterReport, sites: list[Any]) -> dict[str, str]:
    """``{site name: note}`` for the sites observed at a module that owns a stale parameter shard or copy."""
    notes: dict[str, list[str]] = {}
    for entry in report.stale:
        module = entry["parameter"].rsplit(".", 1)[0]
        piece = "copy" if entry["slice"] is None else \
            f"shard ({entry['placement']}, [{entry['slice'][1]}:{entry['slice'][2]}])"
        text = f"parameter {entry['parameter']}: rank {entry['rank']}'s {piece} differs from the reference"
        for s in sites:
            if s.out.module == module and s.out.at == "out":  # the module's own output, not its input
                notes.setdefault(s.name, []).append(text)
    return {k: "; ".join(v) for k, v in notes.items()}
