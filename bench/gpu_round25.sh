#!/usr/bin/env bash
# One device call (twenty-fifth round): the GPU tests of the concurrent onset (TESTS=0: none), then `ulptrace onset` on
# the 0.8B shape as a fresh process each, the command's default against MODES' other flags (default: --no-concurrent;
# before `ulptrace.spawning` this script compared --concurrent), alternating ROUNDS times (default 2), on P1's workload (8 x 128 tokens, 16 steps, no
# oracle) and on the CLI's default workload with the oracle (2 x 16 tokens, 4 steps). Each line: the command's wall
# time and, for a concurrent run, its start-up timeline in seconds from the command's start (the reference process
# spawned, its imports, its preparation, the run sent by this side — its model built —, the reference's model ready,
# its run begun) read from the report's run info. Reports of the two modes compared less the volatile fields. Then
# P1 as the command's default runs it (`bench_trace.py --goals P1 --concurrent auto`; BENCH=0: not).
# Each line also has this process's onset timeline (the run info's `timeline`: when the onset began, its models
# built, each side's run done, the comparison finished) in seconds from the command's start, and what followed it.
# OTHER=<flag without dashes>: the mode compared with the default. EXTRA="...": more arguments for every run (e.g. an experiment's switch). Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
[ "${TESTS:-1}" = 0 ] || timeout 300 python3 -m pytest -m gpu tests/probes/test_onset_concurrent.py -q \
    -p no:cacheprovider -rf --tb=short 2>&1 | tee $OUT/gpu_tests.log | tail -3
run() {  # name, then the onset's arguments
    local name=$1; shift
    local t0 t1
    t0=$(awk '{print $1}' /proc/uptime)
    timeout 200 python3 -m ulptrace onset --device cuda --candidate kernels:fused --quiet --json /tmp/$name.json \
        ${EXTRA:-} "$@" > /dev/null 2> /tmp/$name.err
    local rc=$?
    t1=$(awk '{print $1}' /proc/uptime)
    python3 - "$name" "$t0" "$t1" "$rc" <<'PY' 2>&1 | tee -a $OUT/round25.log
import json, sys, time
name, t0, t1, rc = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
err = open(f"/tmp/{name}.err").read()
line = f"{name}: {t1 - t0:.1f} s, exit {rc}, {err.count('Traceback')} tracebacks"
try:
    run = json.load(open(f"/tmp/{name}.json"))["run"]
except Exception as exc:  # noqa: BLE001
    print(line, "| no report:", exc); sys.exit()
# /proc/uptime and time.perf_counter() (CLOCK_MONOTONIC) agree to a few ms on this kernel: checked here
now = time.perf_counter(); up = float(open("/proc/uptime").read().split()[0])
skew = now - up
proc = run.get("reference_process")
if proc:
    s = proc["start_up"]
    at = {k.removesuffix("_at"): round(v - skew - t0, 1) for k, v in s.items() if k.endswith("_at") and v}
    at["built"] = round(proc["built_at"] - skew - t0, 1)
    line += f" | from start: {at} | run_s {proc['seconds']['run_s']:.2f} waited {proc['seconds'].get('candidate_waited_s', 0):.2f}"
line_ = run.get("timeline")
if line_:  # this process's onset: began (after its imports), models built, each side's run, comparison finished
    begun = line_["started_at"] - skew - t0
    marks = {k.removesuffix("_s"): round(begun + v, 1) for k, v in line_.items() if k.endswith("_s")}
    line += f" | onset began {begun:.1f}, then {marks}, exit after {t1 - t0 - begun - line_['finished_s']:.1f} s"
line += f" | switched {bool(run.get('switched_to_concurrent'))}"
print(line)
PY
}
equal() {
    python3 - "$1" "$2" <<'PY' 2>&1 | tee -a $OUT/round25.log
import json, sys
sys.path.insert(0, "bench")
from bench_trace import _clean
a, b = (json.load(open(f"/tmp/{n}.json")) for n in sys.argv[1:])
print(f"{sys.argv[1]} vs {sys.argv[2]}: reports equal:", _clean(a) == _clean(b), "| sites:", len(a["sites"]))
PY
}
P1="--model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16 --no-oracle"
CLI="--model qwen3.5-0.8b"
OTHER=${OTHER:-no-concurrent}
for i in $(seq ${ROUNDS:-2}); do  # CLI_ROUNDS: more rounds of the CLI's workload alone after these
    run p1_default_$i $P1
    run p1_${OTHER}_$i $P1 --$OTHER
    run cli_default_$i $CLI
    run cli_${OTHER}_$i $CLI --$OTHER
done
for i in $(seq $(( ${ROUNDS:-2} + 1 )) ${CLI_ROUNDS:-0}); do
    run cli_default_$i $CLI
    run cli_${OTHER}_$i $CLI --$OTHER
done
equal p1_default_1 p1_${OTHER}_1
equal cli_default_1 cli_${OTHER}_1
[ "${BENCH:-1}" = 0 ] || timeout 240 python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 \
    --prompt-len 128 --new-tokens 16 --goals P1 --concurrent auto --json $OUT/p1_default.json 2>&1 \
    | grep -v "^\[" | tail -12 | tee -a $OUT/round25.log
