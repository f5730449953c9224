"""What one message's CUDA memory costs to receive and to let go through torch's CUDA IPC, as ``onset --concurrent``
ships a step's records (issue 11, P1): a producer process sends ``--messages`` fresh byte arenas of ``--mib`` MiB (a
``torch.cat`` of pieces, as ``processes.pack`` makes them) through a queue; the consumer reads each (a kernel), then
drops it. Printed: the consumer's median microseconds to take a message (unpickling: opening the memory handle) and to
drop it (its last reference: the handle closed), against the same consumer work on memory of its own.

    python bench/bench_ipc.py --messages 40 --mib 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _producer(queue, n: int, mib: int) -> None:
    pieces = [torch.zeros(mib << 16, dtype=torch.uint8, device="cuda") for _ in range(16)]
    for _ in range(n):
        torch.cuda.ipc_collect()
        queue.put(torch.cat(pieces))
    queue.put(None)
    queue.close()
    queue.join_thread()
    time.sleep(2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=40)
    p.add_argument("--mib", type=int, default=16)
    args = p.parse_args()
    if args.messages < 3 or args.mib < 1:  # the first two messages are left out of the medians
        p.error(f"--messages must be >= 3 and --mib >= 1, but got {args.messages} and {args.mib}")
    context = torch.multiprocessing.get_context("spawn")
    queue = context.Queue(maxsize=4)
    proc = context.Process(target=_producer, args=(queue, args.messages, args.mib))
    proc.start()
    take, drop, own_drop = [], [], []
    while True:
        t0 = time.perf_counter()
        arena = queue.get()
        t1 = time.perf_counter()
        if arena is None:
            break
        arena[:1024].sum()  # read on this side's stream
        t2 = time.perf_counter()
        del arena
        t3 = time.perf_counter()
        take.append(t1 - t0)
        drop.append(t3 - t2)
    proc.join()
    for _ in range(args.messages):
        own = torch.empty(args.mib << 20, dtype=torch.uint8, device="cuda")
        own[:1024].sum()
        t2 = time.perf_counter()
        del own
        own_drop.append(time.perf_counter() - t2)
    def us(xs: list[float]) -> float:  # the first two messages left out: they open the context's handles
        return 1e6 * statistics.median(xs[2:])

    print(f"{args.messages} messages of {args.mib} MiB: take {us(take):.0f} us, drop {us(drop):.0f} us "
          f"(max {1e6 * max(drop[2:]):.0f} us), dropping memory of its own {us(own_drop):.0f} us (medians)")


if __name__ == "__main__":
    main()
