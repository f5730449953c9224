#!/usr/bin/env bash
# CPU findings of issue 13 (bench/FINDINGS.md), the counterpart of bench/gpu_findings.sh on the embedded tiny
# models: torch.compile (Inductor's C++ backend) with and without emulate_precision_casts, traced against HF,
# with the observation check. (Liger-Kernel and flash-linear-attention are Triton kernels: GPU only; their
# paths are covered on the CPU by tests with stand-in packages.) About 10 minutes per model on 2 loaded cores
# (Inductor compiles each graph in 30-50 s: two graphs traced, two untraced per run).
#
#   OUT=/tmp/findings bash bench/cpu_findings.sh [MODEL ...]   (default: tiny-qwen3.5 tiny-llama)
set -uo pipefail
: "${OUT:?set OUT}"
mkdir -p "$OUT"
models=("$@"); [ ${#models[@]} -eq 0 ] && models=(tiny-qwen3.5 tiny-llama)
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    > "$OUT/env.txt"; date -u >> "$OUT/env.txt"
for model in "${models[@]}"; do
  for path in compile compile:emulate; do
    name="${model}_${path/:/_}"
    start=$SECONDS
    python3 -m ulptrace onset --model "$model" --prompts 2 --prompt-len 16 --new-tokens 2 --candidate "$path" \
        --check-observation --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1
    echo "$name: rc=$? wall $((SECONDS - start)) s" | tee -a "$OUT/jobs.txt"
  done
done
python3 bench/findings_summary.py "$OUT"/*.json > "$OUT/summary.md"
cat "$OUT/summary.md"
