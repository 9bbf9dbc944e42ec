#!/bin/bash
# A learned drafter under CUDA graphs on one GPU: the graph tests (bundled block drafters graphed == eager == AR),
# then `specpilot bench --suite drafter-step` (random Qwen3-8B shape, bf16). Usage: probes/drafter_step_h200.sh OUT
out=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv > "$out/nvidia_smi.txt"
timeout "${TEST_S:-240}" python3 -m pytest -q ${TESTS:-tests/test_graphs_gpu.py} > "$out/gpu_tests.log" 2>&1
tail -3 "$out/gpu_tests.log"
python3 -m specpilot bench --suite drafter-step --device cuda --out "$out" 2>&1 | tee "$out/bench.log" | tail -20
