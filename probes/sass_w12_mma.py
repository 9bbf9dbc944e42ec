"""Static instruction counts of the W12 tensor-core kernel's main loop, compiled offline for sm_90a (no GPU
needed; issue 5).

    python probes/sass_w12_mma.py OUT.json
    (run from an older checkout with PYTHONPATH=that checkout to count its kernel: 407d3ee gives the counts before
    the bf16 decode and the K permutation)

Compiles ``_w12_mma_kernel`` with Triton for ``GPUTarget("cuda", 90, 32)`` with the divisibility-by-16
attributes a real launch specializes on (without them the activation loads compile to scalar 2-byte loads a
launch would not have), assembles it with Triton's bundled ``ptxas`` and disassembles it with ``cuobjdump
-sass``. The main loop is the longest backward branch whose body holds the MMAs (``HGMMA``/``HMMA``; the
epilogue's escape loop is longer in bytes, so the MMAs pick the loop). Writes, per config: registers, the
loop's instruction count, its opcode histogram and instructions per weight per thread (loop instructions x
threads / weights a step). A compile-time figure, not a timing: it says where the instructions go.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specpilot.w12 import mma as w12_mma
from specpilot.kernels.resources import ptxas_path
from specpilot.w12.tiles import WORD_KERNEL_SIGNATURE
from specpilot.provenance import git_commit, versions

CONFIGS = [dict(block_m=bm, block_k=bk, num_warps=4, num_stages=4, x_gather=g) for g in (False, True) for bm in (16, 32, 64)
           for bk in (64, 128)]


def loop_counts(block_m: int, block_k: int, num_warps: int, num_stages: int, block_n: int = 64,
                x_gather: bool = True) -> dict:
    """Compile one config (no split, even K, bf16, inline-PTX decode; ``x_gather``: the activation tile loaded in
    ``_k_order``, else permuted after the load) and count its main loop (module docstring).
    Raises RuntimeError when ptxas or cuobjdump fail or no loop holds an MMA."""
    kern = w12_mma._w12_mma_kernel
    const = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1, FUSED=False, EVEN=True, X_EVEN=True,
                 HAS_BIAS=False, FP32=False, ASM=True, X_GATHER=x_gather)
    const = {k: v for k, v in const.items() if k in kern.arg_names}  # older kernels (FUSED came later) too
    sig = dict(WORD_KERNEL_SIGNATURE) | {k: "constexpr" for k in const}
    attrs = {(kern.arg_names.index(n),): [["tt.divisibility", 16]] for n in WORD_KERNEL_SIGNATURE if n != "M"}
    out = triton.compile(ASTSource(kern, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=num_warps, num_stages=num_stages))
    bindir = ptxas_path().parent
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(out.asm["ptx"])
        p = subprocess.run([str(bindir / "ptxas"), "--gpu-name", "sm_90a", "-v", str(Path(d) / "k.ptx"), "-o",
                            str(Path(d) / "k.cubin")], capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"ptxas failed: {p.stderr[-300:]}")
        regs = int(re.search(r"Used (\d+) registers", p.stdout + p.stderr).group(1))
        sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", str(Path(d) / "k.cubin")], capture_output=True,
                              text=True, check=True).stdout
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), line))
    mma = [a for a, op, _ in ins if op.startswith(("HGMMA", "HMMA"))]
    best = None
    for addr, op, line in ins:
        t = re.search(r"0x([0-9a-f]+)", line.split("BRA")[1]) if op.startswith("BRA") else None
        if t and (tgt := int(t.group(1), 16)) < addr and any(tgt <= a <= addr for a in mma):
            if best is None or addr - tgt > best[1] - best[0]:
                best = (tgt, addr)
    if best is None:
        raise RuntimeError("no loop holds an MMA")
    body = [op for a, op, _ in ins if best[0] <= a <= best[1]]
    hist = collections.Counter(op.split(".")[0] for op in body)
    return {"registers": regs, "loop_instructions": len(body),
            "per_weight_per_thread": len(body) * num_warps * 32 / (block_n * block_k),
            "histogram": dict(hist.most_common())}


def main():
    res = {"commit": git_commit(), "versions": versions(), "arch": "sm_90a", "method": __doc__.strip().splitlines()[0],
           "configs": []}
    for c in CONFIGS:
        row = {**c, **loop_counts(**c)}
        print(json.dumps({k: v for k, v in row.items() if k != "histogram"}), flush=True)
        res["configs"].append(row)
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
