"""Candidate paths for the generation diagnostics' tests (matrix, lockstep, batch invariance).

Each function patches an HF model in place, as a user's ``module:function`` path does, and returns an undo
callable. Written independently of ``ulptrace.kernels``. Defects are keyed on the *absolute position* of
the token being computed (read from the forward's ``cache_position`` or the cache's length), never on a
call count, so a step re-run from a restored state behaves as it did in the whole run.
"""

from __future__ import annotations

import torch

DEFECT_LAYER = 1
DEFECT_POSITION = 17
"""The one position the GLU defects touch: with 16-token prompts, decode step 2 (the prefill covers positions
0..15, decode step t feeds position 15 + t)."""
GLU_SCALE = 4.0
KEY_DRIFT = 1.5


def _cache(kwargs: dict):
    return next((kwargs[k] for k in ("cache", "past_key_values") if kwargs.get(k) is not None), None)


def _track_positions(model, seen: dict):
    """A root pre-hook storing the first position and the length of the tokens of each forward."""

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        position = kwargs.get("cache_position")
        if position is not None:
            start = int(position.reshape(-1)[0])
        else:
            cache = _cache(kwargs)
            start = int(cache.get_seq_length()) if cache is not None else 0
        seen["start"], seen["length"], seen["batch"] = start, ids.shape[1], ids.shape[0]

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def _scaled_glu(model, scale: float, applies) -> callable:
    seen: dict = {}
    handle = _track_positions(model, seen)
    mlp = model.model.layers[DEFECT_LAYER].mlp

    def forward(x, mlp=mlp):
        glu = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        positions = torch.arange(seen["start"], seen["start"] + seen["length"], device=x.device)
        hit = (positions == DEFECT_POSITION) & applies(seen)
        if bool(hit.any()):
            glu = torch.where(hit.view(1, -1, 1), glu * scale, glu)
        return mlp.down_proj(glu)

    mlp.forward = forward

    def undo():
        handle.remove()
        del mlp.forward

    return undo


def glu_error_at_step_2(model):
    """Defect (error at ``layers.1.mlp.glu``) at one step: at position 17 (decode step 2 of a 16-token prompt),
    layer 1's GLU product is scaled by 4. A row flips at that step (located there from the restored state) or
    later, through the states that step wrote (accumulated: located at that step from the start)."""
    return _scaled_glu(model, GLU_SCALE, lambda seen: True)


def glu_error_in_batches(model):
    """Defect that depends on the batch shape: as ``glu_error_at_step_2``, but only in batches of 2 or more rows."""
    return _scaled_glu(model, GLU_SCALE, lambda seen: seen["batch"] > 1)


def key_drift(model):
    """Defect in cache handling, outside every site: after each forward, the keys it just wrote into the KV cache
    are scaled by 1.5. A step's own output is untouched (attention has already read the keys), so a step re-run
    from the reference's state is exact, but the stored keys drift and later steps flip: the difference
    *accumulates*."""

    def hook(module, args, kwargs, output):
        cache = _cache(kwargs) or getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        ids = args[0] if args else kwargs["input_ids"]
        length = ids.shape[1]
        position = kwargs.get("cache_position")
        with torch.no_grad():
            for layer in getattr(cache, "layers", []):
                keys = getattr(layer, "keys", None)
                if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
                    continue
                if position is not None:  # a static cache: the positions written
                    keys[:, :, position] = (keys[:, :, position].float() * KEY_DRIFT).to(keys.dtype)
                else:  # a dynamic cache ends with what this forward wrote
                    keys[:, :, -length:] = (keys[:, :, -length:].float() * KEY_DRIFT).to(keys.dtype)

    return model.register_forward_hook(hook, with_kwargs=True).remove


def key_drift_seen_at_attention(model):
    """``key_drift``, from a path that can be observed only at the attention cores (as a compiled path can be
    only at some sites): its ``observable_sites`` keeps those, ``observed`` says so."""
    return key_drift(model)


key_drift_seen_at_attention.observable_sites = lambda model, sites: [s for s in sites if s.kind == "attention"]
key_drift_seen_at_attention.observed = "the attention cores only (a test path)"


def raises_when_applied(model):
    """A path that fails as it is applied: what a broken path does in the process that applies it."""
    raise RuntimeError("planted failure while applying the path")


def raises_at_the_first_decode_step(model):
    """A path that fails inside its run, at its second forward (the first decode step): the other side of an onset
    has run its prefill, or waits for this one's, by then."""
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("planted failure at the first decode step")

    return model.register_forward_hook(hook).remove


