"""Audit 39: a fourth held-out set of candidate paths for ulptrace's onset (defects d2*, valid variants v2*,
x2* = behaviour to report). Run: `PYTHONPATH=bench/audit python -m ulptrace onset --candidate audit39_candidates:NAME
--prompts 2 --prompt-len 16 --new-tokens 3 ...` (bench/audit/audit39_runall.sh runs them all).

Each function patches an HF model in place and returns an undo callable. Written from HF's modeling code
(transformers 5.25: qwen3_5/modeling_qwen3_5.py, llama/modeling_llama.py, integrations/sdpa_attention.py), not from
ulptrace's kernels. Steps: 0 is the prefill (16 tokens), 1 and 2 are one-token decode steps (the candidate is fed the
reference's tokens). Qwen3.5's GatedDeltaNet layers are 0 and 2, its full-attention layers 1 and 3; Llama has three
full-attention layers. None of these repeats an idea of audits 31/32/36/36g/36s. d201b is a follow-up added after the
first pass (to locate d201's result). Results: bench/audit/audit39_summary.md.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from audit31_candidates import (BF16, _attn_layers, _layers, _mixer_call, _mm, _register_attention,
                                _restore_attrs, _sdpa)
from audit32_candidates import _patch_module_fn
from audit36_candidates import _step_tracker


# --------------------------------------------------------------------------------------------- helpers

def _cache_tracker(model):
    """A forward pre-hook on the model keeping the cache object it is handed (decode steps) in ``state['cache']``."""
    state = {"cache": None}

    def hook(module, args, kwargs):
        state["cache"] = kwargs.get("cache") or kwargs.get("past_key_values")
        return args, kwargs

    return state, model.register_forward_pre_hook(hook, with_kwargs=True)


def _expand_kv(module, key, value):
    n = module.num_key_value_groups
    return key.repeat_interleave(n, dim=1), value.repeat_interleave(n, dim=1)


def _causal_keep(q_len, kv_len):
    """bool [q, kv]: key j visible to query i (bottom-right aligned, as HF's cache positions)."""
    i = torch.arange(q_len)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len)[None, :]
    return j <= i


def _explicit_attention(model, name, kernel):
    """Register ``kernel(module, q, k, v, scaling) -> out [b, h, q, d]`` (causal by index, GQA expanded here) as the
    model's attention function."""
    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        k, v = _expand_kv(module, key, value)
        out = kernel(module, query, k, v, scaling)
        return out.transpose(1, 2).contiguous(), None

    return _register_attention(model, name, attn)


