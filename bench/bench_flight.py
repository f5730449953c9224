"""Each side process's bytes in flight in a split onset (shipped, not yet let go by this process), bounded by
``ulptrace.concurrent.FLIGHT_BYTES`` or not, alternating: the most each side had in flight, its waits for the bound,
and the onset's wall. A long prompt's prefill is what ships many parts (P5 at 8 x 4,096 on a GPU); on a CPU the same
shape of work is a small model with small parts (``--part-kib``).

    python bench/bench_flight.py --device cpu --model tiny-qwen3.5 --prompts 8 --prompt-len 512 --part-kib 256
"""

from __future__ import annotations

import argparse
import time

from ulptrace import concurrent
from ulptrace.probes.onset import run_onset
from ulptrace.run import RunConfig


UNBOUNDED = 1 << 50  # the message count (AHEAD) the only bound


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny-qwen3.5")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--part-kib", type=int, default=256, help="PART_BYTES for both modes; the bound is 3 parts")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    concurrent.PART_BYTES = args.part_kib << 10
    bounded = 3 * concurrent.PART_BYTES
    cfg = RunConfig(model=args.model, device=args.device, candidate="kernels:fused", oracle=False, concurrent="split",
                    prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    try:
        for _ in range(args.rounds):
            for flight in (UNBOUNDED, bounded):
                concurrent.FLIGHT_BYTES = flight
                began = time.perf_counter()
                _, info = run_onset(cfg)
                wall = time.perf_counter() - began
                sides = []
                for role in ("reference", "candidate"):
                    process = info[f"{role}_process"]
                    sides.append(f"{role}: most in flight {process['most_in_flight_bytes'] / 2**20:.2f} MiB, "
                                 f"{len(process['messages']['sent'])} messages, waited for the bound "
                                 f"{process['seconds']['flight_wait_s']:.2f} s")
                name = "unbounded" if flight == UNBOUNDED else f"bound {flight >> 10} KiB"
                print(f"{name}: onset {wall:.2f} s (builds included); " + "; ".join(sides), flush=True)
    finally:
        concurrent.shutdown()


if __name__ == "__main__":
    main()
