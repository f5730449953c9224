"""Whether an onset's report depends on where the reference's records waited (issue 11): the same onset with the
reference kept on the GPU (``device``), spilled to host memory past a small GPU room (``auto`` with
``MemorySink.room`` shrunk, as a long prompt's reference does past half the GPU), and in a process of its own
(``--concurrent``), in one process; prints whether each report equals the first, less what says when and where, and
the first differing fields where one does not.

    python bench/spill_diff.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 512 --room-mib 256
"""

from __future__ import annotations

import argparse
import json

from bench_trace import _clean


def _differences(a, b, path="", out=None, limit=12):
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'first' if k in a else 'second'}")
            else:
                _differences(a[k], b[k], f"{path}.{k}", out, limit)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _differences(x, y, f"{path}[{i}]", out, limit)
    elif json.dumps(a) != json.dumps(b):  # a NaN equals itself here, as in the report's text
        out.append(f"{path}: {str(a)[:160]} != {str(b)[:160]}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny-qwen3.5")
    p.add_argument("--candidate", default="kernels:fused")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--room-mib", type=float, default=1.0)
    args = p.parse_args()
    from ulptrace.concurrent import shutdown
    from ulptrace.probes.onset import run_onset
    from ulptrace.record import MemorySink
    from ulptrace.run import RunConfig

    base = {"model": args.model, "candidate": args.candidate, "device": args.device, "prompts": args.prompts,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "oracle": False}
    reports = {}
    for name, fields in (("device", {"reference_memory": "device"}), ("spilled", {}), ("concurrent",
                                                                                      {"concurrent": True})):
        room = MemorySink.room
        if name == "spilled":
            MemorySink.room = classmethod(lambda cls, device: int(args.room_mib * 2**20))
        try:
            comparison, info = run_onset(RunConfig(**base, **fields))
        finally:
            MemorySink.room = room
        reports[name] = _clean(dict(comparison.to_json(), run=info))
        print(f"{name}: {len(reports[name]['sites'])} sites, spilled {info.get('reference_spilled')}", flush=True)
    shutdown()
    for name in ("spilled", "concurrent"):
        diff = _differences(reports["device"], reports[name])
        print(f"{name} vs device: equal {not diff}" + "".join(f"\n  {d}" for d in diff), flush=True)


if __name__ == "__main__":
    main()
