#!/bin/bash
source /work/main/.venv/bin/activate
cd /tmp/audit31
for m in tiny-qwen3.5 tiny-llama; do
  for c in $(python -c "import cands;print(' '.join(n for n in dir(cands) if n[:1] in 'dv' and n[1:3].isdigit()))"); do
    if [ $m = tiny-llama ]; then case $c in d07*|d08*|d09*|d17*) continue;; esac; fi
    if [ $m = tiny-qwen3.5 ]; then case $c in v08*) continue;; esac; fi
    [ -n "$ONLY" ] && [[ $c != $ONLY* ]] && continue
    PYTHONPATH=/tmp/audit31 timeout 300 ulptrace onset --model $m --candidate cands:$c --prompts 2 --prompt-len 16 --new-tokens 3 --quiet --json out/$m.$c.json > out/$m.$c.txt 2>&1
    echo "$m $c rc=$?"
  done
done
