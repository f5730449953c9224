"""ulp_stats' CUDA kernel against its grid size (issue 11, P2): GB/s of the fused statistics on two differing 256 MiB
BF16 tensors for several programs per multiprocessor (``ulptrace._ulp_triton.PROGRAMS_PER_SM``), against a copy
of the same bytes measured in the same run; the setting in the module is chosen from this.

    python bench/bench_ulp_grid.py [--mib 256]
"""

from __future__ import annotations

import argparse
import time

import torch


def best_seconds(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    from ulptrace import _ulp_triton
    from ulptrace.ulp import FORMATS, bits

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256)
    args = p.parse_args()
    if args.mib < 1:
        p.error(f"--mib must be >= 1, but got {args.mib}")
    if not torch.cuda.is_available() or not _ulp_triton.AVAILABLE:
        p.error("needs a CUDA device and Triton (the kernel measured here is the CUDA one)")
    n = args.mib * 2**20 // 2
    a = torch.randn(n, device="cuda").bfloat16()
    b = (a.float() * (1 + 2**-7 * torch.randn(n, device="cuda"))).bfloat16()
    ba, bb, fmt = bits(a), bits(b), FORMATS[a.dtype]
    copy = 2 * a.nbytes / best_seconds(a.clone) / 1e9
    print(f"copy {copy:.0f} GB/s (torch {torch.__version__}, {torch.cuda.get_device_name()})")
    chosen = _ulp_triton.PROGRAMS_PER_SM
    try:
        for per_sm in (1, 2, 4, 8, 16, 32, None):  # None: one program per 4096-element block
            _ulp_triton.PROGRAMS_PER_SM = per_sm if per_sm is not None else 1 << 30
            rate = 2 * a.nbytes / best_seconds(lambda: _ulp_triton.stats(ba, bb, fmt)) / 1e9
            label = "one per block" if per_sm is None else f"{per_sm:>13d}"
            print(f"programs per SM {label}: {rate:6.0f} GB/s = {rate / copy:6.1%} of copy"
                  + ("   (the module's setting)" if per_sm == chosen else ""))
    finally:
        _ulp_triton.PROGRAMS_PER_SM = chosen


if __name__ == "__main__":
    main()
