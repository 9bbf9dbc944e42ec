"""Escape slots loaded before the K loop or after it: the default ``w12_gemm`` with ``esc_early`` on and off, beside
cuBLAS bf16, on the Qwen3-8B projections at 1 / 8 / 16 / 32 rows (issue 5).

    python probes/w12_escape_slots_probe.py OUT.json

Why: the escape table's fixed slots (:func:`~specpilot.w12.gemm.escape_table`) let split 0 load a tile's
escape columns and deltas without a dependent load; ``esc_early`` issues those loads before the K loop (their latency
hidden, their registers held through it), off after it (one latency, no registers held). The first A/B of the slots
against the CSR-only kernels (session 17) lost 2–27% on the one-row GEMV and on split-1 gate_up and won 1–6% on the
split-K tensor-core launches; this says which placement each kernel wants. Each output is checked against the
reference before it is timed; timing as in ``probes/w12_bench.py``; weights from a fixed seed (``projection_copies``).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from specpilot.w12.gemm import w12_gemm
from specpilot.provenance import git_commit, versions

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import check, codes, projection_copies, write_result  # noqa: E402

dev = "cuda"


def main(out_path: str) -> dict:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "rows": []}
    for name, n, k, w, t, esc, ts, ws in projection_copies("qwen3-8b", seed=0):
        g = torch.Generator(device=dev).manual_seed(n + 3 * k)
        aw = w.float().abs() + codes(t).abs()
        for m in (1, 8, 16, 32):
            x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
            row = {"proj": name, "rows": m, "cublas_us": time_calls(lambda a, w_: F.linear(a, w_), ws, x)}
            for label, over in (("early", {}), ("late", {"esc_early": False})):
                c = check(w12_gemm(x, t, escapes=esc, **over), x, t, aw)
                row[label] = c | {"us": time_calls(lambda a, te, o=over: w12_gemm(a, te[0], escapes=te[1], **o), ts, x)}
                row[label]["speedup"] = row["cublas_us"] / row[label]["us"]
            res["rows"].append(row)
            print(name, m, f"cublas {row['cublas_us']:.2f} early {row['early']['us']:.2f} late {row['late']['us']:.2f}",
                  "ok" if row["early"]["within_bound"] and row["late"]["within_bound"] else "OUT OF BOUND", flush=True)
        del w, t, esc, aw, ts, ws
        torch.cuda.empty_cache()
    return write_result(res, t0, out_path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python probes/w12_escape_slots_probe.py OUT.json")
    if not torch.cuda.is_available():
        sys.exit("this probe times CUDA kernels: it needs a CUDA GPU")
    main(sys.argv[1])
