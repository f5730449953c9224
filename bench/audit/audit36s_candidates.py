"""Audit 36s (2026-12-05i): candidate paths that install a clear DEFECT by assigning a shared name (class method,
torch / torch.nn.functional / torch.Tensor, modeling-module function, attention registry) or per instance, to check
ulptrace.sides: the reference side must not run the candidate's kernel.
Run: `PYTHONPATH=bench/audit ulptrace lockstep --candidate audit36s_candidates:NAME` (and matrix / onset).

Each function patches an HF model in place and returns an undo callable that restores every original exactly.
"Decode" = a one-token input (seq dim 1).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

_MISSING = object()


def _set(owner, name, value):
    """Assign ``owner.name = value``; returns an undo putting back what was there (an added entry deleted)."""
    old = vars(owner).get(name, _MISSING)
    setattr(owner, name, value)

    def undo():
        if old is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, old)
    return undo


def _family_module(model):
    """The modeling module of the model's decoder layer class (qwen3_5 or llama)."""
    return sys.modules[type(model.model.layers[0]).__module__]


def _norm_class(model):
    return type(model.model.norm)


# ---------------------------------------------------------------- (a) a method replaced on the CLASS

def a_norm_forward_scaled(model):
    """(a) RMSNorm CLASS forward replaced (LlamaRMSNorm / Qwen3_5RMSNorm, whatever the model's final-norm class is):
    output x1.25 at every step. Expected onset: layers.0.input_layernorm, step 0 (prefill)."""
    cls = _norm_class(model)
    orig = cls.forward

    def forward(self, x):
        return orig(self, x) * 1.25
    return _set(cls, "forward", forward)


def a_norm_helper_decode(model):
    """(a) Qwen3_5RMSNorm._norm (a helper method its forward calls through self) / LlamaRMSNorm.forward replaced on
    the CLASS: variance x4 (output halved) at decode only. Expected onset: layers.0.input_layernorm, step 1."""
    cls = _norm_class(model)
    if "_norm" in vars(cls):
        def _norm(self, x):
            scale = 4.0 if x.shape[-2] == 1 else 1.0
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) * scale + self.eps)
        return _set(cls, "_norm", _norm)
    orig = cls.forward

    def forward(self, x):
        out = orig(self, x)
        return out * 0.5 if x.shape[-2] == 1 else out
    return _set(cls, "forward", forward)


# ---------------------------------------------------------------- (b) torch.nn.functional replaced globally

def b_silu_decode(model):
    """(b) F.silu replaced globally: x1.5 for 3-D one-token inputs [B, 1, I] (the MLP's gate at decode) only.
    Expected onset: layers.0.mlp.glu, step 1."""
    orig = F.silu

    def silu(x, inplace=False):
        out = orig(x, inplace=inplace)
        return out * 1.5 if x.dim() == 3 and x.shape[1] == 1 else out
    return _set(F, "silu", silu)


def b_sdpa_decode(model):
    """(b) F.scaled_dot_product_attention replaced globally: output x0.5 for a one-token query only.
    Expected onset: the first full-attention core at step 1 (llama layers.0.self_attn.core, qwen layers.1)."""
    orig = F.scaled_dot_product_attention

    def sdpa(query, key, value, *args, **kwargs):
        out = orig(query, key, value, *args, **kwargs)
        return out * 0.5 if query.shape[-2] == 1 else out
    return _set(F, "scaled_dot_product_attention", sdpa)


# ---------------------------------------------------------------- (c) a modeling-module function replaced

def c_apply_rope_decode(model):
    """(c) modeling module's apply_rotary_pos_emb replaced: sin negated (rotation the wrong way) for a one-token query.
    Expected onset: the first q_rope at step 1 (llama layers.0.self_attn.q_rope, qwen layers.1)."""
    mod = _family_module(model)
    orig = mod.apply_rotary_pos_emb

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if q.shape[-2] == 1:
            sin = -sin
        return orig(q, k, cos, sin, *args, **kwargs)
    return _set(mod, "apply_rotary_pos_emb", apply_rotary_pos_emb)


def c_rotate_half_wrong(model):
    """(c) modeling module's rotate_half replaced (a helper apply_rotary_pos_emb calls through its globals):
    halves swapped without the sign flip, at every step. Expected onset: the first q_rope, step 0."""
    mod = _family_module(model)

    def rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2:]
        return torch.cat((x2, x1), dim=-1)
    return _set(mod, "rotate_half", rotate_half)


def c_qwen_chunk_gdn_scaled(model):
    """(c) qwen3_5 torch_chunk_gated_delta_rule replaced (the prefill's GatedDeltaNet kernel): output x1.1 and state
    x1.1. Expected onset: layers.0.linear_attn.core (or its recurrent_state), step 0."""
    mod = _family_module(model)
    orig = mod.torch_chunk_gated_delta_rule

    def chunk(*args, **kwargs):
        out, state = orig(*args, **kwargs)
        return out * 1.1, (state * 1.1 if state is not None else None)
    return _set(mod, "torch_chunk_gated_delta_rule", chunk)


def c_qwen_l2norm_decode(model):
    """(c) qwen3_5 l2norm replaced (called by both delta-rule kernels through their module's globals): the norm
    doubled (result halved) when the sequence is one token ([B, 1, H, D] as the recurrent rule gets it, or
    [B, H, 1, D]). Expected onset: layers.0.linear_attn.core, step 1."""
    mod = _family_module(model)
    orig = mod.l2norm

    def l2norm(x, dim=-1, eps=1e-6):
        out = orig(x, dim=dim, eps=eps)
        return out * 0.5 if (x.shape[1] == 1 or x.shape[2] == 1) else out
    return _set(mod, "l2norm", l2norm)


