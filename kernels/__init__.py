"""The kernel-injected path: CUDA kernels, their plain-torch references, and injection into HF models.

Each op has one stem across layers (``csrc/<op>.cu``, ``<op>.py``, ``tests/kernels/test_<op>.py``,
``bench/bench_<op>.py``) and comes as a dispatching function (CUDA kernel or reference) plus its
reference, both with ``mode="faithful"`` (HF's rounding points) or ``mode="fused"`` (FP32 inside,
one final rounding). :func:`inject` puts them into a model; :func:`faithful` and :func:`fused` are
the ``kernels:faithful`` / ``kernels:fused`` paths.

Importing this package imports torch (not transformers) and builds nothing; the CUDA extension
is compiled on the first kernel call. The functions are bound eagerly because several share their
module's name (``glu`` in ``glu.py``, ``inject`` in ``inject.py``): the function wins, and the
modules stay importable by their dotted names (``ulptrace.kernels.inject:faithful``).
"""

from __future__ import annotations

if __name__ == "kernels":  # this folder reached as a top-level package from the checkout's root
    from ulptrace._toplevel import step_aside

    step_aside(__name__, __file__, globals())
else:
    from ulptrace.kernels._build import KernelBuildError
    from ulptrace.kernels._build import available as kernels_available
    from ulptrace.kernels.decode_attention import decode_attention, decode_attention_reference
    from ulptrace.kernels.gated_rms_norm import gated_rms_norm, gated_rms_norm_reference
    from ulptrace.kernels.gdn_gates import gdn_gates, gdn_gates_reference
    from ulptrace.kernels.glu import glu, glu_reference
    from ulptrace.kernels.inject import OPS, Injection, faithful, fused, inject
    from ulptrace.kernels.rms_norm import add_rms_norm, rms_norm_reference

    __all__ = [
        "OPS",
        "Injection",
        "KernelBuildError",
        "add_rms_norm",
        "decode_attention",
        "decode_attention_reference",
        "faithful",
        "fused",
        "gated_rms_norm",
        "gated_rms_norm_reference",
        "gdn_gates",
        "gdn_gates_reference",
        "glu",
        "glu_reference",
        "inject",
        "kernels_available",
        "rms_norm_reference",
    ]
