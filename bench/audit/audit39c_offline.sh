#!/bin/bash
# Audit 39c, check 4: record + compare against onset, and broken/mismatched traces. Usage: bash bench/audit/audit39c_offline.sh OUT
here=$(cd "$(dirname "$0")" && pwd)
out=$1; mkdir -p "$out"; T=$out/traces; rm -rf $T; mkdir -p $T
export PYTHONPATH=$here
run() {  # label, then ulptrace arguments
    local label=$1; shift
    timeout 300 python -m ulptrace "$@" > "$out/$label.txt" 2>&1
    echo "$label rc=$? :: ulptrace $*" >> "$out/rc.txt"
}
Q="--model tiny-qwen3.5 --prompts 2 --prompt-len 16 --quiet"
L="--model tiny-llama --prompts 2 --prompt-len 16 --quiet"
run rec_ref record $Q --new-tokens 3 --out $T/ref
run rec_ref6 record $Q --new-tokens 6 --out $T/ref6
for c in audit39_candidates:d207_final_norm_twice audit39_candidates:d208_o_proj_added_twice_layer1 audit39_candidates:v202_linear_splitk4_fp32 audit36_candidates:d61_qnorm_skipped_decode; do
    n=${c#*:}; n=${n%%_*}
    run rec_$n record $Q --new-tokens 3 --path $c --forced-from $T/ref --out $T/$n
    run cmp_$n compare $T/ref $T/$n --quiet --json $out/cmp_$n.json --fail-on-onset
    run ons_$n onset $Q --new-tokens 3 --candidate $c --json $out/ons_$n.json --fail-on-onset
done
run rec_d301 record $Q --new-tokens 6 --path audit39c_candidates:d301_oproj_scaled_from_step4 --forced-from $T/ref6 --out $T/d301
run cmp_d301 compare $T/ref6 $T/d301 --quiet --json $out/cmp_d301.json --fail-on-onset
run ons_d301 onset $Q --new-tokens 6 --candidate audit39c_candidates:d301_oproj_scaled_from_step4 --json $out/ons_d301.json --fail-on-onset
# broken / mismatched traces (candidate side and reference side)
cp -r $T/d207 $T/d207_noshard; rm $T/d207_noshard/step-00002.safetensors
run bad_noshard_cand compare $T/ref $T/d207_noshard --quiet --fail-on-onset
cp -r $T/ref $T/ref_noshard; rm $T/ref_noshard/step-00001.safetensors
run bad_noshard_ref compare $T/ref_noshard $T/d207 --quiet --fail-on-onset
cp -r $T/v202 $T/v202_trunc; f=$T/v202_trunc/step-00001.safetensors; truncate -s $(( $(stat -c %s $f) / 2 )) $f
run bad_trunc_valid compare $T/ref $T/v202_trunc --quiet --fail-on-onset
cp -r $T/v202 $T/v202_lastshard; rm $T/v202_lastshard/step-00002.safetensors
run bad_lastshard_valid compare $T/ref $T/v202_lastshard --quiet --fail-on-onset
cp -r $T/v202 $T/v202_nomanifest; rm $T/v202_nomanifest/manifest.json
run bad_nomanifest compare $T/ref $T/v202_nomanifest --quiet --fail-on-onset
run rec_llama record $L --new-tokens 3 --out $T/llama
run bad_other_model compare $T/ref $T/llama --quiet --fail-on-onset
run rec_pl12 record $Q --prompt-len 12 --new-tokens 3 --out $T/pl12
run bad_other_plen compare $T/ref $T/pl12 --quiet --fail-on-onset
run bad_other_plen_allow compare $T/ref $T/pl12 --quiet --fail-on-onset --allow-different-inputs
run rec_seed1 record $Q --seed 1 --new-tokens 3 --out $T/seed1
run bad_other_seed compare $T/ref $T/seed1 --quiet --fail-on-onset
run bad_other_steps compare $T/ref $T/ref6 --quiet --fail-on-onset
run bad_other_steps_rev compare $T/ref6 $T/ref --quiet --fail-on-onset
run rec_sel_norm record $Q --new-tokens 3 --kinds norm --path audit39_candidates:v202_linear_splitk4_fp32 --forced-from $T/ref --out $T/sel_norm
run bad_sel_cand compare $T/ref $T/sel_norm --quiet --fail-on-onset
run bad_sel_ref compare $T/sel_norm $T/ref --quiet --fail-on-onset
run rec_d208_sel record $Q --new-tokens 3 --layers 2:4 --path audit39_candidates:d208_o_proj_added_twice_layer1 --forced-from $T/ref --out $T/d208_sel
run rec_ref_sel record $Q --new-tokens 3 --layers 2:4 --out $T/ref_sel
run sel_both_d208 compare $T/ref_sel $T/d208_sel --quiet --fail-on-onset
run self_ref compare $T/ref $T/ref --quiet --fail-on-onset
