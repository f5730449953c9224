#!/bin/bash
# Every audit39b candidate (bench/audit/audit39b_candidates.py), both families where it applies (the GatedDeltaNet and
# Qwen3.5-only ones on tiny-qwen3.5 alone), into OUT (one onset JSON and text per run; rc.txt with each run's exit
# status and seconds), sequentially, with the ulptrace that is first on PYTHONPATH (BASE: a folder holding an older
# tree's package `ulptrace`, else the installed one).
# Usage: bash bench/audit/audit39b_runall.sh OUT [BASE] [NAME_GLOB]; then python bench/audit/summary36.py OUT
here=$(cd "$(dirname "$0")" && pwd)
out=$1; mkdir -p "$out"
export PYTHONPATH=${2:+$2:}$here
glob=${3:-*}
names=$(cd "$here" && python -c "import audit39b_candidates as c;print(' '.join(n for n in dir(c) if n[:1] in 'dvx' and n[1:4].isdigit()))")
run() {  # model candidate label [extra onset arguments]
    local m=$1 c=$2 label=$3; shift 3
    local t0=$(date +%s)
    timeout 300 python -m ulptrace onset --model $m --candidate audit39b_candidates:$c --prompts 2 \
        --prompt-len 16 --new-tokens 3 --quiet --json "$out/$m.$label.json" "$@" > "$out/$m.$label.txt" 2>&1
    echo "$m $label rc=$? s=$(( $(date +%s) - t0 ))" >> "$out/rc.txt"
}
qwen_only='v301*|v314*|v305*|v306*|v311*|v312*|d312*|d313*|d301*|d302*|d303*|d304*|d305*|d306*|d311*|x303*'
for m in tiny-qwen3.5 tiny-llama; do
    for c in $names; do
        case $c in $glob) ;; *) continue;; esac
        if [ $m = tiny-llama ]; then eval "case $c in $qwen_only) continue;; esac"; fi
        run $m $c $c
    done
done
