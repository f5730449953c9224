#!/usr/bin/env bash
# One device call for the streaming-comparison speed (issue 11, P1): install, build the kernels, the tracer's GPU
# tests, then the tracing benchmark on the 0.8B shape with a profile of the warm run. Logs and JSON under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
python3 -m pytest -m gpu tests/tracer -q -p no:cacheprovider -rf --tb=short ${TESTS:-} 2>&1 | tee $OUT/gpu_tests.log | tail -8
python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16 \
    --stats-mib 256 --json $OUT/bench_trace_gpu.json --profile $OUT/profile_p1_warm.txt --reports $OUT/reports \
    2>&1 | grep -v Warn | tee $OUT/bench_trace_gpu.log
