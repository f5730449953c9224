"""Audit 31 (2026-12-05): new candidate paths for ulptrace (defects d*, valid variants v*) — the findings are in issue 11's note of that session (two MISSes: logits changed after lm_head; masks stored otherwise on the two sides). Run: `PYTHONPATH=bench/audit ulptrace onset --candidate audit31_candidates:NAME ...`.

Each function patches an HF model in place and returns an undo callable. Written from HF's modeling code
(transformers 5.25: qwen3_5/modeling_qwen3_5.py, llama/modeling_llama.py), not from ulptrace.kernels.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16


# --------------------------------------------------------------------------------------------- helpers

def _mm(model):
    """The model's modeling module (qwen3_5 or llama)."""
    return sys.modules[type(model).__module__]


def _is_qwen(model) -> bool:
    return "qwen3_5" in type(model).__module__


def _layers(model):
    return list(model.model.layers)


def _attn_layers(model):
    return [l for l in _layers(model) if hasattr(l, "self_attn")]


def _restore_attrs(items):
    """items: list of (obj, attr); returns an undo that deletes instance attributes set on them."""
    def undo():
        for obj, attr in items:
            try:
                delattr(obj, attr)
            except AttributeError:
                pass
    return undo


def _register_attention(model, name, fn):
    """Register ``fn`` as an attention implementation (HF's AttentionInterface) and switch the model to it."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    old = model.config._attn_implementation
    model.config._attn_implementation = name

    def undo():
        model.config._attn_implementation = old
    return undo


def _gqa(module, k, v):
    n = getattr(module, "num_key_value_groups", 1)
    if n > 1:
        k = k.repeat_interleave(n, dim=1)
        v = v.repeat_interleave(n, dim=1)
    return k, v


def _sdpa(module, q, k, v, mask, scaling, **kw):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, **kw)


# ============================================================================================ DEFECTS

def d01_mask_peek_next_prefill(model):
    """DEFECT: the prefill attention kernel's causal mask is off by one: query i also sees key i+1
    (``j <= i + 1``); decode (one query) is HF's sdpa."""

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        q_len, kv_len = query.shape[2], key.shape[2]
        if q_len == 1:
            return _sdpa(module, query, key, value, attention_mask, scaling, dropout=dropout, **kw)
        k, v = _gqa(module, key, value)
        i = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
        j = torch.arange(kv_len, device=query.device)[None, :]
        allowed = j <= i + 1
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return _register_attention(model, "audit_peek", attn)


