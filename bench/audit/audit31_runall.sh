#!/bin/bash
# Every audit31 candidate, both families, into OUT (one onset JSON and text per run; rc.txt), with the ulptrace that
# is first on PYTHONPATH (BASE: a folder holding an older tree's package `ulptrace`, else the installed one); the mask
# candidates d21/v22 also against HF's eager attention (masks encoded otherwise on the two sides).
# Usage: bash bench/audit/audit31_runall.sh OUT [BASE]; then python bench/audit/summary.py OUT
here=$(cd "$(dirname "$0")" && pwd)
out=$1; mkdir -p "$out"
export PYTHONPATH=${2:+$2:}$here
names=$(cd "$here" && python -c "import audit31_candidates as c;print(' '.join(n for n in dir(c) if n[:1] in 'dv' and n[1:3].isdigit()))")
run() {  # model candidate name [extra args]
    timeout 300 python -m ulptrace onset --model $1 --candidate audit31_candidates:$2 "${@:4}" --prompts 2 \
        --prompt-len 16 --new-tokens 3 --quiet --json "$out/$1.$3.json" > "$out/$1.$3.txt" 2>&1
    echo "$1 $3 rc=$?" >> "$out/rc.txt"
}
for m in tiny-qwen3.5 tiny-llama; do
    for c in $names; do
        if [ $m = tiny-llama ]; then case $c in d07*|d08*|d09*|d17*|v11*) continue;; esac; fi  # GatedDeltaNet only
        if [ $m = tiny-qwen3.5 ]; then case $c in v08*) continue;; esac; fi
        case $c in d21e*|v21e*) run $m $c $c --reference hf:attn=eager;; *) run $m $c $c;; esac
    done
    for c in d21_mask_builder_peek v22_explicit_causal_mask; do run $m $c $c.eager --reference hf:attn=eager; done
done
