"""What one observation costs the host, per operation, on this machine (issue 11: P1 is bound by per-value work).

A traced decode step is host-bound: the GPU waits for Python to enqueue work, so every per-value operation the
recorder and the comparison add costs its host time in full. This measures, per call and in microseconds of wall
time (the device synchronised once at the end of each batch of calls): a copy of an observed value (``clone``) at a
decode-step size and a prefill size, an allocation alone, the bit-pattern view the statistics take, and the CUDA
statistics of one record pair launched alone versus queued in a ``StatsBatch`` of 512.

    python bench/bench_launch.py --device cuda [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def per_call(fn, calls: int, device: torch.device) -> float:
    """Least mean wall time of one ``fn()`` in microseconds over 5 batches of ``calls`` calls."""
    fn()
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    from ulptrace import _ulp_triton
    from ulptrace.ulp import StatsBatch, bits, format_of, pending_stats, resolve_stats

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--json")
    args = p.parse_args()
    if args.calls < 1:
        p.error(f"--calls must be >= 1, but got {args.calls}")
    try:
        device = torch.device(args.device)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as exc:
        p.error(f"device {args.device!r} is not usable here: {exc}")
    sizes = {"decode (8 x 1024 bf16)": (8, 1024), "prefill (1024 x 1024 bf16)": (1024, 1024)}
    out: dict[str, float] = {}
    for label, shape in sizes.items():
        a = torch.randn(shape, device=device, dtype=torch.bfloat16)
        b = a.clone()
        out[f"clone, {label}"] = per_call(a.clone, args.calls, device)
        out[f"empty_like, {label}"] = per_call(lambda a=a: torch.empty_like(a), args.calls, device)
        out[f"bits view, {label}"] = per_call(lambda a=a: bits(a), args.calls, device)
        out[f"statistics launched alone, {label}"] = per_call(lambda a=a, b=b: pending_stats(a, b), args.calls,
                                                              device)

        if device.type != "cuda" or not _ulp_triton.AVAILABLE:
            continue  # a StatsBatch serves CUDA with Triton only
        fmt = format_of(a.dtype)

        def batched(a: torch.Tensor = a, b: torch.Tensor = b, fmt: object = fmt) -> None:
            batch = StatsBatch()
            pending = [batch.add(bits(a), bits(b), fmt) for _ in range(512)]
            batch.launch()
            resolve_stats(pending[:1])  # reads the slab back: one synchronisation per 512 records

        out[f"statistics in a batch of 512 incl. read-back, per record, {label}"] = \
            per_call(batched, max(1, args.calls // 512), device) / 512
    print(f"host cost per call on {device} (torch {torch.__version__}), microseconds:")
    for name, us in out.items():
        print(f"  {name:75s} {us:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "us_per_call": out}, f, indent=1)


if __name__ == "__main__":
    main()
