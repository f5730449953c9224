#!/usr/bin/env bash
# One device call: install, build the kernels, every GPU test, the tracing benchmark on the 0.8B shape,
# and flash-linear-attention traced against HF. Logs and JSON under $OUT. Carry .whl (FLA wheels).
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .whl/*.whl 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
python3 -m pytest -m gpu tests -q -p no:cacheprovider -rf --tb=short 2>&1 | tee $OUT/gpu_tests.log | tail -15
python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16 \
    --stats-mib 256 --json $OUT/bench_trace_gpu.json --profile $OUT/profile_p1_warm.txt 2>&1 | grep -v Warn | tee $OUT/bench_trace_gpu.log
export ULPTRACE_FLA_DIR=/tmp/fla
ulptrace onset --model qwen3.5-0.8b --device cuda --prompts 2 --prompt-len 32 --new-tokens 4 \
    --candidate hf:fla --sites 'layers.*.linear_attn.*' --check-reference \
    --json $OUT/fla_gdn.json > $OUT/fla_gdn.txt 2>&1; tail -14 $OUT/fla_gdn.txt
