#!/bin/bash
# Every audit36 candidate (bench/audit/audit36_candidates.py), both families where it applies, into OUT (one onset
# JSON and text per run; rc.txt with each run's exit status and seconds), sequentially, with the ulptrace that is
# first on PYTHONPATH (BASE: a folder holding an older tree's package `ulptrace`, else the installed one).
# Usage: bash bench/audit/audit36_runall.sh OUT [BASE] [NAME_GLOB]; then python bench/audit/summary36.py OUT
here=$(cd "$(dirname "$0")" && pwd)
out=$1; mkdir -p "$out"
export PYTHONPATH=${2:+$2:}$here
glob=${3:-*}
names=$(cd "$here" && python -c "import audit36_candidates as c;print(' '.join(n for n in dir(c) if n[:1] in 'dvx' and n[1:3].isdigit()))")
run() {  # model candidate
    local t0=$(date +%s)
    timeout 300 python -m ulptrace onset --model $1 --candidate audit36_candidates:$2 --prompts 2 \
        --prompt-len 16 --new-tokens 3 --quiet --json "$out/$1.$2.json" > "$out/$1.$2.txt" 2>&1
    echo "$1 $2 rc=$? s=$(( $(date +%s) - t0 ))" >> "$out/rc.txt"
}
qwen_only='d94*|d94b*|d60*|d61*|d62*|d66*|d67*|d68*|d7[0-5]*|d92*|d93*|v70*'
for m in tiny-qwen3.5 tiny-llama; do
    for c in $names; do
        case $c in $glob) ;; *) continue;; esac
        if [ $m = tiny-llama ]; then eval "case $c in $qwen_only) continue;; esac"; fi
        if [ $m = tiny-qwen3.5 ]; then case $c in x103*) continue;; esac; fi  # the crash report: one family is enough
        run $m $c
    done
done
