"""Candidate paths with known defects and valid variants, for the probe tests.

Each function patches an HF model in place, the way a user's ``module:function`` path does, and
returns an undo callable. They are written independently of ``ulptrace.kernels``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _norms(model, cls_name: str):
    return [m for m in model.modules() if type(m).__name__ == cls_name]


def _undo_all(patched):
    def undo():
        for module in patched:
            del module.forward

    return undo


def block_sum_t32_v2(values: torch.Tensor) -> torch.Tensor:
    """FP32 sum over the last dim in the order of one 32-thread CUDA block with 2-wide loads.

    Spelled out from the kernel loop, not from ``ulptrace.trees``: thread ``t`` adds elements
    ``base + 2t`` then ``base + 2t + 1`` for ``base = 0, 64, 128, ...`` to its accumulator (started at
    ``+0.0``; a missing element adds ``+0.0``, which changes no sum of squares), then the warp runs an
    xor-shuffle butterfly with offsets 16, 8, 4, 2, 1 (``own + partner``) and lane 0 holds the total.
    Every step is one float32 elementwise add, i.e. one IEEE round-to-nearest-even addition per row.
    """
    threads, vector = 32, 2
    values = values.float()
    n = values.shape[-1]
    acc = torch.zeros((*values.shape[:-1], threads), dtype=torch.float32, device=values.device)
    for base in range(0, n, threads * vector):
        loads = values[..., base:base + threads * vector]
        loads = F.pad(loads, (0, threads * vector - loads.shape[-1]))  # past the row: +0.0
        loads = loads.reshape(*values.shape[:-1], threads, vector)  # [..., thread, element of the load]
        for v in range(vector):
            acc = acc + loads[..., v]
    lanes = torch.arange(threads, device=values.device)
    for offset in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lanes ^ offset]
    return acc[..., 0]


def reordered_norm_sums(model):
    """Valid variant: every zero-centred RMSNorm sums its squares in a blocked FP32 order
    (``blocked:t32:v2`` in ``ulptrace.trees``' notation, computed by :func:`block_sum_t32_v2`)."""
    patched = _norms(model, "Qwen3_5RMSNorm")
    for norm in patched:
        def forward(x, norm=norm):
            xf = x.float()
            mean = block_sum_t32_v2(xf * xf).unsqueeze(-1) / xf.shape[-1]
            out = xf * torch.rsqrt(mean + norm.eps)
            return (out * (1.0 + norm.weight.float())).to(x.dtype)

        norm.forward = forward
    return _undo_all(patched)


def unrounded_residual(model):
    """Defect: the post-attention norm normalises the FP32 sum residual + attn_out (no BF16 rounding first)."""
    handles, patched = [], []
    for layer in model.model.layers:
        mixer = getattr(layer, "linear_attn", None) or layer.self_attn
        seen = {}
        handles.append(layer.register_forward_pre_hook(lambda m, a, k, seen=seen: seen.__setitem__("r", a[0] if a else k["hidden_states"]), with_kwargs=True))
        handles.append(mixer.register_forward_hook(lambda m, a, o, seen=seen: seen.__setitem__("d", o[0] if isinstance(o, tuple) else o)))
        norm = layer.post_attention_layernorm

        def forward(x, norm=norm, seen=seen):
            s = seen["r"].float() + seen["d"].float()
            out = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + norm.eps)
            return (out * (1.0 + norm.weight.float())).to(x.dtype)

        norm.forward = forward
        patched.append(norm)

    def undo():
        for h in handles:
            h.remove()
        _undo_all(patched)()

    return undo


def glu_rounded_once(model):
    """Defect (boundary): the GLU epilogue silu(gate) * up computed in FP32 and rounded once."""
    patched = [layer.mlp for layer in model.model.layers]
    for mlp in patched:
        def forward(x, mlp=mlp):
            glu = (F.silu(mlp.gate_proj(x).float()) * mlp.up_proj(x).float()).to(x.dtype)
            return mlp.down_proj(glu)

        mlp.forward = forward
    return _undo_all(patched)


def wrong_eps(model):
    """Defect (error): the RMSNorms use eps = 0.1 instead of the configured 1e-6."""
    norms = _norms(model, "Qwen3_5RMSNorm")
    old = [n.eps for n in norms]
    for n in norms:
        n.eps = 0.1

    def undo():
        for n, e in zip(norms, old):
            n.eps = e

    return undo


