"""Inject ulptrace's kernels into an HF model, and take them out again.

``inject(model, mode)`` swaps HF's RMSNorms, GLU epilogue, gated norm, GatedDeltaNet gates and
decode attention for :mod:`ulptrace.kernels` ops (CUDA kernels on a GPU, plain-torch references
otherwise), keeping HF's module names and call structure so a recorder observing by name sees the
same sites on both paths. It returns an :class:`Injection` handle that works as a context manager
and as a plain call with ``.undo()``; undoing restores every module, forward and function, so the
model's outputs are bitwise those of before.

Supported: ``Qwen3_5ForCausalLM`` (the hybrid text model) and the Llama family
(``LlamaForCausalLM``, Qwen3, Qwen2, Mistral), per the data tables :data:`LAYER_FAMILIES`,
``rms_norm.VARIANTS`` and :data:`GATED_NORMS`. Where each op goes:

- ``add_rms_norm``: every known RMSNorm module is replaced at its attribute path; the decoder
  layer's forward is patched on the instance so the post-attention norm also does the residual add;
- ``glu``: ``mlp.forward`` is patched on the instance (SiLU MLPs only);
- ``gated_rms_norm``: ``linear_attn.norm`` is replaced;
- ``gdn_gates``: a transform on the ``ulptrace.taps`` tap of the modeling module's
  ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` replaces ``g``/``beta`` with
  the kernel's, computed from ``a``/``b`` captured by hooks on the running GDN module's projections;
- ``decode_attention``: the tap of the attention function the model uses (the modeling module's
  ``eager_attention_forward``, or ``ALL_ATTENTION_FUNCTIONS["sdpa"]``) gets an implementation that
  runs the kernel for one-token queries and the original otherwise. Faithful follows that
  function's semantics (``eager`` or ``sdpa``, see :mod:`.decode_attention`). A tap holds one
  implementation at a time, so two injections with ``decode_attention`` cannot be active together.

Registered paths: ``kernels:faithful`` -> ``ulptrace.kernels.inject:faithful`` and
``kernels:fused`` -> ``ulptrace.kernels.inject:fused``.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from ulptrace.families import GATED_NORMS, is_gated_deltanet
from ulptrace.kernels import _build
from ulptrace.kernels import _common as c
from ulptrace.kernels._patches import (
    LAYER_FAMILIES,
    SILU_ACTIVATIONS,
    KernelGatedRMSNorm,
    KernelRMSNorm,
    layer_forward,
    mlp_forward,
)
from ulptrace.kernels.decode_attention import SEMANTICS, decode_attention, max_cache_len, tree_specs
from ulptrace.kernels.gdn_gates import gdn_gates
from ulptrace.kernels.rms_norm import VARIANTS, tree_spec
from ulptrace.trace import dtype_name

from ulptrace.sites import GDN_FUNCTIONS  # the functions HF hands the gates to are site metadata

OPS = ("add_rms_norm", "glu", "gated_rms_norm", "gdn_gates", "decode_attention")
# attention kwargs that change the math; a call carrying one (not None) runs the original function
UNSUPPORTED_ATTENTION_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")

_ACTIVE: weakref.WeakKeyDictionary[nn.Module, Injection] = weakref.WeakKeyDictionary()


class Injection:
    """An applied injection: what was replaced, how, and how to undo it.

    Attributes:
        mode: ``"faithful"`` or ``"fused"``.
        backend: ``"cuda"`` or ``"reference"`` (what ``backend="auto"`` resolved to).
        ops: the ops that were applied somewhere, in :data:`OPS` order.
        implementation: op -> ``"cuda"`` or ``"reference"`` (what runs).
        trees: op -> {reduction: ``ulptrace.trees`` spec} of the CUDA kernels; empty for ops without
            a reduction and for the references, which reduce in HF's own torch order.
        sites: op -> module paths replaced or patched (or tapped function names).
        skipped: op -> why it was not applied.
        attention_semantics: ``"eager"``/``"sdpa"`` when decode attention is injected, else None.
        calls: counters: ``decode_attention_kernel``, ``decode_attention_fallback``, ``gdn_gates``.
    """

    def __init__(self, model: nn.Module, mode: str, backend: str) -> None:
        self._model = weakref.ref(model)
        self.mode = mode
        self.backend = backend
        self.ops: tuple[str, ...] = ()
        self.implementation: dict[str, str] = {}
        self.trees: dict[str, dict[str, str]] = {}
        self.sites: dict[str, list[str]] = {}
        self.skipped: dict[str, str] = {}
        self.attention_semantics: str | None = None
        self.calls: dict[str, int] = {"decode_attention_kernel": 0, "decode_attention_fallback": 0, "gdn_gates": 0}
        self._undo: list[Callable[[], None]] = []
        self.active = True

    def undo(self) -> None:
        """Restore everything this injection changed (idempotent)."""
        while self._undo:
            self._undo.pop()()
        model = self._model()
        if model is not None and _ACTIVE.get(model) is self:
            del _ACTIVE[model]
        self.active = False

    def __enter__(self) -> Injection:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def metadata(self) -> dict[str, Any]:
        """A JSON-ready summary for trace metadata."""
        return {
            "path": f"kernels:{self.mode}",
            "mode": self.mode,
            "backend": self.backend,
            "order": "kernel" if self.backend == "cuda" else "hf",
            "ops": list(self.ops),
            "implementation": dict(self.implementation),
            "trees": {op: dict(t) for op, t in self.trees.items()},
            "attention_semantics": self.attention_semantics,
            "skipped": dict(self.skipped),
            "calls": dict(self.calls),
        }

    @property
    def info(self) -> dict[str, Any]:
        """Same as :meth:`metadata` (the name ``ulptrace.paths`` reads a path handle's report from)."""
        return self.metadata()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"Injection(mode={self.mode!r}, backend={self.backend!r}, ops={self.ops}, {state})"


def _resolve_backend(model: nn.Module, backend: str) -> str:
    c.check_choice("backend", backend, c.BACKENDS)
    param = next(model.parameters(), None)
    on_cuda = param is not None and param.is_cuda
    if backend == "reference":
        return "reference"
    if backend == "cuda":
        if not on_cuda:
            raise ValueError(f"backend='cuda' needs the model on a CUDA device, but it is on "
                             f"{param.device if param is not None else 'no device (no parameters)'}")
        _build.extension()
        return "cuda"
    return "cuda" if on_cuda and _build.available(warn=True) else "reference"


def _replace(model: nn.Module, path: str, new: nn.Module, injection: Injection) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, attr)
    setattr(parent, attr, new)
    injection._undo.append(lambda: setattr(parent, attr, old))


