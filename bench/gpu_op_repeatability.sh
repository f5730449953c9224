#!/usr/bin/env bash
# One device call for the twenty-second round: which kernel does not repeat (bench/op_repeatability.py, every aten
# op hashed) — the reference at 8 x LEN (default 512) REPEATS+1 times, the candidate fewer, 8 x 128 as a control;
# then the untraced logits 6 times without the dispatch mode (how often, without the hashing's pacing).
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
W="--device cuda --model qwen3.5-0.8b --prompts 8 --new-tokens 16"
run() { name=$1; shift; timeout ${LIMIT:-150} python3 "$@" --json $OUT/$name.json 2>&1 | grep -v "^\[" \
    | sed "s/^/$name: /" | tee -a $OUT/op_repeatability.log; }
run ref512 bench/op_repeatability.py $W --prompt-len ${LEN:-512} --repeats ${REPEATS:-6}
run cand512 bench/op_repeatability.py $W --prompt-len ${LEN:-512} --side candidate --repeats 3
run ref128 bench/op_repeatability.py $W --prompt-len 128 --repeats 3
run plain512 bench/repeatability.py $W --prompt-len ${LEN:-512} --repeats 6
