#!/usr/bin/env bash
# One device call for `onset --concurrent` (issue 11, P1 and P5): install, build the kernels, its GPU tests and the
# statistics batch's (TESTS=none: none), the CLI's whole onset end to end — sequential and --concurrent, alternating,
# CLI=N rounds (default 2; 0: none), each a fresh process as a user runs it —, bench_trace.py's P1 and P5 with
# --concurrent at 8 x 128 (TRACE=0: skipped) and P5 with --concurrent at LONG prompt tokens (default 0: skipped).
# Logs and JSON under $OUT (few files: the device returns a limited number).
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1 TIMEFORMAT=%R
BENCH="bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --new-tokens 16"
ONSET="ulptrace onset --model qwen3.5-0.8b --device cuda --candidate kernels:fused --no-oracle --prompts 8 \
--prompt-len 128 --new-tokens 16 --quiet"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
if [ "${TESTS:-}" != none ]; then
    timeout 200 python3 -m pytest -m gpu ${TESTS:-tests/probes/test_onset_concurrent.py tests/tracer/test_record_stats.py} -q -p no:cacheprovider -rf \
        --tb=short 2>&1 | tee $OUT/gpu_tests.log | tail -4
fi
for i in $(seq ${CLI:-2}); do  # wall seconds of the whole command: imports, builds, both runs, the report
    for mode in sequential concurrent; do
        flag=$([ $mode = concurrent ] && echo --concurrent || echo --no-concurrent)  # on CUDA the default is on
        s=$( { time timeout 200 $ONSET $flag --json /tmp/cli_${mode}_$i.json > /dev/null 2> /tmp/cli_${mode}_$i.err; } 2>&1 )
        echo "cli $mode $i: $s s" | tee -a $OUT/cli.log
    done
    python3 - $i <<'PY' 2>&1 | tee -a $OUT/cli.log  # the two reports, less what says when and in which process
import json, sys
sys.path.insert(0, "bench")
from bench_trace import _clean
i = sys.argv[1]
seq, conc = (_clean(json.load(open(f"/tmp/cli_{m}_{i}.json"))) for m in ("sequential", "concurrent"))
print(f"cli {i}: the sequential and the concurrent report equal (less {'/'.join(__import__('bench_trace').VOLATILE)}):",
      seq == conc, "| sites:", len(seq["sites"]))
PY
done
if [ "${TRACE:-1}" != 0 ]; then
    timeout 240 python3 $BENCH --prompt-len 128 --goals P1 P5 --concurrent --json $OUT/bench_trace_concurrent.json \
        --reports /tmp/reports_concurrent 2>&1 | grep "^P\|Error" | tee $OUT/bench_trace_concurrent.log
    sha256sum /tmp/reports_concurrent/*.json | tee -a $OUT/bench_trace_concurrent.log  # P1-no-oracle: 8e075445... at 3c98fdf
fi
if [ "${LONG:-0}" != 0 ]; then
    timeout 300 python3 $BENCH --prompt-len $LONG --goals P5 --concurrent --json $OUT/p5_${LONG}_concurrent.json \
        2>&1 | grep "^P\|Error\|memory" | tee $OUT/p5_${LONG}_concurrent.log
fi
