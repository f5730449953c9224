"""Audit 39c: candidates for "a failure must never read as success" — defects that begin only at a late decode step
or only in some batch rows / batch sizes. Run: `PYTHONPATH=bench/audit python -m ulptrace onset --candidate
audit39c_candidates:NAME ...` (bench/audit/audit39c_runall.sh runs the audit's checks). Both families.
Steps: 0 is the prefill, s >= 1 a one-token decode step (cache length prompt + s after the step's token is written).
"""
from __future__ import annotations

from audit31_candidates import _register_attention, _restore_attrs, _sdpa
from audit36_candidates import _step_tracker


def _scale_oproj(model, when, factor=1.01, rows=None):
    """Layer 1's o_proj output (Llama: layer 1's attention; Qwen3.5: layer 1 full attention) times ``factor`` (BF16)
    whenever ``when(state, batch)``; only batch ``rows`` if given."""
    state, handle = _step_tracker(model)
    lin = model.model.layers[1].self_attn.o_proj
    original = type(lin).forward

    def forward(x, lin=lin):
        y = original(lin, x)
        if when(state, y.shape[0]):
            y = y.clone()
            if rows is None:
                y = y * factor
            else:
                for r in rows:
                    if r < y.shape[0]:
                        y[r] = y[r] * factor
        return y

    lin.forward = forward
    undo = _restore_attrs([(lin, "forward")])
    return lambda: (undo(), handle.remove())


def d301_oproj_scaled_from_step4(model):
    """DEFECT: from decode step 4 on (a split-KV path that switches on past a cache length), layer 1's o_proj output
    is scaled by 1.01. Expected: error at layers.1.self_attn.o_proj@4 with --new-tokens >= 5; parity with 3."""
    return _scale_oproj(model, lambda st, b: st["step"] >= 4)


def d302_attn_drops_oldest_key_late(model):
    """DEFECT: at decode, once the cache holds more than prompt+3 keys (step >= 4), the attention kernel drops the
    oldest key (a sliding window off by its size). The K/V/mask the module hands it are right (recorded).
    Expected: error at layers.1.self_attn.core@4 (first full-attention layer); parity with --new-tokens 3 or 4."""
    state, handle = _step_tracker(model)

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        if query.shape[2] == 1 and state["prompt"] is not None and key.shape[2] > state["prompt"] + 3:
            key, value = key[:, :, 1:], value[:, :, 1:]
            if attention_mask is not None:
                attention_mask = attention_mask[..., 1:]
        return _sdpa(module, query, key, value, attention_mask, scaling, dropout=dropout, **kw)

    undo = _register_attention(model, "audit39c_drop_oldest", attn)
    return lambda: (undo(), handle.remove())


def d303_oproj_row2_only(model):
    """DEFECT: layer 1's o_proj output of batch row 2 only (the third row: a tile boundary at row 2) scaled by 1.01,
    every step. Expected: error at layers.1.self_attn.o_proj@0 with --prompts 4 (row 2's elements only); parity with
    --prompts 2."""
    return _scale_oproj(model, lambda st, b: True, rows=[2])


def d304_oproj_batch_gt2(model):
    """DEFECT: layer 1's o_proj output scaled by 1.01 for every row, only when the batch has more than 2 rows (a
    batched kernel chosen above batch 2). Expected: error at layers.1.self_attn.o_proj@0 with --prompts 3 or 4;
    parity with --prompts 1 or 2."""
    return _scale_oproj(model, lambda st, b: b > 2)


def v305_hf_control(model):
    """VALID control: patches nothing. Expected: parity, bitwise."""
    return lambda: None
