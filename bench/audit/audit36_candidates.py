"""Audit 36 (2026-12-05g): a third held-out set of candidate paths for ulptrace (defects d*, valid variants v*,
x* = behaviour to report). Run: `PYTHONPATH=bench/audit ulptrace onset --candidate audit36_candidates:NAME ...`
(bench/audit/audit36_runall.sh runs them all).

Each function patches an HF model in place and returns an undo callable. Written from HF's modeling code
(transformers 5.25: qwen3_5/modeling_qwen3_5.py, llama/modeling_llama.py), not from ulptrace.kernels. Steps: 0 is the
prefill (16 tokens), 1 and 2 are one-token decode steps. Qwen3.5's full-attention layers are 1 and 3 (GatedDeltaNet:
0 and 2); Llama has three full-attention layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from audit31_candidates import (BF16, _attn_layers, _is_qwen, _layers, _mixer_call, _mm, _register_attention,
                                _restore_attrs)
from audit32_candidates import _gdns, _patch_module_fn


# --------------------------------------------------------------------------------------------- helpers

def _norm_eps(norm):
    return norm.eps if hasattr(norm, "eps") else norm.variance_epsilon


def _hf_norm(norm, xf, *, weight_rows=None):
    """HF's RMSNorm of FP32 ``xf`` for either family, HF's rounding points kept; returns BF16.
    ``weight_rows``: a bool per batch row, False = that row skips the weight (d84)."""
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _norm_eps(norm))
    if type(norm).__name__ == "Qwen3_5RMSNorm":
        y = out * (1.0 + norm.weight.float())
        if weight_rows is not None:
            y = torch.where(weight_rows.view(-1, *([1] * (y.dim() - 1))), y, out)
        return y.to(BF16)
    ob = out.to(BF16)
    y = norm.weight * ob
    if weight_rows is not None:
        y = torch.where(weight_rows.view(-1, *([1] * (y.dim() - 1))), y, ob)
    return y


def _step_tracker(model):
    """A forward pre-hook on the model recording the current step (0 prefill, then 1, 2, ...) in ``state['step']``
    from the cache's length; returns (state, handle)."""
    state = {"step": 0, "prompt": None}

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        cache = kwargs.get("past_key_values") or kwargs.get("cache")
        past = cache.get_seq_length() if cache is not None else 0
        if past == 0:
            state["step"], state["prompt"] = 0, ids.shape[1]
        else:
            state["step"] = past - state["prompt"] + 1
        return args, kwargs

    return state, model.register_forward_pre_hook(hook, with_kwargs=True)


def _gdn_forward(gdn, mq, gates=None, norm_gate=None):
    """HF's Qwen3_5GatedDeltaNet.forward (no intermediate states); ``gates(a, b) -> (g, beta)`` and
    ``norm_gate(z, value) -> gate`` replaceable."""

    def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
        cache = cache if cache is not None else kwargs.pop("cache_params", None)
        hidden_states = mq.apply_mask_to_padding_states(hidden_states, attention_mask)
        bsz, seq_len, _ = hidden_states.shape
        recurrent_state = cache.get_recurrent_state(gdn.layer_idx, state_idx=0) if cache is not None else None
        mixed_qkv = gdn.in_proj_qkv(hidden_states).transpose(1, 2)
        z = gdn.in_proj_z(hidden_states).reshape(bsz, seq_len, -1, gdn.head_v_dim)
        b = gdn.in_proj_b(hidden_states)
        a = gdn.in_proj_a(hidden_states)
        mixed_qkv = mq.causal_conv1d_forward(gdn.conv1d, mixed_qkv, cache, gdn.layer_idx,
                                             activation=gdn.activation, **kwargs).transpose(1, 2)
        query, key, value = torch.split(mixed_qkv, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        query = query.reshape(bsz, seq_len, -1, gdn.head_k_dim)
        key = key.reshape(bsz, seq_len, -1, gdn.head_k_dim)
        value = value.reshape(bsz, seq_len, -1, gdn.head_v_dim)
        if gates is None:
            beta = b.sigmoid()
            g = -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)
        else:
            g, beta = gates(a, b)
        kw = dict(g=g, beta=beta, initial_state=recurrent_state, output_final_state=cache is not None,
                  use_qk_l2norm_in_kernel=True)
        if recurrent_state is not None and seq_len == 1:
            core, last = mq.torch_recurrent_gated_delta_rule(query, key, value, **kw)
        else:
            core, last = mq.torch_chunk_gated_delta_rule(query, key, value, **kw)
        if cache is not None:
            cache.update_recurrent_state(last, gdn.layer_idx)
        gate = z if norm_gate is None else norm_gate(z, value)
        core = gdn.norm(core.reshape(-1, gdn.head_v_dim), gate.reshape(-1, gdn.head_v_dim))
        return gdn.out_proj(core.reshape(bsz, seq_len, -1))

    return forward


