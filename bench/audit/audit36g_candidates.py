"""Audit 36g (2026-12-05h): held-out candidate paths for ulptrace's GENERATION diagnostics (matrix, lockstep,
batch-invariance) and trace_norm_rounding. Defects d*, valid variants v*, x* = behaviour to report.
Run: `PYTHONPATH=bench/audit ulptrace batch-invariance --path audit36g_candidates:NAME ...` (and matrix/lockstep);
bench/audit/audit36g_runall.sh runs the whole audit.

Each function patches an HF model in place and returns an undo callable. Written from HF's modeling code
(transformers 5.25: qwen3_5/modeling_qwen3_5.py, llama/modeling_llama.py, integrations/sdpa_attention.py), not
from ulptrace.kernels. Helpers come from the earlier audit files.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from audit31_candidates import _register_attention, _restore_attrs, _sdpa
from audit32_candidates import _state_to_cache, _wrap_forward


# --------------------------------------------------------------------------------------------- helpers

def _norm_eps(norm):
    return norm.eps if hasattr(norm, "eps") else norm.variance_epsilon


def _finish_norm(norm, out, x):
    """HF's weight application and rounding for either family, from FP32 normalised ``out``."""
    if type(norm).__name__ == "Qwen3_5RMSNorm":
        return (out * (1.0 + norm.weight.float())).type_as(x)
    return norm.weight * out.to(x.dtype)


def _position_tracker(model):
    """A pre-hook on the rotary embedding: state['step'] = the decode step of the current forward (0 = prefill),
    from the position ids it is given (the prefill's length remembered)."""
    state = {"step": 0, "prompt": None}

    def hook(module, args, kwargs):
        pos = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if pos is None:
            return None
        if pos.shape[-1] > 1:
            state["step"], state["prompt"] = 0, pos.shape[-1]
        elif state["prompt"] is not None:
            state["step"] = int(pos.max()) - state["prompt"] + 1
        return None

    h = model.model.rotary_emb.register_forward_pre_hook(hook, with_kwargs=True)
    return state, h


def _visible(mask, q_len, kv_len, batch, device):
    """The attention mask as bool 'visible' [B|1, 1, q, kv] (None: causal with top-left alignment, as HF's sdpa)."""
    if mask is None:
        i = torch.arange(q_len, device=device)[:, None]
        j = torch.arange(kv_len, device=device)[None, :]
        return (j <= i + (kv_len - q_len) if q_len > 1 else torch.ones(q_len, kv_len, dtype=torch.bool,
                                                                      device=device)).expand(1, 1, q_len, kv_len)
    if mask.dtype == torch.bool:
        return mask
    return mask == 0


# ============================================================================================ VALID

def v01_mlp_bitwise_copy(model):
    """VALID, bitwise: every MLP rewritten from HF's Qwen3_5MLP/LlamaMLP.forward with the same ops in the same
    order (act(gate(x)) * up(x) -> down). Expected everywhere: bitwise equal to hf (matrix all exact, lockstep
    bitwise every step, batch-invariance all exact, trace_norm_rounding exit 0)."""
    patched = []
    for layer in model.model.layers:
        mlp = layer.mlp

        def forward(x, mlp=mlp):
            return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

        mlp.forward = forward
        patched.append((mlp, "forward"))
    return _restore_attrs(patched)


def _linear_fp32(batch_split: bool):
    def patch(model):
        patched = []
        for m in model.modules():
            if not isinstance(m, torch.nn.Linear):
                continue

            def forward(x, m=m):
                if batch_split and x.shape[0] == 1:
                    return F.linear(x, m.weight, m.bias)
                w = m.weight.float()
                k = w.shape[1]
                if batch_split:  # a split-K tile: two FP32 partial sums added in FP32, one rounding
                    h = k // 2
                    y = x[..., :h].float() @ w[:, :h].t() + x[..., h:].float() @ w[:, h:].t()
                else:  # FP32 accumulation of the whole dot product (torch's FP32 matmul order), one rounding
                    y = x.float() @ w.t()
                if m.bias is not None:
                    y = y + m.bias.float()
                return y.to(x.dtype)

            m.forward = forward
            patched.append((m, "forward"))
        return _restore_attrs(patched)
    return patch


v02_linear_splitk_when_batched = _linear_fp32(True)
v02_linear_splitk_when_batched.__doc__ = (
    "VALID but batch-VARIANT: every nn.Linear (projections, MLP, LM head) switches at batch > 1 to a split-K tile "
    "(two FP32 partial sums added in FP32, rounded once) — an honest FP32 order per row; at batch 1 it is HF's "
    "F.linear. Expected: batch-invariance reports any divergent row as batch-variant, near-tie, onset none (every "
    "difference a tie); never an error/boundary.")

v03_linear_fp32_accum = _linear_fp32(False)
v03_linear_fp32_accum.__doc__ = (
    "VALID: every nn.Linear computed as an FP32 matmul of the upcast operands, rounded once to BF16 (another FP32 "
    "summation order than the BF16 GEMM's). Expected: token flips, if any, near-tie; onset none (ties).")


# ============================================================================================ DEFECTS

