#!/bin/bash
# The batching bar on one GPU, in three calls to the same warm machine (each under the 10-minute call limit):
#
#   tests: the GPU tests of the batched engine, graphs, batched and tree attention and the hybrid's static step, the
#          aligned-attention probe, and the Qwen3-8B-shaped random target in /tmp/q8 (written beside the tests)
#   pilot: `specpilot pilot --batch SIZES` on it with the calibrated drafter (CAL, `specpilot calibrate`), out in
#          /tmp/bpilot; cut by the call's limit, it resumes from its journal in the next call (copy the returned
#          bpilot.tgz to cal/bpilot.tgz if the machine went cold in between)
#   bench: `specpilot bench --batch 1,2,4,8,16,32 --system /tmp/bpilot`: the per-size seals as one load plan against
#          AR and stock at every size
#
# Usage: probes/batch_sealed_h200.sh tests|pilot|bench|both OUT [CAL] (both: pilot, then bench if it ended rc=0); carry [".whl", "cal"] (cal holds CAL). Env: TESTS,
# TEST_S, ALIGNED (0: skip the aligned-attention probe), PROBE_SIZES (tests: then probes/batch_calibrated_probe.py at
# those sizes), PROBE_S, SIZES (pilot, default 1,16), PILOT_S, BENCH_SIZES, BENCH_S, BENCH_ARGS. Any ignored gguf_K/
# carried along is stashed in /tmp/gguf_stash for probes/smollm2_train_h200.sh (its parts ride in these calls' spare
# room).
set -u
mode=$1; out=$2; cal=${3:-cal/block16.json}
S=/tmp/gguf_stash; mkdir -p $S
for d in gguf_*/; do [ -f "$d/part" ] && { cp "$d"/*.npy $S/ 2>/dev/null; cp "$d/part" "$S/part_${d//[!0-9]/}"; }; done
ls $S > "$out/stash.txt" 2>&1
[ -d /tmp/site/typer ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$out/log.txt"; }
sp() { python3 -m specpilot "$@"; }
# pilot and bench on a fresh machine write the target first (25 s); tests write it beside the GPU tests
[ "$mode" != tests ] && [ ! -f /tmp/q8/config.json ] && { sp zoo random --arch qwen3-8b --out /tmp/q8 > "$out/zoo.log" 2>&1
  el "zoo rc=$?"; }
case $mode in
tests)
  nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv > "$out/nvidia_smi.txt"
  [ -d /tmp/q8 ] || (sp zoo random --arch qwen3-8b --out /tmp/q8 > "$out/zoo.log" 2>&1 &)
  timeout "${TEST_S:-270}" python3 -m pytest -q -p no:cacheprovider -rfs ${TESTS:-tests/test_batch_gpu.py \
    tests/test_graphs_gpu.py tests/test_batch_attention.py tests/test_tree_attention.py tests/test_hybrid_static.py} \
    > "$out/gpu_tests.log" 2>&1
  el "tests rc=$?: $(tail -1 "$out/gpu_tests.log")"
  if [ "${ALIGNED:-1}" = 1 ]; then
    timeout 120 python3 probes/batch_attention_aligned_h200.py /tmp/aligned --old-file cal/batch_attention_old.py \
      > "$out/aligned.log" 2>&1
    el "aligned probe rc=$?"; cp /tmp/aligned/*.json "$out/" 2>/dev/null
  fi
  while [ ! -f /tmp/q8/config.json ] || pgrep -f "zoo random" > /dev/null; do sleep 2; done; el "zoo done"
  if [ -n "${PROBE_SIZES:-}" ]; then  # calibrated systems against AR per size before a pilot spends calls on them
    timeout "${PROBE_S:-200}" python3 probes/batch_calibrated_probe.py /tmp/q8 "$cal" "$out/calibrated_probe.json" \
      --sizes "$PROBE_SIZES" > "$out/calibrated_probe.log" 2>&1
    el "probe rc=$?"; tail -3 "$out/calibrated_probe.log"
  fi
  ;;
pilot)
  # resumes: a journal in /tmp/bpilot (this warm machine's) or carried back as cal/bpilot.tgz (a fresh machine's)
  [ ! -d /tmp/bpilot ] && [ -f cal/bpilot.tgz ] && tar xzf cal/bpilot.tgz -C /tmp && el "resuming from cal/bpilot.tgz"
  timeout "${PILOT_S:-560}" python3 -m specpilot pilot --target /tmp/q8 --device cuda --dtype bfloat16 --quick \
    --batch "${SIZES:-1,16}" --calibration "$cal" --out /tmp/bpilot > "$out/console.log" 2>&1
  el "pilot rc=$?"; tail -4 "$out/console.log"; cp "$out/console.log" /tmp/bpilot/ 2>/dev/null
  tar czf "$out/bpilot.tgz" -C /tmp bpilot
  ;;
both)
  bash "$0" pilot "$out" "$cal" && grep -q "pilot rc=0" "$out/log.txt" && bash "$0" bench "$out" "$cal"
  ;;
bench)
  timeout "${BENCH_S:-560}" python3 -m specpilot bench --target /tmp/q8 --batch "${BENCH_SIZES:-1,2,4,8,16,32}" \
    --system /tmp/bpilot --device cuda --out /tmp/bbench ${BENCH_ARGS:-} > "$out/bench.log" 2>&1
  el "bench rc=$?"; tail -20 "$out/bench.log"; tar czf "$out/bbench.tgz" -C /tmp bbench
  ;;
esac
