#!/usr/bin/env bash
# Thirty-third round, one device call: where the concurrent onset's time goes beyond each side's own tracing.
#   1. bench_concurrent.py: each side untraced and traced, both at once and one at a time (the other waiting);
#   2. bench_side_parts.py: each side alone, inside and outside the recorder's hooks;
#   3. bench_trace.py --goals P1 --concurrent auto: P1 as the command's default runs it, with each warm run's
#      message timeline (when the reference sent each step, when this side asked for its token and had it).
#   4. floor: the same with --compare-nothing (this side's comparison dropped): the wall if it cost nothing.
# Logs under $OUT; STAGES picks and orders some of "p1 floor side concurrent".
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" \
    | tee $OUT/env.log
git log -1 --format=%h 2>/dev/null | tee -a $OUT/env.log
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
cd bench
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16"
for stage in ${STAGES:-p1 floor side concurrent}; do
    echo "== $stage $(date +%T)"
    case $stage in
    concurrent) timeout 170 python3 bench_concurrent.py $W --repeats ${REPEATS:-4} --json $OUT/concurrent.json 2>&1 \
        | grep -v Warn | tee $OUT/concurrent.log | tail -12 ;;
    side) timeout 170 python3 bench_side_parts.py $W --repeats ${REPEATS:-3} --json $OUT/side.json 2>&1 \
        | grep -v Warn | tee $OUT/side.log | grep -E "untraced|keep|drop" ;;
    p1) timeout 220 python3 bench_trace.py $W --goals P1 --concurrent auto --json $OUT/p1.json 2>&1 \
        | grep "^P" | tee $OUT/p1.log | cut -c1-1500 ;;
    floor) timeout 220 python3 bench_trace.py $W --goals P1 --concurrent auto --compare-nothing --json $OUT/floor.json \
        2>&1 | grep "^P" | tee $OUT/floor.log | cut -c1-1500 ;;
    esac
done
