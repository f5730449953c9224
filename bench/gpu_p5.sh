#!/usr/bin/env bash
# One device call for peak memory (issue 11, P5) after large values were handed to sinks uncopied: install, build, the
# GPU tests (TESTS=none: none), the onset reports of this tree and of .base/ (identity), P1 and P5 at 8 x 128 with
# the reference kept as onset keeps it by default (auto) and in host memory, and P5 with host memory at a longer
# prompt (LONG tokens, default 1024) for this tree and for the package in .prev/ (the commit before; `git archive
# <commit> tracer probes kernels | tar -x -C .prev`, git-ignored) — before and after in one call. Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
LONG=${LONG:-1024}
BENCH="bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --new-tokens 16"
package() {  # package DIR NAME: an older tree's package importable from /tmp/NAME
    mkdir -p /tmp/$2 && cp -r $1/tracer /tmp/$2/ulptrace && ln -s "$PWD/$1/probes" /tmp/$2/ulptrace/probes \
        && ln -s "$PWD/$1/kernels" /tmp/$2/ulptrace/kernels
}
if [ -d .base/tracer ]; then
    package .base base
    PYTHONPATH=/tmp/base timeout 120 python3 $BENCH --prompt-len 128 --reports-only --reports $OUT/base_reports 2>&1 \
        | grep -v Warn | tail -3
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
if [ "${TESTS:-}" != none ]; then
    timeout 200 python3 -m pytest -m gpu ${TESTS:-tests/tracer} -q -p no:cacheprovider -rf --tb=short 2>&1 \
        | tee $OUT/gpu_tests.log | tail -8
fi
timeout 120 python3 $BENCH --prompt-len 128 --reports-only --reports $OUT/reports 2>&1 | grep -v Warn | tail -3
if [ -d $OUT/base_reports ]; then
    for f in P1-no-oracle P3-oracle; do cmp $OUT/base_reports/$f.json $OUT/reports/$f.json && echo "$f identical to the base"; done
fi
for memory in auto host; do
    timeout 150 python3 $BENCH --prompt-len 128 --goals P1 P5 --reference-memory $memory \
        --json $OUT/p15_128_$memory.json 2>&1 | grep -v Warn | grep "^P"
done
[ -d .prev/tracer ] && package .prev prev
for who in prev now; do
    path=$([ $who = prev ] && echo /tmp/prev || echo "")
    PYTHONPATH=$path timeout 200 python3 $BENCH --prompt-len $LONG --goals P5 --reference-memory host \
        --json $OUT/p5_${LONG}_host_$who.json 2>&1 | grep -v Warn | grep "^P\|Error\|error" | sed "s/^/$who: /"
done
