"""The replay's own walk of op arguments and binding by schema name give what torch's pytree and the schema give, on
every op of every program the oracle captures for both model families — the replay's speed must not come from
reading an argument differently."""

from __future__ import annotations

import pytest
from torch.utils._pytree import tree_flatten, tree_map
from ulptrace.models import build_model
from ulptrace.oracle.hypotheses import enumerate_hypotheses
from ulptrace.oracle.rules import arg_leaves, bind, map_args
from ulptrace.record import Recorder
from ulptrace.run import greedy, make_prompts
from ulptrace.verdicts import OracleJudge


def _programs(name: str) -> list:
    model = build_model(name)
    with Recorder(model, steps=[0, 1]) as rec:
        greedy(model, make_prompts(model.config.vocab_size, 2, 5, 0), 2)
    judge = OracleJudge(model)
    programs = []
    for record in rec.trace:
        site = judge.site(record.site)
        if site is None or site.formula is None:
            continue
        program = judge.program(site, record.inputs)
        if not hasattr(program, "judge"):  # a construction of its own (the GatedDeltaNet scan) has no ops
            programs.append(program)
    return programs


def _schema_bind(func, args, kwargs) -> dict:
    """Binding by reading the schema's arguments one by one (the definition ``bind`` must keep)."""
    bound, positional = {}, list(args)
    for arg in func._schema.arguments:
        if not arg.kwarg_only and positional:
            bound[arg.name] = positional.pop(0)
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-llama"])
def test_arguments_walked_and_bound_as_torch_reads_them(name) -> None:
    programs = _programs(name)
    ops = [op for program in programs for op in program.ops]
    assert len(programs) > 10 and len(ops) > 200
    kinds = {type(leaf) for op in ops for leaf in tree_flatten((op.args, op.kwargs))[0]}
    assert {int, list} & {type(a) for op in ops for a in op.args} and len(kinds) >= 3  # a variety of argument types
    for op in ops:
        tree = (op.args, op.kwargs)
        tagged = lambda a: ("leaf", a)  # every leaf wrapped: the structure is compared too
        assert map_args(tagged, tree) == tree_map(tagged, tree), op
        assert arg_leaves(tree) == tree_flatten(tree)[0], op
        assert bind(op.func, op.args, op.kwargs) == _schema_bind(op.func, op.args, op.kwargs), op


def test_hypotheses_are_enumerated_once_per_program_and_shards() -> None:
    program = next(p for p in _programs("tiny-llama") if enumerate_hypotheses(p))
    first = enumerate_hypotheses(program)
    again = enumerate_hypotheses(program)
    assert again == first and again is not first  # a fresh list each time: a caller may change it
    assert all(a is b for a, b in zip(again, first))  # ... of the hypotheses made once
    assert enumerate_hypotheses(program, ()) == first  # no shards: the same set of shards as the default
