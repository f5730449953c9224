#!/usr/bin/env bash
# One device call (twenty-fourth round, final tree): every GPU test; then the command at 8 x 4,096 tokens with
# --sdpa flash, --concurrent and the default (which switches at the prompt's first layer) alternating, twice each,
# fresh processes, timed whole; the last two reports compared with call 1's --no-concurrent one.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
date -u | tee $OUT/date.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
timeout ${TESTS_S:-300} python3 -m pytest -m gpu tests -q -p no:cacheprovider -rf --tb=short 2>&1 | tee $OUT/gpu_tests.log | tail -4
gunzip -c bench/results/gpu_2026-12-04k/call1/no-concurrent.json.gz > /tmp/no-concurrent.json
OUT=$OUT SDPA=flash TESTS=0 DIFF=0 MODES="concurrent default concurrent default" REUSE=no-concurrent bash bench/gpu_switch.sh
