"""Explicit FP32 reduction trees: name a summation order, evaluate it exactly, find which orders match.

A fused RMSNorm kernel and HF's ``x.pow(2).mean(-1)`` add the same squares in different orders, and
FP32 addition is not associative, so the two sums can differ in their last bits; when the exact value
sits near a BF16 rounding midpoint the normalised outputs then differ by one BF16 step. Nobody is
wrong: the difference is the order. This module makes the order an explicit value, a :class:`Tree`,
evaluates it bit for bit with :func:`reduce_fp32`, and says with :func:`matching_trees` which orders
reproduce an observed result (a sum, or anything computed from it, such as a normalised BF16 row).

Exactness: every step is one float32 elementwise ``torch`` add of two float32 tensors. On CPU and on
CUDA such an add is a single IEEE-754 round-to-nearest-even operation, so evaluating an order with
vectorised adds over the leading ("row") dimensions performs exactly the additions the order names,
for every row at once. Python loops run only over the structure of the order (elements, levels,
steps), never over rows. Flushing subnormals (``torch.set_flush_denormal(True)``) breaks this.

The trees add the float32 values they are given. A kernel that forms ``acc += x * x`` lets nvcc
contract it into ``fmaf(x, x, acc)`` (``--fmad=true`` is the default), which skips the rounding of the
square; ``reduce_fp32(x * x, tree)`` reproduces such a kernel only if it rounds the product first
(``__fmul_rn``) or is built with ``--fmad=false``.

Accumulators start at ``+0.0`` as in ``float acc = 0.f``. Because ``+0 + y == y`` for every ``y`` except ``-0``, and an accumulator started at ``+0``
never becomes ``-0``, padding a partial block with zeros is exactly the same as skipping the missing
elements; the emulation relies on that. The only visible effect of the zero start: a row of ``-0.0``
sums to ``+0.0``.

The orders (``str(tree)`` spec in brackets):

- ``sequential`` [``sequential``]: ``((0 + x0) + x1) + ...``.
- ``pairwise`` [``pairwise:b8``]: split the row into consecutive leaves of ``base`` elements (the last
  one may be shorter), sum each leaf sequentially, then repeatedly add adjacent pairs
  ``(s0 + s1), (s2 + s3), ...``, carrying an unpaired last value up unchanged, until one is left.
  Equivalently: with ``K`` leaves, ``sum(leaves) = sum(first P leaves) + sum(the rest)`` where ``P`` is
  the largest power of two below ``K``. ``base=1`` is the classic fully pairwise tree.
- ``blocked`` [``blocked:t256:v4``, optional ``:asc``, ``:wserial``]: one CUDA block of ``threads``
  threads per row. Thread ``t`` loads ``vector`` contiguous elements per step, element
  ``i = (step * threads + t) * vector + v``, and adds them to its accumulator in load order (step, then
  ``v``). Each warp of 32 lanes then runs an xor-shuffle butterfly: for each offset, lane ``l`` sets
  ``own = own + value_of(l ^ offset)`` (own value on the left). Offsets are ``16, 8, 4, 2, 1``
  (``desc``, the default) or ``1, 2, 4, 8, 16`` (``asc``, CUB's ``WarpReduce`` order). Warp totals go to
  shared memory; the first warp loads them (lanes ``>= threads/32`` load ``0``) and runs the same
  butterfly (``wbutterfly``, default), or thread 0 adds them in warp order ``((w0 + w1) + w2) ...``
  (``wserial``, CUB's ``BlockReduce`` warp-reductions algorithm).
  ``__shfl_down_sync`` with the same offsets gives lane 0 the same value as the xor butterfly (lane
  ``l < offset`` reads lane ``l + offset == l ^ offset`` at every step, and only lanes below the offset
  feed lane 0), so down-shuffle kernels are described by the same trees. A GPU test checks all four
  variants, with xor and down shuffles, against a real CUDA block reduction bit for bit (H200).
- ``numpy`` [``numpy``]: ``np.add.reduce`` / ``np.sum`` along a contiguous float32 row (checked
  against numpy 2.4): ``+0.0`` (the identity) plus numpy's pairwise sum of the whole row: fewer than 8
  elements left to right from ``-0.0``; up to 128 with 8 interleaved accumulators combined as
  ``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))`` then the remainder left to right; longer
  ranges split at half the length rounded down to a multiple of 8.
- ``torch_cpu`` [``torch_cpu:w16``]: ``torch.sum(x, -1)`` on CPU for a contiguous float32 last dim
  with ``width``-lane vectors: ATen's cascade sum (rows shorter than ``width`` use scalar loads;
  otherwise 4 interleaved vector accumulators with cascade levels of 16 or more steps, the scalar tail
  summed first, then the vector lanes added to it in order). Width 8 is what we measured on x86 with
  torch 2.13 (AVX512, AVX2 and DEFAULT capability) and torch 2.11 (AVX512); :func:`torch_cpu_tree` finds the
  width on the running machine by testing against ``torch.sum``. The tree is one thread's inner loop:
  torch runs it for every row, except that a tensor whose reduction has a single output and more than
  32768 elements is split across threads (not reproduced). ``torch.mean`` on CPU is ``torch.sum``
  followed by a division by the length, so ``x.pow(2).mean(-1)`` in HF's RMSNorm on CPU is this sum.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence

import torch
from ulptrace.ulp import bits

__all__ = [
    "DEFAULT_TREES",
    "KINDS",
    "Tree",
    "matching_trees",
    "reduce_fp32",
    "torch_cpu_tree",
    "trees_by_row",
]

KINDS = ("sequential", "pairwise", "blocked", "numpy", "torch_cpu")

WARP = 32
_OFFSETS = {"desc": (16, 8, 4, 2, 1), "asc": (1, 2, 4, 8, 16)}
_WARP_COMBINE = ("butterfly", "serial")
# the fields each kind uses; every other field must keep its default
_FIELDS = {
    "sequential": (),
    "pairwise": ("base",),
    "blocked": ("threads", "vector", "offsets", "warps"),
    "numpy": (),
    "torch_cpu": ("width",),
}
# rules for the integer fields: (check, the rule in words) and the choices for the string fields
_INT_RULES: dict[str, tuple[Callable[[int], bool], str]] = {
    "base": (lambda v: v >= 1, ">= 1 (the leaf size)"),
    "threads": (lambda v: WARP <= v <= 1024 and v % WARP == 0, "a multiple of 32 in [32, 1024]"),
    "vector": (lambda v: 1 <= v <= 64, "in [1, 64]"),
    "width": (lambda v: 1 <= v <= 64 and v & (v - 1) == 0, "a power of two in [1, 64]"),
}
_CHOICES = {"offsets": tuple(_OFFSETS), "warps": _WARP_COMBINE}
_DEFAULTS = {"base": 0, "threads": 0, "vector": 0, "offsets": "desc", "warps": "butterfly", "width": 0}
# spec token prefix -> integer field
_INT_TOKENS = {"b": "base", "t": "threads", "v": "vector", "w": "width"}
# spec flag -> (field, value)
_FLAG_TOKENS = {
    "desc": ("offsets", "desc"),
    "asc": ("offsets", "asc"),
    "wbutterfly": ("warps", "butterfly"),
    "wserial": ("warps", "serial"),
}


@dataclasses.dataclass(frozen=True)
class Tree:
    """One FP32 summation order (see the module docstring for the exact rule of each kind).

    Build with the class methods (``Tree.blocked(256, 4)``), with ``Tree(kind, ...)``, or from a spec
    with :meth:`parse`; ``str(tree)`` gives the canonical spec back. Only the fields of the kind may
    differ from their defaults.

    Attributes:
        kind: one of :data:`KINDS`.
        base: ``pairwise`` leaf size (>= 1).
        threads: ``blocked`` threads per row: a multiple of 32 in ``[32, 1024]``.
        vector: ``blocked`` contiguous elements per load, in ``[1, 64]``.
        offsets: ``blocked`` shuffle offset order, ``"desc"`` (16..1) or ``"asc"`` (1..16).
        warps: ``blocked`` cross-warp stage, ``"butterfly"`` (first warp) or ``"serial"`` (thread 0).
        width: ``torch_cpu`` float lanes of ATen's ``Vectorized<float>`` (power of two in ``[1, 64]``).

    Raises:
        ValueError: unknown kind, a parameter out of range, or a field the kind does not use.
        TypeError: a non-int count (``bool`` included).
    """

    kind: str
    base: int = 0
    threads: int = 0
    vector: int = 0
    offsets: str = "desc"
    warps: str = "butterfly"
    width: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _FIELDS:
            raise ValueError(f"Tree kind must be one of {KINDS}, but got {self.kind!r}")
        used = _FIELDS[self.kind]
        for name, default in _DEFAULTS.items():
            value = getattr(self, name)
            if name not in used:
                if value != default:
                    raise ValueError(
                        f"a {self.kind!r} tree takes only {used or 'no parameters'}, but got {name}={value!r}"
                    )
            elif name in _CHOICES:
                if value not in _CHOICES[name]:
                    raise ValueError(f"{self.kind} {name} must be one of {_CHOICES[name]}, but got {value!r}")
            elif type(value) is not int:
                raise TypeError(
                    f"{self.kind} {name} must be an int, but got {type(value).__name__} {value!r}"
                )
            elif not _INT_RULES[name][0](value):
                raise ValueError(f"{self.kind} {name} must be {_INT_RULES[name][1]}, but got {value}")

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def sequential(cls) -> Tree:
        """Left to right with one accumulator."""
        return cls("sequential")

    @classmethod
    def pairwise(cls, base: int = 1) -> Tree:
        """Sequential leaves of ``base`` elements, then adjacent pairs level by level."""
        return cls("pairwise", base=base)

    @classmethod
    def blocked(cls, threads: int, vector: int = 1, offsets: str = "desc", warps: str = "butterfly") -> Tree:
        """One CUDA block per row: strided per-thread sums, warp shuffle tree, cross-warp stage."""
        return cls("blocked", threads=threads, vector=vector, offsets=offsets, warps=warps)

    @classmethod
    def numpy(cls) -> Tree:
        """``np.add.reduce`` of a contiguous float32 row."""
        return cls("numpy")

    @classmethod
    def torch_cpu(cls, width: int) -> Tree:
        """``torch.sum(x, -1)`` on CPU (contiguous float32) with ``width``-lane vectors."""
        return cls("torch_cpu", width=width)

    # -- spec strings -----------------------------------------------------------------------------
    def __str__(self) -> str:
        parts = [self.kind]
        if self.kind == "pairwise":
            parts.append(f"b{self.base}")
        elif self.kind == "blocked":
            parts += [f"t{self.threads}", f"v{self.vector}"]
            if self.offsets != "desc":
                parts.append(self.offsets)
            if self.warps != "butterfly":
                parts.append("w" + self.warps)
        elif self.kind == "torch_cpu":
            parts.append(f"w{self.width}")
        return ":".join(parts)

    @classmethod
    def parse(cls, spec: str) -> Tree:
        """Build a tree from a spec such as ``"sequential"``, ``"pairwise:b8"``, ``"blocked:t256:v4"``,
        ``"blocked:t128:v2:asc:wserial"`` or ``"torch_cpu:w16"`` (the inverse of ``str(tree)``).

        Raises:
            TypeError: ``spec`` is not a string.
            ValueError: unknown kind or token, a repeated or missing parameter, a bad value.
        """
        if not isinstance(spec, str):
            raise TypeError(f"Tree.parse needs a spec string, but got {type(spec).__name__}")
        kind, *tokens = spec.strip().split(":")
        if kind not in _FIELDS:
            raise ValueError(f"Tree spec must start with one of {KINDS}, but got {spec!r}")
        fields: dict[str, object] = {}
        for token in tokens:
            if token in _FLAG_TOKENS:
                name, value = _FLAG_TOKENS[token]
            elif token[:1] in _INT_TOKENS and token[1:].isdigit():
                name, value = _INT_TOKENS[token[:1]], int(token[1:])
            else:
                raise ValueError(f"unknown token {token!r} in Tree spec {spec!r}")
            if name not in _FIELDS[kind]:
                raise ValueError(f"token {token!r} does not apply to a {kind!r} tree (spec {spec!r})")
            if name in fields:
                raise ValueError(f"parameter {name} given twice in Tree spec {spec!r}")
            fields[name] = value
        missing = [n for n in _FIELDS[kind] if isinstance(_DEFAULTS[n], int) and n not in fields]
        if missing:
            raise ValueError(f"Tree spec {spec!r} lacks {missing} (e.g. 'pairwise:b8', 'blocked:t256:v4')")
        return cls(kind, **fields)  # type: ignore[arg-type]

    def describe(self) -> str:
        """One line for a human, e.g. ``"blocked: 256 threads x 4-wide loads, sequential per thread,
        xor-butterfly over 32 lanes (offsets 16..1), then over 8 warps"``."""
        if self.kind == "sequential":
            return "sequential: one accumulator, elements added left to right"
        if self.kind == "pairwise":
            return (
                f"pairwise: sequential sums of {self.base}-element leaves, then adjacent pairs added "
                "level by level (an unpaired last value carried up)"
            )
        if self.kind == "numpy":
            return (
                "numpy: np.add.reduce on a contiguous float32 row (numpy's pairwise sum: "
                "8 interleaved accumulators per block of <= 128, halving split)"
            )
        if self.kind == "torch_cpu":
            return (
                f"torch_cpu: torch.sum on CPU over a contiguous last dim with {self.width}-lane vectors "
                "(4 interleaved vector accumulators, cascade levels, tail, then lanes in order)"
            )
        order = "16..1" if self.offsets == "desc" else "1..16"
        nwarps = self.threads // WARP
        if nwarps == 1:
            across = "single warp"
        elif self.warps == "butterfly":
            across = f"then over {nwarps} warps"
        else:
            across = f"then thread 0 adds the {nwarps} warp totals in order"
        return (
            f"blocked: {self.threads} threads x {self.vector}-wide loads, sequential per thread, "
            f"xor-butterfly over 32 lanes (offsets {order}), {across}"
        )


