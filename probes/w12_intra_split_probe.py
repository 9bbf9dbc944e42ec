"""The one-row lines GEMV with K split *inside* a program (several warps a tile, each summing its own records of
every step; the warps' sums meet in ``tl.sum`` over the records axis, through shared memory) against the default
split across programs (partials + an atomic counter + a last-program sum), on the Qwen3-8B projections (issue 5).

    python probes/w12_intra_split_probe.py OUT.json [--narrow]

``--narrow``: instead, one-warp programs with more bytes a step or fewer rows a tile (BLOCK_N 4 / 8 / 16, BLOCK_K 512
/ 1024): BLOCK_N 4 with BLOCK_K 1024 holds the default's warps and bytes a step with no split at all, so it prices
the cross-program split against 4x the x traffic; BLOCK_N 16 with BLOCK_K 512 doubles the bytes in flight a warp.

Why: ``probes/w12_fixed_cost_probe.py`` fitted the default qkv launch (split 4, one-warp programs) as 4.4 µs fixed +
2.45 µs a step, against 2.7 µs fixed at split 1: the cross-program split costs ~1.7 µs of serial epilogue (release
fence, counter, partial loads). A program of ``w`` warps and ``BLOCK_K = 256 w`` gives each warp the same 4 records
a step as the default, with the same warps in flight, and no cross-program epilogue. Every output is checked against
the reference before it is timed; timing as in ``probes/w12_bench.py``; cuBLAS and the default in the same run.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from specpilot.kernels.gemm import _num_sms
from specpilot.w12.gemm import w12_gemm
from specpilot.w12.gemv import gemv_config
from specpilot.provenance import git_commit, versions

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import checked_time, codes, projection_copies, write_result  # noqa: E402

dev = "cuda"


def narrow_configs(k: int) -> list[dict]:
    out = [{}]
    for bn, bk, splits in ((4, 1024, (1, 2)), (4, 512, (1, 2, 4)), (8, 512, (1, 2, 4)), (16, 512, (1, 2, 4)),
                           (8, 1024, (1, 2))):
        out += [dict(gemv=True, lines=True, block_n=bn, block_k=bk, num_warps=1, split_k=s) for s in splits
                if k % (bk * s) == 0]
    return out


def configs(k: int) -> list[dict]:
    out = [{}]
    for nw in (2, 4, 8, 16):
        for bn in (16, 8):
            bk = 256 * nw
            for split in (1, 2, 4):
                if k % (bk * split) == 0:
                    out.append(dict(gemv=True, lines=True, block_n=bn, block_k=bk, num_warps=nw, split_k=split))
    return out


def main(out_path: str, narrow: bool = False) -> dict:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = _num_sms(0)
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "rows": []}
    for name, n, k, w, t, esc, ts, ws in projection_copies("qwen3-8b", seed=4):
        g = torch.Generator(device=dev).manual_seed(n + k)
        aw = w.float().abs() + codes(t).abs()
        x = torch.randn(1, k, generator=g, device=dev).to(torch.bfloat16)
        cub = time_calls(lambda a, w_: F.linear(a, w_), ws, x)
        for v in (narrow_configs(k) if narrow else configs(k)):
            row = {"proj": name, "n": n, "k": k, "config": v or gemv_config(n, k, sms), "default": not v,
                   "cublas_us": cub}
            row |= checked_time(lambda a, t_, e_: w12_gemm(a, t_, escapes=e_, **v), x, t, esc, aw, ts, cub)
            res["rows"].append(row)
            print(f"{name} {v}: {row.get('us', float('nan')):.2f} µs vs cublas {cub:.2f} ({row.get('speedup', 0):.3f}x)"
                  f" {row.get('error', '')}", flush=True)
        del ts, ws
        torch.cuda.empty_cache()
    return write_result(res, t0, out_path)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] not in ([], ["--narrow"]):
        sys.exit("usage: python probes/w12_intra_split_probe.py OUT.json [--narrow]")
    if not torch.cuda.is_available():
        sys.exit("this probe times CUDA kernels: it needs a CUDA GPU")
    main(sys.argv[1], narrow=sys.argv[2:] == ["--narrow"])
