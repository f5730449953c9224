"""Site tables: which intermediates of an HF model ulptrace observes, under which names.

A *site* is a named place where an intermediate is observed (``layers.3.input_layernorm``,
``layers.0.linear_attn.gates.g``, ``logits``). Names are the same on every path, so two traces
align by name. Each site says where its output is observed, which inputs the oracle needs (also
observed, never recomputed) and how to build the reference formula from the *reference* model's
own modules (semantics and parameters come from the reference, activations from each path).

The tables are data: one row per site kind and position, instantiated for every decoder layer
that has the row's module. Observation points (``Obs``) are

- ``out`` / ``out1``: the first / second tensor a module returns,
- ``in0`` / ``in1``: a positional input of a module (pre-hook),
- ``residual``: the updated residual of a post-attention norm — the second output when a fused
  add+norm returns ``(normed, residual)``, otherwise the norm's own input (HF adds first),
- ``tap.<field>``: a field of a function tap attributed to the module (GDN gates and core,
  attention q/k/v/mask/core), see ``ulptrace.taps``,
- ``cos`` / ``sin``: the rotary tables an attention module receives (``position_embeddings``),
- ``state.conv`` / ``state.recurrent``: a GatedDeltaNet cache state after the module ran.

Some inputs are optional (``Site.optional``): an attention mask a path may leave to the kernel, the
incoming recurrent or conv state that a prefill does not have.
"""

from __future__ import annotations

import fnmatch
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from ulptrace.families import ARCHITECTURES

KINDS = ("norm", "gated_norm", "glu", "gates", "conv", "rope", "attention", "residual", "state", "logits", "linear",
         "other")
# kinds whose semantics make each output row (the last dimension) from the same row of every input alone — a norm
# reduces over it, a linear layer contracts it, the rest are elementwise — so a record can be judged on some of its
# rows (``ulptrace.verdicts``). Not: the causal conv and the scan (across tokens), attention, rope (its tables are not
# row-shaped), the states.
ROW_WISE_KINDS = ("norm", "gated_norm", "glu", "gates", "residual", "logits", "linear")
# kinds whose semantics treat each batch item (dimension 0 of the output and of every input) alone — attention cores,
# rope (each item's query with its own positions' tables), the GatedDeltaNet conv, scan and states — so a record can be
# judged on some of its batch items (a record whose tables are shared by the batch, dimension 0 of one, is judged whole)
BATCH_WISE_KINDS = ("attention", "rope", "conv", "state")


@dataclass(frozen=True)
class Obs:
    """An observation point: ``module`` (dotted path from the model root) and what is taken there."""

    module: str
    at: str

    @functools.cached_property
    def key(self) -> str:  # cached: the recorder reads it for every observation
        return f"{self.module}:{self.at}"


Formula = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Site:
    """One named site of one model, with where its output and oracle inputs are observed."""

    name: str
    kind: str
    layer: int | None
    out: Obs
    inputs: dict[str, Obs] = field(default_factory=dict)
    # builds the reference formula fn(**inputs) from the reference model; None: no oracle semantics
    formula: Callable[[torch.nn.Module], Formula] | None = field(default=None, compare=False)
    optional: tuple[str, ...] = ()  # input roles that may be absent from a record

    def to_json(self) -> dict[str, Any]:
        return {"site": self.name, "kind": self.kind, "layer": self.layer}


@dataclass(frozen=True)
class Row:
    """A site template in a table; ``module`` and observation paths are relative to the scope."""

    name: str
    kind: str
    module: str  # the module that must exist for the row to apply ("" = the scope itself)
    out: tuple[str, str]
    inputs: dict[str, tuple[str, str]] = field(default_factory=dict)
    formula: Callable[[Any, Any], Formula] | None = None  # (scope module of the reference, model) -> fn
    absent: str | None = None  # the row applies only where this module does not exist
    optional: tuple[str, ...] = ()  # input roles that may be absent from a record


def submodule(scope: torch.nn.Module, path: str) -> Any:
    """The attribute at dotted ``path`` below ``scope`` (``"mlp.down_proj"``; ``""`` is ``scope``); raises
    ``AttributeError`` when there is none."""
    obj: Any = scope
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


