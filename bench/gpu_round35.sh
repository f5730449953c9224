#!/usr/bin/env bash
# Thirty-fifth round's plan for the next device call: does comparing in a process of its own lift P1's wall?
# STAGES picks and orders (default "tests split p1 split p1"); logs under $OUT:
#   tests: the split onset's GPU tests (its records and fed tokens through CUDA IPC; reports as the sequential onset's);
#   split: P1 with onset's concurrent="split" (both sides in processes of their own, this one comparing only), its
#          reports under $OUT/reports_split (report_diff.py against p1's: the same records and verdicts);
#   p1: P1 as the command's default (the reference beside, the candidate recorded and compared here), its reports
#       under $OUT/reports_p1;
#   cli: whole commands (start-up and builds included), P1's workload: `ulptrace onset` as is, then with
#        `--concurrent split` (both side processes started at its first line), twice, wall seconds to $OUT/cli.log.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
cd bench
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16 --goals P1"
for stage in ${STAGES:-tests split p1 split p1}; do
    echo "== $stage $(date +%T)"
    case $stage in
    tests) (cd .. && timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/probes/test_onset_split.py \
        2>&1 | tail -5 | tee $OUT/tests.log) ;;
    split) timeout 220 python3 bench_trace.py $W --concurrent split --reports $OUT/reports_split \
        --json $OUT/split_$(date +%H%M%S).json 2>&1 | grep "^P1 onset\|^P1 concurrent" | tee -a $OUT/split.log \
        | cut -c1-400 ;;
    p1) timeout 220 python3 bench_trace.py $W --concurrent auto --reports $OUT/reports_p1 \
        --json $OUT/p1_$(date +%H%M%S).json 2>&1 | grep "^P1 onset" | tee -a $OUT/p1.log | cut -c1-400 ;;
    cli) for mode in default split default split; do
            extra=$([ $mode = split ] && echo "--concurrent split")
            TIMEFORMAT="cli $mode %R s"
            { time timeout 200 python3 -m ulptrace onset --model qwen3.5-0.8b --device cuda --candidate kernels:fused \
                --no-oracle --prompts 8 --prompt-len 128 --new-tokens 16 --quiet $extra --json $OUT/cli_$mode.json \
                > /dev/null 2>> $OUT/cli_err.log ; } 2>> $OUT/cli.log
            tail -1 $OUT/cli.log
        done ;;
    esac
done
python3 report_diff.py $OUT/reports_p1 $OUT/reports_split 2>&1 | tail -2
