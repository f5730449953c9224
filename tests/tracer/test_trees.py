"""Tests for ulptrace.trees against independent ground truth.

Every order is re-implemented here as a scalar loop of ``numpy.float32`` adds written differently
from the vectorised module (recursion instead of levels, per-thread element lists and explicit lane
loops instead of reshapes), and checked bit for bit. numpy's and torch's own sums are checked against
``np.add.reduce`` and ``torch.sum`` themselves. Hand-derived cases use hex-float constants.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ulptrace.trees import (
    DEFAULT_TREES,
    KINDS,
    Tree,
    matching_trees,
    reduce_fp32,
    torch_cpu_tree,
    trees_by_row,
)

F32 = np.float32
ONE = float.fromhex("0x1p0")
E24 = float.fromhex("0x1p-24")  # half an FP32 ulp of 1.0: 1 + E24 is a tie that rounds to 1
E23 = float.fromhex("0x1p-23")  # one FP32 ulp of 1.0


def heavy_rows(rows: int, n: int, seed: int) -> np.ndarray:
    """float32 values spread over 40 binades, so different orders give different sums."""
    rng = np.random.default_rng(seed)
    return (rng.uniform(-1, 1, (rows, n)) * 2.0 ** rng.integers(-20, 20, (rows, n))).astype(F32)


def bits(values) -> list[int]:
    return np.asarray(values, dtype=F32).reshape(-1).view(np.uint32).tolist()


# -- ground truth: scalar numpy float32 simulations -------------------------------------------------
def gt_sequential(row) -> F32:
    total = F32(0)
    for value in row:
        total = F32(total + F32(value))
    return total


def gt_pairwise(row, base: int) -> F32:
    """Recursive form: the first P leaves (P the largest power of two below the leaf count) + the rest."""
    leaves = -(-len(row) // base)
    if leaves <= 1:
        return gt_sequential(row)
    split = (1 << ((leaves - 1).bit_length() - 1)) * base
    return F32(gt_pairwise(row[:split], base) + gt_pairwise(row[split:], base))


def gt_warp(values: list, offsets, shuffle: str = "xor") -> F32:
    """One warp of 32 lanes; returns lane 0. ``down`` is __shfl_down_sync (out of range: own value)."""
    lanes = list(values)
    assert len(lanes) == 32
    for offset in offsets:
        new = []
        for lane in range(32):
            if shuffle == "xor":
                other = lanes[lane ^ offset]
            else:
                other = lanes[lane + offset] if lane + offset < 32 else lanes[lane]
            new.append(F32(lanes[lane] + other))
        lanes = new
    return lanes[0]


def gt_blocked(row, threads, vector, offsets="desc", warps="butterfly", shuffle="xor") -> F32:
    n = len(row)
    order = (16, 8, 4, 2, 1) if offsets == "desc" else (1, 2, 4, 8, 16)
    per_thread = []
    for t in range(threads):
        mine = []  # the element indices thread t loads, in load order
        step = 0
        while (step * threads + t) * vector < n:
            first = (step * threads + t) * vector
            mine += [i for i in range(first, first + vector) if i < n]
            step += 1
        acc = F32(0)
        for i in mine:
            acc = F32(acc + row[i])
        per_thread.append(acc)
    shared = [gt_warp(per_thread[w : w + 32], order, shuffle) for w in range(0, threads, 32)]
    if warps == "serial":
        total = shared[0]
        for value in shared[1:]:
            total = F32(total + value)
        return total
    # the first warp reduces the warp totals, lanes without one holding 0 (also with a single warp)
    return gt_warp(shared + [F32(0)] * (32 - len(shared)), order, shuffle)


def gt_of(tree: Tree):
    if tree.kind == "sequential":
        return gt_sequential
    if tree.kind == "pairwise":
        return lambda row: gt_pairwise(row, tree.base)
    if tree.kind == "blocked":
        return lambda row: gt_blocked(row, tree.threads, tree.vector, tree.offsets, tree.warps)
    raise AssertionError(f"no scalar ground truth for {tree}")


def reduce_rows(data: np.ndarray, tree: Tree) -> list[int]:
    return bits(reduce_fp32(torch.from_numpy(data), tree).numpy())


# -- each order against its ground truth ------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
def test_sequential_is_a_left_to_right_loop(n):
    data = heavy_rows(3, n, seed=n)
    assert reduce_rows(data, Tree.sequential()) == bits([gt_sequential(r) for r in data])


@pytest.mark.parametrize("base", [1, 2, 3, 8, 32])
@pytest.mark.parametrize("n", [1, 5, 8, 33, 257, 1000])
def test_pairwise_matches_recursive_definition(n, base):
    data = heavy_rows(3, n, seed=n * 31 + base)
    assert reduce_rows(data, Tree.pairwise(base)) == bits([gt_pairwise(r, base) for r in data])


BLOCKED_CASES = [  # (threads, vector, n), n often not a multiple of threads * vector
    (32, 1, 1),
    (32, 1, 31),
    (32, 1, 100),
    (64, 2, 129),
    (96, 4, 1000),  # 3 warps: the cross-warp butterfly sees zero padding
    (128, 4, 515),
    (160, 3, 777),  # 5 warps, 3-wide loads
    (256, 8, 2000),
    (512, 2, 1024),  # an exact multiple
    (1024, 1, 3000),
    (1024, 8, 64),  # fewer elements than threads * vector
]


@pytest.mark.parametrize("threads,vector,n", BLOCKED_CASES, ids=lambda v: str(v))
def test_blocked_matches_lane_simulation(threads, vector, n):
    data = heavy_rows(2, n, seed=threads + vector + n)
    for offsets in ("desc", "asc"):
        for warps in ("butterfly", "serial"):
            tree = Tree.blocked(threads, vector, offsets=offsets, warps=warps)
            expected = [gt_blocked(r, threads, vector, offsets, warps) for r in data]
            assert reduce_rows(data, tree) == bits(expected), tree
            # __shfl_down_sync gives lane 0 the same value, so one tree describes both
            down = [gt_blocked(r, threads, vector, offsets, warps, shuffle="down") for r in data]
            assert bits(down) == bits(expected), tree


def test_blocked_variants_are_distinguishable():
    """The random rows above are hard enough that the variants really are different orders."""
    data = heavy_rows(4, 1000, seed=7)
    results = {str(t): tuple(reduce_rows(data, t)) for t in DEFAULT_TREES if t.kind == "blocked"}
    assert results["blocked:t256:v4"] != results["blocked:t256:v4:asc"]
    assert results["blocked:t256:v4"] != results["blocked:t256:v4:wserial"]
    assert len(set(results.values())) > len(results) // 2


@pytest.mark.parametrize("n", [*range(1, 20), 100, 128, 129, 136, 255, 256, 300, 1000, 4099])
def test_numpy_tree_reproduces_np_sum(n):
    data = heavy_rows(4, n, seed=n)
    assert reduce_rows(data, Tree.numpy()) == bits(np.add.reduce(data, axis=-1))


@pytest.mark.parametrize("n", [1, 3, 9, 200])
def test_rows_of_negative_zero_sum_to_positive_zero(n):
    """Every order starts from +0 like `float acc = 0.f`; numpy and torch start from their identity."""
    data = np.full((2, n), -0.0, dtype=F32)
    assert bits(np.sum(data, axis=-1)) == bits(torch.sum(torch.from_numpy(data), -1).numpy()) == [0, 0]
    for tree in DEFAULT_TREES:
        assert reduce_rows(data, tree) == [0, 0], tree


def test_reduce_along_another_dim():
    data = heavy_rows(37, 6, seed=3)  # reduce the 37 along dim 0
    tree = Tree.blocked(32, 2, offsets="asc")
    got = bits(reduce_fp32(torch.from_numpy(data), tree, dim=0).numpy())
    assert got == bits([gt_of(tree)(data[:, j]) for j in range(6)])
    cube = torch.from_numpy(heavy_rows(2 * 9, 5, seed=4).reshape(2, 9, 5))
    assert reduce_fp32(cube, "pairwise:b2", dim=1).shape == (2, 5)
    assert bits(reduce_fp32(cube, "pairwise:b2", dim=-2).numpy()) == bits(
        [[gt_pairwise(cube[i, :, j].numpy(), 2) for j in range(5)] for i in range(2)]
    )


# -- hand-derived rows ------------------------------------------------------------------------------
HAND_ROW = [ONE] + [E24] * 7  # 1 + e + e: each e alone is a tie that rounds back to 1
HAND_SUMS = {
    "sequential": "0x1p0",  # 1 + e ties to 1, seven times
    "pairwise:b8": "0x1p0",  # one leaf: sequential
    "pairwise:b4": "0x1.000004p0",  # (1+e+e+e = 1) + (4e = 2^-22)
    "pairwise:b2": "0x1.000006p0",  # ((1+e = 1) + 2e) + (2e + 2e) = 1 + 3 * 2^-23
    "pairwise:b1": "0x1.000006p0",
    "blocked:t32:v8": "0x1p0",  # thread 0 holds the whole row
    "blocked:t32:v4": "0x1.000004p0",  # thread 0: 1, thread 1: 4e, then 1 + 4e
    "blocked:t32:v1": "0x1.000006p0",  # lanes 0..7: offsets 4, 2, 1 pair as in pairwise:b1
}


def test_hand_derived_sums():
    x = torch.tensor([HAND_ROW], dtype=torch.float32)
    for spec, hexval in HAND_SUMS.items():
        assert reduce_fp32(x, spec).item() == float.fromhex(hexval), spec


def test_matching_trees_returns_exactly_the_orders_that_reproduce():
    x = torch.tensor([HAND_ROW, HAND_ROW], dtype=torch.float32)
    trees = [Tree.parse(s) for s in HAND_SUMS]
    target = torch.tensor([float.fromhex("0x1.000004p0"), float.fromhex("0x1p0")])
    masks = matching_trees(x, target, trees)
    assert list(masks) == trees
    assert trees_by_row(masks) == [
        [Tree.parse(s) for s in ("pairwise:b4", "blocked:t32:v4")],
        [Tree.parse(s) for s in ("sequential", "pairwise:b8", "blocked:t32:v8")],
    ]


def test_torch_sum_is_not_sequential_from_five_elements():
    """ATen sums rows shorter than its vector width with 4 interleaved accumulators, so element 4
    meets element 0 first: 1 + 2^-23 = 0x1.000002p0, then + e ties up to 0x1.000004p0 and stays.
    Left to right, 1 + e ties down to 1 three times and 1 + 2^-23 = 0x1.000002p0."""
    row = torch.tensor([[ONE, E24, E24, E24, E23]])
    assert torch.sum(row, -1).item() == float.fromhex("0x1.000004p0")
    assert gt_sequential(row[0].numpy()) == float.fromhex("0x1.000002p0")
    assert reduce_fp32(row, torch_cpu_tree()).item() == float.fromhex("0x1.000004p0")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_torch_sum_is_sequential_up_to_four_elements(n):
    data = heavy_rows(64, n, seed=n)
    assert bits(torch.sum(torch.from_numpy(data), -1).numpy()) == bits([gt_sequential(r) for r in data])


# -- torch's own CPU order --------------------------------------------------------------------------
def test_torch_cpu_tree_reproduces_torch_sum():
    tree = torch_cpu_tree()
    assert tree.kind == "torch_cpu" and tree in DEFAULT_TREES
    for n in [*range(1, 257, 3), 16, 64, 128, 256, 1024, 1031, 4096, 6000]:
        x = torch.from_numpy(heavy_rows(6, n, seed=1000 + n)).reshape(2, 3, n)
        assert bits(reduce_fp32(x, tree).numpy()) == bits(torch.sum(x, -1).numpy()), n
    # many rows: torch splits the rows across threads, each row stays one inner loop
    x = torch.from_numpy(heavy_rows(600, 256, seed=5))
    assert bits(reduce_fp32(x, tree).numpy()) == bits(torch.sum(x, -1).numpy())
    # HF's RMSNorm variance on CPU: mean is the same sum divided by the length
    assert bits(x.pow(2).mean(-1).numpy()) == bits((reduce_fp32(x.pow(2), tree) / 256).numpy())


def test_torch_cpu_widths_are_different_orders():
    x = torch.from_numpy(heavy_rows(8, 200, seed=9))
    assert bits(reduce_fp32(x, "torch_cpu:w8").numpy()) != bits(reduce_fp32(x, "torch_cpu:w16").numpy())


# -- matching with a transform ----------------------------------------------------------------------
MIDPOINT = float.fromhex("0x1.01p0")  # 1 + 2^-8: exactly between the BF16 neighbours 1 and 1 + 2^-7


def test_matching_through_a_bf16_transform():
    """Sums that differ by one FP32 ulp at a BF16 midpoint give different BF16 outputs."""
    rows = torch.tensor([[MIDPOINT, E24, E24, E24], [ONE, ONE, ONE, ONE]], dtype=torch.float32)
    weights = torch.tensor([1.0, 0.5, 3.0], dtype=torch.float32)

    def transform(sums: torch.Tensor) -> torch.Tensor:  # (rows,) -> (rows, 3) bf16
        return (sums[:, None] * weights).to(torch.bfloat16)

    sequential = torch.tensor([gt_sequential(r) for r in rows.numpy()])
    assert sequential[0].item() == MIDPOINT  # + e ties to even three times
    target = transform(sequential)
    assert target[0, 0].item() == ONE  # the midpoint ties to even BF16
    trees = [Tree.parse(s) for s in ("sequential", "pairwise:b1", "pairwise:b4", "blocked:t32:v1")]
    masks = matching_trees(rows, target, trees, transform=transform)
    for tree in trees:
        expected = transform(torch.tensor([gt_of(tree)(r) for r in rows.numpy()]))
        rowwise = (expected.view(torch.int16) == target.view(torch.int16)).all(-1)
        assert masks[tree].tolist() == rowwise.tolist(), tree
    # pairwise:b1 adds (e + e) = 2^-23 to the midpoint, which then rounds up in BF16
    assert masks[Tree.pairwise(1)].tolist() == [False, True]
    assert masks[Tree.sequential()].tolist() == [True, True]


def test_matching_against_a_random_order_finds_exactly_the_reproducing_ones():
    data = heavy_rows(5, 300, seed=11)
    trees = [t for t in DEFAULT_TREES if t.kind in ("sequential", "pairwise")] + [
        Tree.parse(s) for s in ("blocked:t64:v2", "blocked:t64:v2:asc", "blocked:t128:v1:wserial")
    ]
    source = Tree.parse("blocked:t64:v2")
    truth = {t: bits([gt_of(t)(r) for r in data]) for t in trees}
    target = torch.tensor(np.array(truth[source], dtype=np.uint32).view(F32))
    masks = matching_trees(torch.from_numpy(data), target, trees)
    for tree in trees:
        assert masks[tree].tolist() == [a == b for a, b in zip(truth[tree], truth[source])], tree
    assert masks[source].all()
    assert sum(int(m.sum()) for m in masks.values()) < len(trees) * 5 // 2  # the data discriminates


def test_default_catalogue_runs_and_nan_matches_any_nan():
    x = torch.from_numpy(heavy_rows(3, 48, seed=2))
    x[2, 5] = float("nan")
    target = reduce_fp32(x, "sequential")
    target[2] = -float("nan")  # another NaN bit pattern
    masks = matching_trees(x, target)
    assert list(masks) == list(DEFAULT_TREES)
    assert masks[Tree.sequential()].tolist() == [True, True, True]
    assert all(mask[2] for mask in masks.values())


# -- the Tree type ----------------------------------------------------------------------------------
def test_specs_round_trip_and_catalogue_is_complete():
    assert len(set(DEFAULT_TREES)) == len(DEFAULT_TREES)
    assert {t.kind for t in DEFAULT_TREES} == set(KINDS)
    for tree in DEFAULT_TREES:
        assert Tree.parse(str(tree)) == tree
        assert tree.describe().startswith(tree.kind + ": ")
    grid = {(t.threads, t.vector) for t in DEFAULT_TREES if t.kind == "blocked"}
    assert grid == {(t, v) for t in (32, 64, 128, 256, 512, 1024) for v in (1, 2, 4, 8)}
    assert str(Tree.blocked(256, 4)) == "blocked:t256:v4"
    assert Tree.parse("blocked:wserial:v2:t64:asc") == Tree.blocked(64, 2, offsets="asc", warps="serial")
    assert str(Tree.pairwise(8)) == "pairwise:b8" and str(Tree.sequential()) == "sequential"


def test_describe_spells_out_the_order():
    text = Tree.blocked(256, 4).describe()
    for part in (
        "256 threads",
        "4-wide loads",
        "sequential per thread",
        "xor-butterfly over 32 lanes",
        "16..1",
        "8 warps",
    ):
        assert part in text
    assert "in order" in Tree.blocked(128, 1, warps="serial").describe()
    assert "8-element leaves" in Tree.pairwise(8).describe()


@pytest.mark.parametrize(
    "spec",
    [
        "tree",
        "pairwise",
        "pairwise:b0",
        "pairwise:bx",
        "pairwise:b4:b8",
        "sequential:b4",
        "blocked:t256",
        "blocked:t100:v4",
        "blocked:t2048:v1",
        "blocked:t256:v0",
        "blocked:t256:v4:sideways",
        "torch_cpu:w3",
        "numpy:t32",
    ],
)
def test_bad_specs_raise(spec):
    with pytest.raises(ValueError):
        Tree.parse(spec)


def test_bad_tree_fields_raise():
    with pytest.raises(ValueError, match="takes only"):
        Tree("pairwise", base=4, threads=32)
    with pytest.raises(TypeError, match="must be an int"):
        Tree("pairwise", base=True)
    with pytest.raises(ValueError, match="offsets must be one of"):
        Tree.blocked(64, 1, offsets="up")
    with pytest.raises(ValueError, match=r"threads must be a multiple of 32 in \[32, 1024\], but got 48"):
        Tree.blocked(48, 1)
    with pytest.raises(TypeError):
        Tree.parse(8)  # type: ignore[arg-type]


def test_bad_inputs_raise():
    x = torch.ones(2, 4)
    with pytest.raises(TypeError, match="torch.bfloat16"):
        reduce_fp32(x.bfloat16(), "sequential")
    with pytest.raises(TypeError, match="float32"):
        reduce_fp32(x.double(), "sequential")
    with pytest.raises(TypeError, match="torch.Tensor"):
        reduce_fp32(np.ones(4, dtype=F32), "sequential")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty reduction"):
        reduce_fp32(torch.ones(3, 0), "pairwise:b2")
    with pytest.raises(ValueError, match="0-d"):
        reduce_fp32(torch.tensor(1.0), "sequential")
    with pytest.raises(IndexError, match=r"\[-2, 1\]"):
        reduce_fp32(x, "sequential", dim=2)
    with pytest.raises(TypeError, match="Tree or a spec"):
        reduce_fp32(x, 3)  # type: ignore[arg-type]


def test_bad_matching_arguments_raise():
    x = torch.ones(2, 4)
    with pytest.raises(ValueError, match="at least one tree"):
        matching_trees(x, torch.ones(2), trees=[])
    with pytest.raises(TypeError, match="same dtype"):
        matching_trees(x, torch.ones(2, dtype=torch.float64), trees=["sequential"])
    with pytest.raises(ValueError, match=r"compared \(2,\) and target \(2, 1\)"):
        matching_trees(x, torch.ones(2, 1), trees=["sequential"])
    with pytest.raises(ValueError, match="start with the sum shape"):
        matching_trees(x, torch.ones(3), trees=["sequential"], transform=lambda s: torch.ones(3))
    with pytest.raises(TypeError, match="must return a torch.Tensor"):
        matching_trees(x, torch.ones(2), trees=["sequential"], transform=lambda s: 1.0)
    with pytest.raises(ValueError, match="bool"):
        trees_by_row({Tree.sequential(): torch.ones(2)})


@pytest.mark.gpu
def test_cuda_tensors_give_the_cpu_bits():
    x = torch.from_numpy(heavy_rows(16, 777, seed=12))
    for spec in (
        "sequential",
        "pairwise:b4",
        "blocked:t256:v4",
        "blocked:t96:v2:asc:wserial",
        "numpy",
        "torch_cpu:w8",
    ):
        assert bits(reduce_fp32(x.cuda(), spec).cpu().numpy()) == bits(reduce_fp32(x, spec).numpy()), spec


# A test-only CUDA block reduction written from the blocked tree's definition, so the emulation is
# checked against real warp shuffles (xor and down) rather than against another simulation.
_BLOCK_SUM_CUDA = r"""
__global__ void block_sum_kernel(const float* x, float* out, int n, int vec, int asc, int serial, int down) {
  const float* row = x + (long)blockIdx.x * n;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nwarps = blockDim.x >> 5;
  float acc = 0.f;
  for (int first = t * vec; first < n; first += blockDim.x * vec)
    for (int v = 0; v < vec; ++v)
      if (first + v < n) acc += row[first + v];
  for (int k = 0; k < 5; ++k) {
    const int o = asc ? (1 << k) : (16 >> k);
    acc += down ? __shfl_down_sync(0xffffffffu, acc, o) : __shfl_xor_sync(0xffffffffu, acc, o);
  }
  __shared__ float totals[32];
  if (lane == 0) totals[warp] = acc;
  __syncthreads();
  if (warp != 0) return;
  if (serial) {
    if (lane == 0) {
      float s = totals[0];
      for (int w = 1; w < nwarps; ++w) s += totals[w];
      out[blockIdx.x] = s;
    }
    return;
  }
  float s = lane < nwarps ? totals[lane] : 0.f;
  for (int k = 0; k < 5; ++k) {
    const int o = asc ? (1 << k) : (16 >> k);
    s += down ? __shfl_down_sync(0xffffffffu, s, o) : __shfl_xor_sync(0xffffffffu, s, o);
  }
  if (lane == 0) out[blockIdx.x] = s;
}

