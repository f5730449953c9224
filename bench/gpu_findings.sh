#!/usr/bin/env bash
# GPU findings of issue 13 (bench/FINDINGS.md): paths nobody here wrote, each traced against HF on the
# Qwen3.5-0.8B shape (seeded random weights) on one H200. One device call, about 7 minutes; JSON reports,
# logs and a markdown summary under $OUT.
#
# Wheels: carry them in .whl/ at the repository root (ignored by git: pass carry=[".whl"]). Download them on
# a machine with network access:
#   pip download --no-deps -d .whl liger-kernel==0.8.5 flash-linear-attention==0.6.0 fla-core==0.6.0 einops
#
# What runs (in parallel where the work is on different resources; every job has its own timeout):
#   compile          ulptrace onset --candidate compile          --check-observation (2 x 32 tokens, 2 steps)
#   compile:emulate  ulptrace onset --candidate compile:emulate  --check-observation (2 x 32 tokens, 2 steps)
#   liger            ulptrace onset --candidate liger            (Liger-Kernel 0.8.5 installed normally; 4 steps)
#   hf:fla (folder)  ULPTRACE_FLA_DIR=/tmp/fla ulptrace onset --candidate hf:fla  (FLA off the import path: HF keeps
#                    its torch scan; the reference runs hf:scan=torch; 4 steps)
#   hf:fla (bound)   PYTHONPATH=/tmp/fla ulptrace onset --candidate hf:fla  (FLA importable: HF binds it at import,
#                    the reference is forced back onto HF's torch scan; 4 steps)
# then bench/findings_summary.py over every report (summary.md), which FINDINGS.md's GPU section is filled from.
#
# Usage on the device machine: OUT=/some/dir bash bench/gpu_findings.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
: "${OUT:?set OUT}"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
python3 -m pip install -q --no-index --no-deps .whl/liger_kernel-*.whl >> "$OUT/install.log" 2>&1 \
    || echo "liger-kernel wheel not installed (see install.log)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .whl/flash_linear_attention-*.whl \
    .whl/fla_core-*.whl .whl/einops-*.whl >> "$OUT/install.log" 2>&1 || echo "FLA wheels not installed (see install.log)"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'triton', triton.__version__)"
  python3 -c "import importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))"
  ls /tmp/fla | grep -i dist-info
  date -u; } > "$OUT/env.txt" 2>&1
ulptrace paths > "$OUT/paths.txt" 2>&1
run="--model qwen3.5-0.8b --device cuda --prompts 2 --prompt-len 32"

job() {  # job NAME TIMEOUT ENV... -- ARGS...: one onset run, its log and JSON under $OUT
  local name=$1 limit=$2; shift 2
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local start=$SECONDS
  env "${envs[@]}" timeout "$limit" python3 -m ulptrace onset $run "$@" --json "$OUT/$name.json" \
      > "$OUT/$name.txt" 2>&1
  echo "$name: rc=$? wall $((SECONDS - start)) s" >> "$OUT/jobs.txt"
}

# Inductor compiles on the CPU (about 50 s a graph for this model): the two compile jobs start first and run
# beside the GPU-bound ones
job compile 400 TORCHINDUCTOR_COMPILE_THREADS=6 -- --candidate compile --new-tokens 2 --check-observation &
job compile_emulate 400 TORCHINDUCTOR_COMPILE_THREADS=6 -- --candidate compile:emulate --new-tokens 2 \
    --check-observation &
job liger 300 ULPTRACE_JOB=liger -- --candidate liger --new-tokens 4 &
job fla_folder 240 ULPTRACE_FLA_DIR=/tmp/fla -- --candidate hf:fla --new-tokens 4 --check-reference
job fla_bound 180 PYTHONPATH=/tmp/fla -- --candidate hf:fla --new-tokens 4
wait
cat "$OUT/jobs.txt"
for f in compile compile_emulate liger fla_folder fla_bound; do echo "== $f"; tail -n 6 "$OUT/$f.txt"; done
reports=$(ls "$OUT"/*.json 2>/dev/null)
[ -n "$reports" ] && python3 bench/findings_summary.py $reports > "$OUT/summary.md" 2> "$OUT/summary.err"
cat "$OUT/summary.md"
