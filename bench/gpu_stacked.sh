#!/usr/bin/env bash
# One device call for judging records of one program together (issue 11, P3; OracleJudge.replayed_many): install,
# build the kernels, the GPU tests of the judging paths (TESTS: stacked answers, judging processes, concurrent
# reference), bench_stacked.py on P3's workload (one by one against stacked, ops per pair, the same answers), then
# bench_trace.py's P3 judged here and in each of WORKERS processes (default "0 8"; the report's sha256: 9ac5bc07... at
# 3c98fdf). BASE: a folder holding an earlier commit's package as `ulptrace` (tracer/ copied there, probes/ and
# kernels/ inside it): bench_stacked.py and P3 judged here are run with it too, on the same host; ROUNDS=N (default 1)
# alternates them N times. STACKED=0 leaves bench_stacked.py out, PROFILE=1 adds bench/profile_p3.py (this tree). Logs
# and JSON under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
TESTS=${TESTS:-tests/probes/test_stacked_judging.py tests/probes/test_judging.py tests/probes/test_onset_concurrent.py}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
if [ "$TESTS" != none ]; then
    timeout 240 python3 -m pytest -m gpu $TESTS -q -p no:cacheprovider -rf --tb=short 2>&1 | tee $OUT/gpu_tests.log \
        | tail -4
fi
if [ "${STACKED:-1}" != 0 ]; then
    timeout 150 python3 bench/bench_stacked.py --device cuda --model qwen3.5-0.8b --json $OUT/stacked.json 2>&1 \
        | grep -v "^\[transformers\]" | tee $OUT/stacked.log
    if [ -n "${BASE:-}" ]; then
        PYTHONPATH=$BASE timeout 150 python3 bench/bench_stacked.py --device cuda --model qwen3.5-0.8b \
            --json $OUT/stacked_base.json 2>&1 | grep -v "^\[transformers\]" | tee $OUT/stacked_base.log
    fi
fi
for round in $(seq ${ROUNDS:-1}); do
    for w in ${WORKERS:-0 8}; do
        echo "this tree, round $round, $w judging processes" | tee -a $OUT/p3.log
        timeout 150 python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --goals P3 --judge-workers $w \
            --json $OUT/p3_workers_${w}_$round.json --reports /tmp/reports_$w 2>&1 | grep "^P3\|Error" | tee -a $OUT/p3.log
        sha256sum /tmp/reports_$w/P3-oracle.json | tee -a $OUT/p3.log
    done
    if [ -n "${BASE:-}" ]; then
        echo "BASE, round $round, judged here" | tee -a $OUT/p3.log
        PYTHONPATH=$BASE timeout 150 python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --goals P3 \
            --json $OUT/p3_base_$round.json --reports /tmp/reports_base 2>&1 | grep "^P3\|Error" | tee -a $OUT/p3.log
        sha256sum /tmp/reports_base/P3-oracle.json | tee -a $OUT/p3.log
    fi
done
if [ "${PROFILE:-0}" != 0 ]; then
    timeout 200 python3 bench/profile_p3.py --device cuda --model qwen3.5-0.8b --out $OUT/profile_p3.txt 2>&1 \
        | grep "^warm" | tee -a $OUT/p3.log
fi
