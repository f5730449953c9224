"""Timing helpers shared by the kernel benchmarks (``bench/bench_<op>.py``).

Each benchmark times a callable two ways on the current CUDA device: ``call_us``, the wall time of
one eager call (Python dispatch included, what an injected model pays per op in eager mode), and
``graph_us``, the GPU time of one call replayed from a CUDA graph (launch overhead removed; None
when the callable cannot be captured). Both are medians over repeats of many calls, after warm-up.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

REPEATS = 5


def call_us(fn: Callable[[], Any], iters: int = 100, warmup: int = 10) -> float:
    """Median microseconds per eager call of ``fn`` (CUDA events around ``iters`` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(samples)


def graph_us(fn: Callable[[], Any], iters: int = 20) -> float | None:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph of ``iters`` calls."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
    except Exception:  # noqa: BLE001 - a callable that syncs on the host cannot be captured
        return None
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / iters)
    return statistics.median(samples)


def row(op: str, case: str, impl: str, fn: Callable[[], Any], nbytes: int) -> dict[str, Any]:
    """One result row; ``nbytes`` is the data the op must read and write (for GB/s)."""
    eager = call_us(fn)
    graph = graph_us(fn)
    best = graph if graph is not None else eager
    return {"op": op, "case": case, "impl": impl, "call_us": round(eager, 2),
            "graph_us": None if graph is None else round(graph, 2),
            "gbps": round(nbytes / (best * 1e-6) / 1e9, 1)}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    head = "| op | case | implementation | eager call (µs) | CUDA-graph replay (µs) | GB/s (graph) |"
    lines = [head, "|---|---|---|---:|---:|---:|"]
    for r in rows:
        graph = "n/a" if r["graph_us"] is None else f"{r['graph_us']:.2f}"
        lines.append(f"| {r['op']} | {r['case']} | {r['impl']} | {r['call_us']:.2f} | {graph} | {r['gbps']} |")
    return "\n".join(lines)
