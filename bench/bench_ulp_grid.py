"""ulp_stats' CUDA kernel against its launch settings (issue 11, P2): GB/s of the fused statistics on two differing
256 MiB BF16 tensors for programs per multiprocessor (``ulptrace._ulp_triton.PROGRAMS_PER_SM``), elements per
program step (``BLOCK``) and warps per program (``WARPS``), against a copy of the same bytes measured in the same
run; the module's settings are chosen from this. ``--sweep grid`` varies only the programs per multiprocessor
(what a package without ``BLOCK``/``WARPS`` settings can run: an older commit's, for a before/after).

    python bench/bench_ulp_grid.py [--mib 256]
"""

from __future__ import annotations

import argparse
import itertools
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
    p.add_argument("--sweep", choices=("all", "grid"), default="all")
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
    names = ("PROGRAMS_PER_SM", "BLOCK", "WARPS") if args.sweep == "all" else ("PROGRAMS_PER_SM",)
    chosen = {name: getattr(_ulp_triton, name) for name in names}
    grid = {"PROGRAMS_PER_SM": (2, 4, 8, 16, 32, 1 << 30), "BLOCK": (1024, 2048, 4096, 8192), "WARPS": (4, 8, 16)}
    results = []
    try:
        for setting in itertools.product(*(grid[name] for name in names)):
            for name, value in zip(names, setting):
                setattr(_ulp_triton, name, value)
            rate = 2 * a.nbytes / best_seconds(lambda: _ulp_triton.stats(ba, bb, fmt)) / 1e9
            label = ", ".join(f"{name} {'one per block' if value == 1 << 30 else value}"
                              for name, value in zip(names, setting))
            results.append((rate, label))
            print(f"{label}: {rate:6.0f} GB/s = {rate / copy:6.1%} of copy"
                  + ("   (the module's setting)" if setting == tuple(chosen.values()) else ""), flush=True)
    finally:
        for name, value in chosen.items():
            setattr(_ulp_triton, name, value)
    rate, label = max(results)
    print(f"best: {label}: {rate:.0f} GB/s = {rate / copy:.1%} of copy")


if __name__ == "__main__":
    main()
