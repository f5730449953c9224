"""The GatedDeltaNet scan judged: FP64 mathematics, a propagated bound on honest FP32 orders, hypotheses.

Op-by-op interval replay (``ulptrace.oracle.replay``) does not work for the delta-rule scan: hundreds of
dependent steps widen the intervals until every value is admissible. This module judges the scan's two
outputs — the attention output ``core`` ``[B, T, Hv, dv]`` and the recurrent state handed to the cache
``state`` ``[B, Hv, dk, dv]`` — with its own construction.

**Mathematics (evaluated in float64 from the recorded inputs).** For every batch row, value head and
value column ``j`` the state column ``s_t = S_t[:, j]`` (length ``dk``) follows, token by token,

    q_t, k_t = l2norm(q_t) / sqrt(dk), l2norm(k_t)          (eps 1e-6 inside the root, as HF and FLA)
    s_t   = a_t (I - b_t k_t k_t^T) s_{t-1} + b_t v_tj k_t   with a_t = exp(g_t), b_t = beta_t
    o_tj  = q_t . s_t

(query/key heads repeated over value heads when there are fewer). HF's chunked WY/UT form, its
token-by-token form, flash-linear-attention's kernels and this evaluation are the same mathematics.

**The bound (sound part).** With ``|k_t| = 1`` and ``0 <= b_t <= 1`` the transition
``M_t = a_t (I - b_t k_t k_t^T)`` has spectral norm ``<= a_t <= 1``: an error already in the state never
grows. So an FP32 implementation's state error obeys, per column, ``e_t <= a_t e_{t-1} + r_t`` in the
2-norm, where ``r_t`` is the rounding error that token introduces; the output error is
``|q_t| e_t`` plus the rounding of the final dot product. This propagation is exact algebra.

**The local term (an estimate).** ``r_t`` is modelled as ``c * u * sqrt(dk) * (a_t|s_{t-1}| + b_t|v_tj| +
b_t|k_t . a_t s_{t-1}| + |s_t|)`` (``u = 2**-24``): every quantity a token's update touches, times the
probabilistic size of an FP32 dot product of length ``dk`` (``sqrt(dk) u``, Higham & Mary) rather than the
worst case ``dk u``; plus the error of the decay as applied, ``a_t |s_{t-1}| eta_t``, where chunked forms
compute decays as differences of FP32 cumulative sums within a chunk (``eta_t = c * u * (4 + sqrt(W) *
sum |g| over the last W = 64 tokens)``). ``c`` is :data:`SAFETY`. This is an estimate, not a proof; it is
validated in ``tests/tracer/oracle/test_gdn.py`` against honest orders evaluated in FP32 — HF's chunked
form at chunk sizes 16/32/64, HF's token-by-token form, a token-by-token scan with reversed dot-product
order — at the tiny and the Qwen3.5-0.8B head shapes, prompts up to 128 tokens and decode steps, each of
which must stay below half the bound; and the BF16-rounded state must leave it.

**Admissible set.** Output: the float64 value +- the bound, rounded to the output dtype (BF16) at both
ends; state: +- the bound in FP32. ``admissible_width`` reports the width in ULPs of the output so users
see how sharp the verdict is.

**Hypotheses** (:data:`HYPOTHESES`, named boundaries kernels introduce), each the same mathematics with
one change and the same bound (a hypothesis that rounds an intermediate of the chunked form also allows
each element to move by twice the scale of the changes the hypothesis makes in its chunk and head, since
the rounding of an intermediate can flip between implementations of the same design — an estimate,
validated on flash-linear-attention's kernels, see ``DeltaRuleSemantics._spread``): the state handed to the cache rounded to BF16; the decay gate ``g``
rounded to BF16 inside the scan; ``q``/``k`` normalised and rounded to BF16; the chunked form's
intra-chunk matrices (``u = T (beta v)`` and ``w = T (beta k decay)``) rounded to BF16 before the
tensor-core products; the output formed from an inter-chunk and an intra-chunk part rounded to BF16
separately; and the combination chunked tensor-core kernels use (q, k, the UT inverse and its
operands, u, w, each chunk's start state as the products read it, the corrected values and the
intra-chunk attention matrix, all BF16; see :func:`chunked`). Anything else outside
the admissible set — decay applied after the update, a dropped beta, a shifted position — is ``error``,
whatever its size.

The oracle never calls HF's module-level scan functions (HF binds them to flash-linear-attention at
import time when it is installed): it computes the mathematics itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from ulptrace.oracle import intervals as I

F64 = torch.float64
U32 = 2.0**-24
SAFETY = 1.0
"""Safety factor ``c`` of the local rounding estimate (see the module docstring)."""
WINDOW = 64
"""Chunk length whose FP32 cumulative decay sums the bound allows for."""
L2_EPS = 1e-6
SPREAD_QUANTILE = 0.9
"""Which quantile of a chunk's relative changes scales a rounding hypothesis's allowance (``DeltaRuleSemantics._spread``)."""

OUTPUTS = ("core", "state")


@dataclass
class Scan:
    """One float64 evaluation: outputs, and (when asked) the bound on honest FP32 implementations."""

    core: torch.Tensor  # [B, T, Hv, dv] float64
    state: torch.Tensor  # [B, Hv, dk, dv] float64
    core_bound: torch.Tensor | None = None
    state_bound: torch.Tensor | None = None


def _heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[B, T, Hk, d] -> [B, Hv, T, d] (query/key heads repeated over value heads, as HF does)."""
    hk = x.shape[2]
    if hk != hv:
        if hv % hk:
            raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
        x = x.repeat_interleave(hv // hk, dim=2)
    return x.transpose(1, 2)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One RNE of float64 ``x`` to ``dtype``, as float64 (``intervals.rne``: on the CPU one compiled pass where
    ``ulptrace.ulp.round_to``'s integer arithmetic takes a dozen; the same values, tested)."""
    return I.rne(x, dtype)


def prepare(inputs: Mapping[str, torch.Tensor], *, qk_bf16: bool = False, g_bf16: bool = False
            ) -> tuple[torch.Tensor, ...]:
    """float64 ``(q, k, v, g, beta, state)`` in the scan's layout ``[B, Hv, T, ...]`` from recorded inputs."""
    for role in ("query", "key", "value", "g", "beta"):
        if role not in inputs:
            raise ValueError(f"the GatedDeltaNet scan needs input {role!r}, but the record has {sorted(inputs)}")
    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    if query.dim() != 4 or key.shape != query.shape or value.dim() != 4 or value.shape[:2] != query.shape[:2]:
        raise ValueError(f"query/key [B, T, Hk, dk] and value [B, T, Hv, dv] expected, but got "
                         f"{list(query.shape)}, {list(key.shape)}, {list(value.shape)}")
    b, _, hv, dv = value.shape
    dk = query.shape[-1]
    q, k = _heads(query.to(F64), hv), _heads(key.to(F64), hv)
    q, k = _l2norm(q), _l2norm(k)
    if qk_bf16:
        q, k = _round(q, torch.bfloat16), _round(k, torch.bfloat16)
    q = q * dk**-0.5
    v = value.to(F64).transpose(1, 2)
    g = inputs["g"].to(F64).transpose(1, 2)
    if g_bf16:
        g = _round(g, torch.bfloat16)
    beta = inputs["beta"].to(F64).transpose(1, 2)
    state = inputs.get("state")
    s0 = torch.zeros(b, hv, dk, dv, dtype=F64, device=v.device) if state is None else state.to(F64)
    if s0.shape != (b, hv, dk, dv):
        raise ValueError(f"state must have shape {(b, hv, dk, dv)}, but got {tuple(s0.shape)}")
    return q, k, v, g, beta, s0


def scan(inputs: Mapping[str, torch.Tensor], *, bound: bool = True, g_bf16: bool = False, chunk: int = 64) -> Scan:
    """The float64 scan with the propagated bound (see the module docstring), ``chunk`` tokens at a time.

    Everything the bound needs per token comes out of matrix products within a chunk, so the cost is
    linear in the sequence length with few Python steps (a chunk loop, as HF's own scan has):

    - ``delta_t = beta_t (v_t - k_t . a_t s_{t-1})`` from a unit lower-triangular solve;
    - the read ``kv_t = k_t . a_t s_{t-1}``, the outputs ``o_t`` and the chunk's final state;
    - the squared column norms ``n_t = |s_t|^2 = a_t^2 n_{t-1} + 2 delta_t kv_t + delta_t^2 |k_t|^2`` and
      the error ``e_t = a_t (1 + eta_t) e_{t-1} + r_t``, both linear scalar recurrences, as decay-weighted
      lower-triangular products;
    - the output's dot-product term bounded by ``|q_t| |s_t|`` (Cauchy-Schwarz).
    """
    q, k, v, g, beta, s = prepare(inputs, g_bf16=g_bf16)
    b, hv, t, dk = q.shape
    dv = v.shape[-1]
    dev = v.device
    out = torch.empty(b, hv, t, dv, dtype=F64, device=dev)
    out_bound = torch.empty_like(out) if bound else None
    unit = SAFETY * U32 * math.sqrt(dk)
    window = g.abs().cumsum(-1)
    window = window - torch.nn.functional.pad(window, (WINDOW, 0))[..., :t]
    eta = SAFETY * U32 * (4 + math.sqrt(WINDOW) * window)  # [B, H, T]
    norm2 = (s * s).sum(-2)  # |s_0|^2 per column [B, H, dv]
    err = torch.zeros(b, hv, dv, dtype=F64, device=dev)
    for c0 in range(0, t, chunk):
        sl = slice(c0, min(c0 + chunk, t))
        qc, kc, vc, gc, bc, ec = q[..., sl, :], k[..., sl, :], v[..., sl, :], g[..., sl], beta[..., sl], eta[..., sl]
        n = qc.shape[-2]
        cum = gc.cumsum(-1)  # [B, H, n]
        lower = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        strict = (decay * (kc @ kc.transpose(-1, -2))).tril(-1)
        head = cum.exp()[..., None]  # decay from the chunk start
        read0 = head * (kc @ s)  # k_t . (decay) s_0
        system = torch.eye(n, dtype=F64, device=dev) + bc[..., None] * strict
        delta = torch.linalg.solve_triangular(system, bc[..., None] * (vc - read0), upper=False)
        kv = read0 + strict @ delta
        out[..., sl, :] = head * (qc @ s) + ((decay * (qc @ kc.transpose(-1, -2))).tril() @ delta)
        if bound:
            ksq = (kc * kc).sum(-1, keepdim=True)
            growth = 2 * delta * kv + delta * delta * ksq
            decay2 = decay * decay
            n_now = (decay2 @ growth + (head * head) * norm2[..., None, :]).clamp(min=0)  # |s_t|^2
            n_prev = torch.cat([norm2[..., None, :], n_now[..., :-1, :]], -2)
            a = gc.exp()[..., None]
            prev = a * n_prev.sqrt()  # a_t |s_{t-1}|
            now = n_now.sqrt()
            local = unit * (prev + bc[..., None] * (vc.abs() + kv.abs()) + now) + ec[..., None] * prev
            log_keep = (gc + torch.log1p(ec)).cumsum(-1)
            keep = (log_keep[..., :, None] - log_keep[..., None, :]).masked_fill(~lower, float("-inf")).exp()
            e_now = keep @ local + log_keep.exp()[..., None] * err[..., None, :]
            qn = qc.norm(dim=-1, keepdim=True)
            o = out[..., sl, :]
            out_bound[..., sl, :] = qn * e_now + unit * qn * now + unit * o.abs()  # type: ignore[index]
            norm2, err = n_now[..., -1, :], e_now[..., -1, :]
        tail = (cum[..., -1:] - cum).exp()[..., None]
        s = s * cum[..., -1].exp()[..., None, None] + (kc * tail).transpose(-1, -2) @ delta
    result = Scan(out.transpose(1, 2), s)
    if bound:
        result.core_bound = out_bound.transpose(1, 2)  # type: ignore[union-attr]
        result.state_bound = err[..., None, :].expand_as(s).clone()
    return result


STAGES = ("qk", "wy", "uw", "h", "v_new", "attn", "parts")
"""Where chunked kernels round to BF16 (see :func:`chunked`)."""


def chunked(inputs: Mapping[str, torch.Tensor], *, chunk: int = 64, stages: frozenset[str] = frozenset()) -> Scan:
    """The chunked (WY/UT) form in float64, rounding to BF16 where fast chunked kernels do (``stages``):

    - ``qk``: the L2-normalised q and k;
    - ``wy``: the inverse ``T`` of the chunk's unit lower-triangular system and the operands ``beta v`` and
      ``beta k exp(cumsum g)`` it multiplies (kernels that form ``T`` explicitly and store it in BF16);
    - ``uw``: ``u = T (beta v)`` and ``w = T (beta k exp(cumsum g))``, the intra-chunk matrices that meet
      the state and the intra-chunk attention in tensor-core products;
    - ``h``: each chunk's start state as the products read it (``w S`` and ``q S``; the carried state
      itself stays FP32);
    - ``v_new``: the corrected values ``u - w S`` as the intra-chunk attention reads them, and, weighted by
      the decay to the chunk's end, as the state update reads them;
    - ``attn``: the intra-chunk attention matrix ``(q k^T) * decay`` before its product with the values;
    - ``parts``: the inter-chunk and intra-chunk parts of the output, before they are added.
    """
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"stages must be among {STAGES}, but got {sorted(unknown)}")

    def at(stage: str, x: torch.Tensor) -> torch.Tensor:
        return _round(x, torch.bfloat16) if stage in stages else x

    q, k, v, g, beta, s = prepare(inputs, qk_bf16="qk" in stages)
    b, hv, t, _ = q.shape
    dv = v.shape[-1]
    pad = (chunk - t % chunk) % chunk
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    shape = (b, hv, n, chunk)
    q, k, v = (x.reshape(*shape, -1) for x in (q, k, v))
    g, beta = g.reshape(shape), beta.reshape(shape)
    cum = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    kb = k * beta[..., None]
    system = ((kb @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    eye = torch.eye(chunk, dtype=F64, device=q.device)
    vb, kbg = v * beta[..., None], kb * cum.exp()[..., None]
    if "wy" in stages:
        inverse = at("wy", torch.linalg.solve_triangular(eye + system, eye.expand_as(system), upper=False,
                                                         unitriangular=True))
        u, w = at("uw", inverse @ at("wy", vb)), at("uw", inverse @ at("wy", kbg))
    else:
        u = at("uw", torch.linalg.solve_triangular(eye + system, vb, upper=False, unitriangular=True))
        w = at("uw", torch.linalg.solve_triangular(eye + system, kbg, upper=False, unitriangular=True))
    attn = at("attn", ((q @ k.transpose(-1, -2)) * decay).masked_fill(~lower, 0.0))
    out = torch.empty(*shape, dv, dtype=F64, device=q.device)
    for c in range(n):
        read = at("h", s)
        v_new = u[:, :, c] - w[:, :, c] @ read
        inter = at("parts", (q[:, :, c] * cum[:, :, c, :, None].exp()) @ read)
        out[:, :, c] = inter + at("parts", attn[:, :, c] @ at("v_new", v_new))
        tail = (cum[:, :, c, -1:] - cum[:, :, c]).exp()[..., None]
        s = s * cum[:, :, c, -1].exp()[..., None, None] + k[:, :, c].transpose(-1, -2) @ at("v_new", v_new * tail)
    core = out.reshape(b, hv, n * chunk, dv)[:, :, :t]
    return Scan(core.transpose(1, 2), s)


# -- judging -------------------------------------------------------------------------------------

def _set(center: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``center +- bound`` with both ends rounded (RNE) to ``dtype``: every value an honest implementation
    can store lies between them."""
    return _round(center - bound, dtype), _round(center + bound, dtype)


@dataclass(frozen=True)
class _Hypothesis:
    kind: str
    description: str
    outputs: tuple[str, ...]  # which outputs it applies to
    stages: frozenset[str] = frozenset()  # the chunked form's BF16 roundings (see chunked())


HYPOTHESES: tuple[_Hypothesis, ...] = (
    _Hypothesis("state_bf16", "the recurrent state handed to the cache is rounded to BF16 (HF keeps it FP32)",
                ("state",)),
    _Hypothesis("g_bf16", "the decay gate g is rounded to BF16 inside the scan (HF keeps it FP32)", ("core", "state")),
    _Hypothesis("qk", "q and k are L2-normalised and rounded to BF16 before the scan (HF normalises in FP32)",
                ("core", "state"), frozenset({"qk"})),
    _Hypothesis("uw", "the chunked form's intra-chunk matrices u = T(beta v) and w = T(beta k decay) are "
                "rounded to BF16 before the tensor-core products (HF keeps them FP32)", ("core", "state"),
                frozenset({"uw"})),
    _Hypothesis("parts", "the output is formed from inter-chunk and intra-chunk parts each rounded to BF16 "
                "(HF adds them in FP32 and rounds once)", ("core",), frozenset({"parts"})),
    _Hypothesis("tensor_core", "a chunked kernel's BF16 tensor-core operands: q and k normalised in BF16, and the "
                "UT inverse with its operands, u, w, each chunk's start state as the products read it, the "
                "corrected values u - wS and the intra-chunk attention matrix in BF16 (the carried state FP32); "
                "HF keeps all of them FP32",
                ("core", "state"), frozenset({"qk", "wy", "uw", "h", "v_new", "attn"})),
    _Hypothesis("unrounded", "the output's final rounding to BF16 is missing (stored wider than HF's)", ("core",)),
)


class DeltaRuleSemantics:
    """Oracle semantics of one GatedDeltaNet scan output, ``core`` or ``state`` (see the module docstring).

    Has the interface ``ulptrace.verdicts`` uses for every site: ``judge(inputs, output,
    reference_output, hypotheses=...)`` and ``admissible(inputs)``. Inputs are the recorded scan
    arguments ``query``, ``key``, ``value``, ``g``, ``beta`` and optionally ``state`` (the incoming
    recurrent state; zeros when absent, as at a prefill).
    """

    def __init__(self, output: str, *, name: str | None = None) -> None:
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, but got {output!r}")
        self.output, self.name = output, name

    def _dtype(self, inputs: Mapping[str, torch.Tensor]) -> torch.dtype:
        return inputs["query"].dtype if self.output == "core" else torch.float32

    def _pick(self, result: Scan) -> torch.Tensor:
        return result.core if self.output == "core" else result.state

    def _bound(self, result: Scan) -> torch.Tensor:
        bound = result.core_bound if self.output == "core" else result.state_bound
        assert bound is not None
        return bound

    def admissible(self, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The admissible set's ends (float64) for the recorded ``inputs``."""
        base = scan(inputs)
        return _set(self._pick(base), self._bound(base), self._dtype(inputs))

    def width_ulps(self, inputs: Mapping[str, torch.Tensor]) -> float:
        """Median width of the admissible set, in ULPs of the output dtype (how sharp the verdict is)."""
        from ulptrace.ulp import ulp_distance

        lo, hi = self.admissible(inputs)
        dtype = self._dtype(inputs)
        return float(ulp_distance(lo.to(dtype), hi.to(dtype)).distance.double().median())

    def _hypothesis_set(self, h: _Hypothesis, inputs: Mapping[str, torch.Tensor], bound: torch.Tensor,
                        base: Scan) -> tuple[torch.Tensor, ...]:
        """``(lo, hi)`` of hypothesis ``h``, and its center where it is a chunked design (see ``judge_sets``)."""
        dtype = self._dtype(inputs)
        if h.kind == "state_bf16":
            lo, hi = _set(base.state, bound, dtype)
            return _round(lo, torch.bfloat16), _round(hi, torch.bfloat16)
        if h.kind == "unrounded":
            center = self._pick(base)
            return center - bound, center + bound
        if h.kind == "g_bf16":
            return _set(self._pick(scan(inputs, bound=False, g_bf16=True)), bound, dtype)
        center, exact = self._pick(chunked(inputs, stages=h.stages)), self._pick(base)
        return (*_set(center, bound + 2 * self._spread(center, exact), dtype), center)

    def _spread(self, center: torch.Tensor, exact: torch.Tensor, chunk: int = 64) -> torch.Tensor:
        """How far an implementation of a rounding hypothesis may land from this evaluation of it, per element.

        A stage rounds an *intermediate* value whose FP32 value before the rounding differs between
        implementations of the same kernel design, so each rounding may land on either neighbour, and
        cancellation amplifies such flips in single elements: this evaluation is one draw of that noise, not the
        value every implementation reaches, and a row's own draw can be small by chance. The scale is therefore
        taken over the rows of the same chunk and head (a row: one token's output vector, or one column of the
        state): the :data:`SPREAD_QUANTILE` quantile of the change relative to each row's RMS, times this row's
        RMS — a quantile, not the largest, since single rows with cancellation change by several times their RMS
        and would widen every row of the chunk — and never less than this row's own largest change. An
        estimate, validated on flash-linear-attention's chunked kernel captured on the H200 (random inputs, and
        two layers of Qwen3.5-0.8B where the row's own change left 1-2 ULP flips outside, issue 10): FLA lands
        within 1.4x of this scale (7.8x of the per-row one); twice it is allowed, about 5-10% of a row's RMS.
        """
        row = -1 if self.output == "core" else -2  # a state's rows are its columns (one per value channel)
        change = (center - exact).abs().amax(row, keepdim=True)
        rms = exact.pow(2).mean(row, keepdim=True).sqrt()
        relative = torch.where(rms > 0, change / rms, torch.zeros_like(rms))
        if self.output == "core":  # [B, T, H, 1]: over each chunk of tokens, per head
            b, t, heads, _ = relative.shape
            pad = (chunk - t % chunk) % chunk
            blocks = torch.nn.functional.pad(relative, (0, 0, 0, 0, 0, pad), value=float("nan"))
            blocks = blocks.reshape(b, -1, chunk, heads, 1)
            scale = blocks.nanquantile(SPREAD_QUANTILE, dim=2, keepdim=True)
            relative = scale.expand_as(blocks).reshape(b, -1, heads, 1)[:, :t]
        else:  # [B, H, 1, dv]: over the head's columns
            relative = relative.quantile(SPREAD_QUANTILE, dim=-1, keepdim=True)
        return torch.maximum(relative * rms, change).expand_as(center)

    @property
    def stack_key(self) -> tuple:
        """Equal for semantics that judge records alike: the scan is a function of its inputs alone (no parameters of
        a layer) and treats each batch item alone, so records of any layer and step with inputs of equal shapes per
        batch item can be judged stacked along dimension 0 (:meth:`judge_stacked`)."""
        return ("delta_rule", self.output)

    def judge(self, inputs: Mapping[str, torch.Tensor], output: torch.Tensor,
              reference_output: torch.Tensor | None = None, *, hypotheses: bool = True) -> Any:
        """Per-element verdicts of ``output`` (a ``ulptrace.oracle.Judgement``)."""
        return self.judge_stacked(inputs, output, reference_output, hypotheses=hypotheses)[0]

    def judge_stacked(self, inputs: Mapping[str, torch.Tensor], output: torch.Tensor,
                      reference_output: torch.Tensor | None = None, layout: Any = None,
                      sites: Sequence[str | None] | None = None, *, hypotheses: bool = True) -> list[Any]:
        """:meth:`judge` of the records of ``layout`` (``ulptrace.oracle.intervals.Layout``: their batch items
        stacked along dimension 0 of every input and output; default one record), in one evaluation: each record's
        judgement is the one :meth:`judge` gives it alone (every step of the scan, the bound and the spread of a
        hypothesis treat each batch item alone)."""
        from ulptrace.oracle.intervals import Layout
        from ulptrace.oracle.judge import HypothesisResult, judge_sets_stacked

        layout = layout or Layout.of(1)
        base = scan(inputs)
        center, bound = self._pick(base), self._bound(base)
        if tuple(output.shape) != tuple(center.shape):
            raise ValueError(f"{self.name or 'GatedDeltaNet scan'}: the {self.output} output must have shape "
                             f"{tuple(center.shape)} for these inputs, but got {tuple(output.shape)}")
        if layout.units not in (1, center.shape[0]):
            raise ValueError(f"a layout of {layout.units} batch items for outputs of {center.shape[0]}")
        dtype = self._dtype(inputs)
        lo, hi = _set(center, bound, dtype)
        options = []
        if hypotheses:
            for i, h in enumerate(HYPOTHESES):
                if self.output in h.outputs:
                    # the chunked designs (different intermediates rounded) are rivals: the best fit is named
                    rivals = tuple(o.kind for o in HYPOTHESES[:i] if o.stages and h.stages)
                    options.append((HypothesisResult(h.kind, h.description, None, 0),
                                    lambda h=h: self._hypothesis_set(h, inputs, bound, base), rivals))
        names = list(sites) if sites is not None else [self.name] * layout.count
        return judge_sets_stacked(output, reference_output, lo, hi, _round(center, dtype), options, dtype, names,
                                  layout)

    def __str__(self) -> str:
        return (f"GatedDeltaNet scan, output {self.output!r}: float64 delta rule on the recorded q, k, v, g, beta "
                f"and incoming state (q, k L2-normalised, q scaled by 1/sqrt(dk)); admissible set = float64 value "
                f"+- a bound propagated through the contracting recurrence (safety {SAFETY}, decay window {WINDOW}); "
                f"hypotheses: " + "; ".join(h.kind for h in HYPOTHESES if self.output in h.outputs))