def fails_in_a_helper_process(model):
    """HF itself (nothing changed) in the process that runs the onset, a failure in any process it started: what a path
    that cannot run there does (e.g. one that needs what only the parent set up)."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        raise RuntimeError("planted failure: this path does not run in a helper process")


def rope_reversed_at_decode_by_name(model):
    """A rotary kernel installed the way Liger-Kernel installs its kernels, by assigning the modeling module's
    ``apply_rotary_pos_emb`` — a name every model of that module looks up as it runs, not this model's alone —
    whose one-token (decode) variant rotates the wrong way (sin negated): an error at ``self_attn.q_rope`` from
    decode step 1."""
    import sys

    namespace = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original = namespace.apply_rotary_pos_emb

    def rope(q, k, cos, sin, *args, **kwargs):
        return original(q, k, cos, -sin if q.shape[-2] == 1 else sin, *args, **kwargs)

    namespace.apply_rotary_pos_emb = rope

    def undo():
        namespace.apply_rotary_pos_emb = original

    return undo


def _on_logits(model, change):
    """``change(logits, batch)`` applied to what the LM head returns."""
    handle = model.lm_head.register_forward_hook(lambda module, args, out: change(out, out.shape[0]))
    return handle.remove


def logits_scaled_by_batch(model):
    """Batch-variant and token-preserving: the logits scaled by 1 + 2^-5 (batch - 1) — a positive factor per row, so
    every greedy choice stays (ties aside) while the numbers follow the batch."""
    return _on_logits(model, lambda out, batch: out * (1 + 2.0 ** -5 * (batch - 1)))


def noisy_logits(model):
    """Not repeatable: noise of a few BF16 ULPs added to the logits, fresh at every call."""
    return _on_logits(model, lambda out, batch: out + 0.02 * torch.randn_like(out))


def attention_registry_overridden(model):
    """An attention kernel installed by replacing the registry entry the model looks its attention up by
    (``ALL_ATTENTION_FUNCTIONS[impl]``: every model with that implementation reaches it) whose one-token (decode)
    variant scales the scores by 1.5x the model's scaling: an error at ``self_attn.core`` from decode step 1."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    key = model.config._attn_implementation
    original = ALL_ATTENTION_FUNCTIONS[key]
    local = ALL_ATTENTION_FUNCTIONS._local_mapping  # where setting an entry writes (over the class-wide one)
    before = local.get(key)

    def attention(module, query, key_states, value, mask, *args, scaling=None, **kwargs):
        if query.shape[2] == 1:
            scaling = 1.5 * (scaling if scaling is not None else query.shape[-1] ** -0.5)
        return original(module, query, key_states, value, mask, *args, scaling=scaling, **kwargs)

    ALL_ATTENTION_FUNCTIONS[key] = attention

    def undo():  # exactly as before: a local entry left behind would shadow a later class-wide register()
        if before is None:
            local.pop(key, None)
        else:
            local[key] = before

    return undo


def attention_registered_class_wide(model):
    """As :func:`attention_registry_overridden`, installed class-wide (``AttentionInterface.register``): a registry's
    local entry left behind by anything before (a tap's) would shadow it and the defect would never run."""
    from transformers.modeling_utils import AttentionInterface

    key = model.config._attn_implementation
    original = AttentionInterface._global_mapping[key]

    def attention(module, query, key_states, value, mask, *args, scaling=None, **kwargs):
        if query.shape[2] == 1:
            scaling = 1.5 * (scaling if scaling is not None else query.shape[-1] ** -0.5)
        return original(module, query, key_states, value, mask, *args, scaling=scaling, **kwargs)

    AttentionInterface.register(key, attention)
    return lambda: AttentionInterface.register(key, original)


def rsqrt_scaled_at_decode(model):
    """``torch.rsqrt`` replaced process-wide by one that is 1.25x too large for one-token inputs (an RMSNorm's
    variance at decode): an error at the first norm from decode step 1. The oracle's own interval arithmetic calls
    ``torch.rsqrt`` too: judged with the candidate's, the defect read as a tie."""
    original = torch.rsqrt

    def rsqrt(x, *args, **kwargs):
        out = original(x, *args, **kwargs)
        return out * 1.25 if x.dim() >= 2 and x.shape[-2] == 1 else out

    torch.rsqrt = rsqrt

    def undo():
        torch.rsqrt = original

    return undo


def cache_update_scaled_at_decode(model):
    """The cache's layer class patched (``DynamicLayer.update``, a class no model module is an instance of): the new
    key and value doubled at decode before they are stored — an input difference at the attention core from step 1."""
    from transformers.cache_utils import DynamicLayer

    original = DynamicLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[-2] == 1:
            key_states, value_states = key_states * 2, value_states * 2
        return original(self, key_states, value_states, *args, **kwargs)

    DynamicLayer.update = update

    def undo():
        DynamicLayer.update = original

    return undo
