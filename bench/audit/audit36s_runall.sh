#!/bin/bash
# Audit 36s (2026-12-05i): ulptrace.sides — candidates that install a defect by assigning a shared name.
# Usage: bash bench/audit/audit36s_runall.sh OUT   -> OUT/{L,M,O}_NAME_FAMILY.txt, OUT/rc.txt
here=$(cd "$(dirname "$0")" && pwd)
out=$1; mkdir -p "$out"
export PYTHONPATH=$here
C=audit36s_candidates
run() { local name=$1; shift; local t0=$(date +%s)
  timeout 300 "$@" 2>&1 | grep -v '^\[transformers\]' > "$out/$name.txt"; local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc s=$(( $(date +%s) - t0 )) :: $*" >> "$out/rc.txt"; }
three() { local cand=$1 fam=$2 model=$3
  run L_${cand}_$fam ulptrace lockstep --quiet $model --candidate $C:$cand
  run M_${cand}_$fam ulptrace matrix --quiet $model --seeds 0 --batches 1 2 --prompt-len 32 --candidate $C:$cand
  run O_${cand}_$fam ulptrace onset --quiet $model --candidate $C:$cand --prompts 2 --prompt-len 16 --new-tokens 3; }
for cand in a_norm_forward_scaled a_norm_helper_decode b_silu_decode b_sdpa_decode c_apply_rope_decode \
            c_rotate_half_wrong d_register_sdpa_decode d_setitem_sdpa_decode e_tensor_pow_decode e_torch_rsqrt_decode \
            f_final_norm_class_swap g_cache_layer_update_decode g_pack_gqa_decode; do
  three $cand qwen ""
  three $cand llama "--model tiny-llama"
done
for cand in c_qwen_chunk_gdn_scaled c_qwen_l2norm_decode; do three $cand qwen ""; done
# as the reference, hf as the candidate
for cand in a_norm_helper_decode d_register_sdpa_decode c_qwen_l2norm_decode; do
  run RL_${cand}_qwen ulptrace lockstep --quiet --reference $C:$cand --candidate hf
  run RO_${cand}_qwen ulptrace onset --quiet --reference $C:$cand --candidate hf --prompts 2 --prompt-len 16 --new-tokens 3
done
for cand in b_silu_decode d_setitem_sdpa_decode; do
  run RL_${cand}_llama ulptrace lockstep --quiet --model tiny-llama --reference $C:$cand --candidate hf
  run RO_${cand}_llama ulptrace onset --quiet --model tiny-llama --reference $C:$cand --candidate hf --prompts 2 --prompt-len 16 --new-tokens 3
done
