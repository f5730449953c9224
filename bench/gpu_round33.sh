#!/usr/bin/env bash
# Thirty-third round, one device call: where the concurrent onset's time goes beyond each side's own tracing.
# STAGES picks and orders some of these (default "p1 floor side concurrent"); logs under $OUT:
#   p1: bench_trace.py --goals P1 --concurrent auto, P1 as the command's default runs it, with each warm run's message
#       timeline (when the reference sent each step, when this side asked for its token and had it);
#   floor: the same with --compare-nothing (this side's comparison dropped): the wall if it cost nothing;
#   side: bench_side_parts.py, each side alone, inside and outside the recorder's hooks;
#   concurrent: bench_concurrent.py, each side untraced and traced, both at once and one at a time;
#   spy: P1's onsets under py-spy (this process only; .whl/py-spy carried), summarised under the candidate's run;
#   upload: bench_table_upload.py (a launch table's way to the device);
#   tests: the GPU tests in TESTS (default: the statistics' and the comparison's).
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
git log -1 --format=%h 2>/dev/null | tee -a $OUT/env.log
cd bench
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16"
for stage in ${STAGES:-p1 floor side concurrent}; do
    echo "== $stage $(date +%T)"
    case $stage in
    concurrent) timeout 170 python3 bench_concurrent.py $W --repeats ${REPEATS:-4} --json $OUT/concurrent.json 2>&1 \
        | grep -v Warn | tee $OUT/concurrent.log | tail -12 ;;
    side) timeout 170 python3 bench_side_parts.py $W --repeats ${REPEATS:-3} --json $OUT/side.json 2>&1 \
        | grep -v Warn | tee $OUT/side.log | grep -E "untraced|keep|drop" ;;
    p1) timeout 220 python3 bench_trace.py $W --goals P1 --concurrent auto --json $OUT/p1.json 2>&1 \
        | grep "^P" | tee $OUT/p1.log | cut -c1-1500 ;;
    spy) python3 -m pip install -q --no-deps ../.whl/py_spy-*.whl 2>&1 | tail -1
        timeout 250 py-spy record -r 200 -f raw -o $OUT/spy.txt -- python3 bench_trace.py $W --goals P1 \
            --concurrent auto 2>&1 | grep "^P1 onset" | tee $OUT/spy.log | cut -c1-300
        python3 spy_summary.py $OUT/spy.txt --root _record_side > $OUT/spy_summary.txt 2>&1
        python3 spy_summary.py $OUT/spy.txt --root _record_side --lines > $OUT/spy_lines.txt 2>&1
        head -60 $OUT/spy_summary.txt; head -40 $OUT/spy_lines.txt ;;
    upload) timeout 60 python3 bench_table_upload.py --json $OUT/upload.json 2>&1 | tee $OUT/upload.log | tail -2 ;;
    tests) (cd .. && timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/tracer/test_record_stats.py \
        tests/tracer/test_ulp.py tests/tracer/test_trace_compare.py} 2>&1 | tail -3 | tee $OUT/tests.log) ;;
    floor) timeout 220 python3 bench_trace.py $W --goals P1 --concurrent auto --compare-nothing --json $OUT/floor.json \
        2>&1 | grep "^P" | tee $OUT/floor.log | cut -c1-1500 ;;
    esac
done
