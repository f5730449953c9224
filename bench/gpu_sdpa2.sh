#!/usr/bin/env bash
# The twenty-second round's second --sdpa call: the GPU tests of the pin, then where cuDNN's attention (torch's
# choice) first feeds a later op a different value (bench/op_repeatability.py's first_fed_differently), as launched
# and under CUDA_LAUNCH_BLOCKING=1.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
timeout 150 python3 -m pytest -q -m gpu tests/tracer/test_sdpa.py -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/tests.log
W="--device cuda --model qwen3.5-0.8b --prompts 8 --new-tokens 16 --prompt-len ${LEN:-512}"
run() { name=$1; shift; timeout ${LIMIT:-120} python3 "$@" 2>&1 | grep -v "^\[" | cut -c1-3000 \
    | sed "s/^/$name: /" | tee -a $OUT/sdpa.log; }
run ops_default bench/op_repeatability.py $W --repeats 2 --json $OUT/ops_default.json
CUDA_LAUNCH_BLOCKING=1 run ops_blocking bench/op_repeatability.py $W --repeats 2 --json $OUT/ops_blocking.json
