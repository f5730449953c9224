#!/usr/bin/env bash
# One device call: `ulptrace onset` as a user runs it on CUDA, a fresh process each, its helper processes (the
# reference's with --concurrent, the oracle's with --judge-workers) forked — the command as it is — against spawned
# (the same command after `torch.cuda.is_available()` in that process: a forked child would be refused CUDA, so
# ulptrace spawns them) and against none (--no-concurrent, judged here). Each run's line: wall seconds, how its helpers
# started, tracebacks and torch's "Producer process has been terminated" warnings on its stderr (both must be 0); the
# reports compared less what says when and in which process; the line also gives the parent's imports, its onset and
# the model build inside it. ROUNDS (default 1) alternations, the order reversed in even rounds; WORK: which workloads
# (tiny p1 p3); ORDER: which variants (forked spawned none; noprep: forked, the helper skipping its imports and CUDA
# context before the run). KEEP=1 copies each run's JSON and stderr to $OUT. Logs under $OUT.
set -uo pipefail
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=/tmp/ext PYTHONUNBUFFERED=1 TIMEFORMAT=%R
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
python3 -c "from ulptrace.kernels import _build; _build.extension()" 2>&1 | tail -1
LOG=$OUT/start.log
CLI='import time
t0 = time.perf_counter()
import atexit, sys, torch
if __name__ == "__main__":
    if sys.argv[1] == "driver":
        torch.cuda.is_available()
    from ulptrace.cli import main
    import ulptrace.probes.onset as onset
    if sys.argv[1] == "noprep":  # a forked helper inherits this: it skips its imports and CUDA context before the run
        import ulptrace.concurrent
        ulptrace.concurrent.prepare_imports = lambda cfg: None
    build = onset.build_pair
    built = []
    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = build(*args, **kwargs)
        built.append(time.perf_counter() - t)
        return out
    onset.build_pair = timed
    t1 = time.perf_counter()
    rc = main(sys.argv[2:])
    t2 = time.perf_counter()
    atexit.register(lambda: print(f"TIMES imports {t1 - t0:.2f} onset {t2 - t1:.2f} (its build {sum(built):.2f})",
                                  file=sys.stderr))
    sys.exit(rc)'
run() {  # name, how (none: the command as it is; driver: after cuInit; noprep: no prepare), then the onset's arguments
    local name=$1 how=$2; shift 2
    s=$( { time (cd /tmp && timeout 200 python3 -c "$CLI" $how onset --device cuda --candidate kernels:fused --quiet \
        --json /tmp/$name.json "$@" > /dev/null 2> /tmp/$name.err); } 2>&1 )
    started=$(python3 -c "import json; r=json.load(open('/tmp/$name.json'))['run']; \
print(r.get('reference_process', {}).get('start_up', {}).get('method'), r.get('judging_processes', {}).get('start_method'))" 2>&1)
    echo "$name: $s s ($(grep TIMES /tmp/$name.err | cut -c7-); the rest: the exit), helpers started by: $started, \
$(grep -c Traceback /tmp/$name.err) tracebacks, $(grep -c 'Producer process has been terminated' /tmp/$name.err) \
IPC warnings" | tee -a $LOG
    [ -n "${KEEP:-}" ] && cp /tmp/$name.json /tmp/$name.err $OUT/
}
equal() {
    python3 - "$@" <<'PY' 2>&1 | tee -a $LOG
import json, sys
sys.path.insert(0, "bench")
from bench_trace import _clean
first, *rest = (json.load(open(f"/tmp/{n}.json")) for n in sys.argv[1:])
print(" = ".join(sys.argv[1:]), ": reports equal:", all(_clean(first) == _clean(r) for r in rest), "| sites:",
      len(first["sites"]))
PY
}
for round in $(seq ${ROUNDS:-1}); do
    for work in ${WORK:-tiny p1 p3}; do
        case $work in
            tiny) ARGS="--model tiny-qwen3.5 --prompts 2 --prompt-len 16 --new-tokens 4 --candidate-mode graph"; J="--judge-workers 2";;
            p1) ARGS="--model qwen3.5-0.8b --prompts 8 --prompt-len 128 --new-tokens 16 --no-oracle"; J="";;
            p3) ARGS="--model qwen3.5-0.8b --prompts 2 --prompt-len 32 --new-tokens 4"; J="--judge-workers 4";;
        esac
        order=${ORDER:-forked spawned none}
        [ $((round % 2)) = 0 ] && order=$(echo $order | tr ' ' '\n' | tac | tr '\n' ' ')  # reversed in even rounds
        for how in $order; do
            case $how in
                forked) run ${work}_forked_$round none $ARGS --concurrent $J;;
                spawned) run ${work}_spawned_$round driver $ARGS --concurrent $J;;
                none) run ${work}_none_$round none $ARGS --no-concurrent;;
                noprep) run ${work}_noprep_$round noprep $ARGS --concurrent $J;;
            esac
        done
        equal $(for how in $order; do echo ${work}_${how}_$round; done)
    done
done
