"""The tensor-core W12 kernel with fewer split-K programs and deeper cp.async pipelines, 1–32 rows, on the Qwen3-8B
projections, against cuBLAS bf16 (issue 5: qkv / o miss 1.25x at 1–32 rows).

    python probes/w12_deep_pipeline_probe.py OUT.json

Why: ``probes/w12_mma_fixed_cost_probe.py`` (session 16) put the whole 8–32-row miss in a fixed cost of 5.2–7.9 µs a
launch against cuBLAS's 2.6 µs, while the kernel streams a K step 1.3–1.6x faster than cuBLAS. Part of that fixed
cost is the cross-program split-K sum (partial store, release, counter, partial loads) that the default launch
needs to fill the SMs (~2.9 programs an SM, 4 stages each). cuBLAS runs one program an SM with a deep pipeline and
no split on these shapes (session 10's ncu). This sweep asks whether split 1 or 2 with 8–16 stages (the same bytes
in flight an SM, no or one partial a tile) and 4 or 8 warps beats the default; and, at 32 rows, the split-K sum in
the kernel (``fused_split``) against the second launch. Every variant runs the word tensor-core kernel
(``gemv=False``, so one row too); correctness and timing as in ``probes/w12_wide_probe.py`` (:func:`run_probe`).
"""

from __future__ import annotations

import sys

import specpilot.w12.gemm as wg

from w12_wide_probe import run_probe  # noqa: E402  (probes/w12_wide_probe.py)

ROWS = (1, 8, 16, 32)


def variants(m: int, n: int, k: int) -> list[dict]:
    """Launch overrides for ``[m, k] @ W12[n, k]ᵀ``: split 1 / 2 with deep pipelines, the default split with more
    stages, and the default with the split-K sum in the kernel and in a second launch."""
    d = wg.default_config(m, n, k)
    out = [dict(split_k=1, block_k=64, num_stages=s, num_warps=w) for s in (8, 12, 16) for w in (4, 8)]
    out += [dict(split_k=1, block_k=128, num_stages=s, num_warps=8) for s in (6, 8)]
    out += [dict(split_k=2, block_k=64, num_stages=s, num_warps=w) for s in (8, 12) for w in (4, 8)]
    out += [dict(num_stages=s) for s in (8, 12)]
    if d["split_k"] > 1:
        out += [dict(fused_split=True), dict(fused_split=False)]
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python probes/w12_deep_pipeline_probe.py OUT.json")
    import torch

    if not torch.cuda.is_available():
        sys.exit("this probe times CUDA kernels: it needs a CUDA GPU")
    run_probe(sys.argv[1], ROWS, variants, __doc__.strip().splitlines()[0], budget_s=470)
