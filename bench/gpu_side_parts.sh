#!/usr/bin/env bash
# One device call (planned for the next session that is lent a GPU): where each side's traced time goes on the H200
# (bench_side_parts.py: the time inside the recorder's hooks against the time tracing adds outside them, each side of
# P1's workload; the host synchronisations each side makes untraced and traced), then P1 as the command's default
# runs it (bench_trace.py --goals P1 --concurrent auto). Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
cd bench
timeout 300 python3 bench_side_parts.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 \
    --new-tokens 16 --repeats ${REPEATS:-5} --syncs --json $OUT/side_parts.json 2>&1 | grep -v Warning \
    | tee $OUT/side_parts.log | tail -40
[ "${BENCH:-1}" = 0 ] || timeout 240 python3 bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 \
    --prompt-len 128 --new-tokens 16 --goals P1 --concurrent auto --json $OUT/p1.json 2>&1 | tee $OUT/p1.log | tail -4
