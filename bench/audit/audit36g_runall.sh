#!/bin/bash
# Audit 36g (2026-12-05h): ulptrace's generation diagnostics (batch-invariance, matrix, lockstep) and
# trace_norm_rounding on the held-out candidates of bench/audit/audit36g_candidates.py, plus bad inputs.
# Usage: bash bench/audit/audit36g_runall.sh OUT [GROUP...]   (groups: A B C D E F; default all; F = follow-ups)
# Each run: OUT/NAME.txt (stdout+stderr), one line in OUT/rc.txt (name, exit status, seconds, command).
here=$(cd "$(dirname "$0")" && pwd)
out=$1; shift; mkdir -p "$out"
groups=${*:-A B C D E F}
export PYTHONPATH=$here
C=audit36g_candidates
run() {  # name command...
    local name=$1; shift
    local t0=$(date +%s)
    timeout 600 "$@" > "$out/$name.txt" 2>&1
    local rc=$?
    echo "$name rc=$rc s=$(( $(date +%s) - t0 )) :: $*" >> "$out/rc.txt"
}
Q="--quiet"
for g in $groups; do case $g in
A)  # batch invariance
    run A01_bi_hf                ulptrace batch-invariance $Q
    run A02_bi_v01               ulptrace batch-invariance $Q --path $C:v01_mlp_bitwise_copy
    run A03_bi_v02_16tok         ulptrace batch-invariance $Q --path $C:v02_linear_splitk_when_batched --new-tokens 16
    run A03b_bi_v02_llama_16tok  ulptrace batch-invariance $Q --model tiny-llama --path $C:v02_linear_splitk_when_batched --new-tokens 16
    run A04_bi_d01               ulptrace batch-invariance $Q --path $C:d01_final_norm_eps_batch_max
    run A05_bi_d01_llama         ulptrace batch-invariance $Q --model tiny-llama --path $C:d01_final_norm_eps_batch_max
    run A06_bi_d02_b124          ulptrace batch-invariance $Q --path $C:d02_attn_batch4_drops_newest_key --batches 1 2 4 --new-tokens 8
    run A07_bi_d03_raises        ulptrace batch-invariance $Q --path $C:d03_raises_when_batched
    run A08_bi_d07_noise         ulptrace batch-invariance $Q --path $C:d07_logits_nondeterministic --new-tokens 8
    run A09_bi_d11_leak_16tok    ulptrace batch-invariance $Q --path $C:d11_final_norm_batch_mean_leak --new-tokens 16
    run A10_bi_d06_doubled       ulptrace batch-invariance $Q --path $C:d06_logits_doubled
    run A11_bi_d05_static        ulptrace batch-invariance $Q --path $C:d05_attn_ignores_mask --mode static
    ;;
B)  # token-parity matrix (seed 0, 32-token prompts, 16 new tokens, batches 1 2 4 8, eager + static)
    M="ulptrace matrix $Q --seeds 0 --prompt-len 32"
    run B01_mx_valid             $M --candidate hf $C:v01_mlp_bitwise_copy $C:v03_linear_fp32_accum $C:d06_logits_doubled
    run B02_mx_gross             $M --candidate $C:d01_final_norm_eps_batch_max $C:d08_final_norm_no_weight
    run B03_mx_step5_static      $M --candidate $C:d04_final_norm_eps_from_step5 $C:d05_attn_ignores_mask
    run B04_mx_d07_self          $M --batches 1 2 --reference $C:d07_logits_nondeterministic --candidate $C:d07_logits_nondeterministic
    run B05_mx_d02               $M --batches 1 2 4 --candidate $C:d02_attn_batch4_drops_newest_key
    run B06_mx_d09               $M --batches 1 2 --candidate $C:d09_gdn_state_to_cache_scaled_decode
    run B07_mx_seed_flag         ulptrace matrix $Q --seeds 0 --seed 5 --batches 1 --prompt-len 8 --new-tokens 2 --candidate hf --json "$out/B07.json"
    run B07b_mx_seed5            ulptrace matrix $Q --seeds 5 --batches 1 --prompt-len 8 --new-tokens 2 --candidate hf --json "$out/B07b.json"
    run B08_mx_llama_gross       $M --model tiny-llama --batches 1 2 --candidate $C:d08_final_norm_no_weight $C:v03_linear_fp32_accum
    ;;