def _l2norm(x):
    """HF's l2norm (eps 1e-6), FP32."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _scan(variant="hf"):
    """A token-by-token gated delta-rule kernel written from HF's torch_recurrent_gated_delta_rule (FP32, query scaled
    by 1/sqrt(d_k), output rounded once to the input dtype, state handed on in FP32). Usable in place of either HF
    scan (it takes and ignores ``chunk_size``). ``variant``: ``hf`` (HF's order: decay, read, delta, write, output),
    ``decay_after`` (the state is decayed after the write instead of before the read), ``beta_v`` (the delta is
    beta * v - S^T k instead of beta * (v - S^T k))."""

    def scan(query, key, value, g, beta, chunk_size=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kw):
        out_dtype = query.dtype
        bsz, seq, nk, dk = key.shape
        nv, dv = value.shape[-2:]
        if nk != nv:
            query = query.repeat_interleave(nv // nk, dim=2)
            key = key.repeat_interleave(nv // nk, dim=2)
        q, k, v, b, gg = [x.transpose(1, 2).to(torch.float32).contiguous() for x in (query, key, value, beta, g)]
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q), _l2norm(k)
        q = q / (dk ** 0.5)
        s = (torch.zeros(bsz, nv, dk, dv, dtype=torch.float32, device=v.device) if initial_state is None
             else initial_state.to(torch.float32))
        out = torch.zeros_like(v)
        for i in range(seq):
            decay = gg[:, :, i].exp()[..., None, None]
            q_t, k_t, v_t, b_t = q[:, :, i], k[:, :, i], v[:, :, i], b[:, :, i, None]
            if variant != "decay_after":
                s = s * decay
            kv_mem = (s * k_t.unsqueeze(-1)).sum(dim=-2)
            delta = b_t * v_t - kv_mem if variant == "beta_v" else (v_t - kv_mem) * b_t
            s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
            if variant == "decay_after":
                s = s * decay
            out[:, :, i] = (s * q_t.unsqueeze(-1)).sum(dim=-2)
        return out.transpose(1, 2).contiguous().to(out_dtype), (s if output_final_state else None)

    return scan


def _layer_forward(model, layer, first_add, second_add):
    """HF's decoder-layer forward (either family) with the two residual adds replaced: ``first_add(residual, delta)``
    after the token mixer, ``second_add(residual, delta)`` after the MLP."""
    call = _mixer_call(model)

    def forward(hidden_states, *args, **kwargs):
        residual = hidden_states
        h = layer.input_layernorm(hidden_states)
        h = call(layer, h, *args, **kwargs)
        h = first_add(residual, h)
        residual = h
        h = layer.post_attention_layernorm(h)
        h = layer.mlp(h)
        return second_add(residual, h)

    return forward


def _bf16_add(residual, delta):
    return residual + delta


# ============================================================================================ attention kernels

def d201_attn_scores_bf16(model):
    """DEFECT (precision loss, both families): the attention kernel stores the scaled scores q.k/sqrt(d) in BF16
    before an FP32 softmax (FP32 scores from BF16 q, k; softmax FP32; P@V FP32; output rounded once). HF's sdpa
    (the reference) keeps the scores in FP32.
    VALID? no: a BF16 rounding HF's sdpa does not do.
    REPORT-BEHAVIOUR / expected: `boundary` at the first self_attn.core, step 0 (Qwen layer 1, Llama layer 0), naming
    the scores' BF16 rounding; never parity where the scores are large enough to matter (Qwen's q/k norms make
    |s| ~ 1-5, so the rounding moves p by up to ~2^-8 relative); on Llama (|s| <= ~0.2) the effect is ~0.1 ULP of the
    output and ties or a partial boundary are both defensible."""
    def kernel(module, q, k, v, scaling):
        s = (torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling).to(BF16).float()
        s = s.masked_fill(~_causal_keep(q.shape[2], k.shape[2]), float("-inf"))
        return torch.matmul(torch.softmax(s, -1), v.float()).to(q.dtype)
    return _explicit_attention(model, "audit39_scores_bf16", kernel)


def d201b_attn_scores_bf16_eager_style(model):
    """Follow-up to d201 (both families): the same kernel, but the scores rounded to BF16 the way HF's eager path
    rounds them — q.k^T rounded to BF16, then times the scale rounded to BF16 again (two roundings; d201 rounds the
    FP32 scaled scores once). FP32 softmax, FP32 P@V, output rounded once.
    Expected: `boundary` at the first self_attn.core@0 naming "attention scores rounded to BF16 before the softmax
    ..., as HF's eager path does" (or ties), no error. If this is a boundary while d201 is an error, the difference is
    that the tool's hypothesis set holds only the eager double rounding, not one rounding of the scaled scores."""
    def kernel(module, q, k, v, scaling):
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)).to(BF16)
        s = (s.float() * scaling).to(BF16).float()
        s = s.masked_fill(~_causal_keep(q.shape[2], k.shape[2]), float("-inf"))
        return torch.matmul(torch.softmax(s, -1), v.float()).to(q.dtype)
    return _explicit_attention(model, "audit39_scores_bf16_eager", kernel)


