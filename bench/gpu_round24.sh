#!/usr/bin/env bash
# One device call (twenty-fourth round): the GPU tests of the helper processes (the SDPA pin kept, torch settings,
# registered paths, the helpers' environment); the command at 8 x 4,096 tokens with --sdpa flash, --concurrent and
# --no-concurrent, reports compared (bench/gpu_switch.sh); bench/idle_helper.py --rounds (a kept reference process
# against none, alternating, with what the helpers and this process ran meanwhile); a py-spy profile of the
# sequential onset's timed runs (bench_p1_parts.py, `.whl/py-spy` carried: a static binary). Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
date -u | tee $OUT/date.txt
OUT=$OUT TESTS=${TESTS:-} ROUNDS=0 REPEATS=1 SKIP_IDLE=1 bash bench/gpu_idle.sh
[ "${SWITCH:-1}" = 0 ] || OUT=$OUT SDPA=flash TESTS=0 DIFF=0 MODES="concurrent no-concurrent" bash bench/gpu_switch.sh
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16"
(cd bench && timeout 200 python3 idle_helper.py $W --repeats 5 --rounds ${ROUNDS:-3} --json $OUT/idle_rounds.json 2>&1 \
    | grep -v "^\[" | tail -6 | tee $OUT/idle_rounds.log)
if [ "${SPY:-1}" = 1 ]; then
    timeout 150 .whl/py-spy record -r 200 --nonblocking -f raw -o $OUT/spy_p1.txt -- python3 bench/bench_p1_parts.py \
        --device cuda --model qwen3.5-0.8b --layers onset --repeats 3 2>&1 | grep -v "Warn\|^\[" | tail -4 | tee $OUT/spy_run.log
    python3 bench/spy_summary.py $OUT/spy_p1.txt --root timed --within full --top 70 > $OUT/spy_p1_summary.txt
    python3 bench/spy_summary.py $OUT/spy_p1.txt --root timed --within full --lines --top 40 >> $OUT/spy_p1_summary.txt
fi
