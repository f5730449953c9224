"""The fused attention ops (SDPA backends) as one op with an explicit float64 decomposition.

``F.scaled_dot_product_attention`` reaches the dispatcher as a single op whose internals are not
observable (``aten._scaled_dot_product_flash_attention_for_cpu`` on CPU; ``_flash_attention``,
``_efficient_attention`` or ``_cudnn_attention`` on CUDA). The oracle replays it as

    scores = q @ k^T          (FP32 accumulation over head_dim)
    scores = scores * scale   (FP32; ``scale`` as the kernel sees it, i.e. rounded to FP32)
    scores = scores + mask    (FP32; a bool mask selects, ``is_causal`` keeps the top-left triangle)
    p      = softmax(scores)  (FP32)
    out    = p @ v            (FP32 accumulation over the keys), one final rounding to the output dtype

with grouped-query attention handled by repeating each key/value head ``Hq / Hk`` times.

The flash kernels of torch (CPU and CUDA) round the *unnormalised* probabilities ``exp(s - m_block)``
to the input dtype before the ``P @ V`` product and normalise by an FP32 row sum afterwards. This was
measured: on CPU, 3216 of 8192 BF16 outputs of a 64x300 attention differ from the once-rounded exact
result. So the default semantics (``"flash"``) admit each probability with a relative error of one unit
roundoff of the input dtype (``2**-8`` for BF16); ``"fp32"`` is the strict reading (probabilities kept in
FP32). Stages that hypotheses can add (``stages``):

- ``"scores"`` -- scores, scaled scores and masked scores each rounded to the input dtype (what HF's
  eager path does with its BF16 ``matmul``, ``* scaling`` and ``+ mask``);
- ``"qk"`` -- only ``q @ k^T`` rounded to the input dtype (a matmul in that dtype), then scaled and masked in FP32;
- ``"scores_once"`` -- the scores rounded to the input dtype once, scaled and masked, just before the softmax (a
  kernel that folds the scale into its FP32 product and stores the scores narrow);
- ``"probs"`` -- the normalised probabilities rounded to the input dtype before ``P @ V`` (eager);
- ``"flash"`` -- the unnormalised probabilities rounded (the widening described above).

Query rows are independent (each has its own scores, softmax and ``P @ V``), so the replay runs in blocks of
rows (:data:`BLOCK_SCORES`; on a CPU cache-sized, ``intervals.CPU_PASS_ELEMENTS``) and memory does not grow with
the square of the prompt.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from ulptrace.oracle import intervals as I
from ulptrace.oracle.intervals import Iv

ATTENTION_OPS: dict[str, int] = {
    # packet name -> number of outputs
    "aten::_scaled_dot_product_flash_attention_for_cpu": 2,
    "aten::_scaled_dot_product_flash_attention": 9,
    "aten::_scaled_dot_product_efficient_attention": 4,
    "aten::_scaled_dot_product_cudnn_attention": 9,
    "aten::scaled_dot_product_attention": 1,
}
"""The fused attention ops the oracle replays, with the number of outputs each returns."""

SEMANTICS = ("flash", "fp32")
"""Readings of a fused attention op's internal precision (see the module docstring)."""

STAGES = ("scores", "qk", "scores_once", "probs", "flash")
"""Internal rounding stages a hypothesis can add to a fused attention op."""

BLOCK_SCORES = 1 << 22
"""Score elements (batch x heads x query rows x keys) replayed at once: the oracle judges attention in blocks of
query rows, so its float64 intermediates stay bounded (about 4M elements, a few hundred MB with their
temporaries) whatever the prompt length."""


def _narrow_of(dtype: torch.dtype) -> torch.dtype | None:
    return dtype if dtype in I.NARROW_DTYPES else None


def attention_terms(b: dict[str, Any], shape_of: Any) -> int:
    """Number of keys (the length of the ``P @ V`` accumulation) from the bound arguments."""
    return int(shape_of(b["key"])[-2])


