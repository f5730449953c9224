"""The pieces injection puts into an HF model: replacement norm modules and patched forwards.

Everything here keeps HF's names and call structure (the recorder observes modules by their HF
names with hooks, and reads the GLU from ``down_proj``'s input):

- :class:`KernelRMSNorm` / :class:`KernelGatedRMSNorm` replace norm modules at the same attribute
  path, share the original ``weight`` Parameter (so ``state_dict`` keys and values are unchanged)
  and take the same arguments. ``KernelRMSNorm`` also takes ``residual=`` and then returns
  ``(normed, new_residual)``.
- :func:`layer_forward` is the decoder layer's forward written for the residual-add fusion: it
  calls ``input_layernorm``, the token mixer (``self_attn`` or ``linear_attn``), the post-attention
  norm as ``normed, residual = post_attention_layernorm(attn_out, residual=residual)``, and ``mlp``,
  all as modules.
- :func:`mlp_forward` computes ``down_proj(glu(gate_proj(x), up_proj(x)))`` calling the three
  Linear modules as modules.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from ulptrace.families import DECODER_LAYERS, is_gated_deltanet
from ulptrace.kernels.gated_rms_norm import gated_rms_norm
from ulptrace.kernels.glu import glu
from ulptrace.kernels.rms_norm import add_rms_norm

# decoder layer class -> how its token mixer is called ("hybrid": Qwen3.5's linear/full attention): the core's
# one table of HF classes (ulptrace.families)
LAYER_FAMILIES: dict[str, str] = DECODER_LAYERS
SILU_ACTIVATIONS = ("SiLUActivation", "SiLU")


def norm_eps(module: nn.Module) -> float:
    """The epsilon of an HF RMSNorm module (``eps`` or ``variance_epsilon``)."""
    for name in ("eps", "variance_epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise ValueError(f"{type(module).__name__} has neither an 'eps' nor a 'variance_epsilon' float attribute")


class KernelRMSNorm(nn.Module):
    """Stands in for an HF RMSNorm; ``forward(x, residual=None)``.

    Without ``residual`` it returns the normed tensor like HF's module; with ``residual`` it
    returns ``(normed, residual + x)`` computed by the fused add + norm.
    """

    def __init__(self, original: nn.Module, variant: str, mode: str, backend: str) -> None:
        super().__init__()
        self.weight = original.weight  # the same Parameter: no copy, no stale cache
        self.eps = norm_eps(original)
        self.variance_epsilon = self.eps
        self.variant = variant
        self.mode = mode
        self.backend = backend
        self.replaces = type(original).__name__

    def forward(self, hidden_states: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(hidden_states, self.weight, self.eps, residual, variant=self.variant, mode=self.mode,
                            backend=self.backend)

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, eps={self.eps}, variant={self.variant}, mode={self.mode}, "
                f"backend={self.backend}, replaces={self.replaces}")


class KernelGatedRMSNorm(nn.Module):
    """Stands in for ``Qwen3_5RMSNormGated``; ``forward(hidden_states, gate)``."""

    def __init__(self, original: nn.Module, mode: str, backend: str) -> None:
        super().__init__()
        self.weight = original.weight
        self.variance_epsilon = norm_eps(original)
        self.eps = self.variance_epsilon
        self.mode = mode
        self.backend = backend
        self.replaces = type(original).__name__

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(hidden_states, gate, self.weight, self.eps, mode=self.mode, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, mode={self.mode}, backend={self.backend}"


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def _named_arguments(layer: nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The class forward's arguments after ``hidden_states`` by name, defaults applied, ``**kwargs`` flattened."""
    bound = _signature(type(layer)).bind(layer, hidden_states, *args, **kwargs)
    bound.apply_defaults()
    named: dict[str, Any] = {}
    for i, (name, value) in enumerate(bound.arguments.items()):
        if i < 2:  # self, hidden_states
            continue
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(f"{type(layer).__name__}.forward got unexpected positional arguments {value!r}")
        else:
            named[name] = value
    return named


def _mix(layer: nn.Module, family: str, h: torch.Tensor, named: dict[str, Any]) -> torch.Tensor:
    """Call the layer's token mixer as HF's layer does (by keyword, same values)."""
    if family == "hybrid" and is_gated_deltanet(getattr(layer, "linear_attn", None)):
        from ulptrace.run import CACHE_KWARGS, cache_kwarg  # the one home of the cache argument's name

        named = dict(named)
        named.pop("position_embeddings", None)
        named.pop("position_ids", None)
        # the layer's cache arrives under this transformers version's name; hand it to the GatedDeltaNet
        # module under *its* name only (passing the deprecated name beside the new one warns)
        given = [named.pop(k) for k in CACHE_KWARGS if k in named]
        cache = next((c for c in given if c is not None), None)
        mask = named.pop("attention_mask", None)
        return layer.linear_attn(hidden_states=h, attention_mask=mask, **{cache_kwarg(layer.linear_attn): cache},
                                 **named)
    out = layer.self_attn(hidden_states=h, **named)
    return out[0] if isinstance(out, tuple) else out


def layer_forward(family: str) -> Callable[..., torch.Tensor]:
    """A decoder layer forward for ``family`` that fuses the post-attention residual add into the norm."""

    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        named = _named_arguments(self, hidden_states, args, kwargs)
        residual = hidden_states
        h = self.input_layernorm(hidden_states)
        h = _mix(self, family, h, named)
        h, residual = self.post_attention_layernorm(h, residual=residual)
        h = self.mlp(h)
        return residual + h

    return forward


def mlp_forward(mode: str, backend: str) -> Callable[..., torch.Tensor]:
    """An MLP forward computing ``down_proj(glu(gate_proj(x), up_proj(x)))`` with the GLU kernel."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), mode=mode, backend=backend))

    return forward
