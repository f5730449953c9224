#!/usr/bin/env bash
# Thirtieth round, one device call: install, build the kernels, the benchmark's reports (P1 without the oracle, P3
# with it) compared with the twenty-sixth round's (bench/results/gpu_2026-12-04m/call4/reports: the tree before the
# last three sessions' changes; only input_delta may differ, c1b2073), every GPU test (TESTS=0: skipped), then
# P1 as the command's default runs it (BENCH=0: skipped; P1_ROUNDS times, SEQ=1: sequential too).
# REPORTS=0: no reports. Logs under $OUT.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
cd bench
if [ "${REPORTS:-1}" = 1 ]; then
    timeout 200 python3 bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16 \
        --reports-only --reports $OUT/reports 2>&1 | grep -v Warn | tail -3
    sha256sum $OUT/reports/*.json | tee $OUT/hashes.txt
    python3 report_diff.py results/gpu_2026-12-04m/call4/reports $OUT/reports --allowed input_delta input_shapes \
        --new-sites output 2>&1 \
        | tee $OUT/report_diff.log
fi
cd ..
[ "${TESTS:-1}" = 0 ] || timeout 320 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rf --tb=short 2>&1 \
    | tee $OUT/gpu_tests.log | tail -8
cd bench
for i in $(seq ${P1_ROUNDS:-1}); do  # P1 as the command's default runs it, then (SEQ=1) one side after the other
    [ "${BENCH:-1}" = 0 ] || timeout 200 python3 bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 \
        --prompt-len 128 --new-tokens 16 --goals P1 --concurrent auto --json $OUT/p1_$i.json 2>&1 | grep "^P" \
        | tee -a $OUT/p1.log
    [ "${SEQ:-0}" = 0 ] || timeout 150 python3 bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 \
        --prompt-len 128 --new-tokens 16 --goals P1 --json $OUT/p1_seq_$i.json 2>&1 | grep "^P" | tee -a $OUT/p1.log
done
