#!/usr/bin/env bash
# One device call for `onset --concurrent`'s P1 (issue 11): this tree's candidate records waiting in order for the
# reference's (StreamingComparator.WAIT_BYTES) against each waiting at once (`--wait-bytes 0`, as before 2026-12-04),
# ROUNDS rounds of alternating processes (default 2), each printing where both sides' time went and the P1 report's
# sha256 (8e075445... at 3c98fdf); its GPU tests first (TESTS=none: none); SPY=1: a py-spy profile of one more
# process, both sides (`.whl/py-spy` carried: a static binary), summarised per side. Logs and JSON under $OUT.
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
    for mode in before after; do
        flag=$([ $mode = before ] && echo "--wait-bytes 0")
        echo "== $mode $i" | tee -a $OUT/ab.log
        timeout 150 python3 $BENCH $flag --json $OUT/p1_${mode}_$i.json --reports /tmp/r_${mode}_$i 2>&1 \
            | grep "^P\|Error" | tee -a $OUT/ab.log
        sha256sum /tmp/r_${mode}_$i/*.json | tee -a $OUT/ab.log
    done
done
if [ "${SPY:-0}" = 1 ]; then
    timeout 150 .whl/py-spy record -r 200 --nonblocking --subprocesses -f raw -o $OUT/spy.txt -- python3 $BENCH \
        > $OUT/spy_run.log 2>&1
    grep "^P" $OUT/spy_run.log
    for root in traced _reference_run; do
        python3 bench/spy_summary.py $OUT/spy.txt --root $root | head -45 > $OUT/spy_$root.txt
        python3 bench/spy_summary.py $OUT/spy.txt --root $root --lines | head -40 >> $OUT/spy_$root.txt
    done
fi