def bf16_scale(model):
    """Defect (boundary): the zero-centred scale (1 + w) formed on the BF16 parameter."""
    patched = _norms(model, "Qwen3_5RMSNorm")
    for norm in patched:
        def forward(x, norm=norm):
            xf = x.float()
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
            return (out * (1.0 + norm.weight).float()).to(x.dtype)

        norm.forward = forward
    return _undo_all(patched)


def stale_weight(model):
    """Defect (error + parameter report): layer 1's post-attention norm runs on a stale weight copy."""
    norm = model.model.layers[1].post_attention_layernorm
    saved = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.mul_(0.9)

    def undo():
        with torch.no_grad():
            norm.weight.copy_(saved)

    return undo


def fp32_norm_output(model):
    """Defect (boundary): post-attention norms hand their FP32 result on unrounded (the MLP casts later)."""
    norms, mlps = [], []
    for layer in model.model.layers:
        norm, mlp = layer.post_attention_layernorm, layer.mlp

        def norm_forward(x, norm=norm):
            xf = x.float()
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
            return out * (1.0 + norm.weight.float())

        def mlp_forward(x, mlp=mlp, original=mlp.forward):
            return original(x.to(torch.bfloat16))

        norm.forward, mlp.forward = norm_forward, mlp_forward
        norms.append(norm)
        mlps.append(mlp)
    return _undo_all(norms + mlps)


def global_attention_scale(model):
    """Defect (error), patched *globally*: every call of HF's registered SDPA function scales scores by 1.5.

    Unscoped on purpose: the oracle's reference formulas must not pick up what a candidate path installs.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from ulptrace.taps import tap

    def transform(args, kwargs):
        return args, {**kwargs, "scaling": kwargs["scaling"] * 1.5}

    return tap(ALL_ATTENTION_FUNCTIONS, "sdpa").add_transform(transform).remove


def global_norm_class_patch(model):
    """Defect (error), patched on the *class*: every Qwen3_5RMSNorm in the process uses eps = 0.1."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    original = Qwen3_5RMSNorm.forward

    def forward(self, x):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 0.1)
        return (out * (1.0 + self.weight.float())).to(x.dtype)

    Qwen3_5RMSNorm.forward = forward

    def undo():
        Qwen3_5RMSNorm.forward = original

    return undo


