#!/usr/bin/env bash
# One-shot GPU check (issue 7): compiled (non-interpreted) Triton attention tests incl. the CUDA
# graph decode path, end-to-end greedy vs HF on the GPU (graphs and eager), then the
# decode/prefill micro-benchmark. Meant for a lent CUDA machine
# (H200, torch 2.11 + triton 3.6); run from anywhere:  bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: NOT INSTALLED")
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
EOF

status=0
echo "=== compiled Triton attention tests ==="
if "$PY" -c "import pytest" 2>/dev/null; then
    PAGEDLLM_TRITON_NATIVE=1 TRITON_INTERPRET=0 timeout 420 "$PY" -m pytest \
        tests/attention/test_triton_attn.py -q -p no:cacheprovider -o addopts="" -rs --durations=5 || status=$?
else
    echo "pytest not importable with $PY: skipping tests"
    status=1
fi

echo "=== end to end on the GPU: greedy vs HF, CUDA graphs and eager ==="
if "$PY" -c "import pytest" 2>/dev/null; then
    PAGEDLLM_TRITON_NATIVE=1 TRITON_INTERPRET=0 timeout 300 "$PY" -m pytest \
        tests/engine/test_gpu_engine.py -q -p no:cacheprovider -o addopts="" -rs --durations=5 || status=$?
fi

echo "=== attention kernel benchmark ==="
timeout 240 "$PY" benchmarks/attention_kernel.py "$@" || status=$?
echo "gpu_check: exit status $status"
exit $status