def d01_final_norm_eps_batch_max(model):
    """DEFECT, batch-VARIANT: the final RMSNorm's epsilon grows with the batch's largest mean square:
    eps_row = eps + 0.5 * (max over the batch of mean(x^2) - own mean(x^2)). Alone (batch 1) it is exactly HF.
    Expected: batch-invariance: rows diverge at batch > 1 (a real error, onset `norm`: error); matrix: batch 1
    exact, larger batches divergent; trace_norm_rounding --prompts 2: error at `norm`, exit 1."""
    norm = model.model.norm

    def forward(x, norm=norm):
        xf = x.float()
        ms = xf.pow(2).mean(-1, keepdim=True)
        batch_max = ms.amax(0, keepdim=True)  # per position, over the batch's rows
        eps = _norm_eps(norm) + 0.5 * (batch_max - ms)
        return _finish_norm(norm, xf * torch.rsqrt(ms + eps), x)

    norm.forward = forward
    return _restore_attrs([(norm, "forward")])


def d02_attn_batch4_drops_newest_key(model):
    """DEFECT only at batch >= 4: the decode attention kernel's batch>=4 variant (another tile) drops the newest
    key (the current token) of every row; batches 1 and 2 run HF's sdpa. Expected: batch-invariance --batches 1 2 4:
    batch 2 exact, batch 4 divergent, located at self_attn.core (error); matrix the same per batch."""

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        b, _, q_len, _ = query.shape
        if b < 4 or q_len != 1:
            return _sdpa(module, query, key, value, attention_mask, scaling, dropout=dropout, **kw)
        kv = key.shape[2]
        vis = _visible(attention_mask, q_len, kv, b, query.device).expand(b, 1, q_len, kv).clone()
        idx = torch.arange(kv, device=query.device).view(1, 1, 1, kv)
        last = torch.where(vis, idx, -1).amax(-1, keepdim=True)
        vis &= idx != last
        return _sdpa(module, query, key, value, vis, scaling, dropout=dropout, **kw)

    return _register_attention(model, "audit36g_b4", attn)


def d03_raises_when_batched(model):
    """REPORT BEHAVIOUR: the kernel supports batch 1 only and raises for a larger batch (a RuntimeError from its
    launcher). Expected: one clear line naming the candidate's frame and message (no ulptrace traceback), exit != 0,
    no report claiming invariance/parity."""
    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is not None and ids.shape[0] > 1:
            raise RuntimeError(f"audit36g: fused kernel supports batch 1 only, got batch {ids.shape[0]}")
        return None

    h = model.register_forward_pre_hook(hook, with_kwargs=True)
    return h.remove


def d04_final_norm_eps_from_step5(model):
    """DEFECT only from decode step 5 on: the final norm's epsilon becomes 1e-1 (a kernel variant chosen for
    longer sequences). Expected: matrix (16 new tokens) divergent rows located at `norm` error, step >= 5;
    lockstep/batch-invariance/trace_norm_rounding at their default 4 tokens (steps 0..3) cannot see it — they must
    not claim more than the steps they ran; with --new-tokens 8: error at `norm`, step 5."""
    norm = model.model.norm
    state, h = _position_tracker(model)

    def forward(x, norm=norm):
        xf = x.float()
        eps = 1e-1 if state["step"] >= 5 else _norm_eps(norm)
        return _finish_norm(norm, xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), x)

    norm.forward = forward
    undo = _restore_attrs([(norm, "forward")])
    return lambda: (undo(), h.remove())


def d05_attn_ignores_mask(model):
    """DEFECT, cache-dependent: the attention kernel ignores the attention mask (is_causal for a prompt, no mask
    for one query), which is exactly HF under a dynamic cache but attends to the zero-padded slots of a static cache
    at decode. Expected: matrix eager exact, static divergent (error at self_attn.core, step >= 1); lockstep
    --candidate-mode static: error at self_attn.core at every decode step, none at the prefill."""

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        return _sdpa(module, query, key, value, None, scaling, dropout=dropout, **kw)

    return _register_attention(model, "audit36g_nomask", attn)


def d06_logits_doubled(model):
    """DEFECT that keeps every argmax: the returned logits are multiplied by 2 (exact in BF16: same argmax, same
    ties). Expected: token parity all exact — correct only as a TOKEN-level statement; lockstep: logits differ at
    every step, onset at `output` (error)."""
    return _wrap_forward(model, lambda logits: logits * 2)


