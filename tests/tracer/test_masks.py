"""Attention masks by meaning (``ulptrace.masks``), against masks written out by hand."""

from __future__ import annotations

import torch
from ulptrace.masks import encoded_like, not_hidden, same_meaning_pair, visible

LOW = torch.finfo(torch.bfloat16).min
CAUSAL = torch.tensor([[True, False, False], [True, True, False], [True, True, True]])


def _additive(seen: torch.Tensor, hidden: float = LOW) -> torch.Tensor:
    out = torch.zeros(seen.shape, dtype=torch.bfloat16)
    for index in zip(*torch.nonzero(~seen, as_tuple=True), strict=True):
        out[index] = hidden
    return out


def test_visibility_of_each_encoding() -> None:
    assert torch.equal(visible(CAUSAL), CAUSAL)
    assert torch.equal(visible(_additive(CAUSAL)), CAUSAL)
    assert torch.equal(visible(_additive(CAUSAL, float("-inf"))), CAUSAL)
    biased = _additive(CAUSAL)
    biased[2, 0] = -0.5  # an ALiBi-like bias: not only visible or hidden
    assert visible(biased) is None and torch.equal(not_hidden(biased), CAUSAL)
    assert visible(CAUSAL.to(torch.int64)) is None


def test_masks_of_one_meaning_compare_equal_across_encodings_and_broadcasts() -> None:
    ref = _additive(CAUSAL)[None, None].expand(2, 1, 3, 3)  # [batch, 1, q, k]
    a, b = same_meaning_pair(ref, CAUSAL[None, None])
    assert a.shape == b.shape == (2, 1, 3, 3) and torch.equal(a, b)
    peek = CAUSAL | torch.tensor([[False, True, False], [False, False, True], [False, False, False]])
    a, b = same_meaning_pair(ref, peek[None, None])
    assert int((a != b).sum()) == 2 * 2  # two positions in each of the two batch items
    assert same_meaning_pair(ref, torch.ones(1, 1, 3, 4, dtype=torch.bool)) is None  # no common shape


def test_a_candidate_mask_is_written_in_the_reference_encoding() -> None:
    ref = _additive(CAUSAL)[None, None]
    written = encoded_like(CAUSAL[None, None], ref)
    assert written.dtype == torch.bfloat16 and written.shape == ref.shape
    assert torch.equal(written.view(torch.int16), ref.view(torch.int16))  # bit for bit: 0 and the lowest value
    inf = encoded_like(CAUSAL, _additive(CAUSAL, float("-inf")))
    assert torch.equal(torch.isinf(inf), ~CAUSAL) and bool((inf[CAUSAL] == 0).all())
    assert torch.equal(encoded_like(ref, CAUSAL[None, None]), CAUSAL[None, None])
    biased = _additive(CAUSAL)
    biased[2, 0] = -0.5
    assert encoded_like(CAUSAL, biased) is None and encoded_like(biased, CAUSAL) is None
    assert encoded_like(CAUSAL[None, None], torch.zeros(1, 1, 3, 4, dtype=torch.bfloat16)) is None


def test_key_visibility_of_a_mask_left_to_the_kernel_follows_sdpas_is_causal() -> None:
    """No mask: causal top-left for a multi-token query, every key for one; keys past those held are hidden."""
    from ulptrace.masks import key_visibility

    assert torch.equal(key_visibility(None, 3, 3, 3), CAUSAL)
    assert torch.equal(key_visibility(None, 1, 3, 5), torch.tensor([[True, True, True, False, False]]))
    two_of_four = torch.tensor([[True, False, False, False], [True, True, False, False]])
    assert torch.equal(key_visibility(None, 2, 4, 4), two_of_four)
    padded = _additive(torch.tensor([True, True, False]))[None, None, None]  # [1, 1, 1, 3], additive
    assert torch.equal(key_visibility(padded, 1, 3, 4), torch.tensor([True, True, False, False]).view(1, 1, 1, 4))
    assert key_visibility(padded, 1, 4, 4) is None  # a mask that does not span the keys
    biased = torch.zeros(1, 1, 1, 3, dtype=torch.bfloat16)
    biased[..., 0] = -0.5
    assert key_visibility(biased, 1, 3, 3) is None  # an additive bias: no plain visibility


def test_keys_seen_counts_the_last_key_any_query_sees_by_the_same_convention() -> None:
    """``keys_seen``: a mask's last visible key plus one (a bias counts as seen, a mask that does not span the keys
    leaves them all, nothing seen is 0), and for no mask the count of ``key_visibility``'s convention, for every
    query and key count — the one convention, counted without building it."""
    from ulptrace.masks import key_visibility, keys_seen

    assert keys_seen(CAUSAL, 3, 3) == 3 and keys_seen(_additive(CAUSAL), 3, 3) == 3
    padded = _additive(torch.tensor([True, True, False, False]))[None, None, None]  # a static cache's padding
    assert keys_seen(padded, 1, 4) == 2 and keys_seen(padded, 1, 5) == 5
    assert keys_seen(torch.zeros(2, 4, dtype=torch.bool), 2, 4) == 0
    biased = torch.zeros(1, 4, dtype=torch.bfloat16)
    biased[0, 3] = -0.5
    assert keys_seen(biased, 1, 4) == 4
    assert [keys_seen(None, q, 4) for q in (1, 2, 3, 4, 6)] == [4, 2, 3, 4, 4]
    for queries in range(1, 7):
        for keys in range(1, 7):
            seen = key_visibility(None, queries, keys, keys)
            assert keys_seen(None, queries, keys) == int(seen.any(0).nonzero().max()) + 1, (queries, keys)


def test_visibility_pair_compares_sides_that_hold_other_keys() -> None:
    from ulptrace.masks import visibility_pair

    # a kernel handed no mask over a static cache of 5 slots, 3 live, against a dynamic cache's 3 keys
    ref, cand = visibility_pair((None, 1, 3), (None, 1, 5), torch.device("cpu"))
    assert ref.shape == cand.shape == (1, 5) and int((ref != cand).sum()) == 2
    # the same cache with its padding hidden by a mask: every query sees the same keys
    live = torch.tensor([True] * 3 + [False] * 2).view(1, 1, 1, 5)
    ref, cand = visibility_pair((_additive(torch.ones(1, 1, 1, 3, dtype=torch.bool)), 1, 3), (live, 1, 5),
                                torch.device("cpu"))
    assert ref.shape == (1, 1, 1, 5) and torch.equal(ref, cand)
