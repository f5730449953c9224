"""Decode attention: one query token per sequence over a KV cache (kernel and reference).

Shapes: ``query`` ``[B, Hq, D]``, ``key``/``value`` ``[B, Hkv, L, D]`` (the cache, head dim
contiguous; ``Hq`` a multiple of ``Hkv``, q head ``h`` reading kv head ``h // (Hq / Hkv)`` as HF's
``repeat_kv``). Valid cached positions per row: ``lengths`` (``int [B]``: positions ``< lengths[b]``)
and/or ``valid`` (``bool [B, L]``); both absent means all ``L``. Output ``[B, Hq, D]`` in the
query's dtype (HF's attention interface returns it as ``[B, 1, Hq, D]``). A row with no valid
position gives zeros (HF would attend uniformly to masked positions).

Semantics (what ``faithful`` is faithful to; the injection picks the model's attention
implementation):

- ``eager`` (``eager_attention_forward``): ``s = round(round(q @ k^T) * scale)`` (a BF16 matmul
  output, then a BF16 scaling), masked positions excluded (HF adds the dtype's minimum, whose
  ``exp`` is exactly 0), ``p = round(softmax_fp32(s))`` — the probabilities are rounded to the
  query dtype before ``P @ V`` — and ``out = round(p @ v)`` with FP32 accumulation.
- ``sdpa``: SDPA's mathematical definition in FP32 (the math backend's semantics): scores, softmax
  and ``P @ V`` in FP32, one final rounding. The fused backends (flash, efficient, cuDNN, CPU
  flash) deviate from it in their own rounding order, so HF-with-SDPA agrees with it to the tie
  level, not bitwise; there is no single SDPA rounding set to reproduce.

``fused`` mode ignores the semantics: FP32 scores, online-softmax style
``out = round((sum_j exp(s_j - max) v_j) / sum_j exp(s_j - max))``, one rounding.

Declared FP32 reductions of the kernel (:func:`tree_specs`): ``qk`` blocked:t32:v{V} over the head
dimension (one warp per position), ``softmax_sum`` blocked:t256:v1 over positions (masked ones are
0), ``pv`` sequential over positions. ``order="kernel"`` in the reference evaluates exactly those
(plus ``expf`` as torch's CUDA ``exp``), bitwise the kernel on a CUDA device; ``order="hf"`` uses
the torch ops of the semantics (for ``eager``: bitwise HF's ``eager_attention_forward``).
"""

from __future__ import annotations

import torch
from ulptrace.kernels import _common as c

SEMANTICS = ("eager", "sdpa")
_SEMANTICS_CODE = {"eager": 0, "sdpa": 1}
THREADS = 256


def tree_specs(head_dim: int, dtype: torch.dtype) -> dict[str, str]:
    """The kernel's FP32 reduction trees (``ulptrace.trees`` specs) by role."""
    return {
        "qk": f"blocked:t32:v{c.vector_width(head_dim, dtype)}",
        "softmax_sum": f"blocked:t{THREADS}:v1",
        "pv": "sequential",
    }


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
           valid: torch.Tensor | None, lengths: torch.Tensor | None, semantics: str, mode: str) -> None:
    c.check_tensor("query", query, dtype=c.FLOAT_DTYPES, ndim=3)
    c.check_tensor("key", key, dtype=c.FLOAT_DTYPES, ndim=4)
    c.check_tensor("value", value, dtype=c.FLOAT_DTYPES, ndim=4)
    c.check_same("key", key, "value", value)
    for name, t in (("key", key), ("value", value)):
        c.check_same("query", query, name, t, what="dtype")
        c.check_same("query", query, name, t, what="device")
    b, hq, d = query.shape
    if key.shape[0] != b or key.shape[3] != d:
        raise ValueError(f"key must be [B={b}, Hkv, L, D={d}], but got shape {tuple(key.shape)}")
    hkv = key.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if valid is not None:
        c.check_tensor("valid", valid, dtype=torch.bool, ndim=2)
        if tuple(valid.shape) != (b, key.shape[2]):
            raise ValueError(f"valid must have shape {(b, key.shape[2])}, but got {tuple(valid.shape)}")
        c.check_same("query", query, "valid", valid, what="device")
    if lengths is not None:
        c.check_tensor("lengths", lengths, dtype=(torch.int32, torch.int64), ndim=1)
        if lengths.shape[0] != b:
            raise ValueError(f"lengths must have shape ({b},), but got {tuple(lengths.shape)}")
        c.check_same("query", query, "lengths", lengths, what="device")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, but got {type(scale).__name__}")
    c.check_choice("semantics", semantics, SEMANTICS)
    c.check_choice("mode", mode, c.MODES)


