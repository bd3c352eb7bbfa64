#!/usr/bin/env bash
# Every GPU check in one run, for a CUDA machine that has torch, triton and transformers
# (GPU time is scarce: one prepared script, stages in order of importance, each under its
# own time limit so that a slow one cannot starve the rest).
#
#   loadtest/gpu_checks.sh OUTDIR
#
# OUTDIR receives: all.log (every stage's output, the step profiles too),
# bench_paged_attention.json and kernels_decode.png (the kernel sweep), and
# bench_executor_gpu.json (the executor against transformers on a SmolLM2-shaped random
# model). About 6 minutes on an H200.
# tests/conftest.py needs the redis client: PYTHONPATH must provide it where it is missing.
set -u
OUT=${1:?usage: loadtest/gpu_checks.sh OUTDIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
LOG="$OUT/all.log"
: > "$LOG"

stage() {   # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "=== $name: start $(date +%T), limit ${limit}s" | tee -a "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    echo "=== $name: rc=$rc after $((SECONDS - start)) s" | tee -a "$LOG"
}

stage env 15 bash -c "nvidia-smi; $PY -c 'import torch, triton, transformers; \
print(torch.__version__, triton.__version__, transformers.__version__, \
torch.cuda.get_device_name())'"
# 1. Every kernel test, compiled for this GPU (the CPU runs them interpreted).
stage kernel_tests 90 $PY -m pytest -q -p no:cacheprovider -n 8 kernels/tests
# 2. The decode kernel sweep: batch 1-256 x context 512-32k, against copy bandwidth and SDPA.
stage bench_paged_attention 60 $PY -m kernels.bench_paged_attention \
    --json "$OUT/bench_paged_attention.json" --plot "$OUT/kernels_decode.png"
# 3. The executor's GPU path against transformers on the same GPU.
stage executor_gpu_tests 90 $PY -m pytest -q -p no:cacheprovider tests/executor/test_gpu_runner.py
# 4. Where a decode step's time goes, then the executor against transformers generate.
stage random_model 30 $PY loadtest/random_model.py /tmp/smollm2-random
for batch in 1 64; do
    stage profile_b$batch 40 $PY loadtest/profile_step.py --device cuda \
        --model /tmp/smollm2-random --dtype bfloat16 --batch $batch --steps 10
done
stage bench_executor 120 bash -c "$PY loadtest/bench_executor.py --json --device cuda \
    --model /tmp/smollm2-random --dtypes bfloat16,float32 --requests 256 \
    --batches 1,8,32,64,128,256 --hf-batches 128,256 > '$OUT/bench_executor_gpu.json'"
# Decode tile tuning (not run by default; the defaults in kernels/paged_attention.py come
# from it):
#   python -m kernels.bench_paged_attention --tune --batches 1,64 --contexts 4096 --no-sdpa
echo "=== done $(date +%T)" | tee -a "$LOG"