def d02_softmax_wrong_axis_head0(model):
    """DEFECT: an FP32 eager attention whose softmax for head 0 runs over the query axis (dim -2) instead of
    the key axis; every other head is an honest FP32 softmax."""

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        k, v = _gqa(module, key, value)
        q_len, kv_len = query.shape[2], k.shape[2]
        s = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scaling
        i = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
        j = torch.arange(kv_len, device=query.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
        p = torch.softmax(s, dim=-1)
        p0 = torch.softmax(s[:, :1], dim=-2)
        p = torch.cat([p0, p[:, 1:]], dim=1)
        out = torch.matmul(p, v.float()).to(query.dtype)
        return out.transpose(1, 2).contiguous(), None

    return _register_attention(model, "audit_wrong_axis", attn)


def d03_norm_weight_convention(model):
    """DEFECT: one RMSNorm uses the other family's weight convention: in Qwen3.5 layer 2's input norm scales by
    ``w`` instead of ``(1 + w)``; in Llama layer 1's input norm scales by ``(1 + w)`` instead of ``w``."""
    if _is_qwen(model):
        norm = model.model.layers[2].input_layernorm

        def forward(x, norm=norm):
            xf = x.float()
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
            return (out * norm.weight.float()).to(x.dtype)
    else:
        norm = model.model.layers[1].input_layernorm

        def forward(x, norm=norm):
            xf = x.float()
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            return (1.0 + norm.weight) * out.to(x.dtype)
    norm.forward = forward
    return _restore_attrs([(norm, "forward")])


def d04_embed_scaled_sqrt_d(model):
    """DEFECT: the embedding kernel multiplies by sqrt(hidden) (Gemma's normaliser) in a model without one."""
    emb = model.get_input_embeddings()
    scale = torch.tensor(math.sqrt(model.config.hidden_size), dtype=BF16)

    def forward(ids, emb=emb):
        return F.embedding(ids, emb.weight) * scale

    emb.forward = forward
    return _restore_attrs([(emb, "forward")])


def d05_lm_head_uses_embedding(model):
    """DEFECT: the LM-head kernel reads the input-embedding matrix (assumes tied weights; this model is untied)."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()

    def forward(x, emb=emb):
        return F.linear(x, emb.weight)

    head.forward = forward
    return _restore_attrs([(head, "forward")])


def d06_decode_rope_pos0(model):
    """DEFECT: the decode step builds its rotary tables for position 0 (position ids not advanced)."""
    rot = model.model.rotary_emb
    original = rot.forward

    def forward(x, position_ids, *a, **kw):
        if position_ids.shape[-1] == 1:
            position_ids = torch.zeros_like(position_ids)
        return original(x, position_ids, *a, **kw)

    rot.forward = forward
    return _restore_attrs([(rot, "forward")])


def d07_hard_sigmoid_attn_gate(model):
    """DEFECT (Qwen3.5): the gated attention output uses hard-sigmoid instead of sigmoid for its gate."""
    mm = _mm(model)
    patched = []
    for layer in _attn_layers(model):
        attn = layer.self_attn

        def forward(hidden_states, position_embeddings, attention_mask, cache=None, attn=attn, **kwargs):
            cache = cache if cache is not None else kwargs.pop("past_key_values", None)
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, attn.head_dim)
            q, gate = torch.chunk(attn.q_proj(hidden_states).view(*input_shape, -1, attn.head_dim * 2), 2, dim=-1)
            gate = gate.reshape(*input_shape, -1)
            q = attn.q_norm(q.view(hidden_shape)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            v = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            cos, sin = position_embeddings
            q, k = mm.apply_rotary_pos_emb(q, k, cos, sin)
            if cache is not None:
                k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
            fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, mm.eager_attention_forward)
            out, w = fn(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
            out = out.reshape(*input_shape, -1).contiguous()
            out = out * F.hardsigmoid(gate)
            return attn.o_proj(out), w

        attn.forward = forward
        patched.append((attn, "forward"))
    return _restore_attrs(patched)


def _gdn_forward(gdn, mq, beta_fn=None, g_fn=None):
    """A copy of HF's Qwen3_5GatedDeltaNet.forward (no intermediate states), with a replaceable beta."""

    def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
        cache = cache if cache is not None else kwargs.pop("cache_params", None)
        hidden_states = mq.apply_mask_to_padding_states(hidden_states, attention_mask)
        batch_size, seq_len, _ = hidden_states.shape
        recurrent_state = cache.get_recurrent_state(gdn.layer_idx, state_idx=0) if cache is not None else None
        mixed_qkv = gdn.in_proj_qkv(hidden_states).transpose(1, 2)
        z = gdn.in_proj_z(hidden_states).reshape(batch_size, seq_len, -1, gdn.head_v_dim)
        b = gdn.in_proj_b(hidden_states)
        a = gdn.in_proj_a(hidden_states)
        mixed_qkv = mq.causal_conv1d_forward(gdn.conv1d, mixed_qkv, cache, gdn.layer_idx,
                                             activation=gdn.activation, **kwargs)
        mixed_qkv = mixed_qkv.transpose(1, 2)
        query, key, value = torch.split(mixed_qkv, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        query = query.reshape(batch_size, seq_len, -1, gdn.head_k_dim)
        key = key.reshape(batch_size, seq_len, -1, gdn.head_k_dim)
        value = value.reshape(batch_size, seq_len, -1, gdn.head_v_dim)
        beta = beta_fn(b) if beta_fn is not None else b.sigmoid()
        g = g_fn(a) if g_fn is not None else -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)
        if recurrent_state is not None and seq_len == 1:
            core, last = mq.torch_recurrent_gated_delta_rule(query, key, value, g=g, beta=beta,
                                                             initial_state=recurrent_state,
                                                             output_final_state=cache is not None,
                                                             use_qk_l2norm_in_kernel=True)
        else:
            core, last = mq.torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta,
                                                         initial_state=recurrent_state,
                                                         output_final_state=cache is not None,
                                                         use_qk_l2norm_in_kernel=True)
        if cache is not None:
            cache.update_recurrent_state(last, gdn.layer_idx)
        core = core.reshape(-1, gdn.head_v_dim)
        z = z.reshape(-1, gdn.head_v_dim)
        core = gdn.norm(core, z).reshape(batch_size, seq_len, -1)
        return gdn.out_proj(core)

    return forward


