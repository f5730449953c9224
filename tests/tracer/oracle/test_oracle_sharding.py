"""The ``sharded`` hypothesis: a linear layer whose reduction is split over processes (row-parallel TP).

Simulated in one process, exactly as transformers' ``RowwiseParallel`` computes it: each shard's local
``F.linear`` in BF16 (FP32 accumulation, one rounding to BF16), then the BF16 partials summed as an
all-reduce does (BF16 after every add, per-element order varying). Without the shard information those
outputs fall outside HF's semantics; with it they are a named boundary and never an error, while a stale
weight shard stays an error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ulptrace.oracle import capture_semantics, judge
from ulptrace.oracle.sharding import ShardedReduction, split_ops


def _linear(out_features: int, in_features: int, seed: int = 0, bias: bool = False) -> torch.nn.Linear:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    layer.weight.data = (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)
    if bias:
        layer.bias.data = (torch.randn(out_features) * 0.05).to(torch.bfloat16)
    return layer


def _row_parallel(x: torch.Tensor, layer: torch.nn.Linear, sizes: list[int], order_seed: int = 0) -> torch.Tensor:
    """What N processes compute: BF16 partials over contiguous input slices, summed in BF16 in a
    per-element random order (an all-reduce's ring order differs between chunks), then the bias."""
    partials, start = [], 0
    for size in sizes:
        partials.append(F.linear(x[..., start:start + size], layer.weight[:, start:start + size]))
        start += size
    stack = torch.stack(partials)
    gen = torch.Generator().manual_seed(order_seed)
    order = torch.argsort(torch.rand(stack.shape, generator=gen), dim=0)
    shuffled = torch.gather(stack, 0, order)
    total = shuffled[0]
    for p in shuffled[1:]:
        total = (total.float() + p.float()).to(torch.bfloat16)
    if layer.bias is not None:
        total = total + layer.bias
    return total


def _program(layer: torch.nn.Linear, x: torch.Tensor):
    return capture_semantics(lambda x: layer(x), {"x": x}, constant_names={"o_proj.weight": layer.weight,
                                                                          "o_proj.bias": layer.bias}
                             if layer.bias is not None else {"o_proj.weight": layer.weight}, name="o_proj")


@pytest.mark.parametrize("sizes", [[64, 64], [48, 48, 32], [32, 32, 32, 32]])
@pytest.mark.parametrize("bias", [False, True])
def test_row_parallel_partial_sums_are_the_named_boundary(sizes: list[int], bias: bool) -> None:
    layer = _linear(96, 128, bias=bias)
    torch.manual_seed(1)
    x = torch.randn(4, 16, 128).to(torch.bfloat16)
    out = _row_parallel(x, layer, sizes)
    reference = layer(x)
    program = _program(layer, x)
    assert not bool(torch.equal(out, reference))

    plain = judge(program, {"x": x}, out, reference)
    assert plain.counts["error"] > 0  # outside HF's semantics, and no unsharded hypothesis explains it

    spec = ShardedReduction("o_proj.weight", 1, tuple(sizes))
    j = judge(program, {"x": x}, out, reference, shards=[spec])
    assert j.counts["error"] == 0 and j.counts["nonfinite"] == 0
    assert j.counts["boundary"] > 0
    assert j.boundary is not None and j.boundary.startswith("partial sums rounded to BF16 before the all-reduce")
    assert f"{len(sizes)} shards: {'+'.join(map(str, sizes))} of the 128-term reduction" in j.boundary
    assert j.explained == 1.0


def test_stale_shard_is_still_an_error() -> None:
    layer = _linear(96, 128)
    torch.manual_seed(1)
    x = torch.randn(4, 16, 128).to(torch.bfloat16)
    stale = _linear(96, 128)
    stale.weight.data[7, 100] += 0.5  # one element of the second shard
    out = _row_parallel(x, stale, [64, 64])
    j = judge(_program(layer, x), {"x": x}, out, layer(x), shards=[ShardedReduction("o_proj.weight", 1, (64, 64))])
    assert j.counts["error"] > 0
    assert bool(j.mask("error")[..., 7].any()) and not bool(j.mask("error")[..., :7].any())


def test_only_a_split_reduction_gets_the_hypothesis() -> None:
    layer = _linear(128, 128)  # square: the split dim must be followed, not guessed from sizes
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    program = _program(layer, x)
    (op, (spec, terms)), = split_ops(program, [ShardedReduction("o_proj.weight", 1, (64, 64))]).items()
    assert program.ops[op].name == "mm" and terms == 128 and spec.sizes == (64, 64)
    # a column-parallel weight (split along the output features) splits no reduction
    assert split_ops(program, [ShardedReduction("o_proj.weight", 0, (64, 64))]) == {}
    # shards that do not cover the dim, or another constant, name nothing
    assert split_ops(program, [ShardedReduction("o_proj.weight", 1, (64, 32))]) == {}
    assert split_ops(program, [ShardedReduction("other.weight", 1, (64, 64))]) == {}


def test_unsharded_output_stays_inside_with_the_hypothesis_offered() -> None:
    layer = _linear(96, 128)
    x = torch.randn(4, 16, 128).to(torch.bfloat16)
    reference = layer(x)
    j = judge(_program(layer, x), {"x": x}, reference, reference,
              shards=[ShardedReduction("o_proj.weight", 1, (64, 64))])
    assert j.counts["exact"] == reference.numel()
