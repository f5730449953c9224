#!/usr/bin/env bash
# The twentieth round's last device call (issue 11): the GPU tests of the statistics batch and the concurrent onset,
# a helper process's start-up by stage (bench_startup.py), P1 sequential (the command's default) with its report's
# sha256, and P5 with --concurrent at 8 x 4,096 tokens (last: the longest). Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
timeout 100 python3 -m pytest -m gpu tests/tracer/test_record_stats.py tests/probes/test_onset_concurrent.py -q -p no:cacheprovider -rf --tb=short 2>&1 | tee $OUT/gpu_tests.log | tail -2
timeout 30 python3 bench/bench_startup.py --device cuda --model qwen3.5-0.8b --repeats 1 --json $OUT/startup.json 2>&1 | tail -10
timeout 70 python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16 --goals P1 --warm-repeats 3 --reports /tmp/rs 2>&1 | grep "^P" | tee $OUT/p1_sequential.log
sha256sum /tmp/rs/*.json
timeout 170 python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 4096 --new-tokens 16 --goals P5 --concurrent --warm-repeats 1 --json $OUT/p5_4096_concurrent.json 2>&1 | grep "^P\|Error" | tee $OUT/p5.log
