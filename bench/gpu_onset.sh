#!/usr/bin/env bash
# GPU run of ulptrace's diagnostics on the real Qwen3.5-0.8B shape (seeded random weights):
# `ulptrace onset` for both kernel modes and `trace_norm_rounding` (fused), logs under $OUT.
# Usage on the device machine: OUT=/some/dir bash bench/gpu_onset.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  date -u; } > "$OUT/env.txt"
run="--model qwen3.5-0.8b --device cuda --prompts ${PROMPTS:-2} --prompt-len ${PROMPT_LEN:-32} --new-tokens ${NEW_TOKENS:-4}"
for mode in faithful fused; do
  start=$SECONDS
  python3 -m ulptrace onset $run --candidate "kernels:$mode" --json "$OUT/onset_$mode.json" \
      > "$OUT/onset_$mode.txt" 2>&1
  echo "kernels:$mode onset: rc=$? wall $((SECONDS - start)) s"; tail -n 4 "$OUT/onset_$mode.txt"
done
start=$SECONDS
python3 -m ulptrace.probes.norm_rounding $run --report-only --json "$OUT/tnr_fused.json" > "$OUT/tnr_fused.txt" 2>&1
echo "trace_norm_rounding: rc=$? wall $((SECONDS - start)) s"; tail -n 3 "$OUT/tnr_fused.txt"
