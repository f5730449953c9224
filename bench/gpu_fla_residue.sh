#!/usr/bin/env bash
# Issue 10's residue, captured for study on the CPU: on the H200 run of 2026-12-01 (bench/FINDINGS.md) the
# GatedDeltaNet oracle put 3 elements of flash-linear-attention's chunked prefill scan outside every admissible set
# (step 0, layers.6.linear_attn.core: 1 element, 2 ULP; layers.12.linear_attn.core: 2 elements, up to 1 ULP). This
# records exactly those two sites with their scan inputs on both sides (HF's torch scan, FLA's kernel, the
# candidate fed the reference's tokens) and judges them there, so the records can be examined with the oracle on
# any machine: whether FLA's values or the oracle's estimated bound for the chunked kernel (the hypothesis
# widening in ulptrace.oracle.gdn) is at fault.
#
#   on the device (carry .whl with the FLA wheels):  OUT=$OUT bash bench/gpu_fla_residue.sh        (about 2 min)
#   then here:  tar -xzf residue.tgz; ulptrace compare residue/ref residue/fla --json residue.json
#               (the oracle needs no weights for these sites: the scan's inputs are in the records)
set -euo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .whl/flash_linear_attention-*.whl \
    .whl/fla_core-*.whl .whl/einops-*.whl >> "$OUT/install.log" 2>&1
export ULPTRACE_FLA_DIR=/tmp/fla
dir=/tmp/residue
rm -rf "$dir" && mkdir -p "$dir"
run=(--model qwen3.5-0.8b --device cuda --prompts 2 --prompt-len 32 --new-tokens 1
     --sites layers.6.linear_attn.core layers.12.linear_attn.core)
ulptrace record "${run[@]}" --path hf:scan=torch --out "$dir/ref" 2> "$dir/record_ref.log"
ulptrace record "${run[@]}" --path hf:fla --forced-from "$dir/ref" --out "$dir/fla" 2> "$dir/record_fla.log"
ulptrace compare "$dir/ref" "$dir/fla" --json "$dir/compare_h200.json" > "$dir/compare_h200.txt" 2>&1 || true
tail -n 30 "$dir/compare_h200.txt"
tar -czf "$OUT/residue.tgz" -C /tmp residue
