#!/bin/bash
# TLV judged at the Qwen3-8B shape on one GPU: the GPU tests (graphs, batched engine, W12 kernels, GDN kernels), then
# the pilot on random bf16 weights of that shape with the calibrated drafter (a real pair's acceptance, its drafter's
# cost), so the planner can propose TLV and the controller judge it. Usage: probes/tlv_qwen3_8b_h200.sh OUT CALIBRATION
# Env: TESTS (test files; empty string skips them), TEST_S, PILOT_S, PILOT_ARGS (extra pilot options).
out=$1; cal=$2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv > "$out/nvidia_smi.txt"
if [ -n "${TESTS-x}" ]; then
  timeout "${TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_graphs_gpu.py tests/test_batch_gpu.py \
    tests/test_w12_fused_split_gpu.py tests/test_gdn_kernels.py tests/test_w12_view_gemm.py} > "$out/gpu_tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$out/gpu_tests.log"
fi
t0=$(date +%s)
[ -d /tmp/q8 ] || python3 -m specpilot zoo random --arch qwen3-8b --out /tmp/q8 > "$out/zoo.log" 2>&1
echo "zoo $(( $(date +%s) - t0 )) s"
timeout "${PILOT_S:-420}" python3 -m specpilot pilot --target /tmp/q8 --device cuda --dtype bfloat16 \
  --calibration "$cal" --quick ${PILOT_ARGS} --out /tmp/pilot > "$out/pilot_console.log" 2>&1
echo "pilot rc=$? after $(( $(date +%s) - t0 )) s"; tail -6 "$out/pilot_console.log"
cp "$out/pilot_console.log" /tmp/pilot/console.log 2>/dev/null; tar czf "$out/pilot.tgz" -C /tmp pilot
