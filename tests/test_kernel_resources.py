"""Registers and spills from an offline compile for sm_90a (no GPU; Triton's bundled ptxas): the W12 GEMV's
default launch for 1, 2, 4 and 8 rows spills nothing on the Qwen3-8B projections, while 16 groups a thread
at 8 rows does (the check can fail); the tensor-core kernel over record words does not load weights byte by byte as
the first tensor-core kernel does. Compiled in a subprocess because the test session runs Triton in interpreter
mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specpilot.kernels.resources import KernelResources, ptxas_available

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json
from specpilot.w12.gemv import gemv_config, gemv_resources
shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
out, seen = [], {}
for rows in (1, 2, 4, 8):
    for n, k in shapes:
        c = gemv_config(n, k, m=rows)
        key = (rows, c["block_k"], c["num_warps"], c["split_k"])
        if key not in seen:
            r = gemv_resources(rows, c["block_n"], c["block_k"], c["num_warps"], c["num_stages"], c["split_k"],
                               lines=c["lines"])
            seen[key] = [r.registers, r.spill_bytes]
        out.append([rows, n, k, *seen[key]])
r = gemv_resources(8, 16, 1024, 4)  # 16 groups of 8 weights a thread at 8 rows
out.append([8, 0, 0, r.registers, r.spill_bytes])
print(json.dumps(out))
"""


@pytest.mark.skipif(not ptxas_available(), reason="Triton's bundled ptxas is not installed here")
def test_gemv_default_configs_do_not_spill():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    defaults, wide = rows[:-1], rows[-1]
    assert len(defaults) == 16
    assert all(spill == 0 and 0 < regs <= 255 for *_, regs, spill in defaults), defaults
    assert wide[4] > 0  # the check can fail: 16 groups a thread at 8 rows spills


STAGES_SCRIPT = r"""
import json
from specpilot.w12.gemv import gemv_resources
print(json.dumps({s: gemv_resources(1, 16, 512, 4, 3, 1, load_stages=s).ptx for s in (1, 3)}))
"""


@pytest.mark.skipif(not ptxas_available(), reason="Triton's bundled ptxas is not installed here")
def test_gemv_load_stages_pipeline_the_weight_words():
    """``load_stages`` 3: Triton copies the record words of later K steps to shared memory (cp.async), which it
    does not do for loads feeding no tl.dot in a plain loop (``load_stages`` 1: global loads, no cp.async)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", STAGES_SCRIPT], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ptx = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, staged = ptx["1"], ptx["3"]
    assert "cp.async.ca.shared.global" not in plain and plain.get("ld.global.b64", 0) >= 8
    assert staged.get("cp.async.ca.shared.global", 0) >= 16 and staged.get("cp.async.wait_group", 0) >= 1
    assert staged.get("ld.global.b64", 0) == 0  # every 64-bit view word now goes through shared memory


TENSOR_CORE_SCRIPT = r"""
import json
from specpilot.kernels.resources import kernel_resources
from specpilot.w12 import mma, mma_bytes
from specpilot.w12.tiles import WORD_KERNEL_SIGNATURE
out = []
for bm in (16, 32, 64):
    common = dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, EVEN=True, HAS_BIAS=False, FP32=False)
    for name, kern, sig, consts in (
            ("bytes", mma_bytes._w12_gemm_kernel, mma_bytes.BYTE_KERNEL_SIGNATURE, common | dict(W_LEFT=True)),
            ("words", mma._w12_mma_kernel, WORD_KERNEL_SIGNATURE, common | dict(ASM=True, X_EVEN=True, FUSED=False))):
        r = kernel_resources(kern, sig, consts, 4, 4)
        out.append(dict(kernel=name, block_m=bm, spill_bytes=r.spill_bytes, ptx=r.ptx))
print(json.dumps(out))
"""


@pytest.mark.skipif(not ptxas_available(), reason="Triton's bundled ptxas is not installed here")
def test_word_tensor_core_kernel_does_not_load_weights_byte_by_byte():
    """The tensor-core kernel over record words (:mod:`specpilot.w12.mma`) spills nothing at 16 / 32 rows and issues
    at most 1/16 of the one-byte global loads of the byte-loading kernel (:mod:`specpilot.w12.mma_bytes`), at 16, 32
    and 64 rows (BLOCK_N 64, BLOCK_K 128, 4 warps, 4 stages, no split)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", TENSOR_CORE_SCRIPT], capture_output=True, text=True, timeout=900,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    mma = json.loads(proc.stdout.strip().splitlines()[-1])
    words = {r["block_m"]: r for r in mma if r["kernel"] == "words"}
    byte_loads = {r["block_m"]: r["ptx"].get("ld.global.b8", 0) for r in mma if r["kernel"] == "bytes"}
    assert words[16]["spill_bytes"] == 0 and words[32]["spill_bytes"] == 0
    assert all(byte_loads[bm] > 0 for bm in (16, 32, 64)), byte_loads
    assert all(words[bm]["ptx"].get("ld.global.b8", 0) * 16 <= byte_loads[bm] for bm in (16, 32, 64)), (words, byte_loads)


def test_max_warps_per_sm_from_registers():
    assert KernelResources(168, 0, 0, 4).max_warps_per_sm == 12  # 168 regs: 5376 a warp, 12 warps fit
    assert KernelResources(172, 0, 0, 8).max_warps_per_sm == 8  # 11 warps fit, whole programs of 8: 8
    assert KernelResources(32, 0, 0, 4).max_warps_per_sm == 64  # the SM's warp limit


CAP_SCRIPT = r"""
import json
from specpilot.w12 import mma as w12_mma
from specpilot.kernels.resources import kernel_resources
from specpilot.w12.launch import WAVE_MAXNREG
from specpilot.w12.tiles import WORD_KERNEL_SIGNATURE
c = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, FUSED=False, EVEN=True, X_EVEN=True, HAS_BIAS=False, FP32=False,
         ASM=True, X_GATHER=False, ESC_EARLY=False)
out = {}
aligned = tuple(n for n in WORD_KERNEL_SIGNATURE if n != "M")  # as a launch of 8 rows specialises them
for cap in (None, WAVE_MAXNREG):
    r = kernel_resources(w12_mma._w12_mma_kernel, WORD_KERNEL_SIGNATURE, c, 4, 4, maxnreg=cap, divisible_by_16=aligned)
    out[str(cap)] = [r.registers, r.spill_bytes, r.max_warps_per_sm]
print(json.dumps(out))
"""


@pytest.mark.skipif(not ptxas_available(), reason="Triton's bundled ptxas is not installed here")
def test_wave_register_cap_adds_a_program_an_sm_without_spills():
    """:data:`~specpilot.w12.launch.WAVE_MAXNREG`: the tensor-core kernel at BLOCK_M 16 (the launch
    ``default_config`` caps) uncapped holds 5 four-warp programs an SM; capped, 6 and no spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", CAP_SCRIPT], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (regs, spill, warps), (cap_regs, cap_spill, cap_warps) = out["None"], out["80"]
    assert regs > 80 and warps == 20, out
    assert cap_regs <= 80 and cap_spill == 0 and cap_warps == 24, out
