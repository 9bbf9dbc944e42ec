"""Offline sm_90a compile (no GPU; Triton's bundled ptxas) of the W12 record-word kernels exact and with ``VIEW`` (the
Q pass's 8-bit view, specpilot/w12/view.py): registers, spills, the memory instructions in the PTX, and whether the
compiled kernel reads its ``RecQ`` argument (the nibble plane) at all. A compile-time figure, not a timing.

Run (CPU, TRITON_INTERPRET unset): ``python probes/w12_view_ptxas.py OUT.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from specpilot.kernels.resources import kernel_ptx, kernel_resources
from specpilot.w12 import gemv, mma
from specpilot.w12.tiles import WORD_KERNEL_SIGNATURE

ONE = dict(EVEN=True, X_EVEN=True, HAS_BIAS=False)
#: (name, kernel, constexprs without VIEW / ASM, num_warps, num_stages): the launches the host makes for a Qwen3-8B
#: projection at that row count (gemv_config / default_config), without a bias
LAUNCHES = [
    ("gemv_lines_1row_split1", gemv._w12_gemv_lines_kernel, dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, FUSED=False) | ONE,
     1, 3),
    ("gemv_lines_1row_split4_fused", gemv._w12_gemv_lines_kernel,
     dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=4, FUSED=True) | ONE, 1, 3),
    ("gemv_groups_4rows", gemv._w12_gemv_kernel,
     dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, FUSED=False, ROWS=4, LOAD_STAGES=1) | ONE, 4, 3),
    ("mma_16rows", mma._w12_mma_kernel,
     dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, FUSED=False, FP32=False) | ONE, 4, 4),
]


def reads_arg(kernel, ptx: str, arg: str) -> bool:
    """Whether the PTX of ``kernel`` refers to its argument ``arg`` (``<name>_param_<index>]``) anywhere."""
    return f"{kernel.__name__}_param_{kernel.arg_names.index(arg)}]" in ptx


def main(out_path: str) -> None:
    t0 = time.time()
    rows = []
    for name, kern, consts, warps, stages in LAUNCHES:
        gemv_kernel = name.startswith("gemv")
        # the host's decode: PTX for the exact kernels; for VIEW the GEMV's plain decode (w12_gemv), the tensor-core
        # kernel's PTX; "view_ptx_decode" is the GEMV's alternative with the PTX decode
        variants = [("exact", False, True), ("view", True, not gemv_kernel)]
        if gemv_kernel:
            variants.append(("view_ptx_decode", True, True))
        for label, view, asm in variants:
            c = consts | dict(VIEW=view, ASM=asm)
            r = kernel_resources(kern, WORD_KERNEL_SIGNATURE, c, warps, stages)
            ptx = kernel_ptx(kern, WORD_KERNEL_SIGNATURE, c, warps, stages)
            rows.append(dict(launch=name, variant=label, registers=r.registers, spill_bytes=r.spill_bytes,
                             reads_nibble_plane=reads_arg(kern, ptx, "RecQ"),
                             global_loads={k: v for k, v in r.ptx.items() if k.startswith(("ld.global", "cp.async.ca"))}))
            print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    import triton

    res = dict(device="none (offline compile for sm_90a, Triton's bundled ptxas)", triton=triton.__version__,
               commit=commit, rows=rows, runtime_s=round(time.time() - t0, 1))
    Path(out_path).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: this probe compiles for sm_90a")
    main(sys.argv[1])
