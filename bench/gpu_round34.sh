#!/usr/bin/env bash
# Thirty-fourth round, one device call: where this process's host waits for the device during a concurrent onset, and
# whether the two sides slow each other on this host. STAGES picks and orders (default "p1syncs sidesyncs concurrent");
# logs under $OUT:
#   p1syncs: bench_trace.py --goals P1 --concurrent auto --syncs — P1 as the command's default runs it (timed), then one
#            more warm onset with this process's host synchronisations counted by where they were asked;
#   sidesyncs: bench_side_parts.py --syncs — each side alone (untraced, hooks only, records dropped, kept), and the
#            synchronisations of each side untraced and kept;
#   concurrent: bench_concurrent.py — each side untraced and traced, both at once and one at a time;
#   cost: bench_compare_cost.py — the candidate's streaming comparison alone, fed recorded records (whole, its Python
#            alone, without pair reuse), with a cProfile of one pass;
#   p3big / p3bigbase: the oracle onset on P1's work (8 x 128 tokens, 16 steps: ~9,300 pairs, the range where the
#            known-pairs table was quadratic) with this tree / with .base/pkg32's package (c2730f0, before the fix;
#            carried), reports under $OUT/reports_<stage> for report_diff.py;
#   p1: P1 alone (as gpu_round33.sh's p1), for an A/B in one call;
#   mpson / mpsoff: start / stop a private CUDA MPS daemon (its pipe and log folders under /tmp/mps): the stages
#            after mpson run their CUDA processes as MPS clients — one GPU context for all of them, so kernels of the
#            two sides are not time-sliced between two contexts.
set -uo pipefail
. "$(dirname "$0")/gpu_setup.sh"
cd bench
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16"
for stage in ${STAGES:-p1syncs sidesyncs concurrent}; do
    echo "== $stage $(date +%T)"
    case $stage in
    p1syncs) timeout 260 python3 bench_trace.py $W --goals P1 --concurrent auto --syncs --json $OUT/p1syncs${TAG:-}.json 2>&1 \
        | grep "^P" | tee $OUT/p1syncs${TAG:-}.log | cut -c1-700 ;;
    p1) timeout 220 python3 bench_trace.py $W --goals P1 --concurrent auto --json $OUT/p1${TAG:-}_$(date +%H%M%S).json 2>&1 \
        | grep "^P1 onset" | tee -a $OUT/p1${TAG:-}.log | cut -c1-400 ;;
    sidesyncs) timeout 200 python3 bench_side_parts.py $W --repeats ${REPEATS:-2} --syncs --json $OUT/side.json 2>&1 \
        | grep -v Warn | tee $OUT/side.log | tail -60 ;;
    concurrent) timeout 170 python3 bench_concurrent.py $W --repeats ${REPEATS:-3} --json $OUT/concurrent${TAG:-}.json 2>&1 \
        | grep -v Warn | tee $OUT/concurrent${TAG:-}.log | tail -12 ;;
    cost) timeout 300 python3 bench_compare_cost.py $W --repeats ${REPEATS:-5} --json $OUT/cost${TAG:-}_$(date +%H%M%S).json \
        2>&1 | grep --line-buffered -v "Warn\|falling" | tee -a $OUT/cost${TAG:-}.log ;;
    p3big|p3bigbase) if [ $stage = p3bigbase ]; then dir=../.base/pkg32/bench; pp=$PWD/../.base/pkg32; else dir=.; pp=; fi
        (cd $dir && PYTHONPATH=$pp timeout 400 python3 bench_trace.py $W --goals P3 --oracle-prompts 8 --oracle-prompt-len 128 \
            --oracle-new-tokens 16 --warm-repeats 2 --reports $OUT/reports_$stage --json $OUT/$stage.json 2>&1 \
            | grep "^P3" | tee $OUT/$stage.log | cut -c1-300) ;;
    mpson) which nvidia-cuda-mps-control; mkdir -p /tmp/mps/pipe /tmp/mps/log
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log; TAG=_mps
        nvidia-cuda-mps-control -d && echo "mps daemon started: $?" | tee -a $OUT/mps.log
        python3 -c "import torch; torch.ones(1, device='cuda'); print('mps client ok')" 2>&1 | tail -1 | tee -a $OUT/mps.log
        nvidia-smi -q | grep -i -A2 "compute mode" | head -3 ;;
    mpsoff) echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; TAG=
        tail -5 /tmp/mps/log/control.log 2>/dev/null | tee -a $OUT/mps.log ;;
    esac
done
