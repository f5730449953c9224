"""Whether an onset's report depends on where the reference's records waited (issue 11): the same onset with the
reference kept on the GPU (``device``), spilled to host memory past a small GPU room (``auto`` with
``MemorySink.room`` shrunk, as a long prompt's reference does past half the GPU), and in a process of its own
(``--concurrent``), in one process; prints whether each report equals the first, less what says when and where, and
the first differing fields where one does not.

    python bench/spill_diff.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 512 --room-mib 256
"""

from __future__ import annotations

import argparse

from bench_trace import _clean, check_workload, differences, workload_arguments, workload_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_arguments(p, prompts=2, prompt_len=16, new_tokens=4)
    p.add_argument("--room-mib", type=float, default=1.0, help="the GPU room of the spilled run (MiB, >= 0)")
    args = p.parse_args()
    check_workload(p, args)
    if not args.room_mib >= 0:
        p.error(f"--room-mib must be >= 0, but got {args.room_mib}")
    from ulptrace.concurrent import shutdown
    from ulptrace.probes.onset import run_onset
    from ulptrace.record import MemorySink

    reports = {}
    for name, fields in (("device", {"reference_memory": "device"}), ("spilled", {}), ("concurrent",
                                                                                      {"concurrent": True})):
        room = MemorySink.room
        if name == "spilled":
            MemorySink.room = classmethod(lambda cls, device: int(args.room_mib * 2**20))
        try:
            comparison, info = run_onset(workload_config(args, oracle=False, **fields))
        finally:
            MemorySink.room = room
        reports[name] = _clean(dict(comparison.to_json(), run=info))
        print(f"{name}: {len(reports[name]['sites'])} sites, spilled {info.get('reference_spilled')}", flush=True)
    shutdown()
    for name in ("spilled", "concurrent"):
        diff = differences(reports["device"], reports[name])
        print(f"{name} vs device: equal {not diff}" + "".join(f"\n  {d}" for d in diff), flush=True)


if __name__ == "__main__":
    main()
