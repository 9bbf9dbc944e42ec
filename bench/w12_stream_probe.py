"""The TMA-streamed one-row W12 GEMV (:mod:`specpilot.kernels.w12_stream`) against the default one-row kernel and
cuBLAS bf16 on the Qwen3-8B projections, side by side in one run (issue 5).

    python bench/w12_stream_probe.py OUT.json [BUDGET_S]

Per projection: cuBLAS, the default ``w12_gemm`` (the line-coalesced GEMV), then the stream kernel over stages
(TMA copies in flight = stages − 1), split K and, with ``persistent`` > 0, that many programs walking the units.
Every output is checked against the reference (rounding bound) and compared bit for bit with the lines kernel at
the same split (the stream kernel sums in the same order) before it is timed; timing as in ``bench/w12_bench.py``
(one CUDA graph, ≥ 512 MiB of weight copies, best of 5 replays).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from specpilot.kernels.gemm import _num_sms
from specpilot.kernels.w12_gemm import w12_gemm
from specpilot.kernels.w12_gemv import gemv_config
from specpilot.kernels.w12_stream import w12_gemv_stream
from specpilot.provenance import git_commit, versions

from timing import time_calls  # noqa: E402  (bench/timing.py)
from w12_bench import bits_equal, check, codes, projection_copies  # noqa: E402

dev = "cuda"


def configs(n: int, k: int, sms: int) -> list[dict]:
    d = gemv_config(n, k, sms)["split_k"]
    blocks = k // 256
    splits = sorted({s for s in (max(1, d // 2), d, 2 * d) if blocks % s == 0})
    out = [dict(stages=st, split_k=s) for st in (2, 3, 4) for s in splits]
    out += [dict(stages=st, split_k=s, block_k=512) for st in (2, 3) for s in sorted({max(1, d // 4), max(1, d // 2)})]
    out += [dict(stages=st, split_k=s, persistent=p * sms) for st in (3, 5) for p in (8, 12, 16) for s in (1, 2, 4)
            if blocks % s == 0]
    return out


def main(out_path: str, budget_s: float) -> dict:
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = _num_sms(0)
    res = {"device": torch.cuda.get_device_name(0), "versions": versions(), "commit": git_commit(), "sms": sms,
           "rows": []}
    for name, n, k, w, t, esc, ts, ws in projection_copies("qwen3-8b", seed=2):
        g = torch.Generator(device=dev).manual_seed(n + k)
        aw = w.float().abs() + codes(t).abs()
        x = torch.randn(1, k, generator=g, device=dev).to(torch.bfloat16)
        cub = time_calls(lambda a, w_: F.linear(a, w_), ws, x)
        default = time_calls(lambda a, tw: w12_gemm(a, tw[0], escapes=tw[1]), ts, x)
        res["rows"].append({"proj": name, "n": n, "k": k, "kernel": "cublas", "us": cub})
        res["rows"].append({"proj": name, "n": n, "k": k, "kernel": "default", "us": default, "cublas_us": cub,
                            "speedup": cub / default, "config": gemv_config(n, k, sms)})
        print(f"{name}: cublas {cub:.2f} default {default:.2f} µs ({cub / default:.3f}x)", flush=True)
        for v in configs(n, k, sms):
            if time.time() - t0 > budget_s:
                res["stopped"] = f"budget {budget_s} s"
                break
            row = {"proj": name, "n": n, "k": k, "kernel": "stream", "config": v, "cublas_us": cub}
            try:
                out = w12_gemv_stream(x, t, None, esc, **v)
                lines = w12_gemm(x, t, escapes=esc, lines=True, split_k=v["split_k"], block_k=v.get("block_k", 256))
                row |= check(out, x, t, aw) | {"bits_equal_lines": bits_equal(out, lines)}
                if row["within_bound"]:
                    us = time_calls(lambda a, tw: w12_gemv_stream(a, tw[0], None, tw[1], **v), ts, x)
                    row |= {"us": us, "speedup": cub / us, "vs_default": default / us}
            except Exception as e:  # a config the compiler or the hardware refuses: record it, go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res["rows"].append(row)
            print(f"  {v}: {row.get('us', float('nan')):.2f} µs {row.get('speedup', 0):.3f}x "
                  f"bits={row.get('bits_equal_lines')} {row.get('error', '')}", flush=True)
        del ts, ws
        torch.cuda.empty_cache()
    res["elapsed_s"] = time.time() - t0
    best = {}
    for r in res["rows"]:
        if r["kernel"] == "stream" and "us" in r and r["us"] < best.get(r["proj"], {"us": 1e9})["us"]:
            best[r["proj"]] = r
    res["best"] = {p: {"config": r["config"], "us": r["us"], "speedup": r["speedup"]} for p, r in best.items()}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["best"], indent=1))
    return res


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python bench/w12_stream_probe.py OUT.json [BUDGET_S]")
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) == 3 else 400.0)
