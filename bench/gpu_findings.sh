#!/usr/bin/env bash
# GPU findings of issue 13 (bench/FINDINGS.md): paths nobody here wrote, each traced against HF on the
# Qwen3.5-0.8B shape (seeded random weights) on one H200: `ulptrace onset --device cuda --prompts 2
# --prompt-len 32` per job, its JSON report and log, and a markdown summary (bench/findings_summary.py).
#
# Jobs (JOBS selects them, default all five; every job has its own timeout):
#   compile          ulptrace onset --candidate compile          --check-observation (2 steps)
#   compile_emulate  ulptrace onset --candidate compile:emulate  --check-observation (2 steps)
#   liger            ulptrace onset --candidate liger            (Liger-Kernel 0.8.5 installed normally; 4 steps)
#   fla_folder       ULPTRACE_FLA_DIR=/tmp/fla ulptrace onset --candidate hf:fla --check-reference  (FLA off the
#                    import path: HF keeps its torch scan; the reference runs hf:scan=torch; 4 steps)
#   fla_bound        PYTHONPATH=/tmp/fla ulptrace onset --candidate hf:fla  (FLA importable: HF binds it at import,
#                    the reference is forced back onto HF's torch scan; 4 steps)
# liger, fla_folder and fla_bound run on qwen3.5-0.8b (24 layers). The compile jobs run on COMPILE_MODEL (default
# qwen3.5-0.8b; an embedded name or a checkpoint directory), or, with COMPILE_LAYERS=N, on a checkpoint directory of
# the embedded COMPILE_MODEL cut to N layers (same widths, heads and vocabulary, its first N layer types; seeded
# weights), written first by bench/make_checkpoint.py to /tmp/ckpt/. Inductor compiling all 24 layers did not finish
# within 400 s (the first run, 2026-12-01): run the compile jobs with COMPILE_LAYERS=4 (three GatedDeltaNet layers
# and one full-attention layer). They run one after the other, each with TORCHINDUCTOR_COMPILE_THREADS=
# COMPILE_THREADS (default 14) and a timeout of COMPILE_TIMEOUT s (default 240); the GPU-bound jobs run beside them.
#
# Output: everything goes to $OUT, then is packed into $OUT/findings.tgz (the device returns only a few files):
# only findings.tgz, summary.md and jobs.txt stay loose. Unpack with: tar -xzf findings.tgz
#
# Wheels (liger and the fla jobs only): carry them in .whl/ at the repository root (ignored by git: pass
# carry=[".whl"]). Download them on a machine with network access:
#   pip download --no-deps -d .whl liger-kernel==0.8.5 flash-linear-attention==0.6.0 fla-core==0.6.0 einops
#
# Usage on the device machine:
#   OUT=/some/dir bash bench/gpu_findings.sh                                          (all five jobs)
#   JOBS="compile compile_emulate" COMPILE_LAYERS=4 OUT=/some/dir bash bench/gpu_findings.sh
#       (compile jobs only: setup about 1 min, then at most 2 x COMPILE_TIMEOUT; under 10 min with the defaults)
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
: "${OUT:?set OUT}"
ALL_JOBS="compile compile_emulate liger fla_folder fla_bound"
JOBS=${JOBS:-$ALL_JOBS}
COMPILE_MODEL=${COMPILE_MODEL:-qwen3.5-0.8b}
COMPILE_LAYERS=${COMPILE_LAYERS:-}
COMPILE_THREADS=${COMPILE_THREADS:-14}
COMPILE_TIMEOUT=${COMPILE_TIMEOUT:-240}
for j in $JOBS; do
  case " $ALL_JOBS " in *" $j "*) ;; *) echo "unknown job '$j' in JOBS (known: $ALL_JOBS)" >&2; exit 2 ;; esac
done
wants() { case " $JOBS " in *" $1 "*) return 0 ;; esac; return 1; }
mkdir -p "$OUT"
: > "$OUT/jobs.txt"
echo "JOBS=\"$JOBS\" COMPILE_MODEL=$COMPILE_MODEL COMPILE_LAYERS=${COMPILE_LAYERS:-all} COMPILE_THREADS=$COMPILE_THREADS \
COMPILE_TIMEOUT=$COMPILE_TIMEOUT" >> "$OUT/jobs.txt"

python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
if wants liger; then
  python3 -m pip install -q --no-index --no-deps .whl/liger_kernel-*.whl >> "$OUT/install.log" 2>&1 \
      || echo "liger-kernel wheel not installed (see install.log)" | tee -a "$OUT/jobs.txt"