# Formulas bind the reference modules' ``forward`` *when they are built* (and the attention function
# as registered then, with any ulptrace tap unwrapped): a candidate path that later patches a class,
# a module-level function or HF's attention registry globally cannot change the reference semantics.
# What the bound code looks up by name as it runs (a module's helpers, methods through the class) is
# put back around each capture by ``ulptrace.oracle.environment``.


def _call(path: str) -> Callable[[Any, Any], Formula]:
    """Formula: the reference's own module at ``path`` on the single input ``x``."""

    def build(scope: Any, model: Any) -> Formula:
        forward = submodule(scope, path).forward
        return lambda x: forward(x)

    return build


def _add(scope: Any, model: Any) -> Formula:
    return lambda residual, delta: residual + delta


def _add_then(path: str) -> Callable[[Any, Any], Formula]:
    """Formula: the decoder layer's residual add (rounds to the stream dtype), then the norm at path."""

    def build(scope: Any, model: Any) -> Formula:
        forward = submodule(scope, path).forward
        return lambda residual, delta: forward(residual + delta)

    return build


def _glu(scope: Any, model: Any) -> Formula:
    act = scope.mlp.act_fn.forward
    return lambda gate, up: act(gate) * up


def _gated_norm(scope: Any, model: Any) -> Formula:
    norm = scope.linear_attn.norm.forward
    return lambda x, gate: norm(x, gate)


def _gdn_g(scope: Any, model: Any) -> Formula:
    # Declared formula for the GatedDeltaNet decay gate (kept in FP32 by HF); tests check it is
    # bitwise equal to what HF passes to the delta rule.
    gdn = scope.linear_attn
    return lambda a: -gdn.A_log.float().exp() * torch.nn.functional.softplus(a.float() + gdn.dt_bias)


def _gdn_beta(scope: Any, model: Any) -> Formula:
    return lambda b: b.sigmoid()


def _gdn_scan(output: str) -> Callable[[Any, Any], Any]:
    """Semantics of the delta-rule scan's ``core`` output or final ``state`` (``ulptrace.oracle.gdn``): the
    mathematics evaluated by the oracle itself, never HF's module-level scan (which HF may bind to
    flash-linear-attention at import time)."""

    def build(scope: Any, model: Any) -> Any:
        from ulptrace.oracle.gdn import DeltaRuleSemantics

        return DeltaRuleSemantics(output, name=f"linear_attn.{'core' if output == 'core' else 'recurrent_state'}")

    return build


def _module_function(module: Any, name: str) -> Callable[..., Any]:
    """``name`` of ``module``'s modeling module as HF registered it (beneath any ulptrace tap)."""
    import sys

    fn = getattr(sys.modules[type(module).__module__], name)
    tapped = getattr(fn, "__ulptrace_tap__", None)
    return tapped.original if tapped is not None else fn


