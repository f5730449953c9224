#!/usr/bin/env bash
# Thirty-eighth round: where P5's memory goes at 8 x 4,096 (`--sdpa flash`), each side's bytes in flight bounded
# (ulptrace.concurrent.FLIGHT_BYTES) or not. STAGES picks and orders (default "base split"); each stage one bench_trace
# P5 run, its JSON to $OUT/p5_<stage>.json, its P5 line and each process's peak (GiB) to $OUT/p5.log:
#   base: the command's default (split) with the package in $BASE, a commit before the bound, its own bench_trace.py;
#         made here and carried (`carry: [".base/pkg37"]`): mkdir -p .base/pkg37 && git archive a05af1c tracer probes
#         kernels bench | tar -x -C .base/pkg37 && cd .base/pkg37 && rm -rf bench/results bench/audit && mv tracer
#         ulptrace && mv probes kernels ulptrace/   (then BASE=$PWD/.base/pkg37 on the device);
#   split: the command's default on a large CUDA model with this tree (each side in a process of its own);
#   flight<N>: the same, each side's bytes in flight bounded by N MiB (--flight-mib);
#   on: the candidate here (`--concurrent`), the reference in a process of its own;
#   p1 / p1base: P1 at 8 x 128 (the default, 2 warm repeats) with this tree / the package in $BASE.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
ROOT=$(pwd)
for stage in ${STAGES:-base split}; do
    echo "== $stage $(date +%T)"
    dir=$ROOT/bench; py=""; extra="--concurrent auto"
    case $stage in
    base|p1base) dir=$BASE/bench; py=$BASE ;;
    flight*) extra="--concurrent auto --flight-mib ${stage#flight}" ;;
    on) extra="--concurrent on" ;;
    esac
    if [[ $stage == p1* ]]; then
        (cd $dir && PYTHONPATH=$py timeout 170 python3 bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 \
            --prompt-len 128 --new-tokens 16 --goals P1 --concurrent auto --warm-repeats 2 --json $OUT/$stage.json \
            2>&1 | grep "^P1 onset\|Error" | tee -a $OUT/p1.log | cut -c1-330)
        continue
    fi
    (cd $dir && PYTHONPATH=$py timeout 170 python3 bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 \
        --prompt-len 4096 --new-tokens 16 --sdpa flash --goals P5 $extra --json $OUT/p5_$stage.json 2>&1 \
        | grep "^P5\|Error" | tee -a $OUT/p5.log | cut -c1-400)
    python3 - "$OUT/p5_$stage.json" <<'PY' 2>&1 | tee -a $OUT/p5.log
import json, sys
p = json.load(open(sys.argv[1]))["P5"]
gib = lambda k: (p.get(k) or 0) / 2**30
here = gib("onset_peak_bytes") - gib("reference_process_peak_bytes") - gib("candidate_process_peak_bytes")
flight = {k: v and round(v / 2**30, 2) for k, v in (p.get("most_in_flight_bytes") or {}).items()}
print(f"peaks GiB: this process {here:.2f}, reference process {gib('reference_process_peak_bytes'):.2f}, candidate "
      f"process {gib('candidate_process_peak_bytes'):.2f}; untraced side by side "
      f"{gib('untraced_side_by_side_peak_bytes'):.2f}, one after the other {gib('untraced_peak_bytes'):.2f}; "
      f"ratio side by side {p.get('ratio_side_by_side', 0):.3f}; most in flight GiB {flight}")
PY
done