def d203_decode_attn_reads_other_layer_kv(model):
    """DEFECT (both families): at decode, the attention kernel of the second full-attention layer (Qwen3.5 layer 3,
    Llama layer 1) reads the KV cache of the first (Qwen3.5 layer 1, Llama layer 0) — a paged-attention kernel handed
    the wrong layer's block table. The K/V the module passes to the attention function (recorded) are right; the
    kernel ignores them.
    Expected: error at layers.3.self_attn.core@1 (Qwen3.5) / layers.1.self_attn.core@1 (Llama); prefill at parity."""
    state, handle = _cache_tracker(model)
    attn_layers = [l.self_attn.layer_idx for l in _attn_layers(model)]
    src, dst = attn_layers[0], attn_layers[1]

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        cache = state["cache"]
        if query.shape[2] == 1 and module.layer_idx == dst and cache is not None:
            other = cache.layers[src]
            key, value = other.keys, other.values
        return _sdpa(module, query, key, value, attention_mask, scaling, dropout=dropout, **kw)

    undo = _register_attention(model, "audit39_kv_other_layer", attn)
    return lambda: (undo(), handle.remove())


def d214_attn_softmax_plus_one(model):
    """DEFECT (both families): the attention kernel's softmax has an extra zero logit in its denominator
    (exp(s_j) / (1 + sum exp(s)): a 'quiet softmax' / attention sink of logit 0 switched on for a model without
    sinks). FP32 throughout, output rounded once.
    Expected: error at the first self_attn.core, step 0 (Qwen layer 1, Llama layer 0)."""
    def kernel(module, q, k, v, scaling):
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
        s = s.masked_fill(~_causal_keep(q.shape[2], k.shape[2]), float("-inf"))
        m = s.amax(-1, keepdim=True).clamp(min=0.0)
        e = torch.exp(s - m)
        p = e / (e.sum(-1, keepdim=True) + torch.exp(-m))
        return torch.matmul(p, v.float()).to(q.dtype)
    return _explicit_attention(model, "audit39_softmax_plus_one", kernel)


def v201_attn_online_softmax_fp32(model):
    """VALID (both families): flash-style attention — keys in blocks of 4, a running max, a running denominator and a
    rescaled FP32 accumulator (online softmax), everything FP32 from the BF16 q/k/v, the output divided by the
    denominator and rounded once to BF16.
    Expected: parity (ties at self_attn.core), no boundary, no error."""
    def kernel(module, q, k, v, scaling):
        qf, kf, vf = q.float(), k.float(), v.float()
        q_len, kv_len = q.shape[2], k.shape[2]
        keep = _causal_keep(q_len, kv_len)
        m = torch.full((*q.shape[:3], 1), float("-inf"))
        l = torch.zeros(*q.shape[:3], 1)
        acc = torch.zeros(*q.shape[:3], v.shape[-1])
        for j0 in range(0, kv_len, 4):
            j1 = min(j0 + 4, kv_len)
            s = torch.matmul(qf, kf[:, :, j0:j1].transpose(-1, -2)) * scaling
            s = s.masked_fill(~keep[:, j0:j1], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, vf[:, :, j0:j1])
            m = m_new
        return (acc / l).to(q.dtype)
    return _explicit_attention(model, "audit39_online_softmax", kernel)


# ============================================================================================ RoPE, KV cache

def d213_decode_rope_positions_stuck(model):
    """DEFECT (both families): the decode loop does not advance the rotary position after the first decode step:
    step 2 gets step 1's position (P, P again instead of P, P+1). Prefill and step 1 are right.
    Expected: unobserved at the first self_attn.q_rope, step 2 (Qwen layer 1, Llama layer 0): its cos/sin inputs
    differ while every earlier record of the step is equal (the tables are not a site)."""
    rot = model.model.rotary_emb
    original = rot.forward
    state = {"first": None}

    def forward(x, position_ids, *a, **kw):
        if position_ids.shape[-1] > 1:
            state["first"] = None
        elif state["first"] is None:
            state["first"] = position_ids.clone()
        else:
            position_ids = state["first"]
        return original(x, position_ids, *a, **kw)

    rot.forward = forward
    return _restore_attrs([(rot, "forward")])


