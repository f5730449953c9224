"""Which kernel of a path does not repeat its bits run after run (the twenty-second round's follow-up to
``repeatability.py``, which found the HF reference's untraced logits differing between two runs in one process on
the H200 at 8 x 512). Every aten op of the path's generation is seen through a ``TorchDispatchMode``: a hash of each
tensor input and output (the bits, as integers: the hash itself is exact and order-free) is kept per call; after
``--repeats`` runs, the first call whose inputs hash alike in two runs but whose outputs do not is the kernel that
does not repeat — named with its aten op, shapes, dtypes, the innermost module running it, the decode step and which
of its outputs differ (uninitialised allocations, ``UNINITIALISED``, are left out). ``--sdpa`` pins the attention
backend as ``ulptrace --sdpa`` does.

    python bench/op_repeatability.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 512 --new-tokens 16
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from bench_trace import check_workload, workload_arguments, workload_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}
UNINITIALISED = ("aten.empty.", "aten.empty_strided.", "aten.new_empty.", "aten.new_empty_strided.", "aten.empty_like.")
"""Ops whose outputs hold whatever the memory held (never expected to repeat; not culprits)."""


def _hash(t: torch.Tensor) -> torch.Tensor:
    """Two exact integer sums over the tensor's bits (plain, and weighted by position mod 8191): a 2-element int64
    tensor on the tensor's device, no host sync."""
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    size = flat.element_size()
    if flat.is_complex() or size not in (1, 2, 4, 8):
        flat = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat.float()
        size = flat.element_size()
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]).to(torch.int64)
    key = (bits.numel(), str(bits.device))
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 8191 + 1
    return torch.stack([bits.sum(), (bits * _WEIGHTS[key]).sum()])


class _Ops(TorchDispatchMode):
    """Keeps, per aten call: op name, innermost module, step, shapes/dtypes, input hashes and output hashes."""

    def __init__(self, where: list[str], step: list[int]) -> None:
        super().__init__()
        self.where, self.step = where, step
        self.calls: list[tuple[str, str, int, str]] = []
        self.hashes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        in_hash = torch.stack([_hash(a) for a in ins]) if ins else torch.zeros(0, 2, dtype=torch.int64)
        out = func(*args, **kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        out_hash = torch.stack([_hash(o) for o in outs]) if outs else torch.zeros(0, 2, dtype=torch.int64)
        sig = ", ".join(f"{tuple(a.shape)}:{str(a.dtype)[6:]}:{tuple(a.stride())}" for a in ins)
        self.calls.append((str(func), self.where[-1], self.step[0], sig))
        self.hashes.append((in_hash, out_hash))
        return out


def _run(model, prompts, new_tokens, forced=None) -> tuple[list, list]:
    from ulptrace.run import greedy

    where, step = ["<model>"], [0]
    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: where.append(n) or None))
        handles.append(module.register_forward_hook(lambda m, a, o: (where.pop(), None)[1]))
    mode = _Ops(where, step)
    try:
        with mode:
            greedy(model, prompts, new_tokens, forced=forced, on_logits=lambda s, _: step.__setitem__(0, s + 1))
    finally:
        for h in handles:
            h.remove()
    hashes = [(i.cpu(), o.cpu()) for i, o in mode.hashes]
    return mode.calls, hashes


def _compare(base: tuple[list, list], other: tuple[list, list]) -> dict:
    calls, hashes = base
    ocalls, ohashes = other
    if [c[0] for c in calls] != [c[0] for c in ocalls]:
        first = next(i for i, (a, b) in enumerate(zip(calls, ocalls)) if a[0] != b[0])
        return {"same_ops": False, "first_op_difference": first, "ops": [len(calls), len(ocalls)]}
    differing = [i for i, ((_, o), (_, oo)) in enumerate(zip(hashes, ohashes))
                 if not torch.equal(o, oo) and not calls[i][0].startswith(UNINITIALISED)]
    culprits = [i for i in differing if torch.equal(hashes[i][0], ohashes[i][0])]
    fed = next((i for i, ((h, _), (oh, _)) in enumerate(zip(hashes, ohashes)) if not torch.equal(h, oh)), None)

    def named(i: int) -> dict:
        outputs = [k for k in range(len(hashes[i][1])) if not torch.equal(hashes[i][1][k], ohashes[i][1][k])]
        return dict(zip(("op", "module", "step", "inputs"), calls[i]), index=i, outputs_differing=outputs)

    def consumer(i: int) -> dict:
        inputs = [k for k in range(len(hashes[i][0])) if not torch.equal(hashes[i][0][k], ohashes[i][0][k])]
        # where each differing input was last seen as an output, in either run (its producer)
        def producer(run_hashes: list, k: int) -> str | None:
            key = run_hashes[i][0][k]
            j = next((j for j in range(i - 1, -1, -1) if any(torch.equal(key, o) for o in run_hashes[j][1])), None)
            return None if j is None else f"{calls[j][0]} #{j}"

        return dict(zip(("op", "module", "step", "inputs"), calls[i]), index=i, inputs_differing=inputs,
                    produced_at={k: [producer(hashes, k), producer(ohashes, k)] for k in inputs})

    kinds = collections.Counter(f"{calls[i][0]} in {calls[i][1]}" for i in culprits)
    return {"same_ops": True, "ops": len(calls), "differing_outputs": len(differing),
            "first_differing": named(differing[0]) if differing else None,
            "not_repeating_calls": len(culprits),
            "first_not_repeating": named(culprits[0]) if culprits else None,
            # the first call fed a value unlike the first run's, and where that value was made (an output seen
            # alike in both runs there changed after it was hashed: written later, by another stream)
            "first_fed_differently": consumer(fed) if fed is not None else None,
            "not_repeating_by_op": dict(kinds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload_arguments(p, prompts=2, prompt_len=16, new_tokens=4)
    p.add_argument("--side", choices=("reference", "candidate"), default="reference")
    p.add_argument("--repeats", type=int, default=4, help="runs to compare with the first (default 4)")
    p.add_argument("--json")
    args = p.parse_args()
    check_workload(p, args)
    from ulptrace.paths import apply_path
    from ulptrace.run import build_pair

    cfg = workload_config(args, oracle=False, reference_memory="device")
    out: dict = {"workload": vars(args), "torch": torch.__version__, "runs": []}
    with torch.no_grad():
        ref, cand, prompts = build_pair(cfg)
        model, path = (ref, cfg.reference) if args.side == "reference" else (cand, cfg.candidate)
        with apply_path(model, path):
            base = _run(model, prompts, args.new_tokens)
            for r in range(args.repeats):
                result = _compare(base, _run(model, prompts, args.new_tokens))
                out["runs"].append(result)
                print(f"run {r + 2} vs 1 ({args.side}, {path}): {json.dumps(result)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
