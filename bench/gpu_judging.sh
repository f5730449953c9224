#!/usr/bin/env bash
# One device call for the oracle judged in processes of its own (issue 11, P3; `onset --judge-workers N`): install,
# build the kernels, the judging GPU tests (TESTS=none: none), bench_trace.py's P3 with each of WORKERS (default
# "0 4 8"; 0: judged in this process) writing the P3 report (its sha256 printed: 9ac5bc07... at 3c98fdf), and with
# CLI=1 the whole CLI onset on P3's workload, a fresh process each, with 0 and the last of WORKERS. Logs and JSON
# under $OUT (few files: the device returns a limited number).
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1 TIMEFORMAT=%R
WORKERS=${WORKERS:-0 4 8}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
if [ "${TESTS:-}" != none ]; then
    timeout 300 python3 -m pytest -m gpu ${TESTS:-tests/probes/test_judging.py} -q -p no:cacheprovider -rf --tb=short \
        2>&1 | tee $OUT/gpu_tests.log | tail -4
fi
for w in $WORKERS; do
    timeout 240 python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --goals P3 --judge-workers $w \
        --json $OUT/p3_workers_$w.json --reports /tmp/reports_$w 2>&1 | grep "^P3\|Error" | tee -a $OUT/p3.log
    sha256sum /tmp/reports_$w/P3-oracle.json | tee -a $OUT/p3.log
done
if [ "${CLI:-0}" != 0 ]; then
    for w in 0 ${WORKERS##* }; do
        s=$( { time timeout 200 ulptrace onset --model qwen3.5-0.8b --device cuda --candidate kernels:fused --prompts 2 \
            --prompt-len 32 --new-tokens 4 --quiet --no-concurrent --judge-workers $w --json /tmp/cli_$w.json > /dev/null \
            2> /tmp/cli_$w.err; } 2>&1 )
        echo "cli onset with the oracle, 2 x 32, 4 steps, --judge-workers $w: $s s" | tee -a $OUT/p3.log
    done
fi