def d215_rope_ignores_partial_rotary(model):
    """DEFECT (Qwen3.5): the RoPE kernel ignores partial_rotary_factor (0.25): it builds its own tables for the whole
    head (rotary dim 32, theta from the config, NeoX pairing (i, i+16)) and rotates all 32 dims; HF rotates the first
    8 (pairs (i, i+4)) and passes the other 24 through.
    Expected: error at layers.1.self_attn.q_rope@0 (token 0, position 0, unchanged; every later token wrong)."""
    rot = model.model.rotary_emb
    state = {"pos": None}

    def pre(module, args, kwargs):
        pos = args[1] if len(args) > 1 else kwargs.get("position_ids")
        state["pos"] = pos[0] if pos.dim() == 3 else pos
        return None

    h = rot.register_forward_pre_hook(pre, with_kwargs=True)
    theta = model.config.rope_parameters["rope_theta"]
    head_dim = model.config.head_dim
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def make(original):
        def apply(q, k, cos, sin, unsqueeze_dim=1):
            freqs = state["pos"][..., None].float() * inv
            emb = torch.cat((freqs, freqs), dim=-1)
            return original(q, k, emb.cos().to(cos.dtype), emb.sin().to(sin.dtype), unsqueeze_dim)
        return apply

    undo = _patch_module_fn(model, "apply_rotary_pos_emb", make)
    return lambda: (undo(), h.remove())


def x202_kv_cache_fp8(model):
    """REPORT BEHAVIOUR (both families): an FP8 KV cache — after each attention layer ran, the K/V it wrote to the
    cache are stored as float8_e4m3fn (no scale) and read back as BF16 by later steps (the step that wrote them used
    them unrounded). A deliberate precision choice in code no site observes.
    Expected: unobserved at the first self_attn.core, step 1 (its key/value inputs differ, every earlier record of
    the step equal); never parity, never an error blamed on a site."""
    handles = []
    for layer in _attn_layers(model):
        attn = layer.self_attn

        def hook(module, args, kwargs, out, attn=attn):
            cache = kwargs.get("cache") or kwargs.get("past_key_values")
            if cache is None:
                return
            entry = cache.layers[attn.layer_idx]
            n = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1]
            with torch.no_grad():
                for t in (entry.keys, entry.values):
                    t[..., -n:, :] = t[..., -n:, :].to(torch.float8_e4m3fn).to(t.dtype)

        handles.append(attn.register_forward_hook(hook, with_kwargs=True))
    return lambda: [h.remove() for h in handles]


# ============================================================================================ Qwen3.5 attention gate

def x201_attn_out_gate_fp32_once(model):
    """REPORT BEHAVIOUR (Qwen3.5, valid): the gated attention's output gate fused in FP32 — attn_out * sigmoid(gate)
    computed in FP32 from the BF16 core output and gate, rounded once (HF rounds sigmoid(gate) to BF16, then the
    product). A deliberate boundary (one rounding skipped) at a step no site judges.
    Expected: no error anywhere; the gate has no site, so the onset is `unobserved` at layers.1.self_attn.o_proj@0
    (its input differs by <= 1 ULP while self_attn.core is equal) — or a named boundary; parity would also be
    defensible only if the tool judged the gate."""
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
            out = (out.float() * torch.sigmoid(gate.float())).to(out.dtype)
            return attn.o_proj(out), w

        attn.forward = forward
        patched.append((attn, "forward"))
    return _restore_attrs(patched)


# ============================================================================================ Qwen3.5 GatedDeltaNet

