#!/bin/bash
# The batched engine on one GPU: its GPU tests, then (when they pass) `specpilot bench --batch` on the Qwen3-8B
# shape (random bf16 weights). Usage: probes/batch_h200.sh OUT_DIR SIZES tests|notests [extra bench args...]
out=$1; sizes=$2; tests=$3; shift 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
sp() { python3 -m specpilot "$@"; }
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv > "$out/nvidia_smi.txt"
if [ "$tests" = tests ]; then
  timeout "${TEST_S:-240}" python3 -m pytest -q -x ${TESTS:-tests/test_gemm.py tests/test_batch_gpu.py tests/test_batch_attention.py tests/test_fused.py} \
    > "$out/gpu_tests.log" 2>&1 || { tail -30 "$out/gpu_tests.log"; exit 1; }
  tail -2 "$out/gpu_tests.log"
fi
[ -d /tmp/q8 ] || (time sp zoo random --arch qwen3-8b --out /tmp/q8) > "$out/zoo.log" 2>&1
tail -2 "$out/zoo.log"
sp bench --target /tmp/q8 --batch "$sizes" --device cuda --dtype bfloat16 --out "$out" "$@" 2>&1 | tee "$out/bench.log" | tail -20
