"""What uploading a statistics launch's table costs on the host (issue 11, P1): ``launch_records`` made each launch's
table (six int64 a record pair, up to 512 pairs) a new pinned tensor from a Python list, then copied it to the device
without waiting. Under py-spy on the H100 that line took ~7% of the candidate's traced run. This times, per table,
the ways to put such a table on the device, between small kernels as the traced run has them:

- ``pinned``: ``torch.tensor(entries, pin_memory=True).to(device, non_blocking=True)`` (the old way);
- ``pageable``: the same from ordinary host memory (a pageable copy: the host may wait for it);
- ``staged``: the entries written into a pinned buffer made once (``ulptrace._ulp_triton.Staging``), then copied.

    python bench/bench_table_upload.py --pairs 512 --repeats 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=512)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    from ulptrace._ulp_triton import Staging

    device = torch.device("cuda")
    entries = list(range(6 * args.pairs))
    x = torch.randn(8, 1024, device=device)
    staging = Staging()

    def pinned() -> torch.Tensor:
        return torch.tensor(entries, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)

    def pageable() -> torch.Tensor:
        return torch.tensor(entries, dtype=torch.int64).to(device, non_blocking=True)

    def staged() -> torch.Tensor:
        return staging.upload(entries, device)

    ways = {"pinned": pinned, "pageable": pageable, "staged": staged}
    for way in ways.values():  # each checked against the entries, then warmed up
        assert way().cpu().tolist() == entries
    results: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                for _ in range(20):  # the run's small kernels between two launches
                    x.mul_(1.0)
                way()
            torch.cuda.synchronize()
            results[name].append((time.perf_counter() - t0) / args.repeats * 1e6)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        for _ in range(20):
            x.mul_(1.0)
    torch.cuda.synchronize()
    base = (time.perf_counter() - t0) / args.repeats * 1e6
    out = {"pairs": args.pairs, "kernels_alone_us": base,
           **{name: {"us_per_table": statistics.median(v) - base, "rounds_us": v} for name, v in results.items()}}
    print(f"{args.pairs} pairs a table; 20 small kernels alone {base:.1f} us; per table beyond them (median of "
          f"{args.rounds}): " + ", ".join(f"{n} {out[n]['us_per_table']:.1f} us" for n in ways))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