def d202_gdn_state_row0_shared_decode(model):
    """DEFECT (Qwen3.5): the one-token delta-rule kernel reads batch row 0's recurrent state for every row (state
    pointer without a batch stride). The state the module hands the kernel (recorded) is right.
    Expected: error at layers.0.linear_attn.core@1 (batch row 1's elements only; row 0 bitwise), and
    linear_attn.recurrent_state@1 too; prefill at parity."""
    def make(original):
        def rec(query, key, value, g, beta, initial_state=None, **kw):
            if initial_state is not None and initial_state.shape[0] > 1:
                initial_state = initial_state[:1].expand_as(initial_state).contiguous()
            return original(query, key, value, g, beta, initial_state=initial_state, **kw)
        return rec
    return _patch_module_fn(model, "torch_recurrent_gated_delta_rule", make)


def d204_gdn_decay_after_update(model):
    """DEFECT (Qwen3.5): both scans (prefill and decode) run a token-by-token kernel that decays the state after the
    delta-rule write instead of before the read: kv = S k; S += k beta (v - kv); S *= exp(g) (HF: S *= exp(g) first).
    The same kernel with HF's order is v205 (valid).
    Expected: error at layers.0.linear_attn.core@0 (and recurrent_state@0)."""
    scan = _scan("decay_after")
    u1 = _patch_module_fn(model, "torch_chunk_gated_delta_rule", lambda original: scan)
    u2 = _patch_module_fn(model, "torch_recurrent_gated_delta_rule", lambda original: scan)
    return lambda: (u2(), u1())


def d205_gdn_delta_beta_on_v_only_decode(model):
    """DEFECT (Qwen3.5): the one-token delta-rule kernel writes S += k (beta v - S^T k) (beta on v only) instead of
    HF's S += k beta (v - S^T k). Prefill is HF's chunked scan.
    Expected: error at layers.0.linear_attn.core@1 (and recurrent_state@1); prefill at parity."""
    return _patch_module_fn(model, "torch_recurrent_gated_delta_rule", lambda original: _scan("beta_v"))


def d206_conv_shifted_prefill(model):
    """DEFECT (Qwen3.5): the prefill causal conv is shifted by one: padding K (not K-1) before taking the first
    seq_len outputs, so output t sees inputs t-K..t-1 instead of t-K+1..t (the newest token is never seen). The conv
    state written to the cache is right (the cache does that before the kernel).
    Expected: error at layers.0.linear_attn.conv@0."""
    def make(original):
        def fn(hidden_states, weight, bias=None, activation=None, **kw):
            seq_len = hidden_states.shape[-1]
            out = F.conv1d(hidden_states.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1],
                           groups=hidden_states.shape[1])[:, :, :seq_len]
            if activation is not None:
                out = F.silu(out)
            return out.to(hidden_states.dtype)
        return fn
    return _patch_module_fn(model, "causal_conv1d_fn", make)


def _silu_fp32(x):
    xf = x.float()
    return xf / (1.0 + torch.exp(-xf))


def v203_gdn_conv_silu_fp32_once(model):
    """VALID, deliberate boundary (Qwen3.5): the causal conv + SiLU fused in FP32 — FP32 operands and accumulation,
    SiLU written as x / (1 + exp(-x)) in FP32, one rounding to BF16 at the end (HF: the BF16 conv output is rounded,
    then F.silu on it rounds again), in both forms (prefill causal_conv1d_fn; decode causal_conv1d_update, which
    updates the conv state in place exactly as HF). The explicit SiLU alone is bitwise F.silu on these inputs (checked:
    0 of 200,000 differ), so every difference is the skipped conv rounding.
    Expected: no error; `boundary` at layers.0.linear_attn.conv@0 naming the skipped BF16 rounding of the conv output
    (or ties)."""
    def prefill(original):
        def fn(hidden_states, weight, bias=None, activation=None, **kw):
            seq_len = hidden_states.shape[-1]
            out = F.conv1d(hidden_states.float(), weight.float().unsqueeze(1), None if bias is None else bias.float(),
                           padding=weight.shape[-1] - 1, groups=hidden_states.shape[1])[:, :, :seq_len]
            if activation is not None:
                out = _silu_fp32(out)
            return out.to(hidden_states.dtype)
        return fn

    def update(original):
        def fn(hidden_states, conv_state, weight, bias=None, activation=None):
            seq_len = hidden_states.shape[-1]
            new = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
            conv_state.copy_(new[:, :, -conv_state.shape[-1]:])
            out = F.conv1d(new.float(), weight.float().unsqueeze(1), None if bias is None else bias.float(),
                           padding=0, groups=hidden_states.shape[1])[:, :, -seq_len:]
            if activation is not None:
                out = _silu_fp32(out)
            return out.to(hidden_states.dtype)
        return fn

    u1 = _patch_module_fn(model, "causal_conv1d_fn", prefill)
    u2 = _patch_module_fn(model, "causal_conv1d_update", update)
    return lambda: (u2(), u1())


