"""Would a comparison in a process of its own lift P1's wall? (issue 11: on the H100 the concurrent onset's candidate
side — recorded and compared in this process — is the wall: ~2 s against its ~0.8-s untraced run, the floor with its
comparison dropped 1.30x; bench/RESULTS.md, thirty-third to thirty-fifth rounds.)

An experiment built from the onset's own parts, before any such mode is: both sides run in kept processes of their
own (``ulptrace.concurrent.ReferenceProcess``, roles ``reference`` and ``candidate``: the candidate's path applied
there as a reference's would be), both ship their records as the reference does now, and this process only compares
— a ``StreamingComparator`` over the reference's stream, fed the candidate's records as they arrive
(``RemoteTrace.arriving``). Unlike the onset, the candidate is not fed the reference's tokens (that needs a token
route between the two processes, which a mode would add): it runs its own greedy generation — the same work, the
same records, the same comparisons, so the wall is what such a mode would be, short of the token hand-off's waits.

Per round, interleaved (warm: the processes kept, the models there): the untraced pair (``bench_trace``'s), the
onset as ``--concurrent`` runs it (P1; timed from when both sides were ready, as ``bench_trace`` times it) and the
split run (timed from sending both runs to the comparison's end). Prints the least of each and the ratios, the
paired medians, and whether the split comparison's records equal the onset's (they do while the candidate's own
tokens are the reference's: the first flip is printed).

    python bench/bench_split.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch


def split_run(cfg, model) -> tuple[float, object, dict, torch.Tensor]:
    """(seconds from sending both runs to the comparison's end, the comparison, each process's run info by role —
    its ``seconds``: its run, its packing, its waits for this process to take its messages (``put_s``), and this
    process's waits for its messages (``candidate_waited_s``, named for the onset's reader) and their unpacking —,
    the candidate's own tokens) of one split run of ``cfg``; ``model``: the candidate's model as built (a twin is
    shipped to a process that has none yet)."""
    from ulptrace.comparison import StreamingComparator
    from ulptrace.concurrent import ReferenceProcess

    side = replace(cfg, reference=cfg.candidate, reference_mode=cfg.candidate_mode)
    with ReferenceProcess(cfg) as reference, ReferenceProcess(side, role="candidate") as candidate:
        t0 = time.perf_counter()
        reference.start(model)
        candidate.start(model)
        sink = StreamingComparator(reference.trace, max_ulp=cfg.max_ulp, release=True)
        for record in candidate.trace.arriving():
            sink.add(record)
        sink.result.candidate = dict(candidate.trace.metadata)
        tokens, _, _, process = candidate.trace.finish()
        processes = {"candidate": process, "reference": reference.trace.finish()[3]}
        comparison = sink.finish()
        if cfg.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        del sink
    return seconds, comparison, processes, tokens


def main() -> None:
    from bench_trace import (check_workload, progress_printer, traced, untraced_runner,  # this folder
                             workload_arguments, workload_config)
    from ulptrace.run import build_pair

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_arguments(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    check_workload(p, args)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, but got {args.repeats}")
    cfg = workload_config(args, oracle=False, concurrent=True)
    say = progress_printer()

    _, model, _ = build_pair(cfg, reference=False)
    run_untraced = untraced_runner(replace(cfg, concurrent=False))
    onset = traced(cfg, None, "P1-onset")  # cold: the reference process started, its model shipped
    split = split_run(cfg, model)  # cold: the candidate's process started
    say(f"cold: onset {onset[0]:.2f} s, split {split[0]:.2f} s")
    rounds = []
    for _ in range(args.repeats):
        pair = run_untraced()
        onset_s = traced(cfg, None, "P1-onset")[0]
        split_s, comparison, processes, tokens = split_run(cfg, model)
        sides = {role: {"run_s": p["seconds"]["run_s"], "waited_for_this_process_s": p["seconds"]["put_s"],
                        "this_process_waited_s": p["seconds"]["candidate_waited_s"]} for role, p in processes.items()}
        rounds.append({"untraced_pair_s": pair, "onset_s": onset_s, "split_s": split_s, "split_sides": sides})
        say(f"untraced pair {pair:.3f} s, onset {onset_s:.3f} s ({onset_s / pair:.2f}x), split {split_s:.3f} s "
            f"({split_s / pair:.2f}x; " + ", ".join(
                f"{role} ran {v['run_s']:.3f} s, waited {v['waited_for_this_process_s']:.3f} s for this process, "
                f"which waited {v['this_process_waited_s']:.3f} s for it" for role, v in sides.items()) + ")")
    from ulptrace.probes.onset import run_onset

    reference_comparison, info = run_onset(cfg)  # the onset's records, against the split run's last comparison
    flip = info.get("first_token_flip")
    own = tokens.tolist() == info["reference_tokens"]
    # records of the steps whose inputs both runs share: all of them, or up to the step whose tokens first differ
    last = None if own else min(step for step, (a, b) in enumerate(zip(
        torch.tensor(info["reference_tokens"]).T.tolist(), tokens.T.tolist())) if a != b)

    def kept(sites: list) -> list[dict]:
        return [d.to_json() for d in sites if last is None or d.step <= last]

    same = kept(comparison.sites) == kept(reference_comparison.sites) and len(kept(comparison.sites)) > 0
    pair = min(r["untraced_pair_s"] for r in rounds)
    out = {"device": args.device, "model": args.model, "torch": torch.__version__, "candidate": args.candidate,
           "workload": {"prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
           "rounds": rounds, "untraced_pair_s": pair,
           "onset_ratio": min(r["onset_s"] for r in rounds) / pair,
           "split_ratio": min(r["split_s"] for r in rounds) / pair,
           "onset_ratio_paired": statistics.median(r["onset_s"] / r["untraced_pair_s"] for r in rounds),
           "split_ratio_paired": statistics.median(r["split_s"] / r["untraced_pair_s"] for r in rounds),
           "candidate_tokens_are_the_reference_s": own, "onset_first_token_flip": flip,
           "records_equal_to_the_onset_s": same, "records_compared_up_to_step": last}
    print(f"{args.model} on {args.device}, {args.prompts} x {args.prompt_len}, {args.new_tokens} steps, least of "
          f"{args.repeats}: untraced pair {pair:.3f} s; onset (--concurrent) {out['onset_ratio']:.2f}x (paired "
          f"{out['onset_ratio_paired']:.2f}x); split {out['split_ratio']:.2f}x (paired "
          f"{out['split_ratio_paired']:.2f}x); the candidate's own tokens the reference's: {own} (the onset's "
          f"first flip: {flip}); the split "
          f"comparison's records equal to the onset's: {same}" + ("" if last is None else f" (steps 0-{last}, whose "
          "inputs both share)"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
