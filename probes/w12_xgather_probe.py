"""The tensor-core W12 kernel's activation load, old against new, side by side in one run on the GPU (issue 5):

    python probes/w12_xgather_probe.py OUT.json [BUDGET_S]

``_mma_step`` permutes K on both operands so the decoded weight words are the ``wgmma`` register fragment
(``_k_order``). Until this probe the activation tile was loaded in column order (``cp.async`` into shared memory),
read into registers, permuted, stored back to shared memory and fenced before each step's MMAs
(``x_gather=False``; offline TTGIR: ``local_load`` → reshape/trans → ``local_alloc`` → ``fence_async_shared``, and
one ``warp_group_dot_wait(0)`` a step). ``x_gather=True`` loads the columns already permuted
(``_k_columns``: 4-byte pieces), so the ``cp.async`` buffer feeds ``wgmma`` directly. Per Qwen3-8B projection at
2–128 rows: cuBLAS, both loads, and (from 32 rows, where the default sums split K in a second kernel) both with
``fused_split=True``. Every output is checked against the reference (rounding bound) before it is timed; timing
as in ``probes/w12_bench.py`` (one CUDA graph, ≥ 512 MiB of weight copies, best of 5 replays).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from specpilot.w12.gemm import w12_gemm
from specpilot.provenance import git_commit, versions

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import budget_cli, checked_time, codes, projection_copies, write_result  # noqa: E402

dev = "cuda"
ROWS = (2, 8, 16, 32, 33, 64, 128)


def variants(m: int) -> list[dict]:
    out = [{"x_gather": False}, {"x_gather": True}]
    if m >= 32:
        out += [{"x_gather": False, "fused_split": True}, {"x_gather": True, "fused_split": True}]
    return out


def main(out_path: str, budget_s: float) -> dict:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "rows": []}
    for name, n, k, w, t, esc, ts, ws in projection_copies("qwen3-8b", seed=3):
        g = torch.Generator(device=dev).manual_seed(n + k)
        aw = w.float().abs() + codes(t).abs()
        for m in ROWS:
            x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
            cub = time_calls(lambda a, w_: F.linear(a, w_), ws, x)
            for v in variants(m):
                if time.time() - t0 > budget_s:
                    res["stopped"] = f"budget {budget_s} s"
                    return write_result(res, t0, out_path)
                row = {"proj": name, "n": n, "k": k, "rows": m, "config": v, "cublas_us": cub}
                row |= checked_time(lambda a, t_, e_: w12_gemm(a, t_, escapes=e_, gemv=False, **v), x, t, esc, aw,
                                    ts, cub)
                res["rows"].append(row)
                print(f"{name} m={m} {v}: {row.get('us', float('nan')):.2f} µs vs cublas {cub:.2f} "
                      f"({row.get('speedup', 0):.3f}x) {row.get('error', '')}", flush=True)
        del ts, ws
        torch.cuda.empty_cache()
    return write_result(res, t0, out_path)


if __name__ == "__main__":
    main(*budget_cli(sys.argv, "w12_xgather_probe.py", 150.0))
