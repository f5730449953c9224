#!/usr/bin/env bash
# One device call for `onset --concurrent`'s P1 (issue 11): its GPU tests (TESTS=none: none); ROUNDS processes of
# bench_trace.py --concurrent (default 2; BASE=dir: alternating with the package in dir/ulptrace, e.g. a commit's
# `git archive` as in RESULTS), each printing where both sides' time went and the P1 report's sha256 (8e075445... at
# 3c98fdf); CONC=1: bench_concurrent.py (each side untraced and traced, at once and one at a time); SPY=1: a py-spy
# profile of one more process, both sides (`.whl/py-spy` carried: a static binary), summarised per side. Logs and
# JSON under $OUT (few files: the device returns a limited number).
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
BENCH="bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16 \
--goals P1 --concurrent --warm-repeats ${REPEATS:-4}"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
if [ "${TESTS:-}" != none ]; then
    timeout 200 python3 -m pytest -m gpu ${TESTS:-tests/probes/test_onset_concurrent.py tests/tracer/test_trace_compare.py} \
        -q -p no:cacheprovider -rf --tb=short 2>&1 | tee $OUT/gpu_tests.log | tail -3
fi
for i in $(seq ${ROUNDS:-2}); do
    for mode in $([ -n "${BASE:-}" ] && echo before) after; do
        echo "== $mode $i" | tee -a $OUT/ab.log
        ( [ $mode = before ] && export PYTHONPATH=$BASE; timeout 150 python3 $BENCH --json /tmp/p1_${mode}_$i.json \
            --reports /tmp/r_${mode}_$i 2>&1 | grep "^P\|Error" | tee -a $OUT/ab.log )
        sha256sum /tmp/r_${mode}_$i/*.json | tee -a $OUT/ab.log
    done
done
if [ "${CONC:-0}" = 1 ]; then
    timeout 200 python3 bench/bench_concurrent.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 \
        --new-tokens 16 --repeats 5 --json $OUT/bench_concurrent.json 2>&1 | grep -v "^\[" | tee $OUT/bench_concurrent.log
fi
if [ "${SPY:-0}" = 1 ]; then
    timeout 150 .whl/py-spy record -r 200 --nonblocking --subprocesses -f raw -o $OUT/spy.txt -- python3 $BENCH \
        > $OUT/spy_run.log 2>&1
    grep "^P" $OUT/spy_run.log
    for root in traced _reference_run; do
        python3 bench/spy_summary.py $OUT/spy.txt --root $root | head -45 > $OUT/spy_$root.txt
        python3 bench/spy_summary.py $OUT/spy.txt --root $root --lines | head -40 >> $OUT/spy_$root.txt
    done
    gzip $OUT/spy.txt
fi
