#!/usr/bin/env bash
# Thirty-first round, one device call: where P1's regression since the twenty-sixth round's tree (c616328) lies.
# Older trees come as packages carried in .base/<name> (ulptrace/ = tracer/ with probes/ and kernels/ inside, bench/
# beside; made from `git archive`), imported by PYTHONPATH. Two measurements, alternating variants:
#   SIDE="pkg30 tree ..." — bench_side_parts.py (this tree's script; each variant's package) in one process each: the
#       reference's and the candidate's traced runs against their untraced ones, inside and outside the hooks;
#   P1="pkg30 tree treemalloc ..." — P1 as the command's default runs it (bench_trace.py --goals P1 --concurrent
#       auto, each variant's own script); `treemalloc` is this tree with MALLOC_TOP_PAD_ set to glibc's default,
#       so ulptrace.host_memory leaves malloc alone in every process (bc78fb5 undone without a code change).
# ROUNDS repeats the lists. Logs under $OUT (one line per run in side.log / p1.log, with the variant and the time).
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1
root=$PWD
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" \
    | tee $OUT/env.log
git log -1 --format=%h 2>/dev/null | tee -a $OUT/env.log
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
for v in $SIDE $P1; do  # each package's extension and CPU loops built before any timing
    case $v in tree*) ;; *) (cd $root/.base/$v/bench && PYTHONPATH=$root/.base/$v python3 -c \
        "import ulptrace; print(ulptrace.__file__); from ulptrace.kernels import _build; _build.extension()" \
        2>&1 | tail -2) ;; esac
done
side() {  # variant
    local pp="" ; case $1 in tree*) ;; *) pp=$root/.base/$1 ;; esac
    (cd $root/bench && PYTHONPATH=$pp timeout 200 python3 bench_side_parts.py --device cuda --model qwen3.5-0.8b \
        --prompts 8 --prompt-len 128 --new-tokens 16 --repeats ${REPEATS:-3} --json $OUT/side_${1}_$2.json 2>&1 \
        | grep -v Warn | sed "s/^/$1 r$2 /" | tee -a $OUT/side.log | grep -E "untraced|keep")
}
p1() {  # variant round
    local dir=$root/bench pp="" envs="" f=$OUT/p1_${1}_$2.json
    [ -e $f ] && f=$OUT/p1_${1}b_$2.json  # a variant listed twice in a round: "<variant>b"
    case $1 in tree) ;; treemalloc) envs="MALLOC_TOP_PAD_=131072" ;; *) dir=$root/.base/$1/bench pp=$root/.base/$1 ;; esac
    (cd $dir && env $envs PYTHONPATH=$pp timeout 200 python3 bench_trace.py --device cuda --model qwen3.5-0.8b \
        --prompts 8 --prompt-len 128 --new-tokens 16 --goals P1 --concurrent auto --json $f 2>&1 \
        | grep "^P" | sed "s/^/$1 r$2 $(date +%T) /" | tee -a $OUT/p1.log)
}
for r in $(seq ${ROUNDS:-1}); do
    for v in $SIDE; do side $v $r; done
    for v in $P1; do p1 $v $r; done
done
python3 $root/bench/p1_ab_summary.py $OUT 2>&1 | tee $OUT/summary.log
