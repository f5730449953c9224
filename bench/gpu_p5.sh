#!/usr/bin/env bash
# One device call for peak memory and the host-memory reference (issue 11, P5): install, build, the GPU tests of the
# recorder and the comparison (TESTS=... to choose others, none: none), the onset reports with the reference in host
# memory for this tree and for .base/ (identity), P1 and P5 with the reference in host memory at 8 x 128 for the
# package in .prev/ (the commit before; `git archive <commit> tracer probes kernels | tar -x -C .prev`, git-ignored)
# and for this tree — before and after in one call — and P5 at a longer prompt (LONG tokens, default 512; LONG=0
# skips it). Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
LONG=${LONG:-512}
BENCH="bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --new-tokens 16 --reference-memory host"
. bench/package.sh
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
if [ "${TESTS:-}" != none ]; then
    timeout 200 python3 -m pytest -m gpu ${TESTS:-tests/tracer/test_record.py tests/tracer/test_trace_compare.py} -q \
        -p no:cacheprovider -rf --tb=short 2>&1 | tee $OUT/gpu_tests.log | tail -4
fi
if [ -d .base/tracer ]; then
    package .base base
    PYTHONPATH=/tmp/base timeout 120 python3 $BENCH --prompt-len 128 --reports-only --reports $OUT/base_reports 2>&1 \
        | grep -v Warn | tail -3
    timeout 120 python3 $BENCH --prompt-len 128 --reports-only --reports $OUT/reports 2>&1 | grep -v Warn | tail -3
    for f in P1-no-oracle P3-oracle; do
        cmp $OUT/base_reports/$f.json $OUT/reports/$f.json && echo "$f (reference in host memory) identical to the base"
    done
fi
[ -d .prev/tracer ] && package .prev prev
for who in prev now; do
    path=$([ $who = prev ] && echo /tmp/prev || echo "")
    PYTHONPATH=$path timeout 150 python3 $BENCH --prompt-len 128 --goals P1 P5 --warm-repeats 2 \
        --json $OUT/p15_128_host_$who.json 2>&1 | grep -v Warn | grep "^P\|Error" | sed "s/^/$who: /"
done
if [ "$LONG" != 0 ]; then
    timeout 150 python3 $BENCH --prompt-len $LONG --goals P5 --json $OUT/p5_${LONG}_host.json 2>&1 | grep -v Warn \
        | grep "^P\|Error"
fi
