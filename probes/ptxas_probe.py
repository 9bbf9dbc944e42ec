"""Registers and spills of the W12 GEMV (``specpilot/w12/gemv.py``) for 1, 2, 4 and 8 rows and a grid
of launch configs, and of the two tensor-core W12 kernels (byte loads: ``w12_gemm``; record words:
``w12_mma``) at 16 / 32 / 64 rows with their PTX memory-instruction counts, compiled for sm_90a with
Triton's bundled ptxas: no GPU needed.

    python probes/ptxas_probe.py OUT.json

A compile-time figure: registers a thread uses, bytes it spills, and the warps an SM can hold by registers.
It says which configs can keep enough loads in flight without spilling; only a GPU run says how fast they
are. Also records what :func:`~specpilot.w12.gemv.gemv_config` picks for the Qwen3-8B shapes.
"""

from __future__ import annotations

import json
import sys
import time

from specpilot.w12 import gemm as w12_gemm, mma as w12_mma
from specpilot.kernels.resources import kernel_resources
from specpilot.w12.gemv import gemv_config, gemv_resources
from specpilot.w12.tiles import WORD_KERNEL_SIGNATURE
from specpilot.provenance import git_commit, versions

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # Qwen3-8B


BYTES_SIGNATURE = {"X": "*bf16", "Rec": "*u8", "Base": "*u8", "Bias": "*bf16", "Out": "*bf16", "Part": "*fp32",
                   "RowPtr": "*i32", "EscK": "*i32", "EscD": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                   "K_PAD": "i32", "stride_xm": "i32", "K_PER_SPLIT": "i32"}


def tensor_core() -> list[dict]:
    """Both tensor-core kernels at the default launch for 16 / 32 / 64 rows (BLOCK_N 64, BLOCK_K 128, 4 warps,
    4 stages, weights as the left operand, no split)."""
    rows = []
    for bm in (16, 32, 64):
        common = dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, EVEN=True, HAS_BIAS=False, FP32=False)
        for name, kern, sig, consts in (
                ("bytes (w12_gemm)", w12_gemm._w12_gemm_kernel, BYTES_SIGNATURE, common | dict(W_LEFT=True)),
                ("words (w12_mma)", w12_mma._w12_mma_kernel, WORD_KERNEL_SIGNATURE,
                 common | dict(ASM=True, X_EVEN=True, FUSED=False))):
            r = kernel_resources(kern, sig, consts, 4, 4)
            rows.append(dict(kernel=name, block_m=bm, registers=r.registers, spill_bytes=r.spill_bytes,
                             shared_bytes=r.shared_bytes, max_warps_per_sm=r.max_warps_per_sm, ptx=r.ptx))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    path = sys.argv[1]
    t0 = time.time()
    res = {"device": "none (offline compile for sm_90a, Triton's ptxas)", "versions": versions(),
           "commit": git_commit(), "configs": [], "defaults": []}
    for rows in (1, 2, 4, 8):
        for gpt in (4, 8, 16):  # groups of 8 weights a thread
            for bk in (256, 512, 1024, 2048):
                nw = 16 * bk // 8 // (32 * gpt)
                if not 1 <= nw <= 16:
                    continue
                r = gemv_resources(rows, 16, bk, nw)
                row = dict(rows=rows, block_n=16, block_k=bk, num_warps=nw, groups_per_thread=gpt,
                           registers=r.registers, spill_bytes=r.spill_bytes, max_warps_per_sm=r.max_warps_per_sm)
                res["configs"].append(row)
                print(row, flush=True)
        for name, (n, k) in SHAPES.items():
            cfg = gemv_config(n, k, m=rows)
            r = gemv_resources(rows, cfg["block_n"], cfg["block_k"], cfg["num_warps"], cfg["num_stages"], cfg["split_k"])
            programs = -(-n // cfg["block_n"]) * cfg["split_k"]
            res["defaults"].append(dict(rows=rows, proj=name, n=n, k=k, **cfg, registers=r.registers,
                                        spill_bytes=r.spill_bytes, max_warps_per_sm=r.max_warps_per_sm,
                                        grid_warps_per_sm=programs * cfg["num_warps"] / 132))
            print(res["defaults"][-1], flush=True)
    res["tensor_core"] = tensor_core()
    res["runtime_s"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