def _patch_forward(module: nn.Module, body: Callable[..., Any], injection: Injection) -> None:
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = types.MethodType(body, module)

    def undo() -> None:
        if had:
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)

    injection._undo.append(undo)


def _model_dtype(model: nn.Module) -> torch.dtype:
    param = next(model.parameters(), None)
    return param.dtype if param is not None else torch.float32


def _tree_key(weight: torch.Tensor) -> str:
    return f"sum_of_squares[n={weight.numel()},{dtype_name(weight.dtype)}]"


def _norm_tree(weight: torch.Tensor) -> str:
    return tree_spec(weight.numel(), weight.dtype)


def _apply_norms(model: nn.Module, inj: Injection, dtype: torch.dtype) -> None:
    targets = [(p, m) for p, m in model.named_modules() if p and type(m).__name__ in VARIANTS]
    for path, module in targets:
        backend = inj.backend if module.weight.dtype == dtype else "reference"
        _replace(model, path, KernelRMSNorm(module, VARIANTS[type(module).__name__], inj.mode, backend), inj)
        inj.sites.setdefault("add_rms_norm", []).append(path)
        if backend == "cuda":
            inj.trees.setdefault("add_rms_norm", {})[_tree_key(module.weight)] = _norm_tree(module.weight)
    for path, layer in model.named_modules():
        family = LAYER_FAMILIES.get(type(layer).__name__)
        if family is not None and isinstance(getattr(layer, "post_attention_layernorm", None), KernelRMSNorm):
            _patch_forward(layer, layer_forward(family), inj)
            inj.sites["add_rms_norm"].append(f"{path}.forward")


def _apply_glu(model: nn.Module, inj: Injection) -> None:
    reasons = []
    for path, layer in model.named_modules():
        if type(layer).__name__ not in LAYER_FAMILIES:
            continue
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            reasons.append(f"{path}.mlp has no gate_proj/up_proj/down_proj")
            continue
        act = type(getattr(mlp, "act_fn", None)).__name__
        if act not in SILU_ACTIVATIONS:
            reasons.append(f"{path}.mlp.act_fn is {act}, the kernel computes SiLU")
            continue
        _patch_forward(mlp, mlp_forward(inj.mode, inj.backend), inj)
        inj.sites.setdefault("glu", []).append(f"{path}.mlp.forward")
    if reasons and "glu" not in inj.sites:
        inj.skipped["glu"] = "; ".join(reasons[:3])


def _apply_gated_norms(model: nn.Module, inj: Injection, dtype: torch.dtype) -> None:
    for path, module in [(p, m) for p, m in model.named_modules() if type(m).__name__ in GATED_NORMS]:
        backend = inj.backend if module.weight.dtype == dtype else "reference"
        _replace(model, path, KernelGatedRMSNorm(module, inj.mode, backend), inj)
        inj.sites.setdefault("gated_rms_norm", []).append(path)
        if backend == "cuda":
            inj.trees.setdefault("gated_rms_norm", {})[_tree_key(module.weight)] = _norm_tree(module.weight)


