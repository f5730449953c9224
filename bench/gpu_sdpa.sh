#!/usr/bin/env bash
# One device call for the twenty-second round: --sdpa. The GPU tests of the pin (each backend's kernel runs, a flash
# pin repeats at 8 x 512); every aten op of the reference hashed with the flash pin (nothing should fail to repeat)
# and with torch's choice (which outputs of cuDNN's attention differ); then the onset at 8 x LEN (default 512) with
# the reference kept, spilled and in its own process, flash-pinned: the reports should now be equal.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
timeout 200 python3 -m pytest -q -m gpu tests/tracer/test_sdpa.py -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/tests.log
W="--device cuda --model qwen3.5-0.8b --prompts 8 --new-tokens 16 --prompt-len ${LEN:-512}"
run() { name=$1; shift; timeout ${LIMIT:-120} python3 "$@" 2>&1 | grep -v "^\[" | cut -c1-1500 \
    | sed "s/^/$name: /" | tee -a $OUT/sdpa.log; }
run ops_flash bench/op_repeatability.py $W --sdpa flash --repeats 3 --json $OUT/ops_flash.json
run ops_default bench/op_repeatability.py $W --repeats 2 --json $OUT/ops_default.json
run spill_flash bench/spill_diff.py $W --sdpa flash --room-mib 256
