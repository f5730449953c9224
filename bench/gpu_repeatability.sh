#!/usr/bin/env bash
# One device call for the twenty-first round's open finding (reports of different modes differ at long prompts from
# decode step 4 on, starting at a full-attention output): does each side repeat its bits run after run at 8 x LEN
# (default 512)? bench/repeatability.py with torch's SDPA choice, each backend pinned, and CUDA_LAUNCH_BLOCKING=1;
# then the onset twice in one mode (ONSETS=0: not). Logs and JSON under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
W="--device cuda --model qwen3.5-0.8b --prompts 8 --prompt-len ${LEN:-512} --new-tokens 16"
for sdpa in default flash efficient math; do
    timeout 120 python3 bench/repeatability.py $W --sdpa $sdpa --json $OUT/untraced_$sdpa.json 2>&1 | grep -v "^\[" \
        | sed "s/^/$sdpa: /" | tee -a $OUT/repeatability.log
done
CUDA_LAUNCH_BLOCKING=1 timeout 150 python3 bench/repeatability.py $W --json $OUT/untraced_blocking.json 2>&1 \
    | grep -v "^\[" | sed "s/^/launch blocking: /" | tee -a $OUT/repeatability.log
if [ "${ONSETS:-2}" != 0 ]; then
    timeout 200 python3 bench/repeatability.py $W --onsets ${ONSETS:-2} --json $OUT/onsets.json 2>&1 | grep -v "^\[" \
        | sed "s/^/onsets: /" | tee -a $OUT/repeatability.log
fi
