"""Audit 32 (2026-12-05): held-out candidate paths for ulptrace (defects d*, valid variants v*, x* = behaviour to
report). Run: `PYTHONPATH=bench/audit ulptrace onset --candidate audit32_candidates:NAME ...`.

Each function patches an HF model in place and returns an undo callable. Written from HF's modeling code
(transformers 5.25: qwen3_5/modeling_qwen3_5.py, llama/modeling_llama.py), not from ulptrace.kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from audit31_candidates import (BF16, _attn_layers, _layers, _mask_builder_patched, _mm, _register_attention,
                                _restore_attrs)


# --------------------------------------------------------------------------------------------- helpers

def _gdns(model):
    return [l.linear_attn for l in _layers(model) if hasattr(l, "linear_attn")]


def _wrap_forward(model, post):
    """model.forward wrapped: ``post(logits) -> logits`` applied to what the model returns."""
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = post(out.logits)
        return out

    model.forward = forward
    return _restore_attrs([(model, "forward")])


def _patch_module_fn(model, name, make):
    mm = _mm(model)
    original = getattr(mm, name)
    setattr(mm, name, make(original))

    def undo():
        setattr(mm, name, original)
    return undo


def _visible(mask):
    if mask.dtype == torch.bool:
        return mask
    return mask == 0


def _builders_encoding(mask, vis):
    """``vis`` (visible keys, bool) written in ``mask``'s own encoding: bool, or additive with the dtype's lowest."""
    if mask.dtype == torch.bool:
        return vis
    return torch.zeros(vis.shape, dtype=mask.dtype, device=mask.device).masked_fill(~vis, torch.finfo(mask.dtype).min)


def _mask_builder(model, edit, eager=None, encode=_builders_encoding):
    """create_causal_mask always materialised (no is_causal skip), then ``edit(visible_bool) -> visible_bool`` and
    written back by ``encode(mask, visible)`` (default: the builder's own encoding); ``eager``: also switch the model
    to HF's eager attention."""
    def make(original):
        def create(*args, **kwargs):
            kwargs["allow_is_causal_skip"] = False
            mask = original(*args, **kwargs)
            return encode(mask, edit(_visible(mask).clone()))
        return create

    return _mask_builder_patched(model, make, bool(eager))


# ============================================================================================ 1. output site

def _head_fp32(model, returned):
    """The LM head as an FP32 GEMM (FP32 operands and accumulation), its result converted by ``returned``."""
    head = model.get_output_embeddings()

    def forward(x, head=head):
        return returned(F.linear(x.float(), head.weight.float()), x.dtype)

    head.forward = forward
    return _restore_attrs([(head, "forward")])


def v40_head_fp32_accum(model):
    """VALID: the LM head as an FP32 GEMM (FP32 operands/accumulation) rounded once to BF16. Expected: parity
    (ties at logits/output)."""
    return _head_fp32(model, lambda y, dtype: y.to(dtype))


def v41_logits_clone(model):
    """VALID: the wrapper returns a contiguous clone of the logits. Expected: parity."""
    return _wrap_forward(model, lambda l: l.clone())


def x42_logits_last_only(model):
    """VALID (behaviour to report): the wrapper returns only the last position's logits (what generation uses).
    Expected: parity, or a clearly reported shape mismatch at `output` step 0 — never an `error` verdict."""
    return _wrap_forward(model, lambda l: l[:, -1:].contiguous())


def v43_logits_fp32_returned(model):
    """VALID, deliberate boundary: the head computed in FP32 and returned in FP32 (the BF16 rounding of the logits
    skipped). Expected: boundary at logits/output naming the skipped rounding (or ties), no error."""
    return _head_fp32(model, lambda y, dtype: y)


def d40_logits_softcap(model):
    """DEFECT: the wrapper soft-caps the logits (tanh(y/c)*c, c=5, Gemma-2 style) in a model with no soft cap.
    Expected: error at `output`, step 0."""
    return _wrap_forward(model, lambda l: (torch.tanh(l.float() / 5.0) * 5.0).to(l.dtype))


def d41_logits_rows_swapped_decode(model):
    """DEFECT: at decode the wrapper returns batch rows 0 and 1 of the logits swapped (a gather-index bug).
    Expected: error at `output`, step 1."""
    def post(l):
        if l.shape[1] == 1 and l.shape[0] > 1:
            return torch.cat([l[1:2], l[0:1], l[2:]], dim=0)
        return l
    return _wrap_forward(model, post)


def d42_logits_minus_max(model):
    """DEFECT (argmax-preserving): the wrapper returns logits - rowmax (log-softmax-shift; softmax and argmax
    unchanged, the returned function is not). Expected: error at `output`, step 0."""
    return _wrap_forward(model, lambda l: l - l.amax(-1, keepdim=True))


def d43_logits_temperature_near_one(model):
    """DEFECT (argmax-preserving, tiny): the wrapper multiplies logits by 1.01 in FP32 then rounds (a stale
    temperature). Expected: error at `output` step 0."""
    return _wrap_forward(model, lambda l: (l.float() * 1.01).to(l.dtype))


# ============================================================================================ 2. masks

def v44_mask_fp32_neginf_eager(model):
    """VALID: model on HF's eager attention, fed a float32 additive mask with -inf (HF: BF16 with finfo.min).
    Expected: parity against --reference hf:attn=eager and (other encodings/None) against sdpa."""
    def fp32_neginf(mask, vis):
        return torch.zeros(vis.shape, dtype=torch.float32, device=vis.device).masked_fill(~vis, float("-inf"))
    return _mask_builder(model, lambda v: v, eager=True, encode=fp32_neginf)


def v45_mask_broadcast_batch1(model):
    """VALID: the mask materialised as [1,1,q,k] (broadcast over the batch) instead of [b,1,q,k].
    Expected: parity (default sdpa reference; and vs eager reference the mask differs only in encoding/shape)."""
    return _mask_builder(model, lambda v: v[:1])


def _hide_first_key(v):
    """Key 0 (the first token / attention sink) hidden from every query but the first."""
    if v.shape[-2] > 1:
        v[..., 1:, 0] = False
    else:
        v[..., 0] = False
    return v


def d44_mask_hide_first_token(model):
    """DEFECT: the mask hides key 0 (the first token / attention sink) from every query but the first.
    Expected: error/unobserved at layer 0's first full-attention core, step 0."""
    return _mask_builder(model, _hide_first_key)


def d44e_mask_hide_first_token_eager(model):
    """DEFECT: as d44 with the model on eager attention (run vs --reference hf:attn=eager)."""
    return _mask_builder(model, _hide_first_key, eager=True)


def d45_mask_decode_hides_self(model):
    """DEFECT: at decode only, the mask hides the newest key (the token's own position: j < i instead of j <= i).
    Expected: error at the first attention core, step 1."""
    def edit(v):
        if v.shape[-2] == 1:
            v[..., -1] = False
        return v
    return _mask_builder(model, edit)


def d46_padding_mask_row1_first(model):
    """DEFECT: the serving layer passes a padding mask that marks row 1's first token as padding (it is not).
    Expected: not at parity, onset at step 0 in the first layer that uses the mask."""

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is not None and ids.shape[0] > 1:
            cache = kwargs.get("cache") or kwargs.get("past_key_values")
            past = cache.get_seq_length() if cache is not None else 0
            m = torch.ones(ids.shape[0], past + ids.shape[1], dtype=torch.long, device=ids.device)
            m[1, 0] = 0
            kwargs["attention_mask"] = m
        return args, kwargs

    h = model.register_forward_pre_hook(hook, with_kwargs=True)
    return h.remove


# ============================================================================================ 3. dtypes handed on

def _o_proj_fp32_residual(model, scale=1.0):
    patched = []
    for layer in _attn_layers(model):
        lin = layer.self_attn.o_proj

        def lin_forward(x, lin=lin):
            y = F.linear(x.float(), lin.weight.float())
            return y * scale if scale != 1.0 else y

        def forward(hidden_states, *args, layer=layer, **kwargs):
            residual = hidden_states
            h = layer.input_layernorm(hidden_states)
            if "position_embeddings" not in kwargs and args:
                kwargs["position_embeddings"] = args[0]
            h, _ = layer.self_attn(hidden_states=h, attention_mask=kwargs.get("attention_mask"),
                                   position_embeddings=kwargs.get("position_embeddings"),
                                   cache=kwargs.get("cache", kwargs.get("past_key_values")),
                                   position_ids=kwargs.get("position_ids"))
            h = (residual.float() + h.float()).to(residual.dtype)
            residual = h
            h = layer.post_attention_layernorm(h)
            h = layer.mlp(h)
            return residual + h

        lin.forward = lin_forward
        layer.forward = forward
        patched += [(lin, "forward"), (layer, "forward")]
    return _restore_attrs(patched)


def v46_o_proj_fp32_into_residual(model):
    """VALID, deliberate boundary: o_proj's FP32 GEMM result goes into the residual add in FP32, rounded once.
    Expected: boundary (o_proj's BF16 rounding skipped) at o_proj/residual_attn, no error."""
    return _o_proj_fp32_residual(model)


def d47_o_proj_fp32_scaled(model):
    """DEFECT hidden behind the FP32 hand-off: as v46 but the FP32 o_proj result is scaled by 1.01 (a folded
    dequant scale off by 1%). Expected: error at o_proj (or residual_attn) of the first attention layer, step 0."""
    return _o_proj_fp32_residual(model, scale=1.01)


def _glu_fp32(model, up_scale=1.0):
    patched = []
    for layer in _layers(model):
        mlp = layer.mlp
        for lin in (mlp.gate_proj, mlp.up_proj):
            s = up_scale if lin is mlp.up_proj else 1.0

            def lin_forward(x, lin=lin, s=s):
                y = F.linear(x.float(), lin.weight.float())
                return y * s if s != 1.0 else y
            lin.forward = lin_forward
            patched.append((lin, "forward"))

        def forward(x, mlp=mlp):
            g, u = mlp.gate_proj(x), mlp.up_proj(x)
            return mlp.down_proj((F.silu(g) * u).to(x.dtype))

        mlp.forward = forward
        patched.append((mlp, "forward"))
    return _restore_attrs(patched)


def v47_gate_up_fp32_glu(model):
    """VALID, deliberate boundary: gate/up projections kept in FP32 into an FP32 GLU (silu(g)*u), rounded once to
    BF16 before down_proj. Expected: boundary at glu (gate/up/silu roundings skipped), no error."""
    return _glu_fp32(model)


def d48_up_fp32_scaled(model):
    """DEFECT hidden behind the FP32 hand-off: as v47 but up_proj's FP32 result is scaled by 1.008 (~1 BF16 ULP).
    Expected: error at up_proj/glu of layer 0, step 0."""
    return _glu_fp32(model, up_scale=1.008)


# ============================================================================================ 4. GatedDeltaNet

def d49_conv_state_stale_decode(model):
    """DEFECT (Qwen3.5): the decode conv kernel computes its output right but writes the conv state back shifted
    by one slot too few (keeps the oldest column, drops the newest). Expected: error at conv_state, step 1."""
    def make(original):
        def update(hidden_states, conv_state, weight, bias=None, activation=None):
            state_len = conv_state.shape[-1]
            new = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
            out = F.conv1d(new, weight.unsqueeze(1), bias, padding=0, groups=hidden_states.shape[1])
            out = out[:, :, -hidden_states.shape[-1]:]
            if activation is not None:
                out = F.silu(out)
            conv_state.copy_(new[:, :, -state_len - 1:-1])
            return out.to(hidden_states.dtype)
        return update
    return _patch_module_fn(model, "causal_conv1d_update", make)


def d50_beta_decode_one_minus(model):
    """DEFECT (Qwen3.5): the decode delta-rule kernel uses 1 - beta (sigmoid(-b)) for the write strength.
    Expected: error at linear_attn.core (or gates.beta), step 1."""
    def make(original):
        def rec(query, key, value, g, beta, *a, **kw):
            return original(query, key, value, g, 1 - beta, *a, **kw)
        return rec
    return _patch_module_fn(model, "torch_recurrent_gated_delta_rule", make)


def d50b_beta_decode_x1_03(model):
    """DEFECT (Qwen3.5, small): the decode kernel uses beta * 1.03 (FP32). Expected: error, step 1."""
    def make(original):
        def rec(query, key, value, g, beta, *a, **kw):
            return original(query, key, value, g, (beta.float() * 1.03), *a, **kw)
        return rec
    return _patch_module_fn(model, "torch_recurrent_gated_delta_rule", make)


def _state_to_cache(model, change, *names):
    """The scans named (``torch_chunk_gated_delta_rule``: prefill; ``torch_recurrent_gated_delta_rule``: decode) hand
    the cache ``change(state)`` instead of their state; their output unchanged."""
    def wrap(original):
        def fn(*a, **kw):
            out, state = original(*a, **kw)
            return out, (None if state is None else change(state))
        return fn
    undos = [_patch_module_fn(model, name, wrap) for name in names]
    return lambda: [undo() for undo in reversed(undos)]


def d51_state_to_cache_scaled(model):
    """DEFECT (Qwen3.5): the prefill scan's output is right but the recurrent state it hands the cache is scaled
    by 0.999. Expected: error at recurrent_state, step 0."""
    return _state_to_cache(model, lambda state: state * 0.999, "torch_chunk_gated_delta_rule")


def d51b_state_to_cache_scaled_decode(model):
    """DEFECT (Qwen3.5): the decode kernel's output is right, its state handed to the cache is scaled by 0.999.
    Expected: error at recurrent_state, step 1."""
    return _state_to_cache(model, lambda state: state * 0.999, "torch_recurrent_gated_delta_rule")


def v52_state_cache_bf16(model):
    """VALID, deliberate boundary (Qwen3.5): both scans hand the cache their state rounded to BF16 (read back as
    FP32 by the next step). Expected: boundary at recurrent_state naming the BF16 state, no error."""
    return _state_to_cache(model, lambda state: state.to(BF16), "torch_chunk_gated_delta_rule",
                           "torch_recurrent_gated_delta_rule")


def _chunk_size(n):
    def patch(model):
        def make(original):
            def chunk(*a, **kw):
                kw["chunk_size"] = n
                return original(*a, **kw)
            return chunk
        return _patch_module_fn(model, "torch_chunk_gated_delta_rule", make)
    patch.__doc__ = (f"VALID (Qwen3.5): the chunked delta-rule scan with chunk_size={n} (HF: 64). "
                     "Expected: parity (ties within the GDN bound).")
    return patch


v53_chunk_size_8 = _chunk_size(8)
v53b_chunk_size_16 = _chunk_size(16)


def v54_l2norm_fla_form(model):
    """VALID (Qwen3.5): the q/k L2 norm in FLA's form x / sqrt(sum(x*x) + eps) (HF: x * rsqrt(...)), FP32.
    Expected: parity (ties)."""
    def make(original):
        def l2(x, dim=-1, eps=1e-6):
            return x / torch.sqrt((x * x).sum(dim=dim, keepdim=True) + eps)
        return l2
    return _patch_module_fn(model, "l2norm", make)


def d55_gdn_key_heads_tiled(model):
    """DEFECT (Qwen3.5): the delta-rule kernel maps value heads to key heads by tiling (h % n_k) instead of
    HF's consecutive grouping (h // (n_v/n_k)). Expected: error at linear_attn.core, step 0."""
    def wrap(original):
        def fn(query, key, value, *a, **kw):
            nk, nv = key.shape[2], value.shape[2]
            if nk != nv:
                r = nv // nk
                query = query.repeat(1, 1, r, 1)
                key = key.repeat(1, 1, r, 1)
            return original(query, key, value, *a, **kw)
        return fn
    u1 = _patch_module_fn(model, "torch_chunk_gated_delta_rule", wrap)
    u2 = _patch_module_fn(model, "torch_recurrent_gated_delta_rule", wrap)
    return lambda: (u2(), u1())


def d56_conv_weight_flipped(model):
    """DEFECT (Qwen3.5): the prefill causal conv applies its taps in reverse order (convolution vs
    cross-correlation). Expected: error at linear_attn.conv, step 0."""
    def make(original):
        def fn(hidden_states, weight, bias=None, activation=None, **kw):
            return original(hidden_states, weight.flip(-1), bias, activation=activation, **kw)
        return fn
    return _patch_module_fn(model, "causal_conv1d_fn", make)


# ============================================================================================ 5. other kernel slips

def d57_gqa_kv_heads_tiled(model):
    """DEFECT: the attention kernel maps query heads to KV heads by tiling (h % n_kv) instead of HF's
    repeat_interleave (h // groups). Expected: error at the first self_attn.core, step 0."""
    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        n = query.shape[1] // key.shape[1]
        k, v = key.repeat(1, n, 1, 1), value.repeat(1, n, 1, 1)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=None if attention_mask is None else attention_mask,
                                             is_causal=attention_mask is None and query.shape[2] > 1, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    return _register_attention(model, "audit32_gqa_tiled", attn)


def d58_rope_interleaved(model):
    """DEFECT: the RoPE kernel rotates interleaved pairs (GPT-J, (x0,x1),(x2,x3)...) instead of HF's rotate_half
    (NeoX) pairing. Expected: error at self_attn.q_rope, step 0."""
    def make(original):
        def rotate_half(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((-x2, x1), dim=-1).flatten(-2)
        return rotate_half
    return _patch_module_fn(model, "rotate_half", make)


def v59_attention_fp32_eager(model):
    """VALID: an attention kernel in FP32 throughout (scores, softmax, PV), output rounded once to BF16, the
    causal mask applied by index. Expected: parity (ties) or a named boundary at self_attn.core, no error."""
    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        n = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(n, dim=1), value.repeat_interleave(n, dim=1)
        q_len, kv_len = query.shape[2], k.shape[2]
        s = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scaling
        i = torch.arange(q_len)[:, None] + (kv_len - q_len)
        j = torch.arange(kv_len)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
        out = torch.matmul(torch.softmax(s, -1), v.float()).to(query.dtype)
        return out.transpose(1, 2).contiguous(), None
    return _register_attention(model, "audit32_fp32", attn)