# -- evaluation -----------------------------------------------------------------------------------
def _zeros(x: torch.Tensor, shape: Sequence[int] | None = None) -> torch.Tensor:
    return torch.zeros(x.shape[:-1] if shape is None else tuple(shape), dtype=x.dtype, device=x.device)


def _pad_last(x: torch.Tensor, length: int) -> torch.Tensor:
    n = x.shape[-1]
    return x if n == length else torch.nn.functional.pad(x, (0, length - n))


def _sequential(x: torch.Tensor) -> torch.Tensor:
    acc = _zeros(x)
    for i in range(x.shape[-1]):
        acc = acc + x[..., i]
    return acc


def _combine_pairs(s: torch.Tensor) -> torch.Tensor:
    """Adjacent pairs level by level along the last dim, an unpaired last value carried up."""
    while s.shape[-1] > 1:
        k = s.shape[-1]
        paired = s[..., 0 : k - 1 : 2] + s[..., 1:k:2]
        s = torch.cat([paired, s[..., k - 1 :]], dim=-1) if k % 2 else paired
    return s[..., 0]


def _pairwise(x: torch.Tensor, base: int) -> torch.Tensor:
    leaves = -(-x.shape[-1] // base)
    xr = _pad_last(x, leaves * base).reshape(*x.shape[:-1], leaves, base)
    return _combine_pairs(_sequential(xr))


def _butterfly(vals: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
    """xor-shuffle butterfly over the last dim (32 lanes): ``own = own + lane[l ^ offset]``."""
    lanes = torch.arange(WARP, device=vals.device)
    for offset in offsets:
        vals = vals + vals[..., lanes ^ offset]
    return vals


def _blocked(x: torch.Tensor, tree: Tree) -> torch.Tensor:
    n, threads, vector = x.shape[-1], tree.threads, tree.vector
    offsets = _OFFSETS[tree.offsets]
    steps = -(-n // (threads * vector))
    # with one step only the first ceil(n / vector) threads load anything; the rest keep +0
    active = threads if steps > 1 else -(-n // vector)
    xr = _pad_last(x, steps * active * vector).reshape(*x.shape[:-1], steps, active, vector)
    acc = _zeros(x, (*x.shape[:-1], active))
    for step in range(steps):
        for v in range(vector):
            acc = acc + xr[..., step, :, v]
    acc = _pad_last(acc, threads)
    nwarps = threads // WARP
    totals = _butterfly(acc.reshape(*x.shape[:-1], nwarps, WARP), offsets)[..., 0]
    if nwarps == 1:
        return totals[..., 0]
    if tree.warps == "serial":
        result = totals[..., 0]
        for w in range(1, nwarps):
            result = result + totals[..., w]
        return result
    return _butterfly(_pad_last(totals, WARP), offsets)[..., 0]


def _numpy_pairwise(x: torch.Tensor) -> torch.Tensor:
    """numpy's ``pairwise_sum`` of the whole last dim (``loops_utils.h.src``)."""
    n = x.shape[-1]
    if n < 8:
        acc = torch.full(x.shape[:-1], -0.0, dtype=x.dtype, device=x.device)
        for i in range(n):
            acc = acc + x[..., i]
        return acc
    if n <= 128:
        r = x[..., 0:8]
        i = 8
        while i < n - n % 8:
            r = r + x[..., i : i + 8]
            i += 8
        res = ((r[..., 0] + r[..., 1]) + (r[..., 2] + r[..., 3])) + (
            (r[..., 4] + r[..., 5]) + (r[..., 6] + r[..., 7])
        )
        for j in range(i, n):
            res = res + x[..., j]
        return res
    half = n // 2
    half -= half % 8
    return _numpy_pairwise(x[..., :half]) + _numpy_pairwise(x[..., half:])


def _ceil_log2(size: int) -> int:
    return 1 if size <= 2 else (size - 1).bit_length()


def _cascade(groups: torch.Tensor) -> torch.Tensor:
    """ATen's ``multi_row_sum``: ``groups`` is (..., size, rows, lanes); returns (..., rows, lanes)."""
    size = groups.shape[-3]
    levels = 4
    power = max(4, _ceil_log2(size) // levels)
    step, mask = 1 << power, (1 << power) - 1
    acc = [_zeros(groups, (*groups.shape[:-3], *groups.shape[-2:])) for _ in range(levels)]
    i = 0
    while i + step <= size:
        for _ in range(step):
            acc[0] = acc[0] + groups[..., i, :, :]
            i += 1
        for j in range(1, levels):
            acc[j] = acc[j] + acc[j - 1]
            acc[j - 1] = torch.zeros_like(acc[j - 1])
            if i & (mask << (j * power)):
                break
    for k in range(i, size):
        acc[0] = acc[0] + groups[..., k, :, :]
    for j in range(1, levels):
        acc[0] = acc[0] + acc[j]
    return acc[0]


def _aten_row_sum(items: torch.Tensor) -> torch.Tensor:
    """ATen's ``row_sum`` with 4-way ILP: ``items`` is (..., size, lanes); returns (..., lanes)."""
    size, lanes = items.shape[-2:]
    ilp = 4
    size_ilp = size // ilp
    grouped = items[..., : size_ilp * ilp, :].reshape(*items.shape[:-2], size_ilp, ilp, lanes)
    partial = _cascade(grouped)
    first = partial[..., 0, :]
    for k in range(size_ilp * ilp, size):
        first = first + items[..., k, :]
    for k in range(1, ilp):
        first = first + partial[..., k, :]
    return first


def _torch_cpu(x: torch.Tensor, width: int) -> torch.Tensor:
    n = x.shape[-1]
    if n >= width:  # vectorized_inner_sum
        nvec = n // width
        lanes = _aten_row_sum(x[..., : nvec * width].reshape(*x.shape[:-1], nvec, width))
        total = _zeros(x)
        for k in range(nvec * width, n):
            total = total + x[..., k]
        for k in range(width):
            total = total + lanes[..., k]
    else:  # scalar_inner_sum
        total = _aten_row_sum(x.unsqueeze(-1))[..., 0]
    return _zeros(x) + total  # the output is zero-filled, then accumulated into


_EVALUATORS: dict[str, Callable[[torch.Tensor, Tree], torch.Tensor]] = {
    "sequential": lambda x, t: _sequential(x),
    "pairwise": lambda x, t: _pairwise(x, t.base),
    "blocked": _blocked,
    "numpy": lambda x, t: _zeros(x) + _numpy_pairwise(x),
    "torch_cpu": lambda x, t: _torch_cpu(x, t.width),
}


def _as_tree(tree: Tree | str) -> Tree:
    if isinstance(tree, Tree):
        return tree
    if isinstance(tree, str):
        return Tree.parse(tree)
    raise TypeError(f"tree must be a Tree or a spec string, but got {type(tree).__name__}")


def _check_input(x: torch.Tensor, dim: int, who: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who} needs x to be a torch.Tensor, but got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{who} sums float32 values exactly; x must be torch.float32, but got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{who} needs x with at least one dimension, but got a 0-d tensor")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{who} needs dim to be an int, but got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise IndexError(
            f"dim must be in [{-x.dim()}, {x.dim() - 1}] for x of shape {tuple(x.shape)}, got {dim}"
        )
    if x.shape[dim] == 0:
        raise ValueError(f"empty reduction: x has shape {tuple(x.shape)}, size 0 along dim {dim}")
    return dim % x.dim()


def reduce_fp32(x: torch.Tensor, tree: Tree | str, dim: int = -1) -> torch.Tensor:
    """The FP32 sum of ``x`` along ``dim``, adding in exactly the order ``tree`` names.

    Args:
        x: float32 tensor of any shape (CPU or CUDA) with a non-empty ``dim``.
        tree: a :class:`Tree` or its spec string (``"blocked:t256:v4"``).
        dim: the reduced dimension; element ``i`` of the order is index ``i`` along ``dim``.

    Returns:
        float32 tensor of ``x.shape`` without ``dim`` (like ``torch.sum(x, dim)``).

    Raises:
        TypeError: ``x`` not a float32 tensor, ``dim`` not an int, ``tree`` not a Tree or string.
        ValueError: 0-d ``x``, empty reduction, or a bad tree spec.
        IndexError: ``dim`` out of range.
    """
    tree = _as_tree(tree)
    dim = _check_input(x, dim, "reduce_fp32")
    return _EVALUATORS[tree.kind](x.movedim(dim, -1), tree)


def matching_trees(
    x: torch.Tensor,
    target: torch.Tensor,
    trees: Iterable[Tree | str] | None = None,
    dim: int = -1,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[Tree, torch.Tensor]:
    """For each tree and each row, whether that order reproduces ``target`` bit for bit.

    A "row" is one reduction: an index of ``x.shape`` without ``dim`` (call that shape ``S``). For each
    tree the sum ``s = reduce_fp32(x, tree, dim)`` (shape ``S``) is mapped by ``transform`` (default:
    identity) to the compared tensor ``c = transform(s)``, which must have ``target``'s dtype and shape
    ``S + E`` for some trailing shape ``E`` (empty for a plain sum; ``(hidden,)`` for a normalised row,
    e.g. ``transform=lambda s: (x * torch.rsqrt(s[..., None] / n + eps)).to(torch.bfloat16)``). A row
    matches when all its ``E`` elements are bitwise equal (any NaN equals any NaN; ``+0 != -0``).

    Args:
        x: float32 values to reduce (see :func:`reduce_fp32`).
        target: the observed result, shape ``S + E``.
        trees: the candidate orders (Trees or spec strings); default :data:`DEFAULT_TREES`.
        dim: the reduced dimension of ``x``.
        transform: function from the FP32 sums (shape ``S``) to the compared tensor.

    Returns:
        ``{tree: bool tensor of shape S}`` in the order of ``trees``; :func:`trees_by_row` turns it
        into one list of matching trees per row.

    Raises:
        TypeError: bad ``x``/``target``/tree types, or ``transform`` returns a non-tensor or a dtype
            other than ``target``'s.
        ValueError: no trees, or a compared shape that is not ``target``'s or does not start with ``S``.
    """
    tree_list = [_as_tree(t) for t in (DEFAULT_TREES if trees is None else trees)]
    if not tree_list:
        raise ValueError("matching_trees needs at least one tree, but got an empty collection")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, but got {type(target).__name__}")
    _check_input(x, dim, "matching_trees")
    target_bits = bits(target, canonical_nan=True)  # NaN payloads vary by backend
    masks: dict[Tree, torch.Tensor] = {}
    for tree in tree_list:
        sums = reduce_fp32(x, tree, dim)
        compared = sums if transform is None else transform(sums)
        if not isinstance(compared, torch.Tensor):
            raise TypeError(f"transform must return a torch.Tensor, but returned {type(compared).__name__}")
        if compared.dtype != target.dtype:
            raise TypeError(
                f"the compared values and target must have the same dtype, but got {compared.dtype} "
                f"(from {'the sum' if transform is None else 'transform'}) and {target.dtype}"
            )
        if compared.shape != target.shape or compared.shape[: sums.dim()] != sums.shape:
            raise ValueError(
                f"target must have the compared shape, which must start with the sum shape "
                f"{tuple(sums.shape)}, but got compared {tuple(compared.shape)} and target "
                f"{tuple(target.shape)}"
            )
        equal = bits(compared, canonical_nan=True) == target_bits.to(compared.device)
        masks[tree] = equal.reshape(*sums.shape, -1).all(dim=-1)
    return masks


def trees_by_row(masks: dict[Tree, torch.Tensor]) -> list[list[Tree]]:
    """Turn :func:`matching_trees`' ``{tree: mask}`` into one list of matching trees per row.

    Rows are the mask elements in C order (``mask.reshape(-1)``); trees keep the dict's order.

    Raises:
        ValueError: masks of different shapes, or a mask that is not boolean.
    """
    items = list(masks.items())
    if not items:
        return []
    shape = items[0][1].shape
    for tree, mask in items:
        if mask.dtype != torch.bool or mask.shape != shape:
            raise ValueError(
                f"every mask must be bool with shape {tuple(shape)}, but {tree} has {mask.dtype} "
                f"{tuple(mask.shape)}"
            )
    stacked = torch.stack([m.reshape(-1) for _, m in items], dim=-1).cpu().tolist()
    return [[items[k][0] for k, hit in enumerate(row) if hit] for row in stacked]


# -- catalogue ------------------------------------------------------------------------------------
_THREADS = (32, 64, 128, 256, 512, 1024)
_VECTORS = (1, 2, 4, 8)

DEFAULT_TREES: tuple[Tree, ...] = (
    Tree.sequential(),
    *(Tree.pairwise(b) for b in (1, 2, 4, 8, 16, 32)),
    Tree.numpy(),
    Tree.torch_cpu(8),
    Tree.torch_cpu(16),
    *(
        Tree.blocked(t, v, offsets=o, warps=w)
        for o in ("desc", "asc")
        for w in _WARP_COMBINE
        for t in _THREADS
        for v in _VECTORS
    ),
)
"""Plausible orders: sequential; pairwise with leaves of 1..32; numpy; torch CPU with AVX2 (8) and
AVX512 (16) vectors; one-block-per-row CUDA reductions with threads in {32..1024} x loads of
{1, 2, 4, 8} x {desc, asc} shuffle offsets x {butterfly, serial} cross-warp stage (104 trees)."""


_PROBE_WIDTHS = (16, 8, 4, 32, 1, 2, 64)


@functools.lru_cache(maxsize=1)
def torch_cpu_tree() -> Tree:
    """The :meth:`Tree.torch_cpu` order that reproduces ``torch.sum(x, -1)`` on this machine.

    Found by testing each vector width against ``torch.sum`` on heavy-tailed random float32 rows of
    lengths 1..300 and a few longer ones (a private generator; the global seed is untouched), where
    different widths give different bits. Cached per process.

    Raises:
        RuntimeError: no width, or more than one, reproduces torch.sum (an unknown torch kernel).
    """
    gen = torch.Generator().manual_seed(20240607)
    rows = []
    for n in [*range(1, 301), 515, 1031, 2053, 4099]:
        mant = torch.rand(8, n, generator=gen) * 2 - 1
        expo = torch.randint(-24, 24, (8, n), generator=gen).float()
        rows.append(mant * torch.exp2(expo))
    hits = [
        w
        for w in _PROBE_WIDTHS
        if all(torch.equal(bits(torch.sum(r, -1), canonical_nan=True), bits(_torch_cpu(r, w), canonical_nan=True))
               for r in rows)
    ]
    if len(hits) != 1:
        raise RuntimeError(
            f"expected exactly one vector width whose cascade order reproduces torch.sum on this CPU, "
            f"but {hits or 'none'} of {_PROBE_WIDTHS} did (torch {torch.__version__}, "
            f"capability {torch.backends.cpu.get_cpu_capability()})"
        )
    return Tree.torch_cpu(hits[0])