# ---------------------------------------------------------------- (d) the attention registry

def _sdpa_entry_decode_scaled(orig):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        out, weights = orig(module, query, key, value, attention_mask, *args, **kwargs)
        return (out * 0.5 if query.shape[-2] == 1 else out), weights
    return attention


def d_register_sdpa_decode(model):
    """(d) AttentionInterface.register("sdpa", fn) (the class-level global mapping): output x0.5 for a one-token query.
    Undo: register the original back. Expected onset: the first self_attn.core at step 1."""
    from transformers.modeling_utils import AttentionInterface
    orig = AttentionInterface._global_mapping["sdpa"]
    AttentionInterface.register("sdpa", _sdpa_entry_decode_scaled(orig))
    return lambda: AttentionInterface.register("sdpa", orig)


def d_setitem_sdpa_decode(model):
    """(d) ALL_ATTENTION_FUNCTIONS["sdpa"] = fn (the instance's local mapping): output x0.5 for a one-token query.
    Undo: the local entry put back as it was (deleted where there was none). Expected onset: as d_register."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as reg
    had = "sdpa" in reg._local_mapping
    old_local = reg._local_mapping.get("sdpa")
    reg["sdpa"] = _sdpa_entry_decode_scaled(reg["sdpa"])

    def undo():
        if had:
            reg._local_mapping["sdpa"] = old_local
        else:
            reg._local_mapping.pop("sdpa", None)
    return undo


# ---------------------------------------------------------------- (e) a torch.Tensor method

def e_tensor_pow_decode(model):
    """(e) torch.Tensor.pow replaced (RMSNorm's x.pow(2) in both families; an entry ADDED to torch.Tensor's dict, the
    method living on torch._C.TensorBase): x4 for a one-token [.., 1, D] float32 input with exponent 2 only.
    Expected onset: layers.0.input_layernorm, step 1."""
    orig = torch.Tensor.pow

    def pow(self, exponent, *args, **kwargs):
        out = orig(self, exponent, *args, **kwargs)
        if exponent == 2 and self.dim() == 3 and self.shape[1] == 1 and self.dtype == torch.float32:
            return out * 4.0
        return out
    return _set(torch.Tensor, "pow", pow)


def e_torch_rsqrt_decode(model):
    """(e') torch.rsqrt replaced (a torch-module function RMSNorm calls): x0.5 for a [B, 1, 1] input (the norm's
    variance at decode). Expected onset: layers.0.input_layernorm, step 1."""
    orig = torch.rsqrt

    def rsqrt(x, *args, **kwargs):
        out = orig(x, *args, **kwargs)
        return out * 0.5 if x.dim() == 3 and x.shape[1] == 1 and x.shape[2] == 1 else out
    return _set(torch, "rsqrt", rsqrt)


# ---------------------------------------------------------------- (f) per instance: a module's class swapped

def f_final_norm_class_swap(model):
    """(f) model.model.norm.__class__ swapped to a subclass whose forward scales x1.25 (per instance).
    Expected onset: norm, step 0."""
    norm = model.model.norm
    base = type(norm)

    class BadNorm(base):
        def forward(self, x):
            return base.forward(self, x) * 1.25
    norm.__class__ = BadNorm

    def undo():
        norm.__class__ = base
    return undo


# ---------------------------------------------------------------- (g) beyond the documented scope (probes)

def g_cache_layer_update_decode(model):
    """(g, beyond sides.py's documented names) transformers.cache_utils.DynamicLayer.update replaced on the CLASS (a
    cache class, not one of the model's modules): the new key/value x2 at decode before it is stored.
    Expected: attention core / k,v cache state differ at step 1 (llama layers.0, qwen layers.1)."""
    from transformers.cache_utils import DynamicLayer
    orig = DynamicLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[-2] == 1:
            key_states, value_states = key_states * 2, value_states * 2
        return orig(self, key_states, value_states, *args, **kwargs)
    return _set(DynamicLayer, "update", update)


def g_pack_gqa_decode(model):
    """(g) transformers.integrations.sdpa_attention.pack_gqa replaced (sdpa_attention_forward's decode-only GQA
    packing, a module one import away): the packed query x2. Expected onset: the first self_attn.core at step 1."""
    import transformers.integrations.sdpa_attention as sa
    orig = sa.pack_gqa

    def pack_gqa(t, n):
        out = orig(t, n)
        return out * 2 if out is not None and out.is_floating_point() and out.dim() == 4 and out.shape[-1] > 8 \
            and out.dtype != torch.bool else out
    return _set(sa, "pack_gqa", pack_gqa)


def e_torch_rsqrt_decode_traced(model):
    """e_torch_rsqrt_decode that also says (stderr, once per dtype) when it fires on a float64 input — i.e. inside the
    oracle's FP64 semantics. Diagnostic for the matrix's "tie" verdict."""
    import traceback
    orig = torch.rsqrt
    said = set()

    def rsqrt(x, *args, **kwargs):
        out = orig(x, *args, **kwargs)
        if x.dim() == 3 and x.shape[1] == 1 and x.shape[2] == 1:
            if x.dtype not in said:
                said.add(x.dtype)
                print(f"AUDIT36S rsqrt defect fired on {x.dtype}; stack:", file=sys.stderr)
                traceback.print_stack(limit=14, file=sys.stderr)
            return out * 0.5
        return out
    return _set(torch, "rsqrt", rsqrt)