def d08_beta_softplus(model):
    """DEFECT (Qwen3.5): the GatedDeltaNet write strength beta = softplus(b) instead of sigmoid(b)."""
    mq = _mm(model)
    patched = []
    for layer in _layers(model):
        gdn = getattr(layer, "linear_attn", None)
        if gdn is None:
            continue
        gdn.forward = _gdn_forward(gdn, mq, beta_fn=lambda b: F.softplus(b.float()).to(b.dtype))
        patched.append((gdn, "forward"))
    return _restore_attrs(patched)


def d09_gdn_decay_twice_decode(model):
    """DEFECT (Qwen3.5): the one-token (decode) delta-rule kernel applies the decay twice (exp(2g))."""
    mq = _mm(model)
    original = mq.torch_recurrent_gated_delta_rule

    def recurrent(query, key, value, g, beta, *a, **kw):
        return original(query, key, value, 2 * g, beta, *a, **kw)

    mq.torch_recurrent_gated_delta_rule = recurrent

    def undo():
        mq.torch_recurrent_gated_delta_rule = original
    return undo


def d10_value_cache_gets_keys(model):
    """DEFECT: the KV-cache write kernel stores the new *keys* in the value slots too (the current step's
    attention used the right values; later steps read keys as past values)."""
    handles = []
    for layer in _attn_layers(model):
        attn = layer.self_attn

        def hook(module, args, kwargs, out, attn=attn):
            cache = kwargs.get("cache") or kwargs.get("past_key_values")
            if cache is None:
                return
            entry = cache.layers[attn.layer_idx]
            n = kwargs["hidden_states"].shape[1] if "hidden_states" in kwargs else args[0].shape[1]
            entry.values[..., -n:, :] = entry.keys[..., -n:, :]

        handles.append(attn.register_forward_hook(hook, with_kwargs=True))
    return lambda: [h.remove() for h in handles]


def d11_down_proj_k_tail_dropped(model):
    """DEFECT: layer 0's down_proj GEMM drops its last K tile (32 of 384 input channels): a tail-handling bug."""
    lin = model.model.layers[0].mlp.down_proj
    kk = lin.in_features - 32

    def forward(x, lin=lin):
        return F.linear(x[..., :kk], lin.weight[:, :kk])

    lin.forward = forward
    return _restore_attrs([(lin, "forward")])


def _fused_layer_forward(layer, mixer_call, drop_last_row_residual=False):
    """Decoder layer whose post-attention norm is a fused add+norm: ``norm(delta, residual=residual)`` returns
    ``(normed, new_residual)``, HF's rounding points kept (the sum rounded to BF16 before the norm)."""
    norm = layer.post_attention_layernorm
    norm_forward = type(norm).forward

    def fused_norm(x, residual=None, norm=norm):
        if residual is None:
            return norm_forward(norm, x)
        s = residual + x  # BF16 add, as HF
        normed = norm_forward(norm, s)
        new_residual = s
        if drop_last_row_residual and s.shape[1] > 1:
            # tail bug: the last row of a multi-row launch does not write its residual back (stale input kept)
            new_residual = s.clone()
            new_residual[:, -1] = residual[:, -1]
        return normed, new_residual

    def forward(hidden_states, *args, layer=layer, **kwargs):
        residual = hidden_states
        h = layer.input_layernorm(hidden_states)
        delta = mixer_call(layer, h, *args, **kwargs)
        h, residual = layer.post_attention_layernorm(delta, residual=residual)
        h = layer.mlp(h)
        return residual + h

    return fused_norm, forward


def _mixer_call(model):
    if _is_qwen(model):
        def call(layer, h, *args, **kwargs):
            pe = kwargs.pop("position_embeddings", args[0] if args else None)
            attention_mask = kwargs.pop("attention_mask", None)
            position_ids = kwargs.pop("position_ids", None)
            cache = kwargs.pop("cache", None) or kwargs.pop("past_key_values", None)
            if layer.block_type == "linear_attention":
                return layer.linear_attn(hidden_states=h, cache=cache, attention_mask=attention_mask, **kwargs)
            return layer.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, position_embeddings=pe, **kwargs)[0]
    else:
        def call(layer, h, *args, **kwargs):
            return layer.self_attn(hidden_states=h, **kwargs)[0]
    return call


