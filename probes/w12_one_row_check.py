"""W12 at one row on the Qwen3-32B shapes (issue 5): the GEMV's default launch (BLOCK_K now always divides
the padded K), the previous BLOCK_K 2048 on the down projection (K = 25600, a ragged last block), and the
tensor-core kernel, against cuBLAS bf16; each checked against ``F.linear`` before it is timed.

    python probes/w12_one_row_check.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

import specpilot.w12.gemm as wg
from specpilot.w12.gemv import gemv_config
from specpilot.provenance import git_commit, versions

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import projection_copies  # noqa: E402
from w12_wide_probe import rel_err  # noqa: E402

VARIANTS = {"gemv_default": dict(), "gemv_block_k_2048": dict(gemv=True, block_k=2048, num_warps=8),
            "tensor_cores_default": dict(gemv=False)}


def main():
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(),
           "method": __doc__.strip().splitlines()[0], "rows": []}
    for name, n, k, w, t, esc, ts, ws in projection_copies("qwen3-32b"):
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, w)
        row = {"proj": name, "gemv_config": gemv_config(n, k),
               "cublas_us": time_calls(lambda a, w_: F.linear(a, w_), ws, x, reps=4)}
        for label, v in VARIANTS.items():
            row[label + "_rel_err"] = rel_err(wg.w12_gemm(x, t, escapes=esc, **v), ref)
            row[label + "_us"] = time_calls(lambda a, te, v=v: wg.w12_gemm(a, te[0], escapes=te[1], **v), ts, x, reps=4)
            row[label + "_vs_cublas"] = row["cublas_us"] / row[label + "_us"]
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    res["runtime_s"] = time.time() - t0
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
