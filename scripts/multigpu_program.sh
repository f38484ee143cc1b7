#!/usr/bin/env bash
# The measurement program for a multi-GPU device session, in one call (development aid). Device time is scarce
# (about 30 minutes a session) and the 4-GPU kind is rarely lent, so everything a session on a new machine needs
# runs here, cheapest and most important first, each step logged under OUT and summed up at the end:
#   1. the EP GPU tests (every rank count the machine has),
#   2. the standard bench (prefill and decode, all four formats, with the ceilings and NCCL),
#   3. in-process A/B of the shares that were tuned on 2 GPUs only (dispatch receive share of large rounds, knob bits
#      27-29; send share of small rounds, bits 10-14; own tokens from x, 0x80000),
#   4. the sweep over N (plots).
# usage: OUT=/path bash scripts/multigpu_program.sh [steps, default "tests bench ab sweep"]
# Keeps NVLink multicast off (the device machine's rule) and stops each step at its own time limit.
set -u
OUT=${OUT:-out/program}
STEPS=${*:-tests bench ab sweep}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache} PYTHONPATH=${PYTHONPATH:-.}
summary="$OUT/summary.txt"
: > "$summary"
step() {  # step NAME LIMIT_S COMMAND...: run, log, note the exit status and the last lines
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$summary"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - t0))s" | tee -a "$summary"
    grep -v "^cuep: \(compiling\|.*ready on\)\|^round [0-9]" "$OUT/$name.log" | tail -"${TAIL:-8}" >> "$summary"
}
for s in $STEPS; do
    case $s in
    tests)
        step tests 300 python3 -m pytest tests/test_ep_gpu.py tests/test_ep_ipc_gpu.py tests/test_moe_gpu.py \
            tests/test_errors_gpu.py -q --timeout 120 -p no:cacheprovider ;;
    bench)
        TAIL=90 step bench 400 python3 -m cuep.bench --formats bf16 fp8 nvfp4 mxfp4 --shapes prefill decode --no-sweep \
            --repeats 10 --ceiling-mib 256 --out "$OUT/bench" ;;
    ab)
        for f in bf16 fp8; do
            step "ab_recv_share_$f" 200 python3 scripts/ab_knobs.py --op dispatch --format $f --tokens 4096 \
                --rounds 3 --knobs 0x18000000 0 0x28000000 0x30000000
        done
        step ab_small_send_share 200 python3 scripts/ab_knobs.py --op dispatch --tokens 128 --rounds 8 \
            --knobs 0 0x1000 0x1400 0x2000 0x80000 ;;
    sweep)
        TAIL=4 step sweep 500 python3 -m cuep.bench --formats bf16 fp8 --shapes none --sweep-n 1:8192 \
            --sweep-repeats 5 --no-ceilings --out "$OUT/sweep" ;;
    *) echo "unknown step $s (tests bench ab sweep)" | tee -a "$summary" ;;
    esac
done
cat "$summary"
