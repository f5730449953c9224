#!/usr/bin/env bash
# Thirty-fifth round's plan for the next device call: would a comparison in a process of its own lift P1's wall?
# STAGES picks and orders (default "split p1"); logs under $OUT:
#   split: bench_split.py — per round, interleaved: the untraced pair, the onset as --concurrent runs it, and both
#          sides in kept processes of their own (roles reference / candidate) with this process only comparing
#          (the candidate not fed the reference's tokens: its own greedy run, the same work); the split comparison's
#          records checked equal to the onset's over the steps whose inputs both share;
#   p1: P1 as the command's default (as gpu_round34.sh's p1), for the same host's figure.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
cd bench
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16"
for stage in ${STAGES:-split p1}; do
    echo "== $stage $(date +%T)"
    case $stage in
    split) timeout 420 python3 bench_split.py $W --repeats ${REPEATS:-3} --json $OUT/split_$(date +%H%M%S).json 2>&1 \
        | grep --line-buffered -v "Warn\|falling" | tee -a $OUT/split.log | cut -c1-600 ;;
    p1) timeout 220 python3 bench_trace.py $W --goals P1 --concurrent auto --json $OUT/p1_$(date +%H%M%S).json 2>&1 \
        | grep "^P1 onset" | tee -a $OUT/p1.log | cut -c1-400 ;;
    esac
done
