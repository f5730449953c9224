#!/usr/bin/env bash
# One device call for the command's default at a long prompt (issue 11, P5): the GPU tests of the reference's GPU
# share (spilled to host memory, said; the onset started again in a process of its own), then `ulptrace onset` on the
# 0.8B shape at 8 x 4,096 tokens, 16 steps, without the oracle, as a user runs it: by default (switches once the
# reference outgrows half the GPU), --concurrent from the start and --no-concurrent (kept here, the rest in host
# memory), each a fresh process (MODES: which), timed whole; reports compared less the run's volatile fields; then
# bench/spill_diff.py at 8 x 512 (DIFF=0: not). SDPA=<backend>: every run with --sdpa <backend>; TESTS=0: no GPU
# tests; REUSE="<mode> ...": reports of those modes already at /tmp/<mode>.json (an earlier call's), compared too.
# Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1 TIMEFORMAT=%R
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
[ "${TESTS:-1}" = 0 ] || timeout 150 python3 -m pytest -m gpu tests/probes/test_onset_memory.py tests/tracer/test_record.py -q -p no:cacheprovider \
    -rf --tb=short 2>&1 | tee $OUT/gpu_tests.log | tail -2
W="--model qwen3.5-0.8b --device cuda --candidate kernels:fused --no-oracle --prompts 8 --prompt-len ${LEN:-4096} --new-tokens 16 --sdpa ${SDPA:-default}"
for mode in ${MODES:-default concurrent no-concurrent}; do
    flag=$([ $mode = default ] || echo --$mode)
    s=$( { time timeout ${LIMIT_S:-150} python3 -m ulptrace onset $W $flag --json /tmp/$mode.json > /dev/null 2> /tmp/$mode.err; } 2>&1 )
    echo "$mode: $s s, exit ${PIPESTATUS[0]}, $(grep -c Traceback /tmp/$mode.err) tracebacks" | tee -a $OUT/switch.log
    grep "outgrew\|host memory" /tmp/$mode.err | tee -a $OUT/switch.log
    gzip -c /tmp/$mode.json > $OUT/$mode.json.gz
done
python3 - ${MODES:-default concurrent no-concurrent} ${REUSE:-} <<'PY' 2>&1 | tee -a $OUT/switch.log
import json, sys
sys.path.insert(0, "bench")
from bench_trace import _clean, differences
runs = {}
for mode in sys.argv[1:]:
    try:
        runs[mode] = json.load(open(f"/tmp/{mode}.json"))
    except Exception as exc:  # noqa: BLE001
        print(mode, "no report:", exc)
for mode, r in runs.items():
    run = r["run"]
    print(mode, "| sites", len(r["sites"]), "| switched", run.get("switched_to_concurrent"), "| spilled",
          run.get("reference_spilled"), "| reference process peak GiB",
          round(run["reference_process"]["peak_gpu_bytes"] / 2**30, 2) if "reference_process" in run else None)
base = runs.get("no-concurrent")
for mode in runs:
    if base and mode != "no-concurrent":
        diff = differences(_clean(runs[mode]), _clean(base))  # NaN compared as text: json.dumps of each leaf
        print(f"{mode} vs no-concurrent: reports equal: {not diff}" + "".join(f"\n  {d}" for d in diff))
PY
if [ "${DIFF:-1}" = 1 ]; then
    timeout 200 python3 bench/spill_diff.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 512 \
        --new-tokens 16 --room-mib 256 --sdpa ${SDPA:-default} 2>&1 | grep -v "^\[" | tee $OUT/spill_diff.log
fi
