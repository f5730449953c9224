#!/usr/bin/env bash
# Issue 12's GPU runs in one device call, as concurrent processes on the one GPU: locating a divergent row is
# bound by the oracle's Python and kernel launches (one CPU core), not by the GPU, so the default 24-check matrix
# is run as its (seed, path) parts side by side — every divergent row located — and batch invariance at
# 1/2/4/8 beside them; then the parts are merged into the whole grid's report (`ulptrace matrix-merge`).
# Times of the parts are wall times under that sharing (the matrix's own overhead against bare generation is
# measured alone: bench/bench_matrix.py, RESULTS.md).
#   on the device:  OUT=$OUT bash bench/gpu_generation_parts.sh        (PART_TIMEOUT=470 s per process)
#   FLA=1 (carry .whl) also traces flash-linear-attention against HF beside them (issue 10).
#   RESUME_DIR=DIR: the $OUT of an earlier call (in the working tree): its parts are resumed (`ulptrace matrix
#   --resume`: checks done are kept, the rest run, another grid refused); BI_BATCHES: the batch-invariance batches
#   (default 1 2 4 8). A part that writes no report is named (MISSING PART) and the script exits 1.
set -uo pipefail
: "${OUT:?set OUT}"
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
PART_TIMEOUT=${PART_TIMEOUT:-470}
SEEDS=${SEEDS:-0 1}
PATHS=${PATHS:-kernels:faithful kernels:fused}
#   (a CPU smoke run: SKIP_INSTALL=1 DEVICE=cpu MODES="eager static" MODEL=tiny-qwen3.5 PROMPT_LEN=16 NEW_TOKENS=4)
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
  python3 -c "from ulptrace.kernels import _build; _build.extension(); print('kernels built')" 2>&1 | tail -1
fi
common=(SKIP_INSTALL=1 MATRIX_TIMEOUT="$PART_TIMEOUT" LOCATE_SECONDS=100000 BENCH_TIMEOUT=1)
pids=()
names=()
part() {  # part NAME ENV...: gpu_generation.sh with ENV, its output under $OUT/NAME
  local name=$1 extra=""; shift
  [ "${PHASE:-matrix}" = matrix ] && names+=("$name")
  mkdir -p "$OUT/$name"
  rm -f "$OUT/$name/matrix.json"  # a stale report must not stand in for this run's
  local earlier="${RESUME_DIR:-/nonexistent}/$name/matrix.json"
  if [ "${PHASE:-matrix}" = matrix ] && [ -f "$earlier" ]; then  # a part of an earlier call: resumed (its checks
    extra="--resume $earlier"                                       # kept, the grid checked; nothing runs if complete)
  fi
  env OUT="$OUT/$name" MATRIX_EXTRA="$extra" "$@" bash bench/gpu_generation.sh "${PHASE:-matrix}" > "$OUT/$name/run.log" 2>&1 &
  pids+=($!)
}
part hf "${common[@]}" PATHS=hf SEEDS="$SEEDS"
for seed in $SEEDS; do
  for path in $PATHS; do
    part "s${seed}_${path//:/_}" "${common[@]}" PATHS="$path" SEEDS="$seed"
  done
done
if [ -n "${FLA:-}" ]; then  # issue 10: flash-linear-attention traced against HF (carry .whl)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .whl/flash_linear_attention-*.whl \
      .whl/fla_core-*.whl .whl/einops-*.whl > "$OUT/fla_install.log" 2>&1
  mkdir -p "$OUT/fla"
  ULPTRACE_FLA_DIR=/tmp/fla timeout "$PART_TIMEOUT" python3 -m ulptrace onset --model qwen3.5-0.8b --device cuda \
      --prompts 2 --prompt-len 32 --new-tokens 4 --candidate hf:fla --sites 'layers.*.linear_attn.*' \
      --check-reference --json "$OUT/fla/fla_gdn.json" > "$OUT/fla/fla_gdn.txt" 2>&1 &
  pids+=($!)
fi
PHASE=batch part batch SKIP_INSTALL=1 BATCHES="${BI_BATCHES:-1 2 4 8}" BI_TIMEOUT="$PART_TIMEOUT" BI_LOCATE_SECONDS=100000
for pid in "${pids[@]}"; do wait "$pid"; done
grep -h "rc=" "$OUT"/*/phases.txt
missing=0
for name in "${names[@]}"; do  # a part that wrote no report would silently shrink the merged grid
  [ -s "$OUT/$name/matrix.json" ] || { echo "MISSING PART: $name wrote no matrix.json (see $OUT/$name/run.log)"; missing=1; }
done
parts=$(ls "$OUT"/*/matrix.json)
python3 -m ulptrace matrix-merge $parts --json "$OUT/matrix.json" --markdown "$OUT/matrix.md" \
    --plot "$OUT/matrix.png" > "$OUT/merge.log" 2>&1
tail -n 40 "$OUT/merge.log"
tail -n 25 "$OUT/batch/batch_invariance.log"
[ -n "${FLA:-}" ] && tail -n 14 "$OUT/fla/fla_gdn.txt"
exit "$missing"