def v204_gdn_chunk_size_5(model):
    """VALID (Qwen3.5): HF's chunked delta-rule scan with chunk_size=5 (HF: 64): the 16-token prefill padded to 20,
    four chunks, the last with one real token (audit32 covered 8 and 16, divisors of 16).
    Expected: parity (ties at linear_attn.core / recurrent_state)."""
    def make(original):
        def chunk(*a, **kw):
            kw["chunk_size"] = 5
            return original(*a, **kw)
        return chunk
    return _patch_module_fn(model, "torch_chunk_gated_delta_rule", make)


def v205_gdn_prefill_token_by_token(model):
    """VALID (Qwen3.5): the prefill runs a token-by-token FP32 kernel (HF's recurrent form, written out here) instead
    of the chunked scan; decode as HF. Control for d204 (the same kernel with HF's order).
    Expected: parity (ties at linear_attn.core / recurrent_state, step 0)."""
    return _patch_module_fn(model, "torch_chunk_gated_delta_rule", lambda original: _scan("hf"))


# ============================================================================================ MLP, residual, norms

def d207_final_norm_twice(model):
    """DEFECT (both families): the final RMSNorm is applied twice (norm(norm(x)); a fused 'add + norm' epilogue on
    the last layer and the model's own norm both ran).
    Expected: error at `norm`@0."""
    norm = model.model.norm
    fwd = type(norm).forward

    def forward(x, norm=norm):
        return fwd(norm, fwd(norm, x))

    norm.forward = forward
    return _restore_attrs([(norm, "forward")])


def d208_o_proj_added_twice_layer1(model):
    """DEFECT (both families): in layer 1 (Qwen3.5: full attention; Llama: attention) the token mixer's output is
    added to the residual twice (a fused o_proj epilogue adds the residual, and the layer adds o_proj's output
    again): h = (residual + d) + d, two BF16 adds.
    Expected: error at layers.1.post_attention_layernorm@0 (judged as norm(residual + delta)) and
    layers.1.residual_attn@0."""
    layer = model.model.layers[1]
    layer.forward = _layer_forward(model, layer, lambda r, d: (r + d) + d, _bf16_add)
    return _restore_attrs([(layer, "forward")])


def d209_glu_fp16_roundtrip(model):
    """DEFECT (both families, small): the GLU (HF's roundings: silu(gate) BF16, times up BF16) is stored through an
    FP16 buffer before down_proj (BF16 -> FP16 -> BF16). Exact for |x| >= 2^-14; below, FP16's subnormal spacing
    2^-24 is coarser than BF16's for |x| < 2^-16, so those elements lose bits (and |x| < 2^-25 flush to zero).
    Expected: error at layers.0.mlp.glu@0, only the few tiny elements differing (the candidate check counts them)."""
    patched = []
    for layer in _layers(model):
        mlp = layer.mlp

        def forward(x, mlp=mlp):
            h = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
            return mlp.down_proj(h.to(torch.float16).to(h.dtype))

        mlp.forward = forward
        patched.append((mlp, "forward"))
    return _restore_attrs(patched)