def global_inner_norm_patch(model):
    """Defect (error), on a name the bound forward looks up as it runs: Qwen3_5RMSNorm's ``_norm`` (which its
    ``forward`` calls through the class) divides the sum of squares by n - 1, not n."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    original = Qwen3_5RMSNorm._norm

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / (x.shape[-1] - 1) + self.eps)

    Qwen3_5RMSNorm._norm = _norm

    def undo():
        Qwen3_5RMSNorm._norm = original

    return undo


def global_rotate_half_patch(model):
    """Defect (error), on a module-level helper: ``rotate_half`` of the model's modeling module, which
    ``apply_rotary_pos_emb`` reads from its globals, in the interleaved (GPT-J) layout instead of HF's halves."""
    module = __import__(type(model).__module__, fromlist=["rotate_half"])
    original = module.rotate_half

    def rotate_half(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    module.rotate_half = rotate_half

    def undo():
        module.rotate_half = original

    return undo


def _patch_rope(model, replacement):
    module = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    original = module.apply_rotary_pos_emb
    module.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: replacement(original, q, k, cos, sin, *a, **kw)

    def undo():
        module.apply_rotary_pos_emb = original

    return undo


def _shift(t):
    return torch.roll(t, 1, dims=-2)


def rope_key_offset(model):
    """Defect in code no site observes: the *keys* get RoPE one position late (a rotary kernel's off-by-one)."""

    def rope(original, q, k, cos, sin, *a, **kw):
        return original(q, k, cos, sin, *a, **kw)[0], original(q, k, _shift(cos), _shift(sin), *a, **kw)[1]

    return _patch_rope(model, rope)


def _key_written(value: float):
    def write(model):
        """Defect in code no site observes: the rotary step writes ``value`` into one element of the keys (a
        corrupted cache or rotary kernel) — the attention's recorded key input differs there and only there."""

        def rope(original, q, k, cos, sin, *a, **kw):
            q_out, k_out = original(q, k, cos, sin, *a, **kw)
            k_out = k_out.clone()
            k_out[0, 0, 0, 0] = value
            return q_out, k_out

        return _patch_rope(model, rope)

    return write


rope_key_nan = _key_written(float("nan"))
rope_key_inf = _key_written(float("inf"))


def rope_query_offset(model):
    """Defect (error at the q_rope site): the queries get RoPE one position late."""

    def rope(original, q, k, cos, sin, *a, **kw):
        return original(q, k, _shift(cos), _shift(sin), *a, **kw)[0], original(q, k, cos, sin, *a, **kw)[1]

    return _patch_rope(model, rope)


def rope_full_width_tables(model):
    """Defect in code no site observes: the rotary tables are built for the whole head dim (a kernel that ignores
    ``partial_rotary_factor``), so every query and key is rotated in all its dims — the rope site's ``cos``/``sin``
    inputs come in another shape."""
    rotary = model.model.rotary_emb
    config = model.config
    head_dim = config.head_dim
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"]
                      ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    original = rotary.inv_freq
    rotary.inv_freq = inv_freq.to(original.device)

    def undo():
        rotary.inv_freq = original

    return undo


def rope_fp32(model):
    """Boundary: RoPE computed in FP32 with one final rounding, as fused rotary kernels do (HF rounds the
    two products and the sum in BF16)."""

    def rope(original, q, k, cos, sin, *a, **kw):
        out = original(q.float(), k.float(), cos.float(), sin.float(), *a, **kw)
        return out[0].to(q.dtype), out[1].to(k.dtype)

    return _patch_rope(model, rope)


def gdn_scan_bug(model):
    """Defect in a site without oracle semantics: the GatedDeltaNet scan's output is scaled by (1 + 2^-6)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq
    from ulptrace.taps import tap

    def result(args, kwargs, out):
        return (out[0] * (1 + 2 ** -6), *out[1:])

    handles = [tap(mq, name).add_result_transform(result)
               for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")]
    return lambda: [h.remove() for h in handles]


def _wrap_returned_logits(model, change):
    """Wrap the model's forward (an instance attribute, as a kernel library's model wrapper installs it) and apply
    ``change`` to the logits it returns — after the LM head module, outside every module ulptrace hooks."""
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = change(out.logits)
        return out

    model.forward = forward

    def undo():
        del model.forward

    return undo


def logits_scaled_outside_head(model):
    """Defect after the last module: the returned logits are scaled by (1 + 2^-4) (a temperature folded into the
    model wrapper), the LM head's own output unchanged."""
    return _wrap_returned_logits(model, lambda logits: (logits.float() * (1 + 2 ** -4)).to(logits.dtype))


def logits_upcast_outside_head(model):
    """Valid variant: the model wrapper returns the logits as float32 (what generation converts them to anyway)."""
    return _wrap_returned_logits(model, lambda logits: logits.float())


def _mask_builder(model, **forced):
    """Call the modeling module's causal-mask builder with ``forced`` keyword arguments (outside every site)."""
    import sys

    module = sys.modules[type(model).__module__]
    original = module.create_causal_mask

    then = forced.pop("_then", lambda mask: mask)

    def create(*args, **kwargs):
        return then(original(*args, **{**kwargs, **forced}))

    module.create_causal_mask = create

    def undo():
        module.create_causal_mask = original

    return undo


def mask_sees_next_token(model):
    """Defect outside every site: the mask builder also lets each query see the next token (an ``or`` mask function
    a serving layer adds), always materialised — a bool mask under SDPA."""
    return _mask_builder(model, or_mask_function=lambda b, h, q, kv: kv == q + 1, allow_is_causal_skip=False)


def mask_always_explicit(model):
    """Valid variant: the mask builder always materialises the correct causal mask (never leaves it to SDPA's
    ``is_causal``) — a bool mask where eager attention's is additive."""
    return _mask_builder(model, allow_is_causal_skip=False)


def _own_attention(model, name: str, with_masks: bool):
    """Switch the model to HF's SDPA function registered under a name of its own (``AttentionInterface``), with a mask
    function for it (``AttentionMaskInterface``) or without one."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, sdpa_attention_forward)
    if with_masks:
        AttentionMaskInterface.register(name, sdpa_mask)
    before = model.config._attn_implementation
    model.config._attn_implementation = name

    def undo():
        model.config._attn_implementation = before

    return undo


def attention_registered_without_masks(model):
    """Defect with a static cache: an attention function registered without a mask function is handed no mask by
    transformers, so at decode its one query sees the static cache's zero padding too (a dynamic cache holds only
    live keys: no difference there)."""
    return _own_attention(model, "ulptrace_tests_no_masks", with_masks=False)


def attention_registered_with_masks(model):
    """Valid variant of :func:`attention_registered_without_masks`: the same function with SDPA's mask function
    registered for it, so it is handed the static cache's mask."""
    return _own_attention(model, "ulptrace_tests_with_masks", with_masks=True)


