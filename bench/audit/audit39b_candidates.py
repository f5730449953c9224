"""Audit 39b: a fifth held-out set of candidate paths for ulptrace's onset, aimed at FALSE ALARMS (honest
implementations that must not read `error`) and at sites earlier audits touched little (the GatedDeltaNet gated norm,
conv at decode, gates, out_proj; fused projections; the key side of RoPE; shapes and dtypes of site outputs).
Defects d3*, valid variants v3*, x3* = behaviour to report. Run: `PYTHONPATH=bench/audit python -m ulptrace onset
--candidate audit39b_candidates:NAME --prompts 2 --prompt-len 16 --new-tokens 3 ...` (bench/audit/audit39b_runall.sh
runs them all).

Each function patches an HF model in place and returns an undo callable. Written from HF's modeling code
(transformers 5.25: qwen3_5/modeling_qwen3_5.py, llama/modeling_llama.py, integrations/sdpa_attention.py), not from
ulptrace's kernels. Steps: 0 is the prefill (16 tokens), 1 and 2 are one-token decode steps. Qwen3.5's GatedDeltaNet
layers are 0 and 2, its full-attention layers 1 and 3; Llama has three full-attention layers. None of these repeats
an idea of audits 31/32/36/36g/36s/39 (already covered and left out: RMSNorm 1/sqrt (31 v01), FP64 norms (36 v88),
sum*(1/n) (31 v10), LM head FP32 once (32 v40), split-K by 4 = per-head o_proj partials (39 v202), sigmoid gate in
the gated norm (31 d17), one-hot embedding (36 v78)).

HF facts used (read from the source): Qwen3_5RMSNormGated rounds twice before its output — the normalised x is cast
to BF16, times the BF16 weight (a BF16 multiply, rounds), times silu(gate.float()) in FP32, rounded at the end. In the
tiny model the gated norm's input has mean square ~1e-9 (<< eps 1e-6): the norm is eps-dominated there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from audit31_candidates import _attn_layers, _is_qwen, _layers, _mm, _register_attention, _restore_attrs, _sdpa
from audit32_candidates import _gdns, _patch_module_fn


# --------------------------------------------------------------------------------------------- helpers

def _repeat_kv(x, n):
    """HF's repeat_kv: expand + reshape (not repeat_interleave)."""
    b, h, s, d = x.shape
    if n == 1:
        return x
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def _pairwise_sum(x):
    """Sum over the last dim by a pairwise tree (halving), FP32; the length is padded with zeros to a power of 2."""
    n = x.shape[-1]
    p = 1
    while p < n:
        p *= 2
    if p != n:
        x = F.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x


def _blocked_sum(x, block=16):
    """Sum over the last dim in blocks of ``block`` (each summed sequentially left to right), then the block partials
    added in reverse order (a GPU-style blocked reduction), FP32."""
    n = x.shape[-1]
    parts = []
    for j in range(0, n, block):
        s = x[..., j]
        for i in range(j + 1, min(j + block, n)):
            s = s + x[..., i]
        parts.append(s)
    acc = parts[-1]
    for p in reversed(parts[:-1]):
        acc = acc + p
    return acc.unsqueeze(-1)


def _rmsnorms(model):
    return [m for m in model.modules() if type(m).__name__ in ("Qwen3_5RMSNorm", "LlamaRMSNorm")]


def _norm_eps(norm):
    return norm.eps if hasattr(norm, "eps") else norm.variance_epsilon