def d212_nan_one_element_decode(model):
    """DEFECT (both families, minimal, nonfinite): at decode step 2 only, one element of layer 1's down_proj output
    (batch row 1, channel 3) is NaN (an uninitialised tail element).
    Expected: nonfinite at layers.1.mlp.down_proj@2, exactly one element; everything before bitwise or ties."""
    state, handle = _step_tracker(model)
    lin = model.model.layers[1].mlp.down_proj

    def forward(x, lin=lin):
        y = F.linear(x, lin.weight)
        if state["step"] == 2 and y.shape[0] > 1:
            y = y.clone()
            y[1, -1, 3] = float("nan")
        return y

    lin.forward = forward
    undo = _restore_attrs([(lin, "forward")])
    return lambda: (undo(), handle.remove())


def v202_linear_splitk4_fp32(model):
    """VALID (both families): every nn.Linear (projections, GDN in/out projections, MLP, LM head) as a split-K GEMM:
    K in 4 slices, each partial product FP32 (FP32 operands, FP32 accumulation), the partials added in FP32 in
    reverse order (slice 3 + 2 + 1 + 0), rounded once to BF16.
    Expected: parity (ties at the linear sites and downstream)."""
    patched = []
    for m in model.modules():
        if not isinstance(m, torch.nn.Linear):
            continue

        def forward(x, lin=m):
            w = lin.weight.float()
            xs = torch.tensor_split(x.float(), 4, dim=-1)
            ws = torch.tensor_split(w, 4, dim=-1)
            parts = [xi @ wi.t() for xi, wi in zip(xs, ws)]
            y = parts[3]
            for p in reversed(parts[:3]):
                y = y + p
            if lin.bias is not None:
                y = y + lin.bias.float()
            return y.to(x.dtype)

        m.forward = forward
        patched.append((m, "forward"))
    return _restore_attrs(patched)


def v206_residual_add_fp32_once(model):
    """VALID (both families): both residual adds of every layer computed as (residual.float() + delta.float()),
    rounded once to BF16. HF's `residual + hidden_states` is a BF16 tensor add, which torch computes as exactly this
    (the FP32 sum of two BF16 values, rounded once).
    Expected: parity, bitwise (no record differs)."""
    def add(r, d):
        return (r.float() + d.float()).to(r.dtype)
    patched = []
    for layer in _layers(model):
        layer.forward = _layer_forward(model, layer, add, add)
        patched.append((layer, "forward"))
    return _restore_attrs(patched)


# ============================================================================================ embedding, head

def d210_lm_head_bias(model):
    """DEFECT (both families): the LM head adds a bias vector (a stale 'bias row' of an augmented GEMM; the model's
    head has none): logits = x W^T + b, b_j = 0.03 sin(j) in BF16, one BF16 GEMM with bias.
    Expected: error at `logits`@0 (then `output`)."""
    head = model.get_output_embeddings()
    bias = (0.03 * torch.sin(torch.arange(head.weight.shape[0], dtype=torch.float32))).to(head.weight.dtype)

    def forward(x, head=head):
        return F.linear(x, head.weight, bias.to(x.device))

    head.forward = forward
    return _restore_attrs([(head, "forward")])


def d211_embed_token0_zeroed(model):
    """DEFECT (both families): the embedding kernel returns zeros for token id 0 (treats it as padding; the model has
    no pad token). With the default seed no prompt holds id 0: a LATENT defect, expected parity (no false alarm) unless
    a generated token is 0. Run with --seed 4 (row 1, position 11 is id 0): expected onset at `embed`@0 (the
    embedding has no oracle semantics: a difference with every recorded input equal), 128 elements of one token."""
    emb = model.get_input_embeddings()

    def forward(ids, emb=emb):
        out = F.embedding(ids, emb.weight)
        return out.masked_fill((ids == 0).unsqueeze(-1), 0.0)

    emb.forward = forward
    return _restore_attrs([(emb, "forward")])