def _gdn_conv(scope: Any, model: Any) -> Formula:
    """HF's causal conv (+ SiLU) with the reference's weights: the prefill form, or the one-token update form
    when the record has the incoming conv state (run on a copy: HF updates the state in place)."""
    gdn = scope.linear_attn
    prefill, update = (_module_function(gdn, n) for n in CONV_FUNCTIONS)
    weight, bias, act = gdn.conv1d.weight.squeeze(1), gdn.conv1d.bias, gdn.activation

    def conv(x: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        if state is None:
            return prefill(x, weight, bias, activation=act)
        return update(x, state.clone(), weight, bias, act)

    return conv


def _gdn_conv_state(scope: Any, model: Any) -> Formula:
    """The conv state left in the cache: the last ``kernel`` inputs the conv saw (zeros before the first)."""
    kernel = scope.linear_attn.conv_kernel_size

    def conv_state(x: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        seen = x if state is None else torch.cat([state, x.to(state.dtype)], dim=-1)
        if seen.shape[-1] < kernel:
            seen = torch.nn.functional.pad(seen, (kernel - seen.shape[-1], 0))
        return seen[..., -kernel:]

    return conv_state


# what HF's attention modules hand their attention function besides the tensors and the scaling, by the module's
# attribute each comes from (``softcap=self.attn_logit_softcapping``: Gemma 2's ``tanh(s / cap) * cap`` of the
# scores; ``sliding_window=self.sliding_window``: the functions that take the window, not a mask): the core's
# semantics are the call HF makes. Left out, a kernel that drops Gemma 2's soft cap was judged against a formula
# without it too (inside: parity).
ATTENTION_CALL_ATTRIBUTES = (("softcap", "attn_logit_softcapping"), ("sliding_window", "sliding_window"))


def _attention_core(scope: Any, model: Any) -> Formula:
    attn = scope.self_attn
    fn = attention_function(model, unwrap=True)
    extra = {name: getattr(attn, attribute) for name, attribute in ATTENTION_CALL_ATTRIBUTES
             if getattr(attn, attribute, None) is not None}

    def core(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None) -> torch.Tensor:
        return fn(attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling, **extra)[0]

    return core


def attention_lookup(model: Any) -> tuple[Any, str]:
    """Where HF looks up the model's attention function at call time: ``(namespace, name)`` — the
    modeling module's ``eager_attention_forward``, or an entry of ``ALL_ATTENTION_FUNCTIONS`` (the
    place a tap must stand, see ``ulptrace.taps``)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    if impl in (None, "eager"):
        layer = decoder_layers(model)[0]
        owner = getattr(layer, "self_attn", None) or next(
            (m for m in layer.modules() if hasattr(m, "scaling")), layer
        )
        return sys.modules[type(owner).__module__], "eager_attention_forward"
    return ALL_ATTENTION_FUNCTIONS, impl


def attention_function(model: Any, *, unwrap: bool = False) -> Callable[..., Any]:
    """The attention interface function the model's config selects (HF's registry lookup).

    ``unwrap`` returns the function beneath an ulptrace tap (what HF registered), for formulas.
    """
    namespace, name = attention_lookup(model)
    fn = getattr(namespace, name) if name == "eager_attention_forward" else namespace[name]
    tapped = getattr(fn, "__ulptrace_tap__", None)
    return tapped.original if unwrap and tapped is not None else fn


def _final_norm(scope: Any, model: Any) -> Formula:
    norm = submodule(model, _resolve(_anchors(model), "", "@body.norm", None)).forward
    return lambda x: norm(x)


def _rope(from_proj: bool) -> Callable[[Any, Any], Formula]:
    """Formula: HF's ``apply_rotary_pos_emb`` on the query before RoPE — the q norm's output, or the q
    projection's output viewed as heads where the model has no q norm."""

    def build(scope: Any, model: Any) -> Formula:
        import sys

        attn = scope.self_attn
        rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        head_dim = attn.head_dim

        def formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            q = (x.view(*x.shape[:-1], -1, head_dim) if from_proj else x).transpose(1, 2)
            return rope(q, q, cos, sin)[0]

        return formula

    return build


def _logits(scope: Any, model: Any) -> Formula:
    head = model.get_output_embeddings().forward
    return lambda x: head(x)


def _returned(scope: Any, model: Any) -> Formula:
    """Formula: what the model returns, from the head's input — the head, then what the model does after it: nothing,
    or a soft cap where the config asks for one (Gemma 2's ``final_logit_softcapping``: ``tanh(y / cap) * cap`` in
    the logits' dtype, as HF does). Observed after the model's own forward, so a temperature, a logit bias or a cast
    that a path applies around the head is judged, not only the head's own module. (From the head's input, which the
    ``logits`` site reads anyway, not from its output: a long prompt's logits are compared where the model left them,
    and a reader after the head's call would make the recorder copy them.)"""
    head = model.get_output_embeddings().forward
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return lambda x: head(x)
    return lambda x: torch.tanh(head(x) / cap) * cap


# Rows shared by every decoder-only family whose module names agree (Llama, Qwen2/3, Mistral,
# Qwen3.5): norms, attention, MLP/GLU, residual stream.
_COMMON_LAYER_ROWS: tuple[Row, ...] = (
    Row("input_layernorm", "norm", "input_layernorm", ("input_layernorm", "out"),
        {"x": ("input_layernorm", "in0")}, _call("input_layernorm")),
    Row("self_attn.q_norm", "norm", "self_attn.q_norm", ("self_attn.q_norm", "out"),
        {"x": ("self_attn.q_norm", "in0")}, _call("self_attn.q_norm")),
    Row("self_attn.k_norm", "norm", "self_attn.k_norm", ("self_attn.k_norm", "out"),
        {"x": ("self_attn.k_norm", "in0")}, _call("self_attn.k_norm")),
    Row("self_attn.q_rope", "rope", "self_attn.q_norm", ("self_attn", "tap.query"),
        {"x": ("self_attn.q_norm", "out"), "cos": ("self_attn", "cos"), "sin": ("self_attn", "sin")}, _rope(False)),
    Row("self_attn.q_rope", "rope", "self_attn.q_proj", ("self_attn", "tap.query"),
        {"x": ("self_attn.q_proj", "out"), "cos": ("self_attn", "cos"), "sin": ("self_attn", "sin")}, _rope(True),
        absent="self_attn.q_norm"),
    Row("self_attn.core", "attention", "self_attn", ("self_attn", "tap.core"),
        {"query": ("self_attn", "tap.query"), "key": ("self_attn", "tap.key"),
         "value": ("self_attn", "tap.value"), "attention_mask": ("self_attn", "tap.mask")},
        _attention_core, optional=("attention_mask",)),
    Row("self_attn.o_proj", "linear", "self_attn.o_proj", ("self_attn.o_proj", "out"),
        {"x": ("self_attn.o_proj", "in0")}, _call("self_attn.o_proj")),
    Row("post_attention_layernorm", "norm", "post_attention_layernorm", ("post_attention_layernorm", "out"),
        {"residual": ("", "in0"), "delta": ("@mixer", "out")}, _add_then("post_attention_layernorm")),
    Row("residual_attn", "residual", "post_attention_layernorm", ("post_attention_layernorm", "residual"),
        {"residual": ("", "in0"), "delta": ("@mixer", "out")}, _add),
    Row("mlp.gate_proj", "linear", "mlp.gate_proj", ("mlp.gate_proj", "out"),
        {"x": ("mlp.gate_proj", "in0")}, _call("mlp.gate_proj")),
    Row("mlp.up_proj", "linear", "mlp.up_proj", ("mlp.up_proj", "out"),
        {"x": ("mlp.up_proj", "in0")}, _call("mlp.up_proj")),
    Row("mlp.glu", "glu", "mlp.down_proj", ("mlp.down_proj", "in0"),
        {"gate": ("mlp.gate_proj", "out"), "up": ("mlp.up_proj", "out")}, _glu),
    Row("mlp.down_proj", "linear", "mlp.down_proj", ("mlp.down_proj", "out"),
        {"x": ("mlp.down_proj", "in0")}, _call("mlp.down_proj")),
    Row("output", "residual", "", ("", "out"),
        {"residual": ("post_attention_layernorm", "residual"), "delta": ("mlp", "out")}, _add),
)

# Qwen3.5's GatedDeltaNet layers (linear attention): gates, causal conv, scan, states, gated norm.
_SCAN_INPUTS = {role: ("linear_attn", f"tap.{role}") for role in ("query", "key", "value", "g", "beta", "state")}
_CONV_INPUTS = {"x": ("linear_attn", "tap.conv_x"), "state": ("linear_attn", "tap.conv_state")}
_GDN_ROWS: tuple[Row, ...] = (
    Row("linear_attn.gates.g", "gates", "linear_attn", ("linear_attn", "tap.g"),
        {"a": ("linear_attn.in_proj_a", "out")}, _gdn_g),
    Row("linear_attn.gates.beta", "gates", "linear_attn", ("linear_attn", "tap.beta"),
        {"b": ("linear_attn.in_proj_b", "out")}, _gdn_beta),
    Row("linear_attn.conv", "conv", "linear_attn", ("linear_attn", "tap.conv"), _CONV_INPUTS, _gdn_conv,
        optional=("state",)),
    Row("linear_attn.core", "attention", "linear_attn", ("linear_attn", "tap.core"), _SCAN_INPUTS,
        _gdn_scan("core"), optional=("state",)),
    Row("linear_attn.conv_state", "state", "linear_attn", ("linear_attn", "state.conv"), _CONV_INPUTS,
        _gdn_conv_state, optional=("state",)),
    Row("linear_attn.recurrent_state", "state", "linear_attn", ("linear_attn", "state.recurrent"), _SCAN_INPUTS,
        _gdn_scan("state"), optional=("state",)),
    Row("linear_attn.norm", "gated_norm", "linear_attn.norm", ("linear_attn.norm", "out"),
        {"x": ("linear_attn.norm", "in0"), "gate": ("linear_attn.norm", "in1")}, _gated_norm),
    Row("linear_attn.out_proj", "linear", "linear_attn.out_proj", ("linear_attn.out_proj", "out"),
        {"x": ("linear_attn.out_proj", "in0")}, _call("linear_attn.out_proj")),
)

# Model-level rows (scope: the model root; "@body" is the decoder stack's owner, "@head" the LM head; "" the model
# itself, whose "out" is the logits it returns).
_MODEL_ROWS: tuple[Row, ...] = (
    Row("embed", "other", "@embed", ("@embed", "out")),
    Row("norm", "norm", "@body.norm", ("@body.norm", "out"), {"x": ("@body.norm", "in0")}, _final_norm),
    Row("logits", "logits", "@head", ("@head", "out"), {"x": ("@head", "in0")}, _logits),
    Row("output", "logits", "", ("", "out"), {"x": ("@head", "in0")}, _returned),  # the logits the model returns
)


@dataclass(frozen=True)
class Table:
    """A site table: which architectures it covers and its per-layer rows (in execution order)."""

    family: str
    architectures: tuple[str, ...]
    layer_rows: tuple[Row, ...]


_LAYER_ORDER_QWEN35 = (
    _COMMON_LAYER_ROWS[:1] + _GDN_ROWS + _COMMON_LAYER_ROWS[1:]
)


def _rows(*names: str) -> tuple[Row, ...]:
    """The common rows of these names, in the common order (a name may have several rows: the rope of a model with
    and without a q norm)."""
    return tuple(r for r in _COMMON_LAYER_ROWS if r.name in names)


def _norm_row(name: str) -> Row:
    """A norm site whose input is the norm module's own."""
    return Row(name, "norm", name, (name, "out"), {"x": (name, "in0")}, _call(name))


# Gemma 2's sandwich layers: the attention's output normed (post_attention_layernorm) before the residual add, the
# MLP's input normed by pre_feedforward_layernorm and its output by post_feedforward_layernorm before the second add.
_GEMMA2_LAYER_ROWS: tuple[Row, ...] = (
    _rows("input_layernorm", "self_attn.q_norm", "self_attn.k_norm", "self_attn.q_rope", "self_attn.core",
          "self_attn.o_proj")
    + (_norm_row("post_attention_layernorm"),
       Row("residual_attn", "residual", "pre_feedforward_layernorm", ("pre_feedforward_layernorm", "in0"),
           {"residual": ("", "in0"), "delta": ("post_attention_layernorm", "out")}, _add),
       _norm_row("pre_feedforward_layernorm"))
    + _rows("mlp.gate_proj", "mlp.up_proj", "mlp.glu", "mlp.down_proj")
    + (_norm_row("post_feedforward_layernorm"),
       Row("output", "residual", "", ("", "out"),
           {"residual": ("pre_feedforward_layernorm", "in0"), "delta": ("post_feedforward_layernorm", "out")}, _add))
)

TABLES: dict[str, Table] = {  # architectures per family: ulptrace.families, the one table of HF classes
    "qwen3_5": Table("qwen3_5", ARCHITECTURES["qwen3_5"], _LAYER_ORDER_QWEN35),
    "llama": Table("llama", ARCHITECTURES["llama"], _COMMON_LAYER_ROWS),
    "gemma2": Table("gemma2", ARCHITECTURES["gemma2"], _GEMMA2_LAYER_ROWS),
}

# Sites that are outputs of one call on the same inputs: the GatedDeltaNet scan's output and the state it hands to the
# cache. A kernel's design (a hypothesis, a boundary) is the call's, so it must explain every output of it: where one
# has elements no hypothesis explains, the others' "boundary" elements are errors too (``ulptrace.comparison``).
ONE_CALL: tuple[tuple[str, ...], ...] = (("linear_attn.core", "linear_attn.recurrent_state"),)

# Module-level functions of a GatedDeltaNet's modeling module that receive the gates (tapped), and the
# causal conv functions it calls (prefill, and one-token decode that updates the conv state in place).
GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
CONV_FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update")


def table_for(model: Any) -> Table | None:
    """The site table for ``model``'s architecture, or None when ulptrace has none."""
    arch = type(model).__name__
    for table in TABLES.values():
        if arch in table.architectures:
            return table
    return None


def decoder_layers(model: Any) -> Sequence[torch.nn.Module]:
    """The decoder layer list: the first ``ModuleList`` named ``layers``, else the longest
    ``ModuleList`` of non-leaf blocks (``transformer.h``, ``blocks``). Found once per model (a walk over every module;
    a site's formula looks its layer up here), and found again if the list is no longer where it was found."""
    found = _LAYERS.get(model) if isinstance(model, torch.nn.Module) else None
    if found is not None:
        path, layers = found
        try:
            if model.get_submodule(path) is layers and len(layers):
                return layers
        except AttributeError:
            pass
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    picked = next(((name, m) for name, m in lists if name.split(".")[-1] == "layers"), None)
    if picked is None:
        blocks = [(name, m) for name, m in lists if all(next(iter(b.children()), None) is not None for b in m)]
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no ModuleList of decoder layers; ulptrace cannot find its "
                             "decoder")
        picked = max(blocks, key=lambda nm: len(nm[1]))
    if isinstance(model, torch.nn.Module):
        _LAYERS[model] = picked
    return picked[1]


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (path, its decoder layer list)


