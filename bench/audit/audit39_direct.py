"""Audit 39: kernel-level checks of the candidates whose change is inside a function no module hook sees (attention
kernels, delta-rule scans, SiLU, the FP16 GLU buffer), on the tensors HF's own prefill/decode hands those functions
(ulptrace's seeded prompts, seed 0). Each kernel is compared with an FP64 evaluation of HF's semantics and with HF's
own function, in BF16 ULPs of the exact value (|y - exact| / ulp_bf16(exact)) or FP32 relative error.
Usage: PYTHONPATH=bench/audit python bench/audit/audit39_direct.py"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

import audit39_candidates as c39
from ulptrace.models import build_model
from ulptrace.run import make_prompts

BF16 = torch.bfloat16


def ulp_bf16(x):
    """BF16 ULP at |x| (FP64)."""
    a = x.abs().clamp(min=2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def err_ulps(y, exact):
    return ((y.double() - exact) / ulp_bf16(exact)).abs()


def capture(model_name, fn_names, decode=True):
    """Run HF's prefill (+ one decode step) and keep the arguments of the modeling module's functions ``fn_names``
    (first call per step)."""
    model = build_model(model_name)
    mm = sys.modules[type(model).__module__]
    got = {}
    saved = {}
    for name in fn_names:
        orig = getattr(mm, name)
        saved[name] = orig

        def wrap(*a, _name=name, _orig=orig, **kw):
            got.setdefault((_name, state["step"]), (a, dict(kw)))
            return _orig(*a, **kw)
        setattr(mm, name, wrap)
    state = {"step": 0}
    prompts = make_prompts(model.config.vocab_size, 2, 16, 0)
    with torch.no_grad():
        out = model(prompts, use_cache=True)
        if decode:
            state["step"] = 1
            model(out.logits[:, -1:].argmax(-1), use_cache=True, cache=out.cache if hasattr(out, "cache") and
                  out.cache is not None else out.past_key_values)
    for name, orig in saved.items():
        setattr(mm, name, orig)
    return model, got


def attention_checks():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    kernels = {}

    class Fake:
        pass

    for cand, name in ((c39.d201_attn_scores_bf16, "d201"), (c39.d214_attn_softmax_plus_one, "d214"),
                       (c39.v201_attn_online_softmax_fp32, "v201")):
        m = Fake()
        m.config = type("C", (), {"_attn_implementation": "sdpa"})()
        # the registered attention function is what the candidate installs: take it from the registry
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        cand(m)
        kernels[name] = ALL_ATTENTION_FUNCTIONS[m.config._attn_implementation]
    for model_name in ("tiny-qwen3.5", "tiny-llama"):
        model = build_model(model_name)
        layer = next(l for l in model.model.layers if hasattr(l, "self_attn"))
        attn = layer.self_attn
        rec = {}

        def grab(module, q, k, v, mask, dropout=0.0, scaling=None, **kw):
            if module is attn:
                rec.setdefault(q.shape[2], (q, k, v, mask, scaling))
            return sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kw)
        AttentionInterface.register("audit39_grab", grab)
        model.config._attn_implementation = "audit39_grab"
        prompts = make_prompts(model.config.vocab_size, 2, 16, 0)
        with torch.no_grad():
            out = model(prompts, use_cache=True)
            model(out.logits[:, -1:].argmax(-1), use_cache=True, cache=out.cache if getattr(out, "cache", None)
                  is not None else out.past_key_values)
        for q_len, (q, k, v, mask, scaling) in sorted(rec.items(), reverse=True):
            n = attn.num_key_value_groups
            kk, vv = k.repeat_interleave(n, 1).double(), v.repeat_interleave(n, 1).double()
            s = q.double() @ kk.transpose(-1, -2) * scaling
            keep = c39._causal_keep(q.shape[2], k.shape[2])
            s = s.masked_fill(~keep, float("-inf"))
            exact = (torch.softmax(s, -1) @ vv).transpose(1, 2)
            smax = s[s > float("-inf")].abs().max().item()
            hf = sdpa_attention_forward(attn, q, k, v, mask, scaling=scaling)[0]
            line = [f"{model_name} layer {attn.layer_idx} q_len {q_len} max|s| {smax:.2f}: HF sdpa err max "
                    f"{err_ulps(hf, exact).max():.2f} ulp (>0.5: {(err_ulps(hf, exact) > 0.5).sum().item()})"]
            for name, fn in kernels.items():
                y = fn(attn, q, k, v, mask, scaling=scaling)[0]
                e = err_ulps(y, exact)
                line.append(f"{name} err max {e.max():.2f} ulp (>0.5: {(e > 0.5).sum().item()}, >1: "
                            f"{(e > 1).sum().item()}), differs from HF in {(y != hf).sum().item()}/{y.numel()}")
            print("\n    ".join(line))


def scan64(q, k, v, g, beta, state, variant):
    """FP64 delta rule (HF's recurrent order) or a defective variant, from HF's scan arguments."""
    nk, nv = k.shape[2], v.shape[2]
    if nk != nv:
        q = q.repeat_interleave(nv // nk, 2)
        k = k.repeat_interleave(nv // nk, 2)
    q, k, v, b, gg = [x.transpose(1, 2).double() for x in (q, k, v, beta, g)]
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)  # HF's l2norm, eps 1e-6 (not negligible here)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / math.sqrt(q.shape[-1])
    s = torch.zeros(q.shape[0], nv, q.shape[-1], v.shape[-1], dtype=torch.float64) if state is None else state.double()
    out = torch.zeros_like(v)
    for i in range(q.shape[2]):
        d = gg[:, :, i].exp()[..., None, None]
        if variant != "decay_after":
            s = s * d
        kv = (s * k[:, :, i, :, None]).sum(-2)
        delta = b[:, :, i, None] * v[:, :, i] - kv if variant == "beta_v" else (v[:, :, i] - kv) * b[:, :, i, None]
        s = s + k[:, :, i, :, None] * delta[:, :, None, :]
        if variant == "decay_after":
            s = s * d
        out[:, :, i] = (s * q[:, :, i, :, None]).sum(-2)
    return out.transpose(1, 2), s


def gdn_checks():
    model, got = capture("tiny-qwen3.5", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
    mm = sys.modules[type(model).__module__]
    for (name, step), (a, kw) in sorted(got.items()):
        q, k, v = a[:3]
        g, beta, st = kw["g"], kw["beta"], kw.get("initial_state")
        exact, exact_s = scan64(q, k, v, g, beta, st, "hf")
        print(f"GDN layer-0 {name} step {step}: q {tuple(q.shape)}, state in: {st is not None}")

        def run(fn, **extra):
            kk = dict(kw)
            kk.update(extra)
            kk["output_final_state"] = True
            kk.pop("cu_seqlens", None)
            return fn(q.float(), k.float(), v.float(), **kk)   # FP32 in -> FP32 out (no final rounding)

        cands = {"HF " + name: (getattr(mm, name), {}), "_scan(hf)": (c39._scan("hf"), {})}
        if name == "torch_chunk_gated_delta_rule":
            cands["HF chunk_size=5"] = (mm.torch_chunk_gated_delta_rule, {"chunk_size": 5})
        base = None
        for label, (fn, extra) in cands.items():
            o, s = run(fn, **extra)
            base = o if base is None else base
            same = (o.to(BF16) == base.to(BF16)).sum().item()
            ro = ((o.double() - exact).abs().max() / exact.abs().max()).item()
            rs = ((s.double() - exact_s).abs().max() / exact_s.abs().max()).item()
            ob = o.to(BF16)
            print(f"  {label:28s} FP32 rel err out {ro:.2e} state {rs:.2e}; BF16 out err max "
                  f"{err_ulps(ob, exact).max():.2f} ulp; BF16 out equal to HF's in {same}/{ob.numel()}")
        for variant in ("decay_after", "beta_v"):
            o, s = run(c39._scan(variant))
            e = err_ulps(o.to(BF16), exact)
            ex_v, _ = scan64(q, k, v, g, beta, st, variant)
            print(f"  _scan({variant}) BF16 out vs HF-exact: max {e.max():.1f} ulp, >2 ulp {(e > 2).sum().item()}/"
                  f"{e.numel()}; vs its own FP64 {((o.double()-ex_v).abs().max()/ex_v.abs().max()).item():.1e}")


def d202_check():
    model, got = capture("tiny-qwen3.5", ["torch_recurrent_gated_delta_rule"])
    mm = sys.modules[type(model).__module__]
    (a, kw) = got[("torch_recurrent_gated_delta_rule", 1)]
    holder = type("M", (), {})()
    holder_mod = type(sys)("fake")
    holder_mod.torch_recurrent_gated_delta_rule = mm.torch_recurrent_gated_delta_rule
    import audit32_candidates as a32
    orig = a32._mm
    a32._mm = lambda m: holder_mod
    try:
        c39.d202_gdn_state_row0_shared_decode(holder)
    finally:
        a32._mm = orig
    kw = dict(kw)
    kw.pop("cu_seqlens", None)
    ref = mm.torch_recurrent_gated_delta_rule(*a, **kw)[0]
    bad = holder_mod.torch_recurrent_gated_delta_rule(*a, **kw)[0]
    print(f"d202: rows differing: row0 {(ref[0] != bad[0]).sum().item()}, row1 {(ref[1] != bad[1]).sum().item()}"
          f"/{ref[1].numel()}; state row0 == row1 in HF? {bool((kw['initial_state'][0] == kw['initial_state'][1]).all())}")


def silu_and_fp16_checks():
    model, got = capture("tiny-qwen3.5", ["causal_conv1d_fn"], decode=False)
    g = torch.randn(200000, dtype=torch.float32).mul(3).to(BF16)
    a = F.silu(g)
    b = c39._silu_fp32(g).to(BF16)
    print(f"v203 conv SiLU: F.silu(bf16) vs x/(1+exp(-x)) FP32 rounded once: {(a != b).sum().item()}/{g.numel()} "
          "differ (random N(0,3) BF16 inputs)")
    gf = g.float()
    e64 = (g.double() / (1 + torch.exp(-g.double())))
    print(f"     FP32 silu rel err vs FP64: F.silu {((F.silu(gf).double()-e64).abs()/e64.abs().clamp(min=1e-30)).max():.1e}"
          f", explicit {((c39._silu_fp32(g).double()-e64).abs()/e64.abs().clamp(min=1e-30)).max():.1e}")
    # the GLU values of both models through an FP16 buffer
    for name in ("tiny-qwen3.5", "tiny-llama"):
        m = build_model(name)
        vals = []
        hs = [l.mlp.down_proj.register_forward_pre_hook(lambda mod, a: vals.append(a[0].detach().clone()))
              for l in m.model.layers]
        with torch.no_grad():
            m(make_prompts(m.config.vocab_size, 2, 16, 0))
        for h in hs:
            h.remove()
        per = [(t.to(torch.float16).to(BF16) != t).sum().item() for t in vals]
        x = torch.cat([t.flatten() for t in vals])
        rt = x.to(torch.float16).to(BF16)
        print(f"d209 {name}: changed per layer (prefill) {per}")
        print(f"d209 {name}: GLU values {x.numel()}, min |x| {x.abs()[x != 0].min().item():.2e}, "
              f"changed by the BF16->FP16->BF16 trip: {(rt != x).sum().item()}")


if __name__ == "__main__":
    which = sys.argv[1:] or ["attention", "gdn", "d202", "silu"]
    if "attention" in which:
        attention_checks()
    if "gdn" in which:
        gdn_checks()
    if "d202" in which:
        d202_check()
    if "silu" in which:
        silu_and_fp16_checks()