def _gdn_forward(gdn, mq, gates=None, post_norm=None):
    """HF's Qwen3_5GatedDeltaNet.forward (no intermediate states; audit36's copy, which was bitwise HF), with
    ``gates(a, b) -> (g, beta)`` and ``post_norm(core_after_norm [b, s, nv, dv]) -> same`` (between the gated norm and
    out_proj) replaceable."""

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
            g, beta = gates(gdn, a, b)
        kw = dict(g=g, beta=beta, initial_state=recurrent_state, output_final_state=cache is not None,
                  use_qk_l2norm_in_kernel=True)
        if recurrent_state is not None and seq_len == 1:
            core, last = mq.torch_recurrent_gated_delta_rule(query, key, value, **kw)
        else:
            core, last = mq.torch_chunk_gated_delta_rule(query, key, value, **kw)
        if cache is not None:
            cache.update_recurrent_state(last, gdn.layer_idx)
        core = gdn.norm(core.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
        core = core.reshape(bsz, seq_len, -1, gdn.head_v_dim)
        if post_norm is not None:
            core = post_norm(core)
        return gdn.out_proj(core.reshape(bsz, seq_len, -1))

    return forward


def _patch_gdns(model, **kw):
    mq = _mm(model)
    patched = []
    for gdn in _gdns(model):
        gdn.forward = _gdn_forward(gdn, mq, **kw)
        patched.append((gdn, "forward"))
    return _restore_attrs(patched)


def _patch_gated_norms(model, make):
    """``make(norm) -> forward(x, gate)`` installed on every GatedDeltaNet's gated norm (instance attribute)."""
    patched = []
    for gdn in _gdns(model):
        gdn.norm.forward = make(gdn.norm)
        patched.append((gdn.norm, "forward"))
    return _restore_attrs(patched)


def _silu_fp32(z):
    zf = z.float()
    return zf / (1.0 + torch.exp(-zf))


def _fused_linears(mods):
    """One GEMM for several nn.Linear modules that read the same input (q/k/v; gate/up): the first module's forward
    runs ``F.linear(x, cat(weights))`` and keeps the other slices, which the later modules return when handed the
    same input tensor (otherwise they run their own GEMM). Modules keep being called, so their hooks fire."""
    state = {"x": None, "outs": None}
    sizes = [m.weight.shape[0] for m in mods]
    first = mods[0]

    def first_forward(x):
        w = torch.cat([m.weight for m in mods], dim=0)
        bias = None if first.bias is None else torch.cat([m.bias for m in mods], dim=0)
        y = F.linear(x, w, bias)
        outs = [t.contiguous() for t in torch.split(y, sizes, dim=-1)]
        state["x"], state["outs"] = x, outs
        return outs[0]

    def later(i, m):
        def forward(x):
            if state["x"] is x and state["outs"] is not None:
                return state["outs"][i]
            return F.linear(x, m.weight, m.bias)
        return forward

    first.forward = first_forward
    for i, m in enumerate(mods[1:], start=1):
        m.forward = later(i, m)
    return [(m, "forward") for m in mods]


# ============================================================================================ VALID

def v301_gated_norm_pairwise_explicit_silu(model):
    """VALID (Qwen3.5): the GatedDeltaNet gated RMSNorm rewritten as a kernel would, keeping HF's three rounding
    points (normalised x -> BF16; times the BF16 weight -> BF16; times the gate in FP32 -> BF16): the mean of squares
    by a pairwise tree in FP32 (HF: torch's mean), the gate's SiLU as z / (1 + exp(-z)) in FP32 (HF: F.silu on FP32).
    Expected: parity (ties or bitwise at layers.{0,2}.linear_attn.norm), no boundary, no error."""
    def make(norm):
        def forward(x, gate):
            xf = x.float()
            ms = _pairwise_sum(xf * xf) / xf.shape[-1]
            h = (xf * torch.rsqrt(ms + norm.variance_epsilon)).to(x.dtype)
            h = norm.weight * h
            return (h.float() * _silu_fp32(gate)).to(x.dtype)
        return forward
    return _patch_gated_norms(model, make)


def v302_rmsnorm_blocked_sumsq(model):
    """VALID (both families): every RMSNorm (input, post-attention, final; Qwen's q/k norms) with its mean of squares
    by a blocked FP32 reduction (blocks of 16 summed left to right, the partials added in reverse order), divided by
    n; rsqrt; HF's rounding points kept (Qwen: (x * r) * (1 + w) in FP32, one rounding; Llama: (x * r) rounded to
    BF16, times w in BF16).
    Expected: parity (ties at the norms), no boundary, no error."""
    patched = []
    for norm in _rmsnorms(model):
        qwen = type(norm).__name__ == "Qwen3_5RMSNorm"

        def forward(x, norm=norm, qwen=qwen):
            xf = x.float()
            ms = _blocked_sum(xf * xf) / xf.shape[-1]
            h = xf * torch.rsqrt(ms + _norm_eps(norm))
            if qwen:
                return (h * (1.0 + norm.weight.float())).to(x.dtype)
            return norm.weight * h.to(x.dtype)

        norm.forward = forward
        patched.append((norm, "forward"))
    return _restore_attrs(patched)


def v303_mlp_gate_up_one_gemm(model):
    """VALID (both families): every MLP's gate_proj and up_proj as ONE BF16 GEMM on the concatenated weights
    [W_gate; W_up] (torch's BF16 GEMM: FP32 accumulation, one rounding), split after. The modules are still called
    (gate first, as HF's forward), so their sites are recorded.
    Expected: parity (bitwise, or ties at mlp.gate_proj / mlp.up_proj)."""
    patched = []
    for layer in _layers(model):
        patched += _fused_linears([layer.mlp.gate_proj, layer.mlp.up_proj])
    return _restore_attrs(patched)


def v304_qkv_one_gemm(model):
    """VALID (both families): every full-attention layer's q_proj, k_proj and v_proj as ONE BF16 GEMM on the
    concatenated weights (Qwen3.5: q_proj's 2x-wide output holding the query and the output gate, then k, v), split
    after. q/k/v projections have no site: where the fused GEMM is not bitwise, the first record that sees the
    difference is q_norm/k_norm (Qwen) or q_rope/core (Llama).
    Expected: parity (bitwise); if the GEMM were not bitwise, `unobserved` at the first consumer (the tool cannot
    judge a projection it has no site for) but never an error."""
    patched = []
    for layer in _attn_layers(model):
        a = layer.self_attn
        patched += _fused_linears([a.q_proj, a.k_proj, a.v_proj])
    return _restore_attrs(patched)


def v305_gdn_conv_explicit_taps_fp32(model):
    """VALID (Qwen3.5): the GatedDeltaNet causal conv written as an explicit FP32 loop over the 4 kernel taps
    (acc = sum_k w_k * x_{t-3+k}, FP32 products and sums, taps in order), rounded to BF16 (HF's F.conv1d output
    rounding), then F.silu on the BF16 tensor (HF's SiLU, rounds again) — HF's rounding points — in both forms
    (prefill causal_conv1d_fn; decode causal_conv1d_update, updating the conv state in place exactly as HF).
    Expected: parity (bitwise or ties at layers.{0,2}.linear_attn.conv), no boundary, no error."""
    def conv(xs, weight, seq_len):
        """xs [b, C, T + K - 1] (history then the new inputs); returns the last seq_len outputs, BF16."""
        k = weight.shape[-1]
        w = weight.float()
        xf = xs.float()
        t = xs.shape[-1] - k + 1
        acc = w[:, 0, None] * xf[:, :, 0:t]
        for i in range(1, k):
            acc = acc + w[:, i, None] * xf[:, :, i:i + t]
        return acc[:, :, -seq_len:].to(weight.dtype)

    def prefill(original):
        def fn(hidden_states, weight, bias=None, activation=None, **kw):
            seq_len = hidden_states.shape[-1]
            xs = F.pad(hidden_states.to(weight.dtype), (weight.shape[-1] - 1, 0))
            out = conv(xs, weight, seq_len)
            if bias is not None:
                out = out + bias[:, None]
            if activation is not None:
                out = F.silu(out)
            return out.to(hidden_states.dtype)
        return fn

    def update(original):
        def fn(hidden_states, conv_state, weight, bias=None, activation=None):
            seq_len = hidden_states.shape[-1]
            new = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
            conv_state.copy_(new[:, :, -conv_state.shape[-1]:])
            out = conv(new, weight, seq_len)
            if bias is not None:
                out = out + bias[:, None]
            if activation is not None:
                out = F.silu(out)
            return out.to(hidden_states.dtype)
        return fn

    u1 = _patch_module_fn(model, "causal_conv1d_fn", prefill)
    u2 = _patch_module_fn(model, "causal_conv1d_update", update)
    return lambda: (u2(), u1())


def v306_gdn_gates_fp64(model):
    """VALID (Qwen3.5): the GatedDeltaNet gates computed in float64 and rounded where HF rounds: g = -exp(A_log) *
    softplus(a + dt_bias) in FP64, rounded to FP32 (HF keeps g FP32); beta = sigmoid(b) in FP64, rounded to BF16
    (HF: b.sigmoid() on the BF16 tensor).
    Expected: parity (ties or bitwise at linear_attn.gates.g / gates.beta; ties downstream), no error."""
    def gates(gdn, a, b):
        g = -gdn.A_log.double().exp() * F.softplus(a.double() + gdn.dt_bias.double())
        beta = torch.sigmoid(b.double()).to(b.dtype)
        return g.float(), beta
    return _patch_gdns(model, gates=gates)


def v307_embed_index_select(model):
    """VALID (both families): the embedding gathered with index_select on the flattened ids (HF: F.embedding).
    Expected: parity, bitwise (no record differs)."""
    emb = model.get_input_embeddings()

    def forward(ids, emb=emb):
        return emb.weight.index_select(0, ids.reshape(-1)).view(*ids.shape, -1)

    emb.forward = forward
    return _restore_attrs([(emb, "forward")])


def v308_attn_gqa_expand_sdpa(model):
    """VALID (both families): the attention function expands the KV heads itself with expand + reshape (HF's
    repeat_kv, not repeat_interleave and not SDPA's enable_gqa, which HF's sdpa path uses on the CPU here) and calls
    torch's SDPA without GQA (is_causal for the prompt, no mask for one query; an explicit mask passed through).
    Expected: parity (bitwise or ties at self_attn.core), no error."""
    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        n = module.num_key_value_groups
        k, v = _repeat_kv(key, n), _repeat_kv(value, n)
        causal = attention_mask is None and query.shape[2] > 1
        if causal and k.shape[2] > query.shape[2]:
            k, v = k[:, :, :query.shape[2]], v[:, :, :query.shape[2]]
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=attention_mask, is_causal=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    return _register_attention(model, "audit39b_gqa_expand", attn)


def v309_sdpa_math_backend(model):
    """VALID (both families): HF's own sdpa attention function run under torch.nn.attention.sdpa_kernel(MATH) (the
    math backend instead of the CPU flash kernel). torch's math backend upcasts BF16 to FP32 (unless
    allow_fp16_bf16_reduction_math_sdp), folds the scale as sqrt(scale) into q and k, FP32 softmax and P@V, one
    rounding at the end.
    Expected: parity (ties at self_attn.core), no boundary, no error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        with sdpa_kernel([SDPBackend.MATH]):
            return _sdpa(module, query, key, value, attention_mask, scaling, dropout=dropout, **kw)
    return _register_attention(model, "audit39b_sdpa_math", attn)


def v310_linear_rows_one_at_a_time(model):
    """VALID (both families): every nn.Linear (projections, MLP, GDN in/out projections, LM head) run on one batch row
    at a time (batch 1, twice) and the rows concatenated — a batch-size-dependent GEMM blocking (HF runs the batch at
    once).
    Expected: parity (bitwise or ties at the linear sites and downstream), no error."""
    patched = []
    for m in model.modules():
        if not isinstance(m, torch.nn.Linear):
            continue

        def forward(x, lin=m):
            if x.dim() < 2 or x.shape[0] == 1:
                return F.linear(x, lin.weight, lin.bias)
            return torch.cat([F.linear(x[i:i + 1], lin.weight, lin.bias) for i in range(x.shape[0])], dim=0)

        m.forward = forward
        patched.append((m, "forward"))
    return _restore_attrs(patched)


# ============================================================================================ DEFECTS

def d301_gated_norm_silu_gate_bf16(model):
    """DEFECT, precision (Qwen3.5): the gated norm's gate SiLU is computed on the BF16 z and stored in BF16
    (F.silu(z) -> BF16, one added rounding) before the final multiply (BF16 weighted x times BF16 silu, FP32 product,
    rounded once — as HF's final rounding). HF takes silu(z.float()) in FP32.
    Expected: `boundary` at layers.0.linear_attn.norm@0 naming the gate's SiLU rounded to BF16 (or ties where the
    rounding does not show); no error."""
    def make(norm):
        def forward(x, gate):
            xf = x.float()
            h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(x.dtype)
            h = norm.weight * h
            return (h.float() * F.silu(gate.to(x.dtype)).float()).to(x.dtype)
        return forward
    return _patch_gated_norms(model, make)


def d302_gated_norm_eps_1e5(model):
    """DEFECT (Qwen3.5): the gated norm kernel hard-codes eps = 1e-5 (Llama's default; the config's rms_norm_eps is
    1e-6). The gated norm's input here has mean square ~1e-9, so the output is ~3.2x too small.
    Expected: error at layers.0.linear_attn.norm@0."""
    def make(norm):
        def forward(x, gate):
            xf = x.float()
            h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
            h = norm.weight * h
            return (h * F.silu(gate.float())).to(x.dtype)
        return forward
    return _patch_gated_norms(model, make)


def d303_conv_decode_window_stale(model):
    """DEFECT (Qwen3.5): the one-token conv update kernel computes its output from the conv state BEFORE appending
    the new input (window x_{t-4..t-1} instead of x_{t-3..t}: the output stale by one token), while it writes the
    state correctly (the new input appended). Prefill is HF's.
    Expected: error at layers.0.linear_attn.conv@1 (conv_state@1 exact)."""
    def make(original):
        def fn(hidden_states, conv_state, weight, bias=None, activation=None):
            seq_len = hidden_states.shape[-1]
            old = conv_state.to(weight.dtype).clone()
            new = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
            conv_state.copy_(new[:, :, -conv_state.shape[-1]:])
            out = F.conv1d(old, weight.unsqueeze(1), bias, padding=0, groups=hidden_states.shape[1])[:, :, -seq_len:]
            if activation is not None:
                out = F.silu(out)
            return out.to(hidden_states.dtype)
        return fn
    return _patch_module_fn(model, "causal_conv1d_update", make)


def d304_conv_decode_taps_reversed(model):
    """DEFECT (Qwen3.5): the one-token conv update kernel applies the kernel taps in reverse order (w[K-1-i]: a
    decode kernel written for the other weight layout; audit32 d56 reversed the prefill's). State update right.
    Expected: error at layers.0.linear_attn.conv@1; prefill at parity."""
    def make(original):
        def fn(hidden_states, conv_state, weight, bias=None, activation=None):
            return original(hidden_states, conv_state, weight.flip(-1), bias, activation)
        return fn
    return _patch_module_fn(model, "causal_conv1d_update", make)


def d305_gdn_k_l2norm_skipped(model):
    """DEFECT (Qwen3.5): both delta-rule kernels L2-normalise the query but not the key (use_qk_l2norm_in_kernel
    honoured for q only). The query is normalised in FP32 with HF's formula and handed to HF's own scan (with the flag
    off) in FP32, output rounded to BF16 as HF.
    Expected: error at layers.0.linear_attn.core@0 (and recurrent_state@0)."""
    def make(original):
        def scan(query, key, value, g, beta, *args, use_qk_l2norm_in_kernel=False, **kw):
            dtype = query.dtype
            q = query.float()
            if use_qk_l2norm_in_kernel:
                q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            out, state = original(q, key.float(), value.float(), g, beta, *args, use_qk_l2norm_in_kernel=False, **kw)
            return out.to(dtype), state
        return scan
    u1 = _patch_module_fn(model, "torch_chunk_gated_delta_rule", make)
    u2 = _patch_module_fn(model, "torch_recurrent_gated_delta_rule", make)
    return lambda: (u2(), u1())


def d306_rmsnorm_one_plus_w_bf16(model):
    """DEFECT, precision (Qwen3.5; lmdeploy #4790's class): every Qwen3_5RMSNorm (input, post-attention, final, q/k)
    forms the zero-centred scale (1 + w) on the BF16 parameter — a BF16 add, rounded — and then multiplies in FP32
    as HF (HF: 1.0 + w.float() in FP32, exact here). The weights are in [-0.42, 0.51], so (1 + w) loses up to ~2^-9
    relative.
    Expected: `boundary` at layers.0.input_layernorm@0 naming the BF16 rounding of (1 + weight) (one added
    rounding of a parameter); an `error` there would be a miss (one named rounding explains it)."""
    patched = []
    for norm in _rmsnorms(model):
        if type(norm).__name__ != "Qwen3_5RMSNorm":
            continue

        def forward(x, norm=norm):
            out = norm._norm(x.float())
            return (out * (1.0 + norm.weight).float()).type_as(x)

        norm.forward = forward
        patched.append((norm, "forward"))
    return _restore_attrs(patched)


def d307_down_proj_square_block_transposed(model):
    """DEFECT (both families): layer 1's down_proj kernel reads its weight's first 128 x 128 block transposed (a
    square tile loaded with the wrong layout; the other two tiles right): y = x[:, :128] W0^T^T + x[:, 128:] W1^T.
    Expected: error at layers.1.mlp.down_proj@0."""
    lin = model.model.layers[1].mlp.down_proj
    n = lin.weight.shape[0]
    w = lin.weight.detach().clone()
    w[:, :n] = lin.weight.detach()[:, :n].t()

    def forward(x):
        return F.linear(x, w.to(x.device))

    lin.forward = forward
    return _restore_attrs([(lin, "forward")])


def d308_attn_head2_zeroed_decode(model):
    """DEFECT (both families): the decode attention kernel of the first full-attention layer (Qwen3.5 layer 1, Llama
    layer 0) leaves head 2's output zero (an unlaunched program of the grid) for one-token queries. Prefill is HF's.
    Expected: error at that layer's self_attn.core@1 (head 2's 32 elements per row, the other heads exact)."""
    first = _attn_layers(model)[0].self_attn.layer_idx

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        out, w = _sdpa(module, query, key, value, attention_mask, scaling, dropout=dropout, **kw)
        if query.shape[2] == 1 and module.layer_idx == first:
            out = out.clone()
            out[:, :, 2] = 0
        return out, w
    return _register_attention(model, "audit39b_head2_zero", attn)


def d309_final_norm_rows_swapped(model):
    """DEFECT (both families): the final norm kernel writes batch row 0's result to row 1 and vice versa (a row-index
    bug in a multi-row launch).
    Expected: error at `norm`@0 (every differing element; rows are different prompts)."""
    norm = model.model.norm
    fwd = type(norm).forward

    def forward(x, norm=norm):
        y = fwd(norm, x)
        return y.flip(0) if y.shape[0] > 1 else y

    norm.forward = forward
    return _restore_attrs([(norm, "forward")])


def d310_k_rope_sin_negated(model):
    """DEFECT (both families): the RoPE kernel rotates the keys the wrong way (sin negated for k only); the queries
    are right. The keys after RoPE have no site of their own.
    Expected: `unobserved` at the first self_attn.core@0 (its key input differs while q_rope and every earlier record
    are equal), never parity."""
    def make(original):
        def apply(q, k, cos, sin, unsqueeze_dim=1):
            q_embed, _ = original(q, k, cos, sin, unsqueeze_dim)
            _, k_embed = original(q, k, cos, -sin, unsqueeze_dim)
            return q_embed, k_embed
        return apply
    return _patch_module_fn(model, "apply_rotary_pos_emb", make)


def d311_gdn_out_proj_heads_swapped(model):
    """DEFECT (Qwen3.5): between the gated norm and out_proj the value heads 0 and 1 are swapped (a reshape /
    head-order bug in a fused norm+out_proj kernel's input layout). The gated norm's own output is right.
    Expected: `unobserved` at layers.0.linear_attn.out_proj@0 (its input differs from the norm's recorded output,
    every earlier record equal) — or an error at out_proj; never parity."""
    def post(core):
        core = core.clone()
        core[:, :, [0, 1]] = core[:, :, [1, 0]]
        return core
    return _patch_gdns(model, post_norm=post)


# ============================================================================================ REPORT BEHAVIOUR

def x301_final_norm_returns_fp32(model):
    """REPORT BEHAVIOUR (both families): the final norm returns its FP32 result (its last BF16 rounding skipped; for
    Llama, w * x computed in FP32 from BF16 operands, exact), and the LM head casts its input to BF16 before the GEMM
    (so the logits are HF's bitwise). The site `norm` is FP32 where HF's is BF16.
    Expected: at `norm`@0 a clear statement of the dtype difference and a `boundary` (the final rounding skipped) or
    ties — never `error`; `logits` exact; no crash (the logits site's recorded input is FP32 too: its semantics must
    cope or say it could not judge)."""
    norm = model.model.norm
    head = model.get_output_embeddings()
    qwen = _is_qwen(model)

    def norm_forward(x, norm=norm):
        xf = x.float()
        h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _norm_eps(norm))
        if qwen:
            return h * (1.0 + norm.weight.float())
        return norm.weight.float() * h.to(x.dtype).float()

    def head_forward(x, head=head):
        return F.linear(x.to(head.weight.dtype), head.weight, head.bias)

    norm.forward = norm_forward
    head.forward = head_forward
    return _restore_attrs([(norm, "forward"), (head, "forward")])


def x302_glu_extra_dim(model):
    """REPORT BEHAVIOUR (both families): every MLP hands down_proj its GLU with an extra unit dim ([b, s, 1, I]; a
    kernel that keeps a broadcast dim) and squeezes it after down_proj; the values are HF's (bitwise). The sites
    mlp.glu and mlp.down_proj then have shape [b, s, 1, *] where HF's is [b, s, *].
    Expected: a clear shape message at layers.0.mlp.glu@0 (same number of elements, different shape) — either judged
    (values equal: parity) or reported as a shape mismatch; never a stack trace, never a silent wrong verdict."""
    patched = []
    for layer in _layers(model):
        mlp = layer.mlp

        def forward(x, mlp=mlp):
            h = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
            return mlp.down_proj(h.unsqueeze(-2)).squeeze(-2)

        mlp.forward = forward
        patched.append((mlp, "forward"))
    return _restore_attrs(patched)


def x303_gdn_beta_fp32(model):
    """REPORT BEHAVIOUR (Qwen3.5, valid): the GatedDeltaNet write strength beta = sigmoid(b) computed in FP32 from the
    BF16 b and kept FP32 into the scan (HF rounds it to BF16: b.sigmoid() on a BF16 tensor); g as HF. The site
    gates.beta is FP32 where HF's is BF16.
    Expected: `boundary` at layers.0.linear_attn.gates.beta@0 naming the skipped BF16 rounding of sigmoid (or a clear
    dtype note), no error; the scan's core/state then differ by inherited ties."""
    def gates(gdn, a, b):
        g = -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)
        return g, torch.sigmoid(b.float())
    return _patch_gdns(model, gates=gates)


# ============================================================================================ second pass (added after
# the first 24 all matched: harder valid variants, and a defect whose effect is far below one ULP on most elements)

def v311_rmsnorm_distributed_weight(model):
    """VALID (Qwen3.5): every Qwen3_5RMSNorm never forms (1 + w): it computes n = x * rsqrt(mean(x^2) + eps) and
    then n + n * w in FP32 (a kernel that distributes the zero-centred scale), one rounding to BF16 at the end as HF.
    FP32 results differ from HF's n * (1 + w) by ~1 FP32 rounding; only elements at a BF16 midpoint can move.
    Expected: parity (ties at the norms), no boundary, no error."""
    patched = []
    for norm in _rmsnorms(model):
        if type(norm).__name__ != "Qwen3_5RMSNorm":
            continue

        def forward(x, norm=norm):
            n = norm._norm(x.float())
            return (n + n * norm.weight.float()).type_as(x)

        norm.forward = forward
        patched.append((norm, "forward"))
    return _restore_attrs(patched)


def v312_gdn_chunk_forward_substitution(model):
    """VALID (Qwen3.5): HF's chunked delta-rule scan on its OWN alternative code path: the branch HF takes under
    torch.export (is_torchdynamo_exporting() true), which builds the inverse of the UT system by explicit forward
    substitution and two matmuls instead of torch.linalg.solve_triangular. Same mathematics, another FP32 order.
    Expected: parity (ties at linear_attn.core / recurrent_state, step 0), no error."""
    mm = _mm(model)

    def make(original):
        def chunk(*a, **kw):
            saved = mm.is_torchdynamo_exporting
            mm.is_torchdynamo_exporting = lambda: True
            try:
                return original(*a, **kw)
            finally:
                mm.is_torchdynamo_exporting = saved
        return chunk
    return _patch_module_fn(model, "torch_chunk_gated_delta_rule", make)


def v313_attn_exp2_softmax(model):
    """VALID (both families): flash-attention's exp2 softmax — scores s = q.k^T in FP32, p = exp2(s * (scale *
    log2 e) - m * (scale * log2 e)) with m the row max of s (the scale and log2 e folded into one FP32 constant), FP32
    normaliser and P@V, output rounded once to BF16. Causal by index, GQA expanded here.
    Expected: parity (ties at self_attn.core), no error."""
    import math

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        n = module.num_key_value_groups
        k, v = _repeat_kv(key, n).float(), _repeat_kv(value, n).float()
        q = query.float()
        s = q @ k.transpose(-1, -2)
        ql, kl = q.shape[2], k.shape[2]
        keep = (torch.arange(kl)[None, :] <= torch.arange(ql)[:, None] + (kl - ql))
        s = s.masked_fill(~keep, float("-inf"))
        c = torch.tensor(scaling * math.log2(math.e), dtype=torch.float32)
        m = s.amax(-1, keepdim=True)
        p = torch.exp2(s * c - m * c)
        out = (p @ v) / p.sum(-1, keepdim=True)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
    return _register_attention(model, "audit39b_exp2", attn)


def d312_gdn_dt_bias_after_softplus(model):
    """DEFECT (Qwen3.5): the gate kernel adds dt_bias after the softplus: g = -exp(A_log) * (softplus(a) + dt_bias)
    (HF: softplus(a + dt_bias)); FP32 as HF. dt_bias here is in [-0.45, 0.62].
    Expected: error at layers.0.linear_attn.gates.g@0."""
    def gates(gdn, a, b):
        g = -gdn.A_log.float().exp() * (F.softplus(a.float()) + gdn.dt_bias.float())
        return g, b.sigmoid()
    return _patch_gdns(model, gates=gates)


def d313_gated_norm_mean_over_token(model):
    """DEFECT, tiny effect (Qwen3.5): the gated norm's mean of squares is taken over all 4 value heads of a token
    (128 values) instead of per head (32) — a kernel launched per token rather than per head. Here the input's mean
    square is ~1e-9, far below eps = 1e-6, so rsqrt(ms + eps) moves by ~1e-3 relative (median; max 9e-3, measured
    by audit39b_direct.py): most elements are bitwise HF's, ~23% move by 1-4 ULP. Every moved element is a real
    defect (the FP32 change is >10^4 x any FP32 rounding-order effect).
    Expected: error at layers.0.linear_attn.norm@0 on the moved elements (a `tie` there would be a miss: no
    rounding order moves rsqrt's argument by 1e-3 relative)."""
    def make(norm, nv=None):
        def forward(x, gate):
            xf = x.float()
            heads = _gdns(model)[0].num_v_heads
            ms = xf.view(-1, heads, xf.shape[-1]).pow(2).mean(dim=(-2, -1), keepdim=True)
            h = (xf.view(-1, heads, xf.shape[-1]) * torch.rsqrt(ms + norm.variance_epsilon)).view_as(xf)
            h = norm.weight * h.to(x.dtype)
            return (h * F.silu(gate.float())).to(x.dtype)
        return forward
    return _patch_gated_norms(model, make)


def v314_gdn_beta_tanh(model):
    """VALID (Qwen3.5): the gate kernel computes beta = sigmoid(b) as 0.5 * (1 + tanh(b / 2)) in FP32 from the BF16
    b, rounded once to BF16 (HF: b.sigmoid() on BF16, i.e. torch's FP32 sigmoid rounded once); g as HF.
    Expected: parity (bitwise or ties at linear_attn.gates.beta), no error."""
    def gates(gdn, a, b):
        g = -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)
        beta = (0.5 * (1.0 + torch.tanh(b.float() * 0.5))).to(b.dtype)
        return g, beta
    return _patch_gdns(model, gates=gates)


def x304_logits_widened_fp32(model):
    """REPORT BEHAVIOUR (both families, valid): the wrapper returns the logits widened to FP32 (logits.float(), as
    serving code and sampling often do): lossless, every value exactly HF's BF16 logit. The `output` site is FP32
    where HF's is BF16; `logits` (the head's own output) is untouched.
    Expected: parity (values bitwise equal) or a clear dtype note; never `boundary` (nothing was left unrounded:
    every value is BF16-representable) and never `error`."""
    from audit32_candidates import _wrap_forward
    return _wrap_forward(model, lambda l: l.float())


def x305_glu_widened_fp32(model):
    """REPORT BEHAVIOUR (both families, valid): every MLP computes the GLU as HF (BF16 silu(gate) * up, rounded) and
    hands it to down_proj widened to FP32 (lossless); down_proj casts its input back to BF16 before the GEMM, so
    everything downstream is HF's bitwise. The `mlp.glu` site is FP32 with values exactly HF's BF16 ones.
    Expected: parity (values equal) or a clear dtype note; never `boundary` / `error`."""
    patched = []
    for layer in _layers(model):
        mlp = layer.mlp

        def forward(x, mlp=mlp):
            h = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
            return mlp.down_proj(h.float())

        def down(x, lin=mlp.down_proj):
            return F.linear(x.to(lin.weight.dtype), lin.weight, lin.bias)

        mlp.forward = forward
        mlp.down_proj.forward = down
        patched += [(mlp, "forward"), (mlp.down_proj, "forward")]
    return _restore_attrs(patched)
