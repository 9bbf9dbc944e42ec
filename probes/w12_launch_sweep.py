"""Launch shapes of the W12 kernels again, after the record addresses became affine in the row (issue 5).

    python probes/w12_launch_sweep.py OUT.json [BUDGET_S] [--lines]

``--lines``: 1 row only, the GEMV's default against the line-coalesced one-row kernel (``lines=True``,
:func:`~specpilot.w12.gemv._w12_gemv_lines_kernel`) at every launch shape of the 1-row list.

Session 12 moved the per-row record offsets to one base register plus immediates (the one-row GEMV went from
167 to 48 registers a thread, the tensor-core kernel at 16 rows from 115 to 80; offline ptxas). That changes how
many programs fit an SM, so the launch shapes tuned at 167 registers are timed again: at 1 row the GEMV over
block_n / block_k / warps / split (more, shorter programs keep the load stream going: ``probes/w12_access_probe.py``
found the GEMV's own loads, with no arithmetic, 1.3-1.5x slower than a plain read on qkv / o / down), at 8 / 16 / 32
rows the tensor-core kernel one factor at a time around :func:`~specpilot.w12.gemm.default_config`.
Every config's output is checked against the reference before it is timed (one CUDA graph, ≥ 512 MiB of weight
copies); cuBLAS is timed in the same run. The table at the end gives the best config per (shape, rows).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from specpilot.w12.gemm import default_config, w12_gemm
from specpilot.provenance import git_commit, versions

from timing import time_calls  # noqa: E402  (probes/timing.py)
from w12_bench import check, codes, projection_copies  # noqa: E402

dev = "cuda"


def gemv_configs(k: int) -> list[dict]:
    out = [{"gemv": True}]
    for bn, bk, nw in ((16, 256, 1), (16, 512, 2), (8, 512, 1), (16, 256, 2), (16, 512, 4), (8, 256, 1), (8, 1024, 2)):
        blocks = k // bk
        for split in (1, 2, 4, 8, 16):
            if blocks % split == 0:
                out.append({"gemv": True, "block_n": bn, "block_k": bk, "num_warps": nw, "split_k": split})
    return out


def mma_configs(m: int, n: int, k: int) -> list[dict]:
    base = {"gemv": False}
    d = default_config(m, n, k)
    out = [base]
    for s in (1, 2, 4, 8, 16):
        if s != d["split_k"] and (k // 64) % s == 0 and k // 64 // s >= 2:
            out.append(base | {"split_k": s})
    out += [base | v for v in ({"block_n": 32}, {"block_n": 128, "num_warps": 8}, {"num_warps": 8}, {"num_stages": 2},
                               {"num_stages": 3}, {"num_stages": 6}, {"block_k": 128}, {"fused_split": m > 16},
                               {"block_n": 128, "num_warps": 8, "split_k": 2 * d["split_k"]})]
    if m <= 8:
        out += [{"gemv": True}, {"gemv": True, "split_k": 8}]
    return out


def main(out_path: str, budget_s: float, lines: bool = False) -> dict:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "rows": []}
    for name, n, k, w, t, esc, ts, ws in projection_copies("qwen3-8b", seed=1):
        g = torch.Generator(device=dev).manual_seed(n + k)
        aw = w.float().abs() + codes(t).abs()
        for m in ((1,) if lines else (1, 8, 16, 32)):
            x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
            cub = time_calls(lambda a, w_: F.linear(a, w_), ws, x)
            configs = gemv_configs(k) if m == 1 else mma_configs(m, n, k)
            if lines:
                configs = [{"gemv": True}, {"gemv": True, "lines": True}] + [c | {"lines": True} for c in configs[1:]]
            for v in configs:
                if time.time() - t0 > budget_s:
                    res["stopped"] = f"budget {budget_s} s"
                    break
                row = {"proj": name, "rows": m, "config": v, "cublas_us": cub}
                try:
                    row |= check(w12_gemm(x, t, escapes=esc, **v), x, t, aw)
                    row["us"] = time_calls(lambda a, te, v=v: w12_gemm(a, te[0], escapes=te[1], **v), ts, x, reps=4)
                    row["speedup"] = cub / row["us"]
                except Exception as exc:  # an invalid shape for this config
                    row["error"] = str(exc).splitlines()[0][:160]
                res["rows"].append(row)
            ok = [r for r in res["rows"] if r["proj"] == name and r["rows"] == m and r.get("within_bound")]
            if ok:
                best = min(ok, key=lambda r: r["us"])
                print(f"{name:18s} {m:2d} rows: cuBLAS {cub:6.2f}  default {ok[0]['us']:6.2f} (x{ok[0]['speedup']:.3f})"
                      f"  best {best['us']:6.2f} (x{best['speedup']:.3f}) {json.dumps(best['config'])}", flush=True)
            bad = [r for r in res["rows"] if r["proj"] == name and r["rows"] == m and "us" in r and not r["within_bound"]]
            if bad:
                print("OUT OF BOUND", [r["config"] for r in bad], flush=True)
            res["runtime_s"] = time.time() - t0
            json.dump(res, open(out_path, "w"), indent=1)
        del w, t, esc, aw, ts, ws
        torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--lines"]
    if len(args) not in (1, 2):
        sys.exit("usage: python probes/w12_launch_sweep.py OUT.json [BUDGET_S] [--lines]")
    main(args[0], float(args[1]) if len(args) == 2 else 300.0, "--lines" in sys.argv[1:])