C)  # lockstep (2 x 16 prompts, 4 new tokens unless said)
    L="ulptrace lockstep $Q"
    run C01_ls_v01               $L --candidate $C:v01_mlp_bitwise_copy
    run C02_ls_d06               $L --candidate $C:d06_logits_doubled
    run C03_ls_d04_default       $L --candidate $C:d04_final_norm_eps_from_step5
    run C03b_ls_d04_8tok         $L --candidate $C:d04_final_norm_eps_from_step5 --new-tokens 8
    run C04_ls_d05_static        $L --candidate $C:d05_attn_ignores_mask --candidate-mode static
    run C04b_ls_d05_self_static  $L --reference $C:d05_attn_ignores_mask --candidate $C:d05_attn_ignores_mask --candidate-mode static
    run C05_ls_d07_self          $L --reference $C:d07_logits_nondeterministic --candidate $C:d07_logits_nondeterministic
    run C06_ls_d09               $L --candidate $C:d09_gdn_state_to_cache_scaled_decode
    run C06b_ls_d09_free         $L --candidate $C:d09_gdn_state_to_cache_scaled_decode --free-running
    run C07_ls_d02_p4            $L --candidate $C:d02_attn_batch4_drops_newest_key --prompts 4
    run C08_ls_d03_raises        $L --candidate $C:d03_raises_when_batched
    run C09_ls_static_hf         $L --candidate-mode static
    ;;
D)  # trace_norm_rounding
    T="trace_norm_rounding $Q"
    run D01_tnr_v01              $T --candidate $C:v01_mlp_bitwise_copy
    run D02_tnr_d01              $T --candidate $C:d01_final_norm_eps_batch_max
    run D02b_tnr_d01_p1          $T --candidate $C:d01_final_norm_eps_batch_max --prompts 1
    run D03_tnr_d13              $T --candidate $C:d13_input_norm_eps_batch_max
    run D04_tnr_d12_glu          $T --candidate $C:d12_glu_gelu
    run D05_tnr_d04_default      $T --candidate $C:d04_final_norm_eps_from_step5
    run D05b_tnr_d04_8tok        $T --candidate $C:d04_final_norm_eps_from_step5 --new-tokens 8
    run D06_tnr_d03_raises       $T --candidate $C:d03_raises_when_batched
    run D07_tnr_d08_llama        $T --model tiny-llama --candidate $C:d08_final_norm_no_weight
    run D08_tnr_v03              $T --candidate $C:v03_linear_fp32_accum
    ;;