def _patch_gdns(model, **kw):
    mq = _mm(model)
    patched = []
    for gdn in _gdns(model):
        gdn.forward = _gdn_forward(gdn, mq, **kw)
        patched.append((gdn, "forward"))
    return _restore_attrs(patched)


def _recurrent_scan(q_scale_power=1, dtype=torch.float32):
    """A one-token (token-by-token) delta-rule kernel written from HF's recurrent form: computed in ``dtype``, the
    query divided by sqrt(d_k) ``q_scale_power`` times; output rounded once to the input dtype, state handed on in
    FP32 (as HF)."""

    def scan(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kw):
        out_dtype = query.dtype
        bsz, seq, nk, dk = key.shape
        nv, dv = value.shape[-2:]
        if nk != nv:
            query = query.repeat_interleave(nv // nk, dim=2)
            key = key.repeat_interleave(nv // nk, dim=2)
        q, k, v, b, gg = [x.transpose(1, 2).to(dtype) for x in (query, key, value, beta, g)]
        if use_qk_l2norm_in_kernel:
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        for _ in range(q_scale_power):
            q = q / math.sqrt(dk)
        s = (torch.zeros(bsz, nv, dk, dv, dtype=dtype) if initial_state is None else initial_state.to(dtype))
        out = torch.zeros_like(v)
        for i in range(seq):
            s = s * gg[:, :, i].exp()[..., None, None]
            kv = (s * k[:, :, i, :, None]).sum(-2)
            delta = (v[:, :, i] - kv) * b[:, :, i, None]
            s = s + k[:, :, i, :, None] * delta[:, :, None, :]
            out[:, :, i] = (s * q[:, :, i, :, None]).sum(-2)
        out = out.transpose(1, 2).contiguous().to(out_dtype)
        return out, (s.to(torch.float32) if output_final_state else None)

    return scan


def _replace_recurrent(model, scan):
    return _patch_module_fn(model, "torch_recurrent_gated_delta_rule", lambda original: scan)


def _attention(model, name, make_scaling=None, explicit=None):
    """Register an attention function: HF's sdpa with a changed scaling (``make_scaling(module, scaling)``), or an
    explicit kernel ``explicit(module, q, k, v, scaling)`` (causal by index)."""
    from audit31_candidates import _sdpa

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        if explicit is not None:
            return explicit(module, query, key, value, scaling), None
        return _sdpa(module, query, key, value, attention_mask, make_scaling(module, scaling), dropout=dropout, **kw)

    return _register_attention(model, name, attn)


def _causal_scores(query, k, scaling):
    q_len, kv_len = query.shape[2], k.shape[2]
    s = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scaling
    i = torch.arange(q_len)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len)[None, :]
    return s.masked_fill(j > i, float("-inf"))


def _qwen_attn_forward(attn, mm, split_flat=False):
    """HF's Qwen3_5Attention.forward; ``split_flat``: q and the output gate split as two flat halves of q_proj's
    output instead of per head."""

    def forward(hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        qp = attn.q_proj(hidden_states)
        if split_flat:
            q, gate = torch.chunk(qp, 2, dim=-1)
            q = q.reshape(*input_shape, -1, attn.head_dim)
        else:
            q, gate = torch.chunk(qp.view(*input_shape, -1, attn.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
        q = attn.q_norm(q.reshape(hidden_shape)).transpose(1, 2)
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
        out = out * torch.sigmoid(gate)
        return attn.o_proj(out), w

    return forward


def _bf16_bump_away(r, exact):
    """The BF16 neighbour of ``r`` on the side away from ``exact`` (so at least one ULP outside faithful rounding)."""
    bits = r.view(torch.int16).item()
    up = float(exact) < float(r)  # move up (towards +inf) when the exact value lies below r
    away_from_zero = up == (float(r) >= 0)
    bits = bits + 1 if away_from_zero else bits - 1
    return torch.tensor([bits], dtype=torch.int16).view(BF16)[0]


# ============================================================================================ Qwen3.5: q/k norms

def d60_qnorm_weight_llama_convention(model):
    """DEFECT (Qwen3.5): every q_norm scales by w instead of (1 + w) (Llama's convention).
    Expected: error at layers.1.self_attn.q_norm, step 0."""
    patched = []
    for layer in _attn_layers(model):
        norm = layer.self_attn.q_norm

        def forward(x, norm=norm):
            xf = x.float()
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
            return (out * norm.weight.float()).to(x.dtype)

        norm.forward = forward
        patched.append((norm, "forward"))
    return _restore_attrs(patched)


def d61_qnorm_skipped_decode(model):
    """DEFECT (Qwen3.5): the decode attention kernel skips q_norm (returns q as projected) when there is one token.
    Expected: error at layers.1.self_attn.q_norm, step 1 (prefill at parity)."""
    patched = []
    for layer in _attn_layers(model):
        norm = layer.self_attn.q_norm
        original = type(norm).forward

        def forward(x, norm=norm, original=original):
            if x.shape[1] == 1:
                return x
            return original(norm, x)

        norm.forward = forward
        patched.append((norm, "forward"))
    return _restore_attrs(patched)


def d62_qnorm_mean_over_all_heads(model):
    """DEFECT (Qwen3.5): q_norm's mean of squares is taken over all heads of a token (dims -2,-1) instead of per
    head. Expected: error at layers.1.self_attn.q_norm, step 0."""
    patched = []
    for layer in _attn_layers(model):
        norm = layer.self_attn.q_norm

        def forward(x, norm=norm):
            xf = x.float()
            out = xf * torch.rsqrt(xf.pow(2).mean((-2, -1), keepdim=True) + norm.eps)
            return (out * (1.0 + norm.weight.float())).to(x.dtype)

        norm.forward = forward
        patched.append((norm, "forward"))
    return _restore_attrs(patched)


def d93_qnorm_uses_knorm_weight(model):
    """DEFECT (Qwen3.5): the fused q/k-norm kernel applies k_norm's weight to the queries (pointer slip).
    Expected: error at layers.1.self_attn.q_norm, step 0."""
    patched = []
    for layer in _attn_layers(model):
        norm, kn = layer.self_attn.q_norm, layer.self_attn.k_norm

        def forward(x, norm=norm, kn=kn):
            xf = x.float()
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
            return (out * (1.0 + kn.weight.float())).to(x.dtype)

        norm.forward = forward
        patched.append((norm, "forward"))
    return _restore_attrs(patched)


def d75_qproj_gate_split_flat(model):
    """DEFECT (Qwen3.5): the query and the output gate are split as the two flat halves of q_proj's output instead of
    per head ([q_h | gate_h] interleaved). No site observes q_proj's split. Expected: unobserved at
    layers.1.self_attn.q_norm, step 0 (its input differs while every earlier record is equal)."""
    mm = _mm(model)
    patched = []
    for layer in _attn_layers(model):
        layer.self_attn.forward = _qwen_attn_forward(layer.self_attn, mm, split_flat=True)
        patched.append((layer.self_attn, "forward"))
    return _restore_attrs(patched)


# ============================================================================================ Qwen3.5: GatedDeltaNet

def d66_gdn_alog_no_exp(model):
    """DEFECT (Qwen3.5): the gate kernel uses -A_log (not -exp(A_log)) as the decay rate: g = -A_log*softplus(a+dt).
    Expected: error at layers.0.linear_attn.gates.g, step 0."""
    def gates(a, b, gdn):
        return -gdn.A_log.float() * F.softplus(a.float() + gdn.dt_bias), b.sigmoid()
    mq = _mm(model)
    patched = []
    for gdn in _gdns(model):
        gdn.forward = _gdn_forward(gdn, mq, gates=lambda a, b, gdn=gdn: gates(a, b, gdn))
        patched.append((gdn, "forward"))
    return _restore_attrs(patched)


def d67_gdn_dt_bias_dropped_decode(model):
    """DEFECT (Qwen3.5): the decode gate kernel forgets dt_bias: g = -exp(A_log)*softplus(a) when seq_len == 1.
    Expected: error at layers.0.linear_attn.gates.g, step 1 (prefill at parity)."""
    def gates(a, b, gdn):
        bias = 0.0 if a.shape[1] == 1 else gdn.dt_bias
        return -gdn.A_log.float().exp() * F.softplus(a.float() + bias), b.sigmoid()
    mq = _mm(model)
    patched = []
    for gdn in _gdns(model):
        gdn.forward = _gdn_forward(gdn, mq, gates=lambda a, b, gdn=gdn: gates(a, b, gdn))
        patched.append((gdn, "forward"))
    return _restore_attrs(patched)


def d92_gdn_decode_gates_swapped_ab(model):
    """DEFECT (Qwen3.5): at decode the gate kernel reads a and b swapped (beta = sigmoid(a), g from b).
    Expected: error at layers.0.linear_attn.gates.g (or gates.beta), step 1."""
    def gates(a, b, gdn):
        if a.shape[1] == 1:
            a, b = b, a
        return -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias), b.sigmoid()
    mq = _mm(model)
    patched = []
    for gdn in _gdns(model):
        gdn.forward = _gdn_forward(gdn, mq, gates=lambda a, b, gdn=gdn: gates(a, b, gdn))
        patched.append((gdn, "forward"))
    return _restore_attrs(patched)


def d74_gdn_norm_gate_is_value(model):
    """DEFECT (Qwen3.5): the gated RMSNorm is handed the value tensor as its gate instead of z (same shape).
    Expected: unobserved at layers.0.linear_attn.norm, step 0 (its gate input differs, every earlier record equal)."""
    return _patch_gdns(model, norm_gate=lambda z, value: value)


def d68_gdn_conv_no_silu_decode(model):
    """DEFECT (Qwen3.5): the one-token conv update kernel drops the SiLU. Expected: error at
    layers.0.linear_attn.conv, step 1."""
    def make(original):
        def update(hidden_states, conv_state, weight, bias=None, activation=None):
            return original(hidden_states, conv_state, weight, bias, activation=None)
        return update
    return _patch_module_fn(model, "causal_conv1d_update", make)


def v70_gdn_decode_fp64(model):
    """VALID (Qwen3.5): the decode delta-rule step computed in float64, output rounded once to BF16, state handed
    on in FP32. Expected: parity (ties at linear_attn.core / recurrent_state, step 1-2)."""
    return _replace_recurrent(model, _recurrent_scan(1, torch.float64))


def d71_gdn_decode_no_qscale(model):
    """DEFECT (Qwen3.5): the decode delta-rule kernel omits the 1/sqrt(d_k) query scale (output x5.66; its state is
    right). Expected: error at layers.0.linear_attn.core, step 1."""
    return _replace_recurrent(model, _recurrent_scan(0))


def d72_gdn_decode_qscale_twice(model):
    """DEFECT (Qwen3.5): the decode delta-rule kernel divides the query by sqrt(d_k) twice.
    Expected: error at layers.0.linear_attn.core, step 1."""
    return _replace_recurrent(model, _recurrent_scan(2))


def d73_gdn_l2norm_eps_1e4(model):
    """DEFECT (Qwen3.5): the q/k L2 norm uses eps=1e-4 (HF: 1e-6). Here sum(k^2) is ~6e-4, so |k| ~ 0.93 (not 1):
    Expected: error at layers.0.linear_attn.core, step 0."""
    def make(original):
        def l2(x, dim=-1, eps=1e-6):
            return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + 1e-4)
        return l2
    return _patch_module_fn(model, "l2norm", make)


# ============================================================================================ attention

def d90_attn_scale_head_dim_plus1(model):
    """DEFECT: the attention kernel scales the scores by 1/sqrt(head_dim + 1) (1.5% low).
    Expected: error at the first self_attn.core (Qwen layer 1, Llama layer 0), step 0."""
    return _attention(model, "audit36_scale_hd1", make_scaling=lambda m, s: (m.head_dim + 1) ** -0.5)


def x91_attn_scale_bf16(model):
    """DEBATABLE: the kernel takes the scale as a BF16 scalar: 1/sqrt(32) -> 0.1767578125 (relative -1.1e-4, far below
    a BF16 ULP of the output). A correct tool may call it ties (a constant rounded to the compute dtype) or an error
    at self_attn.core step 0; never a failure elsewhere."""
    return _attention(model, "audit36_scale_bf16",
                      make_scaling=lambda m, s: float(torch.tensor(s, dtype=BF16)))


def v65_attn_probs_bf16(model):
    """VALID (flash-attention's design): FP32 scores, FP32 softmax, the probabilities rounded to BF16 before P@V,
    P@V accumulated in FP32, output rounded once. Expected: parity (ties) or a named boundary at self_attn.core."""
    def explicit(module, query, key, value, scaling):
        n = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(n, dim=1), value.repeat_interleave(n, dim=1)
        p = torch.softmax(_causal_scores(query, k, scaling), -1).to(BF16)
        out = torch.matmul(p.float(), v.float()).to(query.dtype)
        return out.transpose(1, 2).contiguous()
    return _attention(model, "audit36_p_bf16", explicit=explicit)


def d86_kv_write_off_by_one_decode(model):
    """DEFECT: a fused decode kernel (write K/V to the cache, then attend) writes the new K/V one slot early (over
    the previous token) and leaves its own slot zero; the cache keeps that. Expected: error at the first
    self_attn.core, step 1 (its recorded inputs are right, its output is not)."""
    def explicit(module, query, key, value, scaling):
        if query.shape[2] == 1:
            with torch.no_grad():
                key[:, :, -2] = key[:, :, -1]
                value[:, :, -2] = value[:, :, -1]
                key[:, :, -1] = 0
                value[:, :, -1] = 0
        n = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(n, dim=1), value.repeat_interleave(n, dim=1)
        q_len, kv_len = query.shape[2], k.shape[2]
        mask = (torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len))
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous()
    return _attention(model, "audit36_kv_off1", explicit=explicit)


def v76_rope_complex_fp32(model):
    """VALID: RoPE as a complex multiplication in FP32 (pairs (i, i + d/2), HF's NeoX pairing) from HF's BF16 tables,
    rounded once to BF16 (HF rounds q*cos, rotate(q)*sin and their sum). Expected: tie or a named boundary at
    self_attn.q_rope, never error."""
    def make(original):
        def apply(q, k, cos, sin, unsqueeze_dim=1):
            cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            d = cos.shape[-1]
            rot = torch.complex(cos[..., : d // 2].float(), sin[..., : d // 2].float())

            def one(x):
                xr, xp = x[..., :d], x[..., d:]
                z = torch.complex(xr[..., : d // 2].float(), xr[..., d // 2:].float()) * rot
                return torch.cat([z.real.to(x.dtype), z.imag.to(x.dtype), xp], dim=-1)
            return one(q), one(k)
        return apply
    return _patch_module_fn(model, "apply_rotary_pos_emb", make)


def x85_rope_tables_row0_broadcast(model):
    """LATENT DEFECT: the RoPE kernel reads the cos/sin tables of batch row 0 for every row (batch stride 0). Without
    padding every row has the same positions, so the output is bitwise HF's. Expected: parity (no false alarm)."""
    def make(original):
        def apply(q, k, cos, sin, unsqueeze_dim=1):
            return original(q, k, cos[:1].expand_as(cos), sin[:1].expand_as(sin), unsqueeze_dim)
        return apply
    return _patch_module_fn(model, "apply_rotary_pos_emb", make)


# ============================================================================================ MLP, norms, residual

def v77_glu_fp32_once(model):
    """VALID, deliberate boundary: the GLU silu(g)*u computed in FP32 from the BF16 projections, rounded once (HF
    rounds silu(g) to BF16 first). Expected: boundary at mlp.glu naming the skipped rounding, or ties; no error."""
    patched = []
    for layer in _layers(model):
        mlp = layer.mlp

        def forward(x, mlp=mlp):
            g, u = mlp.gate_proj(x), mlp.up_proj(x)
            return mlp.down_proj((F.silu(g.float()) * u.float()).to(x.dtype))

        mlp.forward = forward
        patched.append((mlp, "forward"))
    return _restore_attrs(patched)


def v88_norm_fp64_same_roundings(model):
    """VALID: every decoder RMSNorm (input/post-attention/final; q/k norms too) computed in float64 with HF's
    rounding points (Qwen3.5: one rounding at the end; Llama: normalised x rounded, then w * x in BF16).
    Expected: parity (ties)."""
    patched = []
    for m in model.modules():
        name = type(m).__name__
        if name not in ("Qwen3_5RMSNorm", "LlamaRMSNorm"):
            continue

        def forward(x, norm=m, qwen=name == "Qwen3_5RMSNorm"):
            xd = x.double()
            out = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + _norm_eps(norm))
            if qwen:
                return (out * (1.0 + norm.weight.double())).to(x.dtype)
            return norm.weight * out.to(x.dtype)

        m.forward = forward
        patched.append((m, "forward"))
    return _restore_attrs(patched)


def d87_norm_mean_over_seq_one_layer(model):
    """DEFECT: one post-attention RMSNorm (Qwen3.5 layer 2, Llama layer 1) takes the mean of squares over the
    sequence axis (dim 1) instead of the hidden axis. Expected: error at that post_attention_layernorm, step 0."""
    layer = model.model.layers[2 if _is_qwen(model) else 1]
    norm = layer.post_attention_layernorm
    qwen = _is_qwen(model)

    def forward(x, norm=norm):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + _norm_eps(norm))
        if qwen:
            return (out * (1.0 + norm.weight.float())).to(x.dtype)
        return norm.weight * out.to(x.dtype)

    norm.forward = forward
    return _restore_attrs([(norm, "forward")])


def d84_final_norm_row1_no_weight(model):
    """DEFECT: the final norm kernel applies its weight only to batch row 0 (later rows use the weight register's
    default). Expected: error at `norm`, step 0 (row 1's elements only)."""
    norm = model.model.norm

    def forward(x, norm=norm):
        rows = torch.zeros(x.shape[0], dtype=torch.bool)
        rows[0] = True
        return _hf_norm(norm, x.float(), weight_rows=rows)

    norm.forward = forward
    return _restore_attrs([(norm, "forward")])


def v80_residual_fp32_stream(model):
    """VALID, deliberate boundary: the residual stream kept in FP32 between layers (both adds in FP32, never rounded;
    the norms read the FP32 stream and keep HF's rounding points; the final norm returns BF16). Expected: boundary
    at layers.0.residual_attn (the residual add's BF16 rounding skipped) or ties; no error."""
    call = _mixer_call(model)
    patched = []
    for m in model.modules():
        if type(m).__name__ in ("Qwen3_5RMSNorm", "LlamaRMSNorm") and m.weight.shape[0] == model.config.hidden_size:
            m.forward = lambda x, norm=m: _hf_norm(norm, x.float())
            patched.append((m, "forward"))
    for layer in _layers(model):
        def forward(hidden_states, *args, layer=layer, **kwargs):
            x = hidden_states.float()
            h = layer.input_layernorm(x)
            r = x + call(layer, h, *args, **kwargs).float()
            h = layer.post_attention_layernorm(r)
            return r + layer.mlp(h).float()

        layer.forward = forward
        patched.append((layer, "forward"))
    return _restore_attrs(patched)


def x82_norm_weight_folded(model):
    """REPORT BEHAVIOUR: each post-attention norm's weight is folded into gate_proj/up_proj (W' = W diag(w_eff),
    rounded to BF16; Qwen3.5 w_eff = 1 + w) and the norm outputs the unweighted normalised x. A genuinely different
    computation: the norm site's output is not HF's norm. Expected: error at layers.0.post_attention_layernorm,
    step 0 (gate_proj/up_proj then also error, judged with HF's weights); never parity."""
    patched = []
    for layer in _layers(model):
        norm, mlp = layer.post_attention_layernorm, layer.mlp
        qwen = type(norm).__name__ == "Qwen3_5RMSNorm"
        w_eff = (1.0 + norm.weight.float()) if qwen else norm.weight.float()

        def norm_forward(x, norm=norm):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _norm_eps(norm))).to(x.dtype)

        norm.forward = norm_forward
        patched.append((norm, "forward"))
        for lin in (mlp.gate_proj, mlp.up_proj):
            folded = (lin.weight.float() * w_eff[None, :]).to(lin.weight.dtype).detach()
            lin.forward = lambda x, folded=folded: F.linear(x, folded)
            patched.append((lin, "forward"))
    return _restore_attrs(patched)


def d83_one_ulp_away_decode_step2(model):
    """DEFECT (minimal): at decode step 2 only, one element of layer 1's down_proj output (batch row 1, channel 5)
    is moved one BF16 ULP away from its exact value (outside any faithful rounding). Expected: error at
    layers.1.mlp.down_proj, step 2, exactly one error element; everything before bitwise or ties."""
    state, handle = _step_tracker(model)
    lin = model.model.layers[1].mlp.down_proj

    def forward(x, lin=lin):
        y = F.linear(x, lin.weight)
        if state["step"] == 2 and y.shape[0] > 1:
            exact = (x[1, -1].double() @ lin.weight[5].double())
            y = y.clone()
            y[1, -1, 5] = _bf16_bump_away(y[1, -1, 5], exact)
        return y

    lin.forward = forward
    undo = _restore_attrs([(lin, "forward")])
    return lambda: (undo(), handle.remove())


# ============================================================================================ embedding, head, errors

def v78_embed_onehot_matmul(model):
    """VALID: the embedding as one_hot(ids) @ E in BF16 (one nonzero term per output: exact). Expected: parity
    (embed bitwise equal)."""
    emb = model.get_input_embeddings()

    def forward(ids, emb=emb):
        return torch.matmul(F.one_hot(ids, emb.weight.shape[0]).to(emb.weight.dtype), emb.weight)

    emb.forward = forward
    return _restore_attrs([(emb, "forward")])


def v79_lm_head_vocab_chunks(model):
    """VALID: the LM head computed in vocabulary chunks of 96 rows, concatenated. Expected: parity (ties at logits)."""
    head = model.get_output_embeddings()

    def forward(x, head=head):
        w = head.weight
        return torch.cat([F.linear(x, w[i:i + 96]) for i in range(0, w.shape[0], 96)], dim=-1)

    head.forward = forward
    return _restore_attrs([(head, "forward")])


def x103_raises_at_decode(model):
    """REPORT BEHAVIOUR: the candidate's decode path raises (RuntimeError from a kernel launch). Expected: a clean
    exit naming the candidate function's frame and the message, no ulptrace-internal traceback, no report claiming
    parity."""
    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            raise RuntimeError("audit36: decode kernel launch failed (invalid configuration argument)")
        return args, kwargs

    h = model.register_forward_pre_hook(hook, with_kwargs=True)
    return h.remove


# ============================================================================================ follow-ups (run after the first pass)

def d90b_attn_scale_missing(model):
    """DEFECT: the attention kernel applies no 1/sqrt(head_dim) scale (scores x5.66). Follow-up to d90, whose 1.5%
    slip moves tiny-llama's near-uniform attention less than HF's own BF16 rounding does. Expected: error at the first
    self_attn.core, step 0."""
    return _attention(model, "audit36_scale_none", make_scaling=lambda m, s: 1.0)


def d83b_one_ulp_away_well_conditioned(model):
    """DEFECT (minimal), follow-up to d83: at decode step 2 only, the best-conditioned element of layer 1's down_proj
    output (batch row 1: largest |y| / sum|x w|) is moved one BF16 ULP away from its exact value. Expected: error at
    layers.1.mlp.down_proj, step 2, one element."""
    state, handle = _step_tracker(model)
    lin = model.model.layers[1].mlp.down_proj

    def forward(x, lin=lin):
        y = F.linear(x, lin.weight)
        if state["step"] == 2 and y.shape[0] > 1:
            prod = x[1, -1].double()[None, :] * lin.weight.double()
            exact = prod.sum(-1)
            j = int((exact.abs() / prod.abs().sum(-1)).argmax())
            y = y.clone()
            y[1, -1, j] = _bf16_bump_away(y[1, -1, j], exact[j])
        return y

    lin.forward = forward
    undo = _restore_attrs([(lin, "forward")])
    return lambda: (undo(), handle.remove())


def _gdn_decode_q_scaled(factor):
    def make(original):
        def rec(query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kw):
            q = query.float() * torch.rsqrt((query.float() ** 2).sum(-1, keepdim=True) + 1e-6) * factor
            k = key.float() * torch.rsqrt((key.float() ** 2).sum(-1, keepdim=True) + 1e-6)
            out, state = original(q, k, value, g, beta, initial_state=initial_state,
                                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=False, **kw)
            return out.to(value.dtype), state
        return rec
    return make


def d94_gdn_decode_out_scale_1p01(model):
    """DEFECT (Qwen3.5, small): the one-token delta-rule kernel scales the query by 1.01 (output x1.01, its state
    right). A one-token recurrent step has no chunked BF16-operand matmuls; expected: error at
    layers.0.linear_attn.core, step 1 (a `BF16 operands` boundary there would be the README's documented width)."""
    return _patch_module_fn(model, "torch_recurrent_gated_delta_rule", _gdn_decode_q_scaled(1.01))


def d94b_gdn_decode_out_scale_1p005(model):
    """DEFECT (Qwen3.5, smaller), follow-up to d94: the one-token delta-rule kernel scales the query by 1.005 (output
    x1.005 ~ 1.3 BF16 ULP at mid-binade; state right). Expected: error at layers.0.linear_attn.core, step 1;
    the README's documented BF16-operand boundary width may name it `boundary` instead (debatable)."""
    return _patch_module_fn(model, "torch_recurrent_gated_delta_rule", _gdn_decode_q_scaled(1.005))
