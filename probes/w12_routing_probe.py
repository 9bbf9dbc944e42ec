"""Three open W12 questions of issue 5, side by side in one run on the GPU:

    python probes/w12_routing_probe.py OUT.json [BUDGET_S]

Written as ``probes/w12_double_probe.py`` (its results keep that name).

1. ``double``: the one-row lines GEMV with a register double buffer (the next step's words and x loaded before
   this step is summed) against the plain lines kernel, over split K, on the Qwen3-8B projections. It lost on every
   shape (254 registers a thread; qkv 15.5–17.4 µs against 14.3, ``results/w12_double_probe_h200_2026-12-01_
   session13.json``) and the override was removed after 7281a1f, where this part ran; the script now times 2 and 3.
2. One-row routing: the tensor-core kernel (``gemv=False``) against the lines GEMV on every Qwen3-8B and Qwen3-32B
   projection (``one_row_gemv`` sent 8B down and 32B qkv / o / down to the tensor cores from session 8's figures,
   before the lines kernel existed; this run moved 8B down to the GEMV).
3. 2, 4 and 8 rows: the FMA GEMV (``gemv=True``, never timed on a GPU before) against the default tensor-core
   kernel and cuBLAS on the Qwen3-8B projections.

Every output is checked against the reference (rounding bound) before it is timed; timing as in
``probes/w12_bench.py`` (one CUDA graph, ≥ 512 MiB of weight copies, best of 5 replays), cuBLAS in the same run.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from specpilot.kernels.gemm import _num_sms
from specpilot.w12.gemm import w12_gemm
from specpilot.provenance import git_commit, versions

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import budget_cli, checked_time, codes, projection_copies, write_result  # noqa: E402

dev = "cuda"


def one_row() -> list[dict]:
    return [{}, {"gemv": False}, {"gemv": True, "lines": True}]


def few_rows(m: int) -> list[dict]:
    return [{}, {"gemv": True}, {"gemv": True, "split_k": 2}, {"gemv": True, "split_k": 4}, {"gemv": True, "split_k": 8}]


def main(out_path: str, budget_s: float) -> dict:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = _num_sms(0)
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "sms": sms,
           "rows": []}
    for prefix in ("qwen3-8b", "qwen3-32b"):
        for name, n, k, w, t, esc, ts, ws in projection_copies(prefix, seed=3):
            g = torch.Generator(device=dev).manual_seed(n + k)
            aw = w.float().abs() + codes(t).abs()
            for m in ((1, 2, 4, 8) if prefix == "qwen3-8b" else (1,)):
                x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
                cub = time_calls(lambda a, w_: F.linear(a, w_), ws, x)
                for v in (one_row() if m == 1 else few_rows(m)):
                    if time.time() - t0 > budget_s:
                        res["stopped"] = f"budget {budget_s} s"
                        break
                    row = {"proj": name, "n": n, "k": k, "rows": m, "config": v, "cublas_us": cub}
                    row |= checked_time(lambda a, t_, e_: w12_gemm(a, t_, escapes=e_, **v), x, t, esc, aw, ts, cub)
                    res["rows"].append(row)
                    print(f"{name} m={m} {v}: {row.get('us', float('nan')):.2f} µs vs cublas {cub:.2f} "
                          f"({row.get('speedup', 0):.3f}x) {row.get('error', '')}",
                          flush=True)
            del ts, ws
            torch.cuda.empty_cache()
    return write_result(res, t0, out_path)


if __name__ == "__main__":
    main(*budget_cli(sys.argv, "w12_routing_probe.py", 400.0))