def _apply_gdn_gates(model: nn.Module, inj: Injection) -> None:
    from ulptrace.taps import tap

    gdns = [(p, m) for p, m in model.named_modules()
            if is_gated_deltanet(m) and hasattr(m, "in_proj_a") and hasattr(m, "in_proj_b")]
    if not gdns:
        return
    state: dict[str, Any] = {"module": None, "a": None, "b": None}

    def enter(module: nn.Module, args: Any) -> None:
        state.update(module=module, a=None, b=None)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        state.update(module=None, a=None, b=None)

    def capture(owner: nn.Module, key: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if state["module"] is owner:
                state[key] = output
        return hook

    def transform(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        module, a, b = state["module"], state["a"], state["b"]
        if module is None or a is None or b is None:
            return args, kwargs
        g, beta = gdn_gates(a, b, module.A_log, module.dt_bias, mode=inj.mode, backend=inj.backend)
        args, kwargs = list(args), dict(kwargs)
        for position, name, value in ((3, "g", g), (4, "beta", beta)):
            old = kwargs.get(name) if name in kwargs else (args[position] if len(args) > position else None)
            if not isinstance(old, torch.Tensor) or old.shape != value.shape:
                return tuple(args), kwargs  # not the call shape we know: leave HF's values
        for position, name, value in ((3, "g", g), (4, "beta", beta)):
            if name in kwargs:
                kwargs[name] = value
            else:
                args[position] = value
        inj.calls["gdn_gates"] += 1
        return tuple(args), kwargs

    namespaces = {}
    for path, module in gdns:
        for handle in (module.register_forward_pre_hook(enter), module.register_forward_hook(leave),
                       module.in_proj_a.register_forward_hook(capture(module, "a")),
                       module.in_proj_b.register_forward_hook(capture(module, "b"))):
            inj._undo.append(handle.remove)
        namespaces[type(module).__module__] = sys.modules[type(module).__module__]
        inj.sites.setdefault("gdn_gates", []).append(path)
    for name, namespace in namespaces.items():
        for fn in GDN_FUNCTIONS:
            if hasattr(namespace, fn):
                inj._undo.append(tap(namespace, fn).add_transform(transform).remove)
                inj.sites["gdn_gates"].append(f"{name}.{fn}")


def _decode_valid(mask: Any, batch: int, length: int) -> tuple[bool, torch.Tensor | None]:
    """``(usable, valid [B, L] or None)`` from HF's attention mask for a one-token query."""
    if mask is None:
        return True, None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1:] != (1, 1, length) \
            or mask.shape[0] not in (1, batch):
        return False, None
    m = mask[:, 0, 0, :].expand(batch, length)
    if m.dtype == torch.bool:
        return True, m
    valid = m == 0
    # an additive bias other than 0 / min is not a set of valid positions; inside a CUDA-graph capture the
    # host cannot look (no synchronisation there): the eager warm-up of the same step has checked it
    capturing = m.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and not bool((valid | (m == torch.finfo(m.dtype).min)).all()):
        return False, None
    return True, valid


def _apply_decode_attention(model: nn.Module, inj: Injection) -> None:
    from ulptrace.sites import attention_lookup
    from ulptrace.taps import tap

    modules = [(p, m.self_attn) for p, m in model.named_modules()
               if type(m).__name__ in LAYER_FAMILIES and getattr(m, "self_attn", None) is not None]
    if not modules:
        return
    impl_name = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl_name not in SEMANTICS:
        inj.skipped["decode_attention"] = (f"the model's attention implementation is {impl_name!r}; "
                                           f"the kernel reproduces {SEMANTICS}")
        return
    namespace, fn_name = attention_lookup(model)  # where HF resolves it at call time, as the recorder taps it
    the_tap = tap(namespace, fn_name)
    original = the_tap.original
    ours = {id(m) for _, m in modules}

    def impl(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        usable = (id(module) in ours and not args and query.dim() == 4 and query.shape[2] == 1
                  and not (module.training and kwargs.get("dropout", 0.0))
                  and all(kwargs.get(k) is None for k in UNSUPPORTED_ATTENTION_KWARGS))
        valid = None
        if usable:
            usable, valid = _decode_valid(attention_mask, query.shape[0], key.shape[2])
        if usable and inj.backend == "cuda" and key.shape[2] > max_cache_len(query.shape[-1]):
            usable = False
        if not usable:
            inj.calls["decode_attention_fallback"] += 1
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling")
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        out = decode_attention(query[:, :, 0], key, value, scale=scale, valid=valid, semantics=impl_name,
                                     mode=inj.mode, backend=inj.backend)
        inj.calls["decode_attention_kernel"] += 1
        return out.unsqueeze(1), None

    try:
        handle = the_tap.set_impl(impl)
    except RuntimeError as exc:
        raise RuntimeError(
            f"cannot inject decode_attention: the attention function {fn_name!r} already has a replacement "
            f"(another active injection?); undo it first, or pass ops without 'decode_attention' ({exc})"
        ) from None
    inj._undo.append(handle.remove)
    inj.attention_semantics = impl_name
    inj.sites["decode_attention"] = [p for p, _ in modules] + [f"{getattr(namespace, '__name__', 'ALL_ATTENTION_FUNCTIONS')}.{fn_name}"]
    if inj.backend == "cuda":
        head_dim = int(getattr(modules[0][1], "head_dim", 0))
        if head_dim:
            inj.trees["decode_attention"] = tree_specs(head_dim, _model_dtype(model))


def inject(model: nn.Module, mode: str = "faithful", ops: Iterable[str] | None = None,
           backend: str = "auto") -> Injection:
    """Replace HF ops of ``model`` by ulptrace's kernels; returns the (already applied) handle.

    Args:
        model: a ``Qwen3_5ForCausalLM`` or Llama-family model (or its inner text model).
        mode: ``"faithful"`` (HF's rounding points) or ``"fused"`` (FP32 inside, one rounding).
        ops: which of :data:`OPS` to inject; None means every op the model has a site for.
        backend: ``"auto"`` (CUDA kernels when the model is on a GPU and they build, else the
            references), ``"cuda"`` or ``"reference"``.

    Returns:
        An :class:`Injection`; use it as a context manager or call ``.undo()``.

    Raises:
        ValueError: unknown mode/backend/op, a model without supported decoder layers or of a dtype
            the kernels do not support (``FLOAT_DTYPES``), an op asked for by name that has no site in
            this model, ``backend="cuda"`` for a CPU model.
        RuntimeError: the model is already injected, ``decode_attention`` is already injected in
            another model, or ``backend="cuda"`` and the kernels cannot be built.
    """
    c.check_choice("mode", mode, c.MODES)
    requested = OPS if ops is None else tuple(ops)
    for op in requested:
        c.check_choice("op", op, OPS)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, but got {type(model).__name__}")
    if model in _ACTIVE:
        raise RuntimeError(f"{type(model).__name__} already has an active injection ({_ACTIVE[model]!r}); "
                           "undo it before injecting again")
    if not any(type(m).__name__ in LAYER_FAMILIES for m in model.modules()):
        raise ValueError(f"inject supports models with decoder layers {sorted(LAYER_FAMILIES)}, "
                         f"but {type(model).__name__} has none")
    dtype = _model_dtype(model)
    if dtype not in c.FLOAT_DTYPES:
        raise ValueError(f"ulptrace's kernels support {', '.join(dtype_name(d) for d in c.FLOAT_DTYPES)} "
                         f"models, but {type(model).__name__} is {dtype_name(dtype)}")
    inj = Injection(model, mode, _resolve_backend(model, backend))
    appliers: dict[str, Callable[[], None]] = {
        "add_rms_norm": lambda: _apply_norms(model, inj, dtype),
        "glu": lambda: _apply_glu(model, inj),
        "gated_rms_norm": lambda: _apply_gated_norms(model, inj, dtype),
        "gdn_gates": lambda: _apply_gdn_gates(model, inj),
        "decode_attention": lambda: _apply_decode_attention(model, inj),
    }
    try:
        for op in OPS:
            if op in requested:
                appliers[op]()
                if op not in inj.sites:
                    inj.skipped.setdefault(op, f"{type(model).__name__} has no site for {op}")
    except BaseException:
        inj.undo()
        raise
    if ops is not None:
        missing = {op: inj.skipped[op] for op in requested if op in inj.skipped}
        if missing:
            inj.undo()
            raise ValueError(f"ops {sorted(missing)} were asked for but cannot be injected: {missing}")
    inj.ops = tuple(op for op in OPS if op in inj.sites)
    inj.implementation = {op: inj.backend for op in inj.ops}
    for op in ("add_rms_norm", "gated_rms_norm"):
        if op in inj.ops and inj.backend == "cuda" and op not in inj.trees:
            inj.implementation[op] = "reference"  # every module of the op fell back (weight dtype)
    _ACTIVE[model] = inj
    return inj


def faithful(model: nn.Module) -> Injection:
    """The ``kernels:faithful`` path: every op, HF's rounding points, CUDA when available."""
    return inject(model, mode="faithful")


def fused(model: nn.Module) -> Injection:
    """The ``kernels:fused`` path: every op in fused mode (FP32 inside, one rounding)."""
    return inject(model, mode="fused")
