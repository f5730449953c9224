#!/usr/bin/env bash
# One device call: `ulptrace onset` as a user runs it on CUDA, with --concurrent against --no-concurrent (the default),
# each a fresh process, their reports compared less what says when and in which process: tiny-qwen3.5 with the
# candidate replayed as CUDA graphs and the oracle; the 0.8B shape with the oracle (P3's workload) judged in 4 processes
# (--judge-workers 4) against judged here. Each run's line counts the tracebacks and torch's warning that a producer
# "has been terminated before all shared CUDA tensors released" on its stderr (both must be 0). P1=1: instead, P1's
# workload (the 0.8B shape, 8 x 128 tokens, 16 steps, no oracle) with --concurrent against the default, alternating
# ROUNDS times (default 2), then tiny-qwen3.5 on the same workload once each (twentieth round). Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1 TIMEFORMAT=%R
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
run() {  # name, then the onset's arguments
    local name=$1; shift
    s=$( { time timeout 150 ulptrace onset --device cuda --candidate kernels:fused --quiet --json /tmp/$name.json "$@" \
        > /dev/null 2> /tmp/$name.err; } 2>&1 )
    echo "$name: $s s, $(grep -c Traceback /tmp/$name.err) tracebacks, $(grep -c 'Producer process has been terminated' \
        /tmp/$name.err) IPC warnings" | tee -a $OUT/cli_defaults.log
}
equal() {
    python3 - "$1" "$2" <<'PY' 2>&1 | tee -a $OUT/cli_defaults.log
import json, sys
sys.path.insert(0, "bench")
from bench_trace import VOLATILE, _clean
a, b = (json.load(open(f"/tmp/{n}.json")) for n in sys.argv[1:])
print(f"{sys.argv[1]} vs {sys.argv[2]}: reports equal:", _clean(a) == _clean(b), "| sites:", len(a["sites"]),
      "| reference process:", "reference_process" in a["run"], "/", "reference_process" in b["run"],
      "| judged in processes:", a["run"].get("judging_processes"), "/", b["run"].get("judging_processes"))
PY
}
if [ "${P1:-0}" = 1 ]; then
    W="--prompts 8 --prompt-len 128 --new-tokens 16 --no-oracle"
    for i in $(seq ${ROUNDS:-2}); do
        run p1_concurrent_$i --model qwen3.5-0.8b $W --concurrent
        run p1_sequential_$i --model qwen3.5-0.8b $W
    done
    equal p1_concurrent_1 p1_sequential_1
    run tiny_sequential --model tiny-qwen3.5 $W
    run tiny_concurrent --model tiny-qwen3.5 $W --concurrent
    equal tiny_concurrent tiny_sequential
    exit
fi
TINY="--model tiny-qwen3.5 --prompts 2 --prompt-len 16 --new-tokens 4 --candidate-mode graph"
run tiny_concurrent $TINY --concurrent
run tiny_sequential $TINY
equal tiny_concurrent tiny_sequential
P3="--model qwen3.5-0.8b --prompts 2 --prompt-len 32 --new-tokens 4"
run p3_concurrent_pool4 $P3 --concurrent --judge-workers 4
run p3_sequential_here $P3
equal p3_concurrent_pool4 p3_sequential_here
