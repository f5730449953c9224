#!/usr/bin/env bash
# One device call: does a kept reference process slow this process's untraced runs (the base `--concurrent`'s P1 is
# divided by)? The GPU tests of the helper processes, then bench/idle_helper.py at P1's workload with this tree and
# (BASE=dir: a package dir/ulptrace, as gpu_concurrent_ab.sh takes) with an older one; SKIP_IDLE=1: the tests only.
# Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
if [ "${TESTS:-}" != none ]; then
    timeout 240 python3 -m pytest -m gpu ${TESTS:-tests/probes/test_onset_concurrent.py tests/probes/test_judging.py} \
        -q -p no:cacheprovider -rf --tb=short 2>&1 | tee $OUT/gpu_tests.log | tail -3
fi
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16 --repeats ${REPEATS:-5}"
[ "${SKIP_IDLE:-0}" = 1 ] && exit 0  # the tests only
for mode in after $([ -n "${BASE:-}" ] && echo before); do
    echo "== $mode" | tee -a $OUT/idle.log
    ( [ $mode = before ] && export PYTHONPATH=$BASE; cd bench && timeout 200 python3 idle_helper.py $W \
        --json $OUT/idle_$mode.json 2>&1 | grep -v "^\[" | tail -8 | tee -a $OUT/idle.log )
done
