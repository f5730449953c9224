#!/usr/bin/env bash
# One device call: P1 --concurrent with the reference's parts of each size in PARTS (MiB; default "32 256 32"),
# one bench_trace.py process each, in that order, printing where both sides' time went and the P1 report's sha256.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
i=0
for mib in ${PARTS:-32 256 32}; do
    i=$((i + 1))
    echo "== parts of $mib MiB" | tee -a $OUT/parts.log
    timeout 150 python3 bench/bench_trace.py --device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len 128 \
        --new-tokens 16 --goals P1 --concurrent --warm-repeats ${REPEATS:-4} --part-mib $mib \
        --json $OUT/p1_${i}_$mib.json --reports /tmp/r_$i 2>&1 | grep "^P\|Error" | tee -a $OUT/parts.log
    sha256sum /tmp/r_$i/*.json | tee -a $OUT/parts.log
done