E)  # bad inputs (each should be one line naming expected vs found, exit 2)
    run E01 ulptrace batch-invariance --model nosuch-model
    run E02 ulptrace batch-invariance --path nosuchpkg.mod:fn
    run E03 ulptrace batch-invariance --path $C:no_such_function
    run E04 ulptrace batch-invariance --batches 0
    run E05 ulptrace batch-invariance --batches -2 2
    run E06 ulptrace batch-invariance --batches 2 2
    run E07 ulptrace batch-invariance --batches 2 3
    run E08 ulptrace batch-invariance --batches
    run E09 ulptrace batch-invariance --new-tokens 0
    run E10 ulptrace batch-invariance --new-tokens -3
    run E11 ulptrace batch-invariance --prompts 0
    run E12 ulptrace batch-invariance --batches 4 --prompts 2
    run E13 ulptrace batch-invariance --mode graph
    run E14 ulptrace batch-invariance --cache-len 40
    run E15 ulptrace batch-invariance --mode static --cache-len 5
    run E16 ulptrace batch-invariance --batches 1 2 --layers 9:12
    run E17 ulptrace batch-invariance --batches 1 2 --kinds bogus
    run E18 ulptrace batch-invariance --batches 1 2 --steps 0:2
    run E19 ulptrace batch-invariance --batches 1 2 --locate-seconds -1
    run E20 ulptrace batch-invariance --batches x
    run E21 ulptrace matrix --candidate hf --batches 0
    run E22 ulptrace matrix --candidate hf --seeds
    run E23 ulptrace matrix --candidate hf --modes graph
    run E24 ulptrace matrix --candidate hf hf
    run E25 ulptrace matrix --candidate hf --new-tokens 0
    run E26 ulptrace matrix --candidate hf --prompts 4
    run E27 ulptrace matrix --candidate hf --modes eager --cache-len 100
    run E28 ulptrace matrix --candidate hf --locate-limit -1
    run E29 ulptrace matrix --candidate hf --graph-attempts 0
    run E30 ulptrace matrix --candidate nosuch
    run E31 ulptrace matrix --candidate hf --resume /nonexistent.json
    run E32 ulptrace matrix --candidate hf --model tiny-llama --sites 'layers.*.linear_attn.*'
    run E33 ulptrace lockstep --new-tokens 0
    run E34 ulptrace lockstep --candidate-mode graph
    run E35 ulptrace lockstep --candidate-mode static --cache-len 10
    run E36 ulptrace lockstep --prompts -1
    run E37 ulptrace lockstep --candidate nosuch.module:fn
    run E38 ulptrace lockstep --model /nonexistent/dir
    run E39 ulptrace lockstep --dtype float8
    run E40 ulptrace lockstep --device cuda
    run E41 ulptrace lockstep $Q --new-tokens 1
    run E42 trace_norm_rounding --kinds glu
    run E43 trace_norm_rounding --kinds bogus
    run E44 trace_norm_rounding --new-tokens 0
    run E45 trace_norm_rounding --candidate $C:no_such_function
    run E46 ulptrace matrix-merge /nonexistent.json
    run E47 ulptrace batch-invariance --resume "$out/B07.json"
    run E48 ulptrace matrix --candidate hf --graph-attempts 3 --seeds 0 --batches 1 --prompt-len 8 --new-tokens 2 $Q
    run E49 ulptrace lockstep --all $Q
    run E50 ulptrace batch-invariance --batches 1 2 --sites 'nomatch.*'
    ;;
F)  # follow-ups: process-global (module-level) patches, a valid batch-variant path with flips
    run C10_ls_d09b              ulptrace lockstep $Q --candidate $C:d09b_gdn_state_to_cache_halved_decode
    run C10b_ls_d09b_free        ulptrace lockstep $Q --candidate $C:d09b_gdn_state_to_cache_halved_decode --free-running
    run C11_ls_d14               ulptrace lockstep $Q --candidate $C:d14_gdn_decode_decay_doubled
    run C12_ls_d15_llama         ulptrace lockstep $Q --model tiny-llama --candidate $C:d15_rope_sin_negated_decode
    run C12b_ls_d15_qwen         ulptrace lockstep $Q --candidate $C:d15_rope_sin_negated_decode
    run F01_onset_d14            ulptrace onset $Q --candidate $C:d14_gdn_decode_decay_doubled
    run F02_onset_d15_llama      ulptrace onset $Q --model tiny-llama --candidate $C:d15_rope_sin_negated_decode
    run B09_mx_d14_d09b          ulptrace matrix $Q --seeds 0 --prompt-len 32 --batches 1 2 --candidate $C:d14_gdn_decode_decay_doubled $C:d09b_gdn_state_to_cache_halved_decode
    run B10_mx_d15_llama         ulptrace matrix $Q --seeds 0 --prompt-len 32 --batches 1 2 --model tiny-llama --candidate $C:d15_rope_sin_negated_decode
    run A12_bi_v02_big           ulptrace batch-invariance $Q --path $C:v02_linear_splitk_when_batched --prompts 16 --batches 1 2 16 --prompt-len 32 --new-tokens 32
    run B11_mx_v03_3seeds        ulptrace matrix $Q --candidate $C:v03_linear_fp32_accum --seeds 0 1 2 --batches 8 --prompt-len 32 --new-tokens 32 --modes eager
    ;;
esac; done
