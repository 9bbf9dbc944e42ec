"""W12 tensor-core kernel launch sweep at 1–128 rows on the Qwen3-8B projections (issue 5): BLOCK_K 64 / 128,
2–6 pipeline stages, split K at half / once / twice the default (each with the default ``fused_split``), and the
default launch with ``fused_split`` on and off (split-K sum in the kernel or in a second one), against cuBLAS
bf16, the dense path and the current default dispatch.

    python probes/w12_mma_sweep.py OUT.json

Why: session 8's kernel (bf16 decode, K permuted so the decoded tile feeds wgmma from registers) changed the
cost balance; in its first run ``block_k`` 64 beat the default 128 by 1.31x on gate_up at 32 rows
(``w12_bench_h200_2026-12-01_session8.json``). Correctness and timing as in ``probes/w12_wide_probe.py``.
"""

from __future__ import annotations

import itertools
import sys

import specpilot.w12.gemm as wg

from w12_wide_probe import run_probe  # noqa: E402  (probes/w12_wide_probe.py)

ROWS = (1, 8, 16, 32, 64, 128)


def variants(m: int, n: int, k: int) -> list[dict]:
    """Launch overrides around :func:`~specpilot.w12.gemm.default_config` for ``[m, k] @ [n, k]ᵀ``."""
    d = wg.default_config(m, n, k)
    splits = sorted({max(1, d["split_k"] // 2), d["split_k"], d["split_k"] * 2})
    grid = [dict(block_k=bk, num_stages=ns, split_k=sp) for bk, ns, sp in itertools.product((64, 128), (2, 3, 4, 6), splits)]
    # the default launch with the split-K sum in the kernel and with the second kernel (the default is fused up to
    # FUSED_SPLIT_MAX_ROWS rows, so one of the two is the default itself)
    return grid + [dict(fused_split=True), dict(fused_split=False)]


if __name__ == "__main__":
    run_probe(sys.argv[1], ROWS, variants, __doc__.strip().splitlines()[0], budget_s=400)
