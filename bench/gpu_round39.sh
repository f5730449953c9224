#!/usr/bin/env bash
# Thirty-ninth round, issue 11's closing call: the frozen baseline's reports against this tree's, and the table's goals at
# this tree with the command's default. With .base/b3c carried (the baseline commit before issue 11's first change:
# mkdir -p .base/b3c && git archive 3c98fdf tracer probes kernels | tar -x -C .base/b3c), its package writes the two
# onsets' reports first (before this tree is installed; $OUT/base_reports), then this tree's sequential onsets
# ($OUT/reports_seq), the goals P1 P2 P3 with the command's default, each side in a process of its own ($OUT/default.json,
# its reports $OUT/reports_default), and P5 at 8 x 4,096 with --sdpa flash, now pinned (LONG=0: skipped). Each report
# folder is compared with the baseline's by bench/report_diff.py (the fields other issues added allowed, the output site
# left out; every allowed difference printed to $OUT/diff_*.log).
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
. bench/package.sh
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16"
if [ -d .base/b3c/tracer ]; then
    package .base/b3c base
    (cd bench && PYTHONPATH=/tmp/base timeout 200 python3 bench_trace.py $W --reports-only --reports $OUT/base_reports 2>&1 \
        | grep -v Warn | tail -2)
fi
. bench/gpu_setup.sh
timeout 150 python3 bench/bench_trace.py $W --reports-only --reports $OUT/reports_seq 2>&1 | grep "Error" | tail -2
timeout 240 python3 bench/bench_trace.py $W --goals P1 P2 P3 --stats-mib 256 --concurrent auto --warm-repeats 2 \
    --reports $OUT/reports_default --json $OUT/default.json 2>&1 | grep "^P\|Error" | tee $OUT/default.log | cut -c1-400
sha256sum $OUT/*/*.json | tee $OUT/sha.log
for d in reports_seq reports_default; do
    [ -d $OUT/base_reports ] && (cd bench && python3 report_diff.py $OUT/base_reports $OUT/$d --new-sites output \
        --allowed input_shapes g > $OUT/diff_$d.log; tail -1 $OUT/diff_$d.log; grep "differing fields" $OUT/diff_$d.log)
done
(cd bench && python3 report_diff.py $OUT/reports_seq $OUT/reports_default | tail -1)
if [ "${LONG:-1}" = 1 ]; then
    timeout 170 python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 4096 \
        --new-tokens 16 --sdpa flash --goals P5 --concurrent auto --json $OUT/p5_4096_flash.json 2>&1 \
        | grep "^P5\|Error" | tee $OUT/p5.log | cut -c1-400
fi