def replay_attention(
    b: dict[str, Any],
    *,
    input_dtype: torch.dtype,
    compute: torch.dtype,
    semantics: str,
    stages: frozenset[str],
    outputs: int,
    where: str,
) -> tuple[Iv | None, ...]:
    """Interval replay of one fused attention op from its bound schema arguments.

    Args:
        b: bound arguments by schema name (``query``, ``key``, ``value``, ``attn_mask`` or ``attn_bias``,
            ``dropout_p``, ``is_causal``, ``scale``, ``enable_gqa``); tensors as :class:`Iv`.
        input_dtype: dtype of the query as captured (its unit roundoff sizes the probability rounding).
        compute: FP32 (or float64 for a float64 program).
        semantics: one of :data:`SEMANTICS`.
        stages: extra rounding stages, a subset of :data:`STAGES`.
        outputs: how many outputs the op returns; all but the first are None (not replayed).
        where: op description for error messages.

    Returns:
        ``(out, None, ...)`` with ``out`` the unrounded interval of the attention output.

    Raises:
        NotImplementedError: dropout, or query/key head counts that do not divide.
    """
    q, k, v = b["query"], b["key"], b["value"]
    mask = b.get("attn_mask", b.get("attn_bias"))
    if float(b.get("dropout_p") or 0.0) != 0.0:
        raise NotImplementedError(f"{where}: attention with dropout_p={b['dropout_p']} cannot be replayed")
    narrow = _narrow_of(input_dtype)
    heads_q, heads_k = q.lo.shape[-3] if q.lo.dim() >= 3 else 1, k.lo.shape[-3] if k.lo.dim() >= 3 else 1
    if heads_q != heads_k:
        if heads_q % heads_k:
            raise NotImplementedError(
                f"{where}: query heads ({heads_q}) must be a multiple of key/value heads ({heads_k})")
        group = heads_q // heads_k
        k = k.map(lambda t: t.repeat_interleave(group, dim=-3))
        v = v.map(lambda t: t.repeat_interleave(group, dim=-3))
    head_dim = q.lo.shape[-1]
    scale = b.get("scale")
    scale = I.round_scalar(1.0 / math.sqrt(head_dim) if scale is None else float(scale), compute)

    eager = "scores" in stages

    def stage(x: Iv, point: str) -> Iv:
        """``x``, a step of the scores (``point``: ``qk``, ``scaled`` or ``masked``) as the kernel keeps it."""
        x = I.round_iv(x, torch.float32 if compute != I.F64 else I.F64)
        if narrow is not None and (eager or point in stages):
            x = I.round_iv(x, narrow)
        return x

    keys, queries = k.lo.shape[-2], q.lo.shape[-2]
    k_t = k.map(lambda t: t.transpose(-2, -1))
    # blocks of query rows, so the float64 score intervals held at once stay bounded (BLOCK_SCORES elements)
    per_row = max(1, q.lo.numel() // max(queries * head_dim, 1) * keys)
    block = max(1, I.elements_at_once(BLOCK_SCORES, q.lo.is_cuda) // per_row)
    # what the products derive from the keys and the values, made once for all blocks (not again at each block from
    # the whole keys and values: that was most of a long prompt's replay, and its memory churn)
    many = block < queries
    k_right = I.matmul_right(k_t, q.is_point) if many else None
    v_right = I.nonneg_right(v) if many else None

    def rows(first: int, last: int) -> Iv:
        """The output interval of query rows ``first:last`` (each row's scores, softmax and P @ V are its own)."""
        qb = q.map(lambda t: t[..., first:last, :])
        scores = stage(I.matmul(qb, k_t, head_dim, k_right), "qk")
        scores = stage(I.mul(scores, I.scalar_iv(scale, scores.lo)), "scaled")
        if mask is not None:
            mb = mask.map(lambda t: t[..., first:last, :]) if mask.lo.dim() >= 2 and mask.lo.shape[-2] == queries \
                else mask
            if mb.lo.dtype == torch.bool:
                keep = mb.lo
                scores = scores.map(lambda t: t.masked_fill(~keep, -math.inf))
            else:
                scores = stage(I.add(scores, mb), "masked")
        if b.get("is_causal"):  # top-left aligned: query row i sees keys 0..i
            keep = torch.ones(last - first, keys, dtype=torch.bool, device=scores.lo.device).tril(first)
            scores = scores.map(lambda t: t.masked_fill(~keep, -math.inf))
        if narrow is not None and "scores_once" in stages:  # (a masked score, -inf, stays -inf)
            scores = I.round_iv(scores, narrow)
        probs = I.round_iv(I.softmax(scores, -1, compute), torch.float32 if compute != I.F64 else I.F64)
        if narrow is not None and "probs" in stages:
            probs = I.round_iv(probs, narrow)
        if narrow is not None and (semantics == "flash" or "flash" in stages):
            probs = I.widen_rel(probs, I.unit_roundoff(narrow))
        # the FP32 accumulation of P @ V, plus one rescaling per key block of an online softmax
        return I.nonneg_matmul(probs, v, 2 * keys, v_right)

    parts = [rows(first, min(first + block, queries)) for first in range(0, queries, block)]
    if len(parts) == 1:
        return (parts[0],) + (None,) * (outputs - 1)
    lo = torch.cat([x.lo for x in parts], -2)
    hi = lo if all(x.is_point for x in parts) else torch.cat([x.hi for x in parts], -2)
    pt = None if any(x.pt is None for x in parts) else \
        (lo if all(x.pt is x.lo for x in parts) else torch.cat([x.pt for x in parts], -2))
    return (Iv(lo, hi, pt),) + (None,) * (outputs - 1)
