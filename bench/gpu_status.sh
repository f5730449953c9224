#!/usr/bin/env bash
# One device call for issue 11's whole table at the current tree: bench_trace.py's goals in the command's default mode
# (sequential: P1, P2, P3, P5 at 8 x 128; reports' sha256), then with --concurrent (P1, P3: the reference in a
# process of its own, kept between the warm runs), then the command default's P5 at 8 x 4,096
# (--concurrent auto: it switches to a process of its own at the prompt's first layers; LONG=0: skipped). Logs and
# JSON under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16 --warm-repeats ${REPEATS:-3}"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
timeout 200 python3 bench/bench_trace.py $W --goals P1 P2 P3 P5 --stats-mib 256 --reports /tmp/rs --json $OUT/sequential.json 2>&1 \
    | grep "^P\|Error" | tee $OUT/sequential.log
sha256sum /tmp/rs/*.json | tee -a $OUT/sequential.log
timeout 200 python3 bench/bench_trace.py $W --goals P1 P3 --concurrent --reports /tmp/rc --json $OUT/concurrent.json \
    2>&1 | grep "^P\|Error" | tee $OUT/concurrent.log
sha256sum /tmp/rc/*.json | tee -a $OUT/concurrent.log
if [ "${LONG:-1}" = 1 ]; then
    timeout ${LONG_S:-150} python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 4096 \
        --new-tokens 16 --goals P5 --warm-repeats 1 --concurrent auto --json $OUT/p5_4096_default.json 2>&1 \
        | grep "^P\|Error" | tee $OUT/p5_4096_default.log
fi