def valid_positions(key: torch.Tensor, valid: torch.Tensor | None, lengths: torch.Tensor | None) -> torch.Tensor | None:
    """``bool [B, L]``: which cached positions each row attends to (None: all of them)."""
    mask = valid
    if lengths is not None:
        pos = torch.arange(key.shape[2], device=key.device)
        by_len = pos[None, :] < lengths.to(pos.dtype)[:, None]
        mask = by_len if mask is None else mask & by_len
    return mask


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, L, D] -> [B, Hkv * groups, L, D]``, each kv head repeated for its query heads."""
    if groups == 1:
        return t
    b, h, length, d = t.shape
    return t[:, :, None].expand(b, h, groups, length, d).reshape(b, h * groups, length, d)


def _hf_order(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
              mask: torch.Tensor | None, semantics: str, mode: str) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)
    q = query.unsqueeze(2)  # [B, Hq, 1, D]
    if mode == "faithful" and semantics == "eager":
        w = torch.matmul(q, k.transpose(2, 3)) * scale
        if mask is not None:
            additive = torch.where(mask, torch.tensor(0.0, dtype=q.dtype, device=q.device),
                                   torch.finfo(q.dtype).min)
            w = w + additive[:, None, None, :]
        p = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(p, v)[:, :, 0]
    s = torch.matmul(q.float(), k.float().transpose(2, 3)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    if mode == "faithful":  # sdpa: FP32 math, one rounding
        return torch.matmul(torch.softmax(s, dim=-1), v.float())[:, :, 0].to(q.dtype)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (torch.matmul(e, v.float()) / e.sum(-1, keepdim=True))[:, :, 0].to(q.dtype)


def _kernel_order(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  mask: torch.Tensor | None, semantics: str, mode: str) -> torch.Tensor:
    dtype = query.dtype
    trees = tree_specs(query.shape[-1], dtype)
    groups = query.shape[1] // key.shape[1]
    k, v = _repeat_kv(key, groups).float(), _repeat_kv(value, groups).float()
    length = k.shape[2]
    ok = torch.ones(query.shape[0], length, dtype=torch.bool, device=query.device) if mask is None else mask
    ok = ok[:, None, :].expand(-1, query.shape[1], -1)  # [B, Hq, L]
    scale32 = torch.tensor(scale, dtype=torch.float32, device=query.device)
    dots = c.reduce_fp32(query.float()[:, :, None, :] * k, trees["qk"])  # [B, Hq, L]
    eager = mode == "faithful" and semantics == "eager"
    s = (dots.to(dtype).float() * scale32).to(dtype).float() if eager else dots * scale32
    m = torch.where(ok, s, float("-inf")).amax(-1, keepdim=True)
    empty = torch.isneginf(m)
    e = torch.where(ok & ~empty, torch.exp(s - m), torch.zeros((), device=s.device))
    total = c.reduce_fp32(e, trees["softmax_sum"]).unsqueeze(-1)
    if mode == "fused":
        p = e
    else:
        p = e / total
        p = p.to(dtype).float() if eager else p
    terms = torch.where(ok[..., None], p[..., None] * v, torch.zeros((), device=v.device))  # [B, Hq, L, D]
    o = c.reduce_fp32(terms, trees["pv"], dim=2)
    if mode == "fused":
        o = o / total
    o = torch.where(empty, torch.zeros((), device=o.device), o)
    return o.to(dtype)


def decode_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    valid: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    semantics: str = "eager",
    mode: str = "faithful",
    order: str = "hf",
) -> torch.Tensor:
    """Plain-torch decode attention (any device); see the module docstring.

    Args:
        query: ``[B, Hq, D]``; key, value: ``[B, Hkv, L, D]``; scale: the score scale (a float).
        valid: optional ``bool [B, L]``; lengths: optional ``int [B]``.
        semantics: ``"eager"`` or ``"sdpa"``; mode: ``"faithful"`` or ``"fused"``.
        order: ``"hf"`` (the semantics' torch ops) or ``"kernel"`` (the kernel's declared trees).

    Returns:
        ``[B, Hq, D]`` in the query's dtype.

    Raises:
        TypeError, ValueError: bad shapes, dtypes, devices or options.
    """
    _check(query, key, value, scale, valid, lengths, semantics, mode)
    c.check_choice("order", order, c.ORDERS)
    mask = valid_positions(key, valid, lengths)
    if order == "hf":
        out = _hf_order(query, key, value, float(scale), mask, semantics, mode)
        if mask is not None:  # rows with nothing to attend to are defined as 0
            out = torch.where(mask.any(-1)[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out
    return _kernel_order(query, key, value, float(scale), mask, semantics, mode)


_MAX_LEN: dict[tuple[int, int], int] = {}


def max_cache_len(head_dim: int) -> int:
    """Most cached positions the CUDA kernel holds in shared memory on the current device (0 without kernels)."""
    from ulptrace.kernels import _build

    if not _build.available():
        return 0
    key = (torch.cuda.current_device(), head_dim)
    if key not in _MAX_LEN:
        _MAX_LEN[key] = int(_build.extension().decode_attention_max_len(head_dim))
    return _MAX_LEN[key]


def _rows_aligned(t: torch.Tensor, vector: int) -> torch.Tensor:
    size = t.element_size()
    if t.stride(-1) != 1 or (t.stride(2) * size) % (vector * size) or t.data_ptr() % (vector * size):
        return t.contiguous() if not t.is_contiguous() else t.clone()
    return t


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    valid: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    semantics: str = "eager",
    mode: str = "faithful",
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention on the CUDA kernel or the reference (``backend`` as in ``add_rms_norm``).

    Arguments as :func:`decode_attention_reference`, plus ``backend`` and ``out`` (an optional
    preallocated contiguous ``[B, Hq, D]`` output).

    Raises:
        TypeError, ValueError: bad inputs or ``out``; a cache longer than :func:`max_cache_len`
            on the CUDA backend.
        RuntimeError: ``backend="cuda"`` and the kernels cannot be built.
    """
    _check(query, key, value, scale, valid, lengths, semantics, mode)
    chosen = c.resolve_backend(backend, query, key, value)
    shape = tuple(query.shape)
    c.check_no_overlap({"out": out}, {"query": query, "key": key, "value": value})
    if chosen == "reference":
        result = decode_attention_reference(query, key, value, scale=scale, valid=valid, lengths=lengths,
                                            semantics=semantics, mode=mode)
        if out is None:
            return result
        c.check_out("out", out, shape, query.dtype, query.device)
        return out.copy_(result)
    head_dim, length = shape[2], key.shape[2]
    limit = max_cache_len(head_dim)
    if length > limit:
        raise ValueError(f"the CUDA decode attention kernel holds at most {limit} cached positions "
                         f"for head_dim {head_dim}, but the cache has {length}")
    vector = c.vector_width(head_dim, query.dtype)
    result = c.output(out, shape, query.dtype, query.device)
    q = query if query.stride(-1) == 1 else query.contiguous()
    v = value if value.stride(-1) == 1 else value.contiguous()
    valid_c = valid.contiguous() if valid is not None else None
    lengths_c = lengths.to(torch.int32).contiguous() if lengths is not None else None
    from ulptrace.kernels import _build

    _build.extension().decode_attention(
        result, q, _rows_aligned(key, vector), v, valid_c, lengths_c, float(scale),
        _SEMANTICS_CODE[semantics], c.mode_code(mode), vector,
    )
    return result
