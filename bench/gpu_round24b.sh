#!/usr/bin/env bash
# One device call (twenty-fourth round, after the forecast): the GPU tests of the reference's GPU share and the
# switch; the command's default at 8 x 4,096 tokens with --sdpa flash (it should switch at the prompt's first layers
# now), its report compared with call 1's --no-concurrent one (bench/results/gpu_2026-12-04k/call1); the default's
# P5 at 8 x 4,096 (bench_trace.py --concurrent auto: the peak before the switch, and after it both processes').
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
date -u | tee $OUT/date.txt
gunzip -c bench/results/gpu_2026-12-04k/call1/no-concurrent.json.gz > /tmp/no-concurrent.json
OUT=$OUT SDPA=flash TESTS=${TESTS:-1} DIFF=0 MODES="default" REUSE=no-concurrent bash bench/gpu_switch.sh
timeout 300 python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 4096 --new-tokens 16 \
    --goals P5 --warm-repeats 1 --concurrent auto --json $OUT/p5_4096_default.json 2>&1 | grep "^P\|Error" \
    | tee $OUT/p5_4096_default.log
