#!/usr/bin/env bash
# One device call for the streaming-comparison speed (issue 11, P1): install, build the kernels, the tracer's GPU
# tests (TESTS=none: none), the tracing benchmark on the 0.8B shape with a profile and the onsets' JSON reports, and
# P1 split into its layers (bench_p1_parts.py, REPEATS runs each, default 3), and the host cost of one observation's
# operations (bench_launch.py). Logs and JSON under $OUT (the device returns a limited number of files: pass a scratch
# folder as OUT and tar it into the real one, as RESULTS.md's fifth round did).
# With .base/ carried (`git archive <commit> tracer probes kernels | tar -x -C .base`, git-ignored) the reports of that
# commit's package are written first, before this tree is installed (to $OUT/base_reports), for an identity check.
# FLUSH="256 4096" adds the onset with its statistics read back every N records (bench_p1_parts.py --flush-every);
# GRID=1 sweeps ulp_stats' kernel settings (bench_ulp_grid.py; with .prev/ carried, that commit's kernel first);
# LAUNCH=0 skips bench_launch.py; NATIVE=1 adds bench_native_copy.py; SPY=1 (py-spy installed, e.g. from a carried
# wheel) a sampling profile of the onset layer summarised by bench/spy_summary.py. TRACE=0 skips bench_trace.py;
# PARTS=0 bench_p1_parts.py's layers; AB=N times P1's layers (AB_LAYERS, default "hooks onset") in N rounds of two
# processes, .prev/'s package (an older commit's, carried) and this tree's, one after the other: a before/after on one
# host within one call. CONC=1 adds bench_trace.py --concurrent (P1, P3, P5 with onset --concurrent, and its reports).
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
. bench/package.sh
BENCH="bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16"
if [ -d .base/tracer ]; then
    package .base base
    PYTHONPATH=/tmp/base python3 $BENCH --reports-only --reports $OUT/base_reports 2>&1 | grep -v Warn | tail -3
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
if [ "${TESTS:-}" != none ]; then
    python3 -m pytest -m gpu ${TESTS:-tests/tracer} -q -p no:cacheprovider -rf --tb=short 2>&1 | tee $OUT/gpu_tests.log | tail -8
fi
if [ "${LAUNCH:-1}" != 0 ]; then
    python3 bench/bench_launch.py --device cuda --json $OUT/launch.json 2>&1 | tee $OUT/launch.log
fi
if [ "${TRACE:-1}" != 0 ]; then
    python3 $BENCH --stats-mib 256 --json $OUT/bench_trace_gpu.json --profile $OUT/profile_p1_warm.txt \
        --reports $OUT/reports 2>&1 | grep -v Warn | tee $OUT/bench_trace_gpu.log
fi
if [ "${CONC:-0}" != 0 ]; then  # onset --concurrent (the reference in a process of its own, kept between onsets)
    python3 $BENCH --goals P1 P3 P5 --concurrent --json $OUT/bench_trace_concurrent.json --reports $OUT/reports_concurrent \
        2>&1 | grep -v Warn | tee $OUT/bench_trace_concurrent.log
fi
if [ "${PARTS:-1}" != 0 ]; then
    python3 bench/bench_p1_parts.py --device cuda --model qwen3.5-0.8b --repeats ${REPEATS:-3} ${FLUSH:+--flush-every $FLUSH} \
        --json $OUT/p1_parts.json 2>&1 | grep -v Warn | tee $OUT/p1_parts.log
fi
if [ "${AB:-0}" != 0 ] && [ -d .prev/tracer ]; then  # this tree against .prev/'s package: AB rounds of one process each
    [ -d /tmp/prev/ulptrace ] || package .prev prev
    for i in $(seq $AB); do
        for side in prev tree; do
            PYTHONPATH=$([ $side = prev ] && echo /tmp/prev) python3 bench/bench_p1_parts.py --device cuda \
                --model qwen3.5-0.8b --repeats ${REPEATS:-3} --layers ${AB_LAYERS:-hooks onset} \
                --json $OUT/ab_${side}_$i.json 2>&1 | grep -v Warn | grep " s " | sed "s/^/$side $i: /" | tee -a $OUT/ab.log
        done
    done
fi
if [ "${GRID:-0}" != 0 ]; then  # ulp_stats' kernel against its launch settings; .prev/'s (an older commit's) beside it
    if [ -d .prev/tracer ]; then
        [ -d /tmp/prev/ulptrace ] || package .prev prev
        PYTHONPATH=/tmp/prev python3 bench/bench_ulp_grid.py --sweep grid 2>&1 | tee $OUT/ulp_grid_prev.log
    fi
    python3 bench/bench_ulp_grid.py 2>&1 | tee $OUT/ulp_grid.log
fi
if [ "${NATIVE:-0}" != 0 ]; then  # what a copy and a launch cost below Python (builds a small extension)
    python3 bench/bench_native_copy.py --json $OUT/native_copy.json 2>&1 | grep -v Warn | tee $OUT/native_copy.log
fi
if [ "${SPY:-0}" != 0 ] && command -v py-spy > /dev/null; then  # a sampling profile of the onset layer's timed runs
    py-spy record -r 200 -f raw -o $OUT/spy_p1.txt -- python3 bench/bench_p1_parts.py --device cuda \
        --model qwen3.5-0.8b --layers onset --repeats 3 2>&1 | grep -v Warn | tail -3
    python3 bench/spy_summary.py $OUT/spy_p1.txt --root timed --within full --top 70 > $OUT/spy_p1_summary.txt
    python3 bench/spy_summary.py $OUT/spy_p1.txt --root timed --within full --lines --top 40 >> $OUT/spy_p1_summary.txt
fi
if [ -d $OUT/base_reports ]; then
    for f in P1-no-oracle P3-oracle; do cmp $OUT/base_reports/$f.json $OUT/reports/$f.json && echo "$f identical to the base"; done
fi