def d07_logits_nondeterministic(model):
    """DEFECT, nondeterministic: the returned logits get a random relative perturbation of ~2^-7 (a non-repeatable
    atomic reduction), drawn from an OS-seeded generator, so two runs of the same inputs differ. Expected: a
    same-path comparison (lockstep/matrix with this path as reference AND candidate) must not read as identical;
    batch-invariance should not blame the batch for run-to-run noise (or at least say the path did not repeat)."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))

    def post(logits):
        noise = torch.randn(logits.shape, generator=gen).to(logits.device)
        return (logits.float() * (1 + 2.0 ** -7 * noise)).to(logits.dtype)

    return _wrap_forward(model, post)


def d08_final_norm_no_weight(model):
    """DEFECT, gross: the final norm applies no weight (scale 1 instead of (1 + w) / w). Expected: divergent rows
    that are NOT near-ties (a real divergence), located at `norm`: error."""
    norm = model.model.norm

    def forward(x, norm=norm):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + _norm_eps(norm))).to(x.dtype)

    norm.forward = forward
    return _restore_attrs([(norm, "forward")])


def d09_gdn_state_to_cache_scaled_decode(model):
    """DEFECT (Qwen3.5), state-only: the decode scan's output is right, but the recurrent state it hands the cache
    is scaled by 0.98. Expected: lockstep (restored): logits bitwise at each step, states differ, onset at
    recurrent_state (error); free-running: the logits start to differ from step 2."""
    return _state_to_cache(model, lambda s: s * 0.98, "torch_recurrent_gated_delta_rule")


def d11_final_norm_batch_mean_leak(model):
    """DEFECT, batch-VARIANT and small: at batch > 1 the final norm's input gets 2^-9 x the batch mean of the rows
    mixed in (a cross-row reduction bug). Alone it is HF. Expected: logits of batched rows differ from alone;
    tokens probably do not: batch-invariance then says 'exact' — correct only as a token-level statement."""
    norm = model.model.norm
    orig = norm.forward

    def forward(x, norm=norm):
        if x.shape[0] > 1:
            x = (x.float() + 2.0 ** -9 * x.float().mean(0, keepdim=True)).to(x.dtype)
        return orig(x)

    norm.forward = forward
    return _restore_attrs([(norm, "forward")])


def d12_glu_gelu(model):
    """DEFECT outside every norm: the MLP uses tanh-GELU instead of SiLU. Expected (trace_norm_rounding): the norms
    themselves are honest (ties, inherited) — a norm-only tool may exit 0, but should not read as 'the candidate is
    fine'; onset would name mlp.glu."""
    patched = []
    for layer in model.model.layers:
        mlp = layer.mlp

        def forward(x, mlp=mlp):
            return mlp.down_proj(F.gelu(mlp.gate_proj(x), approximate="tanh") * mlp.up_proj(x))

        mlp.forward = forward
        patched.append((mlp, "forward"))
    return _restore_attrs(patched)


def d13_input_norm_eps_batch_max(model):
    """DEFECT, batch-VARIANT (norm kind): every input_layernorm uses eps + 0.5*(batch max ms - own ms), as d01 but
    inside the decoder. Expected: trace_norm_rounding --prompts 2: error at a layers.*.input_layernorm, exit 1;
    --prompts 1: exit 0 (absent alone)."""
    patched = []
    for layer in model.model.layers:
        norm = layer.input_layernorm

        def forward(x, norm=norm):
            xf = x.float()
            ms = xf.pow(2).mean(-1, keepdim=True)
            batch_max = ms.amax(0, keepdim=True)  # per position, over the batch's rows
            eps = _norm_eps(norm) + 0.5 * (batch_max - ms)
            return _finish_norm(norm, xf * torch.rsqrt(ms + eps), x)

        norm.forward = forward
        patched.append((norm, "forward"))
    return _restore_attrs(patched)


# ============================================================================================ follow-ups: process-global patches

def d09b_gdn_state_to_cache_halved_decode(model):
    """DEFECT (Qwen3.5), as d09 but the state handed to the cache at decode is halved (a gross state bug), installed
    the way fast kernels are: by assigning the modeling module's ``torch_recurrent_gated_delta_rule``. Expected:
    lockstep (restored): states differ from step 1, onset recurrent_state error; free-running: logits differ too."""
    return _state_to_cache(model, lambda s: s * 0.5, "torch_recurrent_gated_delta_rule")


def d14_gdn_decode_decay_doubled(model):
    """DEFECT (Qwen3.5): the decode (one-token) delta-rule kernel, installed by assigning the modeling module's
    ``torch_recurrent_gated_delta_rule`` (how a fused kernel replaces HF's), applies the decay twice (g -> 2g).
    Expected: lockstep: logits and states differ from step 1, onset at linear_attn.core/recurrent_state (error)."""
    from audit32_candidates import _patch_module_fn

    def make(original):
        def rec(query, key, value, g, beta, *a, **kw):
            return original(query, key, value, 2 * g, beta, *a, **kw)
        return rec
    return _patch_module_fn(model, "torch_recurrent_gated_delta_rule", make)


def d15_rope_sin_negated_decode(model):
    """DEFECT (either family): the modeling module's ``apply_rotary_pos_emb`` replaced (as Liger-Kernel does) by a
    rotary kernel whose one-token (decode) variant negates sin (rotates the wrong way). Expected: lockstep: error at
    self_attn.q_rope from step 1; matrix: divergent rows located at q_rope."""
    from audit32_candidates import _patch_module_fn

    def make(original):
        def rope(q, k, cos, sin, *a, **kw):
            if q.shape[-2] == 1:
                sin = -sin
            return original(q, k, cos, sin, *a, **kw)
        return rope
    return _patch_module_fn(model, "apply_rotary_pos_emb", make)