def _fused_add_norm(model, drop):
    patched = []
    call = _mixer_call(model)
    for layer in _layers(model):
        fused_norm, forward = _fused_layer_forward(layer, call, drop)
        layer.post_attention_layernorm.forward = fused_norm
        layer.forward = forward
        patched += [(layer.post_attention_layernorm, "forward"), (layer, "forward")]
    return _restore_attrs(patched)


def d13_fused_add_norm_stale_last_row(model):
    """DEFECT: a fused add+norm kernel whose last row (of a multi-row launch, i.e. prefill) does not write the
    updated residual back: the next residual add uses the pre-attention residual for that token."""
    return _fused_add_norm(model, drop=True)


def d14_window_off_by_one_step2(model):
    """DEFECT: the decode attention kernel has a sliding window of 17 keys configured by mistake (the model has
    no window): harmless up to 17 cached tokens, from decode step 2 on (18 keys) the oldest key is dropped."""

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        if query.shape[2] == 1 and key.shape[2] > 17:
            key, value = key[:, :, -17:], value[:, :, -17:]
        return _sdpa(module, query, key, value, attention_mask, scaling, dropout=dropout, **kw)

    return _register_attention(model, "audit_window", attn)


def d15_logits_temperature_outside_head(model):
    """DEFECT: the model wrapper divides the returned logits by 0.7 (a sampling temperature applied inside the
    fused model, outside the LM-head module)."""
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = (out.logits.float() / 0.7).to(out.logits.dtype)
        return out

    model.forward = forward
    return _restore_attrs([(model, "forward")])


def _fast_exp(y):
    """exp via 2^n * p(f): a degree-2 polynomial for 2^f on [0, 1) (fast-math, ~0.2% relative error)."""
    t = y * 1.4426950408889634
    n = torch.floor(t)
    f = t - n
    p = 1.0 + f * (0.6565 + 0.344 * f)
    return torch.ldexp(p, n.to(torch.int32))


