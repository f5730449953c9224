"""A candidate path: flash-linear-attention's GatedDeltaNet scan in place of HF's torch scan.

HF binds its scan functions to flash-linear-attention at import time when the package is importable,
which would change the reference too. So FLA is installed into its own folder (``pip install --target
DIR``, DIR in ``ULPTRACE_FLA_DIR``), kept off the import path until this path is applied, and swapped in
through ``ulptrace.taps`` on HF's two module-level scan functions — the reference in the same process
keeps HF's torch fallback.

    ULPTRACE_FLA_DIR=/tmp/fla PYTHONPATH=bench ulptrace onset --model qwen3.5-0.8b --device cuda \
        --candidate fla_path:fla_scan --check-reference
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ulptrace.sites import GDN_FUNCTIONS
from ulptrace.taps import tap


def fla_scan(model: Any) -> Any:
    folder = os.environ.get("ULPTRACE_FLA_DIR")
    if folder and folder not in sys.path:
        sys.path.append(folder)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    gdn = next((m for m in model.modules() if hasattr(m, "A_log")), None)
    if gdn is None:
        raise ValueError(f"{type(model).__name__} has no GatedDeltaNet layer for the FLA scan to replace")
    namespace = sys.modules[type(gdn).__module__]
    kernels = dict(zip(GDN_FUNCTIONS, (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)))

    def wrap(kernel: Any) -> Any:
        def call(query, key, value, g, beta, *args: Any, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs: Any) -> Any:
            return kernel(query.contiguous(), key.contiguous(), value.contiguous(), g=g.contiguous(),
                          beta=beta.contiguous(), initial_state=initial_state, output_final_state=output_final_state,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

        return call

    handles = [tap(namespace, name).set_impl(wrap(kernel)) for name, kernel in kernels.items()]
    return lambda: [h.remove() for h in handles]
