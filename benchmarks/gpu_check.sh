#!/usr/bin/env bash
# One-call GPU check for a lent CUDA machine (H200: torch 2.11 + triton 3.6 on its image), in
# priority order, each step under its own timeout and all of them inside one overall deadline:
#   1. the Triton kernel tests compiled (attention, block copy, LoRA, quantized GEMM);
#   2. end to end on the GPU: greedy vs HF (float32 / bf16, CUDA graphs and eager);
#   3. decode step time of the random 1.1B Llama at batch 1 / 32 / 256 vs the HBM floor
#      (weights + KV bytes per step / the card's measured copy bandwidth);
#   4. a torch.profiler table of the batch-1 decode loop (host vs device time per op), then the
#      offline throughput of the 64-request random workload beside HF transformers on the card;
#   5. the paged-attention kernel's achieved bandwidth (benchmarks/attention_kernel.py);
#   6. a broader slice of the CPU suite run with the GPU visible (device "auto" -> cuda).
# Results go under $OUT (at most 8 files come back from the device tool): summary.txt,
# tests.log, bench.log, broad.log, decode.json, profile.b1.txt, throughput.json.
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh [--budget SECONDS] [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/gpu_check_out}"
BUDGET=520
QUICK=0
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) BUDGET="$2"; shift 2 ;;
        --quick) QUICK=1; shift ;;
        *) echo "unknown argument $1"; exit 2 ;;
    esac
done
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TRITON_INTERPRET=0 PAGEDLLM_TRITON_NATIVE=1
T0=$(date +%s)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

# step NAME LOG SECONDS CMD...: runs CMD with at most min(SECONDS, time left) and records its status.
step() {
    local name="$1" log="$2" want="$3"
    shift 3
    local left=$((BUDGET - ($(date +%s) - T0)))
    local t=$((want < left ? want : left))
    if [ "$t" -lt 15 ]; then
        echo "$name: SKIPPED (budget spent)" | tee -a "$SUMMARY"
        return
    fi
    echo "=== $name (timeout ${t}s) ===" | tee -a "$log"
    local s=$(date +%s)
    timeout "$t" "$@" >>"$log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $(($(date +%s) - s))s$([ $rc -eq 124 ] && echo ' (TIMED OUT)')" | tee -a "$SUMMARY"
    tail -n 8 "$log"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
    "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))" 2>&1
    nproc
} | tee -a "$SUMMARY"

# The 1.1B model is built on the host's CPUs while the GPU runs the tests.
"$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from common import ensure_model; print(ensure_model('llama-1b'))" \
    >"$OUT/model.log" 2>&1 &
MODEL_PID=$!

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= -rfEs --durations=8)
step triton_tests "$OUT/tests.log" 200 "${PYTEST[@]}" -n 8 tests/attention/test_triton_attn.py \
    tests/attention/test_triton_kv8.py tests/attention/test_block_copy.py tests/lora/test_lora_triton.py tests/quantization/test_qgemm_triton.py
step gpu_engine "$OUT/tests.log" 150 "${PYTEST[@]}" tests/engine/test_gpu_engine.py

wait "$MODEL_PID"
cat "$OUT/model.log" >>"$OUT/bench.log" && rm -f "$OUT/model.log"
step decode_floor "$OUT/bench.log" 200 "$PY" benchmarks/decode_bandwidth.py --device cuda --model llama-1b \
    --batches 1,32,256 --prompt-len 128 --decode-tokens 32 --out "$OUT/decode.json"
step decode_profile "$OUT/bench.log" 90 "$PY" benchmarks/decode_bandwidth.py --device cuda --model llama-1b \
    --batches 1 --prompt-len 128 --decode-tokens 32 --profile "$OUT/profile" --out /tmp/decode_profile.json
step throughput "$OUT/bench.log" 150 "$PY" benchmarks/throughput.py --device cuda --model llama-1b \
    --engines pagedllm,hf --num-requests 64 --out "$OUT/throughput.json"
if [ "$QUICK" -eq 1 ]; then
    step attention_kernel "$OUT/bench.log" 60 "$PY" benchmarks/attention_kernel.py --quick
else
    step attention_kernel "$OUT/bench.log" 120 "$PY" benchmarks/attention_kernel.py
fi
step attention_kernel_fp8 "$OUT/bench.log" 40 "$PY" benchmarks/attention_kernel.py --quick --kv-cache-dtype fp8_e4m3
step broad_tests "$OUT/broad.log" 200 "${PYTEST[@]}" -n 8 --maxfail 10 --timeout 120 tests/engine/test_hf_identity.py \
    tests/engine/test_prefix_caching.py tests/engine/test_kv_cache_dtype.py tests/engine/test_sampling_behaviour.py \
    tests/spec_decode tests/lora
echo "gpu_check: $(($(date +%s) - T0))s in all" | tee -a "$SUMMARY"
