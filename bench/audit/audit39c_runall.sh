#!/bin/bash
# Audit 39c: selection / late-step / batch / offline / exit-code checks. Usage: bash bench/audit/audit39c_runall.sh OUT [GROUP...]
# Each run: OUT/LABEL.txt (stdout+stderr), OUT/LABEL.json (when --json), rc in OUT/rc.txt. Then python bench/audit/audit39c_summary.py OUT
here=$(cd "$(dirname "$0")" && pwd)
out=$1; shift; mkdir -p "$out"
export PYTHONPATH=$here
groups=${*:-sel err late batch exit}
A39=audit39_candidates; A36=audit36_candidates; C=audit39c_candidates
run() {  # label, then ulptrace arguments
    local label=$1; shift
    local t0=$(date +%s)
    timeout 300 python -m ulptrace "$@" > "$out/$label.txt" 2>&1
    local rc=$?
    echo "$label rc=$rc s=$(( $(date +%s) - t0 )) :: ulptrace $*" >> "$out/rc.txt"
}
on() {  # label model candidate [extra]
    local label=$1 m=$2 c=$3; shift 3
    run $label onset --model $m --candidate $c --prompts 2 --prompt-len 16 --quiet --json "$out/$label.json" "$@"
}
for g in $groups; do case $g in
sel)
    for m in tiny-qwen3.5 tiny-llama; do
        on sel_d207_full.$m $m $A39:d207_final_norm_twice --new-tokens 3
        on sel_d207_kinds_logits.$m $m $A39:d207_final_norm_twice --new-tokens 3 --kinds logits
        on sel_d207_kinds_glu.$m $m $A39:d207_final_norm_twice --new-tokens 3 --kinds glu
        on sel_d207_sites_out.$m $m $A39:d207_final_norm_twice --new-tokens 3 --sites output logits
        on sel_d208_full.$m $m $A39:d208_o_proj_added_twice_layer1 --new-tokens 3
        on sel_d208_layers2.$m $m $A39:d208_o_proj_added_twice_layer1 --new-tokens 3 --layers 2:4
        on sel_d208_kinds_glu.$m $m $A39:d208_o_proj_added_twice_layer1 --new-tokens 3 --kinds glu linear
    done
    m=tiny-qwen3.5
    on sel_d61_full.$m $m $A36:d61_qnorm_skipped_decode --new-tokens 3
    on sel_d61_sites_mlp.$m $m $A36:d61_qnorm_skipped_decode --new-tokens 3 --sites 'layers.*.mlp.*'
    on sel_d61_kinds_res.$m $m $A36:d61_qnorm_skipped_decode --new-tokens 3 --kinds residual logits
    on sel_d61_steps0.$m $m $A36:d61_qnorm_skipped_decode --new-tokens 3 --steps 0:1
    on sel_d205_full.$m $m $A39:d205_gdn_delta_beta_on_v_only_decode --new-tokens 3
    on sel_d205_kinds_norm_glu.$m $m $A39:d205_gdn_delta_beta_on_v_only_decode --new-tokens 3 --kinds norm glu
    on sel_d205_layers1.$m $m $A39:d205_gdn_delta_beta_on_v_only_decode --new-tokens 3 --layers 1:2
    ;;
err)
    m=tiny-qwen3.5
    on err_sites_unknown.$m $m $C:v305_hf_control --new-tokens 3 --sites 'nonexistent.*'
    on err_layers_oor.$m $m $C:v305_hf_control --new-tokens 3 --layers 7:9
    on err_layers_empty.$m $m $C:v305_hf_control --new-tokens 3 --layers 3:2
    on err_steps_oor.$m $m $C:v305_hf_control --new-tokens 3 --steps 5:8
    on err_kinds_bogus.$m $m $C:v305_hf_control --new-tokens 3 --kinds bogus
    on err_kinds_absent_llama.tiny-llama tiny-llama $C:v305_hf_control --new-tokens 3 --kinds gated_norm
    on err_sites_gdn_llama.tiny-llama tiny-llama $C:v305_hf_control --new-tokens 3 --sites 'layers.0.linear_attn.*'
    on err_sites_partial.$m $m $C:v305_hf_control --new-tokens 3 --sites norm 'nonexistent.*'
    ;;
late)
    for m in tiny-qwen3.5 tiny-llama; do
        for c in d301_oproj_scaled_from_step4 d302_attn_drops_oldest_key_late; do
            on late_${c}_n6.$m $m $C:$c --new-tokens 6
            on late_${c}_n3.$m $m $C:$c --new-tokens 3
            on late_${c}_n6_steps03.$m $m $C:$c --new-tokens 6 --steps 0:3
        done
    done
    ;;
batch)
    for m in tiny-qwen3.5 tiny-llama; do
        on batch_d303_p4.$m $m $C:d303_oproj_row2_only --new-tokens 3 --prompts 4
        on batch_d303_p2.$m $m $C:d303_oproj_row2_only --new-tokens 3 --prompts 2
        on batch_d304_p4.$m $m $C:d304_oproj_batch_gt2 --new-tokens 3 --prompts 4
        on batch_d304_p3.$m $m $C:d304_oproj_batch_gt2 --new-tokens 3 --prompts 3
        on batch_d304_p2.$m $m $C:d304_oproj_batch_gt2 --new-tokens 3 --prompts 2
    done
    ;;
exit)
    m=tiny-qwen3.5
    on exit_d207_fail.$m $m $A39:d207_final_norm_twice --new-tokens 3 --fail-on-onset
    on exit_v305_fail.$m $m $C:v305_hf_control --new-tokens 3 --fail-on-onset
    on exit_d207_kinds_logits_fail.$m $m $A39:d207_final_norm_twice --new-tokens 3 --kinds logits --fail-on-onset
    on exit_d208_layers2_fail.$m $m $A39:d208_o_proj_added_twice_layer1 --new-tokens 3 --layers 2:4 --fail-on-onset
    on exit_d301_n6_fail.$m $m $C:d301_oproj_scaled_from_step4 --new-tokens 6 --fail-on-onset
    on exit_d303_p4_fail.$m $m $C:d303_oproj_row2_only --new-tokens 3 --prompts 4 --fail-on-onset
    on exit_v202_fail.$m $m $A39:v202_linear_splitk4_fp32 --new-tokens 3 --fail-on-onset
    ;;
esac; done
# offline group: bash bench/audit/audit39c_offline.sh OUT (separate script)