torch::Tensor block_sum(torch::Tensor x, int64_t threads, int64_t vec, bool asc, bool serial, bool down) {
  auto out = torch::full({x.size(0)}, NAN, x.options());
  block_sum_kernel<<<x.size(0), threads>>>(x.data_ptr<float>(), out.data_ptr<float>(), x.size(1), vec,
                                           asc, serial, down);
  return out;
}
"""


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.usefixtures("cuda_compiler")
def test_blocked_tree_reproduces_a_real_cuda_block_reduction(tmp_path):
    from torch.utils.cpp_extension import load_inline

    ext = load_inline(
        name="ulptrace_test_block_sum",
        cpp_sources="torch::Tensor block_sum(torch::Tensor x, int64_t threads, int64_t vec, bool asc, "
        "bool serial, bool down);",
        cuda_sources=_BLOCK_SUM_CUDA,
        functions=["block_sum"],
        build_directory=str(tmp_path),
    )
    for threads, vector, n in [*BLOCKED_CASES, (1024, 4, 4096), (256, 4, 1024)]:
        x = torch.from_numpy(heavy_rows(64, n, seed=n + threads))
        for offsets in ("desc", "asc"):
            for warps in ("butterfly", "serial"):
                tree = Tree.blocked(threads, vector, offsets=offsets, warps=warps)
                expected = bits(reduce_fp32(x, tree).numpy())
                for down in (False, True):
                    got = ext.block_sum(x.cuda(), threads, vector, offsets == "asc", warps == "serial", down)
                    assert bits(got.cpu().numpy()) == expected, (tree, down)
