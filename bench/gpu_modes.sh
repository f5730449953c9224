#!/usr/bin/env bash
# One device call: P1 in both modes against one base (bench/modes_ab.py: sequential and --concurrent alternating in
# one process, each followed by an untraced run), with this tree and (BASE=dir: a package dir/ulptrace) an older one.
# Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16 --rounds ${ROUNDS:-5}"
for mode in after $([ -n "${BASE:-}" ] && echo before); do
    echo "== $mode" | tee -a $OUT/modes.log
    ( [ $mode = before ] && export PYTHONPATH=$BASE; cd bench && timeout ${LIMIT_S:-240} python3 modes_ab.py $W \
        --json $OUT/modes_$mode.json 2>&1 | grep -v "^\[" | tail -4 | tee -a $OUT/modes.log )
done