def _path_of(model: Any, module: torch.nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name
    raise ValueError(f"module {type(module).__name__} is not part of the model")


def _anchors(model: Any) -> dict[str, str]:
    layers = decoder_layers(model)
    layers_path = _path_of(model, layers)
    body = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    return {
        "@layers": layers_path,
        "@body": body,
        "@embed": _path_of(model, model.get_input_embeddings()),
        "@head": _path_of(model, model.get_output_embeddings()),
    }


def _resolve(anchors: dict[str, str], scope: str, path: str, layer: torch.nn.Module | None) -> str:
    if path.startswith("@mixer"):
        mixer = "linear_attn" if hasattr(layer, "linear_attn") else "self_attn"
        path = mixer + path[len("@mixer"):]
    for anchor, real in anchors.items():
        if path == anchor or path.startswith(anchor + "."):
            path = real + path[len(anchor):]
            return path.lstrip(".")
    return ".".join(p for p in (scope, path) if p)


def _exists(model: Any, path: str) -> bool:
    try:
        submodule(model, path)
    except AttributeError:
        return False
    return True


def format_sites(sites: Sequence[Site]) -> str:
    """One line per site, in execution order: its name, kind, layer, the inputs its records carry, and whether the
    oracle has semantics for it — the names ``--sites``, ``fault:SITE@STEP`` and ``ulptrace semantics --site`` take
    (``ulptrace sites``)."""
    if not sites:
        return "no sites"
    width = max(len(s.name) for s in sites)
    lines = [f"{'site':<{width}}  {'kind':<9} {'layer':>5}  {'oracle':<12} inputs"]
    for s in sites:
        oracle = "semantics" if s.formula is not None else "no semantics"
        layer = "-" if s.layer is None else str(s.layer)
        lines.append(f"{s.name:<{width}}  {s.kind:<9} {layer:>5}  {oracle:<12} {', '.join(s.inputs) or '-'}")
    return "\n".join(lines)


def site_table(model: Any, *, warn: bool = True) -> list[Site]:
    """All sites of ``model`` in execution order.

    Uses the architecture's table; a model with no table gets a generic fallback (every leaf
    module's output plus every decoder layer's output, no oracle formulas) and a warning naming
    the architecture.
    """
    table = table_for(model)
    if table is None:
        if warn:
            known = sorted(a for t in TABLES.values() for a in t.architectures)
            warnings.warn(
                f"ulptrace has no site table for {type(model).__name__}; recording every leaf module's output "
                f"and decoder-layer outputs without oracle semantics (tables exist for: {', '.join(known)})",
                stacklevel=2,
            )
        return _fallback_sites(model)
    anchors = _anchors(model)
    sites: list[Site] = []

    def instantiate(row: Row, scope_path: str, layer_index: int | None, layer: Any, ref_scope: Callable) -> None:
        if not _exists(model, _resolve(anchors, scope_path, row.module, layer)):
            return
        if row.absent and _exists(model, _resolve(anchors, scope_path, row.absent, layer)):
            return
        out = Obs(_resolve(anchors, scope_path, row.out[0], layer), row.out[1])
        inputs = {role: Obs(_resolve(anchors, scope_path, p, layer), at) for role, (p, at) in row.inputs.items()}
        prefix = f"layers.{layer_index}." if layer_index is not None else ""
        formula = None
        if row.formula is not None:
            build = row.formula

            def formula(ref_model: Any, build=build, ref_scope=ref_scope) -> Formula:
                return build(ref_scope(ref_model), ref_model)

        sites.append(Site(prefix + row.name, row.kind, layer_index, out, inputs, formula, row.optional))

    sites.append(_model_site(_MODEL_ROWS[0], anchors, model))
    layers_path = anchors["@layers"]
    for i, layer in enumerate(decoder_layers(model)):
        scope = f"{layers_path}.{i}"
        for row in table.layer_rows:
            instantiate(row, scope, i, layer, lambda ref, i=i: decoder_layers(ref)[i])
    for row in _MODEL_ROWS[1:]:
        instantiate(row, "", None, None, lambda ref: ref)
    return sites


def _model_site(row: Row, anchors: dict[str, str], model: Any) -> Site:
    return Site(row.name, row.kind, None, Obs(_resolve(anchors, "", row.out[0], None), row.out[1]))


def _fallback_sites(model: Any) -> list[Site]:
    sites = []
    layer_paths: dict[str, int] = {}
    try:
        layers_path = _path_of(model, decoder_layers(model))
        layer_paths = {f"{layers_path}.{i}": i for i in range(len(decoder_layers(model)))}
    except ValueError:
        pass
    for name, module in model.named_modules():
        is_leaf = next(iter(module.children()), None) is None
        if name and (is_leaf or name in layer_paths):
            layer = layer_paths.get(name)
            if layer is None:
                layer = next((i for p, i in layer_paths.items() if name.startswith(p + ".")), None)
            sites.append(Site(name, "other", layer, Obs(name, "out")))
    sites.append(Site("output", "other", None, Obs("", "out")))  # what the model returns: changed after any module
    return sites


def select(
    sites: Iterable[Site],
    patterns: Sequence[str] | None = None,
    kinds: Sequence[str] | None = None,
    layers: range | Sequence[int] | None = None,
) -> list[Site]:
    """Sites whose name matches any glob in ``patterns``, whose kind is in ``kinds`` and whose layer
    is in ``layers`` (model-level sites have no layer and pass a layer filter only when it is None).

    Raises ``ValueError`` for an unknown kind.
    """
    if kinds is not None:
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown site kind(s) {unknown}: expected some of {list(KINDS)}")
    chosen = []
    for site in sites:
        if patterns and not any(fnmatch.fnmatchcase(site.name, p) for p in patterns):
            continue
        if kinds is not None and site.kind not in kinds:
            continue
        if layers is not None and (site.layer is None or site.layer not in layers):
            continue
        chosen.append(site)
    return chosen


def parse_range(text: str | None) -> range | None:
    """``"3"`` -> range(3, 4); ``"2:5"`` -> range(2, 5); ``"2:"`` -> open-ended; None -> None."""
    if text is None or text == "":
        return None
    try:
        if ":" in text:
            lo, hi = text.split(":", 1)
            return range(int(lo or 0), int(hi) if hi else 1 << 30)
        n = int(text)
        return range(n, n + 1)
    except ValueError:
        raise ValueError(f"expected a range like '3', '2:5' or '2:', but got {text!r}") from None
