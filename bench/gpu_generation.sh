#!/usr/bin/env bash
# Generation diagnostics (issue 12) on qwen3.5-0.8b (seeded random BF16 weights), one device call, everything
# under $OUT (reports, figures, one log per command, timings in phases.txt):
#   matrix   - `ulptrace matrix` for hf, kernels:faithful, kernels:fused against HF eager: seeds x batches x
#              (eager + graph attempts, each a fresh capture), 128 prompt + 16 new tokens, every divergent row
#              located; then bench/bench_matrix.py: the matrix's time against bare generation of the same checks
#   lockstep - `ulptrace lockstep` graph vs static eager, 15 decode steps, for hf and for kernels:fused
#   batch    - `ulptrace batch-invariance` of hf at batches 1 2 4 8
# Usage on the device machine:  OUT=/dir bash bench/gpu_generation.sh [PHASE ...]   (default: matrix batch lockstep)
# Sizes (environment): SEEDS="0 1" BATCHES="1 2 4 8" ATTEMPTS=2 PROMPT_LEN=128 NEW_TOKENS=16 PROMPTS=8
#   PATHS="hf kernels:faithful kernels:fused" LOCKSTEP_PATHS="hf kernels:fused" MODEL=qwen3.5-0.8b
# MATRIX_EXTRA: more `ulptrace matrix` options (e.g. --resume PARTIAL.json).
# Budgets (seconds, environment): LOCATE_SECONDS=90 (matrix: no row is located once locating has taken that
#   long; the rest keep their first divergent step and near-tie class), BI_LOCATE_SECONDS=25; each phase is also
#   stopped by a timeout (SIGINT; the matrix keeps its partial JSON report, checks done so far):
#   MATRIX_TIMEOUT=230 BENCH_TIMEOUT=100 BI_TIMEOUT=100 LOCKSTEP_TIMEOUT=45 (per lockstep path).
#   (a CPU smoke run of the script: DEVICE=cpu MODES="eager static" LOCKSTEP_MODE=static SKIP_INSTALL=1, tiny sizes)
# Time: `matrix batch` at most about 8 minutes with these budgets (setup ~1 min: install, kernel build); all three
# phases at most about 9.5 (an earlier H200 call measured lockstep at 27 s per path and batch invariance at
# batches 1 8, every row located, at 163 s). The lockstep phase is last since it was already measured.
# Every divergent row of the default matrix located: the H200 run of 2026-12-01 located 54 of 153 rows in 280 s (about
# 5.3 s a row), so the whole grid's locating does not fit one call. Run it in parts, one device call each, e.g.
#   SEEDS=0 PATHS=kernels:faithful MATRIX_TIMEOUT=520 LOCATE_SECONDS=450 BENCH_TIMEOUT=1 bash bench/gpu_generation.sh matrix
# for each of the four (seed, path) parts plus `PATHS=hf` once (no divergent rows), keep each $OUT/matrix.json, then
#   ulptrace matrix-merge part*.json --json matrix.json --markdown matrix.md --plot matrix.png
# (the merged report is the whole grid's: summary recounted from the checks; bench_matrix.py can time any part).
set -uo pipefail
: "${OUT:?set OUT to the output directory}"
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
MODEL=${MODEL:-qwen3.5-0.8b}
SEEDS=${SEEDS:-0 1}
BATCHES=${BATCHES:-1 2 4 8}
ATTEMPTS=${ATTEMPTS:-2}
PROMPT_LEN=${PROMPT_LEN:-128}
NEW_TOKENS=${NEW_TOKENS:-16}
PROMPTS=${PROMPTS:-8}
PATHS=${PATHS:-hf kernels:faithful kernels:fused}
LOCKSTEP_PATHS=${LOCKSTEP_PATHS:-hf kernels:fused}
DEVICE=${DEVICE:-cuda}
MODES=${MODES:-eager graph}
LOCKSTEP_MODE=${LOCKSTEP_MODE:-graph}
LOCATE_SECONDS=${LOCATE_SECONDS:-90}
BI_LOCATE_SECONDS=${BI_LOCATE_SECONDS:-25}
MATRIX_TIMEOUT=${MATRIX_TIMEOUT:-230}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-100}
LOCKSTEP_TIMEOUT=${LOCKSTEP_TIMEOUT:-45}
BI_TIMEOUT=${BI_TIMEOUT:-100}
PHASES=${*:-matrix batch lockstep}
mkdir -p "$OUT"
phase() {  # phase NAME SECONDS COMMAND...: run under a timeout (SIGINT), log to $OUT/NAME.log, record rc and time
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT/phases.txt"
  grep -v '^\[ulptrace\]' "$OUT/$name.log" | tail -n 25
  return 0
}

start_all=$SECONDS
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
    || { echo "install failed"; tail "$OUT/install.log"; exit 1; }
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null; date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "$DEVICE" != cpu ]; then  # build once, outside the timed matrix (the extension is cached in $TORCH_EXTENSIONS_DIR)
  phase kernels_build 300 python3 -c "from ulptrace.kernels import _build; _build.extension(); print('kernels built')"
fi

run="--model $MODEL --device $DEVICE --prompt-len $PROMPT_LEN --new-tokens $NEW_TOKENS"
for p in $PHASES; do
  case $p in
    matrix)
      # shellcheck disable=SC2086
      phase matrix "$MATRIX_TIMEOUT" python3 -m ulptrace matrix $run --candidate $PATHS --seeds $SEEDS \
          --batches $BATCHES --modes $MODES --graph-attempts "$ATTEMPTS" --locate-seconds "$LOCATE_SECONDS" \
          --json "$OUT/matrix.json" --markdown "$OUT/matrix.md" --plot "$OUT/matrix.png" ${MATRIX_EXTRA:-}
      if [ -s "$OUT/matrix.json" ]; then
        phase bench_matrix "$BENCH_TIMEOUT" python3 bench/bench_matrix.py --matrix-json "$OUT/matrix.json" --json "$OUT/bench_matrix.json"
      fi
      ;;
    lockstep)
      for path in $LOCKSTEP_PATHS; do
        tag=${path//:/_}
        # shellcheck disable=SC2086
        phase "lockstep_$tag" "$LOCKSTEP_TIMEOUT" python3 -m ulptrace lockstep $run --prompts "$PROMPTS" --reference "$path" \
            --candidate "$path" --reference-mode static --candidate-mode "$LOCKSTEP_MODE" \
            --json "$OUT/lockstep_$tag.json" --plot "$OUT/lockstep_$tag.png"
      done
      ;;
    batch)
      # shellcheck disable=SC2086
      phase batch_invariance "$BI_TIMEOUT" python3 -m ulptrace batch-invariance $run --path hf --batches $BATCHES \
          --prompts "$PROMPTS" --locate-seconds "$BI_LOCATE_SECONDS" --json "$OUT/batch_invariance.json" --markdown "$OUT/batch_invariance.md" \
          --plot "$OUT/batch_invariance.png"
      ;;
    *) echo "unknown phase $p (expected matrix, lockstep or batch)"; exit 2 ;;
  esac
done
echo "all phases: $((SECONDS - start_all)) s" | tee -a "$OUT/phases.txt"
