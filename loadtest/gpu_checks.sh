#!/usr/bin/env bash
# Every GPU check in one run, for a CUDA machine that has torch, triton and transformers
# (GPU time is scarce: one prepared script, each check under its own time limit so that a
# slow one cannot starve the rest).
#
#   loadtest/gpu_checks.sh OUTDIR              # all checks, in this order (~6 min, H200)
#   loadtest/gpu_checks.sh OUTDIR CHECK...     # some of them, in the order given
#
# Checks:
#   env            nvidia-smi and the versions of torch, triton, transformers
#   kernel_tests   every kernel test, compiled for this GPU (the CPU runs them interpreted)
#   kernel_bench   the decode kernel sweep, batch 1-256 x context 512-32k, against the
#                  copy bandwidth and torch SDPA -> bench_paged_attention.json, kernels_decode.png
#   executor_tests the executor's GPU path against transformers on the same GPU
#   profile        where a bf16 decode step's time goes, batch 1 and 64, eager and graphs
#   executor_bench the executor against transformers generate on a SmolLM2-shaped random
#                  model, bf16 and fp32, CUDA graphs on -> bench_executor_gpu.json
#   executor_eager the same in bf16 with CUDA graphs off (the baseline), no transformers
#                  -> bench_executor_gpu_eager.json
#   stack          (not in the default list; about 10 min on an H200, never run yet) the
#                  whole stack: a random Llama-3.1-8B-shaped bf16 model drawn on the GPU
#                  (loadtest/random_model.py, with a synthetic tokenizer), then `pagedserve
#                  serve` (its own Redis) paged (steps planned ahead), with
#                  --async-scheduling off, and --contiguous in the same KV memory, and the
#                  in-process engine, at batch 16/64/128/256 -> bench_stack.json
#                  (loadtest/bench_stack.py; async_over_sync and executor_idle per batch).
#                  STACK_DEVICE=cpu runs the same end to end on the CPU with a 2-layer
#                  SmolLM2-shaped random model at batch 2 and 4: its dry run (a test runs it).
# Everything printed goes to OUTDIR/all.log; the exit status is 1 when a stage failed.
# tests/conftest.py needs the redis client:
# PYTHONPATH must provide it where it is missing.
set -u
OUT=${1:?usage: loadtest/gpu_checks.sh OUTDIR [CHECK...]}
shift
CHECKS=${*:-env kernel_tests kernel_bench executor_tests profile executor_bench executor_eager}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
LOG="$OUT/all.log"
MODEL=/tmp/smollm2-random
: > "$LOG"
FAILED=0

stage() {   # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "=== $name: start $(date +%T), limit ${limit}s" | tee -a "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    echo "=== $name: rc=$rc after $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || FAILED=1
}

random_model() {
    [ -f "$MODEL/config.json" ] || stage random_model 40 $PY loadtest/random_model.py "$MODEL"
}

for check in $CHECKS; do
    case $check in
    env)
        stage env 15 bash -c "nvidia-smi; $PY -c 'import torch, triton, transformers; \
print(torch.__version__, triton.__version__, transformers.__version__, \
torch.cuda.get_device_name())'" ;;
    kernel_tests)
        stage kernel_tests 90 $PY -m pytest -q -p no:cacheprovider -n 8 kernels/tests ;;
    kernel_bench)
        stage kernel_bench 60 $PY -m kernels.bench_paged_attention \
            --json "$OUT/bench_paged_attention.json" --plot "$OUT/kernels_decode.png" ;;
    executor_tests)
        stage executor_tests 120 $PY -m pytest -q -p no:cacheprovider \
            tests/executor/test_gpu_runner.py ;;
    profile)
        random_model
        for graphs in 0 256; do
            for batch in 1 64; do
                stage "profile_b${batch}_graphs$graphs" 40 $PY loadtest/profile_step.py \
                    --device cuda --model "$MODEL" --dtype bfloat16 --batch $batch \
                    --steps 10 --cuda-graph-max-batch $graphs
            done
        done ;;
    executor_bench)
        random_model
        stage executor_bench 120 bash -c "$PY loadtest/bench_executor.py --json \
            --device cuda --model $MODEL --dtypes bfloat16,float32 --requests 256 \
            --batches 1,8,32,64,128,256 --hf-batches 128,256 \
            > '$OUT/bench_executor_gpu.json'" ;;
    executor_bench_bf16)   # the same, bf16 only and transformers at batch 256 only
        random_model
        stage executor_bench_bf16 90 bash -c "$PY loadtest/bench_executor.py --json \
            --device cuda --model $MODEL --dtypes bfloat16 --requests 256 \
            --batches 1,8,32,64,128,256 --hf-batches 256 > '$OUT/bench_executor_gpu.json'" ;;
    executor_eager)
        random_model
        stage executor_eager 90 bash -c "$PY loadtest/bench_executor.py --json \
            --device cuda --model $MODEL --dtypes bfloat16 --requests 256 \
            --batches 1,8,32,64,128,256 --no-hf --cuda-graph-max-batch 0 \
            > '$OUT/bench_executor_gpu_eager.json'" ;;
    stack)
        if [ "${STACK_DEVICE:-cuda}" = cuda ]; then
            SMODEL=${STACK_MODEL:-/tmp/llama8b-random}
            [ -f "$SMODEL/tokenizer.json" ] || stage stack_model 150 $PY \
                loadtest/random_model.py "$SMODEL" --shape llama3-8b --dtype bfloat16 \
                --device cuda --tokenizer
            stage stack 450 bash -c "$PY loadtest/bench_stack.py --json --model $SMODEL \
                --systems paged,sync,contiguous,inprocess \
                --device cuda --dtype bfloat16 --batches 16,64,128,256 --output-tokens 128 \
                --max-model-len 8192 > '$OUT/bench_stack.json'"
        else
            SMODEL=${STACK_MODEL:-$OUT/tiny-random}
            [ -f "$SMODEL/tokenizer.json" ] || stage stack_model 120 $PY \
                loadtest/random_model.py "$SMODEL" --layers 2 --tokenizer
            stage stack 300 bash -c "$PY loadtest/bench_stack.py --json --model $SMODEL \
                --device cpu --dtype float32 --batches 2,4 --output-tokens 8 \
                --prompt-len 16,48 --max-model-len 128 --kv-tokens 512 \
                --max-batched-tokens 512 > '$OUT/bench_stack.json'"
        fi ;;
    *)
        echo "unknown check $check" | tee -a "$LOG"
        FAILED=1 ;;
    esac
done
echo "=== done $(date +%T)" | tee -a "$LOG"
exit $FAILED
# Decode tile tuning (not a check; the defaults in kernels/paged_attention.py come from it):
#   python -m kernels.bench_paged_attention --tune --batches 1,64 --contexts 4096 --no-sdpa
