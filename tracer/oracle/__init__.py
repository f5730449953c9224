"""The FP64 oracle: reference semantics, interval replay, and per-element verdicts.

Typical use, for one site::

    norm = ref_model.model.layers[3].input_layernorm
    program = capture_semantics(lambda x: norm(x), {"x": x_ref}, constant_names=norm,
                                name="layers.3.input_layernorm")
    print(program)                                   # where the reference rounds, one op per line
    j = judge(program, {"x": x_cand}, y_cand, reference_output=y_ref)
    j.counts, j.boundary, j.explained, j.max_error_ulp
    judge(program, {"x": x_ref}, y_ref).inside       # is the reference inside its own semantics?
    emulate(program, {"x": x_ref}, reducer=lambda t, d: reduce_fp32(t, "blocked:t256:v4", d))

Public API: :func:`capture_semantics` -> :class:`Program`; :func:`judge` -> :class:`Judgement` (:func:`judge_stacked`: several records of one
program in one replay, :mod:`.members`)
(verdict codes index :data:`VERDICTS`, the one spelling of the verdict names everywhere in ulptrace;
:data:`WORSE_THAN_TIE`); :func:`admissible`; :func:`emulate`;
:func:`enumerate_hypotheses` / :class:`Hypothesis` / :class:`Mods`; :func:`supported_ops`;
:class:`UnsupportedOpError` (a ``NotImplementedError``).

Modules: :mod:`.program` (capture and listing), :mod:`.intervals` (float64 interval arithmetic and the
rounding model), :mod:`.rules` (the table of supported ops), :mod:`.attention` (fused SDPA ops),
:mod:`.replay` (admissible set, emulation), :mod:`.hypotheses`, :mod:`.judge`, :mod:`.members` (which records
stack).
"""

from __future__ import annotations

from ulptrace.oracle.hypotheses import Hypothesis, enumerate_hypotheses
from ulptrace.oracle.judge import VERDICTS, WORSE_THAN_TIE, HypothesisResult, Judgement, judge, judge_stacked
from ulptrace.oracle.program import Op, Program, Value, ValueRef, capture_semantics
from ulptrace.oracle.replay import Mods, admissible, emulate
from ulptrace.oracle.rules import UnsupportedOpError, supported_ops

__all__ = [
    "VERDICTS",
    "WORSE_THAN_TIE",
    "Hypothesis",
    "HypothesisResult",
    "Judgement",
    "Mods",
    "Op",
    "Program",
    "UnsupportedOpError",
    "Value",
    "ValueRef",
    "admissible",
    "capture_semantics",
    "emulate",
    "enumerate_hypotheses",
    "judge",
    "judge_stacked",
    "supported_ops",
]
