#!/usr/bin/env bash
# One device call: `ulptrace onset` as a user runs it on CUDA, --concurrent against the default (both sides in this
# process), a fresh process each, alternating ROUNDS times (default 2) on P1's workload (the 0.8B shape, 8 x 128
# tokens, 16 steps, no oracle), then once each on tiny-qwen3.5. Each line: wall seconds, whether the report's run has
# a reference process, tracebacks and torch's IPC warnings on stderr (both must be 0); the reports compared less what
# says when and in which process. Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1 TIMEFORMAT=%R
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
run() {  # name, then the onset's arguments
    local name=$1; shift
    s=$( { time timeout 150 ulptrace onset --device cuda --candidate kernels:fused --no-oracle --quiet \
        --json /tmp/$name.json "$@" > /dev/null 2> /tmp/$name.err; } 2>&1 )
    used=$(python3 -c "import json; print('reference process:', 'reference_process' in json.load(open('/tmp/$name.json'))['run'])" 2>&1 | tail -1)
    echo "$name: $s s, $(grep -c Traceback /tmp/$name.err) tracebacks, $(grep -c 'Producer process has been terminated' \
        /tmp/$name.err) IPC warnings; $used" | tee -a $OUT/cli_choice.log
}
equal() {
    python3 - "$1" "$2" <<'PY' 2>&1 | tee -a $OUT/cli_choice.log
import json, sys
sys.path.insert(0, "bench")
from bench_trace import _clean
a, b = (json.load(open(f"/tmp/{n}.json")) for n in sys.argv[1:])
print(f"{sys.argv[1]} vs {sys.argv[2]}: reports equal:", _clean(a) == _clean(b), "| sites:", len(a["sites"]))
PY
}
P1="--model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16"
for i in $(seq ${ROUNDS:-2}); do
    run p1_concurrent_$i $P1 --concurrent
    run p1_sequential_$i $P1
done
equal p1_concurrent_1 p1_sequential_1
TINY="--model tiny-qwen3.5 --prompts 8 --prompt-len 128 --new-tokens 16"
run tiny_sequential $TINY
run tiny_concurrent $TINY --concurrent
equal tiny_sequential tiny_concurrent
