#!/bin/bash
# TLV on one GPU: whether a finished profiler session slows later launches (cupti_linger.py), the graph tests (TLV graphed == eager == AR, the 8-bit-view GEMM compiled, the exact W12 kernels
# with their view flag off), `specpilot bench --suite tlv` (random Qwen3-8B shape, bf16, calibrated drafter), then the
# bundled pair's pilot (bf16, 2 rounds) for the cost model's predictions. Usage: probes/tlv_h200.sh OUT
out=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv > "$out/nvidia_smi.txt"
[ -z "$NO_CUPTI" ] && timeout 120 python3 probes/cupti_linger.py "$out/cupti_linger.json" > "$out/cupti.log" 2>&1
timeout "${TEST_S:-300}" python3 -m pytest -q -x ${TESTS:-tests/test_graphs_gpu.py tests/test_w12_view_gemm.py tests/test_w12_gemm.py} > "$out/gpu_tests.log" 2>&1
tail -3 "$out/gpu_tests.log"
timeout "${BENCH_S:-240}" python3 -m specpilot bench --suite tlv --device cuda --out "$out" > "$out/bench.log" 2>&1
tail -3 "$out/bench.log"
if [ -z "$NO_PILOT" ]; then
  timeout "${PILOT_S:-300}" python3 -m specpilot pilot --device cuda --dtype bfloat16 --rounds 2 --out /tmp/pilot > "$out/pilot_console.log" 2>&1
  echo "pilot rc=$?"; tail -4 "$out/pilot_console.log"
  cp "$out/pilot_console.log" /tmp/pilot/console.log 2>/dev/null; tar czf "$out/pilot.tgz" -C /tmp pilot
fi