class _Act(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _swap_act(model, fn):
    saved = [(layer.mlp, layer.mlp.act_fn) for layer in _layers(model)]
    for mlp, _ in saved:
        mlp.act_fn = _Act(fn)

    def undo():
        for mlp, act in saved:
            mlp.act_fn = act
    return undo


def d16_silu_fast_exp(model):
    """DEFECT (fast-math): the MLP's SiLU uses a polynomial exp with ~0.2% relative error."""

    def act(x):
        xf = x.float()
        return (xf / (1.0 + _fast_exp(-xf.clamp(min=-80.0)))).to(x.dtype)

    return _swap_act(model, act)


def d17_gated_norm_sigmoid_gate(model):
    """DEFECT (Qwen3.5): the GatedDeltaNet's gated RMSNorm multiplies by sigmoid(z) instead of silu(z)."""
    patched = []
    for layer in _layers(model):
        gdn = getattr(layer, "linear_attn", None)
        if gdn is None:
            continue
        norm = gdn.norm

        def forward(x, gate, norm=norm):
            xf = x.float()
            h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            h = norm.weight * h.to(x.dtype)
            return (h * torch.sigmoid(gate.float())).to(x.dtype)

        norm.forward = forward
        patched.append((norm, "forward"))
    return _restore_attrs(patched)


# ============================================================================================ VALID

def v01_rmsnorm_div_sqrt(model):
    """VALID: every RMSNorm as x / sqrt(mean + eps) in FP32 (instead of x * rsqrt), HF's roundings kept."""
    patched = []
    for m in model.modules():
        name = type(m).__name__
        if name == "Qwen3_5RMSNorm":
            def forward(x, norm=m):
                xf = x.float()
                out = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
                return (out * (1.0 + norm.weight.float())).to(x.dtype)
        elif name == "LlamaRMSNorm":
            def forward(x, norm=m):
                xf = x.float()
                out = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                return norm.weight * out.to(x.dtype)
        else:
            continue
        m.forward = forward
        patched.append((m, "forward"))
    return _restore_attrs(patched)


def v02_silu_explicit_fp32(model):
    """VALID: the MLP's SiLU as x / (1 + exp(-x)) in FP32, rounded once to BF16 (as HF's silu on BF16)."""

    def act(x):
        xf = x.float()
        return (xf / (1.0 + torch.exp(-xf))).to(x.dtype)

    return _swap_act(model, act)


def v03_linear_fp32_accum(model):
    """VALID: every nn.Linear as an FP32 GEMM (FP32 operands and accumulation) rounded once to the output dtype."""
    patched = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            def forward(x, lin=m):
                b = None if lin.bias is None else lin.bias.float()
                return F.linear(x.float(), lin.weight.float(), b).to(x.dtype)
            m.forward = forward
            patched.append((m, "forward"))
    return _restore_attrs(patched)


def _rotary_with(rot, inv):
    """The rotary embedding ``rot`` computing its tables from ``inv`` (its inv_freq) in each forward; undo restores."""
    original = rot.forward

    def forward(x, position_ids, *a, **kw):
        saved = rot.inv_freq
        rot.inv_freq = inv.to(saved.device)
        try:
            return original(x, position_ids, *a, **kw)
        finally:
            rot.inv_freq = saved

    rot.forward = forward
    return _restore_attrs([(rot, "forward")])


def v05_rope_tables_recomputed(model):
    """VALID: the rotary tables recomputed in FP32 from the positions as a kernel does:
    inv_freq = exp(-ln(theta) * 2i/d) (HF: 1 / theta ** (2i/d)), cos/sin in FP32, rounded to BF16."""
    rot = model.model.rotary_emb
    theta = model.config.rope_parameters["rope_theta"]
    n = rot.inv_freq.shape[0]
    dim = 2 * n
    inv = torch.exp(-math.log(theta) * (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    diff = int((inv != rot.inv_freq.cpu()).sum())
    print(f"[v05] inv_freq elements differing from HF's: {diff} of {n}", file=sys.stderr)
    return _rotary_with(rot, inv)


def v06_down_proj_fused_residual(model):
    """VALID, deliberate boundary: the down_proj GEMM's FP32 result is added to the residual in FP32 and rounded
    once (HF rounds down_proj's output to BF16 first). Expected: a NAMED boundary (down_proj rounding skipped)."""
    patched = []
    call = _mixer_call(model)
    for layer in _layers(model):
        lin = layer.mlp.down_proj

        def lin_forward(x, lin=lin):
            return F.linear(x.float(), lin.weight.float())  # FP32 out, no rounding

        def forward(hidden_states, *args, layer=layer, **kwargs):
            residual = hidden_states
            h = layer.input_layernorm(hidden_states)
            h = call(layer, h, *args, **kwargs)
            h = residual + h
            residual = h
            h = layer.post_attention_layernorm(h)
            d = layer.mlp(h)  # FP32
            return (residual.float() + d).to(residual.dtype)

        lin.forward = lin_forward
        layer.forward = forward
        patched += [(lin, "forward"), (layer, "forward")]
    return _restore_attrs(patched)


def v07_fused_add_norm_faithful(model):
    """VALID: a fused add+norm (``norm(delta, residual=r)`` -> (normed, r + delta)) keeping HF's rounding points."""
    return _fused_add_norm(model, drop=False)


def v08_llama_norm_weight_fp32(model):
    """VALID, deliberate boundary (Llama): RMSNorm multiplies the weight in FP32 and rounds once (HF Llama rounds
    the normalised x to BF16 before the weight). Expected: a NAMED boundary at the norms."""
    patched = []
    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            def forward(x, norm=m):
                xf = x.float()
                out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                return (out * norm.weight.float()).to(x.dtype)
            m.forward = forward
            patched.append((m, "forward"))
    return _restore_attrs(patched)


def v09_attention_mask_all_ones(model):
    """VALID: serving code passes an all-ones padding mask (no padding) to every forward."""

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        if kwargs.get("attention_mask") is None and ids is not None:
            cache = kwargs.get("past_key_values") or kwargs.get("cache")
            past = cache.get_seq_length() if cache is not None else 0
            kwargs["attention_mask"] = torch.ones(ids.shape[0], past + ids.shape[1], dtype=torch.long,
                                                  device=ids.device)
        return args, kwargs

    h = model.register_forward_pre_hook(hook, with_kwargs=True)
    return h.remove


def d18_rope_theta_wrong(model):
    """DEFECT: the fused rotary kernel hard-codes theta = 1e6 (Qwen2's) for a model configured with 1e4."""
    rot = model.model.rotary_emb
    n = rot.inv_freq.shape[0]
    dim = 2 * n
    inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return _rotary_with(rot, inv)


# ============================================================================================ second batch

def d19_norm_eps_1e5(model):
    """DEFECT (config slip, tiny): every RMSNorm uses 10x the configured eps (Qwen3.5: 1e-5 for 1e-6, Llama: 1e-4
    for 1e-5) — a kernel with a hard-coded eps."""
    saved = []
    for m in model.modules():
        name = type(m).__name__
        if name == "Qwen3_5RMSNorm":
            saved.append((m, "eps", m.eps)); m.eps = m.eps * 10
        elif name == "LlamaRMSNorm":
            saved.append((m, "variance_epsilon", m.variance_epsilon)); m.variance_epsilon = m.variance_epsilon * 10

    def undo():
        for m, attr, v in saved:
            setattr(m, attr, v)
    return undo


def d20_glu_swapped(model):
    """DEFECT: the fused GLU applies SiLU to the up projection and multiplies by the gate (gate/up swapped)."""
    patched = []
    for layer in _layers(model):
        mlp = layer.mlp

        def forward(x, mlp=mlp):
            return mlp.down_proj(mlp.act_fn(mlp.up_proj(x)) * mlp.gate_proj(x))

        mlp.forward = forward
        patched.append((mlp, "forward"))
    return _restore_attrs(patched)


def _fast_rsqrt(v):
    """Quake's inverse square root with one Newton step (relative error <= 1.75e-3), FP32."""
    i = v.view(torch.int32)
    i = torch.tensor(0x5F3759DF, dtype=torch.int32) - (i >> 1)
    y = i.view(torch.float32)
    return y * (1.5 - 0.5 * v * y * y)


def d22_norm_fast_rsqrt(model):
    """DEFECT (fast-math): every decoder-layer input norm uses the bit-trick rsqrt with one Newton step."""
    patched = []
    for layer in _layers(model):
        m = layer.input_layernorm
        if type(m).__name__ == "Qwen3_5RMSNorm":
            def forward(x, norm=m):
                xf = x.float()
                out = xf * _fast_rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
                return (out * (1.0 + norm.weight.float())).to(x.dtype)
        else:
            def forward(x, norm=m):
                xf = x.float()
                out = xf * _fast_rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                return norm.weight * out.to(x.dtype)
        m.forward = forward
        patched.append((m, "forward"))
    return _restore_attrs(patched)


def _mask_builder_patched(model, make, eager: bool):
    """HF's ``create_causal_mask`` replaced by ``make(original)``; ``eager``: the model switched to HF's eager
    attention too. Returns the undo of both."""
    mm = _mm(model)
    original = mm.create_causal_mask
    mm.create_causal_mask = make(original)
    old = model.config._attn_implementation
    if eager:
        model.config._attn_implementation = "eager"

    def undo():
        mm.create_causal_mask = original
        model.config._attn_implementation = old
    return undo


def _mask_off_by_one(model, eager: bool):
    def make(original):
        def create(*args, **kwargs):
            # the serving layer adds "look one token ahead" through HF's or_mask_function hook (a bug)
            kwargs["or_mask_function"] = lambda b, h, q, kv: kv == q + 1
            kwargs["allow_is_causal_skip"] = False
            return original(*args, **kwargs)
        return create

    return _mask_builder_patched(model, make, eager)


def d21_mask_builder_peek(model):
    """DEFECT: the mask builder (outside every site) lets each prefill query see the next token; HF's own sdpa
    attention then runs with that explicit mask."""
    return _mask_off_by_one(model, eager=False)


def d21e_mask_builder_peek_eager(model):
    """DEFECT: as d21, with the model on HF's eager attention (run against --reference hf:attn=eager, whose core
    also receives an explicit float mask)."""
    return _mask_off_by_one(model, eager=True)


def v21e_eager_same_mask(model):
    """Control for d21e: the model on HF's eager attention, nothing else changed (vs --reference hf:attn=eager)."""
    old = model.config._attn_implementation
    model.config._attn_implementation = "eager"

    def undo():
        model.config._attn_implementation = old
    return undo


def v10_norm_sum_times_inv_n(model):
    """VALID: every RMSNorm's mean as sum(x^2) * (1/n) in FP32 (a kernel's reciprocal multiply), HF's roundings kept."""
    patched = []
    for m in model.modules():
        name = type(m).__name__
        if name not in ("Qwen3_5RMSNorm", "LlamaRMSNorm"):
            continue
        if name == "Qwen3_5RMSNorm":
            def forward(x, norm=m):
                xf = x.float()
                mean = xf.pow(2).sum(-1, keepdim=True) * (1.0 / xf.shape[-1])
                out = xf * torch.rsqrt(mean + norm.eps)
                return (out * (1.0 + norm.weight.float())).to(x.dtype)
        else:
            def forward(x, norm=m):
                xf = x.float()
                mean = xf.pow(2).sum(-1, keepdim=True) * (1.0 / xf.shape[-1])
                out = xf * torch.rsqrt(mean + norm.variance_epsilon)
                return norm.weight * out.to(x.dtype)
        m.forward = forward
        patched.append((m, "forward"))
    return _restore_attrs(patched)


def v11_gdn_chunked_at_decode(model):
    """VALID (Qwen3.5): decode steps run the chunked delta-rule form on the one token (instead of the recurrent)."""
    mq = _mm(model)
    original = mq.torch_recurrent_gated_delta_rule
    chunk = mq.torch_chunk_gated_delta_rule

    def recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kw):
        return chunk(query, key, value, g=g, beta=beta, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    mq.torch_recurrent_gated_delta_rule = recurrent

    def undo():
        mq.torch_recurrent_gated_delta_rule = original
    return undo


def v12_gdn_fused_gates(model):
    """VALID (Qwen3.5): a fused gate kernel: softplus as log1p(exp(x)) (no threshold) and beta as 1/(1+exp(-b)) in
    FP32 rounded once to BF16; g kept in FP32 as HF."""
    mq = _mm(model)
    patched = []
    for layer in _layers(model):
        gdn = getattr(layer, "linear_attn", None)
        if gdn is None:
            continue
        fwd = _gdn_forward(gdn, mq, beta_fn=lambda b: (1.0 / (1.0 + torch.exp(-b.float()))).to(b.dtype),
                           g_fn=lambda a, gdn=gdn: -gdn.A_log.float().exp()
                           * torch.log1p(torch.exp(a.float() + gdn.dt_bias.float())))
        gdn.forward = fwd
        patched.append((gdn, "forward"))
    return _restore_attrs(patched)


def v00_gdn_forward_copy(model):
    """Control (Qwen3.5): the GatedDeltaNet forward copy used by d08/v12, unmodified (must be bitwise HF)."""
    mq = _mm(model)
    patched = []
    for layer in _layers(model):
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None:
            gdn.forward = _gdn_forward(gdn, mq)
            patched.append((gdn, "forward"))
    return _restore_attrs(patched)


def _decay_scaled_decode(factor):
    def patch(model):
        mq = _mm(model)
        original = mq.torch_recurrent_gated_delta_rule

        def recurrent(query, key, value, g, beta, *a, **kw):
            return original(query, key, value, g * factor, beta, *a, **kw)

        mq.torch_recurrent_gated_delta_rule = recurrent

        def undo():
            mq.torch_recurrent_gated_delta_rule = original
        return undo
    patch.__doc__ = f"DEFECT (Qwen3.5): the one-token delta-rule kernel uses decay exp({factor} g)."
    return patch


d09b_gdn_decay_x1_25_decode = _decay_scaled_decode(1.25)
d09c_gdn_decay_x1_05_decode = _decay_scaled_decode(1.05)


def v22_explicit_causal_mask(model):
    """VALID: the mask builder always materialises the (correct) causal mask (no is_causal skip); HF's own
    attention function runs with it."""
    mm = _mm(model)
    original = mm.create_causal_mask

    def create(*args, **kwargs):
        kwargs["allow_is_causal_skip"] = False
        return original(*args, **kwargs)

    mm.create_causal_mask = create

    def undo():
        mm.create_causal_mask = original
    return undo


def d15b_logit_bias_outside_head(model):
    """DEFECT: the model wrapper adds +8 to token 7's logit (a stale logit-bias buffer applied after the LM head)."""
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        logits = out.logits.clone()
        logits[..., 7] += 8.0
        out.logits = logits
        return out

    model.forward = forward
    return _restore_attrs([(model, "forward")])
