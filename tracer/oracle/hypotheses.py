"""Hypotheses: the captured program with one rounding decision changed, named for a kernel engineer.

An output that falls outside the admissible set is not yet a bug: the kernel may have skipped one of
HF's roundings (a fused residual-add + norm that normalises the FP32 sum), added one (``(1 + w)`` formed
on the BF16 parameter), or fused everything into one final rounding (a GLU epilogue). Each hypothesis
is a :class:`~ulptrace.oracle.replay.Mods` plus a sentence naming the op, its index and the dtype:

- ``missing``: one BF16/FP16 rounding point removed (its result kept in FP32), for every narrow
  rounding point except the output's own;
- ``added``: one FP32 result rounded to the program's narrow dtype, for every FP32 rounding point
  (upcasts and views excluded, the output op included: a kernel that emits an FP32 site in BF16);
- ``attention``: rounding stages inside a fused attention op (see :mod:`ulptrace.oracle.attention`);
- ``fused``: every narrow intermediate rounding removed, only the output rounded (listed only when it
  differs from a single ``missing`` hypothesis); and, for a narrow output, everything kept in FP32;
- fused attention (for decomposed attention with a softmax): scores kept in FP32, probabilities rounded as
  the reference does or unnormalised as flash kernels do;
- ``unrounded``: the output's own narrow rounding missing (listed last among single points): only a candidate stored
  wider than the reference (an FP32 site where HF emits BF16) can fall there;
- ``sharded`` (only when the caller says which parameters are sharded, see :mod:`ulptrace.oracle.sharding`): a
  matmul whose reduction runs over a parameter split into shards, computed as per-shard partial results
  rounded to the result dtype and summed by an all-reduce — what a row-parallel linear layer does under
  tensor parallelism. Listed first: when the run is sharded, that structure is known, not guessed.

They are listed simplest first (single points in op order, then multi-point attention stages, then
``fused``), which is the order ties are broken in when naming the best explanation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from ulptrace.oracle import intervals as I
from ulptrace.oracle.program import Program, dtype_word
from ulptrace.oracle.replay import Mods
from ulptrace.oracle.sharding import ShardedReduction, describe, split_ops


@dataclass(frozen=True)
class Hypothesis:
    """One program modification and its name.

    Attributes:
        kind: ``"missing"``, ``"added"``, ``"attention"``, ``"unrounded"`` (the output's own rounding
            skipped), ``"fused"`` or ``"sharded"``.
        description: the sentence shown to the user.
        op: the op index it is about (None for ``fused``).
        mods: what the replay changes.
    """

    kind: str
    description: str
    op: int | None
    mods: Mods


def _attention_hypotheses(program: Program, op_index: int) -> list[Hypothesis]:
    op = program.ops[op_index]
    narrow = op.attrs.get("input_dtype")
    if narrow not in I.NARROW_DTYPES:
        return []
    word = dtype_word(narrow)
    where = f"inside `{program.op_label(op_index)}` (op {op_index})"
    options: list[tuple[frozenset[str], str]] = []
    # one rounding of the scores where a kernel stores them narrow: the product alone, or the scaled scores once
    narrow_scores = [
        (frozenset({"qk"}), f"attention scores `q @ k^T` rounded to {word} before the scale {where}"),
        (frozenset({"scores_once"}), (f"attention scores rounded to {word} once, scaled, before the softmax "
                                      f"{where}")),
    ]
    if op.attrs.get("attention") == "fp32":
        options += [
            (frozenset({"probs"}), f"attention probabilities rounded to {word} before P @ V {where}"),
            (frozenset({"flash"}), (f"unnormalised attention probabilities rounded to {word} before P @ V "
                                    f"{where}, as flash kernels do")),
            (frozenset({"scores"}), f"attention scores rounded to {word} before the softmax {where}"),
            (frozenset({"scores", "probs"}), (f"eager-style attention {where}: scores and probabilities "
                                              f"rounded to {word}")),
            *narrow_scores,
        ]
    else:
        options += [
            (frozenset({"scores"}), (f"attention scores rounded to {word} before the softmax {where}, "
                                     "as HF's eager path does")),
            *narrow_scores,
        ]
    return [Hypothesis("attention", text, op_index, Mods(attention={op_index: stages})) for stages, text in options]


def enumerate_hypotheses(program: Program, shards: Iterable[ShardedReduction] = ()) -> list[Hypothesis]:
    """Every hypothesis for a program, simplest first (see the module docstring).

    Args:
        program: from :func:`~ulptrace.oracle.program.capture_semantics`.
        shards: parameters (program constants) split into shards by the judged run, e.g. a row-parallel
            weight under tensor parallelism: each matmul contracting over a split dim gets a ``sharded``
            hypothesis.

    Returns:
        the list; empty when the program has no rounding decision to change. Computed once per program and
        set of shards (``Program.memo``: a judge enumerates them for every record of a site's shape).
    """
    key = ("hypotheses", tuple(shards))
    if key not in program.memo:
        program.memo[key] = tuple(_enumerate(program, key[1]))
    return list(program.memo[key])


def _enumerate(program: Program, shards: tuple[ShardedReduction, ...]) -> list[Hypothesis]:
    out_ops = program.output_ops()
    narrow = program.narrow_dtype
    missing: list[Hypothesis] = []
    added: list[Hypothesis] = []
    attention: list[Hypothesis] = []
    for op in program.ops:
        i = op.index
        if i not in program.live:
            continue
        if program.kind(i) == "attention":
            attention += _attention_hypotheses(program, i)
        if not program.is_rounding_point(i):
            continue
        dtype = program.result_dtype(i)
        label = program.op_label(i)
        if dtype in I.NARROW_DTYPES and i not in out_ops:
            missing.append(Hypothesis("missing", f"the {dtype_word(dtype)} rounding of `{label}` (op {i}) is missing",
                                      i, Mods(keep_fp32=frozenset({i}))))
        elif dtype == torch.float32 and narrow is not None:
            added.append(Hypothesis("added", f"`{label}` (op {i}) rounded to {dtype_word(narrow)}", i,
                                    Mods(round_narrow=frozenset({i}))))
    # the output's own narrow rounding skipped: a site that emits its FP32 result (only a candidate stored
    # wider than the reference can land there; for a narrow candidate it admits nothing new)
    unrounded = [i for i in out_ops if program.is_rounding_point(i) and program.result_dtype(i) in I.NARROW_DTYPES]
    final = [Hypothesis("unrounded", f"the final {dtype_word(program.result_dtype(i))} rounding of "
                        f"`{program.op_label(i)}` (op {i}) is missing: the result is kept in FP32", i,
                        Mods(keep_fp32=frozenset({i}))) for i in unrounded]
    sharded = [Hypothesis("sharded", describe(program, i, spec, terms), i, Mods(split={i: spec.sizes}))
               for i, (spec, terms) in sorted(split_ops(program, shards).items())]
    hypotheses = sharded + missing + added + attention + final
    every = frozenset(h.op for h in missing if h.op is not None)
    if len(missing) >= 2:
        hypotheses.append(Hypothesis("fused", "all intermediates fused into one final rounding", None,
                                     Mods(keep_fp32=every)))
    if unrounded and missing:
        hypotheses.append(Hypothesis("fused", "computed entirely in FP32, never rounded to "
                                     f"{dtype_word(program.result_dtype(unrounded[0]))}", None,
                                     Mods(keep_fp32=every | frozenset(unrounded))))
    return hypotheses + _fused_attention_hypotheses(program, missing)


def _fused_attention_hypotheses(program: Program, missing: list[Hypothesis]) -> list[Hypothesis]:
    """For a decomposed attention (eager: matmul, scale, softmax, cast, matmul), what fused kernels do instead:
    scores kept in FP32 (every narrow rounding before the softmax skipped), with the probabilities either
    rounded as the reference does, or rounded unnormalised as flash kernels do, or kept in FP32."""
    out: list[Hypothesis] = []
    for op in program.ops:
        if "softmax" not in op.name or op.index not in program.live:
            continue
        before = frozenset(h.op for h in missing if h.op is not None and h.op < op.index)
        after = sorted(h.op for h in missing if h.op is not None and h.op > op.index)
        if not before:
            continue
        skipped = ", ".join(f"`{program.op_label(i)}` (op {i})" for i in sorted(before))
        word = dtype_word(program.narrow_dtype) if program.narrow_dtype is not None else "the narrow dtype"
        head = f"fused attention around `{op.name}` (op {op.index}): scores kept in FP32 (skips {skipped})"
        out.append(Hypothesis("attention", head, op.index, Mods(keep_fp32=before)))
        if after:
            probs = after[0]
            out.append(Hypothesis("attention", f"{head}, probabilities rounded to {word} unnormalised, as flash "
                                  "kernels do", op.index, Mods(keep_fp32=before, widen_narrow=frozenset({probs}))))
    return out