def down_proj_fp32_into_residual(model):
    """Valid variant, a deliberate boundary: down_proj's FP32 result goes into the residual add unrounded and the sum
    is rounded once (a GEMM with a fused residual epilogue) — the next site receives an FP32 value where HF hands
    on BF16."""
    handles = []
    for layer in model.model.layers:
        handles.append(layer.mlp.down_proj.register_forward_hook(
            lambda m, args, out: F.linear(args[0].float(), m.weight.float())))

        def round_once(m, args, kwargs, out):
            dtype = (args[0] if args else kwargs["hidden_states"]).dtype
            return out.to(dtype) if isinstance(out, torch.Tensor) else (out[0].to(dtype), *out[1:])

        handles.append(layer.register_forward_hook(round_once, with_kwargs=True))
    return lambda: [h.remove() for h in handles]


def gdn_decode_decay_scaled(model):
    """Defect in the one-token (decode) scan: the decay is exp(1.05 g), a few percent off — small enough at one
    token that the scan's output alone falls inside a chunked kernel's BF16 hypotheses; its FP32 state does not."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    original = mq.torch_recurrent_gated_delta_rule

    def recurrent(query, key, value, g, beta, *args, **kwargs):
        return original(query, key, value, g * 1.05, beta, *args, **kwargs)

    mq.torch_recurrent_gated_delta_rule = recurrent

    def undo():
        mq.torch_recurrent_gated_delta_rule = original

    return undo



def a_key_hidden_at_decode(model):
    """Defect after other differences: the mask builder always materialises the mask (bool, for SDPA) and, at decode
    only, hides key 3. Against HF's eager attention the prefill already differs (SDPA's named boundary), and each core
    judged with its own mask is inside its semantics."""
    def hide(mask):
        if mask is not None and mask.shape[-2] == 1:
            mask = mask.clone()
            mask[..., 3] = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        return mask

    return _mask_builder(model, allow_is_causal_skip=False, _then=hide)


def attention_softcap_dropped(model):
    """A defect: attention without Gemma 2's soft cap of the scores (``tanh(s / cap) * cap``) in the second layer —
    an attention kernel that ignores the ``softcap`` HF passes to it."""
    attn = model.model.layers[1].self_attn
    cap = attn.attn_logit_softcapping
    attn.attn_logit_softcapping = None

    def undo():
        attn.attn_logit_softcapping = cap

    return undo


def _attention_fp32_scores(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                           **kwargs):
    """An attention function of a fused kernel: the scores, their soft cap (where given) and the mask (bool or
    additive; none at a prefill: causal, top-left aligned as SDPA's) in FP32, the probabilities rounded to the input
    dtype once normalised, then ``P @ V`` as HF's eager path does it; GQA heads interleaved as HF repeats them."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
            else scores + attention_mask.float()
    elif query.shape[2] > 1:
        n, m = query.shape[2], key.shape[2]
        scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(m - n + 1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def attention_softcap_fp32(model):
    """A valid variant: Gemma 2's attention with the scores, their soft cap and the mask in FP32 (a fused kernel's
    registers), the probabilities rounded to BF16 once normalised and ``P @ V`` as HF's eager path does it."""
    import sys

    owner = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = owner.eager_attention_forward
    owner.eager_attention_forward = _attention_fp32_scores

    def undo():
        owner.eager_attention_forward = original

    return undo


def attention_scale_2_percent(model):
    """A defect: the attention scores scaled by 1.02 in every call of HF's SDPA function (a wrong scale constant)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from ulptrace.taps import tap

    def transform(args, kwargs):
        return args, {**kwargs, "scaling": kwargs["scaling"] * 1.02}

    return tap(ALL_ATTENTION_FUNCTIONS, "sdpa").add_transform(transform).remove


def attention_scores_fp32(model):
    """A valid variant: SDPA replaced by a kernel keeping the scores and the mask in FP32, the probabilities rounded to
    BF16 once normalised."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _attention_fp32_scores

    def undo():
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original

    return undo
