"""GatedDeltaNet scan variants for the GDN oracle tests, written independently of ``ulptrace.oracle.gdn``.

``delta_rule`` is a plain token-by-token implementation of the gated delta rule with the arithmetic
dtype and the defects as arguments; the ``*_path`` functions install a variant in place of HF's scan
functions (through ``ulptrace.taps``, as a user's kernel injection would) and return the undo.
"""

from __future__ import annotations

import sys

import torch
from ulptrace.sites import GDN_FUNCTIONS
from ulptrace.taps import tap


def delta_rule(query, key, value, g, beta, initial_state=None, *, dtype=torch.float64, decay_after=False,
               reverse_dots=False, **_):
    """Token by token: normalise q and k, decay the state by exp(g), read it with k, write beta (v - read) k^T,
    read the output with q / sqrt(dk). Returns ``(core [B, T, Hv, dv] in query's dtype, state float32)``."""
    b, t, hk, dk = query.shape
    hv = value.shape[2]
    rep = hv // hk

    def norm(x):
        x = x.to(dtype).repeat_interleave(rep, dim=2)
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    q, k = norm(query) / dk**0.5, norm(key)
    v, gg, bb = value.to(dtype), g.to(dtype), beta.to(dtype)
    s = (torch.zeros(b, hv, dk, value.shape[-1], dtype=dtype, device=value.device) if initial_state is None
         else initial_state.to(dtype))
    outs = []
    def dot(x, y):  # sum over the key dimension, optionally in reversed order
        terms = x * y
        return (terms.flip(-2) if reverse_dots else terms).sum(-2)

    for i in range(t):
        a = gg[:, i].exp()[..., None, None]
        kt, qt = k[:, i], q[:, i]
        if not decay_after:
            s = s * a
        read = dot(s, kt[..., :, None])
        s = s + kt[..., :, None] * ((v[:, i] - read) * bb[:, i][..., None])[..., None, :]
        if decay_after:
            s = s * a
        outs.append(dot(s, qt[..., :, None]))
    return torch.stack(outs, 1).to(query.dtype), s.float()


def _install(model, impl):
    gdn = next(m for m in model.modules() if hasattr(m, "A_log"))
    namespace = sys.modules[type(gdn).__module__]
    handles = [tap(namespace, name).set_impl(impl(tap(namespace, name).original)) for name in GDN_FUNCTIONS]
    return lambda: [h.remove() for h in handles]


def _scan(**options):
    def impl(original):
        def call(query, key, value, g, beta, *args, initial_state=None, **kwargs):
            return delta_rule(query, key, value, g, beta, initial_state, **options)

        return call

    return impl


def float64_scan_path(model):
    """Valid variant: the scan in float64, token by token, output rounded once."""
    return _install(model, _scan())


def decay_after_update_path(model):
    """Defect: the decay applied after the delta-rule update instead of before (FP32)."""
    return _install(model, _scan(dtype=torch.float32, decay_after=True))


def state_to_bf16_path(model):
    """Boundary: HF's own scan, but the state handed to the cache is rounded to BF16 (FP32 inside)."""

    def impl(original):
        def call(*args, **kwargs):
            core, state = original(*args, **kwargs)
            return core, None if state is None else state.to(torch.bfloat16).float()

        return call

    return _install(model, impl)


def g_bf16_inside_path(model):
    """Boundary: HF's own scan fed the decay gate rounded to BF16 (the recorded g stays FP32)."""

    def impl(original):
        def call(query, key, value, g, beta, *args, **kwargs):
            return original(query, key, value, g.to(torch.bfloat16).float(), beta, *args, **kwargs)

        return call

    return _install(model, impl)
