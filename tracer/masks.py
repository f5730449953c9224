"""Attention masks by meaning: which keys each query may see, whatever the encoding.

Two paths may encode one mask differently — a bool mask (True: visible) for SDPA, an additive float mask (0
visible, the dtype's lowest value or -inf hidden) for eager attention — or one may leave the mask to the kernel.
A mask is structural, not an activation: it is compared by what it lets through (a difference there is evidence,
a different encoding is not), and the oracle judges the candidate with its own mask written in the encoding the
reference's program was captured on. A float mask that holds anything but 0 and hidden (an additive bias) has no
plain visibility; such masks are compared and judged only as they are.
"""

from __future__ import annotations

import torch

MASK = "attention_mask"  # an attention record's mask, by its recorded role
STRUCTURAL_INPUTS = (MASK,)  # recorded inputs that are masks, not activations


def not_hidden(mask: torch.Tensor) -> torch.Tensor:
    """Positions a mask does not hide: a bool mask's True, a float mask's entries other than -inf and the dtype's
    lowest value (an additive bias counts as not hidden)."""
    if mask.dtype == torch.bool:
        return mask
    return (mask != float("-inf")) & (mask != torch.finfo(mask.dtype).min)


def visible(mask: torch.Tensor) -> torch.Tensor | None:
    """Which positions ``mask`` lets through, as a bool tensor; None for a mask that is not only visible or hidden
    (an additive bias, an integer mask)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    seen = not_hidden(mask)
    return seen if bool(((mask == 0) | ~seen).all()) else None


def same_meaning_pair(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The visibility of two masks encoded or shaped otherwise (broadcast to one shape, on the reference's device),
    to compare; None when either has no plain visibility or their shapes do not broadcast."""
    ref = visible(reference)
    return _broadcast_pair(ref, visible(candidate), None if ref is None else ref.device)


def _broadcast_pair(ref: torch.Tensor | None, cand: torch.Tensor | None, device: torch.device | None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Two visibilities broadcast to one shape on ``device``; None where either is None or they do not broadcast."""
    if ref is None or cand is None:
        return None
    try:
        shape = torch.broadcast_shapes(ref.shape, cand.shape)
    except RuntimeError:
        return None
    return ref.to(device).expand(shape), cand.to(device).expand(shape)


def keys_seen(mask: torch.Tensor | None, queries: int, keys: int) -> int:
    """How many leading keys of an attention record's ``keys`` some query sees (the last one any query sees, plus
    one): by ``mask`` where it spans the keys (a bias counts as seen: ``not_hidden``), all of them where it does not,
    and for none :func:`key_visibility`'s convention counted without building it — a multi-token query of fewer
    tokens than the keys sees as many keys as it has tokens (causal, top-left aligned), any other sees all."""
    if mask is None:
        return queries if 1 < queries < keys else keys
    if mask.shape[-1] != keys:
        return keys
    live = not_hidden(mask).reshape(-1, keys).any(0)
    return int(live.nonzero().max()) + 1 if bool(live.any()) else 0


def key_visibility(mask: torch.Tensor | None, queries: int, keys: int, width: int,
                   device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Which of ``width`` key positions each query of an attention record sees, as a bool tensor ``[..., q, width]``
    (a mask's broadcast dimensions kept): ``mask``'s visibility over the record's ``keys`` keys, or, for none — a mask
    left to the kernel — HF's convention for it (SDPA's ``is_causal``: causal, top-left aligned, for a multi-token
    query; every key for one; :func:`keys_seen` counts it); positions at or past ``keys`` (keys this record does not
    hold) are hidden. None where ``mask`` has no plain visibility or does not span the keys. ``device``: where a
    visibility without a mask is made."""
    if mask is None:
        seen = torch.ones(queries, keys, dtype=torch.bool, device=device)
        if queries > 1:
            seen = seen.tril()
    else:
        seen = visible(mask)
        if seen is None or seen.shape[-1] != keys:
            return None
    if width > keys:
        seen = torch.cat([seen, seen.new_zeros(*seen.shape[:-1], width - keys)], dim=-1)
    return seen


def visibility_pair(reference: tuple[torch.Tensor | None, int, int], candidate: tuple[torch.Tensor | None, int, int],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`key_visibility` of two attention records, each given as ``(mask, queries, keys)``, over the keys either
    holds and broadcast to one shape on ``device``, to compare by meaning; None where either has no plain visibility
    or the two do not broadcast."""
    width = max(reference[2], candidate[2])
    return _broadcast_pair(key_visibility(*reference, width, device), key_visibility(*candidate, width, device), device)


def encoded_like(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor | None:
    """``mask`` with its visibility written in ``like``'s encoding (dtype, hidden value) and shape; None where that
    cannot be done (either has no plain visibility, or ``mask`` does not broadcast to ``like``'s shape)."""
    if mask.dtype == like.dtype and mask.shape == like.shape:
        return mask
    seen, target = visible(mask), visible(like)
    if seen is None or target is None:
        return None
    try:
        seen = seen.expand(like.shape)
    except RuntimeError:
        return None
    if like.dtype == torch.bool:
        return seen.contiguous()
    hidden = float("-inf") if bool((like == float("-inf")).any()) else torch.finfo(like.dtype).min
    return torch.zeros(like.shape, dtype=like.dtype, device=mask.device).masked_fill(~seen, hidden)