fi
if wants fla_folder || wants fla_bound; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .whl/flash_linear_attention-*.whl \
      .whl/fla_core-*.whl .whl/einops-*.whl >> "$OUT/install.log" 2>&1 \
      || echo "FLA wheels not installed (see install.log)" | tee -a "$OUT/jobs.txt"
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)"
  if wants liger; then python3 -c "import importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))"; fi
  for d in /tmp/fla/*.dist-info; do [ -e "$d" ] && basename "$d"; done
  nproc
  date -u; } > "$OUT/env.txt" 2>&1
ulptrace paths > "$OUT/paths.txt" 2>&1
run="--device cuda --prompts 2 --prompt-len 32"

job() {  # job NAME TIMEOUT MODEL [ENV...] -- ARGS...: one onset run, its log and JSON under $OUT
  local name=$1 limit=$2 model=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local start=$SECONDS
  # shellcheck disable=SC2086  # $run is a list of arguments
  env ${envs[@]+"${envs[@]}"} timeout "$limit" python3 -m ulptrace onset --model "$model" $run "$@" \
      --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
  echo "$name: rc=$? wall $((SECONDS - start)) s (timeout $limit s, model $model)" >> "$OUT/jobs.txt"
}

compile_jobs() {  # one after the other: each gets the CPU cores for Inductor's compile workers
  local model=$COMPILE_MODEL start=$SECONDS
  if [ -n "$COMPILE_LAYERS" ]; then
    model=/tmp/ckpt/$COMPILE_MODEL-${COMPILE_LAYERS}L
    python3 bench/make_checkpoint.py --model "$COMPILE_MODEL" --layers "$COMPILE_LAYERS" --out "$model" \
        > "$OUT/checkpoint.json" 2> "$OUT/checkpoint.log"
    local rc=$?
    echo "checkpoint $model: rc=$rc wall $((SECONDS - start)) s" >> "$OUT/jobs.txt"
    [ $rc -eq 0 ] || { echo "make_checkpoint.py failed: compile jobs not run" >> "$OUT/jobs.txt"; return; }
  fi
  if wants compile; then
    job compile "$COMPILE_TIMEOUT" "$model" TORCHINDUCTOR_COMPILE_THREADS="$COMPILE_THREADS" -- \
        --candidate compile --new-tokens 2 --check-observation
  fi
  if wants compile_emulate; then
    job compile_emulate "$COMPILE_TIMEOUT" "$model" TORCHINDUCTOR_COMPILE_THREADS="$COMPILE_THREADS" -- \
        --candidate compile:emulate --new-tokens 2 --check-observation
  fi
}

# Inductor compiles on the CPU: the compile jobs start first and run beside the GPU-bound ones
if wants compile || wants compile_emulate; then compile_jobs & fi
if wants liger; then job liger 300 qwen3.5-0.8b -- --candidate liger --new-tokens 4 & fi
if wants fla_folder; then
  job fla_folder 240 qwen3.5-0.8b ULPTRACE_FLA_DIR=/tmp/fla -- --candidate hf:fla --new-tokens 4 --check-reference
fi
if wants fla_bound; then job fla_bound 180 qwen3.5-0.8b PYTHONPATH=/tmp/fla -- --candidate hf:fla --new-tokens 4; fi
wait
cat "$OUT/jobs.txt"
for f in $JOBS; do echo "== $f"; tail -n 6 "$OUT/$f.txt" 2>/dev/null; done
reports=()
for f in $JOBS; do [ -s "$OUT/$f.json" ] && reports+=("$OUT/$f.json"); done
if [ ${#reports[@]} -gt 0 ]; then
  python3 bench/findings_summary.py "${reports[@]}" > "$OUT/summary.md" 2> "$OUT/summary.err"
else
  echo "no JSON report came out (see jobs.txt and the logs in findings.tgz)" > "$OUT/summary.md"
fi
cat "$OUT/summary.md"

# Pack: one archive of everything under $OUT; summary.md and jobs.txt also stay loose.
tgz=/tmp/findings.$$.tgz
if tar -czf "$tgz" -C "$OUT" .; then
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.md ! -name jobs.txt -exec rm -rf {} +
  mv "$tgz" "$OUT/findings.tgz"
  echo "packed: $OUT/findings.tgz ($(du -h "$OUT/findings.tgz" | cut -f1))"
else
  echo "tar failed: the loose files under $OUT are kept"
fi
