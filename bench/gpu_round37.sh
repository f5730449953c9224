#!/usr/bin/env bash
# Thirty-seventh round: the command's default now runs a large model's onset on CUDA split (each side in a process of
# its own from the start, this one comparing). STAGES picks and orders (default "cli test p15 p5long"); logs under $OUT:
#   cli: whole commands of P1's workload, the default (split) against `--concurrent` (the candidate here), alternating,
#        twice each, wall seconds to $OUT/cli.log, each report to $OUT/cli_<mode><n>.json;
#   test: the GPU test of the default on the 0.8B shape (split from the start, the report `--no-concurrent`'s);
#   p15: P1 and P5 at 8 x 128 as the command's default (`--concurrent auto`), reports under $OUT/reports_p15;
#   p5long: P5 at 8 x 4,096 as the command's default (`--sdpa flash`).
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
cd bench
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16"
for stage in ${STAGES:-cli test p15 p5long}; do
    echo "== $stage $(date +%T)"
    case $stage in
    cli) n=0; for mode in default beside default beside; do
            n=$((n + 1)); extra=$([ $mode = beside ] && echo "--concurrent")
            TIMEFORMAT="cli $mode %R s"
            { time timeout 200 python3 -m ulptrace onset --model qwen3.5-0.8b --device cuda --candidate kernels:fused \
                --no-oracle --prompts 8 --prompt-len 128 --new-tokens 16 --quiet $extra --json $OUT/cli_$mode$n.json \
                > /dev/null 2>> $OUT/cli_err.log ; } 2>> $OUT/cli.log
            tail -1 $OUT/cli.log
        done ;;
    test) (cd .. && timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/probes/test_onset_concurrent.py \
        -k "default_on_a_large_model" 2>&1 | tail -3 | tee $OUT/test.log) ;;
    p15) timeout 200 python3 bench_trace.py $W --goals P1 P5 --concurrent auto --reports $OUT/reports_p15 \
        --json $OUT/p15.json 2>&1 | grep "^P1 onset\|^P5" | tee -a $OUT/p15.log | cut -c1-600 ;;
    p5long) timeout 170 python3 bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 4096 \
        --new-tokens 16 --sdpa flash --goals P5 --concurrent auto --json $OUT/p5long.json 2>&1 | grep "^P5\|Error" \
        | tee -a $OUT/p5long.log | cut -c1-600 ;;
    esac
done
